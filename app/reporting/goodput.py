"""Where a job's wall time went: goodput (training steps that count) and badput (everything else).

One owner for the account. Each training process life keeps an `Account` of named phases, switched
at phase edges with time.perf_counter (no device sync; per step only the trainer's one clock read
at the step boundary); rank 0 of each life writes it as one `goodput` row of metrics.jsonl when the life ends,
done or at a fault exit where it can. `job_account` sums every life of a run directory and adds the
time with no training process up (restarts, rendezvous: the gaps between lives, from the rows' own
timestamps) and the lives that left no goodput row (killed: from their start row to their last row).

A life's parts (seconds):
    startup    exec -> the start row: interpreter and imports, process group, data, model, snapshot
               load, the heartbeat's start; the survivor modes' warm-up step
    train      steps that count
    redo       steps trained again after a fault (lost work: steps beyond the snapshot the life
               resumed from, up to the last step the job had trained), and steps not committed
    peer_wait  waiting for a lost or re-forming peer: the way out after a fault (the just-in-time
               snapshot), the survivor modes' membership check before each step (a heal included)
    eval       evaluation
    snapshot   snapshot stalls (the agreement before a save and the wait for the previous write)
    other      the remainder of the life's wall time: what no phase claims (config.json, the
               progress bar, the end); small by construction, a test holds it under 2 %
The job adds:
    down        no training process up: from one life's end to the next life's exec
    unrecorded  lives killed before they could write their row
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Iterator

PHASES = ("startup", "train", "redo", "peer_wait", "eval", "snapshot")
OTHER = "other"
DOWN, UNRECORDED = "down", "unrecorded"
GOOD = "train"


class Account:
    """One process life's phases. `started` is its exec time (wall clock), `startup_s` the seconds from
    then to the moment the account is made (app/reporting/startup.py measures both)."""

    def __init__(self, started: float, startup_s: float) -> None:
        self.started = started
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.seconds["startup"] = startup_s
        self._phase: str | None = None      # None: untracked, left to `other`
        self._since = time.perf_counter()

    @property
    def current(self) -> str | None:
        return self._phase

    def switch(self, phase: str | None, since: float | None = None) -> str | None:
        """Close the current phase and open `phase`; returns the phase that was open. `since` (a
        perf_counter reading) backdates the edge, never past the previous one: a fault found now
        that began at the last step boundary."""
        now = time.perf_counter() if since is None else min(max(since, self._since), time.perf_counter())
        if self._phase is not None:
            self.seconds[self._phase] += now - self._since
        previous, self._phase, self._since = self._phase, phase, now
        return previous

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """`name` for the block, then back to whatever phase was open."""
        previous = self.switch(name)
        try:
            yield
        finally:
            self.switch(previous)

    def move(self, seconds: float, source: str, target: str) -> None:
        """Seconds already counted in `source` belong to `target` (a step that did not commit)."""
        self.switch(self._phase)            # the open phase's seconds so far are counted first
        seconds = min(seconds, self.seconds[source])
        self.seconds[source] -= seconds
        self.seconds[target] += seconds

    def row(self) -> dict[str, Any]:
        """The goodput row's values up to now: the life's wall time and its parts, `other` the remainder."""
        self.switch(self._phase)            # the open phase counts up to now, and stays open
        wall = time.time() - self.started
        parts = {k: round(v, 3) for k, v in self.seconds.items()}
        parts[OTHER] = round(wall - sum(self.seconds.values()), 3)
        return {"life_started": round(self.started, 3), "wall_s": round(wall, 3), "parts_s": parts}


def job_account(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Every life of a run directory's metrics rows (in file order), summed: the parts in seconds,
    `down` and `unrecorded` added, the job's wall time from the first life's exec to the last row,
    and goodput = train / the sum of the parts (the process-seconds of the job plus its down time;
    with one life at a time, as in elastic mode, that sum is the wall time). None without a life."""
    every = lives(rows)
    if not every:
        return None
    parts = dict.fromkeys((*PHASES, OTHER, UNRECORDED, DOWN), 0.0)
    for life in every:
        for name, seconds in life["parts_s"].items():
            parts[name] = parts.get(name, 0.0) + seconds
    first, last = min(life["start"] for life in every), max(life["end"] for life in every)
    parts[DOWN] = (last - first) - _covered([(life["start"], life["end"]) for life in every])
    parts = {k: round(v, 3) for k, v in parts.items()}
    total = sum(parts.values())
    bad = max((k for k in parts if k != GOOD), key=lambda k: parts[k])
    return {"wall_s": round(last - first, 3), "lives": len(every), "parts_s": parts,
            "goodput": round(parts[GOOD] / total, 4) if total > 0 else None, "largest_badput": (bad, parts[bad])}


def lives(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each life, in the order of its start row: its exec time, its end, its parts. A life is a start
    row (its process_started) with the goodput row of the same exec time; one without (killed) runs
    to its last row before the next start row of the run directory, all of it unrecorded."""
    written = {r["life_started"]: r for r in rows if r["event"] == "goodput" and "life_started" in r}
    found, open_life = [], None
    for row in rows:
        if row["event"] == "start" and row.get("process_started") is not None:
            open_life = None
            done = written.pop(row["process_started"], None)
            if done is None:
                open_life = {"start": row["process_started"], "end": row["time"],
                             "parts_s": {UNRECORDED: row["time"] - row["process_started"]}}
                found.append(open_life)
            else:
                found.append(_written(done))
        elif open_life is not None:
            open_life["parts_s"][UNRECORDED] += row["time"] - open_life["end"]
            open_life["end"] = row["time"]
    return found + [_written(r) for r in written.values()]   # a row whose start row was lost: still a life


def _written(row: dict[str, Any]) -> dict[str, Any]:
    return {"start": row["life_started"], "end": row["life_started"] + row["wall_s"], "parts_s": row["parts_s"]}


def _covered(spans: list[tuple[float, float]]) -> float:
    """Seconds in the union of the spans."""
    covered, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            covered += end - max(start, reach)
            reach = end
    return covered


def describe(account: dict[str, Any] | None) -> str:
    """The done line's part: `goodput 0.87 of 123.4 s (3 lives); largest badput startup 8.1 s`."""
    if account is None or account["goodput"] is None:
        return "goodput unknown (no goodput rows)"
    bad, seconds = account["largest_badput"]
    lives = account["lives"]
    return (f"goodput {account['goodput']:.2f} of {account['wall_s']:.1f} s ({lives} li{'ves' if lives > 1 else 'fe'}); "
            f"largest badput {bad} {seconds:.1f} s")
