"""Who reaches whom over the data path (app/ft/reach.py): the probes and the round's choice of members."""
from __future__ import annotations

import time

import pytest

from app.ft.reach import Listener, Probe, mutual, unreachable

pytestmark = pytest.mark.unit


def _arrivals(cut: dict[str, str], steps: dict[str, int] | None = None) -> list[dict]:
    """Arrivals in the order of `cut`'s keys, each with the members (one letter each) it did not reach."""
    return [{"member": m, "step": (steps or {}).get(m, 7), "cut": list(unreached)} for m, unreached in cut.items()]


def _named(arrivals: list[dict]) -> str:
    return "".join(a["member"] for a in mutual(arrivals))


def test_nobody_cut_off_names_every_arrival_in_its_order():
    assert _named(_arrivals({"a": "", "b": "", "c": "", "d": ""})) == "abcd"


def test_a_node_cut_off_from_its_peers_is_left_out_whoever_reports_it():
    assert _named(_arrivals({"a": "d", "b": "d", "c": "d", "d": "abc"})) == "abc"
    assert _named(_arrivals({"d": "abc", "a": "", "b": "", "c": ""})) == "abc", "one side of each pair reports it"


@pytest.mark.parametrize("order", ["abcd", "cadb", "dcba", "bdca"])
def test_of_two_equal_sides_exactly_one_is_named_and_every_closer_names_the_same(order):
    """Whoever closes the round computes from the same arrivals: the same side, whole."""
    sides = {"a": "cd", "b": "cd", "c": "ab", "d": "ab"}
    arrivals = _arrivals({m: sides[m] for m in order})
    named = _named(arrivals)
    assert named in ("ab", "ba", "cd", "dc"), named
    assert _named(list(arrivals)) == named
    assert order[0] in named, "of equal sides, the one holding the first arrival (the closer's) goes on"


def test_of_two_equal_sides_the_one_ahead_goes_on():
    """A side whose members committed a step the other did not keeps it: no committed step is lost."""
    sides = {"a": "cd", "b": "cd", "c": "ab", "d": "ab"}
    assert set(_named(_arrivals(sides, steps={"a": 7, "b": 7, "c": 8, "d": 8}))) == {"c", "d"}


def test_the_largest_side_of_a_partition_in_three_goes_on():
    cut = {"a": "def", "b": "def", "c": "def", "d": "abcf", "e": "abcf", "f": "abcde"}
    assert _named(_arrivals(cut)) == "abc"


def test_one_cut_link_costs_one_of_its_ends():
    named = _named(_arrivals({"a": "d", "b": "", "c": "", "d": "a"}))
    assert len(named) == 3 and "bc" in named


def test_a_listener_is_reached_and_a_closed_one_is_not():
    listener, gone = Listener("127.0.0.1"), Listener("127.0.0.1")
    gone.close()
    try:
        assert unreachable([listener.address, gone.address], 2.0) == {gone.address}
        assert unreachable(["no-such-host.invalid:1", "127.0.0.1:x"], 2.0) == {"no-such-host.invalid:1", "127.0.0.1:x"}
    finally:
        listener.close()


def test_many_probes_at_once_are_all_answered():
    """A whole job's members probing one member at the same moment (the listener's backlog)."""
    listener = Listener("127.0.0.1")
    try:
        assert unreachable([listener.address] * 300, 2.0) == set()
        probes = [Probe([listener.address], 2.0) for _ in range(300)]
        assert all(p.result(2.0) == set() for p in probes)
    finally:
        listener.close()


def test_a_probe_never_blocks_its_caller_and_ends_at_its_timeout():
    """A connect that is never answered (a full accept queue drops the SYN, as a cut link does): pending
    at first, unreachable at the timeout."""
    import socket

    with socket.create_server(("127.0.0.1", 0), backlog=0) as full, socket.create_connection(full.getsockname()):
        address = "127.0.0.1:%d" % full.getsockname()[1]
        started = time.monotonic()
        probe = Probe([address], 0.3)
        assert probe.result() is None and time.monotonic() - started < 0.25     # not the 0.3 s timeout
        while (failed := probe.result(0.05)) is None:
            pass
        assert failed == {address} and 0.3 <= time.monotonic() - started < 2.0
