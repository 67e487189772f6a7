"""In-place mode (--ft inplace): the survivors of a fault re-form their process group among themselves
and go on, on torch's own c10d; no torchft, and nothing between two steps while nobody comes or goes.

Why beside torchft: torchft asks its Lighthouse for a quorum and votes a commit at every step (two
round trips a step: about 0.8 of elastic's throughput on the quick configuration here), and a
hung group holds the others inside the step's all-reduce until its timeout, since torchft cannot
abort it (docs/fault-tolerance.md). Here the members meet in the job's store only when the
membership changes, and a member that stops beating is cut off at once.

- Every training process of every node is a member. Members meet in a TCPStore every node reaches
  (--group-store: the compose store service's, the one the elastic rendezvous uses) under the job's
  namespace; each beats there from a thread of its own.
- A generation is one gloo process group of the members it names, built under its own key prefix.
  A member asks for the next one when it starts (a node that comes back), when its all-reduce
  failed, or when its watch saw a peer's beat stop; the members of the current generation see the
  request at their next step boundary and come. The first to arrive closes the round, once every
  member of the last generation has either arrived or been silent for the heartbeat timeout.
- A silent peer is cut off at once: once its beat has stopped for the heartbeat timeout, the
  watch ends the generation for this member, and the main thread, which waits for an all-reduce in
  slices of the heartbeat interval, leaves it instead of waiting out the collective timeout. The
  operation runs out its timeout in the background (torch 2.14's gloo backend has no abort:
  ProcessGroupGloo inherits Backend::abort, a no-op; its experimental `_reconfigure` re-forms a
  group but cannot end a pending all-reduce either). So does a member that finds the others in a
  newer generation than its own (it was stopped or cut off meanwhile).
- The most advanced member is rank 0 of a new generation and sends its whole state (weights,
  optimizer, schedule, position) to the members behind it. Members at one step hold the same
  state and exchange nothing, so a fault costs the survivors no transfer at all.
- Only members that prove they hold the job secret (JOB_SECRET) are named in a generation, and a
  member only joins a list signed with it: no stranger is sent the weights.
"""
from __future__ import annotations

import hashlib
import hmac
import io
import json
import os
import socket
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from app.config import endpoint
from app.distributed import World
from app.errors import UserError
from app.ft.replica import REPLICA_ENV, _short, copy_back, flat_gradients
from app.ft.writer import WriterLease
from app.process_group import SECRET_ENV
from app.recovery.policy import FaultPolicy

NAMESPACE = "app/inplace"
POLL_S = 0.02           # how often a member waiting for a round looks at the store


class StoreLost(UserError):
    """The group store did not answer for the quorum timeout: the job cannot re-form without it."""


class InPlaceGroup:
    """This process as a member of the job's generations: its share of each step, the all-reduce
    across members, and what happens when a member leaves or comes. The same interface as
    app/ft/replica.py's Replica, so that app/ft/trainer.py runs either."""

    def __init__(self, world: World, policy: FaultPolicy, endpoint: str, job: str,
                 state: Callable[[], Any], load: Callable[[Any], None]) -> None:
        self.world, self.policy = world, policy
        self.member = uuid.uuid4().hex[:12]
        self.name = os.environ.get(REPLICA_ENV) or f"{socket.gethostname()}-{os.getpid()}"   # the node's
        self._endpoint, self._job, self._keys = endpoint, job, f"{NAMESPACE}/{job}/"
        self._secret = os.environ.get(SECRET_ENV, "").encode()
        self._state, self._load = state, load
        self.store = self._connect()
        self.step = 0                   # committed steps this member's state holds
        self.gen, self.members = 0, [self.member]
        self.pg: dist.ProcessGroupGloo | None = None
        self._regroup_next = False
        self._left_behind: list[tuple[dist.ProcessGroupGloo, dist.Work]] = []    # see _finish
        self.errored: str | None = None
        self.refused: list[str] = []    # strangers this member's rounds left out (said once each)
        self._lease = WriterLease(self.name, policy.ft_heartbeat_timeout_s)
        self._refuse_if_stranger()
        self.watch = Watch(self)
        self.watch.start()

    # ------------------------------------------------------------ one step

    def start_step(self) -> None:
        """Re-form the group first if it has none, lost a member, or every member agreed at the last
        all-reduce to let one in."""
        if self.pg is None or self._regroup_next or self.watch.ended.is_set():
            self._regroup()

    def share(self) -> tuple[int, int]:
        """(this process's slot, slots in this step): its rank and the generation's size."""
        return self.members.index(self.member), len(self.members)

    def average_gradients(self, parameters: list[torch.nn.Parameter]) -> None:
        """The gradients averaged over the generation in one flat all-reduce. A failure (a member
        that died or was cut off mid-step) is not raised: it makes commit() say no.

        One more number rides along: whether this member's watch wants a new generation (a node
        asks to come in). Every member reads the same sum, so all of them finish this step and
        re-form at the same boundary; deciding it alone, one would wait at the round for a peer
        waiting for it in the next step's all-reduce."""
        self.errored = None
        grads, flat = flat_gradients(parameters, spare=1)
        flat[-1] = float(self.watch.wanted.is_set())
        self.errored = self._finish(self.pg.allreduce([flat]))
        if self.errored is not None:
            self._regroup_next = True
            return
        self._regroup_next = bool(flat[-1].item() > 0)
        copy_back(flat.div_(len(self.members)), grads)

    def _finish(self, work: dist.Work) -> str | None:
        """Wait for `work` in slices of the heartbeat interval: None once it completed, else why not.
        An operation of a generation the watch has ended (a peer went silent, the others went on
        without this member) is left to run out its timeout in the background, its group kept alive
        meanwhile (dropping it would wait for it): gloo in torch 2.14 cannot abort it."""
        while True:
            try:
                work.wait(timedelta(seconds=self.policy.ft_heartbeat_interval_s))
                return None
            except RuntimeError as exc:     # gloo's own failure (a reset peer), or this slice ran out
                if work.is_completed():
                    return _short(str(exc))
            if self.watch.ended.is_set():
                self._left_behind = [(pg, w) for pg, w in self._left_behind if not w.is_completed()]
                self._left_behind.append((self.pg, work))
                return self.watch.reason

    def commit(self) -> bool:
        """Whether this member's all-reduce completed: it then steps, and counts the step."""
        if self.errored is not None:
            return False
        self.step += 1
        return True

    def check_secret(self, warn: Callable[[str], None]) -> None:
        while self.refused:
            warn(f"refused {self.refused.pop()}: it does not hold the job secret ({SECRET_ENV}); nothing was sent")

    def set_step(self, step: int, samples: int) -> None:
        """After a restore from a snapshot: the most advanced member becomes the source of a generation."""
        self.step = step

    def writes(self, directory: Path) -> bool:
        """Whether this member writes snapshots and metrics rows into `directory` now: local rank 0 of
        the node that holds the directory's lease (app/ft/writer.py)."""
        return self.world.local_rank == 0 and self._lease.holds(directory)

    def shutdown(self) -> None:
        self.watch.stop()

    # ------------------------------------------------------------ a new generation

    def _regroup(self) -> None:
        """Meet the others at the next round until one names this member and its group forms."""
        deadline = time.monotonic() + self.policy.ft_quorum_timeout_s
        while True:
            try:
                g = max(self.gen, self._latest()) + 1
                members, steps = Round(self, g).meet(deadline)
                if self.member in members:
                    self._form(g, members, steps)
                    return
                self.gen = g                # closed without this member: the next round
            except (dist.DistError, RuntimeError, StoreLost) as exc:   # the store went away, a member died forming
                self.errored = _short(str(exc))
                if time.monotonic() > deadline:
                    raise StoreLost(f"no group formed at the group store {self._endpoint} within "
                                    f"{self.policy.ft_quorum_timeout_s:g} s ({self.errored}): is it running?") from None
                time.sleep(self.policy.ft_heartbeat_interval_s)
                try:
                    self.store = self._connect()
                except StoreLost:
                    pass

    def _form(self, g: int, members: list[str], steps: list[int]) -> None:
        """Build generation g's process group, then bring every member to rank 0's state."""
        rank = members.index(self.member)
        self._regroup_next = False
        self.watch.pause()
        store = dist.PrefixStore(f"{self._keys}{g}/pg/", self.store)
        pg = dist.ProcessGroupGloo(store, rank, len(members), timedelta(seconds=self.policy.collective_timeout_s))
        if len(set(steps)) > 1:
            self._sync(pg, rank, behind=steps[rank] != steps[0])
        self.pg, self.gen, self.members = pg, g, members
        self.watch.follow(g, members)

    def _sync(self, pg: dist.ProcessGroupGloo, rank: int, behind: bool) -> None:
        """Rank 0's whole state to every member of the new group; those behind it load it (tensors and
        plain values only: weights_only, as torchft mode's transport)."""
        payload = torch.empty(0, dtype=torch.uint8)
        if rank == 0:
            buffer = io.BytesIO()
            torch.save(self._state(), buffer)
            payload = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
        pg.broadcast([size], dist.BroadcastOptions()).wait()
        if rank != 0:
            payload = torch.empty(int(size.item()), dtype=torch.uint8)
        pg.broadcast([payload], dist.BroadcastOptions()).wait()
        if behind:
            state = torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=True)
            self._load(state)
            self.step = state["train_state"]["step"]

    def _refuse_if_stranger(self) -> None:
        """A node whose secret does not sign the running job's generation stops here, before it
        arrives: the job's members would leave it out of every generation anyway. A job whose
        members all stopped beating long ago is no job: its record is ignored."""
        g = self._latest()
        key = f"{self._keys}{g}/closed"
        if not g or not self.store.check([key]):
            return
        closed = json.loads(self.store.get(key))
        if hmac.compare_digest(closed["proof"], self.proof(f"{g}/{','.join(closed['members'])}")):
            return
        beats = [f"{self._keys}beat/{m}" for m in closed["members"]]
        last = max((beat_time(self.store.get(k)) for k in beats if self.store.check([k])), default=0.0)
        if time.time() - last < self.policy.collective_timeout_s:
            raise UserError(f"the job '{self._job}' at {self._endpoint} holds another job secret "
                            f"({SECRET_ENV}): this node is refused and nothing was sent")

    def _latest(self) -> int:
        key = self._keys + "latest"
        return int(self.store.get(key)) if self.store.check([key]) else 0

    def _connect(self) -> dist.TCPStore:
        host, port = endpoint(self._endpoint, "--group-store")
        try:
            return dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                                 timeout=timedelta(seconds=self.policy.collective_timeout_s))
        except (dist.DistError, RuntimeError) as exc:
            raise StoreLost(f"no group store answered at {self._endpoint} ({_short(str(exc))}); start one "
                            "(the compose store service, or `python -m app.node store`) or pass --group-store") from None

    def proof(self, text: str) -> str:
        return hmac.new(self._secret, f"{self._keys}{text}".encode(), hashlib.sha256).hexdigest()


class Round:
    """The meeting for generation g: arrive, close it if first, read who is in."""

    def __init__(self, group: InPlaceGroup, g: int) -> None:
        self.group, self.g, self.store = group, g, group.store
        self.key = f"{group._keys}{g}/"

    def meet(self, deadline: float) -> tuple[list[str], list[int]]:
        group = self.group
        self.store.set(f"{group._keys}{self.g - 1}/reform", b"1")      # the last generation's members: come
        arrival = int(self.store.add(self.key + "arrived", 1))
        me = {"member": group.member, "name": f"{group.name}/{group.world.local_rank}", "step": group.step,
              "proof": group.proof(f"{self.g}/{group.member}")}
        self.store.set(f"{self.key}m/{arrival}", json.dumps(me))
        closed = self._wait_closed(arrival, deadline)
        if group.member in closed["refused"]:
            raise UserError(f"the group at {group._endpoint} refused this node: they do not share the job's secret "
                            f"({SECRET_ENV}); nothing was sent")
        if not hmac.compare_digest(closed["proof"], group.proof(f"{self.g}/{','.join(closed['members'])}")):
            raise UserError(f"the group at {group._endpoint} cannot prove it holds the job's secret ({SECRET_ENV}): "
                            "not joining it")
        return closed["members"], closed["steps"]

    def _close(self) -> None:
        """Wait for the last generation's members (each arrives or goes silent), then name the new one:
        the most advanced member first (it is the source of the state), then in order of arrival."""
        group = self.group
        expected = self._expected()
        silent = group.watch.silence        # what the watch saw of them already: no second wait
        started = last_arrival = time.monotonic()
        seen = 1
        while True:
            arrivals = self._arrivals()
            if len(arrivals) != seen:
                seen, last_arrival = len(arrivals), time.monotonic()
            here = {a["member"] for a in arrivals}
            missing = [m for m in expected if m not in here]
            beats = self._beats(missing)
            gone = [m for m in missing if silent.is_silent(m, beats.get(m))]
            now = time.monotonic()
            if expected and len(gone) == len(missing):
                break
            if not expected and now - last_arrival >= group.policy.ft_join_timeout_s:
                break           # nodes starting together: whoever came within the join window
            if now - started >= group.policy.collective_timeout_s:
                break           # beating but never coming (stuck): they come back as newcomers
            time.sleep(POLL_S)
        self._name(arrivals)

    def _name(self, arrivals: list[dict]) -> None:
        """Write the round's list: arrivals that hold the secret and still beat (one that arrived and
        died, a closer taken over from, would fail the group's forming)."""
        group = self.group
        beats = self._beats([a["member"] for a in arrivals])
        arrivals = [a for a in arrivals if a["member"] == group.member
                    or not group.watch.silence.is_silent(a["member"], beats.get(a["member"]))]
        good = [a for a in arrivals if hmac.compare_digest(a["proof"], group.proof(f"{self.g}/{a['member']}"))]
        refused = [a["member"] for a in arrivals if a not in good]
        order = sorted(range(len(good)), key=lambda i: (-good[i]["step"], i))
        members = [good[i]["member"] for i in order]
        closed = {"members": members, "steps": [good[i]["step"] for i in order],
                  "names": [good[i]["name"] for i in order], "refused": refused,
                  "proof": group.proof(f"{self.g}/{','.join(members)}")}
        self.store.compare_set(self.key + "reform", "", "0")    # unless a late member asked already
        # Atomic: of two closers (one taking over from a closer thought gone), the first list stands.
        if self.store.compare_set(self.key + "closed", "", json.dumps(closed)) == json.dumps(closed).encode():
            group.refused += [a["name"] for a in arrivals if a not in good]
        self.store.set(group._keys + "latest", str(self.g))

    def _expected(self) -> list[str]:
        """The last generation's members: this member's own record of it, else the store's."""
        group = self.group
        if group.gen == self.g - 1 and group.pg is not None:
            return [m for m in group.members if m != group.member]
        key = f"{group._keys}{self.g - 1}/closed"
        return json.loads(self.store.get(key))["members"] if self.store.check([key]) else []

    def _arrivals(self) -> list[dict]:
        count = int(self.store.add(self.key + "arrived", 0))
        keys = [f"{self.key}m/{i}" for i in range(1, count + 1)]
        ready = [k for k in keys if self.store.check([k])]       # an arrival counted but not yet written
        return [json.loads(v) for v in self.store.multi_get(ready)] if ready else []

    def _beats(self, members: list[str]) -> dict[str, bytes]:
        keys = {m: f"{self.group._keys}beat/{m}" for m in members}
        return {m: self.store.get(k) for m, k in keys.items() if self.store.check([k])}

    def _wait_closed(self, arrival: int, deadline: float) -> dict:
        """The round's list, once closed. The first arrival closes it; if it goes silent before it
        has (a woken member whose node then restarts it, a kill), the next one still beating takes
        over, so that no round waits for a closer that is gone."""
        key = self.key + "closed"
        silence = self.group.watch.silence
        while not self.store.check([key]):
            if time.monotonic() > deadline:
                raise StoreLost(f"generation {self.g} was never closed at {self.group._endpoint} within "
                                f"{self.group.policy.ft_quorum_timeout_s:g} s")
            earlier = [a["member"] for a in self._arrivals()[:arrival - 1]]
            beats = self._beats(earlier)
            if all([silence.is_silent(m, beats.get(m)) for m in earlier]):
                self._close()
                break
            time.sleep(self.group.policy.ft_heartbeat_interval_s)
        return json.loads(self.store.get(key))


class Silence:
    """When each member's beat last changed, as this process saw it (the watch and a closing round
    both look); silent after `timeout_s` unchanged."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._last: dict[str, tuple[bytes | None, float]] = {}
        self._lock = threading.Lock()

    def is_silent(self, member: str, beat: bytes | None) -> bool:
        now = time.monotonic()
        with self._lock:
            value, since = self._last.get(member, (None, now))
            if member not in self._last or beat != value:
                self._last[member] = (beat, now)
                return False
        return now - since >= self.timeout_s


class Watch:
    """One thread per member, on a store connection of its own: beats, and watches the generation's
    other members and requests to come in. Sets `wanted` for the main thread's next step boundary;
    ends the generation for this member when a peer goes silent or the others went on without it."""

    def __init__(self, group: InPlaceGroup) -> None:
        self.group = group
        self.wanted = threading.Event()     # a new generation, at the next step boundary
        self.ended = threading.Event()      # this generation is over for this member: leave its operations
        self.reason: str | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._following: tuple[int, list[str]] | None = None
        self.silence = Silence(group.policy.ft_heartbeat_timeout_s)
        self._thread = threading.Thread(target=self._run, name="inplace-watch", daemon=True)
        self._beat = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.group.policy.ft_heartbeat_timeout_s)

    def want(self, reason: str) -> None:
        self.reason = self.reason or reason
        self.wanted.set()

    def pause(self) -> None:
        """A new generation is forming: stop watching the old one."""
        with self._lock:
            self._following = None

    def follow(self, g: int, members: list[str]) -> None:
        with self._lock:
            self._following = (g, [m for m in members if m != self.group.member])
            self.silence = Silence(self.group.policy.ft_heartbeat_timeout_s)
            self.reason = None
            self.wanted.clear()
            self.ended.clear()

    def _run(self) -> None:
        store = None
        while not self._stop.wait(self.group.policy.ft_heartbeat_interval_s):
            try:
                store = store or self.group._connect()
                self._round(store)
            except (dist.DistError, RuntimeError):
                store = None        # the store restarted or is cut off: connect again next time

    def _round(self, store: dist.TCPStore) -> None:
        keys = self.group._keys
        self._beat += 1
        store.set(f"{keys}beat/{self.group.member}", f"{self._beat}:{time.time():.3f}")
        with self._lock:
            following = self._following
        if following is None:
            return
        g, others = following
        if not store.check([f"{keys}latest"]):
            self.want("the group store restarted")     # its keys are gone: every member re-forms on it
            return
        if int(store.get(f"{keys}latest")) > g:
            # The others went on without this member (it was stopped or cut off meanwhile): its group
            # is gone, and an all-reduce on it would wait out the collective timeout. Woken, it
            # leaves it and comes back at once.
            return self._cut(following, "the others went on in a newer group")
        if store.get(f"{keys}{g}/reform") == b"1":
            self.want("a member asks to come in")
        beats = {m: store.get(f"{keys}beat/{m}") for m in others if store.check([f"{keys}beat/{m}"])}
        if any([self.silence.is_silent(m, beats.get(m)) for m in others]):
            self._cut(following, f"a member stopped beating for {self.group.policy.ft_heartbeat_timeout_s:g} s")

    def _cut(self, following: tuple[int, list[str]], reason: str) -> None:
        """End the generation for this member: the main thread leaves its pending operation."""
        self.want(reason)
        with self._lock:
            if self._following is following:
                self._following = None
                self.ended.set()


def beat_time(beat: bytes) -> float:
    """The wall-clock time a beat was written ("count:time")."""
    return float(beat.decode().split(":")[1])
