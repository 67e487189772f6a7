"""Hung peers caught in seconds, not after the collective timeout.

Every rank runs one thread that beats through the store the job already has (the default process
group's) and reads the others' beats. A peer whose beat count stops growing for `--heartbeat-timeout`
seconds (a paused container, a host cut off; app/recovery/silence.py judges it, as for inplace mode's
members) is lost, unless it said it left on purpose; so is the store itself when it stops answering
that long.
A rank that beats but whose training makes no progress for much longer than its steps usually take
(a stuck kernel, a collective that never completes) is caught by a progress bound: `slack` times
the slowest recent step, never below the progress floor (the timings: app/core/policy.py). Phases that are slow by nature (evaluation,
snapshot writes, the first steps with their compilation) pause that bound.

A rank that beats and steps, only slowly (a node with a cut CPU quota, a failing fan), is named: with
each beat every rank publishes its steps' time outside the collective wait (`pace`,
app/training/step_time.py), and the first rank of each node reads them all and judges every node
(`watch`, app/recovery/slow.py), which says `node X is slow: ...` once on every node. Elastic mode only
names it: leaving a node out restarts the job, which costs more than a slow node's minutes.

Either way `on_lost` is called once, from the monitor thread, with one line saying why; the trainer
then keeps the state it holds and leaves, and the launcher restarts the group without the lost
peer. The collective timeout stays the last line of defence.

Written by hand: torchrun's own health checks watch agents, not the workers' progress, and torchft
(which has per-step quorums) replaces torchrun's process model rather than sitting on top of it.
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from typing import Any, Callable, Iterator, Sequence

from app.recovery import threads
from app.core.policy import DEFAULT, FaultPolicy
from app.recovery.silence import Silence
from app.recovery.slow import SlowWatch

# A rank's step times since its last beat, as its step clock gives them: (mean seconds per ordinary step
# outside the collective wait or None, the flags of the steps left out).
Pace = Callable[[], tuple[float | None, frozenset[str]]]


class Heartbeat:
    def __init__(self, store: Any, rank: int, size: int, prefix: str, on_lost: Callable[[str], None],
                 policy: FaultPolicy = DEFAULT, pace: Pace | None = None, nodes: Sequence[str] = (),
                 watch: SlowWatch | None = None) -> None:
        """pace: this rank's step times, published with each beat; nodes: each rank's node; watch: on the
        first rank of each node, the judge of every node's pace."""
        self.store, self.rank, self.size, self.prefix, self.on_lost = store, rank, size, prefix, on_lost
        self.pace, self.nodes, self.watch = pace, list(nodes), watch
        self.timeout_s, self.interval_s = policy.heartbeat_timeout_s, policy.heartbeat_interval_s
        self.progress_floor_s, self.slack = policy.progress_floor_s, policy.progress_slack
        self.silent: int | None = None     # the peer whose silence fired it, if that was the cause
        self._stop = threading.Event()
        self._fired = threading.Event()
        self._round_done = time.monotonic()        # last time the beat thread got through a round
        self._last_step_at = time.monotonic()
        self._step_times: deque[float] = deque(maxlen=50)
        self._warm = False          # the first step (compilation, cold caches) is exempt from the bound
        self._slow_phases = 0       # evaluation, synchronous snapshots: no steps expected
        self._threads: list[threading.Thread] = []

    # ------------------------------------------------------------ the trainer's side

    def start(self) -> None:
        """Both threads, through app/recovery/threads.py: a failure of either that they do not handle
        (anything but the store's) ends the node with one error line."""
        self._threads = [threads.start("heartbeat", self._beat), threads.start("heartbeat-watch", self._watch)]

    def stop(self) -> None:
        """This rank leaves on purpose (done, or stopping at a boundary): its silence is no alarm."""
        self._stop.set()
        try:
            self.store.set(self._done_key(self.rank), b"1")
        except Exception:   # the store may be gone already; peers then find out through it
            pass
        # Joined, not left to die with the interpreter: a daemon thread inside a store call (C++, the GIL
        # released) that wakes during interpreter shutdown is ended by pthread_exit, whose unwinding
        # through pybind11's GIL guard aborts the process. The trainer's own end skips finalization
        # (failures.exit_process: gloo's threads hit the same abort); this keeps a rank that stops
        # its heartbeat and goes on in-process (tests, a caller of app.train.run) from leaving one.
        for thread in self._threads:
            if thread.is_alive() and thread is not threading.current_thread():
                thread.join(timeout=self.timeout_s or self.interval_s)

    def stepped(self) -> None:
        """A training step completed (main thread)."""
        now = time.monotonic()
        if self._warm:
            self._step_times.append(now - self._last_step_at)
        self._warm = True
        self._last_step_at = now

    @contextlib.contextmanager
    def slow_phase(self) -> Iterator[None]:
        """A phase with no steps (evaluation, a synchronous snapshot): the progress bound waits."""
        self._slow_phases += 1
        try:
            yield
        finally:
            self._slow_phases -= 1
            self._last_step_at = time.monotonic()
            self._warm = False      # the step after it may be slow too (e.g. the train graph again)

    def progress_bound_s(self) -> float:
        return max(self.progress_floor_s, self.slack * max(self._step_times, default=0.0))

    # ------------------------------------------------------------ threads

    def _key(self, rank: int) -> str:
        return f"{self.prefix}/beat/{rank}"

    def _done_key(self, rank: int) -> str:
        return f"{self.prefix}/done/{rank}"

    def _pace_key(self, rank: int) -> str:
        return f"{self.prefix}/pace/{rank}"

    def _beat(self) -> None:
        """Beat, read the others' beats, and find a peer whose beat has stopped."""
        silence = Silence(self.timeout_s)
        watched = [r for r in range(self.size) if r != self.rank]
        while not self._stop.is_set() and not self._fired.is_set():
            try:
                silent = self._round(silence, watched)
            except RuntimeError:  # the store is gone or refuses (DistError): the watch thread times that out
                if self._stop.wait(self.interval_s):
                    return
                continue
            if silent:
                self.silent = silent[0]
                self._fire(f"rank {silent[0]} has not sent a heartbeat for {self.timeout_s:.0f} s (hung or cut off)")
                return
            self._stop.wait(self.interval_s)

    def _round(self, silence: Silence, watched: list[int]) -> list[int]:
        """One beat and one look at the others; the peers silent for too long that did not leave on purpose."""
        self.store.add(self._key(self.rank), 1)
        if self.pace is not None:
            self.store.set(self._pace_key(self.rank), _encode(*self.pace()))
        if self.watch is not None and self.watch.due(time.monotonic()):
            self._judge_pace()
        silent = [r for r in watched if silence.is_silent(r, self.store.add(self._key(r), 0))]
        for r in [r for r in silent if self.store.check([self._done_key(r)])]:
            watched.remove(r)       # it finished or stopped on purpose: not lost
            silent.remove(r)
        self._round_done = time.monotonic()
        return silent

    def _judge_pace(self) -> None:
        """Every rank's published step times, each node's the slowest of its ranks', to the watch: one
        check and one read of the store a beat (nothing while a rank has not published yet)."""
        keys = [self._pace_key(r) for r in range(self.size)]
        if not self.store.check(keys):
            return
        nodes: dict[str, tuple[float | None, frozenset[str]]] = {}
        for node, raw in zip(self.nodes, self.store.multi_get(keys)):
            compute, flags = _decode(raw)
            had, had_flags = nodes.get(node, (None, frozenset()))
            times = [c for c in (had, compute) if c is not None]
            nodes[node] = (max(times) if times else None, had_flags | flags)
        self.watch.feed(time.monotonic(), [(node, c, f) for node, (c, f) in nodes.items()])

    def _watch(self) -> None:
        """The beat thread itself stuck in a store call, or training without progress.

        A gap in this thread's own turns longer than the timeout means the whole process was
        stopped (SIGSTOP, a paused container): that says nothing of the store or of training, and
        both are judged afresh from the wake. The peers judge the pause from their side. (In the
        survivor modes the woken process comes back into the job in place; firing here restarted it.)"""
        last_turn = time.monotonic()
        while not self._stop.wait(self.interval_s) and not self._fired.is_set():
            now = time.monotonic()
            if now - last_turn > self.timeout_s:
                self._round_done = self._last_step_at = now
            last_turn = now
            if now - self._round_done > self.timeout_s:
                self._fire(f"the job's store has not answered for {self.timeout_s:.0f} s")
            elif self._warm and not self._slow_phases and now - self._last_step_at > self.progress_bound_s():
                self._fire(f"no training step for {now - self._last_step_at:.0f} s "
                           f"(bound {self.progress_bound_s():.0f} s: a stuck kernel or collective)")

    def _fire(self, why: str) -> None:
        if not self._fired.is_set() and not self._stop.is_set():
            self._fired.set()
            self.on_lost(why)


def _encode(compute_s: float | None, flags: frozenset[str]) -> str:
    """A rank's step times as its pace key holds them: `0.012345|eval,join`, `|join` with no time."""
    return f"{'' if compute_s is None else f'{compute_s:.6f}'}|{','.join(sorted(flags))}"


def _decode(raw: bytes) -> tuple[float | None, frozenset[str]]:
    compute, _, flags = raw.decode(errors="replace").partition("|")
    try:
        value = float(compute) if compute else None
    except ValueError:
        value = None
    return value, frozenset(f for f in flags.split(",") if f)
