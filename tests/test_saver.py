"""The snapshot saver process (app/training/saver.py): its own faults, and that no process outlives a trainer."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from app.training import saver, snapshot, snapshot_files
from tests.helpers import REPO, _tagged, clean_env, read_metrics, run_trainer, snapshot_steps, start_trainer, wait_for
from tests.test_snapshot import snapshots

pytestmark = pytest.mark.unit

BIG = 37_500_000        # 150 MB of float32: a write long enough to be caught in the middle


def big_parts(step: int) -> snapshot.State:
    weights = torch.zeros(BIG)
    weights[0] = step
    return {"model": {"w": weights}, "optimizer": {}, "scheduler": {}, "scaler": {}, "train_state": {"step": step}}


def in_the_middle(directory: Path) -> bool:
    """A write has begun its first part and not finished it."""
    return any((p / "model.safetensors").exists() for p in directory.glob(f"{snapshot.TMP_PREFIX}*"))


def gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"     # exited, not yet reaped
    except OSError:
        return True


def saver_in_the_middle_of_a_write(directory: Path) -> tuple[snapshot.Snapshots, Any, int]:
    """Snapshots handing its saver a 150 MB write of step 1, returned once the write has begun; the saver's pid."""
    ckpt, said = snapshots(directory)
    ckpt.start()
    pid = ckpt._saver.process.pid
    ckpt.save(1, big_parts(1))
    deadline = time.monotonic() + 60
    while not in_the_middle(directory):
        assert time.monotonic() < deadline, "the write never began"
        time.sleep(0.001)
    return ckpt, said, pid


def test_a_saver_killed_in_the_middle_of_a_write_is_replaced_and_the_write_done_again(tmp_path):
    ckpt, said, first = saver_in_the_middle_of_a_write(tmp_path)
    os.kill(first, signal.SIGKILL)
    ckpt.wait()
    assert said == said.warnings == [f"warning: the snapshot saver (pid {first}) ended by SIGKILL while writing "
                                     "step 1; a new saver writes step 1"]
    assert snapshot_steps(tmp_path) == [1] and snapshot.read_snapshot(tmp_path / "step-00000001")["model"]["w"][0] == 1
    ckpt.save(2, big_parts(2), background=False)          # the new saver goes on
    assert snapshot_steps(tmp_path) == [1, 2] and not list(tmp_path.glob(f"{snapshot.TMP_PREFIX}*"))
    second = ckpt._saver.process.pid
    ckpt.close()
    assert second != first and gone(second)


def written_mb(directory: Path) -> str:
    """The megabytes in the temporary folders of writes, as the saver's warning rounds them."""
    return f"{sum(f.stat().st_size for f in directory.glob(f'{snapshot.TMP_PREFIX}*/*')) / 1e6:.0f}"


def test_a_saver_that_hangs_in_the_middle_of_a_write_is_killed_and_replaced_saying_how_far_it_got(tmp_path,
                                                                                               monkeypatch):
    monkeypatch.setattr(saver, "HUNG_AFTER_S", 2.0)
    monkeypatch.setattr(saver, "WRITE_FLOOR_MB_S", 1e9)      # the bound: HUNG_AFTER_S alone
    ckpt, said, first = saver_in_the_middle_of_a_write(tmp_path)
    os.kill(first, signal.SIGSTOP)
    while Path(f"/proc/{first}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":    # kill() only sends it
        time.sleep(0.001)
    written = written_mb(tmp_path)      # stopped: what it wrote stays as it is
    ckpt.wait()
    assert said == said.warnings == [f"warning: the snapshot saver (pid {first}) did not finish step 1 within 2 s "
                                     f"(2 s + 150 MB at 1e+09 MB/s) and was killed: it had written {written} MB of "
                                     "150 MB; a new saver writes step 1"]
    assert snapshot_steps(tmp_path) == [1] and gone(first)
    ckpt.close()


def test_the_time_a_write_is_given_grows_with_its_bytes(tmp_path, monkeypatch):
    """A fixed 300 s: a state of several GB on a slow or network disk was killed, written again, killed
    again, and never snapshotted at all. Here the floor makes 150 MB worth 5 s more than the 1 s bound
    for what any write does besides its bytes; the write paused 2.5 s finishes, by the same saver."""
    monkeypatch.setattr(saver, "HUNG_AFTER_S", 1.0)
    monkeypatch.setattr(saver, "WRITE_FLOOR_MB_S", 30.0)
    assert saver.write_bound_s(150_000_000) == 6.0
    ckpt, said, first = saver_in_the_middle_of_a_write(tmp_path)
    os.kill(first, signal.SIGSTOP)
    time.sleep(2.5)
    with contextlib.suppress(ProcessLookupError):      # killed meanwhile, by a bound that did not grow
        os.kill(first, signal.SIGCONT)
    ckpt.wait()
    assert said == [] and snapshot_steps(tmp_path) == [1] and ckpt._saver.process.pid == first
    ckpt.close()


def leaves_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not gone(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def outlives_its_trainer_s() -> float:
    """The most a saver outlives its trainer, or a SIGTERM or SIGINT sent to it (saver.py's docstring)."""
    return saver.PARENT_POLL_S + saver.WRITE_AT_END_S + saver.UPLOAD_AT_END_S


# A stand-in for a dead mount, without FUSE: the saver's every write hangs; told to leave, it waits 1 s for it.
STUCK_SAVER = r"""
import sys, time
from app.training import saver, snapshot_files
saver.WRITE_AT_END_S = 1.0
snapshot_files._write_parts = lambda *args: time.sleep(600)
saver.main(sys.argv[1:])
"""


def on_a_dead_mount() -> None:
    """Make the savers this process starts from now on write as on a dead mount (STUCK_SAVER)."""
    real = subprocess.Popen

    def popen(command: list[str], **kwargs: Any) -> subprocess.Popen:
        assert command[1:3] == ["-m", "app.training.saver"], command
        return real([command[0], "-c", STUCK_SAVER, *command[3:]], **kwargs)
    subprocess.Popen = popen


# A trainer's side alone, in a session of its own as torchrun starts a worker: starts its saver, forks a child
# that holds its end of the saver's socket (as a DataLoader worker does), hands the saver a 150 MB write, says
# the saver's pid and the child's, and waits to be killed. --stuck: its saver writes as on a dead mount.
TRAINER = r"""
import os, sys, time
from pathlib import Path
from tests.test_saver import big_parts, on_a_dead_mount
from tests.test_snapshot import snapshots
if "--stuck" in sys.argv:
    on_a_dead_mount()
ckpt, _ = snapshots(Path(sys.argv[1]))
ckpt.start()
if (child := os.fork()) == 0:
    time.sleep(600)
    os._exit(0)
ckpt.save(1, big_parts(1))
print(ckpt._saver.process.pid, child, flush=True)
time.sleep(600)
"""


def fake_trainer(directory: Path, *args: str, **popen: Any) -> tuple[subprocess.Popen, int, int]:
    """A TRAINER, its saver's pid and its child's."""
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, str(directory), *args], cwd=REPO, env=clean_env(),
                               stdout=subprocess.PIPE, text=True, start_new_session=True, **popen)
    saver_pid, child = map(int, trainer.stdout.readline().split())
    return trainer, saver_pid, child


def kill_if_left(*pids: int) -> None:
    """SIGKILL those of these processes a failed test left behind (a gone one's pid may be another's by now)."""
    for pid in pids:
        if not gone(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("how", ["trainer", "group"])
def test_a_trainer_killed_while_its_saver_writes_leaves_a_complete_snapshot_and_no_process(tmp_path, how):
    """The saver finishes the snapshot it holds, then leaves within its bound: "trainer", the trainer alone
    SIGKILLed, its forked child still holding its end of the socket (no end of file comes); "group", the
    trainer's process group SIGKILLed, as torchrun stops a worker (the saver is in a session of its own)."""
    assert f"= {outlives_its_trainer_s():g} s after its trainer" in saver.__doc__.replace("\n", " ")
    trainer, saver_pid, child = fake_trainer(tmp_path)
    try:
        wait_for(lambda: in_the_middle(tmp_path), trainer, 60, "the write to begin", interval=0.001)
        if how == "group":
            os.killpg(trainer.pid, signal.SIGKILL)
        else:
            trainer.kill()
        trainer.wait()
        assert leaves_within(saver_pid, outlives_its_trainer_s()), "the saver outlived its trainer"
    finally:
        kill_if_left(saver_pid, child)
    assert snapshot_steps(tmp_path) == [1] and not list(tmp_path.glob(f"{snapshot.TMP_PREFIX}*"))
    assert snapshot.read_snapshot(tmp_path / "step-00000001")["model"]["w"][0] == 1


def test_a_saver_whose_write_is_stuck_gives_it_up_once_its_trainer_is_gone(tmp_path):
    """A write that never ends (a dead mount) holds the saver WRITE_AT_END_S after its trainer's death, no
    longer; its temporary folder, whose lock died with it, goes at the next start."""
    trainer, saver_pid, child = fake_trainer(tmp_path, "--stuck", stderr=subprocess.PIPE)
    try:
        wait_for(lambda: list(tmp_path.glob(f"{snapshot.TMP_PREFIX}*")), trainer, 60, "the write to begin")
        os.killpg(trainer.pid, signal.SIGKILL)
        trainer.wait()
        assert leaves_within(saver_pid, saver.PARENT_POLL_S + 1.0 + 10.0), "the stuck saver outlived its bound"
    finally:
        kill_if_left(saver_pid, child)
    assert trainer.stderr.read() == (f"warning: the snapshot saver (pid {saver_pid}) gave up the write it held: it had "
                                     f"not finished 1 s after its trainer (pid {trainer.pid}) ended; earlier snapshots "
                                     "are kept\n")
    assert list(tmp_path.glob(f"{snapshot.TMP_PREFIX}*"))
    snapshot_files.remove_stale(tmp_path)
    assert not list(tmp_path.iterdir())


def minds_its_signals(pid: int) -> bool:
    """SIGTERM and SIGINT are blocked in the saver's main thread: from then on its watchdog takes them."""
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    blocked = int(status["SigBlk"], 16)
    return all(blocked >> (sig - 1) & 1 for sig in (signal.SIGTERM, signal.SIGINT))


@pytest.mark.parametrize("sig, writing", [(signal.SIGTERM, True), (signal.SIGINT, False)],
                         ids=["SIGTERM-mid-write", "SIGINT-idle"])
def test_sigterm_or_sigint_to_the_saver_ends_it_after_the_write_it_holds(tmp_path, sig, writing):
    """Sent to the saver itself (Slurm's scancel signals every process of a step), either signal is its trainer's
    death: the write it holds is finished and answered, then it leaves, status 0; the next write starts another."""
    if writing:
        ckpt, said, pid = saver_in_the_middle_of_a_write(tmp_path)
    else:
        ckpt, said = snapshots(tmp_path)
        ckpt.start()
        pid = ckpt._saver.process.pid
        deadline = time.monotonic() + 60
        while not minds_its_signals(pid):
            assert time.monotonic() < deadline, "the saver never took SIGTERM and SIGINT in hand"
            time.sleep(0.01)
    process = ckpt._saver.process
    os.kill(pid, sig)
    ckpt.wait()
    try:
        assert leaves_within(pid, outlives_its_trainer_s()), f"the saver outlived {sig.name}"
        assert process.wait(timeout=10) == 0 and said == []
        assert snapshot_steps(tmp_path) == ([1] if writing else [])
        ckpt.save(2, big_parts(2), background=False)       # a saver that has left is replaced without a word
        assert said == [] and snapshot_steps(tmp_path)[-1] == 2 and ckpt._saver.process.pid != pid
    finally:
        process.kill()                  # nothing, once it has ended and been waited for
        ckpt.close()


def test_closing_a_saver_that_not_even_sigkill_ends_gives_up_with_one_warning(tmp_path, monkeypatch):
    """A saver stuck in the kernel (a write on a dead mount, in D state, ends only when its write does) must
    not hold the trainer's exit: close() waits, kills, waits a bounded time more, and says so once."""
    monkeypatch.setattr(saver, "LEAVES_WITHIN_S", 1.0)
    monkeypatch.setattr(saver, "KILLED_WITHIN_S", 1.0)
    ckpt, said = snapshots(tmp_path)
    ckpt.start()
    process = ckpt._saver.process
    os.kill(process.pid, signal.SIGSTOP)                    # it never finds its socket closed
    monkeypatch.setattr(process, "kill", lambda: None)      # and SIGKILL does not end it, as in D state
    closing = threading.Thread(target=ckpt.close, name="close", daemon=True)
    closing.start()
    closing.join(10)
    try:
        assert not closing.is_alive(), "close() waited without a bound"
        assert said == said.warnings == [f"warning: the snapshot saver (pid {process.pid}) did not end within 1 s "
                                         "of SIGKILL (stuck in the kernel: a dead mount?); it is left behind"]
    finally:
        os.kill(process.pid, signal.SIGKILL)
        process.wait()


FAST = ["--dataset", "digits", "--model", "tiny", "--epochs", "2", "--batch-size", "64", "--save-every-steps", "3"]


@pytest.mark.parametrize("how", ["done", "error", "killed"])
def test_no_process_is_left_behind_after_any_exit(tmp_path, how):
    """After a run ends (trained to the end, a bad input, SIGKILL), no process of it is left: the launch's
    every process carries its tag in its environment, the saver too."""
    args = [*FAST, "--run-dir", tmp_path / "run"]
    if how == "error":
        args += ["--lr", "-1"]
    proc = start_trainer(args, nproc=0)
    if how == "killed":
        wait_for(lambda: (tmp_path / "run" / "metrics.jsonl").exists() and read_metrics(tmp_path / "run", "snapshot"),
                 proc, 120, "a first snapshot")
        os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=120)
    assert proc.returncode == {"done": 0, "error": 2, "killed": -signal.SIGKILL}[how]
    deadline = time.monotonic() + 30
    while [pid for pid in _tagged(proc.run_tag) if not gone(pid)]:
        assert time.monotonic() < deadline, f"left behind: {_tagged(proc.run_tag)}"
        time.sleep(0.05)
    if how == "done":
        assert snapshot_steps(tmp_path / "run" / "snapshots")


def test_resnet152_with_adamw_snapshots_every_two_steps_and_resumes(tmp_path, synthetic_data):
    """The issue's own lines at a tiny size: about 2,300 tensors, whose layout never fit one socket message."""
    args = ["--dataset", "synthetic", "--data-dir", synthetic_data, "--model", "resnet152", "--optimizer", "adamw",
            "--batch-size", "2", "--save-every-steps", "2", "--save-every-seconds", "0", "--run-dir", tmp_path]
    first = run_trainer([*args, "--max-steps", "3"], nproc=0, timeout=300)
    assert "warning" not in first.stderr and snapshot_steps(tmp_path / "snapshots") == [2, 3]
    second = run_trainer([*args, "--max-steps", "4", "--resume"], nproc=0, timeout=300)
    assert "resuming from" in second.stdout and snapshot_steps(tmp_path / "snapshots") == [2, 3, 4]
