"""How many intra-op compute threads a training process on CPU runs: its share of its host's cores.

torch's default is a thread for every core the process may use, so N training processes on one host
(two nodes started by hand, node containers, two jobs) each take them all, and their steps wait on
each other: two nodes of one process each trained at a third of their pace (issue 28).

The division: an explicit count wins (--threads, else OMP_NUM_THREADS). Otherwise every core is
split evenly among the training processes of the host that may run on it, and a process gets the
whole cores of its part, at least one (threads()). So one process alone on a host gets every core
it may use; N processes that may all use the same C cores get C // N each; node containers, which
each run on cores of their own (docker/entrypoint.sh claims them, app/node.py's cpu_plan), divide
their node's cores among their processes only.

How a process learns who shares its host: every training process on CPU enters itself in a
directory in /dev/shm (HostShare): one file per process that names the cores it may run on, under
an exclusive flock held for the process's life. The kernel drops the lock when the process dies,
however it dies, so the live entries are exactly the files whose lock cannot be taken. /dev/shm
belongs to the host (node containers share it: compose gives them `ipc: host`); the run directory
may not. Why not the process group: in the survivor modes every node is a process group of its
own, and a host-wide count also covers two jobs on one host and nodes of other jobs. The count is
taken after the process group is joined (every process of an elastic round has entered itself by
then, and elastic mode starts new processes on every membership change) and again whenever a
survivor mode's membership changes (app/ft/trainer.py): a node that comes or goes later moves no
thread count in between. A process whose entry cannot be written counts itself alone, with a warning.

Which cores a node runs on: node containers claim an equal part of the host's each (a lock file per
core, docker/entrypoint.sh). A node that may wait as a warm spare (inplace's --full-size) claims
none at its start: its training processes claim their part when the job names them (CoreClaim) and
give it back when they wait, so a spare that joins runs on the cores of the node it replaces (whose
locks went with its processes) and a node back while the job is full holds none.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import sys
import uuid
from collections import Counter
from fractions import Fraction
from pathlib import Path
from typing import IO, Callable, Collection, Iterable, Iterator, Mapping

from app.core.errors import UserError

REGISTRY = Path("/dev/shm/ftt-cpu-share")     # one file per live training process on CPU
OMP_ENV = "OMP_NUM_THREADS"
# Set by docker/entrypoint.sh for a node of a job with spares, instead of claiming cores itself: the
# folder of the host's core locks, and how many cores the node claims (CoreClaim).
CLAIM_LOCKS_ENV, CLAIM_CORES_ENV = "NODE_CORE_LOCKS", "NODE_CORE_CLAIM"


def threads(own: Collection[int], explicit: int | None, host: Iterable[Collection[int]]) -> int:
    """Compute threads for a process that may run on the cores `own`, given the cores of every training
    process on its host (itself included): `explicit` if given; else, with every core split evenly
    among the processes that may run on it, the whole cores of this process's part, at least one.
    The processes of one host then never sum to more threads than its cores, unless there are more
    processes than cores (each still gets one)."""
    if explicit:
        return explicit
    sharing = Counter(core for cores in host for core in set(cores))
    part = sum((Fraction(1, max(1, sharing[core])) for core in set(own)), Fraction(0))
    return max(1, int(part))


def explicit_threads(setting: int, environ: Mapping[str, str]) -> int | None:
    """The count the user gave: --threads (0: none), else OMP_NUM_THREADS (its first level, as
    OpenMP reads "4,2"); None when neither."""
    if setting:
        return setting
    raw = environ.get(OMP_ENV, "").strip()
    if not raw:
        return None
    first = raw.split(",")[0].strip()
    if not first.isdigit() or int(first) < 1:
        raise UserError(f"environment variable {OMP_ENV}={raw!r}: expected a positive number of threads "
                        "(or leave it unset: each training process then takes its share of the host's cores)")
    return int(first)


def pin_process(cores: Collection[int]) -> None:
    """Run every thread of this process on `cores`: sched_setaffinity moves one thread, and torch's
    compute threads already run (threads started later take their starter's cores)."""
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):      # a thread that ended meanwhile
            os.sched_setaffinity(int(task), cores)


class CoreClaim:
    """The cores a training process of a node that may wait as a spare runs on while it trains: `want`
    of `cores`, each held by an exclusive flock on `locks`/cpu-ID (the files docker/entrypoint.sh's
    take_locks uses, so claims made there and here never overlap), taken when the job names the
    process and given back when it waits. The kernel drops a lock when its process dies."""

    def __init__(self, locks: Path, want: int, cores: Collection[int],
                 pin: Callable[[Collection[int]], None] = pin_process) -> None:
        self.locks, self.want, self.cores, self._pin = locks, want, sorted(cores), pin
        self._held: dict[int, int] = {}      # core -> the descriptor of its lock

    @classmethod
    def from_env(cls, environ: Mapping[str, str], processes: int) -> CoreClaim | None:
        """The claim docker/entrypoint.sh handed over (None where it claimed, or nothing was to be
        claimed): the node's cores split among its `processes` training processes, at least one each."""
        locks, want = environ.get(CLAIM_LOCKS_ENV), environ.get(CLAIM_CORES_ENV, "")
        if not locks or not want.isdigit() or int(want) < 1:
            return None
        return cls(Path(locks), max(1, int(want) // max(1, processes)), os.sched_getaffinity(0))

    @property
    def held(self) -> frozenset[int]:
        return frozenset(self._held)

    def take(self) -> bool:
        """Claim `want` free cores and run on them; False (running on every core of `cores`) if fewer are
        free: a frozen node keeps its locks until it wakes and waits as a spare."""
        if self._held:
            return True
        try:
            self.locks.mkdir(parents=True, exist_ok=True)
            for core in self.cores:
                fd = os.open(self.locks / f"cpu-{core}", os.O_WRONLY | os.O_CREAT, 0o644)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    continue
                self._held[core] = fd
                if len(self._held) == self.want:
                    self._pin(self.held)
                    return True
        except OSError:
            pass
        self.give_back()
        return False

    def give_back(self) -> None:
        """Let go of every core held, and run on every core of `cores` again."""
        for fd in self._held.values():
            os.close(fd)
        self._held = {}
        self._pin(self.cores)


class HostShare:
    """This process's entry in its host's registry of training processes on CPU, and its thread
    count from it (apply). The entry lasts as long as the process (or until close())."""

    def __init__(self, explicit: int | None, registry: Path = REGISTRY, cores: Collection[int] | None = None,
                 claim: CoreClaim | None = None) -> None:
        self.explicit = explicit
        self.cores = frozenset(os.sched_getaffinity(0) if cores is None else cores)
        self.registry = registry
        self.claim = claim
        self._path = registry / uuid.uuid4().hex
        self._entry = self._enter()

    def _enter(self) -> IO[str] | None:
        """Write this process's cores under a hidden name, lock the file, then rename it into place:
        a reader never finds an entry that is not yet locked (and would take it for a dead one)."""
        try:
            self.registry.mkdir(parents=True, exist_ok=True)
            if self.registry.stat().st_uid == os.getuid():
                os.chmod(self.registry, 0o1777)      # every user's processes enter; each removes only its own
            hidden = self._path.with_name(f".{self._path.name}")
            entry = open(os.open(hidden, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644), "w")
            fcntl.flock(entry, fcntl.LOCK_EX)
            entry.write(",".join(map(str, sorted(self.cores))))
            entry.flush()
            os.rename(hidden, self._path)
            return entry
        except OSError as exc:
            print(f"warning: cannot enter this process in {self.registry} ({exc.strerror}): it counts itself "
                  "alone on this host for its CPU threads", file=sys.stderr, flush=True)
            return None

    def host(self) -> list[frozenset[int]]:
        """The cores of every live training process on this host, this one included; dead entries are removed."""
        if self._entry is None:
            return [self.cores]
        live = []
        for path in self.registry.iterdir():
            if path.name.startswith("."):
                continue
            try:
                with open(path) as entry:
                    try:
                        fcntl.flock(entry, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    except BlockingIOError:     # held: its process lives
                        live.append(frozenset(int(c) for c in entry.read().split(",") if c))
                        continue
                path.unlink(missing_ok=True)    # its process is gone
            except (OSError, ValueError):       # another user's dead entry, a stranger's file
                continue
        return live

    def threads(self) -> int:
        return threads(self.cores, self.explicit, [] if self.explicit else self.host())

    def apply(self) -> int:
        """Set torch's intra-op threads to this process's share now; returns the count."""
        import torch

        count = self.threads()
        if count != torch.get_num_threads():
            torch.set_num_threads(count)
        return count

    def named(self) -> str | None:
        """The job names this process (an inplace generation): with a claim (a node that may wait as a
        spare), take its cores if it holds none, run on them and count its share anew. What it runs on,
        in words; None when it holds its cores already (or claims none)."""
        if self.claim is None or self.claim.held:
            return None
        taken = self.claim.take()
        cores = self.claim.held if taken else frozenset(self.claim.cores)
        if cores != self.cores:
            self._move(cores)
            self.apply()
        shown = ",".join(map(str, sorted(cores)))
        return (f"running on cores {shown} (claimed now)" if taken else
                f"fewer than {self.claim.want} cores free: running on every core ({shown}) until a generation finds them")

    def _move(self, cores: frozenset[int]) -> None:
        """This process's entry, naming `cores` now: the new entry first, then the old one goes (a reader
        meanwhile counts it twice, never not at all)."""
        old, self.cores = self._entry, cores
        if old is None:
            return
        old_path, self._path = self._path, self.registry / uuid.uuid4().hex
        self._entry = self._enter()
        old_path.unlink(missing_ok=True)
        old.close()

    @contextlib.contextmanager
    def away(self) -> Iterator[None]:
        """Out of the host's count while this process computes nothing (an inplace spare waiting): the
        training processes that count the host meanwhile take its share, and its claimed cores go back
        (a node that joins takes them). Back in, under a new name, with its own share taken anew."""
        if self.claim is not None:
            self.claim.give_back()
            self.cores = frozenset(self.claim.cores)
        if self._entry is None:
            yield
            return
        self.close()
        try:
            yield
        finally:
            self._path = self.registry / uuid.uuid4().hex
            self._entry = self._enter()
            self.apply()

    def close(self) -> None:
        if self._entry is not None:
            self._path.unlink(missing_ok=True)
            self._entry.close()
            self._entry = None
