"""Docker tier: the README's multi-host recipe, with each "host" in a network namespace of its own.

Each host is a container that only holds a network namespace (its own address on a bridge network
this test creates and removes); the recipe's services join that namespace instead of the real
host's (`network_mode: container:...`, the one difference from the recipe). Each host has its own
runs/ directory: no shared storage. The job must form at world size 2, survive a kill and a
restart of each host's node, always resume from the newest state anywhere, and lose no step; in
torchft mode the other host's training process must go on throughout, and the node back heal from
it over the network (its own disk holds only an older snapshot).
"""
from __future__ import annotations

import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from app.core.config import FT_MODES, SURVIVOR_MODES
from scripts.job import IMAGE, ComposeJob
from tests.docker_helpers import cleanup, trainer_pid

pytestmark = pytest.mark.docker

SUBNET, ADDRESSES = "10.123.45.0/24", ("10.123.45.2", "10.123.45.3")   # only on this test's bridge
PORT, LIGHTHOUSE_PORT = 29431, 29531
TIMEOUT_S = 240
OVERRIDE = """services:
  store:
    network_mode: container:${HOST_NETNS}
  trainer:
    network_mode: container:${HOST_NETNS}
"""


def _docker(*words: str) -> None:
    subprocess.run(["docker", *words], check=True, capture_output=True, text=True, timeout=120)


@pytest.fixture(params=FT_MODES)
def hosts(request: pytest.FixtureRequest, image: str, tmp_path: Path) -> Iterator[list[ComposeJob]]:
    """Two hosts, each with its node (and the first with the store), in one mode: the test's parameter."""
    tag = uuid.uuid4().hex[:6]
    network, override = f"ftt-mh-{tag}", tmp_path / "hosts.compose.yaml"
    override.write_text(OVERRIDE)
    _docker("network", "create", "--subnet", SUBNET, network)
    jobs = []
    try:
        for name, address in zip("ab", ADDRESSES):
            netns = f"ftt-mh-{tag}-host-{name}"
            _docker("run", "-d", "--name", netns, "--network", network, "--ip", address, IMAGE, "sleep", "infinity")
            env = {"HOST_NETNS": netns, "NODE_ADDR": address, "RDZV_HOST": ADDRESSES[0], "NNODES": "1:2",
                   "JOB_SECRET": tag, "TRAINER_RESTART": "no", "LIGHTHOUSE_PORT": str(LIGHTHOUSE_PORT)}
            jobs.append(ComposeJob(f"mh-{tag}", 1, project=f"ftt-mh-{name}", rdzv_port=PORT, inherit_env=False,
                                   runs_dir=tmp_path / f"host-{name}" / "runs", compose_override=str(override),
                                   extra_env=env, settings={
                                       "ft": request.param, "dataset": "digits", "model": "tiny", "epochs": 200,
                                       "batch_size": 32,
                                       "log_every_steps": 1, "save_every_steps": 10, "save_every_seconds": 0,
                                       "progress": "lines"}))
        yield jobs
    finally:
        for job in jobs:
            cleanup(job)
        for name in "ab":
            subprocess.run(["docker", "rm", "-f", f"ftt-mh-{tag}-host-{name}"], capture_output=True, timeout=120)
        subprocess.run(["docker", "network", "rm", network], capture_output=True, timeout=120)


def _rows(jobs: list[ComposeJob]) -> list[dict[str, Any]]:
    """Both hosts' metrics (each written while that host held rank 0), in time order."""
    return sorted((r for job in jobs for r in job.rows()), key=lambda r: r["time"])


def _wait(jobs: list[ComposeJob], what: str, predicate) -> dict[str, Any]:
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        found = next((r for r in _rows(jobs) if predicate(r)), None)
        if found:
            return found
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}\n" + "\n".join(job.logs(30) for job in jobs))


def _kill_and_restart(jobs: list[ComposeJob], victim: ComposeJob, times) -> None:
    node = victim.trainers()[0]
    last = max(r["step"] for r in _rows(jobs) if r["event"] == "train")
    t_kill = time.time()
    node.kill()
    alone = _wait(jobs, "world size 1", lambda r: r["event"] == "train" and r["time"] > t_kill and r["world_size"] == 1)
    start = [r for r in _rows(jobs) if r["event"] == "start" and r["time"] > t_kill][0]
    times.record(f"multihost_recovery[{victim.project}]", alone["time"] - t_kill, resumed_at=start["step"], last=last)
    assert start["resumed"] and start["step"] >= last, (start, last)        # nothing lost, whoever died

    before = max(r["step"] for r in _rows(jobs) if r["event"] == "train")
    t_start = time.time()
    node.start()
    both = _wait(jobs, "world size 2 again", lambda r: r["event"] == "train" and r["time"] > t_start
                 and r["world_size"] == 2)
    start = [r for r in _rows(jobs) if r["event"] == "start" and r["time"] > t_start][-1]
    times.record(f"multihost_rejoin[{victim.project}]", both["time"] - t_start, resumed_at=start["step"])
    assert start["step"] >= before, (start, before)    # the node that was away never pulls the job back


def _kill_and_heal(jobs: list[ComposeJob], victim: ComposeJob, times) -> None:
    """torchft and inplace modes: the other host's training process goes on alone, and the victim, back, heals from it."""
    survivor = next(job for job in jobs if job is not victim)
    node, pid = victim.trainers()[0], trainer_pid(survivor.trainers()[0])
    last = max(r["step"] for r in survivor.rows("train"))
    starts = victim.rows("start")
    t_kill = time.time()
    node.kill()
    alone = _wait([survivor], "world size 1", lambda r: r["event"] == "train" and r["time"] > t_kill
                  and r["world_size"] == 1)
    times.record(f"multihost_{victim.settings['ft']}_alone[{victim.project}]", alone["time"] - t_kill)
    assert alone["step"] > last, (alone, last)           # went on from where it was: nothing lost
    t_start = time.time()
    node.start()
    both = _wait([victim], "the victim back at world size 2", lambda r: r["event"] == "train" and r["time"] > t_start
                 and r["world_size"] == 2)
    times.record(f"multihost_{victim.settings['ft']}_back[{victim.project}]", both["time"] - t_start)
    assert trainer_pid(survivor.trainers()[0]) == pid, "the survivor's training process was restarted"
    steps = [r["step"] for r in survivor.rows("train")]
    assert steps == sorted(steps), "a committed step went back on the survivor: lost"
    assert len(victim.rows("start")) == len(starts) + 1, "the returned node's start and no other"
    assert "healed from a live replica group" in node.logs().decode(errors="replace")


def test_two_hosts_without_shared_storage_survive_each_losing_its_node(hosts, times) -> None:
    a, b = hosts
    t0 = time.time()
    a.up("store", "trainer")
    b.up("trainer", no_deps=True)
    first = _wait(hosts, "one job of world size 2", lambda r: r["event"] == "train" and r["world_size"] == 2)
    times.record(f"multihost_job_start[{a.settings['ft']}]", first["time"] - t0)
    _wait(hosts, "a first snapshot", lambda r: r["event"] == "snapshot" and r["step"] >= 10)
    for victim in (a, b):
        if a.settings["ft"] in SURVIVOR_MODES:
            _kill_and_heal(hosts, victim, times)
        else:
            _kill_and_restart(hosts, victim, times)
    starts = [r for r in _rows(hosts) if r["event"] == "start"]
    assert all(later["step"] >= earlier["step"] for earlier, later in zip(starts, starts[1:])), starts
    for job in hosts:       # every host keeps snapshots of its own
        assert list((job.run_dir / "snapshots").glob("step-*")), job.run_dir
