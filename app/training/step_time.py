"""How long this process's steps take outside the collective wait: what a member publishes so that a
slow node can be named (app/recovery/slow.py).

In a synchronous job every member's step takes the same wall time, each waiting at the all-reduce for
the slowest; what tells a slow node apart is the rest of its step: the step's data, forward, backward
and optimizer. The loop marks a step's span (begin, end) and, inside it, each wait for a collective
(wait_begin, wait_end): DDP's buffer broadcast before the forward and its gradients' all-reduce from
the last bucket's launch to the backward's end (wrap_ddp installs the hooks that mark them), the
survivor modes' all-reduce and commit across nodes (app/ft/trainer.py), the log row's all-reduce. A
step's compute time is its span less its waits.

On CPU every call is synchronous, and the marks are perf_counter readings. On a GPU the host runs ahead
of the device, and reading when the device got somewhere would need a host sync, which the step never
makes (app/training/step.py). There each mark is a CUDA event recorded on the current stream (no sync),
and a step is read only once its last event has completed (Event.query(), which does not wait): its
time is published a step or a few late, never waited for. The stream's time between two events
includes a slow host's: kernels launched late leave the device idle between them, and that counts.
A DDP job under torch.compile gets no forward hooks (dynamo traces the module's call): there the buffer
broadcast counts as compute, a few microseconds but for a slow rank 0 it is the others' wait.

A step's span runs to the end of its log row and snapshot decision, not only its optimizer: a node's
own work for each step is all of it (with a row every step, as in the chaos jobs, the row is a good
part), and a CPU quota stops a process wherever it burns CPU, in the row's work too. The row's
all-reduce is a wait like the others.

A step that is not an ordinary training step is flagged and left out of the time published
(app/recovery/slow.py lists the flags): the first JOIN_STEPS steps after the process started or came
into a group, the step after an evaluation or after an epoch's data was made, a step that handed a
snapshot over and the one after it (`not_ordinary`). What is published (`take`) is the mean over the
ordinary steps since the last take, and the flags of the others.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any, Callable

import torch
from torch import nn

JOIN_STEPS = 5          # steps flagged `join` after a start or a join: page faults, allocations, warm caches
PENDING = 16            # GPU: steps whose events have not completed yet, at most (older ones are dropped)


class StepClock:
    """This process's steps: their compute time (span less waits), flagged where not ordinary. The
    main thread (and DDP's autograd thread, for a wait) marks; a beat thread takes."""

    def __init__(self, device: torch.device, clock: Callable[[], float] = time.perf_counter) -> None:
        self._cuda = device.type == "cuda"
        self._clock = clock
        self._marks: list[Any] = []           # the open step's: begin, then (wait_begin, wait_end) pairs
        self._open_wait = False
        self._now: set[str] = set()           # the open step's flags
        self._next: set[str] = set()          # the next step's
        self._join_left = JOIN_STEPS          # steps still to flag `join`: a start is a join
        self._pending: deque[tuple[list[Any], frozenset[str]]] = deque()   # GPU: steps not yet read
        self._lock = threading.Lock()
        self._sum, self._count, self._flags = 0.0, 0, set()     # since the last take
        self.last_s: float | None = None       # the newest ordinary step's compute time

    # ------------------------------------------------------------ the loop's marks

    def begin(self) -> None:
        """A step starts (before its data is sliced)."""
        self._marks = [self._mark()]
        self._open_wait = False
        self._now, self._next = self._next, set()
        if self._join_left > 0:
            self._now.add("join")
            self._join_left -= 1

    def wait_begin(self) -> None:
        """The step reaches a collective: from here it may wait for its peers."""
        if self._marks and not self._open_wait:
            self._marks.append(self._mark())
            self._open_wait = True

    def wait_end(self) -> None:
        """Back from the collective."""
        if self._open_wait:
            self._marks.append(self._mark())
            self._open_wait = False

    def end(self) -> None:
        """The step is done: its optimizer stepped, its log row and snapshot decision made."""
        if not self._marks:
            return
        self.wait_end()
        marks, self._marks = self._marks + [self._mark()], []
        flags = frozenset(self._now)
        if self._cuda:
            with self._lock:
                self._pending.append((marks, flags))
                if len(self._pending) > PENDING:
                    self._pending.popleft()
            self._read_completed()
        else:
            self._count_step(_compute_s(marks), flags)

    def cancel(self) -> None:
        """The step did not count (not committed): nothing of it is published."""
        self._marks, self._open_wait = [], False

    def not_ordinary(self, flag: str) -> None:
        """The open step is not an ordinary one, or between steps the next: `eval` (after an evaluation),
        `epoch` (its data was just made), `snapshot` (a snapshot handed over: on a GPU its copy runs
        beside the next step), `join` (this process just came into a group or healed: JOIN_STEPS steps)."""
        if flag == "join":
            self._join_left = JOIN_STEPS - (1 if self._marks else 0)
        (self._now if self._marks else self._next).add(flag)
        if flag == "snapshot" and self._marks:
            self._next.add(flag)

    # ------------------------------------------------------------ the publisher's side

    def take(self) -> tuple[float | None, frozenset[str]]:
        """The mean compute time of the ordinary steps since the last take (None: none), and the flags of
        the others; the count starts again. From any thread."""
        if self._cuda:
            self._read_completed()
        with self._lock:
            taken = (self._sum / self._count if self._count else None, frozenset(self._flags))
            self._sum, self._count, self._flags = 0.0, 0, set()
        return taken

    # ------------------------------------------------------------ inside

    def _mark(self) -> Any:
        if not self._cuda:
            return self._clock()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _read_completed(self) -> None:
        """GPU: the steps whose events have all completed, oldest first; none is waited for (query())."""
        with self._lock:
            while self._pending and all(mark.query() for mark in self._pending[0][0]):
                marks, flags = self._pending.popleft()
                self._count_locked(_compute_s([0.0] + [marks[0].elapsed_time(m) / 1e3 for m in marks[1:]]), flags)

    def _count_step(self, compute_s: float, flags: frozenset[str]) -> None:
        with self._lock:
            self._count_locked(compute_s, flags)

    def _count_locked(self, compute_s: float, flags: frozenset[str]) -> None:
        if flags:
            self._flags |= flags
        else:
            self._sum += compute_s
            self._count += 1
            self.last_s = compute_s


def _compute_s(marks: list[float]) -> float:
    """A step's span less its waits: marks are begin, (wait_begin, wait_end) pairs, end."""
    waits = sum(end - start for start, end in zip(marks[1:-1:2], marks[2:-1:2]))
    return max(0.0, marks[-1] - marks[0] - waits)


def mark_ddp_waits(ddp: nn.Module, module: nn.Module, clock: StepClock, hooks_on_forward: bool) -> None:
    """DDP's waits in a step, marked on `clock`: its buffer broadcast (from DDP's forward to the wrapped
    module's, `hooks_on_forward`) and its gradients' all-reduce, from the launch of the last bucket (every
    gradient is ready then) to the backward's end, which the loop marks (StepRunner.accumulate). The
    all-reduce itself is DDP's own (its default hook's): the same sum over the same buckets."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    def allreduce(state, bucket):     # type: ignore[no-untyped-def]  (DDP refuses any annotation but its own types)
        if bucket.is_last():
            clock.wait_begin()
        return default_hooks.allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, allreduce)
    if hooks_on_forward:
        ddp.register_forward_pre_hook(lambda *_: clock.wait_begin())
        module.register_forward_pre_hook(lambda *_: clock.wait_end())
