"""Warm spares on GPU hosts (app/cluster/gpus.py): a process of a spare-ready node claims its GPU only
when a generation names it, moves to a free one when its own is held, and gives it back while it
waits; the claims are the entrypoint's own lock files, the GPUs faked (device objects and lock files
need no GPU). Before, a spare container held GPUS/NODES GPUs of its own for its life."""
from __future__ import annotations

import contextlib
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from app.cluster import gpus
from app.cluster.distributed import World
from app.core.policy import DEFAULT

pytestmark = pytest.mark.unit


def _claim(tmp_path, moves: list) -> gpus.GpuClaim:
    """A process of a one-GPU node on a host whose job may use GPUs 4 and 7, starting on the first."""
    return gpus.GpuClaim(tmp_path / "gpu-locks", ["4", "7"], torch.device("cuda", 0), relocate=moves.append)


def test_a_spare_claims_when_named_and_takes_the_gpu_of_the_node_it_replaces(tmp_path):
    moves: dict[str, list] = {"a": [], "b": [], "spare": []}
    a, b, spare = (_claim(tmp_path, moves[n]) for n in ("a", "b", "spare"))
    with spare.away():                          # the job is full: the spare waits, holding no GPU
        assert a.named() == "running on GPU 4 (claimed now)" and moves["a"] == []
        assert b.named() == "running on GPU 7 (claimed now; moved from GPU 4)"
        assert moves["b"] == [torch.device("cuda", 1)] and b.device == torch.device("cuda", 1)
        assert spare.held is None and a.named() is None     # named again: it keeps what it holds
        b.give_back()                           # b is killed: the kernel drops its lock
    assert spare.named() == "running on GPU 7 (claimed now; moved from GPU 4)"
    assert moves["spare"] == [torch.device("cuda", 1)] and (tmp_path / "gpu-locks" / "gpu-7").exists()


def test_with_no_gpu_free_a_named_spare_trains_where_it_is_and_claims_at_a_later_generation(tmp_path):
    """A frozen node keeps its lock: the spare named in its place trains unclaimed, and it gives back
    what it claimed while it waits again."""
    a, frozen, moves = _claim(tmp_path, []), _claim(tmp_path, []), []
    assert a.named() and frozen.named() and (a.held, frozen.held) == (0, 1)
    spare = _claim(tmp_path, moves)
    assert spare.named() == "no GPU free to claim: running on GPU 4, unclaimed, until a generation finds one"
    assert spare.held is None and moves == []
    frozen.give_back()                          # it woke and waits as the spare now
    assert spare.named() == "running on GPU 7 (claimed now; moved from GPU 4)" and spare.held == 1
    with spare.away():
        assert spare.held is None and frozen.named() == "running on GPU 7 (claimed now)"


def test_the_claim_comes_from_the_entrypoint_on_gpu_hosts_only(monkeypatch):
    environ = {gpus.CLAIM_LOCKS_ENV: "/runs/.gpu-locks/host", gpus.CLAIM_GPUS_ENV: "1", "CUDA_VISIBLE_DEVICES": "2,3"}
    claim = gpus.GpuClaim.from_env(environ, torch.device("cuda", 0))
    assert claim is not None and claim.gpus == ["2", "3"] and str(claim.locks) == "/runs/.gpu-locks/host"
    assert gpus.GpuClaim.from_env(environ, torch.device("cpu")) is None
    assert gpus.GpuClaim.from_env({}, torch.device("cuda", 0)) is None


class Recorded:
    """A GpuClaim's part inplace mode calls, recording when."""

    def __init__(self, events: list) -> None:
        self.events = events

    def named(self) -> str:
        self.events.append("named")
        return "running on GPU 7 (claimed now; moved from GPU 4)"

    @contextlib.contextmanager
    def away(self):
        self.events.append("away")
        yield


def _member(monkeypatch, endpoint: str, node: str, events: list):
    from app.ft.inplace import InPlaceGroup

    monkeypatch.setenv("FT_REPLICA_ID", node)      # a node of its own (app/ft/replica.py's REPLICA_ENV)
    world = World(0, 0, 1, 1, torch.device("cpu"), 0, gpu_claim=Recorded(events))
    member = InPlaceGroup(world, DEFAULT, endpoint, "t", lambda: {}, lambda state: None, full_size=1,
                          say=lambda line: events.append(line))
    form = member.groups.form
    member.groups.form = lambda *args: (events.append("form"), form(*args))[1]
    return member


def test_an_inplace_spare_claims_its_gpu_when_named_before_its_group_forms_and_none_while_it_waits(monkeypatch):
    """--full-size 1, two nodes: one trains, the other waits as a spare (its claim given back); the
    first goes silent, the spare is named: its claim is made, and said, before its group forms."""
    monkeypatch.setenv("JOB_SECRET", "s")
    server = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False, timeout=timedelta(seconds=10))
    endpoint = f"127.0.0.1:{server.port}"
    events: dict[str, list] = {"node-a": [], "node-b": []}
    members = {node: _member(monkeypatch, endpoint, node, said) for node, said in events.items()}
    starts = {node: threading.Thread(target=m.start_step, daemon=True) for node, m in members.items()}
    try:
        for thread in starts.values():
            thread.start()
        deadline = time.monotonic() + 30
        while not any("away" in e for e in events.values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        spare = next((node for node, e in events.items() if "away" in e), None)
        assert spare is not None, events
        trained = next(node for node in events if node != spare)
        starts[trained].join(30)
        assert events[trained][:2] == ["named", "running on GPU 7 (claimed now; moved from GPU 4)"], events
        assert events[trained].index("named") < events[trained].index("form")
        members[trained].watch.stop()           # no beat from here on: the spare is named in its place
        starts[spare].join(30)
        assert not starts[spare].is_alive(), "the spare was never named"
        waited = "waiting as a spare: the job trains on 1 nodes (generation 1)"
        assert events[spare] == [waited, "away", "named", "running on GPU 7 (claimed now; moved from GPU 4)", "form"], events
        assert members[spare].members == [members[spare].member]
    finally:
        for member in members.values():
            member.shutdown()


def test_a_move_takes_every_tensor_the_step_uses_and_the_state_follows_the_new_buffers(tmp_path):
    """What a spare moved to the GPU it claimed computes with: the model, the optimizer's state, the data
    and the state's own tensors, on the new device (here `meta`: no GPU needed). module.to replaces the
    batch-norm buffers, so a state that kept the old ones would average and snapshot stale statistics."""
    from pathlib import Path

    from app.core.config import Config
    from app.datasets.data import load
    from app.reporting.metrics import Reporter
    from app.training import models
    from app.training.trainer import Trainer

    world = World(rank=0, local_rank=0, size=1, local_size=1, device=torch.device("cpu"), restart_count=0)
    data = load("digits", Path("/nonexistent"), say=lambda line: None)
    trainer = Trainer(Config(model="tiny", batch_size=32, run_dir=tmp_path), world, data, models.build("tiny", 10),
                      Reporter(tmp_path, False, "lines"))
    trainer.steps.accumulate(torch.arange(32), trainer.batches.epoch_augmentation(0))
    trainer.steps.update()                      # the optimizer has state now
    meta = torch.device("meta")
    trainer.steps.relocate(meta)
    trainer.state.relocate(trainer.steps, meta)
    trainer.batches.relocate(meta)
    model = trainer.steps.raw_model
    assert {t.device for t in [*model.parameters(), *model.buffers()]} == {meta}
    moved = [v for s in trainer.steps.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    assert moved and all(v.device == meta or v.device.type == "cpu" and v.dim() == 0 for v in moved)
    assert any(v.device == meta for v in moved)
    buffers = dict(model.named_buffers())
    assert trainer.state.float_buffers and all(any(b is live for live in buffers.values()) for b in trainer.state.float_buffers)
    assert trainer.state._loss.device == meta and trainer.steps.numerics.device == meta
    assert {trainer.batches.train_images.device, trainer.batches.mean.device, trainer.batches.device} == {meta}


@pytest.mark.parametrize("gpus, full_size, expected", [
    ("0,1", "2", ("when-named:0,1", True, "0,1")),        # a spare-ready node of one GPU: claimed when named
    ("0,1", "", ("0", False, "0")),                       # no spares: one GPU claimed for the node's life
    ("0,1,2,3", "2", ("0,1", False, "0,1")),              # a node of two GPUs keeps them (its NCCL group is bound)
])
def test_the_entrypoint_hands_a_one_gpu_spare_ready_node_its_claim(tmp_path, gpus, full_size, expected):
    """docker/entrypoint.sh's claim_gpus, run as the script defines it, on this host without GPUs (GPUS
    names them, as the docker tier's tests do)."""
    import os
    import subprocess

    from tests.helpers import REPO

    script = (REPO / "docker" / "entrypoint.sh").read_text()
    functions = script[script.index("take_locks() {"):script.index("# CPUs: the same way")]
    shown = 'echo "$NODE_GPUS|${NODE_GPU_LOCKS:-}|${NODE_GPU_CLAIM:-}|$CUDA_VISIBLE_DEVICES"'
    env = {**os.environ, "PATH": f"{REPO / '.venv' / 'bin'}:{os.environ['PATH']}", "GPUS": gpus, "NODES": "2",
           "TRAIN_RUN_DIR": str(tmp_path), "TRAIN_FULL_SIZE": full_size}
    out = subprocess.run(["bash", "-c", f'set -euo pipefail\nlog() {{ echo "$*" >&2; }}\n{functions}\nclaim_gpus\n{shown}'],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    node_gpus, locks, claim, visible = out.stdout.strip().split("|")
    assert (node_gpus, bool(locks), visible) == expected, out.stdout
    assert claim == ("1" if expected[1] else "")
