"""Each node's step times, riding the survivor modes' all-reduce to every other node: what a slow node is
named from (app/recovery/slow.py) at no cost between faults, with no store traffic and no round trip.

The step's flat all-reduce (app/ft/replica.py's flat_copy) gets three more numbers per slot at its
end: in its own slot a node puts its steps' time outside the collective wait (the step clock's,
app/training/step_time.py; -1 when none of its steps since its last round was an ordinary one), the
flags of those that were not, as bits, and how long it steps aside (inplace, app/ft/slow_nodes.py: 0
not, -1 it leaves); the others' slots are zeros, so after the sum every node holds every slot's
numbers. A node takes its clock's time and feeds what the all-reduce brought to its watch once a
round (SlowWatch.every_s), not every step.

torchft: one slot per node. On a GPU reading the numbers back would need a host sync: they are copied
to pinned host memory behind the all-reduce (non_blocking) and read at the next round, once the copy's
event has completed (query(), which does not wait). inplace: one slot per member (a node's processes,
judged as its slowest); its step reads the regroup flag back every step anyway, and the numbers with it
(`shared`), since every member must see a node step aside at the same step.
"""
from __future__ import annotations

import statistics
import time
from collections import deque
from typing import Callable

import torch

from app.recovery.slow import FLAGS, SlowWatch

BITS = {flag: 1 << i for i, flag in enumerate(FLAGS)}
NO_TIME = -1.0
NUMBERS = 3         # per slot: its time, its flags, the seconds it steps aside
OVERHEADS = 8       # the healthy rounds whose step overhead is kept (their median is `overhead_s`)


class SharedPace:
    """One node's side: `put` its numbers before the all-reduce, `got` every node's after it.
    `take`: the step clock's; `watch`: where every node's numbers go (both asked when needed: the
    trainer makes them after its membership)."""

    def __init__(self, take: Callable[[], tuple[float | None, frozenset[str]]], watch: Callable[[], SlowWatch],
                 device: torch.device, node: Callable[[str], str] = lambda name: name) -> None:
        """node: the node of a slot's name (inplace names members node/local rank)."""
        self._take, self._watch, self._cuda, self._node = take, watch, device.type == "cuda", node
        self._mine: tuple[float | None, frozenset[str]] = (None, frozenset({"join"}))
        self._copied: tuple[torch.Tensor, torch.cuda.Event, list[str], float] | None = None    # GPU: the last round's
        self._round_at = float("-inf")      # when this node last took its time and read the others'
        self._steps = 0                     # steps since then
        self.step_s = 0.0                   # the job's wall time per step over the last round, waits included
        self._overheads: deque[float] = deque(maxlen=OVERHEADS)

    @property
    def watch(self) -> SlowWatch:
        return self._watch()

    def _due(self) -> bool:
        return time.monotonic() - self._round_at >= self._watch().every_s

    @staticmethod
    def numbers(nodes: int) -> int:
        """How many numbers ride with a step of `nodes` nodes."""
        return NUMBERS * nodes

    def put(self, tail: torch.Tensor, slot: int, aside_s: float = 0.0) -> None:
        """This node's numbers into its slot of the all-reduce's tail (zeros elsewhere): a fresh take from
        the step clock once a round, else the last one again; `aside_s`: it steps aside (inplace)."""
        if self._due():
            self._mine = self._take()
        self._steps += 1
        compute_s, flags = self._mine
        tail[NUMBERS * slot] = NO_TIME if compute_s is None else compute_s
        tail[NUMBERS * slot + 1] = float(sum(BITS[f] for f in flags if f in BITS))
        tail[NUMBERS * slot + 2] = aside_s

    def got(self, tail: torch.Tensor, names: list[str], scale: float = 1.0) -> None:
        """Every node's numbers after the all-reduce (`scale` undoes an average; `names`: the node of each
        slot), to the watch once a round."""
        if not self._due():
            return
        watch, now = self._watch(), self._round()
        if not self._cuda:
            watch.feed(now, samples(tail.tolist(), names, scale))
            return
        previous = self._copied
        host = torch.empty(tail.numel(), dtype=tail.dtype, pin_memory=True)
        host.copy_(tail, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        self._copied = (host, done, names, scale)
        if previous is not None and previous[1].query():
            watch.feed(now, samples(previous[0].tolist(), previous[2], previous[3]))

    def shared(self, values: list[float], names: list[str]) -> dict[str, float]:
        """inplace: every slot's numbers after the all-reduce, read back (`names`: the member of each slot,
        node/local rank). To the watch once a round, by node; and the nodes that step aside now, with
        their seconds aside (the longest of a node's slots, or -1 if one leaves: its first process decides)."""
        if self._due():
            watch, now = self._watch(), self._round()
            nodes = by_node(samples(values, names, 1.0), self._node)
            if not watch.peers.named:
                self._healthy(nodes)
            watch.feed(now, nodes)
        aside: dict[str, float] = {}
        for i, name in enumerate(names):
            seconds = values[NUMBERS * i + 2]
            if seconds:
                node = self._node(name)
                held = aside.get(node, 0.0)
                aside[node] = min(seconds, held) if min(seconds, held) < 0 else max(seconds, held)   # leaving wins
        return aside

    @property
    def overhead_s(self) -> float | None:
        """What a step takes beyond its slowest node's own time while no node is slow: the collective's own
        cost and each step's share of the evaluations, epochs' data and snapshots between steps (a round's
        wall time counts them), the median over the last OVERHEADS such rounds (None: none yet). What a step
        without a slow node would take beyond the others' own times (app/recovery/slow.py's estimate_without)."""
        return statistics.median(self._overheads) if self._overheads else None

    def _healthy(self, nodes: list[tuple[str, float | None, frozenset[str]]]) -> None:
        """A round in which no node was named slow: its overhead, where every node has a time (a join's
        rounds have none)."""
        times = [compute_s for _, compute_s, _ in nodes if compute_s is not None]
        if self.step_s > 0 and nodes and len(times) == len(nodes):
            self._overheads.append(max(0.0, self.step_s - max(times)))

    def _round(self) -> float:
        """A round begins now: the step period over the last one."""
        now = time.monotonic()
        if self._steps and self._round_at > float("-inf"):
            self.step_s = (now - self._round_at) / self._steps
        self._round_at, self._steps = now, 0
        return now


def by_node(slots: list[tuple[str, float | None, frozenset[str]]],
            node: Callable[[str], str]) -> list[tuple[str, float | None, frozenset[str]]]:
    """Each node's sample from its processes' slots: its slowest process's time (a node is as slow as its
    slowest rank, as in elastic mode), every flag any of them raised."""
    nodes: dict[str, tuple[float | None, frozenset[str]]] = {}
    for name, compute_s, flags in slots:
        held, raised = nodes.get(node(name), (None, frozenset()))
        times = [c for c in (held, compute_s) if c is not None]
        nodes[node(name)] = (max(times) if times else None, raised | flags)
    return [(name, compute_s, flags) for name, (compute_s, flags) in nodes.items()]


def samples(values: list[float], names: list[str], scale: float) -> list[tuple[str, float | None, frozenset[str]]]:
    """Each node's (name, time or None, flags) from the tail's numbers."""
    out = []
    for i, name in enumerate(names):
        compute_s, bits = values[NUMBERS * i] * scale, round(values[NUMBERS * i + 1] * scale)
        flags = frozenset(flag for flag, bit in BITS.items() if bits & bit)
        out.append((name, None if compute_s < 0 else compute_s, flags))
    return out
