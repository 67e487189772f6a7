"""app/recovery/slow.py: a slow node named from its step times, what is told apart from a slow one, what
leaving it out gains, and when a flapping link's node may come back; over orders of events, with the
time passed in."""
from __future__ import annotations

from typing import Callable

import pytest
import torch

from app.recovery.slow import (SHARE, SLICES, Sample, Slow, SlowPeers, SlowWatch, estimate_without, faster,
                               returns_at)

pytestmark = pytest.mark.unit

FACTOR, WINDOW, BEAT = 2.0, 10.0, 0.25
STEP_S = 0.012          # an ordinary step outside the wait (the digits job's: 77 steps/s)

# A node's step time at a moment: (seconds per ordinary step or None, flags).
Course = Callable[[float], tuple[float | None, frozenset[str]]]


def steady(_: float) -> tuple[float | None, frozenset[str]]:
    return STEP_S, frozenset()


def slowed(at: float, until: float = float("inf"), times: float = 5.0) -> Course:
    """A node whose CPU quota is cut to 1/times from `at` to `until`."""
    return lambda t: (STEP_S * times if at <= t < until else STEP_S, frozenset())


def run(courses: dict[str, Course], until: float, start: float = 0.0,
        detector: SlowPeers | None = None) -> tuple[SlowPeers, list[tuple[float, str]]]:
    """Every node publishes each beat from `start` to `until`; what was said, when."""
    detector = detector or SlowPeers(FACTOR, WINDOW)
    said: list[tuple[float, str]] = []
    t = start
    while t <= until:
        for node, course in courses.items():
            compute, flags = course(t)
            detector.add(Sample(node, t, compute, flags))
        named, kept_up = detector.update(t)
        said += [(t, s.line()) for s in named] + [(t, f"node {n} keeps up again") for n in kept_up]
        t = round(t + BEAT, 6)
    return detector, said


def test_a_node_at_a_fifth_of_its_pace_is_named_once_within_the_window_and_keeps_up_after():
    detector, said = run({"a": steady, "b": slowed(25.0, until=115.0)}, until=140.0)
    (named_at, line), (back_at, back) = said
    # its mean ratio in the four slow slices, the oldest of them partly before the cut
    assert line == "node b is slow: its steps take 4.4x the others' for 10 s"
    # named once four of its window's five slices are slow (three whole and one mostly): 6-8 s after the
    # cut, well within the 15 s
    assert 25.0 + (SHARE - 1 / SLICES) * WINDOW <= named_at <= 25.0 + SHARE * WINDOW, named_at
    assert back == "node b keeps up again" and 115.0 < back_at <= 115.0 + WINDOW
    assert detector.named == {}


def test_among_three_the_slow_one_is_held_against_the_median_of_the_other_two():
    _, said = run({"a": steady, "b": slowed(0.0, times=1.5), "c": slowed(20.0, times=3.0)}, until=40.0)
    assert [line for _, line in said] == ["node c is slow: its steps take 2.4x the others' for 10 s"]


def test_the_others_waiting_for_a_slow_node_are_not_slow_and_a_node_as_slow_as_all_is_not_named():
    """Every node slowed alike (a host's load): no ratio moves."""
    _, said = run({"a": slowed(5.0, times=4.0), "b": slowed(5.0, times=4.0), "c": slowed(5.0, times=4.0)}, until=60.0)
    assert said == []


def busy(flag: str, every: float, lasting: float, times: float, marked: bool) -> Course:
    """A node whose steps take `times` as long for `lasting` seconds of every `every`, as the step clock
    publishes it: a beat whose steps were all marked with `flag` carries no time, only the flag
    (`marked` False: as if nothing told those steps apart)."""
    def course(t: float) -> tuple[float | None, frozenset[str]]:
        if t % every >= lasting:
            return STEP_S, frozenset()
        return (None, frozenset({flag})) if marked else (STEP_S * times, frozenset())
    return course


# Each kept up for most of the time, so that unmarked it would name the node: the marks are what keep it out.
BUSY = {"snapshot": (12.0, 11.0, 3.0),      # the steps just after a hand-over (on a GPU the arena's copy beside them)
        "eval": (20.0, 19.0, 4.0),          # evaluation's next steps (the train graph again)
        "epoch": (10.0, 9.5, 3.0)}          # the epoch's order and augmentation being made


@pytest.mark.parametrize("flag", sorted(BUSY))
def test_steps_after_a_snapshot_an_evaluation_or_an_epochs_data_are_left_out(flag):
    every, lasting, times = BUSY[flag]
    _, said = run({"a": steady, "b": busy(flag, every, lasting, times, marked=True)}, until=120.0)
    assert said == []
    _, said = run({"a": steady, "b": busy(flag, every, lasting, times, marked=False)}, until=120.0)
    assert said and said[0][1].startswith("node b is slow"), "the same steps unmarked name it"


def test_a_node_whose_saver_writes_beside_its_steps_is_not_named_a_node_slowed_throughout_is():
    """A ResNet-18's snapshot every 6 s written in 1.5 s by the saver process on the node's own cores:
    its steps 3x meanwhile, unflagged (a write in flight flags nothing: a slow writer's saver is slow
    too and would be in flight all the time). A quarter of the window is under SHARE."""
    saving = lambda t: (STEP_S * 3 if t % 6.0 < 1.5 else STEP_S, frozenset())
    _, said = run({"a": steady, "b": saving}, until=120.0)
    assert said == []
    _, said = run({"a": steady, "b": slowed(0.0, times=3.0)}, until=30.0)
    assert [line for _, line in said] == ["node b is slow: its steps take 3.0x the others' for 10 s"]


def test_a_burst_shorter_than_most_of_the_window_names_nobody_even_unflagged():
    """Another job's burst on a shared host, a saver's contention nobody flagged: under 6 s of 3x in a
    10 s window covers three of its five slices at most, wherever the window falls; 7 s may cover four."""
    _, said = run({"a": steady, "b": slowed(20.0, until=25.9, times=3.0)}, until=60.0)
    assert said == []
    _, said = run({"a": steady, "b": slowed(20.0, until=27.5, times=3.0)}, until=60.0)
    assert said[0][1].startswith("node b is slow: its steps take 2.8x")


def test_a_slow_node_whose_beats_read_fast_one_time_in_three_is_named_all_the_same():
    """A CPU quota stops a process for most of each 100 ms: a beat's few steps may miss a stop (one sample
    in three read as fast at a fifth of a core here). Each 2 s slice's mean is slow."""
    quota = lambda t: (STEP_S * (1.0 if round(t / BEAT) % 3 == 0 or t < 20.0 else 5.0), frozenset())
    _, said = run({"a": steady, "b": quota}, until=40.0)
    (named_at, line), = said
    assert named_at <= 20.0 + WINDOW and line == "node b is slow: its steps take 3.3x the others' for 10 s"


def test_a_node_in_its_first_steps_after_a_join_is_not_named_and_is_judged_only_after_a_window():
    """It starts its record afresh at the join (its earlier steps are not held against it), its flagged
    first steps carry no time, and its warm-up (4x for 3 s, unflagged) is under a window's share."""
    detector, said = run({"a": steady, "b": slowed(0.0, times=6.0)}, until=30.0)
    assert [line for _, line in said] == ["node b is slow: its steps take 6.0x the others' for 10 s"]

    def rejoined(t: float) -> tuple[float | None, frozenset[str]]:
        if t < 31.0:
            return None, frozenset({"join"})
        return (STEP_S * 4 if t < 34.0 else STEP_S), frozenset()

    detector, said = run({"a": steady, "b": rejoined}, start=30.25, until=80.0, detector=detector)
    assert said == [] and detector.named == {}


def test_a_newcomer_that_is_slow_from_its_first_step_is_named_a_window_after_it_joined():
    detector, said = run({"a": steady}, until=20.0)
    joined = lambda t: (None, frozenset({"join"})) if t < 20.5 else (STEP_S * 5, frozenset())
    _, said = run({"a": steady, "b": joined}, start=20.25, until=40.0, detector=detector)
    (named_at, line), = said
    assert named_at >= 20.5 + WINDOW and line.startswith("node b is slow")


def test_what_leaving_a_slow_node_out_gains_is_estimated_from_the_measured_times():
    """Two nodes, the job's step period 60 ms (everyone waits for b), a's own 12 ms, b's 58 ms: without b
    the step is about a's own, one share of the samples fewer: 2/0.06 = 33.3 node-steps/s with it,
    1/0.014 = 71.4 without."""
    gain = estimate_without(0.060, {"a": 0.012, "b": 0.058}, "b")
    assert (round(gain.with_pace, 1), round(gain.without_pace, 1)) == (33.3, 71.4) and gain.faster_without
    assert gain.line() == "node b: 33.3 node-steps/s with it, 71.4 without it (estimated from the step times): " \
                          "the job leaves it out"
    # Four nodes, one a bit slow: three quarters of the samples at a step barely shorter is no gain.
    gain = estimate_without(0.020, {"a": 0.015, "b": 0.015, "c": 0.016, "d": 0.019}, "d")
    assert not gain.faster_without and gain.line().endswith("the job keeps it")
    assert round(gain.without_pace, 1) == round(3 / 0.017, 1)


def test_with_the_collectives_own_cost_measured_the_estimate_holds_where_the_slow_node_stalls_inside_it():
    """The serial pass's case: three nodes, c at a tenth of a core. A quota stops c inside the all-reduce
    too, so its own time (0.13 s) is a third of the step (0.353 s): the difference alone read 8.4 node-steps/s
    without c against 8.5 with it, and kept it. With the overhead measured while no node was slow (0.05 s),
    a step without c is the others' own time plus that."""
    times = {"a": 0.013, "b": 0.014, "c": 0.13}
    kept = estimate_without(0.353, times, "c")
    assert round(kept.without_pace, 1) == 8.4 and not kept.faster_without
    gain = estimate_without(0.353, times, "c", overhead_s=0.05)
    assert round(gain.without_pace, 1) == round(2 / 0.064, 1) and gain.faster_without
    # Never slower than now: an overhead measured on a busier job does not make leaving a node out cost.
    assert estimate_without(0.02, {"a": 0.015, "d": 0.019}, "d", overhead_s=0.5).without_pace == 1 / 0.02


def test_no_time_measured_for_the_others_is_no_estimate_and_the_node_is_kept():
    """A named node whose peers have no time yet (all zero): it read 2000000000.0 node-steps/s without it."""
    gain = estimate_without(0.13, {"a": 0.0, "b": 0.0, "c": 0.5}, "c")
    assert gain.without_pace == 0.0 and not gain.faster_without


def test_the_collectives_cost_is_measured_in_rounds_where_no_node_is_slow_and_each_has_a_time(monkeypatch):
    """SharedPace keeps each healthy round's step period less its slowest node's own time; a round with a
    node named slow, or a node without a time (a join's), adds nothing. A round with an evaluation counts:
    a short epoch's job (the digits, 14 steps an epoch on three nodes) has one in nearly every round."""
    from app.ft import pace as pace_module
    from app.ft.pace import SharedPace

    clock = iter([0.0, 0.0, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0])     # each round: its due check, then its start
    monkeypatch.setattr(pace_module.time, "monotonic", lambda: next(clock))
    watch = SlowWatch(2.0, 10.0, 0.5, lambda line: None)
    shared = SharedPace(lambda: (None, frozenset()), lambda: watch, torch.device("cpu"))

    def round_of(steps: int, times: tuple[float, float], flags: int = 0) -> None:
        shared._steps = steps
        shared.shared([times[0], flags, 0.0, times[1], 0.0, 0.0], ["a", "b"])

    round_of(0, (0.02, 0.03))                   # the first round: no period yet
    assert shared.overhead_s is None
    round_of(20, (0.02, 0.03))                  # 1 s over 20 steps: 0.05 s a step, 0.02 s beyond b's own
    assert shared.overhead_s == pytest.approx(0.02)
    round_of(20, (-1.0, 0.03), flags=1)         # a just joined: no time of its own
    assert shared.overhead_s == pytest.approx(0.02)
    watch.peers.named["b"] = Slow("b", 4.0, 10.0, 0.12, 0.03)
    round_of(10, (0.02, 0.12))                  # b named slow: its round says nothing of the healthy cost
    assert shared.overhead_s == pytest.approx(0.02)


def test_a_measured_pace_counts_as_faster_only_beyond_the_margin():
    assert faster(106.0, 100.0) and not faster(104.0, 100.0) and not faster(90.0, 100.0)


# ---------------------------------------------------------------- a flapping link

STABLE = 20.0


def test_a_single_outage_however_long_comes_back_as_soon_as_its_link_is_up():
    assert returns_at([(0.0, True), (100.0, False), (160.0, True)], STABLE) == 160.0
    assert returns_at([(0.0, True), (100.0, False), (101.0, False)], STABLE) is None     # still down
    assert returns_at([(0.0, True)], STABLE) == 0.0


def test_a_node_cut_off_soon_after_it_first_joined_comes_back_as_soon_as_its_link_is_up():
    """A join is no return: a four-node job that formed in two rounds cut its late node off 5 s after it
    joined, and the node waited FLAP_STABLE past the heal (tests/test_data_path.py, 21 s for start-up + 1)."""
    assert returns_at([(0.0, True), (5.0, False), (30.0, True)], STABLE) == 30.0
    assert returns_at([(0.0, False), (10.0, True), (15.0, False), (30.0, True)], STABLE) == 30.0 + STABLE


def test_a_link_that_went_down_again_soon_after_it_came_back_is_held_until_it_stays_up():
    link = [(0.0, True), (100.0, False), (102.0, True), (106.0, False), (108.0, True)]
    assert returns_at(link, STABLE) == 108.0 + STABLE
    assert returns_at(link + [(110.0, True)], STABLE) == 108.0 + STABLE      # more ups: the same stretch


def flapping_link(t: float) -> bool:
    """The issue's flap: cut 2 s, healed 4 s, ten times, from t = 30; up before and after."""
    return not (30.0 <= t < 90.0 and (t - 30.0) % 6.0 < 2.0)


def test_a_flapping_link_costs_the_others_at_most_one_loss_and_one_return_per_stable_time():
    """The node is probed every half second while out; in the job, a cut loses it at once; it comes
    back when returns_at says. Every loss and return is a regroup for the others."""
    link: list[tuple[float, bool]] = []
    inside, regroups, t = True, [], 0.0
    while t < 200.0:
        up = flapping_link(t)
        link.append((t, up))
        if inside and not up:
            inside = False
            regroups.append(t)
        elif not inside and (at := returns_at(link, STABLE)) is not None and at <= t:
            inside = True
            regroups.append(t)
        t = round(t + 0.5, 6)
    # lost at the first cut, back at its heal (a single outage so far), lost again, then held until
    # the link has stayed up STABLE after the last heal
    assert regroups == [30.0, 32.0, 36.0, 86.0 + STABLE]
    assert all(later - earlier >= STABLE for earlier, later in zip(regroups[1::2], regroups[3::2]))


def test_the_watch_says_each_change_once_and_forgets_a_node_out_of_the_group_for_a_window():
    from app.recovery.slow import SlowWatch

    said: list[str] = []
    watch = SlowWatch(FACTOR, WINDOW, BEAT, said.append)
    t = 0.0
    while t < 30.0:
        if watch.due(t):
            watch.feed(t, [("a", STEP_S, frozenset()), ("b", STEP_S * 4, frozenset())])
        t = round(t + 0.05, 6)
    assert said == ["node b is slow: its steps take 4.0x the others' for 10 s"]
    assert watch.lost_s == pytest.approx(STEP_S * 3)
    while t < 45.0:                 # b left the group
        if watch.due(t):
            watch.feed(t, [("a", STEP_S, frozenset()), ("c", STEP_S, frozenset())])
        t = round(t + 0.05, 6)
    assert "b" not in watch.peers.named and watch.lost_s == 0.0 and len(said) == 1


def test_a_node_just_over_the_factor_is_named_once_not_named_and_kept_up_in_turn():
    """A fifth of a core read 2.2-2.5x in elastic mode's containers: its slices' means wander around k.
    Named once; it keeps up only at halfway from 1 to k."""
    wandering = lambda t: (STEP_S * (1.0 if t < 10.0 else 1.9 if 30.0 <= t < 42.0 else 2.5), frozenset())
    _, said = run({"a": steady, "b": wandering}, until=70.0)
    assert [line.split(":")[0] for _, line in said] == ["node b is slow"]
    _, said = run({"a": steady, "b": lambda t: (STEP_S * (2.5 if t < 30.0 else 1.4), frozenset())}, until=60.0)
    assert [line.split(":")[0] for _, line in said] == ["node b is slow", "node b keeps up again"]


# ---------------------------------------------------------------- what the slow node chooses (inplace)

def _choice(replace: int = 1):
    import dataclasses

    from app.core.policy import DEFAULT
    from app.ft.slow_nodes import StepAside
    return StepAside(dataclasses.replace(DEFAULT, slow_replace=replace, flap_stable_s=STABLE, slow_window_s=WINDOW))


SLOW_B = Slow("b", 4.8, WINDOW, 0.058, 0.012)
TIMES = {"a": 0.012, "b": 0.058}


def test_a_slow_node_steps_aside_for_a_waiting_spare_whatever_the_gain():
    choice = _choice().choose(SLOW_B, 0.0, 0.020, {"a": 0.015, "b": 0.019}, spare_waiting=True)
    assert choice.aside_s == STABLE
    assert choice.line == "node b steps aside for the waiting spare (4.8x the others' step time): it waits as a spare"
    leaves = _choice(replace=2).choose(SLOW_B, 0.0, 0.060, TIMES, spare_waiting=True)
    assert leaves.aside_s < 0 and leaves.line.endswith("it leaves the job")


def test_without_a_spare_a_slow_node_steps_aside_only_when_the_others_train_faster_without_it():
    choice = _choice().choose(SLOW_B, 0.0, 0.060, TIMES, spare_waiting=False)
    assert choice.aside_s == STABLE and choice.line.endswith("the job leaves it out; it comes back on trial in 20 s")
    keeps = _choice().choose(SLOW_B, 0.0, 0.020, {"a": 0.015, "b": 0.015, "c": 0.016, "d": 0.019}, False)
    assert keeps.aside_s == 0 and keeps.line.endswith("the job keeps it")
    off = _choice(replace=0).choose(SLOW_B, 0.0, 0.060, TIMES, spare_waiting=True)
    assert off.aside_s == 0 and off.line == ""


def test_a_node_named_again_soon_after_its_trial_stays_aside_twice_as_long_up_to_eight_times():
    aside = _choice()
    seconds = [aside.choose(SLOW_B, t, 0.060, TIMES, False).aside_s for t in (0.0, 40.0, 100.0, 200.0, 400.0)]
    assert seconds == [STABLE, 2 * STABLE, 4 * STABLE, 8 * STABLE, 8 * STABLE]
    # Named again long after its last trial (it kept up meanwhile): back to FLAP_STABLE.
    assert aside.choose(SLOW_B, 10_000.0, 0.060, TIMES, False).aside_s == STABLE
