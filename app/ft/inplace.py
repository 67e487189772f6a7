"""In-place mode (--ft inplace): the survivors of a fault re-form their process group among themselves
and go on, on torch's own c10d; no torchft, and nothing between two steps while nobody comes or goes.

Why beside torchft: torchft asks its Lighthouse for a quorum and votes a commit at every step (two
round trips a step: about 0.8 of elastic's throughput on the quick configuration here), and a
hung group holds the others inside the step's all-reduce until its timeout, since torchft cannot
abort it (docs/survivor-modes.md). Here the members meet in the job's store only when the
membership changes, and a member that stops beating is cut off at once.

Who comes to a round, who closes it and whom it names, who waits as a spare or is held off: the
protocol, app/ft/protocol.py, which this module runs (InPlaceGroup._run carries out its requests).
This module is its I/O:
- Every training process of every node is a member. Members meet in a TCPStore every node reaches
  (--group-store: the compose store service's, the one the elastic rendezvous uses) under the job's
  namespace; each beats there from a thread of its own (Watch), which also reads what the
  protocol's watch needs and carries out its verdict.
- A generation is one process group of the members it names, built under its own key prefix: gloo
  on CPU hosts, NCCL on CUDA hosts (app/ft/groups.py: how each backend's group is formed, waited on
  and ended; on NCCL every generation that ends is aborted). The main thread waits for an
  all-reduce without blocking on it (gloo: slices of the heartbeat interval; NCCL: polling), so a
  generation the watch ended is left at once instead of at the collective timeout. On gloo the
  operation runs out its timeout in the background (torch 2.14's gloo backend has no abort).
- A peer cut off over the data path (its link to the others down, the store still reached) beats on:
  probes find it (app/ft/reach.py), made only while an all-reduce is pending past INPLACE_STALL or
  at a round; a step that completes costs none of this: the main thread notes when its wait began.
- The most advanced member is rank 0 of a new generation and sends its whole state (weights,
  optimizer, schedule, position) to the members behind it. Members at one step hold the same
  state and exchange nothing, so a fault costs the survivors no transfer at all.
- Only members that prove they hold the job secret (JOB_SECRET) are named in a generation, and a
  member only joins a list signed with it: no stranger is sent the weights.
- Nothing a member reads from the store steers it unless a member signed it (app/cluster/secret.py): the
  generation (`latest`), the notices that end one (`{g}/end`), the beats, the arrivals and the lists
  (`Keys` names every key, in one place). Each signature names the job, the key and the generation
  it is about, beats count up, and `latest` only ever moves a member forward, so a value copied from
  elsewhere or replayed is as worthless as a forged one: it is counted and said in one warning a
  minute (FaultPolicy.store_warning_interval_s), nothing else.
- A spare (--full-size N) waits out of its host's count of cores (app/cluster/cores.py), while a
  thread of its own blocks in the store's wait for the next round's first arrival.
- The store traffic of a member does not grow with the job: its watch reads one peer's beat (its
  successor on a ring that puts the processes of one node apart), `latest` and the generation's
  notices, four operations a round. The first member to see its peer silent ends the generation
  for everyone in one signed notice (docs/survivor-modes.md, "Scale").
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import socket
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, ContextManager, TypeVar

import torch
import torch.distributed as dist

from app.cluster.distributed import World
from app.cluster.secret import SECRET_ENV, job_key, proof, proves
from app.core.config import endpoint
from app.core.errors import JobOver, UserError
from app.core.policy import FaultPolicy
from app.ft import protocol, records
from app.ft.groups import ENDED, Ended, groups_for
from app.ft.pace import SharedPace
from app.ft.protocol import (NOTICES, Arrival, Beat, Done, Flow, Listed, Member, Roster, StoreLost, Unavailable,
                             behind, sends_state, successor)
from app.ft.reach import Listener, Probe, numeric, unreachable
from app.ft.records import INCARNATION, MEMBER, NUMBER, Keys, Rejects, peek
from app.ft.replica import REPLICA_ENV, advertised_host, copy_back, flat_copy
from app.ft.slow_nodes import StepAside
from app.ft.writer import WriterLease
from app.recovery import threads
from app.recovery.failures import short_cause
from app.training.evaluate import Scorer
from app.training.guard import Terminated
from app.training.state import step_of

T = TypeVar("T")


class InPlaceGroup:
    """This process as a member of the job's generations: its share of each step, the all-reduce
    across members, and what happens when a member leaves or comes. app/ft/membership.py's
    Membership, as torchft mode's Replica is, so that app/ft/trainer.py runs either."""

    errored: str | None     # why this step's all-reduce failed (Membership.errored)

    def __init__(self, world: World, policy: FaultPolicy, endpoint: str, job: str,
                 state: Callable[[], Any], load: Callable[[Any], None],
                 idle: Callable[[], ContextManager[None]] = contextlib.nullcontext, full_size: int = 0,
                 stopping: Callable[[], bool] = lambda: False, say: Callable[[str], None] = print,
                 stuck: Callable[[str], None] | None = None, epochs: int = 0,
                 refresh: Callable[[], tuple[int, int, str]] | None = None, pace: SharedPace | None = None) -> None:
        """state, load: this member's state to send, and how to load a source's; refresh: what its state
        holds before it arrives at a round (protocol.Refresh: steps, samples, lineage, a newer snapshot
        loaded first); pace: this process's step times and its watch over the nodes' (app/ft/pace.py),
        riding each step's all-reduce; the others: the node's progress bound, the spare's size, SIGTERM,
        lines, a stuck NCCL call, the epochs the job trains."""
        self.world, self.policy = world, policy
        self._refresh = refresh or (lambda: (self.step, self.me.samples, self.me.lineage))
        self._stopping, self._say = stopping, say
        self._waiting: contextlib.ExitStack | None = None   # while a spare: out of the host's count, the progress bound
        self._waker: tuple[int, threading.Event, threading.Thread | None] = (0, threading.Event(), None)
        self.member = uuid.uuid4().hex[:12]
        self.name = os.environ.get(REPLICA_ENV) or f"{socket.gethostname()}-{os.getpid()}"   # the node's
        self.endpoint, self.keys = endpoint, Keys(job)     # the group store, and this job's keys in it
        self._secret = job_key()
        self._state, self._load = state, load
        self._idle = idle       # around a wait that is no stuck step: the node's progress bound waits
        self.rejects = Rejects(policy.store_warning_interval_s)
        self._store_at: str | None = None   # the store's numeric address, as the main thread last resolved it
        self.store = self.connect()
        self.pending_since: float | None = None    # when the operation the main thread waits for began
        # How a generation's group is formed and ended; `stuck`: what an NCCL call past its bound does.
        self.groups = groups_for(world.device, policy, stuck)
        self.pg: dist.Backend | None = None
        self._regroup_next = False
        self.errored: str | None = None
        self.refused: list[str] = []    # strangers this member's rounds left out (said once each)
        self._lease = WriterLease(self.name, policy.ft_heartbeat_timeout_s)
        self._pace, self._step_aside = pace, StepAside(policy)
        self._aside_s = 0.0                 # this node steps aside: said at the next all-reduce
        self._leaves: str | None = None     # why this node leaves the job (slow, SLOW_REPLACE=2)
        self._refuse_if_stranger()
        self.listener = Listener(advertised_host())
        # The protocol's view of this member (app/ft/protocol.py): what it holds, which generation it is in.
        self.me = Member(self.member, f"{self.name}/{world.local_rank}", self.listener.address, policy, full_size,
                         endpoint, epochs=epochs)
        self._leave_if_over(self._run(protocol.job_over(self.me)))
        self.watch = Watch(self)
        self.watch.start()

    @property
    def step(self) -> int:
        """Committed steps this member's state holds."""
        return self.me.step

    @step.setter
    def step(self, step: int) -> None:
        self.me.step = step

    @property
    def gen(self) -> int:
        return self.me.gen

    @property
    def formed(self) -> int:
        return self.me.formed

    @property
    def members(self) -> list[str]:
        return list(self.me.members)

    @property
    def full_size(self) -> int:
        return self.me.full_size

    # ------------------------------------------------------------ one step

    def start_step(self) -> None:
        """Re-form the group first if it has none, lost a member, or every member agreed at the last
        all-reduce to let one in."""
        if self.pg is not None and self.errored is None and (self._regroup_next or self.watch.ended.is_set()):
            # No step of this member failed (the watch ended the generation between two, or every
            # member agreed at the last all-reduce to form anew): say why, as a failed step's warning does.
            self._say(f"generation {self.formed} ended before step {self.step + 1} "
                      f"({self.watch.reason or 'a member asked for a new one'}): forming a new one")
        if self._leaves is not None:
            self.shutdown()
            raise JobOver(self._leaves)
        if self.pg is None or self._regroup_next or self.watch.ended.is_set():
            self._leave_if_over(self._run(protocol.regroup(self.me)))

    def _leave_if_over(self, done: Done | None) -> None:
        """The job's done mark covers this member's epochs: it leaves without training (JobOver)."""
        if done is not None:
            self.shutdown()
            raise JobOver(f"the job finished: {done.epochs} epochs, {done.step} steps (the done mark in the "
                          f"group store at {self.endpoint}); this node leaves without training")

    def finished(self) -> None:
        """This member trained the job to its end: the done mark, before it stops beating."""
        self._run(protocol.finish(self.me))

    def share(self) -> tuple[int, int]:
        """(this process's slot, slots in this step): its rank and the generation's size."""
        return self.members.index(self.member), len(self.members)

    def average_gradients(self, parameters: list[torch.nn.Parameter], buffers: list[torch.Tensor]) -> None:
        """The gradients and batch-norm statistics averaged over the generation in one flat all-reduce
        (replica.py's flat_copy). A failure (a member that died or was cut off mid-step) is not
        raised: it makes commit() say no.

        More numbers ride along: whether this member's watch wants a new generation (a node asks to
        come in), and each member's step times and seconds aside (app/ft/pace.py). Every member reads
        the same sum, so all of them finish this step and re-form at the same boundary; deciding it
        alone, one would wait at the round for a peer waiting for it in the next step's all-reduce."""
        self.errored = self.watch.fenced()
        if self.errored is not None:    # frozen or starved past the fencing bound: the others may have gone on
            self._regroup_next = True   # without it, and a generation of one would commit steps of its own
            return                      # between waking and its watch's next look
        riding = SharedPace.numbers(len(self.members)) if self._pace is not None else 0
        tensors, flat = flat_copy(parameters, buffers, spare=riding + 1)
        if riding:
            self._pace.put(flat[-riding - 1:-1], self.members.index(self.member), self._aside_s)
        flat[-1] = float(self.watch.wanted.is_set())
        self.errored = self._finish(self.pg.allreduce([flat]))
        if self.errored is not None:
            self._regroup_next = True
            return
        tail = flat[-riding - 1:].tolist()      # one read back, as the flag alone was (on a GPU, a sync)
        self._regroup_next = tail[-1] > 0
        if riding:
            self._shared(tail[:-1])
        copy_back(flat.div_(len(self.members)), tensors)

    def _shared(self, values: list[float]) -> None:
        """The step's numbers of every member: a node that steps aside (every member regroups after this
        step; this node's members then arrive aside, or leave), and this node's own choice once it is
        named slow (its first process's), said at the next step."""
        aside, mine = self._pace.shared(values, list(self.me.roster.names)), protocol.node_of(self.me.name)
        self._aside_s = 0.0
        if aside:
            self._regroup_next = True
        for node in aside.keys() - {mine} if self.world.local_rank == 0 else ():
            self._say(f"node {node} steps aside (slow): the others train on without it")
        seconds = aside.get(mine, 0.0)
        if seconds < 0:
            self._leaves = f"node {mine} leaves the job: it is slow (SLOW_REPLACE=2); the others train on"
        elif seconds > 0:
            self.me.aside_until = time.monotonic() + seconds
        if self.world.local_rank == 0:
            self._aside_s = self._choose(mine)

    def _choose(self, mine: str) -> float:
        """This node's seconds aside if its watch named it slow since it last chose (0: it stays)."""
        watch, now = self._pace.watch, time.monotonic()
        slow = watch.peers.named.get(mine)
        if slow is None or slow is self._step_aside.chosen_for:
            return 0.0
        # Each node's time: its median over the window, else (too few samples since a join) the others' at the naming.
        measured = watch.peers.compute_s(now)
        times = {node: measured.get(node, slow.others_s) for node in map(protocol.node_of, self.me.roster.names)}
        choice = self._step_aside.choose(slow, now, self._pace.step_s, {**times, mine: slow.compute_s}, self._spare_waits(),
                                         self._pace.overhead_s)
        if choice.line:
            self._say(choice.line)
        return choice.aside_s

    def _spare_waits(self) -> bool:
        """Whether a spare beats now (listed, in no generation), as a round's closer judges one: read once a
        naming, from the main thread; a store that does not answer says no."""
        try:
            return self._run(protocol.spare_beats(self.me, set(self.members)))
        except Unavailable:
            return False

    def _finish(self, work: dist.Work) -> str | None:
        """Wait for `work` without blocking on it (app/ft/groups.py): None once it completed, else why
        not. An operation of a generation the watch has ended (a peer went silent, the others went
        on without this member) is ended with its group (NCCL: aborted; gloo: left to run out its
        timeout in the background)."""
        outcome = self._wait(work)
        if outcome is ENDED:
            self.groups.end(self.pg, work)
            return self.watch.reason or "the generation ended"
        return outcome

    def _wait(self, work: dist.Work) -> str | None | Ended:
        """The backend's wait, its start noted for the watch: one pending past INPLACE_STALL makes it
        probe the peers (two attribute writes a step: nothing else when nothing is wrong)."""
        self.pending_since = time.monotonic()
        try:
            return self.groups.wait(work, self.watch.ended)
        finally:
            self.pending_since = None

    def commit(self) -> bool:
        """Whether this member's all-reduce completed: it then steps, and counts the step."""
        if self.errored is not None:
            return False
        self.step += 1
        return True

    def score_test_set(self, scorer: Scorer) -> list[float] | None:
        """Each member scores its shard and one all-reduce of the generation sums the counts: every
        member gets there at the same step (an epoch ends at the same position for all) with the
        same model (the step's gradients and batch-norm statistics are averaged). A member whose
        all-reduce fails (a peer died or was cut off meanwhile) scores the whole set alone, and
        re-forms before its next step instead of failing it."""
        slot, slots = self.share()
        counts = torch.tensor(scorer(slot, slots), dtype=torch.float64, device=self.groups.device)
        if self._finish(self.pg.allreduce([counts])) is None:
            return counts.tolist()
        self._regroup_next = True
        return scorer(0, 1)

    def check_secret(self, warn: Callable[[str], None]) -> None:
        while self.refused:
            warn(f"refused {self.refused.pop()}: it does not hold the job secret ({SECRET_ENV}); nothing was sent")
        line = self.rejects.line()
        if line:
            warn(line)

    def set_step(self, step: int, samples: int) -> None:
        """After a restore from a snapshot: the most advanced member becomes the source of a generation."""
        self.step = step

    def writes(self, directory: Path) -> bool:
        """Whether this member writes snapshots and metrics rows into `directory` now: local rank 0 of
        the node that holds the directory's lease (app/ft/writer.py)."""
        return self.world.local_rank == 0 and self._lease.holds(directory)

    def shutdown(self) -> None:
        if getattr(self, "watch", None) is not None:
            self.watch.stop()
        self._retire()
        self.groups.settle()        # the last group ended before the process exits, within the backend's bound
        self.listener.close()

    @property
    def backend(self) -> str:
        return self.groups.name

    @property
    def lineage(self) -> str:
        """The generation this member's state trains in now (protocol.lineage_of): snapshots keep it."""
        return self.me.lineage

    # ------------------------------------------------------------ the protocol's requests

    def _run(self, flow: Flow[T], store: dist.Store | None = None) -> T:
        """Carry out a flow of the protocol (app/ft/protocol.py) on `store` (the watch's connection; by
        default the main thread's, which a Reconnect replaces): each request it yields is done here and
        its result sent back; an error of the store or of forming a group is thrown into it as Unavailable."""
        result: Any = None
        error: Unavailable | None = None
        while True:
            try:
                request = flow.send(result) if error is None else flow.throw(error)
            except StopIteration as done:
                return done.value
            result, error = None, None
            try:
                result = self._do(request, self.store if store is None else store)
            except (dist.DistError, RuntimeError) as exc:   # the store went away, a member died forming
                error = Unavailable(short_cause(str(exc)))

    def _do(self, request: Any, store: dist.Store) -> Any:
        keys = self.keys
        match request:
            case protocol.Now():
                return time.monotonic()
            case protocol.Sleep(seconds=seconds, idle=idle):
                with self._idle() if idle else contextlib.nullcontext():
                    time.sleep(seconds)
            case protocol.ReadLatest():
                raw = peek(store, keys.latest())
                return None if raw is None else self.generation(raw)
            case protocol.ReadList(g=g):
                return self._listed(store, g)
            case protocol.ReadArrivals(g=g):
                return self._arrivals(store, g)
            case protocol.ReadNotices(g=g):
                return self.notices(store, g)
            case protocol.ReadSpares():
                return self.listed_spares(store)
            case protocol.ReadBeats(members=members):
                return {m: self.beat(store, m) for m in members}
            case protocol.Probe(addresses=addresses):
                return unreachable(addresses, self.policy.inplace_probe_timeout_s)
            case protocol.Unreachable():
                return self.watch.unreachable()
            case protocol.Notify(g=g, kind=kind, about=about):
                self.notify(store, g, kind, about)
            case protocol.Arrive(g=g, arrival=arrival):
                key = keys.arrivals(g)
                store.append(key, f"\n{json.dumps(records.arrival_record(arrival, self.proof(key, records.arrival_text(arrival))))}\n")
            case protocol.Close(g=g, roster=roster, strangers=strangers):
                return self._close(store, g, roster, strangers)
            case protocol.Refresh():
                return self._refresh()
            case protocol.Advance(g=g):
                self._advance(store, g)
            case protocol.ReadDone():
                return self._done(store)
            case protocol.ReadIncarnation():
                body = self.opened(keys.incarnation(), peek(store, keys.incarnation()))
                return body if body is not None and INCARNATION.fullmatch(body) else None
            case protocol.NewIncarnation():
                value = self.sign(keys.incarnation(), uuid.uuid4().hex[:8])
                held = store.compare_set(keys.incarnation(), "", value).decode(errors="replace")
                return held.rpartition("|")[0] if self.opened(keys.incarnation(), held.encode()) else None
            case protocol.MarkDone(epochs=epochs, step=step):
                store.set(keys.done(), self.sign(keys.done(), f"{epochs}:{step}"))
            case protocol.ListSpare():
                store.append(keys.spares(), f"\n{self.sign(keys.spares(), self.member)}\n")
            case protocol.AwaitArrival(g=g, seconds=seconds):
                woken = self._woken_at(g)
                woken.wait(seconds)
                if self._stopping():    # a SIGTERM's handler runs in this thread, which an Event's wait lets it
                    raise Terminated()
                return woken.is_set()
            case protocol.SpareWait(waiting=waiting):
                self._spare_wait(waiting)
            case protocol.Form(g=g, roster=roster):
                self._form(g, roster)
            case protocol.Retire():
                self._retire()
            case protocol.Say(line=line):
                self._say(line)
            case protocol.Reconnect():
                with contextlib.suppress(StoreLost):
                    self.store = self.connect()
            case _:
                raise TypeError(f"no such request of the protocol: {request!r}")
        return None

    def _listed(self, store: dist.Store, g: int) -> Listed:
        raw = peek(store, self.keys.closed(g))
        roster = self.closed_list(g, raw)
        unchecked = records.as_list(records.unsigned(raw)) if raw is not None and roster is None else None
        return Listed(roster, raw is not None, unchecked is not None and self.member in unchecked.refused)

    def _advance(self, store: dist.Store, g: int) -> None:
        """`latest` forward to g unless it is there already: compare-and-set from what it holds, again
        while another writer moves it meanwhile."""
        key = self.keys.latest()
        value = self.sign(key, str(g)).encode()
        while True:
            raw = peek(store, key)
            if raw is not None and self.generation(raw) >= g:
                return
            if store.compare_set(key, b"" if raw is None else raw, value) == value:
                return

    def _done(self, store: dist.Store) -> Done | None:
        body = self.opened(self.keys.done(), peek(store, self.keys.done()))
        epochs, _, step = (body or "").partition(":")
        return Done(int(epochs), int(step)) if NUMBER.fullmatch(epochs) and NUMBER.fullmatch(step) else None

    def _close(self, store: dist.Store, g: int, roster: Roster, strangers: tuple[str, ...]) -> bool:
        """Round g's list, if none is yet (atomic: of two closers, the first list stands)."""
        key = self.keys.closed(g)
        value = self.sign(key, records.list_text(roster))
        if store.compare_set(key, "", value) != value.encode():
            return False
        self.refused += strangers
        return True

    def _spare_wait(self, waiting: bool) -> None:
        """A spare's wait: out of the host's count of cores and of the node's progress bound; or back in."""
        if waiting and self._waiting is None:
            share, claim = self.world.cpu_share, self.world.gpu_claim
            self._waiting = contextlib.ExitStack()
            self._waiting.enter_context(self._idle())
            self._waiting.enter_context(share.away() if share is not None else contextlib.nullcontext())
            self._waiting.enter_context(claim.away() if claim is not None else contextlib.nullcontext())
        elif not waiting and self._waiting is not None:
            self._waiting.close()
            self._waiting = None

    def _woken_at(self, g: int) -> threading.Event:
        """Set once round g has an arrival: a thread blocks in the store's wait for it, on a connection of
        its own (a wait that times out says so in the log: its bound is the quorum timeout, and a wait
        that ends unset is begun again)."""
        g_waited, woken, thread = self._waker
        if g_waited == g and (woken.is_set() or thread is not None and thread.is_alive()):
            return woken
        woken = threading.Event()

        def wait() -> None:
            try:
                self.connect().wait([self.keys.arrivals(g)], timedelta(seconds=self.policy.ft_quorum_timeout_s))
                woken.set()
            except (dist.DistError, RuntimeError, StoreLost):
                pass        # the store went away or the bound passed: the next look begins another wait

        self._waker = (g, woken, threads.start("inplace-spare", wait))
        return woken

    def _form(self, g: int, roster: Roster) -> None:
        """Build generation g's process group, then bring every member to rank 0's state. The watch
        follows it from here: a peer that goes silent or cannot be reached ends the sending too."""
        rank = roster.members.index(self.member)
        self._regroup_next = False
        self.watch.pause()
        self._retire()      # every member of the last generation has arrived or is gone: none uses it now
        self._claim_gpu()
        pg = self._connect_group(g, rank, len(roster.members))
        self.watch.follow(g, roster.members, roster.names, roster.addrs)
        try:
            if sends_state(roster):
                self._sync(pg, rank, behind=behind(roster, self.member))
        except BaseException:
            self.groups.end(pg, None)       # returns at once (NCCL: ended in a thread of its own)
            del pg
            raise
        self.pg = pg
        moved = self.world.cpu_share.named() if self.world.cpu_share is not None else None
        if moved:
            self._say(moved)

    def _claim_gpu(self) -> None:
        """Named: a spare-ready node's process claims its GPU now (app/cluster/gpus.py), moving there if
        it must, and the group forms on it."""
        claim = self.world.gpu_claim
        said = claim.named() if claim is not None else None
        if said:
            self._say(said)
            self.groups.device = self.world.device

    def _connect_group(self, g: int, rank: int, size: int) -> dist.Backend:
        """Generation g's group, on a store connection of its own (a forming that a failed round leaves
        running must not hold the main one). One that does not form tells the members that formed
        theirs to leave it too."""
        try:
            return self.groups.form(dist.PrefixStore(self.keys.pg(g), self.connect()), rank, size, g)
        except (dist.DistError, RuntimeError):
            self.notify(self.store, g, "cut", self.member)
            raise

    def _retire(self) -> None:
        """End the current generation's group and let go of it. Nothing here waits for its end: on NCCL
        a thread of its own aborts it and drops its last reference (app/ft/groups.py, Ends)."""
        pg, self.pg = self.pg, None
        if pg is not None:
            self.groups.end(pg, None)
        del pg

    def _sync(self, pg: dist.Backend, rank: int, behind: bool) -> None:
        """Rank 0's whole state to every member of the new group; those behind it load it (tensors and
        plain values only: weights_only, as torchft mode's transport)."""
        device = self.groups.device
        payload = torch.empty(0, dtype=torch.uint8, device=device)
        if rank == 0:
            buffer = io.BytesIO()
            torch.save(self._state(), buffer)
            payload = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8).to(device)
        size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
        self._broadcast(pg, size)
        if rank != 0:
            payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
        self._broadcast(pg, payload)
        if behind:
            state = torch.load(io.BytesIO(payload.cpu().numpy().tobytes()), weights_only=True)
            self._load(state)
            self.step = step_of(state)

    def _broadcast(self, pg: dist.Backend, tensor: torch.Tensor) -> None:
        """Rank 0's `tensor` on every member, waited for as an all-reduce is (and ended by the watch as
        one is); a failure raises, and the member meets the others again."""
        work = pg.broadcast([tensor], dist.BroadcastOptions())
        outcome = self._wait(work)
        if outcome is ENDED:
            self.groups.end(pg, work)       # gloo: kept until the broadcast runs out its timeout
            outcome = self.watch.reason or "the generation ended"
        if outcome is not None:
            raise RuntimeError(f"sending the state to the new group failed: {outcome}")

    def _refuse_if_stranger(self) -> None:
        """A node whose secret does not sign the running job's generation stops here, before it
        arrives: the job's members would leave it out of every generation anyway. A job whose
        members all stopped beating long ago is no job: its record is ignored. What a stranger
        reads here it cannot check (it lacks the secret): only its form is."""
        keys = self.keys
        latest = peek(self.store, keys.latest())
        if latest is None or self.opened(keys.latest(), latest) is not None:
            return
        g = records.unsigned(latest)
        if not NUMBER.fullmatch(g):
            return
        closed = peek(self.store, keys.closed(int(g)))
        listed = records.as_list(records.unsigned(closed)) if closed is not None else None
        if listed is None or self.opened(keys.closed(int(g)), closed) is not None:
            return
        beats = [records.beat_of(records.unsigned(peek(self.store, keys.beat(m)) or b"")) for m in listed.members]
        last = max((b[1] for b in beats if b is not None), default=0.0)
        if time.time() - last < self.policy.inplace_job_gone_s:
            raise UserError(f"the job '{keys.job}' at {self.endpoint} holds another job secret "
                            f"({SECRET_ENV}): this node is refused and nothing was sent")

    def connect(self, timeout_s: float | None = None, resolve: bool = True) -> dist.TCPStore:
        """A new connection to the group store, whose operations fail after `timeout_s` (the collective
        timeout by default; the watch thread keeps one of its own, on a shorter bound). `resolve`: look
        the store's host name up again (the main thread's connections); the watch's reconnects use the
        address found last and resolve nothing (a resolver that hangs during a network fault would stop
        the beats, reach.numeric)."""
        if resolve or self._store_at is None:
            host, port = endpoint(self.endpoint, "--group-store")
            self._store_at = numeric(f"{host}:{port}")
        host, _, port = self._store_at.rpartition(":")
        host, port = host.strip("[]"), int(port)
        try:
            return dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                                 timeout=timedelta(seconds=timeout_s or self.policy.collective_timeout_s))
        except (dist.DistError, RuntimeError) as exc:
            raise StoreLost(f"no group store answered at {self.endpoint} ({short_cause(str(exc))}); start one "
                            "(the compose store service, or `python -m app.node store`) or pass --group-store") from None

    # ------------------------------------------------------------ signed values (app/cluster/secret.py)

    def proof(self, key: str, body: str) -> str:
        """The job secret's proof of `body` as the value of `key`."""
        return proof(self._secret, key, body)

    def proves(self, said: str, key: str, body: str) -> bool:
        """Whether `said` is the job secret's proof of `body` as the value of `key`."""
        return proves(self._secret, said, key, body)

    def sign(self, key: str, body: str) -> str:
        return f"{body}|{self.proof(key, body)}"

    def opened(self, key: str, raw: bytes | None) -> str | None:
        """The body of a value of `key` that a member of this job signed; None (counted) if not."""
        if raw is None:
            return None
        body, _, said = raw.decode(errors="replace").rpartition("|")
        if self.proves(said, key, body):
            return body
        self.rejects.add(self.keys.kind(key))
        return None

    def generation(self, latest: bytes | None) -> int:
        """The generation a signed `latest` names; 0 for none or one no member signed."""
        body = self.opened(self.keys.latest(), latest)
        return int(body) if body is not None and NUMBER.fullmatch(body) else 0

    def beat(self, store: dist.Store, member: str) -> Beat | None:
        """`member`'s newest signed beat, its age by this host's clock; None while it has no valid one."""
        key = self.keys.beat(member)
        beat = records.beat_of(self.opened(key, peek(store, key)) or "")
        return None if beat is None else Beat(beat[0], time.time() - beat[1])

    def notify(self, store: dist.Store, g: int, kind: str, about: str) -> None:
        """A signed notice to generation g's members: appended, so that no writer overwrites another's."""
        key = self.keys.end(g)
        store.append(key, f"\n{self.sign(key, f'{kind}:{about}')}\n")

    def notices(self, store: dist.Store, g: int) -> dict[str, set[str]]:
        """Generation g's signed notices by kind: who asks in, who went silent, who cannot reach a peer."""
        found: dict[str, set[str]] = {kind: set() for kind in NOTICES}
        key = self.keys.end(g)
        for line in (peek(store, key) or b"").split(b"\n"):
            body = self.opened(key, line) if line else None
            kind, _, about = (body or "").partition(":")
            if kind in found:
                found[kind].add(about)
        return found

    def listed_spares(self, store: dist.Store) -> set[str]:
        """The members that ever waited as spares (signed)."""
        key = self.keys.spares()
        return {body for line in (peek(store, key) or b"").split(b"\n") if line
                and (body := self.opened(key, line)) is not None and MEMBER.fullmatch(body)}

    def closed_list(self, g: int, raw: bytes | None) -> Roster | None:
        """Round g's list if a member of this job signed it."""
        return records.as_list(self.opened(self.keys.closed(g), raw))

    def _arrivals(self, store: dist.Store, g: int) -> tuple[list[Arrival], list[Arrival]]:
        """Round g's arrivals in the order of their first record, each as its newest: those that prove they
        hold the secret, and the well-formed others (strangers, to be told they are refused)."""
        good: dict[str, Arrival] = {}
        strangers: dict[str, Arrival] = {}
        key = self.keys.arrivals(g)
        for line in (peek(store, key) or b"").split(b"\n"):
            found = records.arrival_of(line) if line else None
            if found is None:
                if line:
                    self.rejects.add(self.keys.kind(key))
                continue
            arrival, said = found
            into = good if self.proves(said, key, records.arrival_text(arrival)) else strangers
            into[arrival.member] = arrival      # its newest record, in the place of its first (a closer arrives again)
        return list(good.values()), [a for m, a in strangers.items() if m not in good]


class Watch:
    """One thread per member, on a store connection of its own: beats, then runs the protocol's look at
    the generation it follows (app/ft/protocol.py's `look`: `latest`, the notices, one peer's beat, and,
    while the main thread's operation is pending past INPLACE_STALL, whether every peer is reachable
    over the data path), and carries out its verdict: `wanted` for the main thread's next step
    boundary, `ended` to leave the generation now, a notice to the others."""

    def __init__(self, group: InPlaceGroup) -> None:
        self.group = group
        self.wanted = threading.Event()     # a new generation, at the next step boundary
        self.ended = threading.Event()      # this generation is over for this member: leave its operations
        self.reason: str | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._following: tuple[int, str | None, list[str]] | None = None    # g, the peer watched, numeric probe addresses
        self._probe: Probe | None = None
        self._thread: threading.Thread | None = None
        self._beat = 0
        self._beat_ok = time.monotonic()    # when a beat last reached the store

    def start(self) -> None:
        """The thread, through app/recovery/threads.py: what it does not handle ends the node."""
        self._thread = threads.start("inplace-watch", self._run)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.group.policy.ft_heartbeat_timeout_s)

    def want(self, reason: str) -> None:
        self.reason = self.reason or reason
        self.wanted.set()

    def pause(self) -> None:
        """A new generation is forming: stop watching the old one."""
        with self._lock:
            self._following = None

    def follow(self, g: int, members: list[str] | tuple[str, ...], names: list[str] | tuple[str, ...],
               addrs: list[str] | tuple[str, ...]) -> None:
        """Watch generation g from now on. Called by the main thread, which resolves the peers' probe
        addresses here, once per generation: the thread that beats resolves no name (reach.numeric)."""
        peers = [numeric(a) for m, a in zip(members, addrs) if m != self.group.member]
        with self._lock:
            self._following = (g, successor(self.group.member, members, names), peers)
            self._probe = None
            self.reason = None
            self.wanted.clear()
            self.ended.clear()

    def _run(self) -> None:
        """Its store operations fail after the fencing bound (protocol.fenced): a beat that cannot reach the
        store ends this member's generation before the others count it gone."""
        store = None
        bound = protocol.FENCE_FRACTION * self.group.policy.ft_heartbeat_timeout_s
        while not self._stop.wait(self.group.policy.ft_heartbeat_interval_s):
            try:
                store = store or self.group.connect(bound, resolve=False)
                self._round(store)
            except (dist.DistError, RuntimeError, StoreLost, Unavailable):
                store = None        # the store restarted or is cut off: connect again next time
                self._fence()

    def fenced(self) -> str | None:
        """Why this member must not go on in its generation now: its last beat that reached the store is
        past the fencing bound (protocol.fenced); None while it beats."""
        return protocol.fenced(self.group.me, time.monotonic() - self._beat_ok)

    def _fence(self) -> None:
        why = self.fenced()
        with self._lock:
            following = self._following
        if why is not None and following is not None:
            self._cut(following, why)

    def _round(self, store: dist.TCPStore) -> None:
        """Four store operations, whatever the job's size: the beat, `latest`, the notices, one peer's beat."""
        group = self.group
        self._fence()       # back from a freeze or a stall past the bound: the generation may have gone on
        self._beat += 1
        beat = group.keys.beat(group.member)
        store.set(beat, group.sign(beat, f"{self._beat}:{time.time():.3f}"))
        self._beat_ok = time.monotonic()
        with self._lock:
            following = self._following
        if following is None:
            return
        g, peer, _ = following
        verdict = group._run(protocol.look(group.me, g, peer), store)
        if verdict.want:
            self.want(verdict.want)
        if verdict.notify:
            group.notify(store, g, *verdict.notify)
        if verdict.cut:
            self._cut(following, verdict.cut)

    def unreachable(self) -> bool:
        """Whether a probe of the peers did not reach one. Made only while the main thread's operation
        has been pending past INPLACE_STALL, again each INPLACE_STALL while it stays so (a slow peer
        is reached and waited for): a data link down, which no beat shows, is found in seconds
        instead of the collective timeout. The probe runs across rounds, never holding the beat, to the
        numeric addresses `follow` resolved: no name is resolved here."""
        policy = self.group.policy
        since = self.group.pending_since
        with self._lock:
            peers = self._following[2] if self._following is not None else []
        if since is None or not peers or time.monotonic() - since < policy.inplace_stall_s:
            self._probe = None
            return False
        if self._probe is None or time.monotonic() - self._probe.started >= policy.inplace_stall_s:
            self._probe = Probe(peers, policy.inplace_probe_timeout_s)
        return bool(self._probe.result())

    def _cut(self, following: tuple[int, str | None, list[str]], reason: str) -> None:
        """End the generation for this member: the main thread leaves its pending operation."""
        self.want(reason)
        with self._lock:
            if self._following is following:
                self._following = None
                self.ended.set()
