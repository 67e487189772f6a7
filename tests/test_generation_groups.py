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
import types
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

    def __init__(self, group: "Made") -> None:
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


class Made:
    """What a test reads of one FakeNccl, kept after the group itself is gone (its end drops it once the
    caller's references are gone: a test that kept the group would hold its end forever)."""

    def __init__(self, store: dist.Store, rank: int, size: int, name: str) -> None:
        self.store, self.rank, self.size, self.name = store, rank, size, name
        self.aborted, self.aborts, self.works = threading.Event(), 0, []
        self.dropped = threading.Event()        # the group's destructor ran
        self.dropped_on: str | None = None      # in which thread

    def abort(self) -> None:
        self.aborts += 1
        self.aborted.set()


class FakeNccl:
    """ProcessGroupNCCL's part that inplace mode uses: allreduce, broadcast, abort, its name, its destructor."""

    made: list[Made] = []

    def __init__(self, store: dist.Store, rank: int, size: int, device: torch.device, timeout: timedelta,
                 name: str) -> None:
        self.record = Made(store, rank, size, name)
        self.options = types.SimpleNamespace(group_name=name)
        FakeNccl.made.append(self.record)

    def allreduce(self, tensors: list[torch.Tensor]) -> StuckWork:
        self.record.works.append(StuckWork(self.record))
        return self.record.works[-1]

    def broadcast(self, tensors: list[torch.Tensor], options: object) -> StuckWork:
        work = StuckWork(self.record)
        work.done.set()
        return work

    def abort(self) -> None:
        self.record.abort()

    def __del__(self) -> None:
        self.record.dropped_on = threading.current_thread().name
        self.record.dropped.set()


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
    assert (work.timed_waits, pg.record.aborts) == (0, 0), "a healthy slow all-reduce was destroyed"


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
        assert first.aborted.wait(5) and first.works[-1].timed_waits == 0    # aborted in a thread of its own
        assert survivor.commit() is False

        survivor.start_step()
        assert (survivor.gen, survivor.members) == (2, [survivor.member])
        assert fake_nccl[-1].name == "inplace-2" and fake_nccl[-1].size == 1 and not fake_nccl[-1].aborted.is_set()
    finally:
        survivor.shutdown()
        frozen.shutdown()
    assert fake_nccl[-1].aborted.is_set(), "the last generation was aborted at shutdown, never finalised"


def test_an_init_that_never_returns_ends_the_process_in_one_line_within_the_bound(monkeypatch):
    """The main thread needs the group it forms. Deliberate break: NcclGroups.bound returning
    nullcontext(): the call hangs and no line comes."""
    release, said = threading.Event(), []

    class Hanging(FakeNccl):
        def __init__(self, *args: object) -> None:
            release.wait(3)
            super().__init__(*args)

    def leave(line: str, status: int = failures.EXIT_PEER_LOST) -> None:
        said.append((time.monotonic(), line, status))
        release.set()

    monkeypatch.setattr(failures, "leave", leave)
    groups = NcclGroups(dataclasses.replace(DEFAULT, inplace_group_bound_s=0.5), CPU, make=Hanging)
    started = time.monotonic()
    groups.form(dist.HashStore(), 0, 2, 7)
    assert len(said) == 1, said
    at, line, status = said[0]
    assert 0.5 <= at - started < 2.5 and status == failures.EXIT_PEER_LOST
    assert line.startswith("error: ") and "\n" not in line and "INPLACE_GROUP_BOUND" in line, line
    assert "forming generation 7" in line


class NeverEnds(FakeNccl):
    """A group whose abort, or whose destructor, never returns (NVIDIA/nccl#1777: ncclCommAbort joining a
    proxy thread stuck in poll(); torch's destructor joining a watchdog that sleeps a minute)."""

    hang = "abort"
    release = threading.Event()     # set at the end of a test: no thread is left behind for good

    def abort(self) -> None:
        super().abort()
        if self.hang == "abort":
            NeverEnds.release.wait(60)

    def __del__(self) -> None:
        super().__del__()
        if self.hang == "destructor":
            NeverEnds.release.wait(60)


@pytest.fixture
def never_ends():
    NeverEnds.release, NeverEnds.hang = threading.Event(), "abort"
    yield NeverEnds
    NeverEnds.release.set()


@pytest.mark.parametrize("hang", ["abort", "destructor"])
def test_ending_a_group_whose_abort_or_destructor_never_returns_holds_the_caller_not_at_all(never_ends, hang):
    """The H200's survivor of a kill: its main thread waited in the end of the dead peer's group past
    INPLACE_GROUP_BOUND and left. Deliberate break: NcclGroups.end calling pg.abort() itself."""
    never_ends.hang = hang
    groups = NcclGroups(dataclasses.replace(DEFAULT, inplace_group_bound_s=30), CPU, make=never_ends)
    pg = groups.form(dist.HashStore(), 0, 2, 1)
    record = pg.record
    started = time.monotonic()
    groups.end(pg, None)
    del pg                  # the caller lets go: the last reference is the ending thread's
    assert time.monotonic() - started < 0.5
    assert record.aborted.wait(5), "the group was never aborted"
    if hang == "destructor":
        assert record.dropped.wait(5) and record.dropped_on == "end-inplace-1", record.dropped_on
    assert groups.ends.settle(timeout=0.3) is False      # still ending, in its own thread


def test_a_stuck_end_is_said_once_and_the_process_leaves_only_past_inplace_stuck_groups(never_ends):
    """Two groups stuck (INPLACE_STUCK_GROUPS=2): a warning each, the process trains on; the third ends
    it in one line, through the trainer's hook (its last step kept first)."""
    warned, left = [], []
    policy = dataclasses.replace(DEFAULT, inplace_group_bound_s=0.2, inplace_stuck_groups=2)
    groups = NcclGroups(policy, CPU, make=never_ends, stuck=left.append)
    groups.ends._warn = warned.append
    for g in (1, 2):
        groups.end(groups.form(dist.HashStore(), 0, 2, g), None)
    deadline = time.monotonic() + 5
    while len(warned) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert [w.split(":")[0] for w in warned] == ["warning"] * 2 and not left, (warned, left)
    assert "ending inplace-1's NCCL group did not return within 0.2 s (INPLACE_GROUP_BOUND)" in warned[0]
    assert groups.ends.stuck == 2
    groups.end(groups.form(dist.HashStore(), 0, 2, 3), None)
    while not left and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(left) == 1 and left[0].startswith("error: ending inplace-3's NCCL group did not return"), left
    assert "3 groups are stuck, more than INPLACE_STUCK_GROUPS=2" in left[0] and "\n" not in left[0]
    never_ends.release.set()            # they end after all: said, and no longer counted
    while groups.ends.ended < 3 and time.monotonic() < deadline + 5:
        time.sleep(0.02)
    assert groups.ends.ended == 3 and groups.ends.stuck == 0
    assert any("ended after all" in w for w in warned), warned


def test_groups_ended_normally_leave_no_thread_and_no_group_behind():
    """Thirty generations formed and ended: the process's threads and the groups alive are what they
    were after the first (each group's end thread and its bound's timer end with it)."""
    groups = NcclGroups(DEFAULT, CPU, make=FakeNccl)
    FakeNccl.made = []

    def generation(g: int) -> None:
        pg = groups.form(dist.HashStore(), 0, 1, g)
        groups.end(pg, None)

    generation(1)
    assert groups.ends.settle(timeout=5)
    threads_after_first = threading.active_count()
    for g in range(2, 31):
        generation(g)
    assert groups.ends.settle(timeout=10)
    deadline = time.monotonic() + 5     # the last end's thread and its bound's timer, on their way out
    while threading.active_count() > threads_after_first and time.monotonic() < deadline:
        time.sleep(0.02)
    assert threading.active_count() <= threads_after_first, [t.name for t in threading.enumerate()]
    assert all(m.dropped.is_set() and m.aborts == 1 for m in FakeNccl.made), "a group was kept or aborted twice"
    assert groups.ends.ended == 30 and groups.ends.stuck == 0


def test_the_survivor_of_a_peer_whose_group_never_ends_trains_on_in_a_new_generation(monkeypatch, fake_nccl, never_ends):
    """As the frozen-peer test below, with generation 1's abort never returning: the survivor's
    all-reduce fails on the silence, it re-forms alone at once and all-reduces there, while
    generation 1's group is still being ended in its own thread."""
    monkeypatch.setenv("JOB_SECRET", "s")
    monkeypatch.setattr("app.ft.inplace.groups_for",
                        lambda device, policy, stuck=None: NcclGroups(policy, CPU, make=never_ends, stuck=stuck))
    server = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False, timeout=timedelta(seconds=10))
    survivor, frozen = _member(f"127.0.0.1:{server.port}"), _member(f"127.0.0.1:{server.port}")
    try:
        forming = threading.Thread(target=frozen.start_step)
        forming.start()
        survivor.start_step()
        forming.join(30)
        weight = torch.nn.Parameter(torch.zeros(3))
        weight.grad = torch.ones(3)
        frozen.watch.stop()
        frozen_at = time.monotonic()
        survivor.average_gradients([weight], [])
        assert survivor.commit() is False
        survivor.start_step()           # generation 1's end does not return: the survivor is not held
        assert (survivor.gen, survivor.members) == (2, [survivor.member])
        assert time.monotonic() - frozen_at < DEFAULT.ft_heartbeat_timeout_s + 5.0
        second = fake_nccl[-1]
        threading.Timer(0.2, lambda: second.works[-1].done.set()).start()
        survivor.average_gradients([weight], [])
        assert survivor.commit() is True and survivor.errored is None
        assert not fake_nccl[0].dropped.is_set() and survivor.groups.ends.stuck == 0     # still ending, within its bound
    finally:
        never_ends.release.set()
        survivor.shutdown()
        frozen.shutdown()


def _past_the_bound(stuck: Callable[[str], None], said: list[str]) -> None:
    """A block that outlives a 0.2 s bound until `said` has a line (5 s at most); that line is the bound's."""
    groups = NcclGroups(dataclasses.replace(DEFAULT, inplace_group_bound_s=0.2), CPU, make=FakeNccl, stuck=stuck)
    with groups.bound("forming an NCCL group"):
        deadline = time.monotonic() + 5
        while not said:
            assert time.monotonic() < deadline, "nothing came of the bound"
            time.sleep(0.02)
    assert said[0].startswith("error: forming an NCCL group did not return within 0.2 s"), said


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
    import app.job
    from app.core.config import parse

    class Stop(Exception):
        pass

    seen: dict[str, str | None] = {}

    def setup(*args: object) -> None:
        seen.update({name: os.environ.get(name) for name in NCCL_ENVIRONMENT})
        raise Stop

    users = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
             "TORCH_NCCL_BLOCKING_WAIT": "1", "TORCH_NCCL_PROPAGATE_ERROR": "1", "NCCL_NVLS_ENABLE": "1",
             "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "15000", "TORCH_NCCL_ENABLE_MONITORING": "1"}
    for name, value in users.items():
        monkeypatch.setenv(name, value)     # restored after the test, whatever main() wrote
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(app.job.distributed, "setup", setup)
    with pytest.raises(Stop):
        app.job.main(parse(["--ft", mode, "--dataset", "digits", "--run-dir", str(tmp_path)]))
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


def test_a_group_the_caller_keeps_a_while_is_not_counted_stuck_and_ends_once_it_is_let_go_of():
    """An all-reduce ended by the watch hands its group over at once, and the member keeps it until its
    next generation forms (a round can take long): that wait is no stuck call (counted, three would end
    the process), and the destructor still runs in the end's own thread."""
    groups = NcclGroups(dataclasses.replace(DEFAULT, inplace_group_bound_s=0.2, inplace_stuck_groups=0), CPU,
                        make=FakeNccl, stuck=lambda line: pytest.fail(line))
    groups.ends._warn = lambda line: pytest.fail(line)
    kept = groups.form(dist.HashStore(), 0, 2, 4)
    record = kept.record
    groups.end(kept, None)
    assert record.aborted.wait(5)
    time.sleep(0.6)                     # three bounds
    assert groups.ends.stuck == 0 and groups.ends.ended == 0 and not record.dropped.is_set()
    del kept                            # the next generation formed: the member lets go
    assert record.dropped.wait(5) and record.dropped_on == "end-inplace-4"
    assert groups.ends.settle(timeout=5) and groups.ends.ended == 1
