"""Which faults a run injects, in what order and when: every kind once before any repeats, at random
points of the job's progress, drawn by a seeded rng."""
from __future__ import annotations

import random

FAULTS = ("kill_worker", "kill_rank0", "kill_during_save", "restart_fast", "pause", "freeze_worker", "partition",
          "cut_peers", "split_halves", "disk_full", "corrupt_newest", "scale_up", "store_restart", "back_to_back",
          "wipe_disks", "damage_then_wipe", "slow_node", "flap")

# These cut the data path between nodes with nftables (scripts/chaos/host.py's PeerCut): the host needs nft.
NEEDS_NFT = ("cut_peers", "split_halves", "flap")

# A steady fault rate (--every) draws from these unless --only says otherwise: the faults a job meets at
# random in a large fleet, each over within seconds (a pause, a cut or a slow node lasts as long as its
# flag says, and would set the rate instead).
EVERY_KINDS = ("kill_worker", "kill_rank0", "freeze_worker", "partition")


# Only these faults need the job's object store (the run's --no-object-store leaves them out).
NEEDS_OBJECT_STORE = ("wipe_disks", "damage_then_wipe")


def kinds(only: list[str] | None, object_store: bool) -> list[str]:
    """The kinds a run draws from: --only's, else every kind its jobs can take."""
    return list(only) if only else [k for k in FAULTS if object_store or k not in NEEDS_OBJECT_STORE]


def plan(rng: random.Random, count: int, kinds: list[str] | None = None) -> list[str]:
    """Every kind at least once (when count allows), the rest drawn at random; scale_up brings scale_down."""
    pool = list(kinds or FAULTS)
    rng.shuffle(pool)
    return pool[:count] + [rng.choice(pool) for _ in range(max(0, count - len(pool)))]


# The faults come at points of the job's progress, not of the clock: on a fast machine a clock
# schedule outlasts the job (and a test must raise its epochs), on a slow one it makes the job long.
# One fault in each equal slice of the first SPAN of the epochs, so that the job trains on after
# the last one: the last node comes back and the pace after the faults is measured there.
SPAN = 0.5


# In a run that measures its pace (--pace-before), a fault not yet injected when the job is past this
# share of its epochs is left out: faults fall behind a job that trains faster than they are healed
# (each waits for the job to recover), and one that comes as the job ends leaves no pace after the
# faults to measure (the full run of 2026-11-26 22:35, elastic mode: its last fault came as it ended).
LAST_FAULT_BY = 0.8


def too_late(epoch: float, epochs: float) -> bool:
    """Whether a fault due now would leave the job too little training after it to measure."""
    return epoch > LAST_FAULT_BY * epochs


def moments(rng: random.Random, count: int, epochs: float, start: float = 0.0) -> list[float]:
    """The epoch at which each of `count` faults is due, increasing, counted from epoch `start` (a run
    that trains a while at full size first, to measure its pace before the faults)."""
    width = SPAN * (epochs - start) / max(1, count)
    return [round(start + width * (i + rng.uniform(0.2, 1.0)), 2) for i in range(count)]


def every(start: float, count: int, every_s: float) -> list[float]:
    """A steady fault rate: the wall-clock moment each of `count` faults is due, one every `every_s`
    seconds from `start` (the end of the pace window). A fault still being healed when the next is due
    delays it: the runner injects that one at once, and the report says the rate it kept."""
    return [start + every_s * (i + 1) for i in range(count)]
