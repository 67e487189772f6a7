"""The inplace membership protocol's choices (app/ft/protocol.py), one by one: whom a round names."""
from __future__ import annotations

import json

import pytest

from app.ft.protocol import Arrival, mutual

pytestmark = pytest.mark.unit


def _arrivals(cut: dict[str, str], steps: dict[str, int] | None = None) -> list[Arrival]:
    """Arrivals in the order of `cut`'s keys, each with the members (one letter each) it did not reach."""
    steps = steps or {}
    return [Arrival(m, f"{m}/0", steps.get(m, 7), f"{m}:1", tuple(unreached), samples=steps.get(m, 7) * 4)
            for m, unreached in cut.items()]


def _named(arrivals: list[Arrival]) -> str:
    return "".join(a.member for a in mutual(arrivals))


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


def test_a_slow_node_stepping_aside_is_named_only_where_nobody_else_is():
    import dataclasses

    from app.ft.protocol import fill, without_aside
    arrivals = _arrivals({"a": "", "b": "", "c": ""})
    arrivals[1] = dataclasses.replace(arrivals[1], aside=True)
    assert "".join(a.member for a in without_aside(arrivals)) == "ac"
    # With --full-size 2 the spare (c) takes the slow node's place, though b trained in the last generation.
    assert "".join(a.member for a in fill(without_aside(arrivals), {"a", "b"}, 2)) == "ac"
    alone = [dataclasses.replace(a, aside=True) for a in arrivals[:1]]
    assert without_aside(alone) == alone, "one node alone trains, slow or not"


def test_an_arrival_says_whether_it_steps_aside_under_its_proof():
    from app.ft import records
    arrival = Arrival("0123456789ab", "node1/0", 7, "10.0.0.2:1", (), 28, "", aside=True)
    said = "proof"
    line = json.dumps(records.arrival_record(arrival, said)).encode()
    assert records.arrival_of(line) == (arrival, said)
    assert records.arrival_text(arrival).endswith("/1")
    older = json.loads(line)
    del older["aside"]
    assert records.arrival_of(json.dumps(older).encode()) is None
