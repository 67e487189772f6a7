"""What the tests of the survivor modes (torchft: tests/test_ft.py, inplace: tests/test_inplace.py,
both: tests/test_slow_nodes.py) share: where the nodes meet, a node as the container entrypoint starts
it, its rows, and the killed-node scenario."""
from __future__ import annotations

import signal
import json
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from app.core.config import SNAPSHOT_FOLDER
from app.ft.records import Keys
from app.training.snapshot import read_snapshot
from app.training.snapshot_files import name_of
from tests.helpers import (REPO, clean_env, finish, free_port, kill_all, read_metrics, snapshot_steps, start_trainer,
                           wait_for, worker_pids)


class MeetingPoint:
    """The service the nodes meet through (torchft's Lighthouse, inplace's store), run for a `with`
    block; `env` is what the nodes need to reach it. `ready`: the first line it prints once it listens."""

    def __init__(self, module: Sequence[str], env: dict[str, str], ready: str | None = None) -> None:
        self.command, self.env, self.ready = [sys.executable, "-m", *module], env, ready
        self.process = self._start()

    def _start(self) -> subprocess.Popen:
        process = subprocess.Popen(self.command, cwd=REPO, env=self.env, text=True, stderr=subprocess.DEVNULL,
                                   stdout=subprocess.PIPE if self.ready else subprocess.DEVNULL)
        if self.ready:
            assert self.ready in process.stdout.readline()
        return process

    def restart(self) -> None:
        self.process.kill()
        self.process.wait()
        self.process = self._start()

    def __enter__(self) -> "MeetingPoint":
        return self

    def __exit__(self, *_: object) -> None:
        self.process.kill()


def standalone_node(i: int, tmp_path: Path, env: dict[str, str], epochs: int, *args: object,
                    **popen: Any) -> subprocess.Popen:
    """Node i: its own standalone torchrun with one gloo worker, writing to tmp_path/run{i} (`popen`: Popen's)."""
    return start_trainer(["--dataset", "digits", "--epochs", epochs, "--log-every-steps", 2,
                          "--run-dir", tmp_path / f"run{i}", *args], nproc=1, env={**env, "FT_REPLICA_ID": f"node{i}"},
                         launcher_args=["--standalone", "--nproc-per-node=1"], **popen)


def train_rows(run_dir: Path, after: float = 0.0) -> list[dict]:
    return [r for r in read_metrics(run_dir, "train") if r["time"] > after] if (run_dir / "metrics.jsonl").exists() else []


def training_with(run_dir: Path, size: int, after: float = 0.0) -> Callable[[], bool]:
    """Whether run_dir has a train row at world size `size` written after `after`."""
    return lambda: any(r["world_size"] == size for r in train_rows(run_dir, after))


LONG = 1000      # epochs: a member that a test stops itself (went_on_then_stop), never by its own end


def went_on_then_stop(member: subprocess.Popen, run_dir: Path, since: float) -> subprocess.CompletedProcess:
    """The member trained after `since` (the job went on), then is stopped by SIGTERM and collected: a
    test of what happened meanwhile needs no race against the member's own end."""
    wait_for(lambda: bool(train_rows(run_dir, since)), member, 120, "the member training on")
    kill_all(member, signal.SIGTERM)
    return finish(member, 120)


# Epochs of the killed-node scenario: the survivor must still be training when the returned node is
# through its start-up. At 14 epochs (about 20 s at world size 2) it was not, under load on this
# 2-core machine (a returned node's start-up took about 15 s); 30 leave it about 40 s.
PAST_A_RETURN = 30


def kill_return_and_finish(tmp_path: Path, env: dict[str, str]) -> None:
    """Two nodes train; node 1 is SIGKILLed and started again. The survivor keeps its worker process
    and loses no committed step, the returned node heals from it, and both finish at one step."""
    survivor, victim = (standalone_node(i, tmp_path, env, PAST_A_RETURN) for i in (0, 1))
    run0 = tmp_path / "run0"
    try:
        wait_for(training_with(run0, 2), survivor, 180, "both nodes training")
        pids = worker_pids(survivor.pid)
        killed_at = time.time()
        kill_all(victim)
        wait_for(training_with(run0, 1, killed_at), survivor, 60, "the survivor training alone")
        back_at = time.time()
        returned = standalone_node(1, tmp_path, env, PAST_A_RETURN)
        wait_for(training_with(run0, 2, back_at), survivor, 120, "the returned node training with it again (or "
                 "the survivor finished first: raise PAST_A_RETURN)")
        assert worker_pids(survivor.pid) == pids, "the survivor's worker was restarted"
        done, again = finish(survivor, 300), finish(returned, 300)
    finally:
        for proc in (survivor, victim):
            kill_all(proc)
    assert done.returncode == 0 and again.returncode == 0, done.stderr[-3000:] + again.stderr[-3000:]
    starts = read_metrics(run0, "start")
    assert len(starts) == 1, "the survivor started once: no restart of its processes"
    assert starts[0]["ft_backend"] == "gloo", "the start row says the members' backend (NCCL on CUDA hosts)"
    # A node's launch is a world of one here, never the job's (its train rows say 2, then 1, then 2):
    # the plot marked each node's start "restart, world 1".
    assert (starts[0]["world_size"], starts[0]["node_world_size"]) == (None, 1), starts[0]
    recorded = json.loads((run0 / "config.json").read_text())
    assert "world_size" not in recorded and recorded["node_world_size"] == 1, recorded
    steps = [r["step"] for r in read_metrics(run0, "train")]
    assert steps == sorted(set(steps)), "a committed step was lost or taken twice on the survivor"
    assert "healed from a live replica group" in again.stdout
    finals = [line for line in (done.stdout + again.stdout).splitlines() if line.startswith("done:")]
    assert len(finals) == 2 and finals[0].split(", test_acc")[0] == finals[1].split(", test_acc")[0], finals


def every_node_snapshots_a_step_alike(tmp_path: Path, env: dict[str, str]) -> None:
    """Two nodes train together, each snapshotting every 4 steps into its own run directory: each step
    both snapshot holds the same tensors in both, tensor by tensor (weights, batch-norm statistics,
    the optimizer's momentum). Each node's statistics were its own shard's once (nothing synced them
    across nodes), so the snapshots of one step differed and the shared evaluation scored two models."""
    flags = ["--save-every-steps", 4, "--save-every-seconds", 0, "--keep", 1000]
    nodes = [standalone_node(i, tmp_path, env, 3, *flags) for i in (0, 1)]
    try:
        done = [finish(node, 300) for node in nodes]
    finally:
        for node in nodes:
            kill_all(node)
    assert all(d.returncode == 0 for d in done), done[0].stderr[-3000:] + done[1].stderr[-3000:]
    folders = [tmp_path / f"run{i}" / SNAPSHOT_FOLDER for i in (0, 1)]
    both = sorted(set(snapshot_steps(folders[0])) & set(snapshot_steps(folders[1])))
    assert len(both) >= 3, both
    for step in both:
        a, b = (dict(_tensors(read_snapshot(folder / name_of(step)))) for folder in folders)
        assert a.keys() == b.keys() and any("running_mean" in name for name in a), sorted(a)
        differ = [name for name in a if not torch.equal(a[name], b[name])]
        assert not differ, f"step {step}: the nodes' snapshots differ in {differ[:6]} ({len(differ)} of {len(a)})"


def _tensors(tree: Any, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a snapshot's model and optimizer parts, by its path in the tree."""
    if isinstance(tree, torch.Tensor):
        yield path, tree
    elif isinstance(tree, dict):
        for key, value in tree.items():
            if path or key in ("model", "optimizer"):
                yield from _tensors(value, f"{path}/{key}")


COLLECTIVE_TIMEOUT_S = 30       # a hung member must be cut off long before its all-reduce would time out


def inplace_store(secret: str = "test-secret") -> MeetingPoint:
    """The job's store on free ports (`python -m app.node store`, as the compose store service runs
    it), for a `with` block."""
    port = free_port()
    return MeetingPoint(["app.node", "store"], clean_env(
        RDZV_PORT=str(port), LIGHTHOUSE_PORT=str(free_port()), RDZV_BIND="127.0.0.1", RDZV_ID="test-job",
        TRAIN_FT="inplace", TRAIN_GROUP_STORE=f"127.0.0.1:{port}", TRAIN_COLLECTIVE_TIMEOUT=str(COLLECTIVE_TIMEOUT_S),
        JOB_SECRET=secret), ready="TCPStore listening")


def spares_listed(env: dict[str, str]) -> Callable[[], int]:
    """How many members have waited as spares in the job's store (Keys.spares, one line each)."""
    host, port = env["TRAIN_GROUP_STORE"].split(":")
    client = dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False, timeout=timedelta(seconds=10))
    key = Keys(env["RDZV_ID"]).spares()
    return lambda: len([line for line in client.compare_set(key, "\x00", "\x00").split(b"\n") if b"|" in line])
