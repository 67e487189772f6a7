"""Slow peers: a node alive and beating whose steps take much longer than the others' is named; what
leaving it out would gain; when a node whose link flaps may come back.

Pure: no store, no threads, no clock of its own. Every time is passed in, in the caller's seconds,
so the rules are tested over orders of events. Elastic mode's heartbeat (app/recovery/heartbeat.py),
torchft mode's replica group (app/ft/replica.py) and inplace mode feed it samples.

What a node publishes. In a synchronous job every member's step takes the same wall time: each waits
at the all-reduce for the slowest. So the wall time says nothing of who is slow; the time a step
takes outside the collective's wait (the step's data, forward, backward, optimizer) does
(app/training/step_time.py measures it). A sample is the mean of that over the node's ordinary
steps since its last sample. A step that is not an ordinary one is left out, and named by its flag:

    snapshot  the first step after a snapshot was handed to the saver (on a GPU its copy runs beside it)
    eval      the first step after an evaluation (the training graph and caches come back)
    join      the first steps after the process started, healed or came into a group (page faults,
              warm-up); a sample with it also starts the node's record afresh
    epoch     the first step of an epoch: the epoch's order and augmentation are made just before it

When a node is slow. Each ordinary sample of a node gives a ratio: its time over the median of the
others' latest ordinary times (none older than the window). The window [t - window, t] is cut into
SLICES slices, and a node is slow at time t when in at least SHARE of them the mean of its ratios is
above the factor k, its record spanning the window: a node is judged on a whole window of its own
steps, so one that just joined (or whose steps were all flagged) is not judged until it has one.
Slices, not single samples: a CPU quota stops a process for most of each 100 ms, and a beat's few
steps may miss a stop and read as fast (one sample in three did, a node held to a fifth of a core by
SIGSTOP/SIGCONT in 100 ms periods); a slice of 2 s holds many stops. Judged on single samples, that
node (in elastic mode, not rank 0's) was named after 36 s once and not within 40 s once; on slices,
after 7.0-7.5 s in four runs (this 2-core machine, 2026-11-28). A burst that covers fewer than
SHARE x SLICES slices (under 6 s of a 10 s window: the saver writing a snapshot beside the steps,
another job's burst on a shared host) names nobody, and a slow node's dip under k in one slice does
not restart its window. A named node keeps up again once in SHARE of the slices its mean ratio is at
or under halfway from 1 to k (1.5 for k = 2): a node just over k (a fifth of a core read 2.2-2.5x in
elastic mode's containers, its own share of the collectives' work counted as wait) would otherwise
be named, kept up and named again within seconds. Named with its mean ratio in the slices it was
slow in.
"""
from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

FLAGS = ("snapshot", "eval", "join", "epoch")
SLICES = 5          # a window's slices (2 s of the default 10 s window)
SHARE = 0.8         # of the slices whose mean ratio must be above k (or, to keep up, at or under it)
MIN_SAMPLES = 5     # a window judged on fewer samples than this judges nothing
# Leaving a node out costs a regroup, and taking it back another: only a clear gain is worth them.
MARGIN = 0.05


@dataclass(frozen=True)
class Sample:
    """One node's step time, as published at `time`: seconds per ordinary step outside the collective
    wait (None: none of its steps since its last sample was an ordinary one) and the flags of those
    that were not."""
    node: str
    time: float
    compute_s: float | None
    flags: frozenset[str] = field(default_factory=frozenset)


@dataclass(frozen=True)
class Slow:
    """A node named slow: the median of its ratios to the others over the window, the window, and the
    medians of its step times and of the others' (seconds per step, outside the wait)."""
    node: str
    factor: float
    window_s: float
    compute_s: float
    others_s: float

    def line(self) -> str:
        return f"node {self.node} is slow: its steps take {self.factor:.1f}x the others' for {self.window_s:.0f} s"


class SlowPeers:
    """The nodes' samples over the last window, and which nodes are named slow."""

    def __init__(self, factor: float, window_s: float) -> None:
        self.factor, self.window_s = factor, window_s
        self._latest: dict[str, tuple[float, float]] = {}               # node -> (time, compute_s)
        self._ratios: dict[str, deque[tuple[float, float, float]]] = {}  # node -> (time, ratio, compute_s)
        self._since: dict[str, float] = {}                               # node -> its record's first ratio
        self.named: dict[str, Slow] = {}

    def add(self, sample: Sample) -> None:
        """One node's sample; the ratio it gives against the others' latest."""
        node, now = sample.node, sample.time
        if "join" in sample.flags:
            self.forget(node)
        if sample.compute_s is None:
            return
        self._latest[node] = (now, sample.compute_s)
        others = self._others(node, now)
        if not others:
            return
        ratios = self._ratios.setdefault(node, deque())
        ratios.append((now, sample.compute_s / max(statistics.median(others), 1e-9), sample.compute_s))
        self._since.setdefault(node, now)
        while ratios and ratios[0][0] < now - self.window_s:
            ratios.popleft()

    def forget(self, node: str) -> None:
        """A node that left, or came back: nothing of its past record is held against it."""
        for record in (self._latest, self._ratios, self._since, self.named):
            record.pop(node, None)

    def update(self, now: float) -> tuple[list[Slow], list[str]]:
        """The nodes named slow at `now` that were not, and those named before that keep up again."""
        named, kept_up = [], []
        for node in list(self._ratios):
            window = self._window(node, now)
            if window is None:
                continue
            above, under = self._slices(window, now)
            if node not in self.named and len(above) >= SHARE * SLICES:
                self.named[node] = self._verdict(node, above, window, now)
                named.append(self.named[node])
            elif node in self.named and under >= SHARE * SLICES:
                del self.named[node]
                kept_up.append(node)
        return named, kept_up

    def compute_s(self, now: float) -> dict[str, float]:
        """Each node's median step time over the window (seconds per ordinary step, outside the wait)."""
        windows = {node: self._window(node, now, whole=False) for node in self._ratios}
        return {node: statistics.median(c for _, _, c in window) for node, window in windows.items() if window}

    def _others(self, node: str, now: float) -> list[float]:
        return [c for other, (at, c) in self._latest.items() if other != node and at >= now - self.window_s]

    def _window(self, node: str, now: float, whole: bool = True) -> list[tuple[float, float, float]] | None:
        """The node's ratios in [now - window, now], if its record spans the window (`whole`) and has enough."""
        if whole and self._since.get(node, now) > now - self.window_s:
            return None
        window = [r for r in self._ratios.get(node, ()) if now - self.window_s <= r[0] <= now]
        return window if len(window) >= MIN_SAMPLES else None

    def _slices(self, window: list[tuple[float, float, float]], now: float) -> tuple[list[list[float]], int]:
        """The ratios of the window's slices whose mean is above k, and how many slices have a mean that
        keeps up (at or under halfway from 1 to k); a slice without a sample is neither."""
        width, start = self.window_s / SLICES, now - self.window_s
        slices = [[r for at, r, _ in window if start + i * width <= at < start + (i + 1) * width
                   or (i == SLICES - 1 and at == now)] for i in range(SLICES)]
        keeps_up = 1 + (self.factor - 1) / 2
        above = [ratios for ratios in slices if ratios and statistics.fmean(ratios) > self.factor]
        return above, sum(1 for ratios in slices if ratios and statistics.fmean(ratios) <= keeps_up)

    def _verdict(self, node: str, above: list[list[float]], window: list[tuple[float, float, float]],
                 now: float) -> Slow:
        """Named with the mean ratio in the slices it was slow in: how much slower while slow (a mean, as the
        slices are judged: a quota's stops make a few samples long and leave the others short)."""
        # The others' medians over the window; those without enough samples there yet (joined lately): their
        # latest times, which the ratios were taken against.
        others = [c for other, c in self.compute_s(now).items() if other != node] or self._others(node, now)
        return Slow(node, statistics.fmean(r for ratios in above for r in ratios), self.window_s,
                    statistics.median(c for _, _, c in window), statistics.median(others) if others else 0.0)


class SlowWatch:
    """A process's watch over its peers' step times: samples in (at most one round per `every_s`), one
    line per node named or keeping up again (`say`), and `lost_s`: the seconds each step now waits for
    the nodes named slow beyond the slowest other node's own time (goodput's slow_peer). The mode's
    membership feeds it (elastic: the heartbeat; torchft: the numbers riding each step's all-reduce)."""

    def __init__(self, factor: float, window_s: float, every_s: float, say: Callable[[str], None]) -> None:
        self.peers = SlowPeers(factor, window_s)
        self.every_s, self.say = every_s, say
        self.lost_s = 0.0
        self._fed = float("-inf")
        self._seen: dict[str, float] = {}       # node -> the last round it was in

    def due(self, now: float) -> bool:
        """Whether a round of samples is wanted now."""
        return now - self._fed >= self.every_s

    def feed(self, now: float, samples: Iterable[tuple[str, float | None, frozenset[str]]]) -> None:
        """One round: each node's (name, compute_s, flags) at `now`."""
        self._fed = now
        for node, compute_s, flags in samples:
            self.peers.add(Sample(node, now, compute_s, flags))
            self._seen[node] = now
        for node in [n for n, at in self._seen.items() if at < now - self.peers.window_s]:
            del self._seen[node]        # out of the group for a window: its record goes, said or not
            self.peers.forget(node)
        named, kept_up = self.peers.update(now)
        for slow in named:
            self.say(slow.line())
        for node in kept_up:
            self.say(f"node {node} keeps up again")
        self.lost_s = self._lost(now)

    def _lost(self, now: float) -> float:
        if not self.peers.named:
            return 0.0
        medians = self.peers.compute_s(now)
        slow = [c for node, c in medians.items() if node in self.peers.named]
        others = [c for node, c in medians.items() if node not in self.peers.named]
        return max(0.0, max(slow) - max(others)) if slow and others else 0.0


# ---------------------------------------------------------------- what leaving a node out gains

@dataclass(frozen=True)
class Gain:
    """The job's pace (node-steps per second: each node trains one share of a step's samples, so this
    is images per second over the images per node) with every node now, measured, and without `node`,
    estimated from measurements (estimate_without)."""
    node: str
    with_pace: float
    without_pace: float

    @property
    def faster_without(self) -> bool:
        return faster(self.without_pace, self.with_pace)

    def line(self) -> str:
        """What the job chose and why, in one line."""
        chose = "leaves it out" if self.faster_without else "keeps it"
        return (f"node {self.node}: {self.with_pace:.1f} node-steps/s with it, {self.without_pace:.1f} without it "
                f"(estimated from the step times): the job {chose}")


def estimate_without(step_s: float, compute_s: Mapping[str, float], node: str,
                     overhead_s: float | None = None) -> Gain:
    """The pace with every node and without `node`, from what the members measured: `step_s` the job's
    step period now (wall time per step, waits included), `compute_s` each node's time per step outside
    the wait, `overhead_s` what a step took beyond its slowest node's own time while no node was slow
    (the collective and each step's share of the work between steps: app/ft/pace.py; None: not measured yet).

    With the overhead measured, a step without `node` takes the slowest other's own time plus it (never
    longer than now). Without it: every other node waits at the all-reduce for `node` beyond what the
    slowest other needs itself, so the step would be shorter by that, never shorter than the slowest
    other's own time. The second underestimates the gain where the slow node also stalls inside the
    collective (a CPU quota stops it there too: at a tenth of a core its own time was 0.13 s of a
    0.35 s step); the first does not depend on where it stalls. One node's share of each step's samples
    fewer either way. No time measured for the others: no estimate, the node is kept."""
    others = [c for other, c in compute_s.items() if other != node]
    with_pace = len(compute_s) / step_s if step_s > 0 else 0.0
    if not others or step_s <= 0 or max(others) <= 0:
        return Gain(node, with_pace, 0.0)
    slowest_other = max(others)
    if overhead_s is not None:
        step_without = min(step_s, slowest_other + overhead_s)
    else:
        step_without = max(step_s - max(0.0, compute_s[node] - slowest_other), slowest_other)
    return Gain(node, with_pace, len(others) / step_without)


def faster(pace: float, than: float) -> bool:
    """Whether a measured pace beats another by more than MARGIN: leaving a node out (or taking it back)
    is worth its regroup only then."""
    return pace > than * (1 + MARGIN)


# ---------------------------------------------------------------- a flapping link

def returns_at(link: Iterable[tuple[float, bool]], stable_s: float) -> float | None:
    """When a node may come back into the job, from what was seen of its link: (time, up) in time order,
    down where it was lost from a group or a probe to its peers failed, up where a probe or a join
    got through. None while its link is down.

    A node whose link came back and was up for less than `stable_s` before it went down again flaps: it
    may come back only once its link has stayed up `stable_s`. Any other (a single outage, however long,
    and one soon after the node first joined: a join is no return) comes back as soon as its link is up.
    So once a link has flapped, its node comes back at most once per `stable_s`, and the others pay at
    most one loss and one return (two regroups) per `stable_s`."""
    link = list(link)
    periods: list[list[float]] = []     # [first up, first down after it] of each stretch the link was up
    down = True
    for time, up in link:
        if up and down:
            periods.append([time, float("inf")])
        elif not up and not down:
            periods[-1][1] = time
        down = not up
    if down or not periods:
        return None
    current = periods[-1][0]
    if len(periods) < 2:
        return current
    first, last = periods[-2]
    # The stretch before the last outage began with a return unless it is the record's first and the
    # record began with it up (the join). A member keeps its changes only, an even number of them
    # (protocol.LINK_KEPT), so a record cut short and up at its end begins with a down.
    returned = len(periods) > 2 or not link[0][1]
    return current + stable_s if returned and last - first < stable_s else current

