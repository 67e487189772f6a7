"""The inplace membership protocol (app/ft/protocol.py) over orders of events: the simulation of
tests/inplace_sim.py runs the protocol's own flows against a simulated store, network and clock, and
checks the job's invariants after every event. Bulk runs over seeded schedules; hypothesis draws more
and shrinks a failing one to its shortest; and one schedule per order of events that broke the
protocol before (issue 51), each named by what it broke.

A failure prints the schedule and the trace; `python -m tests.inplace_sim --seed N` replays a seeded one."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.inplace_sim import Draws, Fault, Schedule, Violation, draw_schedule, seeded, simulate

pytestmark = pytest.mark.unit

SCHEDULES, CHUNKS = 10_000, 4       # seeded schedules in all, in chunks that xdist runs side by side


@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_every_invariant_holds_over_seeded_schedules(chunk):
    size = SCHEDULES // CHUNKS
    for seed in range(chunk * size, (chunk + 1) * size):
        try:
            simulate(seeded(seed))
        except Violation as violation:
            pytest.fail(f"seed {seed} (python -m tests.inplace_sim --seed {seed}): {violation}")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_every_invariant_holds_over_drawn_schedules(data):
    """hypothesis draws each choice of a schedule, so a failure shrinks to the fewest faults and nodes."""
    simulate(draw_schedule(Draws(lambda low, high: data.draw(st.integers(low, high)))))


# Orders of events that broke the protocol before issue 51, each with the invariant it broke.
CASES = {
    # 1: the job's end. Members that finish stop beating; the spare saw them silent, closed a round alone
    # and trained the whole job again.
    "a spare after the job's end": Schedule(3, 2, (), 3),
    # 1: a node held off by a cut when the job ends.
    "a node held off by a cut at the end": Schedule(3, 0, (Fault("cut", 1.0, (2,), 30.0),), 5),
    # 1: a node started into a finished job, on a disk without its snapshots: it trained the job again.
    "a node started into a finished job": Schedule(2, 0, (Fault("start_fresh", 14.0, (2,), None),), 1),
    # 2: a spare and a one-node cut, sides [A] and [B, S]: A won the tie with B and trained alone while B
    # and S, the larger side, were held off.
    "a spare on the larger side of a cut": Schedule(3, 2, (Fault("cut", 3.0, (0,), 8.0),), 0),
    # 3: a node that comes back while the members evaluate past INPLACE_ROUND_TIMEOUT closed the round
    # alone and trained its restored snapshot on a branch of its own.
    "a node back while the members evaluate": Schedule(2, 0, (Fault("kill", 1.0, (1,), 2.2),), 11, eval_s=6.0),
    # 4: after a store restart a fresh node took round 1, closed it alone and set `latest` below the
    # members' generation; the two groups trained apart.
    "a fresh node after a store restart": Schedule(2, 0, (Fault("store_restart", 4.0, (), 0.5),
                                                          Fault("start", 4.6, (2,), None)), 2),
    # Found by the simulator: a member frozen before the first generation formed woke after the others
    # trained, snapshotted and died, and trained its start state on (nobody trains on a state older than
    # the newest snapshot).
    "a member frozen from the start": Schedule(2, 0, (Fault("freeze", 1.2, (0,), 6.4),
                                                      Fault("kill", 6.3, (1,), 5.95)), 9045414, eval_s=6.0),
    # Found by the simulator: two members cut off from the store fenced nothing and kept training while a
    # spare that reached the store took over (two lineages).
    "members cut off from the store": Schedule(3, 2, (Fault("store_cut", 3.45, (0, 1), 4.3),
                                                      Fault("start", 5.5, (3,), None)), 1184694337),
    # Found by the simulator: a store restart while every member's beats were stale, each judged the other
    # silent and formed a generation alone.
    "both members back from a store outage": Schedule(3, 2, (Fault("store_restart", 3.1, (), 1.2),), 905525119),
    # Found by the simulator: a member frozen across a store restart came back to a job that had started
    # again in the new store; its older line must not win by its generation's number.
    "a member frozen across a store restart": Schedule(
        2, 0, (Fault("kill", 4.1, (0,), 4.2), Fault("store_restart", 5.95, (), 0.3),
               Fault("freeze", 5.95, (0, 1), 6.75), Fault("start", 10.0, (1,), None)), 441418898),
}


@pytest.mark.parametrize("case", CASES)
def test_an_order_of_events_that_broke_the_protocol_holds_now(case):
    sim = simulate(CASES[case])
    assert sim.done_at is not None or not any(not p.gone for p in sim.procs), sim.trace[-20:]


# What the slow-node and flapping-link rules choose (app/ft/protocol.py's aside and returns_at), with
# every invariant checked along the way: the nodes that train in a window of the simulated job.

def trained(sim, start: float, end: float) -> set[int]:
    return {node for t, node, _ in sim.commits if start <= t < end}


def test_a_slow_node_is_swapped_for_the_waiting_spare_and_waits_as_one():
    sim = simulate(Schedule(3, 2, (Fault("slow", 3.0, (0,), 6.0),), 1))
    assert trained(sim, 2.0, 3.0) == {0, 1}, "node 2 waits as the spare at first"
    assert trained(sim, 4.0, 11.0) == {1, 2}, "the spare trains in the slow node's place, at full size"
    assert trained(sim, 11.0, 99.0) == {1, 2}, "the slow node stays the spare once its time aside is over"


def test_a_slow_node_without_a_spare_is_left_out_then_taken_back_on_trial():
    sim = simulate(Schedule(3, 0, (Fault("slow", 3.0, (2,), 4.0),), 1))
    assert trained(sim, 4.0, 6.5) == {0, 1}
    assert trained(sim, 8.0, 99.0) == {0, 1, 2}, "back once its time aside is over"


def test_a_node_aside_when_the_job_ends_leaves_with_it():
    sim = simulate(Schedule(2, 0, (Fault("slow", 8.0, (1,), 30.0),), 1))
    assert trained(sim, 9.0, 99.0) == {0}
    assert sim.done_at is not None and all(p.gone for p in sim.procs)


def test_a_flapping_link_keeps_its_node_out_until_it_held_flap_stable():
    """Cut for 2 s every 6 s: back at once after the first cut; after the second (up for less than
    FLAP_STABLE before it) out until its link holds FLAP_STABLE, so the others form no more groups."""
    cuts = tuple(Fault("cut", 3.0 + 6.0 * i, (2,), 2.0) for i in range(3))
    sim = simulate(Schedule(3, 0, cuts, 0))
    generations = sorted({g for t, node, g in sim.commits if 9.0 <= t < 23.0})
    assert trained(sim, 6.5, 9.0) == {0, 1, 2}, "a single outage: back as soon as its link is"
    assert trained(sim, 12.0, 23.0) == {0, 1} and len(generations) <= 2, generations


def test_the_side_that_waited_out_an_even_cut_is_back_at_the_heal_not_held_as_flapping():
    """2|2: the losing side reached its own half of the last generation, then none of the winners' list;
    one outage all the same (found by test_data_path's even cut, held 20 s after its heal)."""
    sim = simulate(Schedule(4, 0, (Fault("cut", 3.0, (2, 3), 8.0),), 1))
    assert len(trained(sim, 5.0, 11.0)) == 2
    assert trained(sim, 14.0, 99.0) == {0, 1, 2, 3}


def test_a_node_cut_off_soon_after_it_joined_is_back_at_the_heal_not_held_as_flapping():
    """A job that formed in two rounds (node 2 started later, in generation 2 at 3.96 s) cuts node 2 off
    at 6.5 s: one outage, not a flap, so it is back at the heal at 8.5 s. The old rule held it past the
    job's end (found by test_data_path's 3|1 cut, held 20 s after its heal)."""
    sim = simulate(Schedule(2, 0, (Fault("start", 3.0, (2,), None), Fault("cut", 6.5, (2,), 2.0)), 1))
    assert 2 in trained(sim, 4.0, 6.5), "node 2 joined before the cut"
    assert trained(sim, 10.0, 99.0) == {0, 1, 2}
