"""What inplace mode keeps in the group store, and how it is read: every key of a job (Keys), a key's
value read without waiting (peek), the values no member signed counted for one warning (Rejects), and
the records (beats, arrivals, lists) parsed and checked for their form. No store connection and no
secret here: app/ft/inplace.py signs, checks the signatures of and reads what is laid out here."""
from __future__ import annotations

import json
import re
import threading
import time
from collections import Counter
from dataclasses import dataclass

import torch.distributed as dist

from app.ft.protocol import Arrival, Roster

NAMESPACE = "app/inplace"
# compare_set's expected value in peek(): a key holding it is answered with FORGED instead (set by
# the same call), so that a missing key and every value anyone wrote are told apart in one operation.
ABSENT, FORGED = b"\x00absent", b"\x00forged"
MEMBER = re.compile(r"[0-9a-f]{12}")
NAME = re.compile(r"[\w.:@-]{1,200}/\d{1,5}", re.ASCII)     # node/local rank, as it is printed in warnings
NUMBER = re.compile(r"\d{1,18}", re.ASCII)
ADDRESS = re.compile(r"[\w.:\[\]-]{1,200}:\d{1,5}", re.ASCII)     # a member's probe address (app/ft/reach.py)


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

    def done(self) -> str:
        """The job's done mark: the epochs it trained and its last step ("epochs:step")."""
        return self.namespace + "done"

    def incarnation(self) -> str:
        """This lifetime of the store (random): a store that restarts without its keys begins another."""
        return self.namespace + "incarnation"

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


def unsigned(raw: bytes | None) -> str:
    """A signed value's body without its check: for a stranger, who cannot check it."""
    return (raw or b"").decode(errors="replace").rpartition("|")[0]


def beat_of(body: str) -> tuple[int, float] | None:
    """(count, wall-clock time) of a beat's body "count:time"; None if it is not one."""
    count, _, at = body.partition(":")
    try:
        return int(count), float(at)
    except ValueError:
        return None


def list_text(roster: Roster) -> str:
    """A round's list as the store holds it (the source of the state first)."""
    return json.dumps({k: list(getattr(roster, k)) for k in LIST_FIELDS})


def arrival_text(a: Arrival) -> str:
    """What an arrival's proof signs: all of it."""
    return f"{a.member}/{a.name}/{a.step}/{a.addr}/{','.join(a.cut)}/{a.samples}/{a.lineage}/{int(a.aside)}"


def arrival_record(a: Arrival, said: str) -> dict:
    return {"member": a.member, "name": a.name, "step": a.step, "addr": a.addr, "cut": list(a.cut), "samples": a.samples,
            "lineage": a.lineage, "aside": a.aside, "proof": said}


def arrival_of(line: bytes) -> tuple[Arrival, str] | None:
    """One arrival record and its proof, if it is one: a member id, a node name, a step, a probe address,
    the members its probes did not reach, the samples and lineage of its state, whether it steps aside
    (slow), a proof."""
    try:
        a = json.loads(line)
    except ValueError:
        return None
    if (isinstance(a, dict) and isinstance(a.get("member"), str) and MEMBER.fullmatch(a["member"])
            and isinstance(a.get("name"), str) and NAME.fullmatch(a["name"])
            and type(a.get("step")) is int and a["step"] >= 0 and isinstance(a.get("proof"), str)
            and isinstance(a.get("addr"), str) and ADDRESS.fullmatch(a["addr"]) and isinstance(a.get("cut"), list)
            and all(isinstance(m, str) and MEMBER.fullmatch(m) for m in a["cut"])
            and type(a.get("samples")) is int and a["samples"] >= 0
            and isinstance(a.get("lineage"), str) and LINEAGE.fullmatch(a["lineage"])
            and type(a.get("aside")) is bool):
        return (Arrival(a["member"], a["name"], a["step"], a["addr"], tuple(a["cut"]), a["samples"], a["lineage"],
                        a["aside"]), a["proof"])
    return None


LIST_FIELDS = ("members", "steps", "names", "addrs", "refused", "samples", "lineages")    # protocol.Roster's, in order
INCARNATION = re.compile(r"[0-9a-f]{8}", re.ASCII)
LINEAGE = re.compile(r"([0-9a-f]{8}\.\d{1,18}\.[0-9a-f]{12})?", re.ASCII)     # protocol.lineage_of's, or none


def as_list(text: str | None) -> Roster | None:
    """A round's list, if `text` is one: members, their steps, names and probe addresses (one each),
    and the refused."""
    try:
        c = json.loads(text) if text else None
    except ValueError:
        return None
    if not (isinstance(c, dict)
            and all(isinstance(c.get(k), list) for k in LIST_FIELDS)):
        return None
    ok = (c["members"] and len({len(c[k]) for k in LIST_FIELDS if k != "refused"}) == 1
          and all(isinstance(m, str) and MEMBER.fullmatch(m) for m in c["members"] + c["refused"])
          and all(type(s) is int and s >= 0 for s in c["steps"] + c["samples"])
          and all(isinstance(x, str) and LINEAGE.fullmatch(x) for x in c["lineages"])
          and all(isinstance(n, str) and NAME.fullmatch(n) for n in c["names"])
          and all(isinstance(a, str) and ADDRESS.fullmatch(a) for a in c["addrs"]))
    if not ok:
        return None
    return Roster(*(tuple(c[k]) for k in LIST_FIELDS))
