"""Which replica group writes a directory's snapshots and metrics rows: a lease that its holder renews
as it writes.

Groups on one host (or on hosts that share a disk) share the run and snapshot directories, and one
group writes each. A lock held for life is not enough: a group that hangs (a paused container, a
frozen process, a partition) keeps it while the others train on, and the rows and snapshots would
stop with it. So the writer is whoever holds a small lease file naming it and the time of its last
write; any group may take the lease once that is older than the heartbeat timeout, the same bound
after which the Lighthouse leaves a silent group out of the quorum. Two groups taking an expired
lease at the same moment may both write one row (readers keep the latest row per step,
app/reporting/metrics.py). Hosts that share a disk must have clocks that agree to well under the timeout.

The holder asks at every step, and a rewrite (a file written and renamed) cost 0.35 ms an ask here, so
it rewrites the lease only once RENEW_FRACTION of the timeout has passed since the last; every ask
still reads it, so a holder that lost it (a taker after a hang, the other of two takers) learns so at
its next ask, as before. A holder whose asks are more than the rest of the timeout apart may lose it
to a taker, as a silent one does.
"""
from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Callable

LEASE_FILE = ".ft-writer"
RENEW_FRACTION = 0.25   # of the timeout: how old the holder's own lease gets before it is rewritten


class WriterLease:
    """This group's claim on the directories it writes; `holds(directory)` before each write."""

    def __init__(self, holder: str, timeout_s: float, clock: Callable[[], float] = time.time) -> None:
        """clock: the wall clock the lease's times are on (every host sharing the disk reads the same)."""
        self.holder, self.timeout_s, self._clock = holder, timeout_s, clock

    def holds(self, directory: Path) -> bool:
        """Whether this group writes `directory` now: it held the lease, or the lease had expired."""
        path = directory / LEASE_FILE
        now = self._clock()
        holder, written = read_lease(path)
        if holder == self.holder and 0 <= now - written < RENEW_FRACTION * self.timeout_s:
            return True                 # renewed lately: nobody may take it for most of the timeout yet
        if holder != self.holder and now - written < self.timeout_s:
            return False
        tmp = path.with_name(f"{LEASE_FILE}.{re.sub(r'[^A-Za-z0-9_.-]', '_', self.holder)}.{os.getpid()}")
        try:
            directory.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps({"holder": self.holder, "time": now}))
            os.replace(tmp, path)      # atomic: a reader sees the old lease or the new one
        except OSError:
            # A full or read-only disk: the lease can be neither renewed nor taken. Its holder stays the
            # writer (its write then fails and says so in one warning, as in elastic mode, and the
            # job trains on); the others stay readers until one can write again.
            tmp.unlink(missing_ok=True)
            return holder == self.holder
        return read_lease(path)[0] == self.holder   # of two that took it at once, the last rename won


def read_lease(path: Path) -> tuple[str | None, float]:
    """(holder, time of its last write) of a lease file; (None, 0) where there is none yet."""
    try:
        lease = json.loads(path.read_text())
        return str(lease["holder"]), float(lease["time"])
    except (OSError, ValueError, KeyError, TypeError):
        return None, 0.0
