"""In-place mode (--ft inplace): the survivors of a fault re-form their process group among themselves
and go on, on torch's own c10d; no torchft, and nothing between two steps while nobody comes or goes.

Why beside torchft: torchft asks its Lighthouse for a quorum and votes a commit at every step (two
round trips a step: about 0.8 of elastic's throughput on the quick configuration here), and a
hung group holds the others inside the step's all-reduce until its timeout, since torchft cannot
abort it (docs/survivor-modes.md). Here the members meet in the job's store only when the
membership changes, and a member that stops beating is cut off at once.

- Every training process of every node is a member. Members meet in a TCPStore every node reaches
  (--group-store: the compose store service's, the one the elastic rendezvous uses) under the job's
  namespace; each beats there from a thread of its own.
- A generation is one process group of the members it names, built under its own key prefix: gloo
  on CPU hosts, NCCL on CUDA hosts (app/ft/groups.py: how each backend's group is formed, waited on
  and ended; on NCCL every generation that ends is aborted).
  A member asks for the next one when it starts (a node that comes back), when its all-reduce
  failed, or when its watch saw a peer's beat stop; the members of the current generation see the
  request at their next step boundary and come. The first to arrive closes the round, once every
  member of the last generation has either arrived or been silent for the heartbeat timeout.
- A silent peer is cut off at once: once its beat has stopped for the heartbeat timeout, the
  watch ends the generation for this member, and the main thread, which waits for an all-reduce
  without blocking on it (gloo: slices of the heartbeat interval; NCCL: polling), leaves it instead
  of waiting out the collective timeout. On NCCL it aborts the group; on gloo the operation runs
  out its timeout in the background (torch 2.14's gloo backend has no abort: ProcessGroupGloo
  inherits Backend::abort, a no-op; its experimental `_reconfigure` re-forms a group but cannot end
  a pending all-reduce either). So does a member that finds the others in a newer generation than
  its own (it was stopped or cut off meanwhile).
- A peer cut off over the data path (its link to the others down, the store still reached) beats on:
  probes find it (app/ft/reach.py). A member whose all-reduce is pending past INPLACE_STALL probes
  the generation's peers (a TCP connect to each one's probe address); one it cannot reach ends the
  generation for everyone with a signed `cut` notice. Each arrival at the next round reports the
  members of the last list its probes did not reach, and the closer names the largest set of
  arrivals that reach one another: one signed list decides who trains, so two sides of a cut never
  both do. A member that is not in the newest generation (left out, or new) and cannot reach a
  beating member of it does not arrive (it would call the others to a round that leaves it out
  again): it probes until it reaches them, the node's progress bound paused, then comes in as a
  node that comes back does. A gloo group that does not connect within INPLACE_FORM_BOUND is a
  failed round, taken again with fresh probes. A step that completes costs none of this: the
  main thread notes when its wait began, nothing more.
- The most advanced member is rank 0 of a new generation and sends its whole state (weights,
  optimizer, schedule, position) to the members behind it. Members at one step hold the same
  state and exchange nothing, so a fault costs the survivors no transfer at all.
- Only members that prove they hold the job secret (JOB_SECRET) are named in a generation, and a
  member only joins a list signed with it: no stranger is sent the weights.
- Nothing a member reads from the store steers it unless a member signed it (app/cluster/secret.py): the
  generation (`latest`), the notices that end one (`{g}/end`: a member asks in, a peer went
  silent or cannot be reached), the beats, the arrivals and the lists (`Keys` names every key, in one place). Each
  signature names the job, the key and the generation it is about, beats count up, and `latest`
  only ever moves a member forward, so a value copied from elsewhere or replayed is as worthless
  as a forged one: it is counted and said in one warning a minute
  (FaultPolicy.store_warning_interval_s), nothing else.
- Spares (--full-size N): a job of N nodes names at most N nodes in a generation, those of the last one
  first. A member left out of a full job (a node started beside it, or one that comes back while
  the job is full) waits as a spare: out of its host's count of cores (app/cluster/cores.py), while a
  thread of its own blocks in the store's wait for the next round's first arrival (its main thread
  looks once a heartbeat timeout whether the members still beat). It arrives at every round, and one that
  is short of N nodes names it; a closer short of nodes waits for the spares that beat (`spares`
  lists them), so one round both drops a lost node and takes the spare in, which heals from the
  most advanced member as a node that comes back does.
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
import re
import socket
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, ContextManager

import torch
import torch.distributed as dist

from app.cluster.distributed import World
from app.cluster.secret import SECRET_ENV, job_key, proof, proves
from app.core.config import endpoint
from app.core.errors import UserError
from app.ft.groups import ENDED, Ended, groups_for
from app.ft.reach import Listener, Probe, mutual, unreachable
from app.ft.replica import REPLICA_ENV, advertised_host, copy_back, flat_copy
from app.ft.writer import WriterLease
from app.recovery import threads
from app.core.policy import FaultPolicy
from app.recovery.failures import short_cause
from app.recovery.silence import Silence
from app.training.evaluate import Scorer
from app.training.guard import Terminated
from app.training.state import step_of

NAMESPACE = "app/inplace"
# compare_set's expected value in peek(): a key holding it is answered with FORGED instead (set by
# the same call), so that a missing key and every value anyone wrote are told apart in one operation.
ABSENT, FORGED = b"\x00absent", b"\x00forged"
MEMBER = re.compile(r"[0-9a-f]{12}")
NAME = re.compile(r"[\w.:@-]{1,200}/\d{1,5}", re.ASCII)     # node/local rank, as it is printed in warnings
NUMBER = re.compile(r"\d{1,18}", re.ASCII)
ADDRESS = re.compile(r"[\w.:\[\]-]{1,200}:\d{1,5}", re.ASCII)     # a member's probe address (app/ft/reach.py)
# A member asks to come in; a peer of the generation went silent; a member could not reach a peer over
# the data path, or the generation's group did not connect.
NOTICES = ("reform", "silent", "cut")
CUT = "a peer is unreachable over the data path"      # why a generation ended on a "cut" notice


class StoreLost(UserError):
    """The group store did not answer for the quorum timeout: the job cannot re-form without it."""


def peek(store: dist.Store, key: str) -> bytes | None:
    """A key's value, or None when there is none, in one store operation that never waits (get waits
    for a missing key for the store's whole timeout)."""
    value = store.compare_set(key, ABSENT, FORGED)
    return None if value == ABSENT else value


@dataclass(frozen=True)
class Keys:
    """Every key of one job in the group store, spelled here only. Each is the whole key: what the
    store holds and what a signature names (app/cluster/secret.py binds a value to its key, so a value
    copied to another key proves nothing)."""

    job: str

    @property
    def namespace(self) -> str:
        return f"{NAMESPACE}/{self.job}/"

    def latest(self) -> str:
        """The newest generation closed (it only ever moves a member forward)."""
        return self.namespace + "latest"

    def beat(self, member: str) -> str:
        """A member's beats: their count and the wall-clock time of the last."""
        return f"{self.namespace}beat/{member}"

    def arrivals(self, g: int) -> str:
        """Who came to round g, appended one line each."""
        return f"{self.namespace}{g}/arrivals"

    def closed(self, g: int) -> str:
        """Round g's list, written once by the member that closes it."""
        return f"{self.namespace}{g}/closed"

    def end(self, g: int) -> str:
        """Generation g's notices (NOTICES), appended one line each."""
        return f"{self.namespace}{g}/end"

    def spares(self) -> str:
        """The members that waited as spares, appended one signed line each."""
        return self.namespace + "spares"

    def pg(self, g: int) -> str:
        """The prefix generation g's process group is built under."""
        return f"{self.namespace}{g}/pg/"

    def kind(self, key: str) -> str:
        """How a warning counts `key`: every member's beat as beat/*, every generation's keys as <g>/..."""
        name = key.removeprefix(self.namespace)
        return "beat/*" if name.startswith("beat/") else re.sub(r"^\d+/", "<g>/", name)


class Rejects:
    """Values read from the store that no member signed or that make no sense: counted by kind of key (from
    the watch thread and the main one), said at most once per interval by the main thread."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._counts: Counter[str] = Counter()
        self._said_at = -interval_s
        self._lock = threading.Lock()

    def add(self, kind: str) -> None:
        """One more of a kind of key (Keys.kind)."""
        with self._lock:
            self._counts[kind] += 1

    def line(self) -> str | None:
        now = time.monotonic()
        with self._lock:
            if not self._counts or now - self._said_at < self.interval_s:
                return None
            counts, self._counts, self._said_at = self._counts, Counter(), now
        keys = ", ".join(f"{k} ({n})" for k, n in counts.most_common(5))
        return (f"ignored {sum(counts.values())} values in the group store that no member of this job signed or "
                f"that make no sense: {keys}; something else writes to the store (docs/security.md, threat model)")


class InPlaceGroup:
    """This process as a member of the job's generations: its share of each step, the all-reduce
    across members, and what happens when a member leaves or comes. app/ft/membership.py's
    Membership, as torchft mode's Replica is, so that app/ft/trainer.py runs either."""

    errored: str | None     # why this step's all-reduce failed (Membership.errored)

    def __init__(self, world: World, policy: FaultPolicy, endpoint: str, job: str,
                 state: Callable[[], Any], load: Callable[[Any], None],
                 idle: Callable[[], ContextManager[None]] = contextlib.nullcontext, full_size: int = 0,
                 stopping: Callable[[], bool] = lambda: False, say: Callable[[str], None] = print,
                 stuck: Callable[[str], None] | None = None) -> None:
        self.world, self.policy = world, policy
        self.full_size = full_size      # nodes a generation names at most (--full-size); 0: no bound
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
        self.store = self.connect()
        self.step = 0                   # committed steps this member's state holds
        self.gen, self.members = 0, [self.member]
        self.formed = 0                 # the generation of `pg` (gen moves on past rounds passed over)
        self.pending_since: float | None = None    # when the operation the main thread waits for began
        # How a generation's group is formed and ended; `stuck`: what an NCCL call past its bound does.
        self.groups = groups_for(world.device, policy, stuck)
        self.pg: dist.Backend | None = None
        self._regroup_next = False
        self.errored: str | None = None
        self.refused: list[str] = []    # strangers this member's rounds left out (said once each)
        self._lease = WriterLease(self.name, policy.ft_heartbeat_timeout_s)
        self._refuse_if_stranger()
        self.listener = Listener(advertised_host())
        self.watch = Watch(self)
        self.watch.start()

    # ------------------------------------------------------------ one step

    def start_step(self) -> None:
        """Re-form the group first if it has none, lost a member, or every member agreed at the last
        all-reduce to let one in."""
        if self.pg is not None and self.errored is None and (self._regroup_next or self.watch.ended.is_set()):
            # No step of this member failed (the watch ended the generation between two, or every
            # member agreed at the last all-reduce to form anew): say why, as a failed step's warning does.
            self._say(f"generation {self.formed} ended before step {self.step + 1} "
                      f"({self.watch.reason or 'a member asked for a new one'}): forming a new one")
        if self.pg is None or self._regroup_next or self.watch.ended.is_set():
            self._regroup()

    def share(self) -> tuple[int, int]:
        """(this process's slot, slots in this step): its rank and the generation's size."""
        return self.members.index(self.member), len(self.members)

    def average_gradients(self, parameters: list[torch.nn.Parameter], buffers: list[torch.Tensor]) -> None:
        """The gradients and batch-norm statistics averaged over the generation in one flat all-reduce
        (replica.py's flat_copy). A failure (a member that died or was cut off mid-step) is not
        raised: it makes commit() say no.

        One more number rides along: whether this member's watch wants a new generation (a node
        asks to come in). Every member reads the same sum, so all of them finish this step and
        re-form at the same boundary; deciding it alone, one would wait at the round for a peer
        waiting for it in the next step's all-reduce."""
        self.errored = None
        tensors, flat = flat_copy(parameters, buffers, spare=1)
        flat[-1] = float(self.watch.wanted.is_set())
        self.errored = self._finish(self.pg.allreduce([flat]))
        if self.errored is not None:
            self._regroup_next = True
            return
        self._regroup_next = bool(flat[-1].item() > 0)
        copy_back(flat.div_(len(self.members)), tensors)

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
        self.watch.stop()
        self._retire()
        self.listener.close()

    @property
    def backend(self) -> str:
        return self.groups.name

    # ------------------------------------------------------------ a new generation

    def _regroup(self) -> None:
        """Meet the others at the next round until one names this member and its group forms. A round
        whose list no member signed (written first by someone else) is passed over by everyone alike;
        a member cut off from the newest generation waits until it reaches it (_held_off)."""
        deadline = time.monotonic() + self.policy.ft_quorum_timeout_s
        while True:
            try:
                g = max(self.gen, self.generation(peek(self.store, self.keys.latest()))) + 1
                last = self.closed_list(g - 1, peek(self.store, self.keys.closed(g - 1)))
                if self._spare(g, last):
                    deadline = time.monotonic() + self.policy.ft_quorum_timeout_s    # the store answers
                    continue
                unreached = self._unreached(g - 1, last)
                if self._held_off(last, unreached):
                    deadline = time.monotonic() + self.policy.ft_quorum_timeout_s    # the store answers
                elif self._meet(g, unreached, deadline):
                    return
            except (dist.DistError, RuntimeError, StoreLost) as exc:   # the store went away, a member died forming
                self.errored = short_cause(str(exc))
                if time.monotonic() > deadline:
                    raise StoreLost(f"no group formed at the group store {self.endpoint} within "
                                    f"{self.policy.ft_quorum_timeout_s:g} s ({self.errored}): is it running?") from None
                time.sleep(self.policy.ft_heartbeat_interval_s)
                try:
                    self.store = self.connect()
                except StoreLost:
                    pass

    def _meet(self, g: int, unreached: list[str], deadline: float) -> bool:
        """Round g: whether it named this member (its group then formed), else on to the next."""
        closed = Round(self, g, unreached).meet(deadline)
        if closed is not None and self.member in closed["members"]:
            self._form(g, closed)
            moved = self.world.cpu_share.named() if self.world.cpu_share is not None else None
            if moved:
                self._say(moved)
            return True
        self.gen = g
        if closed is not None:      # left out of a signed list, the newest generation: its own group is none
            self._retire()          # any more (a round passed over changes nothing)
        return False

    def _unreached(self, g: int, listed: dict | None) -> list[str]:
        """The members of round g's list that a probe of their data addresses did not reach, but for
        those a peer already named silent (no probe waits for a node known to be gone)."""
        if listed is None:
            return []
        silent = self.notices(self.store, g)["silent"]
        peers = {a: m for m, a in zip(listed["members"], listed["addrs"]) if m != self.member and m not in silent}
        return sorted(peers[a] for a in unreachable(peers, self.policy.inplace_probe_timeout_s))

    def _spare(self, g: int, last: dict | None) -> bool:
        """Whether this member waited as a spare, instead of arriving at round g: the last generation
        (`last`) trains at full size without it. It waits, out of the host's count of cores and of
        the node's progress bound until it arrives, for round g's first arrival (a thread blocked on
        the store), a heartbeat timeout at most: then it looks again whether the members still beat,
        and whether a SIGTERM came (its handler runs in this thread, which an Event's wait lets it)."""
        if not self.full_size or last is None or self.member in last["members"] or self._short(last):
            self._back_in()
            return False
        if not self._spare_listed():
            self.store.append(self.keys.spares(), f"\n{self.sign(self.keys.spares(), self.member)}\n")
            self._say(f"waiting as a spare: the job trains on {self.full_size} nodes (generation {g - 1})")
        if self._waiting is None:
            share = self.world.cpu_share
            self._waiting = contextlib.ExitStack()
            self._waiting.enter_context(self._idle())
            self._waiting.enter_context(share.away() if share is not None else contextlib.nullcontext())
        woken = self._woken_at(g)
        woken.wait(self.policy.ft_heartbeat_timeout_s)
        if self._stopping():
            raise Terminated()
        if woken.is_set():
            self._back_in()
        return not woken.is_set()

    def _back_in(self) -> None:
        """A spare that arrives: back in the host's count of cores and under the progress bound."""
        if self._waiting is not None:
            self._waiting.close()
            self._waiting = None

    def _short(self, last: dict) -> bool:
        """Whether the nodes of `last` that still beat are fewer than the job's full size."""
        silence = self.watch.silence
        beating = {node_of(n) for m, n in zip(last["members"], last["names"])
                   if not silence.is_silent(m, self.beat_count(self.store, m))}
        return len(beating) < self.full_size

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

    def _spare_listed(self) -> bool:
        return self.member in self.listed_spares(self.store)

    def listed_spares(self, store: dist.Store) -> set[str]:
        """The members that ever waited as spares (signed)."""
        key = self.keys.spares()
        return {body for line in (peek(store, key) or b"").split(b"\n") if line
                and (body := self.opened(key, line)) is not None and MEMBER.fullmatch(body)}

    def _held_off(self, last: dict | None, unreached: list[str]) -> bool:
        """Whether to wait a poll instead of arriving: this member is not in the newest generation
        (left out, or new) and cannot reach a member of it that still beats. The others train on
        meanwhile: arriving would call them to a round that leaves this member out again. Such a
        wait is no stuck step: the node's progress bound waits (idle)."""
        if last is None or self.member in last["members"]:
            return False
        if all(self.watch.silence.is_silent(m, self.beat_count(self.store, m)) for m in unreached):
            return False
        with self._idle():
            time.sleep(self.policy.ft_heartbeat_interval_s)
        return True

    def _form(self, g: int, closed: dict) -> None:
        """Build generation g's process group, then bring every member to rank 0's state. The watch
        follows it from here: a peer that goes silent or cannot be reached ends the sending too."""
        members, steps = closed["members"], closed["steps"]
        rank = members.index(self.member)
        self._regroup_next = False
        self.watch.pause()
        self._retire()      # every member of the last generation has arrived or is gone: none uses it now
        pg = self._connect_group(g, rank, len(members))
        self.watch.follow(g, members, closed["names"], closed["addrs"])
        try:
            if len(set(steps)) > 1:
                self._sync(pg, rank, behind=steps[rank] != steps[0])
        except BaseException:
            with self.groups.bound(f"ending generation {g}'s group"):
                self.groups.end(pg, None)
                del pg
            raise
        self.pg, self.gen, self.formed, self.members = pg, g, g, members

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
        """End the current generation's group and drop it, within the backend's bound: the last
        reference goes there, and with it the group's threads (NCCL's destructor joins them)."""
        with self.groups.bound(f"ending generation {self.formed}'s group"):
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
        g = _unsigned(latest)
        if not NUMBER.fullmatch(g):
            return
        closed = peek(self.store, keys.closed(int(g)))
        listed = _as_list(_unsigned(closed)) if closed is not None else None
        if listed is None or self.opened(keys.closed(int(g)), closed) is not None:
            return
        beats = [_beat(_unsigned(peek(self.store, keys.beat(m)) or b"")) for m in listed["members"]]
        last = max((b[1] for b in beats if b is not None), default=0.0)
        if time.time() - last < self.policy.inplace_job_gone_s:
            raise UserError(f"the job '{keys.job}' at {self.endpoint} holds another job secret "
                            f"({SECRET_ENV}): this node is refused and nothing was sent")

    def connect(self) -> dist.TCPStore:
        """A new connection to the group store (the watch thread keeps one of its own)."""
        host, port = endpoint(self.endpoint, "--group-store")
        try:
            return dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                                 timeout=timedelta(seconds=self.policy.collective_timeout_s))
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

    def beat_count(self, store: dist.Store, member: str) -> int | None:
        """How many beats `member` has signed; None while it has no valid one."""
        key = self.keys.beat(member)
        beat = _beat(self.opened(key, peek(store, key)) or "")
        return None if beat is None else beat[0]

    def notify(self, store: dist.Store, g: int, kind: str, about: str) -> None:
        """A signed notice to generation g's members: appended, so that no writer overwrites another's."""
        key = self.keys.end(g)
        store.append(key, f"\n{self.sign(key, f'{kind}:{about}')}\n")

    def notices(self, store: dist.Store, g: int) -> dict[str, set[str]]:
        """Generation g's signed notices by kind: who asks in, who went silent."""
        found: dict[str, set[str]] = {kind: set() for kind in NOTICES}
        key = self.keys.end(g)
        for line in (peek(store, key) or b"").split(b"\n"):
            body = self.opened(key, line) if line else None
            kind, _, about = (body or "").partition(":")
            if kind in found:
                found[kind].add(about)
        return found

    def closed_list(self, g: int, raw: bytes | None) -> dict | None:
        """Round g's list if a member of this job signed it."""
        return _as_list(self.opened(self.keys.closed(g), raw))


class Round:
    """The meeting for generation g: arrive, close it if first, read who is in. `unreached`: the members
    of the last list this member's probes did not reach, reported in its arrival."""

    def __init__(self, group: InPlaceGroup, g: int, unreached: list[str]) -> None:
        self.group, self.g, self.store, self.unreached = group, g, group.store, unreached

    def meet(self, deadline: float) -> dict | None:
        """Arrive and wait for the round's list: the list, or None when no member of this job signed it."""
        group = self.group
        group.notify(self.store, self.g - 1, "reform", group.member)     # the last generation's members: come
        me = {"member": group.member, "name": f"{group.name}/{group.world.local_rank}", "step": group.step,
              "addr": group.listener.address, "cut": self.unreached}
        key = group.keys.arrivals(self.g)
        me["proof"] = group.proof(key, _arrival_text(me))
        self.store.append(key, f"\n{json.dumps(me)}\n")
        raw = self._wait_closed(deadline)
        closed = group.closed_list(self.g, raw)
        if closed is not None:
            return closed
        # A list this member cannot check: a newcomer it names as refused is the stranger (only a
        # member of no generation yet: a forged list must not cut off the job's own members).
        unchecked = _as_list(_unsigned(raw))
        if group.formed == 0 and unchecked is not None and group.member in unchecked["refused"]:
            raise UserError(f"the group at {group.endpoint} refused this node: they do not share the job's secret "
                            f"({SECRET_ENV}); nothing was sent")
        return None

    def _close(self) -> None:
        """Wait for the last generation's members (each arrives or goes silent), then name the new one:
        the most advanced member first (it is the source of the state), then in order of arrival."""
        group = self.group
        last, expected = self._expected()
        silent = group.watch.silence        # what the watch saw of them already: no second wait
        started = last_arrival = time.monotonic()
        seen = 1
        while True:
            arrivals, strangers = self._arrivals()
            if len(arrivals) != seen:
                seen, last_arrival = len(arrivals), time.monotonic()
            here = {a["member"] for a in arrivals}
            missing = [m for m in expected if m not in here]
            named = group.notices(self.store, last)["silent"] if missing else set()  # seen silent by a peer
            gone = [m for m in missing if m in named or silent.is_silent(m, group.beat_count(self.store, m))]
            now = time.monotonic()
            if expected and len(gone) == len(missing) and not self._spares_coming(arrivals):
                break
            if not expected and now - last_arrival >= group.policy.inplace_join_window_s:
                break           # nodes starting together: whoever came within the join window
            if now - started >= group.policy.inplace_round_timeout_s:
                break           # beating but never coming (stuck): they come back as newcomers
            time.sleep(group.policy.inplace_poll_s)
        self._name(arrivals, strangers, expected)

    def _spares_coming(self, arrivals: list[dict]) -> bool:
        """Whether the round is short of the job's nodes and a spare that beats has not arrived yet
        (it wakes at the round's first arrival; a lost node's round closes in a poll otherwise)."""
        group = self.group
        if not group.full_size or len({node_of(a["name"]) for a in arrivals}) >= group.full_size:
            return False
        here = {a["member"] for a in arrivals}
        return any(self._beats_now(m) for m in group.listed_spares(self.store) - here)

    def _beats_now(self, member: str) -> bool:
        """A beat within the heartbeat timeout by the clock it carries, and not silent as this member
        saw it: a spare long gone costs no wait, one on a host whose clock runs ahead a timeout at most."""
        group = self.group
        key = group.keys.beat(member)
        beat = _beat(group.opened(key, peek(self.store, key)) or "")
        return (beat is not None and time.time() - beat[1] < group.policy.ft_heartbeat_timeout_s
                and not group.watch.silence.is_silent(member, beat[0]))

    def _name(self, arrivals: list[dict], strangers: list[dict], expected: list[str]) -> None:
        """Write the round's list: arrivals that hold the secret and still beat (one that arrived and
        died, a closer taken over from, would fail the group's forming), of those the largest set that
        reach one another over the data path (app/ft/reach.py's mutual)."""
        group = self.group
        silence = group.watch.silence
        good = [a for a in arrivals if a["member"] == group.member
                or not silence.is_silent(a["member"], group.beat_count(self.store, a["member"]))]
        text = _list_text(self._fill(mutual(good), expected), strangers)
        keys = group.keys
        value = group.sign(keys.closed(self.g), text)
        # Atomic: of two closers (one taking over from a closer thought gone), the first list stands.
        if self.store.compare_set(keys.closed(self.g), "", value) == value.encode():
            group.refused += [a["name"] for a in strangers]
            self.store.set(keys.latest(), group.sign(keys.latest(), str(self.g)))

    def _fill(self, named: list[dict], expected: list[str]) -> list[dict]:
        """Of `named`, the nodes of at most --full-size: those that trained in the last generation first
        (no state to send them), then in order; the others wait as spares."""
        group = self.group
        if not group.full_size:
            return named
        trained = set(expected) | ({group.member} if group.pg is not None else set())
        nodes: list[str] = []
        for a in sorted(named, key=lambda a: a["member"] not in trained):
            if len(nodes) < group.full_size and node_of(a["name"]) not in nodes:
                nodes.append(node_of(a["name"]))
        return [a for a in named if node_of(a["name"]) in nodes]

    def _expected(self) -> tuple[int, list[str]]:
        """The last generation formed and its members: this member's own record of it (rounds passed
        over since included), else the store's."""
        group = self.group
        if group.gen == self.g - 1 and group.pg is not None:
            return group.formed, [m for m in group.members if m != group.member]
        closed = group.closed_list(self.g - 1, peek(self.store, group.keys.closed(self.g - 1)))
        return self.g - 1, closed["members"] if closed is not None else []

    def _arrivals(self) -> tuple[list[dict], list[dict]]:
        """The round's arrivals in order, once each: those that prove they hold the secret, and the
        well-formed others (strangers, to be told they are refused)."""
        group = self.group
        good: list[dict] = []
        strangers: list[dict] = []
        key = group.keys.arrivals(self.g)
        for line in (peek(self.store, key) or b"").split(b"\n"):
            arrival = _arrival(line) if line else None
            if arrival is None:
                if line:
                    group.rejects.add(group.keys.kind(key))
                continue
            signed = group.proves(arrival["proof"], key, _arrival_text(arrival))
            into = good if signed else strangers
            if all(a["member"] != arrival["member"] for a in into):
                into.append(arrival)
        members = {a["member"] for a in good}
        return good, [a for a in strangers if a["member"] not in members]

    def _wait_closed(self, deadline: float) -> bytes:
        """The round's list, once closed. The first arrival closes it; if it goes silent before it
        has (a woken member whose node then restarts it, a kill), the next one still beating takes
        over, so that no round waits for a closer that is gone."""
        group = self.group
        key = group.keys.closed(self.g)
        while (raw := peek(self.store, key)) is None:
            if time.monotonic() > deadline:
                raise StoreLost(f"generation {self.g} was never closed at {group.endpoint} within "
                                f"{group.policy.ft_quorum_timeout_s:g} s")
            arrivals = [a["member"] for a in self._arrivals()[0]]
            earlier = arrivals[:arrivals.index(group.member)] if group.member in arrivals else arrivals
            # In order, and only as far as one beats: one read a poll while the first arrival lives.
            if all(group.watch.silence.is_silent(m, group.beat_count(self.store, m)) for m in earlier):
                self._close()
                continue
            time.sleep(group.policy.ft_heartbeat_interval_s)
        return raw


class Watch:
    """One thread per member, on a store connection of its own: beats, and watches one peer of the
    generation (its successor on the ring), the generation's notices, and, while the main thread's
    operation is pending past INPLACE_STALL, whether every peer is reachable over the data path. Sets
    `wanted` for the main thread's next step boundary; ends the generation for this member when a
    peer goes silent or cannot be reached, or the others went on without it."""

    def __init__(self, group: InPlaceGroup) -> None:
        self.group = group
        self.wanted = threading.Event()     # a new generation, at the next step boundary
        self.ended = threading.Event()      # this generation is over for this member: leave its operations
        self.reason: str | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._following: tuple[int, str | None, list[str]] | None = None    # g, the peer watched, probe addresses
        self._probe: Probe | None = None
        self.silence = Silence(group.policy.ft_heartbeat_timeout_s)
        self._thread: threading.Thread | None = None
        self._beat = 0

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

    def follow(self, g: int, members: list[str], names: list[str], addrs: list[str]) -> None:
        peers = [a for m, a in zip(members, addrs) if m != self.group.member]
        with self._lock:
            self._following = (g, successor(self.group.member, members, names), peers)
            self._probe = None
            self.silence = Silence(self.group.policy.ft_heartbeat_timeout_s)
            self.reason = None
            self.wanted.clear()
            self.ended.clear()

    def _run(self) -> None:
        store = None
        while not self._stop.wait(self.group.policy.ft_heartbeat_interval_s):
            try:
                store = store or self.group.connect()
                self._round(store)
            except (dist.DistError, RuntimeError, StoreLost):
                store = None        # the store restarted or is cut off: connect again next time

    def _round(self, store: dist.TCPStore) -> None:
        """Four store operations, whatever the job's size: the beat, `latest`, the notices, one peer's beat."""
        group, keys = self.group, self.group.keys
        self._beat += 1
        beat = keys.beat(group.member)
        store.set(beat, group.sign(beat, f"{self._beat}:{time.time():.3f}"))
        with self._lock:
            following = self._following
        if following is None:
            return
        g, peer, peers = following
        latest = peek(store, keys.latest())
        if latest is None:
            self.want("the group store restarted")     # its keys are gone: every member re-forms on it
            return
        if group.generation(latest) > g:
            # The others went on without this member (it was stopped or cut off meanwhile): its group
            # is gone, and an all-reduce on it would wait out the collective timeout. Woken, it
            # leaves it and comes back at once.
            return self._cut(following, "the others went on in a newer group")
        silent = f"a member stopped beating for {group.policy.ft_heartbeat_timeout_s:g} s"
        notices = group.notices(store, g)
        if notices["silent"]:
            return self._cut(following, silent)
        if notices["cut"]:
            return self._cut(following, CUT)
        if notices["reform"]:
            self.want("a member asks to come in")
        if peer is not None and self.silence.is_silent(peer, group.beat_count(store, peer)):
            group.notify(store, g, "silent", peer)      # the others learn it from this one notice
            return self._cut(following, silent)
        if self._unreachable(peers):
            group.notify(store, g, "cut", group.member)
            self._cut(following, CUT)

    def _unreachable(self, peers: list[str]) -> bool:
        """Whether a probe of the peers did not reach one. Made only while the main thread's operation
        has been pending past INPLACE_STALL, again each INPLACE_STALL while it stays so (a slow peer
        is reached and waited for): a data link down, which no beat shows, is found in seconds
        instead of the collective timeout. The probe runs across rounds, never holding the beat."""
        policy = self.group.policy
        since = self.group.pending_since
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


def node_of(name: str) -> str:
    """The node of a member's name (node/local rank): its processes come and go together."""
    return name.rpartition("/")[0]


def successor(member: str, members: list[str], names: list[str]) -> str | None:
    """The member `member` watches: the next on a ring ordered by local rank, then node, so that the
    processes of one node follow processes of other nodes and a whole node that hangs is seen by
    each of its watchers elsewhere. None in a generation of one."""
    ring = [m for _, m in sorted(zip([(int(n.rpartition("/")[2]), n) for n in names], members))]
    return None if len(ring) < 2 else ring[(ring.index(member) + 1) % len(ring)]


def _unsigned(raw: bytes | None) -> str:
    """A signed value's body without its check: for a stranger, who cannot check it."""
    return (raw or b"").decode(errors="replace").rpartition("|")[0]


def _beat(body: str) -> tuple[int, float] | None:
    """(count, wall-clock time) of a beat's body "count:time"; None if it is not one."""
    count, _, at = body.partition(":")
    try:
        return int(count), float(at)
    except ValueError:
        return None


def _list_text(named: list[dict], strangers: list[dict]) -> str:
    """A round's list of the arrivals `named`: the most advanced member first (it is the source of
    the state), then in order of arrival."""
    order = sorted(named, key=lambda a: -a["step"])
    return json.dumps({"members": [a["member"] for a in order], "steps": [a["step"] for a in order],
                       "names": [a["name"] for a in order], "addrs": [a["addr"] for a in order],
                       "refused": [a["member"] for a in strangers]})


def _arrival_text(arrival: dict) -> str:
    """What an arrival's proof signs: all of it."""
    return f"{arrival['member']}/{arrival['name']}/{arrival['step']}/{arrival['addr']}/{','.join(arrival['cut'])}"


def _arrival(line: bytes) -> dict | None:
    """One arrival record, if it is one: a member id, a node name, a step, a probe address, the members
    its probes did not reach, a proof."""
    try:
        a = json.loads(line)
    except ValueError:
        return None
    if (isinstance(a, dict) and isinstance(a.get("member"), str) and MEMBER.fullmatch(a["member"])
            and isinstance(a.get("name"), str) and NAME.fullmatch(a["name"])
            and type(a.get("step")) is int and a["step"] >= 0 and isinstance(a.get("proof"), str)
            and isinstance(a.get("addr"), str) and ADDRESS.fullmatch(a["addr"]) and isinstance(a.get("cut"), list)
            and all(isinstance(m, str) and MEMBER.fullmatch(m) for m in a["cut"])):
        return {k: a[k] for k in ("member", "name", "step", "addr", "cut", "proof")}
    return None


def _as_list(text: str | None) -> dict | None:
    """A round's list, if `text` is one: members, their steps, names and probe addresses (one each),
    and the refused."""
    try:
        c = json.loads(text) if text else None
    except ValueError:
        return None
    if not (isinstance(c, dict)
            and all(isinstance(c.get(k), list) for k in ("members", "steps", "names", "addrs", "refused"))):
        return None
    ok = (c["members"] and len(c["members"]) == len(c["steps"]) == len(c["names"]) == len(c["addrs"])
          and all(isinstance(m, str) and MEMBER.fullmatch(m) for m in c["members"] + c["refused"])
          and all(type(s) is int and s >= 0 for s in c["steps"])
          and all(isinstance(n, str) and NAME.fullmatch(n) for n in c["names"])
          and all(isinstance(a, str) and ADDRESS.fullmatch(a) for a in c["addrs"]))
    return c if ok else None
