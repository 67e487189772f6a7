"""Inplace mode's generation groups, one kind per c10d backend: how a generation's process group is
formed, how the step waits for its all-reduce, and how it is ended (app/ft/inplace.py runs them;
gloo on CPU hosts, NCCL on CUDA hosts). What differs, and why:

- Waiting. gloo's timed wait only raises when its slice runs out (the operation goes on), so the
  gloo kind waits in slices of the heartbeat interval. NCCL's `wait(timeout)` aborts the
  communicator once the operation is older than the timeout: short timed waits would destroy every
  healthy slow all-reduce. The NCCL kind polls `is_completed()` (a CUDA event query) and, once it
  is done, reads its result: one the watchdog failed is never waited on (WorkNCCL.wait aborts the
  communicator, on the calling thread, when its operation failed); one that succeeded is.
- Ending. gloo has no abort (ProcessGroupGloo inherits Backend::abort, a no-op): the pending
  operation of a generation that ended runs out its timeout in the background, its group kept alive
  meanwhile (dropping it would wait for it). NCCL's `abort()` (ncclCommAbort) ends the kernels at
  once; `shutdown()` would finalise, waiting for every kernel, and hang on a dead peer. A generation
  that ends on NCCL is aborted, never shut down, whether it failed or a newcomer re-forms it.
- Nothing the main thread waits on can hang in an ending. An NCCL abort can hang with a dead peer
  (NVIDIA/nccl#1013, #1777; pytorch#119797), and so can the group's destructor, which joins its
  watchdog (torch's watchdog sleeps 4 x TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC, 60 s, on a failed
  collective before it lets go: the H200's survivor of a kill waited past INPLACE_GROUP_BOUND there).
  So a group that ends is handed to a thread of its own (Ends), which aborts it and drops its last
  reference, and the survivor forms its next generation at once. A group whose end has not returned
  within INPLACE_GROUP_BOUND is left there with its threads and device memory, said in one warning
  and counted; the process trains on until more than INPLACE_STUCK_GROUPS are stuck at once, then
  leaves in one line (its node starts it again as a new member). Only that thread aborts a group:
  the watchdog is told not to (TORCH_NCCL_ASYNC_ERROR_HANDLING=0), so no abort holds the lock of a
  communicator the main thread is still polling.
- Forming. A gloo group whose peer cannot be reached (a data link down) waits in gloo's connect
  retries far past its own timeout; the gloo kind forms in a thread of its own and calls a group not
  connected within INPLACE_FORM_BOUND a failed round (app/ft/inplace.py takes it again). An NCCL init
  can hang too (NVIDIA/nccl#289) on the main thread, which needs the group to go on: one that has not
  returned within INPLACE_GROUP_BOUND ends the process in one line (exit 1); its node starts it
  again, and it comes back as a new member healed from a live one.
- The process's environment (NCCL_ENVIRONMENT), set before its first NCCL group: it decides
  whether the process survives an NCCL error, and whether a key another job writes to the shared
  store can end it.
"""
from __future__ import annotations

import itertools
import os
import sys
import threading
import time
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import Callable, ContextManager, Iterator, MutableMapping, Protocol

import torch
import torch.distributed as dist

from app.core.policy import FaultPolicy
from app.recovery import failures, threads

# What inplace mode sets, whatever the environment said, before the process's first NCCL group (the
# node's own group included: torch reads them as each group is built). Each decides whether the
# mode's promise holds; docs/survivor-modes.md says the same.
NCCL_ENVIRONMENT: dict[str, tuple[str, str]] = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": (
        "0", "on an NCCL error or a collective past its timeout the watchdog fails the operation and nothing else: "
        "the process lives on (torch's default, 3, ends it: every survivor of a fault), and the communicator is "
        "aborted only by the thread that ends its generation (2 would have the watchdog abort it too, holding the "
        "communicator's lock the main thread's poll takes: an abort that hangs would hold the main thread)"),
    "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": (
        "0", "the watchdog sleeps 4 times this (torch's default 15000: 60 s) on a failed collective before it goes on, "
        "holding its group's work list; the group's destructor joins it: with a dead peer every ending waited a minute"),
    "TORCH_NCCL_ENABLE_MONITORING": (
        "0", "no heartbeat monitor: it ends the process when a group's watchdog has not beaten for 8 minutes, and "
        "the watchdog of a group whose abort hangs (left behind, INPLACE_STUCK_GROUPS) never beats again"),
    "TORCH_NCCL_BLOCKING_WAIT": (
        "0", "wait() leaves the host free and the watchdog in charge (1: wait blocks the host and throws)"),
    "TORCH_NCCL_DUMP_ON_TIMEOUT": (
        "0", "no `exception_dump` key written or watched at the root of the group store, which every job on "
        "that store shares: on (torch's default), one job's timeout ends every process there whose first "
        "NCCL group watches it"),
    "TORCH_NCCL_PROPAGATE_ERROR": (
        "0", "no `remote_error` key either: a member's error is its own, the generation ends by its notices"),
    "NCCL_NVLS_ENABLE": (
        "0", "no NVLink SHARP buffers: what NVIDIA's in-process restart, which also aborts and re-forms "
        "communicators in a live process, requires"),
}
# How often the NCCL kind looks at a pending all-reduce: soon at first, backing off to a ceiling that
# keeps the host's lag behind a completed all-reduce well under a GPU step (about 10 ms here).
POLL_FIRST_S, POLL_MAX_S = 0.00005, 0.0002
# How often an ending group's thread looks whether the caller has let go of it: soon, backing off.
RELEASE_POLL_S, RELEASE_POLL_MAX_S = 0.01, 0.5


def _sole_refs() -> int:
    held = object()
    return sys.getrefcount(held)


# What sys.getrefcount says of an object that only the calling frame holds (2 before Python 3.14, which
# borrows the argument's reference): measured, not assumed.
SOLE_REFS = _sole_refs()


class Ended:
    """What `wait` returns when the generation ended (the watch) before its operation completed."""


ENDED = Ended()


class Groups(Protocol):
    """One backend's generation groups (GlooGroups, NcclGroups)."""

    name: str                   # the backend, as the start row says it
    device: torch.device        # where the tensors of its collectives live

    def form(self, store: dist.Store, rank: int, size: int, g: int) -> dist.Backend:
        """Generation g's group of `size` members on `store` (a prefix of its own)."""
        ...

    def wait(self, work: dist.Work, ended: threading.Event) -> str | None | Ended:
        """None once `work` completed, its error if it failed, ENDED if `ended` was set first."""
        ...

    def end(self, pg: dist.Backend, work: dist.Work | None) -> None:
        """Generation's group over (`work`: its operation left pending, if any). Returns at once; the
        caller lets go of `pg` after it."""
        ...

    def settle(self) -> None:
        """Wait, within the backend's bound, for the groups end() was given to be ended (a process's last)."""
        ...

    def bound(self, what: str) -> ContextManager[None]:
        """Around a step that may hang in the backend and that the caller needs done (forming a group)."""
        ...


def groups_for(device: torch.device, policy: FaultPolicy, stuck: Callable[[str], None] | None = None) -> Groups:
    """NCCL on CUDA hosts (`stuck`: what a call past its bound does, bounded()'s), gloo elsewhere."""
    return NcclGroups(policy, device, stuck=stuck) if device.type == "cuda" else GlooGroups(policy)


def set_nccl_environment(environ: MutableMapping[str, str] | None = None) -> None:
    """NCCL_ENVIRONMENT into `environ` (this process's), on a CUDA host: before its first NCCL group."""
    if torch.cuda.is_available():
        (os.environ if environ is None else environ).update({name: value for name, (value, _) in NCCL_ENVIRONMENT.items()})


@contextmanager
def bounded(seconds: float, what: str, stuck: Callable[[str], None] | None = None) -> Iterator[None]:
    """Leave the process in one line (exit 1: its node starts it again) if the block has not returned
    within `seconds`: `stuck(line)` if given (the trainer keeps its last step first), else at once.
    The line comes from a timer thread: torch releases the interpreter lock inside NCCL's init and abort."""
    line = (f"error: {what} did not return within {seconds:g} s (INPLACE_GROUP_BOUND); a stuck NCCL call "
            "cannot be undone in place: leaving, to come back as a new member")

    def expire() -> None:
        try:
            (stuck or failures.leave)(line)
        except BaseException:       # the hook failed on its way: leave without what it would have kept
            failures.leave(line)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


class GlooGroups:
    """gloo: timed waits in slices, no abort (an ended operation runs out its timeout in the background)."""

    name = "gloo"
    device = torch.device("cpu")

    def __init__(self, policy: FaultPolicy) -> None:
        self.policy = policy
        self._left_behind: list[tuple[dist.Backend, dist.Work]] = []

    def form(self, store: dist.Store, rank: int, size: int, g: int) -> dist.Backend:
        """Within INPLACE_FORM_BOUND, or RuntimeError (a failed round). Across a cut link gloo's connect
        outlasts its own timeout (TCP's SYN retries: generations formed during a cut waited 134-150 s
        in connectFullMesh after the heal), so it runs in a thread of its own (it releases the GIL),
        which a failed round leaves to end by itself; its group is dropped there."""
        formed: list[dist.Backend | Exception] = []
        timeout = timedelta(seconds=self.policy.collective_timeout_s)

        def connect() -> None:
            try:
                formed.append(dist.ProcessGroupGloo(store, rank, size, timeout))
            except (dist.DistError, RuntimeError) as exc:      # a peer's key never came, a reset: a failed round
                formed.append(exc)

        threads.start(f"inplace-form-{g}", connect).join(self.policy.inplace_form_bound_s)
        if not formed:
            raise RuntimeError(f"generation {g}'s group did not connect within {self.policy.inplace_form_bound_s:g} s "
                               "(INPLACE_FORM_BOUND): a peer unreachable over the data path")
        if isinstance(formed[0], Exception):
            raise formed[0]
        return formed[0]

    def wait(self, work: dist.Work, ended: threading.Event) -> str | None | Ended:
        """In slices of the heartbeat interval (gloo ends the operation itself at its timeout)."""
        while True:
            try:
                work.wait(timedelta(seconds=self.policy.ft_heartbeat_interval_s))
                return None
            except RuntimeError:            # gloo's own failure (a reset peer), or this slice ran out
                if work.is_completed():
                    return self._outcome(work)
            if ended.is_set():
                return ENDED

    def _outcome(self, work: dist.Work) -> str | None:
        """A completed operation's own outcome. The slice's "Operation timed out!" may be raised just
        as the operation completes: taken as a failure, this member alone did not commit the step
        its peers committed, and they waited for it in the next all-reduce for the collective
        timeout (seen under load: a 30 s stall)."""
        try:
            work.wait(timedelta(seconds=self.policy.ft_heartbeat_interval_s))
            return None
        except RuntimeError as exc:
            return failures.short_cause(str(exc))

    def end(self, pg: dist.Backend, work: dist.Work | None) -> None:
        """Keep a pending operation's group alive until the operation has run out its timeout."""
        self._left_behind = [(p, w) for p, w in self._left_behind if not w.is_completed()]
        if work is not None and not work.is_completed():
            self._left_behind.append((pg, work))

    def settle(self) -> None:
        return None

    def bound(self, what: str) -> ContextManager[None]:
        return nullcontext()


def nccl_group(store: dist.Store, rank: int, size: int, device: torch.device, timeout: timedelta,
               name: str) -> dist.Backend:
    """A stock ProcessGroupNCCL, connected now (not at its first collective, where a hang would be
    taken for a slow all-reduce)."""
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout      # the watchdog's (mode 2: it aborts, the process lives): a safety net
    options.group_name = name       # its logs and flight recorder name the generation
    pg = dist.ProcessGroupNCCL(store, rank, size, options)
    pg.eager_connect_single_device(device)
    return pg


WORK_SUCCESS = 0
WORK_RESULTS = {1: "timeout", 2: "communication error", 100: "unknown"}    # c10d's WorkResult


class NcclGroups:
    """NCCL: a polled wait, every generation that ends aborted off the main thread (Ends), init within the bound."""

    name = "nccl"

    def __init__(self, policy: FaultPolicy, device: torch.device, make: Callable[..., dist.Backend] = nccl_group,
                 stuck: Callable[[str], None] | None = None) -> None:
        self.policy, self.device, self._make, self._stuck = policy, device, make, stuck
        self.ends = Ends(policy, stuck)

    def form(self, store: dist.Store, rank: int, size: int, g: int) -> dist.Backend:
        with self.bound(f"forming generation {g}'s NCCL group"):
            return self._make(store, rank, size, self.device, timedelta(seconds=self.policy.collective_timeout_s),
                              f"inplace-{g}")

    def wait(self, work: dist.Work, ended: threading.Event) -> str | None | Ended:
        """Poll until `work` completed or the generation ended; never a timed wait. The watchdog fails
        an operation past the collective timeout; one it has not failed a bound later counts as failed."""
        limit_s = self.policy.collective_timeout_s + self.policy.inplace_group_bound_s
        deadline, pause = time.monotonic() + limit_s, POLL_FIRST_S
        while not work.is_completed():
            if ended.is_set():
                return ENDED
            if time.monotonic() > deadline:     # the watchdog is stuck itself: the caller aborts
                return f"not completed within {limit_s:g} s"
            time.sleep(pause)
            pause = min(POLL_MAX_S, pause * 2)
        failed = self._failed(work)
        if failed is not None:      # never waited on: WorkNCCL.wait aborts a failed operation's communicator here
            return failed
        try:
            work.wait()
        except RuntimeError as exc:             # DistBackendError among them
            return failures.short_cause(str(exc))
        return self._failed(work)

    @staticmethod
    def _failed(work: dist.Work) -> str | None:
        """Why a completed operation failed, as far as its result says yet: the watchdog marks it TIMEOUT
        or COMM_ERROR (ProcessGroupNCCL.cpp), and so does the poll that found its communicator's error;
        SUCCESS comes from the watchdog's next round, so an unmarked one has not failed (yet). Whether
        wait() raises for a failed operation differs between torch versions; Work.exception() says the
        same but prints a deprecation warning (torch 2.14)."""
        result = work.get_future_result()
        code = result.value() if result.done() else WORK_SUCCESS
        return None if code == WORK_SUCCESS else f"the NCCL watchdog failed it ({WORK_RESULTS.get(code, code)})"

    def end(self, pg: dist.Backend, work: dist.Work | None) -> None:
        """Hand the group to a thread of its own that aborts it and drops it (Ends): returns at once."""
        self.ends.take(pg)

    def settle(self) -> None:
        self.ends.settle()

    def bound(self, what: str) -> ContextManager[None]:
        return bounded(self.policy.inplace_group_bound_s, what, self._stuck)


class Ends:
    """The NCCL groups of generations that ended, each ended in a thread of its own: `abort()`, then its
    last reference dropped there (the destructor joins the group's threads), once the caller has let
    go of its own. The main thread never waits for either. One that has not ended within
    INPLACE_GROUP_BOUND is stuck: left there, its threads and device memory with it, and said in one
    warning; while more than INPLACE_STUCK_GROUPS are stuck at once, the process leaves in one line
    (`stuck`, bounded()'s: the trainer keeps its last step first)."""

    def __init__(self, policy: FaultPolicy, stuck: Callable[[str], None] | None = None,
                 warn: Callable[[str], None] | None = None) -> None:
        self.policy, self._stuck = policy, stuck
        self._warn = warn or (lambda line: print(line, file=sys.stderr, flush=True))
        self._lock = threading.Lock()
        self._handed: set[int] = set()      # ids of the groups handed over and still alive (one end each)
        # each end (a number of its own: a group's id may be another's once it is freed) -> the group's
        # name, when its end began, the timer of its bound
        self._ending: dict[int, tuple[str, float, threading.Timer]] = {}
        self._late: set[int] = set()        # those of them past the bound
        self._releasing: set[int] = set()   # those aborted, waiting for the caller to let go (not stuck)
        self._done = threading.Condition(self._lock)
        self._count = itertools.count()
        self.ended, self.longest_s = 0, 0.0     # groups ended, and the longest end

    @property
    def stuck(self) -> int:
        """Groups past the bound that have not ended yet."""
        with self._lock:
            return len(self._late)

    def take(self, pg: dist.Backend) -> None:
        """End `pg` (once: a group already being ended is left to its thread)."""
        name, key = _name_of(pg), next(self._count)
        timer = threading.Timer(self.policy.inplace_group_bound_s, self._past_bound, (key,))
        timer.daemon = True
        with self._lock:
            if id(pg) in self._handed:
                return
            self._handed.add(id(pg))
            self._ending[key] = (name, time.monotonic(), timer)
        timer.start()
        box = [pg]
        del pg
        threads.start(f"end-{name}", lambda: self._end(box, key))

    def _end(self, box: list[dist.Backend], key: int) -> None:
        pg = box.pop()
        began = time.monotonic()
        try:
            pg.abort()
        except RuntimeError:        # an abort that failed: the group is dropped all the same
            pass
        took = time.monotonic() - began
        with self._lock:
            self._releasing.add(key)
        # The caller's references go first, so that the destructor, which may hang as the abort may,
        # runs here: this frame's alone is left (SOLE_REFS). A caller may keep one a while (an
        # operation ended by the watch hands its group over at once, and the member lets go of it when
        # its next generation forms): the wait is no stuck call, and is not counted as one.
        pause = RELEASE_POLL_S
        while sys.getrefcount(pg) > SOLE_REFS:
            time.sleep(pause)
            pause = min(RELEASE_POLL_MAX_S, pause * 2)
        with self._lock:
            self._handed.discard(id(pg))
            self._releasing.discard(key)
        released = time.monotonic()
        del pg
        took += time.monotonic() - released     # the abort and the destructor: the end's own seconds
        with self._lock:
            name, _, timer = self._ending[key]
            late = key in self._late
        timer.cancel()
        if late:
            self._warn(f"warning: {name}'s NCCL group ended after all: its abort and destructor took {took:.1f} s")
        with self._lock:      # last: once settle() returns, nothing of this end runs any more but the thread's exit
            del self._ending[key]
            self._late.discard(key)
            self.ended, self.longest_s = self.ended + 1, max(self.longest_s, took)
            self._done.notify_all()

    def _past_bound(self, key: int) -> None:
        with self._lock:
            if key not in self._ending:
                return
            if key in self._releasing:      # its abort returned; its release has a bound of its own
                self._timer_again(key)
                return
            self._late.add(key)
            name, stuck = self._ending[key][0], len(self._late)
        what = (f"ending {name}'s NCCL group did not return within {self.policy.inplace_group_bound_s:g} s "
                f"(INPLACE_GROUP_BOUND)")
        if stuck > self.policy.inplace_stuck_groups:
            line = (f"error: {what}, and {stuck} groups are stuck, more than INPLACE_STUCK_GROUPS="
                    f"{self.policy.inplace_stuck_groups}: leaving, to come back as a new member")
            try:
                (self._stuck or failures.leave)(line)
            except BaseException:   # the hook failed on its way: leave without what it would have kept
                failures.leave(line)
            return
        self._warn(f"warning: {what}: left behind with its threads and device memory, this process trains on "
                   f"({stuck} stuck; more than INPLACE_STUCK_GROUPS={self.policy.inplace_stuck_groups} end it)")

    def _timer_again(self, key: int) -> None:
        """The bound once more, from now, for an end that moves on to its destructor (under the lock)."""
        name, began, _ = self._ending[key]
        timer = threading.Timer(self.policy.inplace_group_bound_s, self._past_bound, (key,))
        timer.daemon = True
        self._ending[key] = (name, began, timer)
        timer.start()

    def settle(self, timeout: float | None = None) -> bool:
        """Wait, INPLACE_GROUP_BOUND at most unless told, until no group is being ended but the stuck ones;
        whether none is left at all."""
        deadline = time.monotonic() + (self.policy.inplace_group_bound_s if timeout is None else timeout)
        with self._lock:
            while len(self._ending) > len(self._late) and self._done.wait(max(0.0, deadline - time.monotonic())):
                pass
            return not self._ending


def _name_of(pg: dist.Backend) -> str:
    """The group's name as nccl_group() gave it (inplace-<g>: its generation), for a line that says which."""
    try:
        return str(pg.options.group_name) or "a generation"
    except (AttributeError, RuntimeError):
        return "a generation"
