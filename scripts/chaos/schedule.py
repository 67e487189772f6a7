"""Which faults a run injects, in what order: every kind once before any repeats, drawn by a seeded rng."""
from __future__ import annotations

import random

FAULTS = ("kill_worker", "kill_rank0", "kill_during_save", "restart_fast", "pause", "freeze_worker", "partition",
          "disk_full", "corrupt_newest", "scale_up", "store_restart", "back_to_back")


def plan(rng: random.Random, count: int, kinds: list[str] | None = None) -> list[str]:
    """Every kind at least once (when count allows), the rest drawn at random; scale_up brings scale_down."""
    pool = list(kinds or FAULTS)
    rng.shuffle(pool)
    return pool[:count] + [rng.choice(pool) for _ in range(max(0, count - len(pool)))]
