"""Snapshots: atomic writes, validation on read, rotation, fallback, and kills in the middle of a save."""
from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from app.cluster.distributed import World
from app.core.config import Config, resolve
from app.core.errors import UserError
from app.core.errors import warning
from app.training import snapshot
from app.training.snapshot import (CLAIM_PREFIX, Snapshots, SnapshotInvalid, complete_snapshots, read_snapshot,
                                   write_snapshot)
from tests.helpers import REPO, clean_env, snapshot_steps

pytestmark = pytest.mark.unit

SOLO = World(rank=0, local_rank=0, size=1, local_size=1, device=torch.device("cpu"), restart_count=0)


def make_parts(step: int, size: int = 1000) -> snapshot.State:
    g = torch.Generator().manual_seed(step)
    return {
        "model": {"conv.weight": torch.randn(size, generator=g), "bn.num_batches_tracked": torch.tensor(step)},
        "optimizer": {"state": {0: {"momentum_buffer": torch.randn(10, generator=g)}},
                      "param_groups": [{"lr": 0.1, "params": [0]}]},
        "scheduler": {"progress": step / 10},
        "scaler": {},
        "train_state": {"step": step, "epoch": 0, "consumed": 16 * step, "rng": {"python": [1, 2, 3]},
                        "config": {"model": "tiny"}},
    }


def assert_parts_equal(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_parts_equal(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_parts_equal(x, y)
    else:
        assert a == b


class Lines(list):
    """What a Reporter would show, in order; warnings as they read on stderr, also kept apart."""

    def __init__(self) -> None:
        super().__init__()
        self.warnings: list[str] = []

    def say(self, line: str) -> None:
        self.append(line)

    def warn(self, line: str) -> None:
        self.append(warning(line))
        self.warnings.append(warning(line))


def snapshots(directory: Path, keep: int = 3, job: str | None = None, **settings) -> tuple[Snapshots, Lines]:
    """job: the launcher's name for the job (World.job); None: a plain process."""
    said = Lines()
    cfg = resolve(Config(snapshot_dir=directory, keep=keep, **settings), "digits")     # a CPU job's defaults
    return Snapshots(cfg, dataclasses.replace(SOLO, job=job), said.say, said.warn), said


def corrupt(path: Path, how: str) -> None:
    if how == "flip":
        payload = bytearray(path.read_bytes())
        payload[len(payload) // 2] ^= 0xFF
        path.write_bytes(bytes(payload))
    elif how == "truncate":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "delete":
        path.unlink()
    else:
        raise ValueError(how)


# ---------------------------------------------------------------- write / read

def test_round_trip(tmp_path):
    parts = make_parts(7)
    final = write_snapshot(tmp_path, 7, parts)
    assert final == tmp_path / "step-00000007"
    assert sorted(p.name for p in final.iterdir()) == sorted([f"{n}.safetensors" for n in snapshot.PARTS] + ["manifest.json"])
    manifest = json.loads((final / "manifest.json").read_text())
    assert manifest["step"] == 7 and set(manifest["parts"]) == set(snapshot.PARTS)
    for name in snapshot.PARTS:
        assert manifest["parts"][name]["bytes"] == (final / f"{name}.safetensors").stat().st_size
    assert_parts_equal(read_snapshot(final), parts)
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000007"]      # no temporary folder left


def test_writing_an_existing_step_keeps_the_first(tmp_path):
    write_snapshot(tmp_path, 3, make_parts(3))
    write_snapshot(tmp_path, 3, make_parts(99))
    assert read_snapshot(tmp_path / "step-00000003")["train_state"]["step"] == 3


def test_complete_snapshots_newest_first_ignoring_everything_else(tmp_path):
    for step in (2, 10, 9):
        write_snapshot(tmp_path, step, make_parts(step))
    (tmp_path / ".tmp-step-00000011-123").mkdir()
    (tmp_path / "step-notanumber").mkdir()
    (tmp_path / "step-\u00b2").mkdir()        # a digit to str.isdigit, not to int(): read at every start
    (tmp_path / "step-00000012").write_text("a file, not a snapshot")
    (tmp_path / "archive-20250101-000000").mkdir()
    assert [p.name for p in complete_snapshots(tmp_path)] == ["step-00000010", "step-00000009", "step-00000002"]


@pytest.mark.parametrize("how", ["flip", "truncate", "empty", "delete"])
@pytest.mark.parametrize("part", ["model.safetensors", "train_state.safetensors", "manifest.json"])
def test_damaged_snapshot_is_invalid(tmp_path, part, how):
    final = write_snapshot(tmp_path, 1, make_parts(1))
    corrupt(final / part, how)
    with pytest.raises(SnapshotInvalid):
        read_snapshot(final)


# A pickle that runs code when it is unpickled: it creates the file named in it.
class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _swap_part(snapshot_path: Path, part_file: str, payload: bytes) -> None:
    """Replace one part and make the manifest agree with it, as an attacker who writes the folder would."""
    import hashlib
    (snapshot_path / part_file).write_bytes(payload)
    manifest = json.loads((snapshot_path / "manifest.json").read_text())
    manifest["parts"][part_file.split(".")[0]] = {"bytes": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}
    (snapshot_path / "manifest.json").write_text(json.dumps(manifest))


def _legacy_snapshot(directory: Path, step: int, parts) -> Path:
    """A snapshot as the code before the saver wrote it: torch.save parts and a manifest without a format."""
    import hashlib
    import io
    final = directory / f"step-{step:08d}"
    final.mkdir(parents=True)
    manifest = {"step": step, "parts": {}}
    for name in snapshot.PARTS:
        buf = io.BytesIO()
        torch.save(parts[name], buf)
        (final / f"{name}.pt").write_bytes(buf.getvalue())
        manifest["parts"][name] = {"bytes": len(buf.getvalue()), "sha256": hashlib.sha256(buf.getvalue()).hexdigest()}
    (final / "manifest.json").write_text(json.dumps(manifest))
    return final


@pytest.mark.parametrize("part", ["model.safetensors", "optimizer.safetensors", "train_state.safetensors"])
def test_no_file_of_a_snapshot_runs_code_when_it_is_loaded(tmp_path, part):
    """A part replaced by a pickle that would run code, its manifest made to match: refused, and nothing ran."""
    import pickle
    final = write_snapshot(tmp_path, 1, make_parts(1))
    marker = tmp_path / "ran"
    _swap_part(final, part, pickle.dumps(_Payload(marker)))
    with pytest.raises(SnapshotInvalid):
        read_snapshot(final)
    assert not marker.exists()


def test_snapshots_written_before_the_saver_still_load_and_run_nothing(tmp_path):
    """The .pt parts of earlier snapshots load as before (weights_only); a malicious one is refused."""
    assert_parts_equal(read_snapshot(_legacy_snapshot(tmp_path, 1, make_parts(1))), make_parts(1))
    import pickle
    bad = _legacy_snapshot(tmp_path, 2, make_parts(2))
    marker = tmp_path / "ran"
    _swap_part(bad, "scheduler.pt", pickle.dumps(_Payload(marker), protocol=2))   # torch.save's own protocol
    with pytest.raises(SnapshotInvalid):
        read_snapshot(bad)
    assert not marker.exists()


def test_a_state_holds_only_tensors_and_json_values(tmp_path):
    parts = make_parts(1)
    parts["scheduler"] = {"obj": Path("/etc")}
    with pytest.raises(TypeError, match="scheduler:obj is a PosixPath"):
        write_snapshot(tmp_path, 1, parts)


def test_tuples_and_integer_keys_come_back_as_they_were(tmp_path):
    """JSON alone would turn the optimizer's parameter indices into strings (load_state_dict then
    silently drops the momentum) and tuples into lists."""
    parts = make_parts(1)
    parts["optimizer"]["state"][3] = {"step": torch.tensor(2.0), "betas": (0.9, 0.99)}
    parts["scheduler"] = {"$odd": 1, "nan": float("nan") != float("nan"), "inf": float("inf")}
    back = read_snapshot(write_snapshot(tmp_path, 1, parts))
    assert list(back["optimizer"]["state"]) == [0, 3] and back["optimizer"]["state"][3]["betas"] == (0.9, 0.99)
    assert back["scheduler"] == parts["scheduler"]


# ---------------------------------------------------------------- Snapshots

def test_background_saves_and_keep_rotation(tmp_path):
    ckpt, said = snapshots(tmp_path, keep=2)
    for step in range(1, 6):
        ckpt.save(step, make_parts(step))        # background thread; the next save waits for it
    ckpt.wait()
    ckpt.raise_if_failed()
    assert snapshot_steps(tmp_path) == [4, 5]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000004", "step-00000005"]
    assert_parts_equal(read_snapshot(tmp_path / "step-00000005"), make_parts(5))
    assert said == []


def test_save_copies_the_state_before_returning(tmp_path):
    ckpt, _ = snapshots(tmp_path)
    parts = make_parts(1)
    expected = parts["model"]["conv.weight"].clone()
    ckpt.save(1, parts)
    parts["model"]["conv.weight"].add_(1.0)      # training goes on while the saver writes
    ckpt.wait()
    assert torch.equal(read_snapshot(tmp_path / "step-00000001")["model"]["conv.weight"], expected)


@pytest.mark.parametrize("sizes", [(1000, 5000), (5000, 1000)], ids=["larger", "smaller"])
def test_a_state_of_a_new_layout_is_written_from_its_own_arena(tmp_path, sizes):
    """A new layout (the optimizer's first state, a resized model) takes a new arena, and the saver must
    map it: the saver was told of a new arena by its fd number, which the closed old arena's number
    is, so it wrote the new state's offsets out of the old memory (a larger state: an unreadable
    snapshot; a smaller one: the old values in a valid snapshot)."""
    ckpt, said = snapshots(tmp_path)
    first, second = sizes
    ckpt.save(1, make_parts(1, size=first))
    ckpt.save(2, make_parts(2, size=second))
    ckpt.close()
    assert_parts_equal(read_snapshot(tmp_path / "step-00000002"), make_parts(2, size=second))
    assert said == []


def many_tensors(count: int, step: int) -> snapshot.State:
    """A state of `count` small tensors of mixed dtypes, with Adam-like per-parameter state."""
    g = torch.Generator().manual_seed(step)
    weights = {f"layer{i}.weight": torch.randn(3 + i % 5, generator=g) for i in range(count // 2)}
    moments = {i: {"exp_avg": torch.randn(2, generator=g), "step": torch.tensor(float(step))}
               for i in range(count // 4)}
    return {"model": weights, "optimizer": {"state": moments, "param_groups": [{"lr": 1e-3, "params": list(moments)}]},
            "scheduler": {}, "scaler": {}, "train_state": {"step": step}}


def test_a_state_of_twenty_thousand_tensors_goes_through_the_saver_and_back_bit_for_bit(tmp_path):
    """The saver once learnt the layout from one socket message, capped by the socket's send buffer (about
    200 KB): a state of a couple of thousand tensors (ResNet-152 with AdamW) never wrote a snapshot."""
    ckpt, said = snapshots(tmp_path)
    for step in (1, 2):        # the second save reuses the arena the first one sent
        ckpt.save(step, many_tensors(20_000, step))
    ckpt.close()
    ckpt.raise_if_failed()
    assert said == [] and snapshot_steps(tmp_path) == [1, 2]
    assert_parts_equal(read_snapshot(tmp_path / "step-00000002"), many_tensors(20_000, 2))


def test_the_snapshot_size_bench_measures_each_state_and_checks_it_bit_for_bit(tmp_path):
    from bench import snapshot_size

    out = tmp_path / "out.json"
    assert snapshot_size.main(["--states", "tensors:100,bytes:1MB", "--repeats", "2", "--dir", str(tmp_path),
                               "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["states"]
    assert [(r["state"], r["tensors"], r["bytes"], len(r["write_s"]), r["bit_for_bit"]) for r in rows] == [
        ("tensors:100", 100, 100 * 16 * 4, 2, True), ("bytes:1MB", 1, 1 << 20, 2, True)]


def test_an_arena_prepared_ahead_is_the_one_the_first_save_fills(tmp_path):
    """Making the arena (its pages, pinning on CUDA) is start-up work, not part of the first save's stall."""
    ckpt, _ = snapshots(tmp_path)
    ckpt.prepare(make_parts(0))
    prepared = ckpt._arena
    ckpt.save(1, make_parts(1))
    ckpt.close()
    assert ckpt._arena is prepared
    assert_parts_equal(read_snapshot(tmp_path / "step-00000001"), make_parts(1))


def test_restore_newest(tmp_path):
    ckpt, said = snapshots(tmp_path, keep=5)
    for step in (1, 2, 3):
        ckpt.save(step, make_parts(step), background=False)
    state = snapshots(tmp_path)[0].restore(mode=None, fresh_start_allowed=True)
    assert_parts_equal(state, make_parts(3))


@pytest.mark.parametrize("how", ["flip", "truncate", "empty", "delete"])
def test_corrupt_newest_falls_back_to_previous_with_a_warning(tmp_path, how):
    for step in (1, 2, 3):
        write_snapshot(tmp_path, step, make_parts(step))
    corrupt(tmp_path / "step-00000003" / "model.safetensors", how)
    ckpt, said = snapshots(tmp_path)
    state = ckpt.restore(mode=True, fresh_start_allowed=True)
    assert state["train_state"]["step"] == 2
    assert_parts_equal(state, make_parts(2))
    assert said[0].startswith(f"warning: snapshot {tmp_path / 'step-00000003'} is unusable (")
    assert said[0].endswith("; set aside as unusable-step-00000003; trying the previous one")
    assert said[1] == f"resuming from {tmp_path / 'step-00000002'}"
    assert len(said) == 2 and said.warnings == said[:1]        # the warning on stderr, the rest on stdout
    # Kept for a look, out of rotation: the job's next save of step 3 is a fresh, valid one.
    assert (tmp_path / "unusable-step-00000003" / "manifest.json").exists()
    ckpt.save(3, make_parts(3), background=False)
    assert_parts_equal(read_snapshot(tmp_path / "step-00000003"), make_parts(3))


def test_a_second_unusable_snapshot_of_a_step_is_set_aside_beside_the_first(tmp_path):
    """unusable-step-N is taken (an earlier start set aside a bad step N): the new bad step N must still
    leave the rotation, under a name of its own, or every start would read it again."""
    earlier = tmp_path / "unusable-step-00000003"
    earlier.mkdir()
    (earlier / "model.pt").write_bytes(b"the first bad copy")
    for step in (2, 3):
        write_snapshot(tmp_path, step, make_parts(step))
    corrupt(tmp_path / "step-00000003" / "model.safetensors", "truncate")
    ckpt, said = snapshots(tmp_path)
    assert ckpt.restore(mode=None, fresh_start_allowed=True)["train_state"]["step"] == 2
    beside = [p.name for p in tmp_path.glob("unusable-step-00000003-*")]
    assert len(beside) == 1 and (tmp_path / beside[0] / "manifest.json").exists()
    assert (earlier / "model.pt").read_bytes() == b"the first bad copy"
    assert not (tmp_path / "step-00000003").exists()
    assert [line for line in said if " is unusable " in line] == [said[0]] and f"set aside as {beside[0]};" in said[0]


def test_several_bad_snapshots_fall_back_one_line_each(tmp_path):
    for step in (1, 2, 3):
        write_snapshot(tmp_path, step, make_parts(step))
    corrupt(tmp_path / "step-00000003" / "optimizer.safetensors", "truncate")
    corrupt(tmp_path / "step-00000002" / "manifest.json", "delete")
    ckpt, said = snapshots(tmp_path)
    assert ckpt.restore(mode=None, fresh_start_allowed=True)["train_state"]["step"] == 1
    assert [line.split(" is unusable")[0] for line in said[:2]] == [
        f"warning: snapshot {tmp_path / 'step-00000003'}", f"warning: snapshot {tmp_path / 'step-00000002'}"]
    assert said[2] == f"resuming from {tmp_path / 'step-00000001'}"


def test_all_snapshots_bad(tmp_path):
    write_snapshot(tmp_path, 1, make_parts(1))
    corrupt(tmp_path / "step-00000001" / "scaler.safetensors", "flip")
    ckpt, said = snapshots(tmp_path)
    assert ckpt.restore(mode=None, fresh_start_allowed=True) is None          # auto: start fresh
    assert said[-1] == f"no snapshot in {tmp_path} or on any other node: starting fresh"
    with pytest.raises(UserError, match=r"--resume given but no valid snapshot in"):
        snapshots(tmp_path)[0].restore(mode=True, fresh_start_allowed=True)


def test_a_fresh_start_that_loses_steps_is_a_warning_and_a_first_start_is_not(tmp_path):
    ckpt, said = snapshots(tmp_path)
    assert ckpt.restore(mode=None, fresh_start_allowed=True, trained_to=40) is None
    assert said == said.warnings == ["warning: no valid snapshot on any node, but this job has trained before "
                                     "(to step 40): starting again from step 0, 40 steps lost"]
    ckpt, said = snapshots(tmp_path / "new")
    assert ckpt.restore(mode=None, fresh_start_allowed=True) is None
    assert said == [f"no snapshot in {tmp_path / 'new'} or on any other node: starting fresh"] and not said.warnings


def test_stale_temporary_folders_are_removed(tmp_path):
    write_snapshot(tmp_path, 4, make_parts(4))
    stale = [tmp_path / ".tmp-step-00000005-4242", tmp_path / ".tmp-step-step-00000001-deleting"]
    for d in stale:
        d.mkdir()
        (d / "model.pt").write_bytes(b"half a file")
    ckpt, said = snapshots(tmp_path)
    assert ckpt.restore(mode=None, fresh_start_allowed=True)["train_state"]["step"] == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == [snapshot.DIRECTORY_ID, "step-00000004"]


def test_a_clean_up_while_a_write_locks_its_folder_costs_the_write_nothing(tmp_path, monkeypatch):
    """Another process's clean-up (remove_stale) between the writer's mkdir and its lock removed the
    folder the writer then wrote into: the write failed, or, with the clean-up's rmtree still running,
    parts already closed were deleted and the folder renamed to its final name without them."""
    import fcntl

    from app.training import snapshot_files

    real_flock, interrupted = fcntl.flock, []

    def flock(fd: int, how: int) -> None:
        if how == fcntl.LOCK_EX and not interrupted:       # the writer's lock: a clean-up comes first
            interrupted.append(True)
            snapshot_files.remove_stale(tmp_path)
        real_flock(fd, how)

    monkeypatch.setattr(fcntl, "flock", flock)
    write_snapshot(tmp_path, 3, make_parts(3))
    assert interrupted and [p.name for p in tmp_path.iterdir()] == ["step-00000003"]
    assert_parts_equal(read_snapshot(tmp_path / "step-00000003"), make_parts(3))


def test_a_clean_up_holds_its_lock_until_the_folder_is_gone(tmp_path, monkeypatch):
    """A clean-up that let go of its lock before rmtree left a gap in which a writer could lock the folder
    and write parts that rmtree then deleted."""
    import fcntl

    from app.training import snapshot_files

    stale = tmp_path / ".tmp-step-00000005-4242"
    stale.mkdir()
    real_rmtree, locked_during = shutil.rmtree, []

    def rmtree(path, *args, **kwargs):
        fd = os.open(path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            locked_during.append(False)
        except BlockingIOError:
            locked_during.append(True)
        finally:
            os.close(fd)
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(snapshot_files.shutil, "rmtree", rmtree)
    snapshot_files.remove_stale(tmp_path)
    assert locked_during == [True] and not stale.exists()


class CleanUpAt:
    """Another process's clean-up (remove_stale of every temporary prefix: a start's, a saver's, a download's)
    run just before the k-th filesystem call (mkdir, open, flock, rename, link, fsync, close, unlink, rmdir)
    that a sequence makes; k=None counts the calls instead. Its own calls pass through, and its locks are
    its own open files, which flock sets against the sequence's as it would another process's."""

    CALLS = [(os, "mkdir"), (os, "open"), ("fcntl", "flock"), (os, "rename"), (os, "link"), (os, "fsync"),
             (os, "close"), (os, "unlink"), (os, "rmdir")]

    def __init__(self, directory: Path, k: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
        import fcntl

        from app.training import snapshot_files
        from app.training.object_store import DOWNLOAD_PREFIX

        self.calls, self.busy, self.done = 0, False, False
        prefixes = (snapshot_files.TMP_PREFIX, snapshot_files.HELD_PREFIX, DOWNLOAD_PREFIX)
        for module, name in self.CALLS:
            module = fcntl if module == "fcntl" else module
            real = getattr(module, name)

            def call(*args, _real=real, **kwargs):
                if not self.busy:
                    if self.calls == k:
                        self.busy = True
                        try:
                            snapshot_files.remove_stale(directory, prefixes)
                        finally:
                            self.busy, self.done = False, True
                    self.calls += 1
                return _real(*args, **kwargs)

            monkeypatch.setattr(module, name, call)


def interleaved(sequence, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> int:
    """Run `sequence(directory)` (it checks its own result) with a clean-up at each point it could come; the points."""
    (tmp_path / "count").mkdir()
    with monkeypatch.context() as m:
        counted = CleanUpAt(tmp_path / "count", None, m)
        sequence(tmp_path / "count")
    assert counted.calls > 5
    for k in range(counted.calls):
        directory = tmp_path / f"clean-up-before-call-{k}"
        directory.mkdir()
        with monkeypatch.context() as m:
            at = CleanUpAt(directory, k, m)
            sequence(directory)
        assert at.done, k
    return counted.calls


def test_a_write_holds_against_a_clean_up_at_any_point(tmp_path, monkeypatch):
    """remove_stale between the writer's mkdir and its open: the FileNotFoundError was not caught
    (locked_folder), and the snapshot failed."""
    def write(directory: Path) -> None:
        write_snapshot(directory, 3, make_parts(3))
        assert [p.name for p in directory.iterdir()] == ["step-00000003"]
        assert_parts_equal(read_snapshot(directory / "step-00000003"), make_parts(3))

    interleaved(write, monkeypatch, tmp_path)


def test_an_uploads_held_copy_holds_against_a_clean_up_at_any_point(tmp_path, monkeypatch):
    from app.training.snapshot_files import held_copy

    def hold(directory: Path) -> None:
        folder = write_snapshot(directory, 3, make_parts(3))
        with held_copy(folder) as held:
            assert held is not None
            assert {p.name: p.read_bytes() for p in held.iterdir()} == {p.name: p.read_bytes() for p in folder.iterdir()}
        assert [p.name for p in directory.iterdir()] == ["step-00000003"]

    interleaved(hold, monkeypatch, tmp_path)


def test_a_prune_holds_against_a_clean_up_at_any_point(tmp_path, monkeypatch):
    from app.training.snapshot_files import prune

    def rotate(directory: Path) -> None:
        for step in (1, 2, 3):
            write_snapshot(directory, step, make_parts(step))
        prune(directory, keep=1)
        assert [p.name for p in directory.iterdir()] == ["step-00000003"]

    interleaved(rotate, monkeypatch, tmp_path)


def test_two_prunes_at_once_both_succeed(tmp_path, monkeypatch):
    """Two writers of one directory (a claim taken over, a lease changing hands) prune it at once: the
    one that found a folder gone raised FileNotFoundError, and the write it followed was reported failed."""
    from app.training import snapshot_files

    for step in (1, 2, 3):
        write_snapshot(tmp_path, step, make_parts(step))
    listed = snapshot_files.complete_snapshots

    def listed_then_pruned_by_another(directory: Path) -> list[Path]:
        found = listed(directory)
        shutil.rmtree(found[-1])            # the other writer's prune takes the oldest first
        return found

    monkeypatch.setattr(snapshot_files, "complete_snapshots", listed_then_pruned_by_another)
    snapshot_files.prune(tmp_path, keep=1)
    monkeypatch.undo()
    assert snapshot_steps(tmp_path) == [3]


def test_no_resume_moves_snapshots_aside(tmp_path):
    for step in (1, 2):
        write_snapshot(tmp_path, step, make_parts(step))
    ckpt, said = snapshots(tmp_path)
    assert ckpt.restore(mode=False, fresh_start_allowed=True) is None
    assert complete_snapshots(tmp_path) == []
    archives = list(tmp_path.glob("archive-*"))
    assert len(archives) == 1 and sorted(p.name for p in archives[0].iterdir()) == ["step-00000001", "step-00000002"]
    assert said == [f"moved 2 earlier snapshots to {archives[0]}", "starting fresh (--no-resume)"]


def test_no_resume_begins_a_job_once_and_every_later_start_of_it_resumes(tmp_path):
    """A survivor mode's node is a launch of its own (restart count 0): a node started again with
    --no-resume, a spare or a restarted container moved the live job's snapshots to an archive."""
    write_snapshot(tmp_path, 1, make_parts(1))                  # an earlier job's
    ckpt, said = snapshots(tmp_path, job="job-a")
    assert ckpt.restore(mode=False, fresh_start_allowed=True) is None
    archives = list(tmp_path.glob("archive-*"))
    assert said == [f"moved 1 earlier snapshots to {archives[0]}", "starting fresh (--no-resume)"]
    assert json.loads((tmp_path / snapshot.JOB_MARK).read_text())["job"] == "job-a"
    ckpt.save(7, make_parts(7), background=False)
    ckpt.close()
    again, said = snapshots(tmp_path, job="job-a")              # a node of the job, started again
    assert again.restore(mode=False, fresh_start_allowed=True)["train_state"]["step"] == 7
    assert said[0].startswith("--no-resume: job job-a began 20") and said[0].endswith(
        f"(its mark in {tmp_path}); this start of one of its nodes resumes it")
    assert said[1:] == [f"resuming from {tmp_path / 'step-00000007'}"] and list(tmp_path.glob("archive-*")) == archives
    next_job, said = snapshots(tmp_path, job="job-b")           # the next job, with its own name, starts fresh
    assert next_job.restore(mode=False, fresh_start_allowed=True) is None
    assert said[0].startswith("moved 1 earlier snapshots to ") and said[1:] == ["starting fresh (--no-resume)"]
    assert complete_snapshots(tmp_path) == [] and len(list(tmp_path.glob("archive-*/step-00000007"))) == 1
    assert json.loads((tmp_path / snapshot.JOB_MARK).read_text())["job"] == "job-b"


def test_a_jobs_name_is_slurms_then_the_containers_then_torchruns_and_a_plain_process_has_none():
    from app.cluster.distributed import job_of

    launches = {"SLURM_JOB_ID": "4242", "RDZV_ID": "4242-1", "TORCHELASTIC_RUN_ID": "f00d"}
    assert job_of(launches) == "4242"       # train.sbatch's RDZV_ID counts requeues: the job is Slurm's
    assert job_of({"RDZV_ID": "run-a", "TORCHELASTIC_RUN_ID": "f00d"}) == "run-a"    # a container's standalone launch
    assert job_of({"TORCHELASTIC_RUN_ID": "f00d"}) == "f00d"
    assert job_of({}) is None


def test_a_container_started_again_with_no_resume_resumes_its_job(tmp_path):
    """The trainer as a node container runs it: TRAIN_RESUME=false and the job's RDZV_ID, in every start."""
    from tests.helpers import read_metrics, run_trainer

    args = ["--dataset", "digits", "--model", "tiny", "--progress", "lines", "--batch-size", "64", "--run-dir", tmp_path]
    run_trainer([*args, "--epochs", "1"], nproc=0, env=clean_env(TRAIN_RESUME="false", RDZV_ID="job-a"))
    trained_to = read_metrics(tmp_path, "snapshot")[-1]["step"]
    again = run_trainer([*args, "--epochs", "2"], nproc=0, env=clean_env(TRAIN_RESUME="false", RDZV_ID="job-a"))
    assert "--no-resume: job job-a began " in again.stdout and "moved" not in again.stdout
    assert read_metrics(tmp_path, "start")[-1]["step"] == trained_to and not list(tmp_path.glob("snapshots/archive-*"))


def test_no_resume_is_ignored_on_an_elastic_restart(tmp_path):
    write_snapshot(tmp_path, 1, make_parts(1))
    ckpt, _ = snapshots(tmp_path)
    assert ckpt.restore(mode=False, fresh_start_allowed=False)["train_state"]["step"] == 1


def test_restore_creates_a_missing_directory(tmp_path):
    ckpt, said = snapshots(tmp_path / "a" / "b")
    assert ckpt.restore(mode=None, fresh_start_allowed=True) is None
    assert (tmp_path / "a" / "b").is_dir()


def test_snapshot_directory_that_is_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(UserError, match="is not a directory"):
        snapshots(tmp_path / "f")[0].restore(mode=None, fresh_start_allowed=True)


def test_snapshot_directory_that_refuses_writes_is_one_error(tmp_path, monkeypatch):
    """A directory whose mode bits allow writing but whose file system does not (a read-only mount,
    /proc): the first write, the directory's id, fails, and the start stops with one line."""
    real_open = snapshot.os.open

    def read_only(path, *args, **kwargs):
        if Path(path).name == snapshot.DIRECTORY_ID:
            raise OSError(errno.EROFS, "Read-only file system")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(snapshot.os, "open", read_only)
    with pytest.raises(UserError) as err:
        snapshots(tmp_path)[0].restore(mode=None, fresh_start_allowed=True)
    assert str(err.value) == f"cannot write to snapshot directory {tmp_path}: Read-only file system"


def test_failed_write_keeps_training_and_reports(tmp_path):
    ckpt, said = snapshots(tmp_path)
    ckpt.save(1, make_parts(1), background=False)
    ckpt.directory = tmp_path / "gone"                    # e.g. the volume went away
    ckpt.save(2, make_parts(2), background=False)
    assert said and said[-1].startswith("warning: snapshot at step 2 failed (") and said.warnings == said[-1:]
    with pytest.raises(UserError, match="the last snapshot could not be written"):
        ckpt.raise_if_failed()
    ckpt.directory = tmp_path
    ckpt.save(3, make_parts(3), background=False)         # the next save succeeds and clears the failure
    ckpt.raise_if_failed()
    assert snapshot_steps(tmp_path) == [1, 3]


@pytest.fixture
def small_disk(tmp_path):
    """A 512 KiB file system of its own (tmpfs), so that the saver process meets a real full or
    read-only disk; needs root, as the suite has in CI."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (not root)")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)


@pytest.mark.parametrize("how", ["full", "read-only"])
def test_a_disk_that_fails_mid_run_keeps_the_newest_snapshot_and_training_goes_on(small_disk, how):
    """ENOSPC or EROFS under the saver in the middle of a save: one warning, the earlier snapshot
    stays, the partial one's space is freed at once, and the next save, once the disk is back, works."""
    ckpt, said = snapshots(small_disk)
    ckpt.save(1, make_parts(1, size=20_000), background=False)          # about 80 KB
    ballast = small_disk / "ballast"
    if how == "full":
        free = os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize
        ballast.write_bytes(b"x" * (free - 40_000))
    else:
        subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    ckpt.save(2, make_parts(2, size=20_000))
    ckpt.wait()
    error = "No space left on device" if how == "full" else "Read-only file system"
    assert said == said.warnings == [f"warning: snapshot at step 2 failed ({small_disk}: {error}); earlier snapshots are kept"]
    assert sorted(p.name for p in small_disk.iterdir() if p.name != "ballast") == ["step-00000001"]
    if how == "full":
        ballast.unlink()
    else:
        subprocess.run(["mount", "-o", "remount,rw", str(small_disk)], check=True)
    ckpt.save(3, make_parts(3, size=20_000), background=False)
    ckpt.close()
    assert snapshot_steps(small_disk) == [1, 3] and len(said) == 1


# ---------------------------------------------------------------- SIGKILL during a save

# Writes ~150 MB snapshots at steps 1, 2, 3, ... until it is killed. The payload of step s is
# recognisable (its first element is s), so a reader can tell which save a folder came from.
WRITER = r"""
import sys, torch
from pathlib import Path
from app.training.snapshot import write_snapshot
directory = Path(sys.argv[1])
big = torch.randn(37_500_000, generator=torch.Generator().manual_seed(0))   # 150 MB of float32
print("ready", flush=True)
step = 1
while True:
    big[0] = step
    parts = {"model": {"w": big}, "optimizer": {"m": big[:1000].clone()}, "scheduler": {"progress": float(step)},
             "scaler": {}, "train_state": {"step": step}}
    write_snapshot(directory, step, parts)
    print("wrote", step, flush=True)
    step += 1
"""


def _tmp_dirs(directory: Path) -> list[Path]:
    return [p for p in directory.iterdir() if p.name.startswith(snapshot.TMP_PREFIX)]


def _kill_when(point: str, directory: Path):
    def first_tmp() -> bool:
        return any(p.name.startswith(".tmp-step-00000001") for p in _tmp_dirs(directory))

    def inside_model_file() -> bool:
        return any((p / "model.safetensors").exists() and (p / "model.safetensors").stat().st_size > 0 for p in _tmp_dirs(directory))

    def manifest_in_tmp() -> bool:
        return any((p / "manifest.json").exists() for p in _tmp_dirs(directory))

    return {"first-tmp-folder": first_tmp, "inside-model-file": inside_model_file,
            "manifest-before-rename": manifest_in_tmp}.get(point)


@pytest.mark.parametrize("point", ["first-tmp-folder", "inside-model-file", "manifest-before-rename",
                                   "after-0.6s", "after-1.5s"])
def test_sigkill_during_save_leaves_only_complete_snapshots(tmp_path, point):
    directory = tmp_path / "ckpt"
    directory.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(directory)], cwd=REPO, env=clean_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
        start = time.monotonic()
        condition = _kill_when(point, directory)
        if condition is None:
            delay = float(point.split("-")[1].rstrip("s"))
            time.sleep(delay)
        else:
            while not condition():
                assert proc.poll() is None, proc.stderr.read()
                assert time.monotonic() - start < 60, f"never reached {point}"
                time.sleep(0.0005)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL

    if point == "first-tmp-folder":     # the kill landed inside the very first save
        assert complete_snapshots(directory) == [] and _tmp_dirs(directory)

    # Every folder under a final name reads back whole, with the content of its own step.
    for path in complete_snapshots(directory):
        state = read_snapshot(path)
        step = int(path.name[len(snapshot.PREFIX):])
        assert state["train_state"]["step"] == step
        assert state["model"]["w"][0].item() == step and state["model"]["w"].numel() == 37_500_000
    # Nothing else but temporary folders: no stray files, no half-renamed names.
    for entry in directory.iterdir():
        assert entry.name.startswith((snapshot.PREFIX, snapshot.TMP_PREFIX)), entry
        if entry.name.startswith(snapshot.PREFIX):
            assert entry in complete_snapshots(directory)
            assert sorted(p.name for p in entry.iterdir()) == sorted(
                [f"{n}.safetensors" for n in snapshot.PARTS] + ["manifest.json"])

    # The next start cleans up and resumes from the newest complete snapshot (or starts fresh).
    ckpt, said = snapshots(directory)
    state = ckpt.restore(mode=None, fresh_start_allowed=True)
    assert _tmp_dirs(directory) == []
    steps = snapshot_steps(directory)
    if steps:
        assert state["train_state"]["step"] == steps[-1]
        assert said == [f"resuming from {directory / f'step-{steps[-1]:08d}'}"]
    else:
        assert state is None


# ---------------------------------------------------------------- when a snapshot is due

def test_due_names_the_reason_for_every_snapshot(tmp_path):
    s, _ = snapshots(tmp_path, save_every_steps=5, save_every_seconds=0, log_every_steps=2)
    assert [s.due(step) for step in (1, 4, 5, 9, 10)] == [None, None, "interval", None, "interval"]
    assert s.due(3, epoch=1) == "epoch" and s.due(7, stopping=True) == "stop"


def test_a_step_that_has_its_snapshot_takes_no_second_one(tmp_path):
    """The stop after --max-steps at an interval's step copied and handed over the same state again (77 ms of
    stall waiting for the first write of a ResNet-18 on CPU), and the saver then kept the first one."""
    s, _ = snapshots(tmp_path, save_every_steps=5, save_every_seconds=0, log_every_steps=2, epochs=3)
    assert s.due(10) == "interval" and s.due(10, epoch=1) is None and s.due(10, stopping=True) is None
    assert s.due(15, epoch=2) == "epoch" and s.due(16, stopping=True) == "stop"


def test_on_a_gpu_the_clock_alone_takes_snapshots_and_the_last_epoch_always_one(tmp_path):
    """A CIFAR epoch takes about a second on one GPU: epoch and step cadences would snapshot every second."""
    gpu = Snapshots(resolve(Config(snapshot_dir=tmp_path, epochs=15), "cifar10", "cuda"), SOLO, print, print)
    assert (gpu.every_seconds, gpu.every_steps, gpu.every_epochs) == (60, 0, 0)
    assert [gpu.due(step, epoch=epoch) for step, epoch in ((100, None), (391, 1), (5865, 15))] == [None, None, "epoch"]
    cpu, _ = snapshots(tmp_path, epochs=15, save_every_epochs=5)
    assert [cpu.due(step, epoch=epoch) for step, epoch in ((7, 4), (9, 5), (11, 14), (13, 15))] == [None, "epoch", None, "epoch"]


def test_the_timer_is_rank_0s_vote_and_due_follows_the_agreed_vote(tmp_path, monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr("app.training.snapshot.time.monotonic", lambda: clock[0])
    s, _ = snapshots(tmp_path, save_every_steps=0, save_every_seconds=60, log_every_steps=4)
    assert s.timer_vote() == 0.0
    clock[0] += 61
    assert s.timer_vote() == 1.0
    assert s.due(8) is None and s.due(8, timer=True) == "timer"
    s.save(8, {name: {} for name in ("model", "optimizer", "scheduler", "scaler", "train_state")}, background=False)
    assert s.timer_vote() == 0.0
    off, _ = snapshots(tmp_path, save_every_steps=0, save_every_seconds=0)
    clock[0] += 1e6
    assert off.timer_vote() == 0.0


def test_two_writers_of_one_step_leave_one_complete_snapshot(tmp_path, monkeypatch):
    """Nodes sharing a disk may both save the same step (a just-in-time snapshot): one wins."""
    first = write_snapshot(tmp_path, 3, make_parts(3))
    assert write_snapshot(tmp_path, 3, make_parts(3)) == first      # already there: nothing written

    def the_other_writer_renamed_first(src, dst):
        first.mkdir()
        raise OSError(39, "Directory not empty")

    shutil.rmtree(first)
    monkeypatch.setattr("app.training.snapshot_files.os.rename", the_other_writer_renamed_first)
    assert write_snapshot(tmp_path, 3, make_parts(3)) == first
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(snapshot.TMP_PREFIX)]


def test_directory_id_is_shared_by_everyone_who_sees_the_directory(tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    assert snapshot._directory_id(tmp_path) == snapshot._directory_id(tmp_path)
    assert snapshot._directory_id(other) != snapshot._directory_id(tmp_path)


def test_one_rank_claims_a_just_in_time_snapshot_and_a_new_start_forgets_the_claim(tmp_path):
    s, _ = snapshots(tmp_path)
    assert s.claim(7, 1.0, 30.0) is True
    threading.Timer(0.2, write_snapshot, (tmp_path, 7, make_parts(7))).start()    # the claimant's write lands
    assert s.claim(7, 1.0, 30.0) is False                          # the second survivor leaves it alone
    write_snapshot(tmp_path, 8, make_parts(8))
    assert s.claim(8, 1.0, 30.0) is False                          # already written
    s.restore(mode=None, fresh_start_allowed=True)
    assert s.claim(9, 1.0, 30.0) is True and not list(tmp_path.glob(f"{CLAIM_PREFIX}*0007"))   # stale claims go at start


def test_a_claim_whose_claimant_died_writing_is_taken_over(tmp_path):
    """A `docker restart` of rank 0's node: its SIGTERM set the rank writing its step, the SIGKILL after it ended
    the write; its claim stays. Before, the survivor saw the claim, left the step to it, and the job resumed
    17 steps back (the 20-fault chaos run, elastic, restart_fast)."""
    s, _ = snapshots(tmp_path)
    (tmp_path / f"{CLAIM_PREFIX}{7:08d}").touch()                   # the dead claimant's
    assert s.claim(7, 1.0, 0.2) is True


def test_the_start_says_what_a_job_risks_when_every_node_dies_at_once(tmp_path):
    gpu = Snapshots(resolve(Config(snapshot_dir=tmp_path), "cifar10", "cuda"), SOLO, print, print)
    assert gpu.cadence() == ("snapshots every 60 s and at the end: at most 60 s of training lost if every node "
                             "dies at once")
    assert snapshots(tmp_path)[0].cadence() == ("snapshots every 300 s, every epoch, every 100 steps and at the end: "
                                                "at most 300 s of training lost if every node dies at once")
    off, _ = snapshots(tmp_path, save_every_seconds=0, save_every_epochs=3, save_every_steps=0)
    assert off.cadence() == ("snapshots every 3 epochs and at the end (--save-every-seconds 0): what is lost if every "
                             "node dies at once has no bound in time")
    stored, _ = snapshots(tmp_path, snapshot_url="s3://bucket/run", upload_every_seconds=10)
    assert stored.cadence().endswith("dies at once; the newest goes up to the object store every 10 s at most")
