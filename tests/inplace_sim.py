"""A deterministic simulation of an inplace job, for tests/test_inplace_sim.py: N nodes (one training
process each), a group store, a data network and a clock, all simulated, running the protocol's own
flows (app/ft/protocol.py: the very code app/ft/inplace.py runs) under faults drawn from a schedule,
with the job's invariants checked after every event.

What is simulated, and how close to the real thing:
- The store: the keys app/ft/inplace.py's Keys names, as typed values (no signatures: forged values are
  the real tests' business). It can restart (every key gone) and be cut off from a node (an operation
  then waits for the heal, or fails after the collective timeout, as a TCPStore client's does).
- Each process: its main thread (the training loop of app/ft/trainer.py and InPlaceGroup: start_step,
  a step's compute, the all-reduce, commit, the evaluation at an epoch's end, snapshots) and its
  watch thread (a beat, then the protocol's `look`, every heartbeat interval), each a coroutine.
- The all-reduce of a generation completes once every member posted it and every pair reaches the other;
  it fails at once for the others when a member dies (a reset connection), ends for a member whose
  watch ended the generation, and times out at the collective timeout.
- Probes: a peer whose node is cut off is not reached (after the probe timeout); a dead one refuses at
  once; a frozen one is reached (its kernel still accepts).
- Faults: kill (the node starts a new process, which restores the newest snapshot), freeze and wake, a
  cut of the data path between two sides, a node cut off from the store, a store restart, a node
  started at any time (a spare, or into a finished job), slow evaluations, clocks that disagree.

A state is a step and an id: training step s+1 on state x in generation g makes a new id whose parent is
x. The invariants (Violation says which broke, with the trace):
- one lineage: the states of the generations that can still commit a step (all their members there)
  and the newest snapshot lie on one chain of parents (two groups that train apart make a fork);
- nobody trains on a state older than the newest snapshot;
- no process goes back to an older round, and no generation forms twice while a member of the first is
  in it (a store that lost its keys must get back a `latest` past every generation that trains);
- no generation names more nodes than the job's full size;
- after the job's last step, nothing trains, and every process exits within END_BOUND_S;
- a job with a live process and no fault left finishes within SETTLE_S;
- during a cut that lasts, a largest set of nodes that reach one another trains.
"""
from __future__ import annotations

import dataclasses
import heapq
import random
from dataclasses import dataclass
from typing import Any, Callable, Generator, Iterator

from app.core.policy import DEFAULT
from app.ft import protocol
from app.ft.protocol import Arrival, Beat, Listed, Member, Roster, StoreLost, Unavailable, node_of, successor

# The timings the simulated members run with: the real policy's, but for the round timeout and the
# collective timeout, shorter so that a schedule's every wait ends within seconds of simulated time
# (each still above what it must exceed: FaultPolicy.check() holds).
POLICY = dataclasses.replace(DEFAULT, heartbeat_timeout_s=3.0, collective_timeout_s=6.0, ft_heartbeat_interval_s=0.25,
                             ft_heartbeat_timeout_s=1.0, inplace_poll_s=0.1, inplace_round_timeout_s=4.0,
                             inplace_form_bound_s=2.0, inplace_stall_s=1.0, inplace_probe_timeout_s=0.5)
STEP_S = (0.25, 0.5)        # a step's compute, drawn per step: a job of about 10 s
STEPS, EPOCH = 24, 8        # the job's steps; an evaluation every EPOCH steps
SNAPSHOT_EVERY = 4          # steps between snapshots (written by the generation's first member)
RESTART_S = (0.5, 2.0)      # a killed process's node starts another after this long
END_BOUND_S = 5.0           # every process has exited this long after the job's done mark (or its last fault)
SETTLE_S = 60.0             # a job with a live process and no fault left finishes within this
CUT_SETTLE_S = 6.0          # how long into a cut the largest side must be the one training
LIVELOCK_EVENTS = 10_000    # events at one moment: a loop that never sleeps
FENCE_S = protocol.FENCE_FRACTION * POLICY.ft_heartbeat_timeout_s     # the watch's store operations time out


class Violation(AssertionError):
    """An invariant broke: which (`kind`), when, and the trace up to it."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"[{kind}] {message}")
        self.kind = kind


# ------------------------------------------------------------------ a schedule

@dataclass(frozen=True)
class Fault:
    """One fault at `at` seconds: kill, freeze, cut (the data path between `nodes` and the rest),
    store_cut (`nodes` cut off from the store), store_restart, start (a new node), start_fresh (one on a
    disk without the job's snapshots), slow (the nodes, named slow, step aside: their members ask for a
    round at the next all-reduce, as the aside bit riding it does, and stay out for `lasts`). `lasts`: how
    long (a kill: until the node's next process, None: never)."""

    kind: str
    at: float
    nodes: tuple[int, ...] = ()
    lasts: float | None = 1.0


@dataclass(frozen=True)
class Schedule:
    nodes: int                      # nodes started at 0
    full_size: int                  # --full-size (0: none)
    faults: tuple[Fault, ...]
    seed: int                       # the simulation's own draws (latencies, compute times)
    eval_s: float = 0.2             # an evaluation's compute
    clock_skew_s: tuple[float, ...] = ()     # each node's wall clock against the simulation's


# ------------------------------------------------------------------ the simulated world

@dataclass(frozen=True)
class State:
    step: int
    id: int
    samples: int = 0        # one a slot a step: a generation of n trains on n a step
    lineage: str = ""       # the formation that trained it (protocol.lineage_of)


@dataclass(frozen=True)
class Compute:
    """Sim only: the main thread computes for `seconds`."""
    seconds: float


@dataclass(frozen=True)
class AllReduce:
    """Sim only: the generation's all-reduce -> whether it completed."""


@dataclass(frozen=True)
class SimBeat:
    """Sim only: the watch's beat."""


class Store:
    """The group store's keys, as values."""

    def __init__(self) -> None:
        self.latest: int | None = None
        self.lists: dict[int, Roster] = {}
        self.arrivals: dict[int, list[Arrival]] = {}
        self.notices: dict[int, dict[str, set[str]]] = {}
        self.spares: set[str] = set()
        self.beats: dict[str, tuple[int, float]] = {}
        self.extra: dict[str, Any] = {}         # keys the protocol adds later


class Thread:
    """A coroutine of a process: its main thread or its watch."""

    def __init__(self, sim: "Sim", proc: "Proc", flow: Generator, name: str) -> None:
        self.sim, self.proc, self.flow, self.name = sim, proc, flow, name
        self.done = False
        self.waiting: Any = None        # what it blocks on (a collective, an arrival), to be woken

    def resume(self, value: Any = None, error: BaseException | None = None) -> None:
        proc = self.proc
        if self.done or proc.gone:
            return
        if proc.frozen:
            proc.deferred.append(lambda: self.resume(value, error))
            return
        while True:
            try:
                request = self.flow.throw(error) if error is not None else self.flow.send(value)
            except StopIteration:
                self.done = True
                self.sim.thread_ended(self)
                return
            except (StoreLost, protocol.UserError) as exc:
                self.done = True
                self.sim.log(f"{proc} leaves: {exc}")
                self.sim.exit(proc)
                return
            value, error = None, None
            outcome = self.sim.handle(self, request)
            if outcome is LATER:
                return
            if isinstance(outcome, Failed):
                error = Unavailable(outcome.why)
            else:
                value = outcome


@dataclass(frozen=True)
class Failed:
    why: str


LATER = object()        # a handler that resumes the thread itself


class Proc:
    """One training process: its protocol state, its threads, what it holds."""

    def __init__(self, sim: "Sim", node: int, life: int, fresh: bool = False) -> None:
        self.sim, self.node, self.life = sim, node, life
        self.id = f"{node:06x}{life:06x}"
        self.m = Member(self.id, f"n{node}/0", f"n{node}:{life}", POLICY, sim.schedule.full_size, "sim",
                        epochs=STEPS // EPOCH)
        self.state = State(0, 0) if fresh else sim.newest_snapshot()
        self.m.step, self.m.samples = self.state.step, self.state.samples
        self.gone = self.frozen = False
        self.deferred: list[Callable[[], None]] = []
        self.group: tuple[int, Roster] | None = None
        self.seq = 0                    # collectives posted in its group
        self.following: tuple[int, str | None] | None = None
        self.wanted = self.ended = self.regroup_next = False
        self.pending_since: float | None = None
        self.beats = 0
        self.beat_ok = sim.now
        self.threads: list[Thread] = []
        self.last_round = 0

    def __repr__(self) -> str:
        return f"p{self.node}.{self.life}"


class Sim:
    def __init__(self, schedule: Schedule) -> None:
        self.schedule = schedule
        self.rng = random.Random(schedule.seed)
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0
        self.store = Store()
        self.store_up = True
        self.stores = 0                 # the store's lifetimes so far (its incarnation's name)
        self.store_cut: set[int] = set()
        self.cut: dict[int, int] = {}          # node -> side, while the data path is cut
        self.parent: dict[int, int] = {0: -1}
        self.step_of: dict[int, int] = {0: 0}
        self.snapshots: list[State] = [State(0, 0)]
        self.procs: list[Proc] = []
        self.lives: dict[int, int] = {}
        self.collectives: dict[tuple[int, int], dict[str, tuple[Thread, bool]]] = {}
        self.forming: dict[int, dict[str, Thread]] = {}
        self.arrival_waiters: dict[int, list[Thread]] = {}
        self.store_waiters: list[tuple[Thread, Any]] = []
        self.formed: dict[int, Roster] = {}        # every generation ever formed, across store restarts
        self.finished_at: float | None = None      # the job's last step
        self.final: State | None = None
        self.done_at: float | None = None          # its done mark, after the last evaluation
        self.trace: list[str] = []
        self.commits: list[tuple[float, int, int]] = []      # (time, node, generation)
        self.faults_end = max((f.at + (f.lasts or 0.0) for f in schedule.faults), default=0.0)
        self.tables()

    # ------------------------------------------------------------ the engine

    def at(self, t: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (t, self._seq, action))
        self._seq += 1

    def log(self, line: str) -> None:
        self.trace.append(f"{self.now:8.3f} {line}")

    def violation(self, kind: str, what: str) -> Violation:
        return Violation(kind, f"{what}\nschedule: {self.schedule}\ntrace (last 60):\n" + "\n".join(self.trace[-60:]))

    def run(self) -> None:
        for node in range(self.schedule.nodes):
            self.start(node)
        for fault in self.schedule.faults:
            self.at(fault.at, lambda fault=fault: self.fault(fault))
        deadline = self.faults_end + SETTLE_S
        same, last = 0, -1.0
        while self._heap:
            t, _, action = heapq.heappop(self._heap)
            same = same + 1 if t == last else 0
            last = t
            if same > LIVELOCK_EVENTS:
                raise self.violation("livelock", f"{same} events at {t:.3f} s without the clock moving")
            if self.done_at is not None and t > self.ended_by():
                break
            if t > deadline:
                break
            self.now = t
            action()
        self.check_end(deadline)

    # ------------------------------------------------------------ processes

    def start(self, node: int, fresh: bool = False) -> None:
        """A process on `node`; `fresh`: on a disk without the job's snapshots (a new host)."""
        life = self.lives[node] = self.lives.get(node, -1) + 1
        proc = Proc(self, node, life, fresh)
        self.procs.append(proc)
        self.log(f"{proc} starts at step {proc.state.step} (member {proc.id})")
        main = Thread(self, proc, self.main(proc), "main")
        watch = Thread(self, proc, self.watch(proc), "watch")
        proc.threads = [main, watch]
        self.at(self.now, main.resume)
        self.at(self.now, watch.resume)

    def thread_ended(self, thread: Thread) -> None:
        if thread.name == "main":
            self.exit(thread.proc)

    def exit(self, proc: Proc) -> None:
        if not proc.gone:
            self.log(f"{proc} exits at step {proc.state.step}")
            self.leave(proc)

    def leave(self, proc: Proc) -> None:
        """A process gone (exited or killed): its collectives fail for the others at once."""
        proc.gone = True
        for key, posted in list(self.collectives.items()):
            if proc.group is not None and key[0] == proc.group[0]:
                self.fail_collective(key, f"{proc} is gone")

    def live(self) -> list[Proc]:
        return [p for p in self.procs if not p.gone]

    # ------------------------------------------------------------ faults

    def fault(self, f: Fault) -> None:
        self.log(f"FAULT {f}")
        procs = [p for p in self.live() if p.node in f.nodes]
        if f.kind == "kill":
            for p in procs:
                self.leave(p)
                if f.lasts is not None:
                    self.at(self.now + f.lasts, lambda node=p.node: self.start(node))
        elif f.kind == "freeze":
            for p in procs:
                p.frozen = True
            self.at(self.now + f.lasts, lambda ps=procs: self.wake(ps))
        elif f.kind == "cut":
            self.cut = {n: (1 if n in f.nodes else 0) for n in self.lives}
            self.at(self.now + f.lasts, self.heal)
            if f.lasts > CUT_SETTLE_S and self.quiet_around(f):     # still cut when it looks
                self.at(self.now + CUT_SETTLE_S, self.check_largest)
        elif f.kind == "store_cut":
            self.store_cut |= set(f.nodes)
            self.at(self.now + f.lasts, lambda nodes=set(f.nodes): self.store_heal(nodes))
        elif f.kind == "store_restart":
            self.store_up = False
            self.at(self.now + f.lasts, self.store_back)
        elif f.kind == "slow":
            for p in procs:
                if p.group is not None and not p.ended:     # only a member's steps are timed
                    p.m.aside_until, p.wanted = self.now + f.lasts, True
        elif f.kind in ("start", "start_fresh"):
            for node in f.nodes:
                if node not in self.lives or all(p.gone for p in self.procs if p.node == node):
                    self.start(node, fresh=f.kind == "start_fresh")

    def wake(self, procs: list[Proc]) -> None:
        for p in procs:
            p.frozen = False
            deferred, p.deferred = p.deferred, []
            for action in deferred:
                self.at(self.now, action)
        for key in list(self.collectives):
            self.try_complete(key)

    def heal(self) -> None:
        self.cut = {}
        for key in list(self.collectives):
            self.try_complete(key)

    def store_heal(self, nodes: set[int]) -> None:
        self.store_cut -= nodes
        waiting, self.store_waiters = self.store_waiters, []
        for thread, request in waiting:
            if thread.proc.node in self.store_cut:
                self.store_waiters.append((thread, request))
            else:
                self.at(self.now, lambda t=thread, r=request: self.retry(t, r))

    def retry(self, thread: Thread, request: Any) -> None:
        outcome = self.handle(thread, request)
        if outcome is LATER:
            return
        if isinstance(outcome, Failed):
            thread.resume(error=Unavailable(outcome.why))
        else:
            thread.resume(outcome)

    def store_back(self) -> None:
        self.store, self.store_up = Store(), True
        self.stores += 1
        self.log("the store is back, empty")

    def reaches(self, a: int, b: int) -> bool:
        return self.cut.get(a, 0) == self.cut.get(b, 0)

    # ------------------------------------------------------------ a process's threads

    def main(self, p: Proc) -> Iterator[Any]:
        """The training loop (app/ft/trainer.py's run_steps and InPlaceGroup's step)."""
        rng = self.rng
        if (yield from protocol.job_over(p.m)) is not None:
            return
        while p.state.step < STEPS:
            if p.group is None or p.regroup_next or p.ended:
                if (yield from protocol.regroup(p.m)) is not None:
                    self.log(f"{p} leaves: the job finished")
                    return
                p.state = dataclasses.replace(p.state, lineage=p.m.lineage)     # FtTrainer.run_steps
                if p.state.step >= STEPS:
                    break
            yield Compute(rng.uniform(*STEP_S))
            if protocol.fenced(p.m, self.now - p.beat_ok) or not (yield AllReduce()):   # InPlaceGroup.average_gradients
                p.regroup_next = True
                continue
            self.commit(p)
            if p.state.step % EPOCH == 0:
                yield Compute(self.schedule.eval_s)
                if not (yield AllReduce()):
                    p.regroup_next = True
        yield from protocol.finish(p.m)

    def watch(self, p: Proc) -> Iterator[Any]:
        """The watch thread: a beat, then the protocol's look at the generation followed."""
        while True:
            yield protocol.Sleep(POLICY.ft_heartbeat_interval_s)
            try:
                self.fence(p)
                yield SimBeat()
                p.beat_ok = self.now
                if p.following is None:
                    continue
                following = p.following
                verdict = yield from protocol.look(p.m, *following)
            except Unavailable:
                self.fence(p)
                continue
            if verdict.want:
                p.wanted = True
            if verdict.notify:
                kind, about = verdict.notify
                self.store.notices.setdefault(following[0], _notices())[kind].add(about)
            if verdict.cut and p.following is following:
                p.following, p.wanted, p.ended = None, True, True
                self.log(f"{p} watch ends generation {following[0]}: {verdict.cut}")
                self.end_wait(p)

    def fence(self, p: Proc) -> None:
        why = protocol.fenced(p.m, self.now - p.beat_ok)
        if why is not None and p.following is not None:
            self.log(f"{p} watch ends generation {p.following[0]}: {why}")
            p.following, p.wanted, p.ended = None, True, True
            self.end_wait(p)

    # ------------------------------------------------------------ requests

    def handle(self, thread: Thread, r: Any) -> Any:
        """A thread's request: a store operation, else the simulation's own handler (one table each)."""
        op = self.store_ops.get(type(r))
        if op is None:
            return self.handlers[type(r)](thread, r)
        if not self.store_up:
            return Failed("connection refused")
        if thread.proc.node in self.store_cut:     # the watch's connection fails sooner (protocol.fenced)
            self.store_waiters.append((thread, r))
            bound = FENCE_S if thread.name == "watch" else POLICY.collective_timeout_s
            self.at(self.now + bound, lambda: self.store_timeout(thread, r))
            return LATER
        return op(thread.proc, r)

    def tables(self) -> None:
        """The handlers of every request, by its type."""
        s = lambda: self.store     # noqa: E731 (the store is replaced when it restarts)
        self.handlers: dict[type, Callable[[Thread, Any], Any]] = {
            protocol.Now: lambda t, r: self.now,
            protocol.Sleep: self.sleep, Compute: self.sleep,
            protocol.Probe: lambda t, r: self.probe(t, r.addresses),
            protocol.Unreachable: lambda t, r: self.unreachable(t.proc),
            protocol.AwaitArrival: self.await_arrival,
            protocol.SpareWait: lambda t, r: None,
            protocol.Form: lambda t, r: self.form(t, r.g, r.roster),
            protocol.Retire: self.retire,
            protocol.Say: lambda t, r: self.log(f"{t.proc} says: {r.line}"),
            protocol.Reconnect: lambda t, r: None,
            protocol.Refresh: self.refresh,
            AllReduce: lambda t, r: self.all_reduce(t),
        }
        self.store_ops: dict[type, Callable[[Proc, Any], Any]] = {
            protocol.ReadLatest: lambda p, r: s().latest,
            protocol.ReadList: lambda p, r: Listed(s().lists.get(r.g), r.g in s().lists),
            protocol.ReadArrivals: lambda p, r: (list(s().arrivals.get(r.g, [])), []),
            protocol.ReadNotices: lambda p, r: {k: set(v) for k, v in s().notices.get(r.g, _notices()).items()},
            protocol.ReadSpares: lambda p, r: set(s().spares),
            protocol.ReadBeats: self.read_beats,
            protocol.Notify: lambda p, r: s().notices.setdefault(r.g, _notices())[r.kind].add(r.about),
            protocol.Arrive: self.arrive,
            protocol.Close: self.close,
            protocol.Advance: lambda p, r: self.set_latest(p, r.g) if r.g > (s().latest or 0) else None,
            protocol.ReadIncarnation: lambda p, r: s().extra.get("incarnation"),
            protocol.NewIncarnation: lambda p, r: s().extra.setdefault("incarnation", f"{self.stores:08x}"),
            protocol.ReadDone: lambda p, r: s().extra.get("done"),
            protocol.MarkDone: self.mark_done,
            protocol.ListSpare: lambda p, r: s().spares.add(p.id),
            SimBeat: self.beat,
        }

    def sleep(self, thread: Thread, r: Any) -> Any:
        self.at(self.now + r.seconds, thread.resume)
        return LATER

    def await_arrival(self, thread: Thread, r: protocol.AwaitArrival) -> Any:
        if self.store.arrivals.get(r.g):
            return True
        self.arrival_waiters.setdefault(r.g, []).append(thread)
        thread.waiting = ("arrival", r.g)
        self.at(self.now + r.seconds, lambda: self.arrival_timeout(thread, r.g))
        return LATER

    def retire(self, thread: Thread, r: protocol.Retire) -> None:
        thread.proc.group, thread.proc.following = None, None

    def refresh(self, thread: Thread, r: protocol.Refresh) -> tuple[int, int, str]:
        """FtTrainer._refresh: the newest snapshot, loaded if it is further than this state."""
        p, newest = thread.proc, self.newest_snapshot()
        if protocol.further((newest.lineage, newest.samples), (p.state.lineage, p.state.samples)):
            self.log(f"{p} loads the snapshot at step {newest.step}")
            p.state = newest
        return p.state.step, p.state.samples, p.state.lineage

    def store_timeout(self, thread: Thread, request: Any) -> None:
        if (thread, request) in self.store_waiters:
            self.store_waiters.remove((thread, request))
            thread.resume(error=Unavailable("the store did not answer"))

    def read_beats(self, p: Proc, r: protocol.ReadBeats) -> dict[str, Beat | None]:
        beats, wall = self.store.beats, self.now + self.skew(p.node)
        return {m: None if m not in beats else Beat(beats[m][0], wall - beats[m][1]) for m in r.members}

    def arrive(self, p: Proc, r: protocol.Arrive) -> None:
        if r.g < p.last_round:
            raise self.violation("latest", f"{p} went back to round {r.g} after round {p.last_round}")
        p.last_round = r.g
        arrivals = self.store.arrivals.setdefault(r.g, [])
        again = [i for i, a in enumerate(arrivals) if a.member == r.arrival.member]
        if again:
            arrivals[again[0]] = r.arrival
        else:
            arrivals.append(r.arrival)
        for waiter in self.arrival_waiters.pop(r.g, []):
            if waiter.waiting == ("arrival", r.g):
                waiter.waiting = None
                self.at(self.now, lambda w=waiter: w.resume(True))

    def close(self, p: Proc, r: protocol.Close) -> bool:
        if r.g in self.store.lists:
            return False
        self.store.lists[r.g] = r.roster
        self.log(f"{p} closes round {r.g}: {[self.name(m) for m in r.roster.members]} steps {r.roster.steps}")
        return True

    def mark_done(self, p: Proc, r: protocol.MarkDone) -> None:
        self.store.extra["done"] = protocol.Done(r.epochs, r.step)
        self.done_at = self.done_at or self.now

    def beat(self, p: Proc, r: SimBeat) -> None:
        p.beats += 1
        self.store.beats[p.id] = (p.beats, self.now + self.skew(p.node))

    def set_latest(self, p: Proc, g: int) -> None:
        self.store.latest = g

    def skew(self, node: int) -> float:
        skews = self.schedule.clock_skew_s
        return skews[node] if node < len(skews) else 0.0

    def name(self, member: str) -> str:
        return next((repr(p) for p in self.procs if p.id == member), member)

    def probe(self, thread: Thread, addresses: tuple[str, ...]) -> Any:
        p = thread.proc
        failed, slow = set(), False
        for address in addresses:
            target = next((q for q in self.procs if q.m.addr == address), None)
            if target is None or target.gone:
                failed.add(address)
            elif not self.reaches(p.node, target.node):
                failed.add(address)
                slow = True
        if not slow:
            return failed
        self.at(self.now + POLICY.inplace_probe_timeout_s, lambda: thread.resume(failed))
        return LATER

    def unreachable(self, p: Proc) -> bool:
        if p.pending_since is None or p.group is None or self.now - p.pending_since < POLICY.inplace_stall_s:
            return False
        return any(not self.reaches(p.node, q.node) for q in self.group_procs(p.group) if q is not p)

    def group_procs(self, group: tuple[int, Roster]) -> list[Proc]:
        return [q for q in self.procs if q.id in group[1].members]

    def arrival_timeout(self, thread: Thread, g: int) -> None:
        if thread.waiting == ("arrival", g):
            thread.waiting = None
            thread.resume(False)

    # ------------------------------------------------------------ groups

    def form(self, thread: Thread, g: int, roster: Roster) -> Any:
        """Every member of the list calls it; it forms once all have, the state sent to those behind."""
        p = thread.proc
        p.group, p.following = None, None
        forming = self.forming.setdefault(g, {})
        forming[p.id] = thread
        procs = {q.id: q for q in self.procs if q.id in roster.members}
        if any(q.gone for q in procs.values()):
            forming.pop(p.id)
            return Failed("a member of the list is gone")
        thread.waiting = ("form", g)
        self.at(self.now + POLICY.inplace_form_bound_s, lambda: self.form_timeout(thread, g))
        if len(forming) < len(roster.members):
            return LATER
        if any(not self.reaches(a.node, b.node) or a.frozen for a in procs.values() for b in procs.values()):
            return LATER        # each waits out the form bound
        del self.forming[g]
        # Frozen ones and ones cut off from the store are out of it already: their next beat (or its failure)
        # fences them before they can commit (protocol.fenced).
        knew = [q for q in self.live() if q.group is not None and q.group[0] == g and q.id not in roster.members
                and not q.ended and not q.frozen and q.node not in self.store_cut]
        if g in self.formed and knew:
            raise self.violation("latest", f"generation {g} forms a second time ({roster.members}) while {knew} "
                                 "train in the first: `latest` went back below it")
        self.formed[g] = roster
        source = procs[roster.members[0]].state
        for q in procs.values():
            if protocol.sends_state(roster) and protocol.behind(roster, q.id):     # InPlaceGroup._sync
                q.state = source
                q.m.step = source.step
            q.group, q.seq = (g, roster), 0
            q.following = (g, successor(q.id, roster.members, roster.names))
            q.wanted = q.ended = q.regroup_next = False
            self.check_lineage(f"{q} formed generation {g}")
        nodes = {node_of(n) for n in roster.names}
        if self.schedule.full_size and len(nodes) > self.schedule.full_size:
            raise self.violation("size", f"generation {g} names {len(nodes)} nodes, over the full size")
        self.log(f"generation {g} formed: {[self.name(m) for m in roster.members]}")
        for q_thread in forming.values():
            q_thread.waiting = None
            if q_thread is not thread:
                self.at(self.now, lambda t=q_thread: t.resume(None))
        return None

    def form_timeout(self, thread: Thread, g: int) -> None:
        if thread.waiting == ("form", g):
            thread.waiting = None
            self.forming.get(g, {}).pop(thread.proc.id, None)
            thread.resume(error=Unavailable(f"generation {g}'s group did not connect"))

    def all_reduce(self, thread: Thread) -> Any:
        p = thread.proc
        if p.group is None or p.ended:
            return False
        key = (p.group[0], p.seq)
        p.seq += 1
        posted = self.collectives.setdefault(key, {})
        posted[p.id] = (thread, p.wanted)
        thread.waiting = ("collective", key)
        p.pending_since = self.now
        if any(q.gone for q in self.group_procs(p.group)):
            self.fail_collective(key, "a peer is gone")
            return LATER
        self.at(self.now + POLICY.collective_timeout_s, lambda: self.collective_timeout(thread, key))
        self.try_complete(key)
        return LATER

    def try_complete(self, key: tuple[int, int]) -> None:
        posted = self.collectives.get(key)
        if not posted:
            return
        threads = [t for t, _ in posted.values()]
        roster = threads[0].proc.group[1] if threads[0].proc.group else None
        if roster is None or len(posted) < len(roster.members):
            return
        procs = [t.proc for t in threads]
        if any(q.frozen or q.gone for q in procs) or any(not self.reaches(a.node, b.node) for a in procs for b in procs):
            return
        wanted = any(w for _, w in posted.values())
        del self.collectives[key]
        for t in threads:
            if t.waiting == ("collective", key):
                t.waiting, t.proc.pending_since = None, None
                t.proc.regroup_next = wanted
                self.at(self.now, lambda t=t: t.resume(True))

    def fail_collective(self, key: tuple[int, int], why: str) -> None:
        for t, _ in self.collectives.pop(key, {}).values():
            if t.waiting == ("collective", key):
                t.waiting, t.proc.pending_since = None, None
                self.at(self.now, lambda t=t: t.resume(False))

    def collective_timeout(self, thread: Thread, key: tuple[int, int]) -> None:
        if thread.waiting == ("collective", key):
            self.fail_collective(key, "timed out")

    def end_wait(self, p: Proc) -> None:
        """The watch ended the generation: the main thread leaves the operation it waits for."""
        for t in p.threads:
            if isinstance(t.waiting, tuple) and t.waiting[0] == "collective":
                key = t.waiting[1]
                self.collectives.get(key, {}).pop(p.id, None)
                t.waiting, p.pending_since = None, None
                self.at(self.now, lambda t=t: t.resume(False))

    # ------------------------------------------------------------ training and its invariants

    def commit(self, p: Proc) -> None:
        # Members of one generation at one step hold one state: the all-reduce averaged the same gradients.
        twin = next((q.state for q in self.procs if q.group == p.group and q is not p
                     and q.state.step == p.state.step + 1 and self.parent.get(q.state.id) == p.state.id), None)
        furthest = self.furthest_snapshot()
        if twin is None and self.further(furthest, p.state):
            raise self.violation("stale", f"{p} trained step {p.state.step + 1} on a state behind a snapshot (step "
                                 f"{furthest.step}, {furthest.lineage or 'no lineage'})")
        after_end = self.finished_at is not None and twin != self.final
        if twin is None:
            twin = State(p.state.step + 1, len(self.parent), p.state.samples + len(p.group[1].members), p.m.lineage)
            self.parent[twin.id], self.step_of[twin.id] = p.state.id, twin.step
        p.state = twin
        self.check_lineage(f"{p} committed step {p.state.step}")
        if after_end:
            raise self.violation("job_end", f"{p} trained step {p.state.step} after the job's last step")
        p.m.step = p.state.step
        self.commits.append((self.now, p.node, p.group[0]))
        if p.group[1].members[0] == p.id and p.state.step % SNAPSHOT_EVERY == 0:
            self.snapshots.append(p.state)
        if p.state.step >= STEPS and self.finished_at is None:
            self.finished_at, self.final = self.now, p.state
            self.log(f"the job's last step, by {p}")

    def newest_snapshot(self) -> State:
        """What a start restores: the highest step (Snapshots.restore)."""
        return max(self.snapshots, key=lambda s: s.step)

    def furthest_snapshot(self) -> State:
        """The snapshot furthest by protocol.further: what no trainer may be behind."""
        furthest = self.snapshots[0]
        for snapshot in self.snapshots[1:]:
            if self.further(snapshot, furthest):
                furthest = snapshot
        return furthest

    @staticmethod
    def further(a: State, b: State) -> bool:
        return protocol.further((a.lineage, a.samples), (b.lineage, b.samples))

    def ancestor(self, a: State, b: State) -> bool:
        """Whether a is b or an ancestor of b."""
        x = b.id
        while x != -1 and self.step_of[x] > a.step:
            x = self.parent[x]
        return x == a.id

    def trainable(self) -> list[State]:
        """The states of the generation that can still commit a step: the newest formed, if every member is
        there (frozen ones are: they may wake). An older one cannot: one of its members is in the newer one
        or out of it, and a member back from a freeze commits nothing before its watch has looked."""
        groups = [p.group for p in self.live() if p.group is not None]
        if not groups:
            return []
        g, roster = max(groups, key=lambda group: group[0])
        procs = [p for p in self.procs if p.id in roster.members]
        if all(not p.gone and p.group is not None and p.group[0] == g and not p.ended for p in procs):
            return [p.state for p in procs]
        return []

    def check_lineage(self, after: str) -> None:
        """One lineage: the states that can train lie on one chain, and none is behind a snapshot of another
        line (a line that lost, behind the one that won, may leave snapshots: a start after a crash would
        go on from them, lost work, not two groups training)."""
        held = self.trainable()
        newest = max(held, key=lambda s: s.step, default=None)
        for s in held:
            if not self.ancestor(s, newest):
                raise self.violation("lineage", f"two lineages after {after}: a state at step {s.step} is not on the chain "
                                     f"of the newest (step {newest.step})")
        furthest = self.furthest_snapshot()
        for s in held:
            if self.further(furthest, s) and not self.ancestor(s, furthest):
                raise self.violation("lineage", f"after {after}: a state at step {s.step} trains behind a snapshot of "
                                     f"another line (step {furthest.step}, {furthest.lineage})")

    def quiet_around(self, cut: Fault) -> bool:
        """Whether `cut` is the only fault from 10 s before it to CUT_SETTLE_S into it, and evaluations are
        short: then who trains is the cut's doing alone."""
        return self.schedule.eval_s <= 1.0 and all(
            f is cut or f.at + (f.lasts or 0.0) < cut.at - 10.0 or f.at > cut.at + CUT_SETTLE_S
            for f in self.schedule.faults)

    def check_largest(self) -> None:
        """During a cut that lasts: the nodes that train are a largest side (capped at the full size)."""
        if self.finished_at is not None:
            return
        since = self.now - 1.5
        training = {node for t, node, _ in self.commits if t >= since}
        live = [p for p in self.live() if not p.frozen]
        sides: dict[int, set[int]] = {}
        for p in live:
            sides.setdefault(self.cut.get(p.node, 0), set()).add(p.node)
        largest = max((len(s) for s in sides.values()), default=0)
        cap = self.schedule.full_size or largest
        if live and len(training) < min(largest, cap):
            raise self.violation("largest", f"during a cut, {sorted(training)} train while a side of {largest} nodes reaches "
                                 f"one another: {sides}")

    def ended_by(self) -> float:
        """When every process must have exited: END_BOUND_S after the job's done mark, its last evaluation
        (a node started from the last snapshot may mark it done while the members still evaluate) and its
        last fault."""
        return max(self.done_at, (self.finished_at or 0.0) + self.schedule.eval_s, self.faults_end) + END_BOUND_S

    def check_end(self, deadline: float) -> None:
        if self.finished_at is None:
            if any(not p.gone for p in self.procs):
                raise self.violation("liveness", f"the job did not finish within {SETTLE_S:g} s of its last fault")
            return
        left = [p for p in self.procs if not p.gone]
        if left:
            raise self.violation("job_end", f"{left} still running {END_BOUND_S:g} s after the job's done mark "
                                 f"(written at {self.done_at})")


def _notices() -> dict[str, set[str]]:
    return {kind: set() for kind in protocol.NOTICES}


def simulate(schedule: Schedule) -> Sim:
    """Run one schedule to its end; a broken invariant raises Violation."""
    sim = Sim(schedule)
    sim.run()
    return sim


# ------------------------------------------------------------------ drawing schedules

class Draws:
    """Where a schedule's choices come from: a seeded random.Random for the bulk runs, hypothesis's data
    for the runs that shrink a failure to its shortest schedule (tests/test_inplace_sim.py)."""

    def __init__(self, integer: Callable[[int, int], int]) -> None:
        self.integer = integer

    def real(self, low: float, high: float, step: float = 0.05) -> float:
        """A multiple of `step` in [low, high] (few values: shrinking and reading traces stay easy)."""
        return round(low + step * self.integer(0, round((high - low) / step)), 3)

    def pick(self, choices: tuple[Any, ...]) -> Any:
        return choices[self.integer(0, len(choices) - 1)]

    def chance(self, percent: int) -> bool:
        return self.integer(0, 99) < percent


KINDS = ("kill", "freeze", "cut", "store_cut", "store_restart", "start", "start_fresh", "slow")


def draw_schedule(d: Draws) -> Schedule:
    """Two to four nodes, a spare or none, up to four faults of every kind at any moment of the job
    (before its start, during it, after its end), slow evaluations, clocks that disagree."""
    nodes, spares = d.integer(2, 4), d.integer(0, 1)
    every = nodes + spares
    faults = []
    for _ in range(d.integer(0, 4)):
        kind = d.pick(KINDS)
        at = d.real(0.0, 15.0)
        if kind in ("start", "start_fresh"):
            faults.append(Fault(kind, at, (d.integer(0, every),), None))
            continue
        lasts = None if kind == "kill" and d.chance(20) else d.real(0.2, 10.0)
        chosen = tuple(n for n in range(every) if d.chance(40)) or (d.integer(0, every - 1),)
        faults.append(Fault(kind, at, () if kind == "store_restart" else chosen, lasts))
    eval_s = d.pick((0.2, 0.2, 0.2, 6.0))
    skew = tuple(d.real(-0.8, 0.8) for _ in range(every + 1)) if d.chance(30) else ()
    return Schedule(every, nodes if spares else 0, tuple(sorted(faults, key=lambda f: f.at)), d.integer(0, 2**31),
                    eval_s, skew)


def seeded(seed: int) -> Schedule:
    """The bulk runs' schedule number `seed`."""
    rng = random.Random(seed)
    return draw_schedule(Draws(rng.randint))


def main(argv: list[str] | None = None) -> int:
    """`python -m tests.inplace_sim [N]`: N seeded schedules (10,000); for each kind of violation, the first
    seed that shows it and how many showed it. `--seed S`: schedule S alone, with its trace."""
    import argparse
    import time
    parser = argparse.ArgumentParser(prog="python -m tests.inplace_sim")
    parser.add_argument("count", nargs="?", type=int, default=10_000)
    parser.add_argument("--seed", type=int)
    args = parser.parse_args(argv)
    if args.seed is not None:
        schedule = seeded(args.seed)
        print(schedule)
        sim = Sim(schedule)
        try:
            sim.run()
        finally:
            print("\n".join(sim.trace))
        return 0
    first: dict[str, int] = {}
    seen: dict[str, int] = {}
    started = time.perf_counter()
    for seed in range(args.count):
        try:
            simulate(seeded(seed))
        except Violation as v:
            first.setdefault(v.kind, seed)
            seen[v.kind] = seen.get(v.kind, 0) + 1
    took = time.perf_counter() - started
    print(f"{args.count} schedules in {took:.1f} s ({took / args.count * 1000:.2f} ms each)")
    for kind in sorted(seen, key=first.get):
        print(f"  {kind}: first at schedule {first[kind]} (found after {first[kind] + 1}), in {seen[kind]} of {args.count}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
