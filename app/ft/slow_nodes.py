"""What an inplace member does once its node is named slow (app/recovery/slow.py names it on every
node; only the slow node's first process acts, and only once per naming): step aside, or not.

    SLOW_REPLACE=0  nothing: the node is only named
    SLOW_REPLACE=1  with a spare waiting, the node steps aside and the spare takes its place in the
                    round that follows (the job trains at full size again); without one, it steps aside
                    only when the others alone would train faster, by the measured step times
                    (estimate_without); it comes back on trial once its time aside is over, and waits
                    as a spare where the job is at full size without it
    SLOW_REPLACE=2  the same, but the node leaves the job instead (its process ends, exit 0)

Its time aside is FLAP_STABLE, doubled each time it is named again soon after coming back (within
AGAIN_WINDOWS slow windows of training; at most ASIDE_DOUBLINGS times): a node that stays slow costs
the others two regroups and a window at its pace per trial, fewer and fewer of them.

How every member learns of it at the same step: the node puts its seconds aside (-1: it leaves) into
its slot of the step's all-reduce (app/ft/pace.py), and every member reads the sum; all regroup after
that step, and the node arrives at that round marked aside (protocol.Arrival.aside), which the closer
leaves out unless nobody else is there (protocol.without_aside). Pure: no store, torch or clock here.
"""
from __future__ import annotations

from dataclasses import dataclass

from app.core.policy import FaultPolicy
from app.recovery.slow import Gain, Slow, estimate_without

ASIDE_DOUBLINGS = 3     # a node named again and again stays aside FLAP_STABLE x 1, 2, 4, then 8 at most
AGAIN_WINDOWS = 3       # named again within this many windows of training after coming back: "again"
LEAVES = -1.0           # the seconds aside of a node that leaves the job (SLOW_REPLACE=2)


@dataclass(frozen=True)
class Choice:
    """What the slow node does: its seconds aside (0: it stays, LEAVES: it leaves) and why, in one line."""
    aside_s: float
    line: str


class StepAside:
    """The slow node's first process: whether it steps aside when its own node is named."""

    def __init__(self, policy: FaultPolicy) -> None:
        self.replace, self.base_s, self.window_s = policy.slow_replace, policy.flap_stable_s, policy.slow_window_s
        self.times = 0          # times it stepped aside, named again soon after each return
        self.chosen_for: Slow | None = None     # the naming it last chose on (one choice per naming)
        self._back_by = float("-inf")           # named before this, it is named "again"

    def choose(self, slow: Slow, now: float, step_s: float, compute_s: dict[str, float], spare_waiting: bool,
               overhead_s: float | None = None) -> Choice:
        """`now`: the caller's clock, seconds; `step_s`: the job's step period now (waits included);
        `compute_s`: each node's own time per step, outside the wait; `overhead_s`: a step's time beyond
        its slowest node's while none was slow (app/ft/pace.py)."""
        self.chosen_for = slow
        if not self.replace:
            return Choice(0.0, "")
        if now > self._back_by:
            self.times = 0
        leaves = self.replace == 2
        then = "leaves the job" if leaves else None
        if spare_waiting:
            return self._aside(leaves, f"node {slow.node} steps aside for the waiting spare ({slow.factor:.1f}x the "
                                       f"others' step time): it {then or 'waits as a spare'}", now)
        gain: Gain = estimate_without(step_s, compute_s, slow.node, overhead_s)
        if not gain.faster_without:
            return Choice(0.0, gain.line())
        return self._aside(leaves, f"{gain.line()}; it {then or f'comes back on trial in {self._seconds():.0f} s'}",
                           now)

    def _seconds(self) -> float:
        return self.base_s * 2 ** min(self.times, ASIDE_DOUBLINGS)

    def _aside(self, leaves: bool, line: str, now: float) -> Choice:
        seconds = LEAVES if leaves else self._seconds()
        # Named again by then (its time aside, a window to be judged again, and some windows of training): again.
        self._back_by = now + max(seconds, 0.0) + (1 + AGAIN_WINDOWS) * self.window_s
        self.times += 1
        return Choice(seconds, line)
