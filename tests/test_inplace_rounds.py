"""Orders of events that broke inplace's rounds before issue 51, on the real driver: members in this
process (app/ft/inplace.py's InPlaceGroup, threads of their own) on a real store and real gloo groups,
the data path cut in the probes alone. The simulator (tests/test_inplace_sim.py) finds and checks the
same orders over its own store and network; these show the code that runs does what it says."""
from __future__ import annotations

import dataclasses
import threading
import time
from datetime import timedelta
from typing import Callable

import pytest
import torch
import torch.distributed as dist

from app.cluster.distributed import World
from app.core.policy import DEFAULT
from app.ft import inplace
from app.ft.inplace import InPlaceGroup
from app.ft.records import Keys, peek
from app.ft.replica import REPLICA_ENV

pytestmark = pytest.mark.unit

POLICY = dataclasses.replace(DEFAULT, inplace_round_timeout_s=1.0)
WHO = threading.local()        # the member a thread runs, for the cut's probes


def _store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False, timeout=timedelta(seconds=10))


def _member(monkeypatch, server: dist.TCPStore, node: str, stop: threading.Event, full_size: int = 0,
            policy=POLICY) -> InPlaceGroup:
    """A member of job "t" on its own node, whose state is its step alone; `stop` ends a spare's wait."""
    monkeypatch.setenv("JOB_SECRET", "s")
    monkeypatch.setenv(REPLICA_ENV, node)
    world = World(0, 0, 1, 1, torch.device("cpu"), 0)
    member: InPlaceGroup | None = None
    member = InPlaceGroup(world, policy, f"127.0.0.1:{server.port}", "t", lambda: {"train_state": {"step": member.step}},
                          lambda state: None, full_size=full_size, stopping=stop.is_set)
    return member


def _in_thread(member: InPlaceGroup, call: Callable[[InPlaceGroup], None]) -> threading.Thread:
    def run() -> None:
        WHO.member = member
        try:
            call(member)
        except Exception:       # a spare stopped at the test's end (Terminated)
            pass
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _step(member: InPlaceGroup) -> None:
    """One step: the membership's start, the all-reduce (which carries a wish for a new generation), commit."""
    member.start_step()
    parameter = torch.nn.Parameter(torch.zeros(3))
    parameter.grad = torch.ones(3)
    member.average_gradients([parameter], [])
    member.commit()


def _training(member: InPlaceGroup, stop: threading.Event) -> threading.Thread:
    return _in_thread(member, lambda m: [_step(m) for _ in iter(lambda: stop.is_set(), True)])


def _wait(condition: Callable[[], bool], seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _first_generation(members: list[InPlaceGroup]) -> None:
    threads = [_in_thread(m, lambda m: m.start_step()) for m in members]
    for thread in threads:
        thread.join(30)
    assert {m.gen for m in members} == {1} and all(len(m.members) == len(members) for m in members)


def test_a_spare_on_the_larger_side_of_a_cut_trains_with_it_and_the_lone_member_waits(monkeypatch):
    """--full-size 2, A and B train, S waits as the spare; the data path cut between A and {B, S} (the
    store reached by all). Before: A and B each arrived, the first (A) closed the round with a tie of one
    against one and won, and B and S, the larger side, were held off. Now S joins the round the others
    called, the closer waits for it (the largest set that reach one another is short of the full size),
    and B and S train; A waits as the spare."""
    server, stop = _store(), threading.Event()
    a, b, s = (_member(monkeypatch, server, node, stop, full_size=2) for node in ("nodeA", "nodeB", "nodeS"))
    try:
        _first_generation([a, b])
        spare = _in_thread(s, lambda m: m.start_step())
        _wait(lambda: s.member in a.listed_spares(server), 10, "S waiting as a spare")
        sides = {a.listener.address: "A", b.listener.address: "BS", s.listener.address: "BS"}
        side = {a.member: "A", b.member: "BS", s.member: "BS"}
        monkeypatch.setattr(inplace, "unreachable", lambda addresses, timeout_s: {
            x for x in addresses if sides[x] != side[WHO.member.member]})
        a._regroup_next = b._regroup_next = True        # as the cut's failed step leaves them
        lone = _in_thread(a, lambda m: m.start_step())
        time.sleep(0.3)                                 # A arrives first: the closer, as before
        other = _in_thread(b, lambda m: m.start_step())
        other.join(30)
        spare.join(30)
        assert b.gen == s.gen == 2 and sorted(b.members) == sorted(s.members) == sorted([b.member, s.member])
        assert lone.is_alive() and a.gen >= 2 and a.pg is None, "A waits (as the spare), training nothing"
    finally:
        stop.set()
        for m in (a, b, s):
            m.shutdown()


def test_a_node_that_comes_while_the_members_evaluate_waits_for_them_past_the_round_timeout(monkeypatch):
    """The members are away from a step boundary (an evaluation) for longer than INPLACE_ROUND_TIMEOUT
    (1 s here). Before: the newcomer closed the round alone at the timeout and trained its own state on a
    branch of its own. Now a round of newcomers alone waits for the last generation's members."""
    server, stop = _store(), threading.Event()
    a, b = (_member(monkeypatch, server, node, stop) for node in ("nodeA", "nodeB"))
    newcomer = _member(monkeypatch, server, "nodeN", stop)
    try:
        _first_generation([a, b])
        joining = _in_thread(newcomer, lambda m: m.start_step())
        time.sleep(3 * POLICY.inplace_round_timeout_s)      # the members evaluate
        assert newcomer.formed == 0 and joining.is_alive(), "the newcomer trained without the members"
        assert a.watch.wanted.is_set() and b.watch.wanted.is_set(), "asked in"
        steps = [_in_thread(m, lambda m: (_step(m), m.start_step())) for m in (a, b)]   # the wish's step, the round
        joining.join(30)
        for thread in steps:
            thread.join(30)
        assert newcomer.gen == a.gen == b.gen == 2 and len(newcomer.members) == 3
    finally:
        stop.set()
        for m in (a, b, newcomer):
            m.shutdown()


def _wipe(server: dist.TCPStore, keys: Keys, members: list[InPlaceGroup]) -> None:
    """Every key of the job, as a store restarted empty leaves them (the connections stay up)."""
    g = max(m.gen for m in members)
    names = [keys.latest(), keys.spares(), keys.done(), keys.incarnation()] + [keys.beat(m.member) for m in members]
    names += [k for r in range(g + 2) for k in (keys.closed(r), keys.arrivals(r), keys.end(r))]
    for name in names:
        server.delete_key(name)


def test_a_node_that_starts_after_the_store_lost_its_keys_joins_the_job_instead_of_starting_another(monkeypatch):
    """The store restarted empty while A and B train in generation 2. Before: a node started then found no
    `latest`, closed round 1 alone and trained, `latest` went back to 1, and two lineages trained apart.
    Now the members put `latest` back within a beat and the new node joins their next round."""
    server, stop = _store(), threading.Event()
    a, b = (_member(monkeypatch, server, node, stop) for node in ("nodeA", "nodeB"))
    fresh = None
    try:
        _first_generation([a, b])
        a._regroup_next = b._regroup_next = True
        for thread in [_in_thread(m, lambda m: m.start_step()) for m in (a, b)]:
            thread.join(30)
        assert a.gen == b.gen == 2
        trainers = [_training(m, stop) for m in (a, b)]
        _wipe(server, a.keys, [a, b])
        fresh = _member(monkeypatch, server, "nodeF", stop)
        trainers.append(_training(fresh, stop))
        _wait(lambda: fresh.formed > 0, 30, "the new node in a generation")
        assert len(fresh.members) == 3 and fresh.formed > 2, (fresh.formed, fresh.members)
        assert a.generation(peek(server, a.keys.latest())) >= fresh.formed
        stop.set()
        for thread in trainers:
            thread.join(30)
    finally:
        stop.set()
        for m in (a, b, fresh):
            if m is not None:
                m.shutdown()
