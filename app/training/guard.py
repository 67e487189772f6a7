"""The training loop's fault hooks: what a rank does when a peer is lost, hangs, or the launcher stops it.

Three ways a rank learns that the job has lost a peer, each ending the same way (the last completed
step kept as a just-in-time snapshot, then exit with a status the launcher acts on,
app/recovery/failures.py):
- a collective fails (a killed peer: at once): `FaultGuard.after_failure` in the main thread;
- a peer's heartbeat stops (a paused container, a cut-off host: within the heartbeat timeout, while
  the main thread may wait in a collective for ever): `_on_peer_hung` in the heartbeat thread;
- SIGTERM from the launcher (a node joined or left, a stop): a flag, acted on at the step boundary.

The state is consistent at step boundaries only: the optimizer step runs under `updating`, which
the heartbeat thread's snapshot waits for. The trainer supplies `keep(why)`, which writes its state
at the last boundary and says what it did, and `leaving(final)`: from the heartbeat thread, which
ends the process itself, once when it finds the fault (the goodput account's edge) and once, final,
just before it leaves (the account's row).

A hang (a silent peer, no progress, a collective that ran out its timeout) first leaves the Python
stacks of this rank and, when the silent peer runs on this host, of that one (app/recovery/stacks.py)
in the run directory, named in one line.
"""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

from app.cluster.distributed import World
from app.recovery import failures, stacks, threads
from app.recovery.heartbeat import Heartbeat, Pace
from app.recovery.slow import SlowWatch
from app.core.policy import FaultPolicy


def node_name() -> str:
    """This process's node as a slow-node line names it: as the survivor modes name theirs in containers
    (node-ADDR, the entrypoint's NODE_ADDR), else its host and torchrun's node rank."""
    addr = os.environ.get("NODE_ADDR")
    return f"node-{addr}" if addr else f"{socket.gethostname()}-{os.environ.get('GROUP_RANK', '0')}"


class Terminated(Exception):
    """SIGTERM from the launcher (a peer was lost, or the job is being stopped); the step is kept."""


class PeerLost(RuntimeError):
    """A collective failed because a peer is gone; `saved` says what this rank kept of its state."""

    def __init__(self, reason: str, saved: str) -> None:
        super().__init__(reason)
        self.reason, self.saved = reason, saved


class FaultGuard:
    def __init__(self, world: World, policy: FaultPolicy, keep: Callable[[str], str], run_dir: Path,
                 leaving: Callable[[bool], None], pace: Pace | None = None, slow: SlowWatch | None = None) -> None:
        """pace: this rank's step times, published with its beat; slow: where the first rank of each node
        judges every node's (app/recovery/slow.py)."""
        self.world, self.policy, self._keep, self.run_dir, self._leaving = world, policy, keep, run_dir, leaving
        self._pace, self._slow = pace, slow
        self.updating = threading.Lock()     # held while the optimizer changes the state
        self.stop_requested = False
        self.heartbeat: Heartbeat | None = None
        self._peers: list[tuple[str, int]] = []     # every rank's (host, pid): whose stacks this rank can ask for

    # ------------------------------------------------------------ the loop's side

    def arm(self) -> None:
        """SIGTERM becomes a flag; heartbeats start (with fresh keys, agreed by every rank of this start)."""
        signal.signal(signal.SIGTERM, self._on_sigterm)
        if not self.world.distributed or self.world.store is None or not self.policy.heartbeat_timeout_s:
            return
        prefix = self.world.broadcast_object(f"ftt-heartbeat/{uuid.uuid4().hex}")
        ranks = self.world.gather_object((socket.gethostname(), os.getpid(), node_name()))
        self._peers = [(host, pid) for host, pid, _ in ranks]
        self.heartbeat = Heartbeat(self.world.store, self.world.rank, self.world.size, prefix, self._on_peer_hung,
                                   self.policy, pace=self._pace, nodes=[node for *_, node in ranks],
                                   watch=self._slow if self.world.local_rank == 0 else None)
        self.heartbeat.start()

    def stepped(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stepped()

    @contextlib.contextmanager
    def slow_phase(self) -> Iterator[None]:
        """Evaluation, a snapshot write: no steps expected, the progress bound waits."""
        with self.heartbeat.slow_phase() if self.heartbeat is not None else contextlib.nullcontext():
            yield

    def disarm(self) -> None:
        """This rank leaves on purpose: its silence is no alarm."""
        if self.heartbeat is not None:
            self.heartbeat.stop()

    def after_failure(self, exc: Exception) -> None:
        """A failure out of the training loop: re-raised unless a peer is gone or the shutdown caused it.

        A lost peer leaves this rank at the last step boundary: the failing collective comes before
        any change to the weights (DDP syncs gradients before the optimizer steps) and the counters
        move only after the optimizer. That step is kept, then PeerLost (or the shutdown) ends the rank.
        """
        if not (failures.peer_lost(exc) or self._sigterm_arrives()):
            raise exc
        if failures.timed_out(exc):
            self.take_stacks(f"a collective ran out its timeout ({failures.first_line(exc)})", None)
        saved = self._keep("stopped by SIGTERM" if self.stop_requested else "lost a peer")
        if not self.stop_requested:
            raise PeerLost(failures.first_line(exc), saved) from None

    def stop_if_requested(self) -> None:
        """At a step boundary after the loop: a SIGTERM keeps the step and ends the rank."""
        if self.stop_requested:
            self._keep("stopped by SIGTERM")
            raise Terminated()

    # ------------------------------------------------------------ signals and threads

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        # Only a flag: the loop stops at the next step boundary, where the state is consistent.
        self.stop_requested = True

    def _sigterm_arrives(self) -> bool:
        """After a failure: was it the shutdown? A peer that stopped first makes this rank's collective fail
        while the same SIGTERM may still be on its way here."""
        deadline = time.monotonic() + self.policy.sigterm_wait_s
        while not self.stop_requested and time.monotonic() < deadline:
            time.sleep(0.01)        # the handler runs here, in the main thread
        return self.stop_requested

    def _on_peer_hung(self, why: str) -> None:
        """From the heartbeat thread: the main thread may wait in a collective for a peer that will not
        come. Its stacks (and the silent peer's, if it can answer), then the last completed step
        (within the policy's budget), then leave."""
        self._leaving(False)
        self.take_stacks(why, self.heartbeat.silent if self.heartbeat is not None else None)
        what = self._keep_within_budget("lost a peer")
        self._leaving(True)
        failures.leave(f"error: lost contact with another rank ({why}); {what}; the launcher restarts the job")

    def leave_keeping(self, line: str) -> None:
        """From a timer thread: a call that will not return (an NCCL abort or init past its bound, in
        inplace mode) holds the main thread. The last completed step, within the policy's budget (the
        only live copy of the job's state may be this process's), then leave with `line`."""
        self._leaving(False)
        what = self._keep_within_budget("an NCCL call did not return")
        self._leaving(True)
        failures.leave(f"{line}; {what}")

    def _keep_within_budget(self, why: str) -> str:
        """The last completed step written now, in a thread of its own joined for JIT_SNAPSHOT_BUDGET at
        most (a write may hang too); what became of it, in words."""
        saved: list[str] = []

        def keep() -> None:
            with self.updating:
                try:
                    saved.append(self._keep(why))
                except Exception as exc:    # a full disk, a bad directory: said in the one line below
                    saved.append(f"no snapshot written ({failures.first_line(exc)})")

        threads.start("just-in-time snapshot", keep).join(timeout=self.policy.jit_snapshot_budget_s)
        return saved[0] if saved else "no snapshot written in time"

    def take_stacks(self, why: str, silent: int | None = None) -> None:
        """This rank's stacks, and the silent peer's when it runs on this host, in the run directory: one line."""
        rank = self.world.rank
        try:
            said = [f"rank {rank} (pid {os.getpid()}, this one) in {stacks.dump_own(self.run_dir, rank, why)}"]
            if silent is not None and silent < len(self._peers):
                host, pid = self._peers[silent]
                said.append(stacks.ask(self.run_dir, silent, pid, why) if host == socket.gethostname()
                            else f"rank {silent} runs on {host}: its own node's ranks leave theirs")
        except OSError as exc:
            said = [f"not written: {exc.filename}: {exc.strerror}"]
        print(f"hang stacks ({why}): {'; '.join(said)}", file=sys.stderr, flush=True)
