"""Where one process's start-up seconds go, from its exec to its first training step.

Every (re)start of a worker pays them again, so they are most of a recovery's cost; the start row
of metrics.jsonl carries them, and the chaos runner puts them next to the seconds before the process
existed (detection, the agent's restart and rendezvous) to show where each recovery's time went.
"""
from __future__ import annotations

import os
import time
from typing import Sequence


def process_started() -> float:
    """Wall-clock time at which this process was exec'd (Linux /proc, 10 ms ticks); now elsewhere."""
    try:
        with open("/proc/self/stat") as f:
            # Fields after the command name (which may hold spaces); starttime is field 22 of the
            # whole line, clock ticks after boot.
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime_s = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return time.time()
    return time.time() - (uptime_s - start_ticks / os.sysconf("SC_CLK_TCK"))


class StartupClock:
    """Named phases of a start, each ending at its mark: clock.mark("data") after loading the data.

    `marks`: phases that ended before the clock was made, (name, wall-clock end): the entry point's
    interpreter and imports, marked as its module loaded."""

    def __init__(self, marks: Sequence[tuple[str, float]] = ()) -> None:
        self.started = process_started()
        self._marks = list(marks)

    def mark(self, phase: str) -> None:
        self._marks.append((phase, time.time()))

    def seconds(self) -> dict[str, float]:
        """Each phase's seconds, in order; the first runs from the exec."""
        out, previous = {}, self.started
        for phase, at in self._marks:
            out[phase] = round(at - previous, 3)
            previous = at
        return out
