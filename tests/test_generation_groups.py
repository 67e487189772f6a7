"""Inplace mode's generation groups on NCCL (app/ft/groups.py), as far as a CPU host can pin them: a
test double of ProcessGroupNCCL whose all-reduce never completes until its group is aborted (a peer
that died or froze mid all-reduce), and whose timed wait destroys the group as NCCL's does. The
membership rounds are inplace mode's own, unchanged, on a real TCPStore; ProcessGroupNCCL itself
cannot be built without a GPU (bench/gpu_survivors.py runs the real one)."""
from __future__ import annotations

import dataclasses
import os
import threading
import time
from datetime import timedelta
from typing import Callable

import pytest
import torch
import torch.distributed as dist

from app.cluster.distributed import World
from app.core.policy import DEFAULT
from app.ft import groups as groups_module
from app.ft.groups import NCCL_ENVIRONMENT, NcclGroups
from app.recovery import failures

from tests.helpers import REPO

pytestmark = pytest.mark.unit
CPU = torch.device("cpu")
BLOCKED_S = 5.0     # a wait() that blocks the host this long is a test failure, not a hang


class StuckWork:
    """An all-reduce whose peer never takes part: complete only once `done` is set, or failed once its
    group is aborted. A timed wait aborts the group first, as NCCL's does to an operation older than
    the timeout: a loop of short timed waits would destroy a healthy slow all-reduce."""

    def __init__(self, group: "FakeNccl") -> None:
        self.group, self.done, self.timed_waits = group, threading.Event(), 0

    def is_completed(self) -> bool:
        return self.done.is_set() or self.group.aborted.is_set()

    def get_future_result(self) -> torch.futures.Future:
        result = torch.futures.Future()
        result.set_result(0 if self.done.is_set() else 2)       # SUCCESS, or COMM_ERROR once aborted
        return result

    def wait(self, timeout: timedelta | None = None) -> bool:
        if timeout is not None:
            self.timed_waits += 1
            self.group.abort()
            raise RuntimeError("[Rank 0] Watchdog caught collective operation timeout")
        deadline = time.monotonic() + BLOCKED_S
        while not self.is_completed():
            assert time.monotonic() < deadline, "wait() was called on an operation still pending: it blocked the host"
            time.sleep(0.01)
        if not self.done.is_set():
            raise RuntimeError("NCCL communicator was aborted on rank 0")
        return True


class FakeNccl:
    """ProcessGroupNCCL's part that inplace mode uses: allreduce, broadcast, abort."""

    made: list["FakeNccl"] = []

    def __init__(self, store: dist.Store, rank: int, size: int, device: torch.device, timeout: timedelta,
                 name: str) -> None:
        self.store, self.rank, self.size, self.name = store, rank, size, name
        self.aborted, self.aborts, self.works = threading.Event(), 0, []
        FakeNccl.made.append(self)

    def allreduce(self, tensors: list[torch.Tensor]) -> StuckWork:
        self.works.append(StuckWork(self))
        return self.works[-1]

    def broadcast(self, tensors: list[torch.Tensor], options: object) -> StuckWork:
        work = StuckWork(self)
        work.done.set()
        return work

    def abort(self) -> None:
        self.aborts += 1
        self.aborted.set()


@pytest.fixture
def fake_nccl(monkeypatch):
    """Inplace members built from here on form their generations on FakeNccl (app/ft/groups.py's NCCL kind)."""
    FakeNccl.made = []
    monkeypatch.setattr("app.ft.inplace.groups_for",
                        lambda device, policy, stuck=None: NcclGroups(policy, CPU, make=FakeNccl, stuck=stuck))
    return FakeNccl.made


def test_a_slow_all_reduce_is_polled_to_its_end_never_waited_on_with_a_timeout():
    """Five heartbeat intervals long: gloo's slices of timed waits (GlooGroups.wait) would have
    aborted it at the first (the deliberate break: NcclGroups.wait = GlooGroups.wait)."""
    groups = NcclGroups(DEFAULT, CPU, make=FakeNccl)
    pg = groups.form(dist.HashStore(), 0, 2, 1)
    work = pg.allreduce([torch.zeros(1)])
    threading.Timer(5 * DEFAULT.ft_heartbeat_interval_s, work.done.set).start()
    assert groups.wait(work, threading.Event()) is None
    assert (work.timed_waits, pg.aborts) == (0, 0), "a healthy slow all-reduce was destroyed"


class SilentlyFailedWork:
    """An all-reduce the watchdog failed, from a torch whose wait() returns instead of raising: its
    failure is in its result alone."""

    def is_completed(self) -> bool:
        return True

    def wait(self, timeout: timedelta | None = None) -> bool:
        return False

    def get_future_result(self) -> torch.futures.Future:
        result = torch.futures.Future()
        result.set_result(1)        # c10d's WorkResult::TIMEOUT, as the watchdog marks it
        return result


def test_an_all_reduce_failed_by_the_watchdog_is_a_failure_even_when_wait_does_not_raise():
    """Taken as committed, this member alone would have applied a step its peers never completed."""
    groups = NcclGroups(DEFAULT, CPU, make=FakeNccl)
    outcome = groups.wait(SilentlyFailedWork(), threading.Event())
    assert outcome == "the NCCL watchdog failed it (timeout)"


def _member(endpoint: str):
    from app.ft.inplace import InPlaceGroup

    world = World(0, 0, 1, 1, CPU, 0)
    return InPlaceGroup(world, DEFAULT, endpoint, "t", lambda: {}, lambda state: None)


def test_an_all_reduce_stuck_on_a_frozen_peer_is_aborted_within_the_detection_bound_and_the_survivor_reforms(
        monkeypatch, fake_nccl):
    """Two members form generation 1 through the unchanged rounds; then one freezes (its watch stops
    beating) while the other is inside an all-reduce that never completes. The survivor's watch sees
    the silence after FT_HEARTBEAT_TIMEOUT, the main thread, polling, aborts the group (once: no
    timed wait) and the survivor re-forms alone in generation 2, on a fresh group under its own prefix.
    Today's code (timed waits of gloo's slices) aborts the group through its first timed wait and
    reports the timeout instead of the silence."""
    monkeypatch.setenv("JOB_SECRET", "s")
    server = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False, timeout=timedelta(seconds=10))
    survivor, frozen = _member(f"127.0.0.1:{server.port}"), _member(f"127.0.0.1:{server.port}")
    try:
        forming = threading.Thread(target=frozen.start_step)
        forming.start()
        survivor.start_step()
        forming.join(30)
        assert survivor.gen == frozen.gen == 1 and sorted(survivor.members) == sorted(frozen.members)
        first = next(f for f in fake_nccl if f.rank == survivor.members.index(survivor.member))
        assert first.size == 2 and first.name == "inplace-1"
        first.store.set("probe", "1")       # the group's own prefix: the unchanged key layout
        assert dist.PrefixStore(survivor.keys.pg(1), server).get("probe") == b"1"

        weight = torch.nn.Parameter(torch.zeros(3))
        weight.grad = torch.ones(3)
        frozen.watch.stop()                 # no beat from here on: frozen
        frozen_at = time.monotonic()
        survivor.average_gradients([weight], [])
        took = time.monotonic() - frozen_at
        assert "stopped beating" in (survivor.errored or ""), survivor.errored
        # The detection bound (the heartbeat timeout, a watch round, a poll), with room for a loaded
        # machine: far from the collective timeout (30 s) a timed wait would have run into.
        assert DEFAULT.ft_heartbeat_timeout_s / 2 < took < DEFAULT.ft_heartbeat_timeout_s + 2.0, took
        assert first.aborted.is_set() and first.works[-1].timed_waits == 0
        assert survivor.commit() is False

        survivor.start_step()
        assert (survivor.gen, survivor.members) == (2, [survivor.member])
        assert fake_nccl[-1].name == "inplace-2" and fake_nccl[-1].size == 1 and not fake_nccl[-1].aborted.is_set()
    finally:
        survivor.shutdown()
        frozen.shutdown()
    assert fake_nccl[-1].aborted.is_set(), "the last generation was aborted at shutdown, never finalised"


@pytest.mark.parametrize("stuck", ["abort", "init"])
def test_an_abort_or_init_that_never_returns_ends_the_process_in_one_line_within_the_bound(monkeypatch, stuck):
    """Deliberate break: NcclGroups.bound returning nullcontext(): the call hangs and no line comes."""
    release, said = threading.Event(), []

    class Hanging(FakeNccl):
        def __init__(self, *args: object) -> None:
            if stuck == "init":
                release.wait(3)
            super().__init__(*args)

        def abort(self) -> None:
            release.wait(3)

    def leave(line: str, status: int = failures.EXIT_PEER_LOST) -> None:
        said.append((time.monotonic(), line, status))
        release.set()

    monkeypatch.setattr(failures, "leave", leave)
    policy = dataclasses.replace(DEFAULT, inplace_group_bound_s=0.5)
    groups = NcclGroups(policy, CPU, make=Hanging)
    started = time.monotonic()
    if stuck == "init":
        groups.form(dist.HashStore(), 0, 2, 7)
    else:
        release.set()
        pg = groups.form(dist.HashStore(), 0, 2, 7)
        release.clear()
        started = time.monotonic()
        groups.end(pg, None)
    assert len(said) == 1, said
    at, line, status = said[0]
    assert 0.5 <= at - started < 2.5 and status == failures.EXIT_PEER_LOST
    assert line.startswith("error: ") and "\n" not in line and "INPLACE_GROUP_BOUND" in line, line
    assert ("forming generation 7" if stuck == "init" else "aborting") in line


def _past_the_bound(stuck: Callable[[str], None], said: list[str]) -> None:
    """A block that outlives a 0.2 s bound until `said` has a line (5 s at most); that line is the bound's."""
    groups = NcclGroups(dataclasses.replace(DEFAULT, inplace_group_bound_s=0.2), CPU, make=FakeNccl, stuck=stuck)
    with groups.bound("aborting an NCCL group"):
        deadline = time.monotonic() + 5
        while not said:
            assert time.monotonic() < deadline, "nothing came of the bound"
            time.sleep(0.02)
    assert said[0].startswith("error: aborting an NCCL group did not return within 0.2 s"), said


def test_a_call_past_its_bound_goes_to_the_trainers_hook_when_it_has_one():
    """The trainer's hook writes the last step before it leaves (app/training/guard.py, leave_keeping)."""
    said: list[str] = []
    _past_the_bound(said.append, said)


def test_a_hook_that_fails_still_ends_the_process_in_its_line(monkeypatch):
    """A timer thread that died in the hook would leave the process stuck for good."""
    said: list[str] = []
    monkeypatch.setattr(failures, "leave", lambda line, status=failures.EXIT_PEER_LOST: said.append(line))

    def broken(line: str) -> None:
        raise RuntimeError("the goodput row could not be written")

    _past_the_bound(broken, said)


@pytest.mark.parametrize("mode, expected", [("inplace", "ours"), ("elastic", "the user's")])
def test_the_nccl_environment_is_in_place_before_the_first_group_on_a_cuda_host(monkeypatch, tmp_path, mode, expected):
    """What the process has when app.cluster.distributed.setup() builds its first NCCL group (the
    node's own): inplace mode's settings over the user's; other modes keep the user's. Deliberate
    break: set_nccl_environment() called after setup()."""
    import app.train

    class Stop(Exception):
        pass

    seen: dict[str, str | None] = {}

    def setup(*args: object) -> None:
        seen.update({name: os.environ.get(name) for name in NCCL_ENVIRONMENT})
        raise Stop

    users = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
             "TORCH_NCCL_BLOCKING_WAIT": "1", "TORCH_NCCL_PROPAGATE_ERROR": "1", "NCCL_NVLS_ENABLE": "1"}
    for name, value in users.items():
        monkeypatch.setenv(name, value)     # restored after the test, whatever main() wrote
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(app.train.distributed, "setup", setup)
    with pytest.raises(Stop):
        app.train.main(["--ft", mode, "--dataset", "digits", "--run-dir", str(tmp_path)])
    ours = {name: value for name, (value, _) in NCCL_ENVIRONMENT.items()}
    assert seen == (ours if expected == "ours" else users)
    assert set(users) == set(NCCL_ENVIRONMENT)


def test_every_nccl_setting_is_documented_with_its_value():
    text = (REPO / "docs" / "survivor-modes.md").read_text()
    missing = [f"{name}={value}" for name, (value, _) in NCCL_ENVIRONMENT.items() if f"`{name}={value}`" not in text]
    assert not missing, f"docs/survivor-modes.md does not say {missing}"


def test_a_cuda_host_gets_nccl_generations_and_a_cpu_host_gloo():
    assert groups_module.groups_for(torch.device("cuda", 0), DEFAULT).name == "nccl"
    assert groups_module.groups_for(CPU, DEFAULT).name == "gloo"
