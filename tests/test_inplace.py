"""In-place mode (--ft inplace, app/ft/inplace.py): the survivors re-form their c10d group in the same
processes; a member that comes back heals from a live one; a hung one is cut off at its heartbeat."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import REPO, clean_env, finish, free_port, kill_all, read_metrics, wait_for, worker_pids
from tests.survivors import MeetingPoint, kill_return_and_finish, standalone_node, train_rows, training_with

COLLECTIVE_TIMEOUT_S = 30       # a hung member must be cut off long before its all-reduce would time out


def _store(secret: str = "test-secret") -> MeetingPoint:
    """The job's store on free ports (`python -m app.node store`, as the compose store service runs
    it), for a `with` block."""
    port = free_port()
    return MeetingPoint(["app.node", "store"], clean_env(
        RDZV_PORT=str(port), LIGHTHOUSE_PORT=str(free_port()), RDZV_BIND="127.0.0.1", RDZV_ID="test-job",
        TRAIN_FT="inplace", TRAIN_GROUP_STORE=f"127.0.0.1:{port}", TRAIN_COLLECTIVE_TIMEOUT=str(COLLECTIVE_TIMEOUT_S),
        JOB_SECRET=secret), ready="TCPStore listening")


@pytest.mark.multiprocess
def test_a_killed_member_leaves_the_survivor_training_in_the_same_process_and_heals_on_return(tmp_path):
    with _store() as store:
        kill_return_and_finish(tmp_path, store.env)


@pytest.mark.multiprocess
def test_a_hung_member_is_cut_off_long_before_the_collective_timeout_and_heals_when_it_wakes(tmp_path):
    """SIGSTOP one member's worker: the survivor's all-reduce is waiting for it; gloo alone would wait
    the collective timeout. The survivor's watch sees the beat stop and shuts the group's connections;
    the survivor leaves its stacks."""
    with _store() as store:
        survivor, victim = standalone_node(0, tmp_path, store.env, 40), standalone_node(1, tmp_path, store.env, 40)
        run0, run1 = tmp_path / "run0", tmp_path / "run1"
        try:
            wait_for(training_with(run0, 2), survivor, 180, "both members training")
            (frozen,) = worker_pids(victim.pid).values()
            stopped_at = time.time()
            os.kill(frozen, signal.SIGSTOP)
            wait_for(training_with(run0, 1, stopped_at), survivor, COLLECTIVE_TIMEOUT_S / 2,
                     "the survivor training alone before half the collective timeout")
            os.kill(frozen, signal.SIGCONT)
            woke_at = time.time()
            wait_for(training_with(run0, 2, woke_at), survivor, 60, "the woken member back in the group")
            assert list(worker_pids(victim.pid).values()) == [frozen], "the woken member came back in the same process"
        finally:
            for proc in (survivor, victim):
                kill_all(proc)
    said = survivor.stderr.read()
    assert "a member stopped beating" in said
    # Before it went on, the survivor left the stacks of its threads in its run directory, in one line.
    hangs = [line for line in said.splitlines() if line.startswith("hang stacks (") and "stopped beating" in line]
    assert len(hangs) == 1, said[-3000:]
    written = re.search(r"\(pid \d+, this one\) in (\S+\.txt)", hangs[0])
    assert written and Path(written[1]).parent == run0 / "hangs" and "Thread 0x" in Path(written[1]).read_text()


@pytest.mark.multiprocess
def test_a_restarted_store_costs_the_members_a_new_generation_not_the_job(tmp_path):
    with _store() as store:
        members = [standalone_node(i, tmp_path, store.env, 40) for i in (0, 1)]
        run0 = tmp_path / "run0"
        try:
            wait_for(training_with(run0, 2), members[0], 180, "both members training")
            restarted_at = time.time()
            pids = [worker_pids(m.pid) for m in members]
            store.restart()
            wait_for(training_with(run0, 2, restarted_at + 2.0), members[0], 60,
                     "both members training together after the store restarted")
            assert [worker_pids(m.pid) for m in members] == pids, "a member's worker was restarted"
        finally:
            for member in members:
                kill_all(member)


@pytest.mark.multiprocess
def test_a_member_without_the_job_secret_is_refused_in_one_line_and_the_job_goes_on(tmp_path):
    with _store("right") as store:
        member = standalone_node(0, tmp_path, store.env, 6)
        try:
            wait_for(lambda: bool(train_rows(tmp_path / "run0")), member, 180, "the member training")
            stranger = subprocess.run([sys.executable, "-m", "app.train", "--dataset", "digits",
                                       "--run-dir", str(tmp_path / "run1")],
                                      cwd=REPO, env={**store.env, "JOB_SECRET": "wrong"}, capture_output=True,
                                      text=True, timeout=180)
            done = finish(member, 300)
        finally:
            kill_all(member)
    errors = [line for line in stranger.stderr.splitlines() if line.startswith("error:")]
    assert stranger.returncode == 2 and "Traceback" not in stranger.stderr, stranger.stderr[-3000:]
    assert len(errors) == 1 and "holds another job secret (JOB_SECRET): this node is refused" in errors[0], errors
    assert done.returncode == 0, done.stderr[-3000:]
    assert all(r["world_size"] == 1 for r in read_metrics(tmp_path / "run0", "train")), "the stranger never counted"


@pytest.mark.multiprocess
def test_no_group_store_is_one_error_line(tmp_path):
    done = subprocess.run([sys.executable, "-m", "app.train", "--ft", "inplace", "--dataset", "digits", "--epochs", "1",
                           "--group-store", f"127.0.0.1:{free_port()}", "--collective-timeout", "5",
                           "--run-dir", str(tmp_path / "run")], cwd=REPO, env=clean_env(), capture_output=True,
                          text=True, timeout=120)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert len(errors) == 1 and "no group store answered at 127.0.0.1:" in errors[0], errors


@pytest.mark.unit
def test_a_round_whose_closer_died_after_arriving_is_closed_by_the_next_arrival_without_it(monkeypatch):
    """Seen in the chaos run: a paused member woke, arrived first at the next round and was then
    restarted by its node, and the round waited for its list until the survivors' progress bound.
    The next arrival takes over once the first has been silent for the heartbeat timeout, and
    leaves it out of the list (a group formed with it would wait for it to connect)."""
    import json
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from app.distributed import World
    from app.ft.inplace import InPlaceGroup
    from app.recovery.policy import DEFAULT

    monkeypatch.setenv("JOB_SECRET", "s")
    server = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False, timeout=timedelta(seconds=10))
    world = World(0, 0, 1, 1, torch.device("cpu"), 0)
    member = InPlaceGroup(world, DEFAULT, f"127.0.0.1:{server.port}", "t", lambda: {}, lambda state: None)
    try:
        ghost = {"member": "ghost", "name": "gone/0", "step": 9, "proof": member.proof("1/ghost")}
        assert server.add("app/inplace/t/1/arrived", 1) == 1
        server.set("app/inplace/t/1/m/1", json.dumps(ghost))
        started = time.monotonic()
        member.start_step()
        took = time.monotonic() - started
        assert member.members == [member.member] and member.gen == 1, "the dead closer was left out"
        assert DEFAULT.ft_heartbeat_timeout_s <= took < DEFAULT.collective_timeout_s, "waited for the dead closer"
    finally:
        member.shutdown()
