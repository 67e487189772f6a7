"""When a peer that beats through a store counts as gone: the one silence detector of the elastic
heartbeat (app/recovery/heartbeat.py, a rank's count in the job's store) and of inplace mode
(app/ft/inplace.py, a member's signed beat).

A peer is silent once `timeout_s` has passed, as this process saw it, without a higher beat count
than the last it showed. Only a higher count is a sign of life: the counts only grow (the heartbeat's
store counter is only ever added to, under a prefix fresh at every start; a member counts its own
beats, from one for the process's whole life), so a lower or equal one is a value replayed or
forged, and none at all is no beat. A store that restarts loses the counts with everything else:
elastic mode's agents leave with it; inplace mode's watch, finding `latest` gone, judges no silence
and asks for a new generation, which starts a Silence of its own.
"""
from __future__ import annotations

import threading
import time
from typing import Hashable


class Silence:
    """How many beats each peer had shown, and when that last grew, as this process saw it (the
    threads that look at one peer may differ: inplace's watch and a closing round)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._last: dict[Hashable, tuple[int | None, float]] = {}
        self._lock = threading.Lock()

    def is_silent(self, peer: Hashable, count: int | None, now: float | None = None) -> bool:
        """Whether `peer`, whose beat count reads `count` now (None: no valid beat), is silent. Its
        first sight starts its clock. `now`: the monotonic time of the reading (inplace's protocol
        passes its own, which a simulation runs); the process's clock by default."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if peer not in self._last:
                self._last[peer] = (count, now)
                return False
            last, since = self._last[peer]
            if count is not None and (last is None or count > last):
                self._last[peer] = (count, now)
                return False
        return now - since >= self.timeout_s
