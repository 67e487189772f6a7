"""Which replica group writes a directory's snapshots and metrics rows: a lease that its holder renews
as it writes.

Groups on one host (or on hosts that share a disk) share the run and snapshot directories, and one
group writes each. A lock held for life is not enough: a group that hangs (a paused container, a
frozen process, a partition) keeps it while the others train on, and the rows and snapshots would
stop with it. So the writer is whoever holds a small lease file naming it and the time of its last
write; any group may take the lease once that is older than the heartbeat timeout, the same bound
after which the Lighthouse leaves a silent group out of the quorum. A take reads and rewrites the
lease under a flock, so of two groups asking at once (every node at a job's first step) one takes
it and the other reads it taken: both wrote the first row before (a docker-tier test of warm spares
saw step 1 twice in 2 of 3 runs). Hosts that share a disk over a network file system need its
locks, and clocks that agree to well under the timeout.

The holder asks at every step, and a rewrite (a file written and renamed) cost 0.35 ms an ask here, so
it rewrites the lease only once RENEW_FRACTION of the timeout has passed since the last; every ask
still reads it, so a holder that lost it (a taker after a hang, the other of two takers) learns so at
its next ask, as before. A holder whose asks are more than the rest of the timeout apart may lose it
to a taker, as a silent one does.
"""
from __future__ import annotations

import fcntl
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
        holder, written = read_lease(path)
        decided = self._decided(holder, written, self._clock())
        if decided is not None:
            return decided              # no write: the lock is only taken to renew or take the lease
        try:
            directory.mkdir(parents=True, exist_ok=True)
            with open(path.with_name(LEASE_FILE + ".lock"), "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)    # released with the file: one take at a time
                holder, written = read_lease(path)
                now = self._clock()
                decided = self._decided(holder, written, now)
                if decided is False:
                    return False        # another took it since the read above
                self._write(path, now)
                return True
        except OSError:
            # A full or read-only disk: the lease can be neither renewed nor taken. Its holder stays the
            # writer (its write then fails and says so in one warning, as in elastic mode, and the
            # job trains on); the others stay readers until one can write again.
            return holder == self.holder

    def _decided(self, holder: str | None, written: float, now: float) -> bool | None:
        """True: this group holds a lease renewed lately; False: another holds a live one; None: this
        group renews it or takes it (it is its own and due, or expired, or there is none)."""
        if holder == self.holder and 0 <= now - written < RENEW_FRACTION * self.timeout_s:
            return True                 # renewed lately: nobody may take it for most of the timeout yet
        if holder != self.holder and now - written < self.timeout_s:     # none: written 0, long expired
            return False
        return None

    def _write(self, path: Path, now: float) -> None:
        tmp = path.with_name(f"{LEASE_FILE}.{re.sub(r'[^A-Za-z0-9_.-]', '_', self.holder)}.{os.getpid()}")
        try:
            tmp.write_text(json.dumps({"holder": self.holder, "time": now}))
            os.replace(tmp, path)      # atomic: a reader sees the old lease or the new one
        finally:
            tmp.unlink(missing_ok=True)


def read_lease(path: Path) -> tuple[str | None, float]:
    """(holder, time of its last write) of a lease file; (None, 0) where there is none yet."""
    try:
        lease = json.loads(path.read_text())
        return str(lease["holder"]), float(lease["time"])
    except (OSError, ValueError, KeyError, TypeError):
        return None, 0.0
