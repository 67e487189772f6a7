"""Inplace mode's generation groups, one kind per c10d backend: how a generation's process group is
formed, how the step waits for its all-reduce, and how it is ended (app/ft/inplace.py runs them;
gloo on CPU hosts, NCCL on CUDA hosts). What differs, and why:

- Waiting. gloo's timed wait only raises when its slice runs out (the operation goes on), so the
  gloo kind waits in slices of the heartbeat interval. NCCL's `wait(timeout)` aborts the
  communicator once the operation is older than the timeout: short timed waits would destroy every
  healthy slow all-reduce. The NCCL kind polls `is_completed()` (a CUDA event query) and calls
  `wait()`, without a timeout, once it is done.
- Ending. gloo has no abort (ProcessGroupGloo inherits Backend::abort, a no-op): the pending
  operation of a generation that ended runs out its timeout in the background, its group kept alive
  meanwhile (dropping it would wait for it). NCCL's `abort()` (ncclCommAbort) ends the kernels at
  once; `shutdown()` would finalise, waiting for every kernel, and hang on a dead peer. A generation
  that ends on NCCL is aborted, never shut down, whether it failed or a newcomer re-forms it.
- Forming. A gloo group whose peer cannot be reached (a data link down) waits in gloo's connect
  retries far past its own timeout; the gloo kind forms in a thread of its own and calls a group not
  connected within INPLACE_FORM_BOUND a failed round (app/ft/inplace.py takes it again).
- Bounds. An NCCL init or abort can hang (NVIDIA/nccl#289, #1013, #1777; pytorch#119797), and a CUDA
  context an error corrupted cannot be repaired in place: one that has not returned within
  INPLACE_GROUP_BOUND ends the process in one line (exit 1); its node starts it again, and it comes
  back as a new member healed from a live one.
- The process's environment (NCCL_ENVIRONMENT), set before its first NCCL group: it decides
  whether the process survives an NCCL error, and whether a key another job writes to the shared
  store can end it.
"""
from __future__ import annotations

import os
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
        "2", "on an NCCL error or a collective past its timeout the watchdog aborts the group's communicators "
        "and the process lives on (torch's default, 3, ends the process: every survivor of a fault)"),
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
        """Generation's group over (`work`: its operation left pending, if any)."""
        ...

    def bound(self, what: str) -> ContextManager[None]:
        """Around a step that may hang in the backend (forming, ending, dropping a group)."""
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
    """NCCL: a polled wait, abort for every generation that ends, init and abort within the bound."""

    name = "nccl"

    def __init__(self, policy: FaultPolicy, device: torch.device, make: Callable[..., dist.Backend] = nccl_group,
                 stuck: Callable[[str], None] | None = None) -> None:
        self.policy, self.device, self._make, self._stuck = policy, device, make, stuck

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
        try:
            work.wait()
        except RuntimeError as exc:             # DistBackendError among them
            return failures.short_cause(str(exc))
        # Whether wait() raises for an operation the watchdog failed differs between torch versions; the
        # watchdog always marks its result TIMEOUT or COMM_ERROR (ProcessGroupNCCL.cpp). Work.exception()
        # says the same but prints a deprecation warning (torch 2.14).
        result = work.get_future_result()
        code = result.value() if result.done() else WORK_SUCCESS
        return None if code == WORK_SUCCESS else f"the NCCL watchdog failed it ({WORK_RESULTS.get(code, code)})"

    def end(self, pg: dist.Backend, work: dist.Work | None) -> None:
        """Abort (idempotent: a group the watchdog or an earlier end aborted is aborted again at no cost)."""
        with self.bound("aborting an NCCL group"):
            pg.abort()

    def bound(self, what: str) -> ContextManager[None]:
        return bounded(self.policy.inplace_group_bound_s, what, self._stuck)
