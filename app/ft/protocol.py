"""Inplace mode's membership as a protocol: who comes to a round, who closes it and whom it names, who
waits as a spare or is held off, whose state goes on, what `latest` may become, what a member's watch
makes of what it reads, and when the job is over. Plain values and generators: no store, thread,
clock or torch here.

app/ft/inplace.py runs these flows against the group store and c10d; tests/inplace_sim.py runs the
very same flows against a simulated store, network and clock, over thousands of orders of events. A
flow yields a request (the dataclasses below: read a key, arrive, sleep, probe, form the group) and
is sent its result; an error of the store, or a group that did not form, is thrown into it as
`Unavailable`. The rules, and what the simulator checks, in one page: docs/protocol.md.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Generator, TypeVar

from app.core.errors import UserError
from app.core.policy import FaultPolicy
from app.recovery.silence import Silence
from app.recovery.slow import returns_at

NOTICES = ("reform", "silent", "cut")   # a member asks in; a peer went silent; a peer cannot be reached
CUT = "a peer is unreachable over the data path"      # why a generation ended on a "cut" notice
LINK_KEPT = 8       # a member's last changes of link kept (returns_at reads the last two stretches up; even: see there)

T = TypeVar("T")
Flow = Generator[Any, Any, T]           # yields requests, is sent their results, returns a T


class StoreLost(UserError):
    """The group store did not answer for the quorum timeout: the job cannot re-form without it."""


class Unavailable(Exception):
    """Thrown into a flow: the store did not answer, or a generation's group did not form."""


class Finished(Exception):
    """Inside the flows: the job's done mark says the job this member trains for is over."""

    def __init__(self, done: "Done") -> None:
        super().__init__(done)
        self.done = done


# ------------------------------------------------------------------ what the store holds

@dataclass(frozen=True)
class Arrival:
    """A member at a round: its id, node/local rank, committed steps, probe address, the members of the
    last list its probes did not reach, the samples its state has trained on, and its lineage."""

    member: str
    name: str
    step: int
    addr: str
    cut: tuple[str, ...] = ()
    samples: int = 0
    lineage: str = ""
    aside: bool = False     # a slow node stepping aside: named only where nobody else is (name_of)


@dataclass(frozen=True)
class Roster:
    """A round's list: the members named (the source of the state first), one step, name and probe
    address each, and the strangers refused."""

    members: tuple[str, ...]
    steps: tuple[int, ...]
    names: tuple[str, ...]
    addrs: tuple[str, ...]
    refused: tuple[str, ...] = ()
    samples: tuple[int, ...] = ()       # the samples each member's state has trained on
    lineages: tuple[str, ...] = ()      # each member's state's lineage (lineage_of)


@dataclass(frozen=True)
class Listed:
    """What round g's list key holds: the list if a member signed it, whether there is a list at all
    (one nobody signed is passed over), and whether an unsigned one names the reader refused."""

    roster: Roster | None
    present: bool
    refuses_reader: bool = False


@dataclass(frozen=True)
class Done:
    """The job's done mark: its members trained `epochs` epochs, to `step`."""

    epochs: int
    step: int


@dataclass(frozen=True)
class Beat:
    """A member's newest signed beat: its count and how old its wall-clock time is by the reader's clock."""

    count: int
    age_s: float


# ------------------------------------------------------------------ requests (a flow yields them)

@dataclass(frozen=True)
class Now:
    """-> the monotonic clock, in seconds."""


@dataclass(frozen=True)
class Sleep:
    """-> None after `seconds`; `idle`: a wait the node's progress bound must not take for a stuck step."""
    seconds: float
    idle: bool = False


@dataclass(frozen=True)
class ReadLatest:
    """-> the newest generation closed: None when the key is gone, 0 when no member signed it."""


@dataclass(frozen=True)
class ReadIncarnation:
    """-> the store's lifetime (random, signed), None before the first member names it."""


@dataclass(frozen=True)
class NewIncarnation:
    """-> the store's lifetime: named now at random if none is (compare-and-set), else the one that is."""


@dataclass(frozen=True)
class ReadList:
    """-> Listed: round g's list."""
    g: int


@dataclass(frozen=True)
class ReadArrivals:
    """-> (arrivals signed, strangers): round g's, in order, once each."""
    g: int


@dataclass(frozen=True)
class ReadNotices:
    """-> {kind: set of members}: generation g's signed notices."""
    g: int


@dataclass(frozen=True)
class ReadDone:
    """-> the job's done mark (Done), or None."""


@dataclass(frozen=True)
class MarkDone:
    """Write the job's done mark, signed."""
    epochs: int
    step: int


@dataclass(frozen=True)
class ReadSpares:
    """-> the members that have waited as spares (a set)."""


@dataclass(frozen=True)
class ReadBeats:
    """-> {member: Beat or None}."""
    members: tuple[str, ...]


@dataclass(frozen=True)
class Probe:
    """-> the addresses a TCP connect did not reach (a set)."""
    addresses: tuple[str, ...]


@dataclass(frozen=True)
class Unreachable:
    """-> whether the watch's probes, made while the main thread's operation is pending past
    INPLACE_STALL, found a peer of the generation it cannot reach."""


@dataclass(frozen=True)
class Notify:
    """Append a signed notice to generation g's."""
    g: int
    kind: str
    about: str


@dataclass(frozen=True)
class Arrive:
    """Append this member's signed arrival to round g."""
    g: int
    arrival: Arrival


@dataclass(frozen=True)
class Close:
    """-> whether this list is round g's: written if none is (compare-and-set); the closer then says the
    strangers it refused (their names)."""
    g: int
    roster: Roster
    strangers: tuple[str, ...] = ()


@dataclass(frozen=True)
class Refresh:
    """-> (steps, samples, lineage) of this member's state now, after loading the newest snapshot on its
    disk if that is further (protocol.further). Before every arrival and before a closer names: a member that
    was frozen, held off or waiting as a spare while the others trained on, wrote it and left must not
    bring the job back to its own older state."""


@dataclass(frozen=True)
class Advance:
    """Move `latest` forward to g, signed, unless it is there or past it already (compare-and-set:
    it never moves backwards, whoever writes it at once)."""
    g: int


@dataclass(frozen=True)
class ListSpare:
    """Append this member to the spares, signed."""


@dataclass(frozen=True)
class AwaitArrival:
    """-> whether round g had an arrival within `seconds` (a spare's wait; a SIGTERM ends it)."""
    g: int
    seconds: float


@dataclass(frozen=True)
class SpareWait:
    """Enter (True) or leave (False) a spare's wait: out of the host's cores and the progress bound."""
    waiting: bool


@dataclass(frozen=True)
class Form:
    """Build generation g's group from its list and bring every member to the source's state; raises
    Unavailable if it does not form."""
    g: int
    roster: Roster


@dataclass(frozen=True)
class Retire:
    """End this member's group and drop it."""


@dataclass(frozen=True)
class Say:
    line: str


@dataclass(frozen=True)
class Reconnect:
    """A new connection to the store, after an error."""


# ------------------------------------------------------------------ a member

@dataclass
class Member:
    """One member's protocol state: who it is, what it holds, which generation it is in. The flows
    change it; the driver reads it (its rank, its peers)."""

    id: str                     # 12 hex digits, new for every process life
    name: str                   # node/local rank
    addr: str                   # where its peers probe it
    policy: FaultPolicy
    full_size: int = 0          # nodes a generation names at most (--full-size); 0: no bound
    endpoint: str = "the group store"     # as messages name the store
    epochs: int = 0             # the epochs it trains for: a done mark of as many or more ends it
    step: int = 0               # committed steps its state holds
    samples: int = 0            # samples its state has trained on (as of its last arrival or generation)
    lineage: str = ""           # the formation its state last trained in (lineage_of); "": none yet
    incarnation: str = ""       # the store's lifetime as it last read it (a store that restarts begins another)
    known: int = 0              # the highest `latest` it has read
    gen: int = 0                # the newest round it went to
    formed: int = 0             # its group's generation (rounds passed over since stay behind gen)
    roster: Roster | None = None            # generation `formed`'s list
    grouped: bool = False       # it holds a group (formed and not retired)
    waiting: bool = False       # in a spare's wait
    # A slow node stepping aside (the driver decides it, app/ft/slow_nodes.py): it arrives once saying so,
    # and stays out of the rounds until then (monotonic seconds; 0: it is not aside).
    aside_until: float = 0.0
    # Its link as its probes of the newest generation saw it, (time, up): a flapping link keeps it out
    # until the link has held FLAP_STABLE (app/recovery/slow.py's returns_at).
    link: list[tuple[float, bool]] = field(default_factory=list)
    silence: Silence = field(init=False)

    def __post_init__(self) -> None:
        self.silence = Silence(self.policy.ft_heartbeat_timeout_s)

    @property
    def members(self) -> tuple[str, ...]:
        return self.roster.members if self.roster is not None else (self.id,)

    def silent(self, member: str, beat: Beat | None, now: float) -> bool:
        return self.silence.is_silent(member, None if beat is None else beat.count, now)


# ------------------------------------------------------------------ a new generation

def regroup(m: Member) -> Flow[Done | None]:
    """Meet the others at the next round until one names this member and its group forms (None), or the
    job's done mark says its job is over (the mark: it leaves without training). A round whose list no
    member signed is passed over by everyone alike, and so is one that `latest` moved past; a member
    cut off from the newest generation waits until it reaches it."""
    policy = m.policy
    deadline = (yield Now()) + policy.ft_quorum_timeout_s
    while True:
        try:
            yield from _unless_over(m)
            g = max(m.gen, (yield from _latest(m))) + 1
            last = (yield ReadList(g - 1)).roster
            if (yield from _waits_as_spare(m, g, last)):
                deadline = (yield Now()) + policy.ft_quorum_timeout_s      # the store answers
                continue
            if (yield from _stands_aside(m, last)):
                continue
            unreached = yield from _unreached(m, g - 1, last)
            if (yield from _held_off(m, g, last, unreached)):
                deadline = (yield Now()) + policy.ft_quorum_timeout_s      # the store answers
                continue
            roster = yield from meet(m, g, last, unreached, deadline)
            if roster is not None and (yield from _latest(m)) > g:
                roster = None           # a later round was closed meanwhile: this one is passed over
            if roster is not None and m.id in roster.members:
                yield from _form(m, g, roster)
                return
            m.gen = g
            if roster is not None:      # left out of a signed list, the newest generation: its own group is
                yield Retire()          # none any more (a round passed over changes nothing)
                m.grouped = False
        except Finished as over:
            yield from _back_in(m)
            return over.done
        except (Unavailable, StoreLost) as exc:       # the store went away, a member died forming
            # Beats this member could not read say nothing of the others: each is judged afresh from the next
            # sight (two members each counting the other's outage as silence formed a generation each).
            m.silence = Silence(policy.ft_heartbeat_timeout_s)
            if (yield Now()) > deadline:
                raise StoreLost(f"no group formed at the group store {m.endpoint} within "
                                f"{policy.ft_quorum_timeout_s:g} s ({exc}): is it running?") from None
            yield Sleep(policy.ft_heartbeat_interval_s)
            yield Reconnect()


def _latest(m: Member) -> Flow[int]:
    """`latest`, put back first where the store holds less than this member has read there (a store that
    lost its keys): a node that starts now must not take the job for a new one, nor a round number that
    was used for one of its own."""
    m.incarnation = (yield ReadIncarnation()) or (yield NewIncarnation())
    latest = yield ReadLatest()
    if latest is None or latest < m.known:
        yield Advance(m.known)
        latest = yield ReadLatest()
    m.known = max(m.known, latest or 0)
    return latest or 0


def _unless_over(m: Member) -> Flow[None]:
    """Raise Finished if the job's done mark covers the epochs this member trains for."""
    done = yield ReadDone()
    if done is not None and m.epochs <= done.epochs:
        raise Finished(done)


def job_over(m: Member) -> Flow[Done | None]:
    """A node's first look, before it restores anything: the done mark if its job is over (a store that
    does not answer now is asked again at the first round)."""
    try:
        yield from _unless_over(m)
    except Finished as over:
        return over.done
    except Unavailable:
        pass
    return None


def finish(m: Member) -> Flow[None]:
    """The job trained to its end: its done mark, which spares, held-off members and nodes that start
    later read and leave on. A store away meanwhile is waited for, INPLACE_JOB_GONE at most."""
    deadline = (yield Now()) + m.policy.inplace_job_gone_s
    while True:
        try:
            yield MarkDone(m.epochs, m.step)
            return
        except Unavailable as exc:
            if (yield Now()) > deadline:
                yield Say(f"warning: the done mark could not be written to {m.endpoint} ({exc}): a spare "
                          "still waiting may take the job for one that lost its nodes")
                return
            yield Sleep(m.policy.ft_heartbeat_interval_s)
            yield Reconnect()


def _form(m: Member, g: int, roster: Roster) -> Flow[None]:
    m.silence = Silence(m.policy.ft_heartbeat_timeout_s)     # peers judged afresh from the new group on
    m.grouped = False               # the driver retires the old group first, whether the new one forms or not
    yield Form(g, roster)
    m.gen = m.formed = g
    m.roster, m.grouped = roster, True
    m.lineage = lineage_of(m.incarnation, g, roster)
    m.step, m.samples = roster.steps[0], roster.samples[0]      # every member holds the source's state now


def _waits_as_spare(m: Member, g: int, last: Roster | None) -> Flow[bool]:
    """Whether this member waited as a spare instead of arriving at round g: the last generation trains
    at full size without it. It waits for round g's first arrival, a heartbeat timeout at most, then
    looks again whether the members still beat."""
    if not m.full_size or last is None or m.id in last.members or (yield from _short(m, last)):
        yield from _back_in(m)
        return False
    if m.id not in (yield ReadSpares()):
        yield ListSpare()
        yield Say(f"waiting as a spare: the job trains on {m.full_size} nodes (generation {g - 1})")
    if not m.waiting:
        yield SpareWait(True)
        m.waiting = True
    woken = yield AwaitArrival(g, m.policy.ft_heartbeat_timeout_s)
    if woken:
        yield from _back_in(m)
    return not woken


def _back_in(m: Member) -> Flow[None]:
    if m.waiting:
        yield SpareWait(False)
        m.waiting = False


def _short(m: Member, last: Roster) -> Flow[bool]:
    """Whether the nodes of `last` that still beat are fewer than the job's full size."""
    beats = yield ReadBeats(last.members)
    now = yield Now()
    beating = {node_of(n) for x, n in zip(last.members, last.names) if not m.silent(x, beats[x], now)}
    return len(beating) < m.full_size


def _unreached(m: Member, g: int, last: Roster | None) -> Flow[list[str]]:
    """The members of round g's list that a probe of their data addresses did not reach, but for those
    a peer already named silent (no probe waits for a node known to be gone)."""
    if last is None:
        return []
    silent = (yield ReadNotices(g))["silent"]
    peers = {a: x for x, a in zip(last.members, last.addrs) if x != m.id and x not in silent}
    failed = yield Probe(tuple(peers))
    # Up: every peer reached. "Some" would flip with the list probed: a member on the losing side of an
    # even cut reaches its side's peers of the last generation, then none of the winners' list.
    up = not failed
    if peers and (not m.link or m.link[-1][1] != up):      # the changes only: a poll's repeats say nothing new
        m.link = [*m.link[-LINK_KEPT + 1:], ((yield Now()), up)]
    return sorted(peers[a] for a in failed)


def _stands_aside(m: Member, last: Roster | None) -> Flow[bool]:
    """Whether this member waits a poll out of the job: a slow node the others left out, until its time
    aside is over (it comes back on trial) or nobody of the newest generation beats any more."""
    if not m.aside_until or last is None or m.id in last.members:
        return False
    beats = yield ReadBeats(last.members)
    now = yield Now()
    if now >= m.aside_until or all(m.silent(x, beats[x], now) for x in last.members):
        m.aside_until = 0.0
        return False
    yield Sleep(m.policy.ft_heartbeat_interval_s, idle=True)
    return True


def _held_off(m: Member, g: int, last: Roster | None, unreached: list[str]) -> Flow[bool]:
    """Whether to wait a poll instead of arriving: this member is not in the newest generation and
    cannot reach a member of it that still beats (arriving would call them to a round that leaves it
    out again). A round the others have called already it joins: arriving costs them nothing more, and
    the closer needs every arrival's reach to name the largest side (a spare on the side of a cut that
    holds fewer of the last generation's members)."""
    if last is None or m.id in last.members or (yield ReadArrivals(g))[0]:
        return False
    beats = yield ReadBeats(tuple(unreached) if unreached else last.members)
    now = yield Now()
    if all(m.silent(x, beats[x], now) for x in (unreached or last.members)):
        return False
    if not unreached:           # reached: back now, or once a link that flaps has held FLAP_STABLE
        back = returns_at(m.link, m.policy.flap_stable_s)
        if back is None or back <= now:
            return False
    yield Sleep(m.policy.ft_heartbeat_interval_s, idle=True)
    return True


def meet(m: Member, g: int, last: Roster | None, unreached: list[str], deadline: float) -> Flow[Roster | None]:
    """Arrive at round g and wait for its list: the list, or None when no member of this job signed it.
    The first arrival closes the round; if it goes silent before it has, the next one still beating
    takes over, so that no round waits for a closer that is gone."""
    policy = m.policy
    m.step, m.samples, m.lineage = yield Refresh()
    yield Notify(g - 1, "reform", m.id)      # the last generation's members: come
    yield Arrive(g, _arrival(m, unreached))
    while not (listed := (yield ReadList(g))).present:
        if (yield Now()) > deadline:
            raise StoreLost(f"generation {g} was never closed at {m.endpoint} within {policy.ft_quorum_timeout_s:g} s")
        yield from _unless_over(m)
        if (yield from _latest(m)) >= g:
            return None         # closed and lost with the store's keys, or a later one closed: passed over
        arrivals = [a.member for a in (yield ReadArrivals(g))[0]]
        earlier = arrivals[:arrivals.index(m.id)] if m.id in arrivals else arrivals
        if (yield from _all_silent(m, earlier)):
            yield from close(m, g, last, unreached)
            continue
        yield Sleep(policy.ft_heartbeat_interval_s)
    if listed.roster is not None:
        return listed.roster
    # A list this member cannot check: a newcomer it names as refused is the stranger (only a member of
    # no generation yet: a forged list must not cut off the job's own members).
    if m.formed == 0 and listed.refuses_reader:
        from app.cluster.secret import SECRET_ENV
        raise UserError(f"the group at {m.endpoint} refused this node: they do not share the job's secret "
                        f"({SECRET_ENV}); nothing was sent")
    return None


def _all_silent(m: Member, members: list[str]) -> Flow[bool]:
    """In order, and only as far as one beats: one read a poll while the first of them lives."""
    for x in members:
        beats = yield ReadBeats((x,))
        if not m.silent(x, beats[x], (yield Now())):
            return False
    return True


def close(m: Member, g: int, last: Roster | None, unreached: list[str]) -> Flow[None]:
    """Wait for the last generation's members (each arrives or goes silent), then name the new one. Just
    before, the closer looks for a snapshot newer than its state once more (Refresh): the members that
    trained on may have written one and gone while this round waited; it arrives again with it."""
    waited = _Waited(*_expected(m, g, last), m.id in (last.members if last is not None else ()) or (m.gen == g - 1 and m.grouped),
                     started=(yield Now()))
    while True:
        yield from _unless_over(m)
        if (yield from _latest(m)) >= g:
            return              # this round or a later one was closed meanwhile
        arrivals, strangers = yield ReadArrivals(g)
        if not (yield from _ready(m, waited, arrivals)):
            yield Sleep(m.policy.inplace_poll_s)
            continue
        m.step, m.samples, m.lineage = yield Refresh()
        if _arrival(m, unreached) in arrivals:
            break
        yield Arrive(g, _arrival(m, unreached))     # again, with what it holds now (or lost with the store's keys)
    yield from _name(m, g, arrivals, strangers, waited.expected)


def _arrival(m: Member, unreached: list[str]) -> Arrival:
    return Arrival(m.id, m.name, m.step, m.addr, tuple(unreached), m.samples, m.lineage, m.aside_until > 0)


@dataclass
class _Waited:
    """What a closer knows of its round: the last generation and its members but itself, whether one of
    them (or itself) is here (the lineage), when it began, when the last arrival came, how many came."""

    last_g: int
    expected: tuple[str, ...]
    lineage: bool
    started: float
    last_arrival: float = 0.0
    seen: int = 0


def _ready(m: Member, w: _Waited, arrivals: list[Arrival]) -> Flow[bool]:
    """Whether the round can be closed now: every member of the last generation arrived or is gone and no
    spare that beats is on its way; or, for a round with no last generation, the join window."""
    policy = m.policy
    now = yield Now()
    if len(arrivals) != w.seen:
        w.seen, w.last_arrival = len(arrivals), now
    here = {a.member for a in arrivals}
    missing = [x for x in w.expected if x not in here]
    named = (yield ReadNotices(w.last_g))["silent"] if missing else set()     # seen silent by a peer
    beats = yield ReadBeats(tuple(x for x in missing if x not in named))
    now = yield Now()
    gone = [x for x in missing if x in named or m.silent(x, beats[x], now)]
    if w.expected and len(gone) == len(missing):
        return not (yield from _spares_coming(m, arrivals))
    if not w.expected:
        # Nodes starting together: whoever came within the join window. Not before a heartbeat timeout
        # either: members of a job whose store lost its keys put `latest` back within a beat, and this
        # round is then passed over (close's first look) instead of starting a second job.
        return now - w.last_arrival >= policy.inplace_join_window_s and now - w.started >= policy.ft_heartbeat_timeout_s
    # Beating but never coming (stuck): they come back as newcomers. Only with a member of the last
    # generation here: newcomers alone wait for its members, whose state is the job's newest (an
    # evaluation or a save can keep them from a step boundary longer than this), or for their silence.
    w.lineage |= bool(here & set(w.expected))
    return now - w.started >= policy.inplace_round_timeout_s and w.lineage


def _expected(m: Member, g: int, last: Roster | None) -> tuple[int, tuple[str, ...]]:
    """The last generation formed and its members but this one: this member's own record of it (rounds
    passed over since included), else round g-1's list."""
    if m.gen == g - 1 and m.grouped:
        return m.formed, tuple(x for x in m.members if x != m.id)
    return g - 1, last.members if last is not None else ()


def _spares_coming(m: Member, arrivals: list[Arrival]) -> Flow[bool]:
    """Whether the largest set of arrivals that reach one another is short of the job's nodes and a spare
    that beats has not arrived yet (it wakes at the round's first arrival; a lost node's round closes in a
    poll otherwise). Counted on that set, not on every arrival: across a cut, the side a spare is on may
    be the larger once it is there."""
    if not m.full_size or len({node_of(a.name) for a in mutual(arrivals)}) >= m.full_size:
        return False
    return (yield from spare_beats(m, {a.member for a in arrivals}))


def spare_beats(m: Member, but: set[str]) -> Flow[bool]:
    """Whether a member listed as a spare, but those in `but`, beats now (a slow node asks it too:
    app/ft/slow_nodes.py steps aside only for one)."""
    waiting = sorted((yield ReadSpares()) - but)
    beats = yield ReadBeats(tuple(waiting))
    now = yield Now()
    return any(_beats_now(m, x, beats[x], now) for x in waiting)


def _beats_now(m: Member, member: str, beat: Beat | None, now: float) -> bool:
    """Not silent as this member sees it (the beats' counts, on its own clock), unless its last beat is
    older than INPLACE_JOB_GONE by the wall-clock time it carries: a spare long gone costs no wait, and
    clocks that disagree by less than that cost nothing (a live spare on a host whose clock runs behind
    by more than a heartbeat timeout was once passed over)."""
    return beat is not None and beat.age_s < m.policy.inplace_job_gone_s and not m.silent(member, beat, now)


def _name(m: Member, g: int, arrivals: list[Arrival], strangers: list[Arrival], expected: tuple[str, ...]) -> Flow[None]:
    """Write the round's list: arrivals that still beat (one that arrived and died would fail the group's
    forming), of those the largest set that reach one another, at most the full size of nodes."""
    others = tuple(a.member for a in arrivals if a.member != m.id)
    beats = yield ReadBeats(others)
    now = yield Now()
    good = [a for a in arrivals if a.member == m.id or not m.silent(a.member, beats[a.member], now)]
    trained = set(expected) | ({m.id} if m.grouped else set())
    roster = roster_of(fill(without_aside(mutual(good)), trained, m.full_size), strangers)
    if (yield Close(g, roster, tuple(a.name for a in strangers))):  # of two closers, the first list stands
        yield Advance(g)


# ------------------------------------------------------------------ choices (pure)

def mutual(arrivals: list[Arrival]) -> list[Arrival]:
    """The arrivals a round names, in their order: a set whose every pair reaches each other by what
    each reported (`cut`: the members it could not reach; a pair is cut if either says so). From each
    arrival in turn, the most advanced first, then in order of arrival, it takes every arrival, in
    their order, that reaches all taken so far; the largest such set wins, of equal ones the first
    found. So the largest side of any clean partition goes on, of two equal sides the one holding the
    most advanced member, then the earliest arrival (the closer's); one cut link costs one of its ends.
    Every member computes the same from the same arrivals."""
    cut: dict[str, set[str]] = {a.member: set() for a in arrivals}
    for a in arrivals:
        for other in set(a.cut) & cut.keys() - {a.member}:
            cut[a.member].add(other)
            cut[other].add(a.member)
    best: list[Arrival] = []
    for seed in sorted(arrivals, key=AHEAD) if any(cut.values()) else arrivals[:1]:
        taken = {seed.member}
        for a in arrivals:
            if not cut[a.member] & taken:
                taken.add(a.member)
        if len(taken) > len(best):
            best = [a for a in arrivals if a.member in taken]
    return best


def without_aside(named: list[Arrival]) -> list[Arrival]:
    """`named` but the slow nodes stepping aside, unless nobody else is there: one node alone trains."""
    return [a for a in named if not a.aside] or named


def fill(named: list[Arrival], trained: set[str], full_size: int) -> list[Arrival]:
    """Of `named`, the nodes of at most `full_size`: those that trained in the last generation first (no
    state to send them), then in order; the others wait as spares."""
    if not full_size:
        return named
    nodes: list[str] = []
    for a in sorted(named, key=lambda a: a.member not in trained):
        if len(nodes) < full_size and node_of(a.name) not in nodes:
            nodes.append(node_of(a.name))
    return [a for a in named if node_of(a.name) in nodes]


def roster_of(named: list[Arrival], strangers: list[Arrival]) -> Roster:
    """The list of the arrivals `named`: the member ahead first (further: it is the source of the state),
    then in order of arrival."""
    order = sorted(named, key=AHEAD)
    return Roster(tuple(a.member for a in order), tuple(a.step for a in order), tuple(a.name for a in order),
                  tuple(a.addr for a in order), tuple(a.member for a in strangers), tuple(a.samples for a in order),
                  tuple(a.lineage for a in order))


def behind(roster: Roster, member: str) -> bool:
    """Whether `member` loads the source's state when its generation forms."""
    i = roster.members.index(member)
    return (roster.samples[i], roster.lineages[i]) != (roster.samples[0], roster.lineages[0])


def sends_state(roster: Roster) -> bool:
    """Whether a generation forming from `roster` sends the source's state: a member is behind it."""
    return any(behind(roster, x) for x in roster.members)


def lineage_of(incarnation: str, g: int, roster: Roster) -> str:
    """The lineage of every state generation g trains: the store's lifetime, its number and its source's
    member id ("incarnation.g.id"). Snapshots keep it, so a state loaded from one says where it came from."""
    return f"{incarnation}.{g}.{roster.members[0]}"


def further(a: tuple[str, int], b: tuple[str, int]) -> bool:
    """Whether state a, (lineage, samples), is further than state b. In one lifetime of the store, the
    later generation: it continues what the store sanctioned (members that lost the store and stopped
    come back to a job that went on without them, perhaps from an older snapshot, and that line, whose
    snapshots are the newest on disk, is the job's); within one generation, more samples. Across
    lifetimes (a store that lost its keys: its generations started again) and for a state of no
    generation, samples alone: steps of two lines would not compare (one that trained alone took more
    steps for the same samples), samples do. Last, the lineages themselves, so that any two differ."""
    (la, sa), (lb, sb) = a, b
    (ia, ga), (ib, gb) = _lineage_parts(la), _lineage_parts(lb)
    if ia == ib and ia and ga != gb:
        return ga > gb
    return (sa, la) > (sb, lb)


def _lineage_parts(lineage: str) -> tuple[str, int]:
    incarnation, _, rest = lineage.partition(".")
    g = rest.partition(".")[0]
    return (incarnation, int(g)) if g.isdigit() else ("", 0)


# Arrivals in order of how far their states are, the furthest first (sorted's key).
AHEAD = functools.cmp_to_key(lambda a, b: -1 if further((a.lineage, a.samples), (b.lineage, b.samples))
                             else 1 if further((b.lineage, b.samples), (a.lineage, a.samples)) else 0)


def node_of(name: str) -> str:
    """The node of a member's name (node/local rank): its processes come and go together."""
    return name.rpartition("/")[0]


def successor(member: str, members: tuple[str, ...] | list[str], names: tuple[str, ...] | list[str]) -> str | None:
    """The member `member` watches: the next on a ring ordered by local rank, then node, so that the
    processes of one node follow processes of other nodes and a whole node that hangs is seen by each
    of its watchers elsewhere. None in a generation of one."""
    ring = [x for _, x in sorted(zip([(int(n.rpartition("/")[2]), n) for n in names], members))]
    return None if len(ring) < 2 else ring[(ring.index(member) + 1) % len(ring)]


# ------------------------------------------------------------------ the watch

FENCE_FRACTION = 0.8    # of the heartbeat timeout: a member whose beats fail this long leaves its generation


def fenced(m: Member, beat_since_s: float) -> str | None:
    """Why this member leaves its generation when its last beat that reached the store is `beat_since_s`
    old: the others count it gone after the heartbeat timeout and may form a generation without it,
    so it stops well before (its watch's store operations time out at this bound too). None: not yet."""
    bound = FENCE_FRACTION * m.policy.ft_heartbeat_timeout_s
    if beat_since_s < bound:
        return None
    return (f"its beats have not reached the group store for {bound:g} s: it leaves the generation before the "
            "others count it gone")

@dataclass(frozen=True)
class Verdict:
    """What a member's watch makes of one look at generation g: a new generation wanted at the next step
    boundary (why), the generation over for this member now (why), a notice to the others."""

    want: str | None = None
    cut: str | None = None
    notify: tuple[str, str] | None = None      # (kind, about)


def look(m: Member, g: int, peer: str | None) -> Flow[Verdict]:
    """One look of the watch of a member of generation g, after its beat: `latest`, g's notices, the beat
    of the one peer it watches (`peer`, its successor on the ring), and its probes' finding."""
    latest = yield ReadLatest()
    if latest is None or latest < g:
        yield Advance(max(g, m.known))  # `latest` back first, as _latest does
        if latest != 0:     # the store lost its keys (a member behind may have put back its own): re-form on it;
            return Verdict(want="the group store restarted")    # a value no member signed (0) steers nothing else
    m.known = max(m.known, latest or 0)
    if latest > g:
        # The others went on without this member (it was stopped or cut off meanwhile): its group is
        # gone, and an all-reduce on it would wait out the collective timeout.
        return Verdict(cut="the others went on in a newer group")
    silent = f"a member stopped beating for {m.policy.ft_heartbeat_timeout_s:g} s"
    notices = yield ReadNotices(g)
    if notices["silent"]:
        return Verdict(cut=silent)
    if notices["cut"]:
        return Verdict(cut=CUT)
    if notices["reform"] & set(m.members) - {m.id}:
        # One of this generation asks for the next: it left this one (its step failed, or it lost the store
        # for a while) and will not come to this generation's next all-reduce.
        return Verdict(cut="a member left the generation")
    want = "a member asks to come in" if notices["reform"] else None
    if peer is not None and m.silent(peer, (yield ReadBeats((peer,)))[peer], (yield Now())):
        return Verdict(want=want, cut=silent, notify=("silent", peer))     # the others learn it from this notice
    if (yield Unreachable()):
        return Verdict(want=want, cut=CUT, notify=("cut", m.id))
    return Verdict(want=want)
