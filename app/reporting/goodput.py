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
               resumed from, up to the last step the job had trained), and the compute of steps not
               committed
    detection  from the last step boundary before a fault to the moment this process found it (the
               step in flight, the wait for a peer that would not come); in the survivor modes a
               step's wait at the all-reduce that failed
    regroup    the way out after a fault (the just-in-time snapshot); the survivor modes' membership
               check before each step: a group re-formed, torchft's quorum round trip at every step
    heal       loading a live member's state (survivor modes; its transfer counts in regroup)
    slow_peer  while a peer is named slow (app/recovery/slow.py), what each step waits for it beyond
               the slowest other node's own time: the step's seconds the job would not have spent
    eval       evaluation
    snapshot   snapshot stalls (the agreement before a save and the wait for the previous write)
    other      the remainder of the life's wall time: what no phase claims (config.json, the
               progress bar, the end); small by construction, a test holds it under 2 %
The job adds:
    down        no training process up: from one life's end to the next life's exec
    unrecorded  lives killed before they could write their row

Lives overlap in the survivor modes (every node's rank 0 is one), so a life without its goodput row
may be one that still runs: only a life known to be gone counts as killed (`running`).
"""
from __future__ import annotations

import contextlib
import fcntl
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

PHASES = ("startup", "train", "redo", "detection", "regroup", "heal", "slow_peer", "eval", "snapshot")
OTHER = "other"
DOWN, UNRECORDED = "down", "unrecorded"
GOOD = "train"
MARKS = ".lives"        # in the run directory: a file per life, locked by its process while it runs
# How long a life that trained to its end waits for the job's others still running to end, so that its
# done line counts them: the survivor modes' nodes end at the same step, a moment apart (the lease
# holder closes the last snapshot first); one that runs on past this (paused, come too late to train)
# is said and left out.
END_WAIT_S = 10.0


class Account:
    """One process life's phases. `started` is its exec time (wall clock), `startup_s` the seconds from
    then to the moment the account is made (app/reporting/startup.py measures both)."""

    def __init__(self, started: float, startup_s: float,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.started, self.clock = started, clock
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.seconds["startup"] = startup_s
        self._phase: str | None = None      # None: untracked, left to `other`
        self._since = self._made = clock()

    @property
    def current(self) -> str | None:
        return self._phase

    def switch(self, phase: str | None, since: float | None = None) -> str | None:
        """Close the current phase and open `phase`; returns the phase that was open. `since` (a
        perf_counter reading) backdates the edge, never past the previous one: a fault found now
        that began at the last step boundary."""
        now = self.clock() if since is None else min(max(since, self._since), self.clock())
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
        wall = self.seconds["startup"] + self.clock() - self._made     # one clock: the parts add up to it
        parts = {k: round(v, 3) for k, v in self.seconds.items()}
        parts[OTHER] = round(wall - sum(self.seconds.values()), 3)
        return {"life_started": round(self.started, 3), "wall_s": round(wall, 3), "parts_s": parts}


class LifeMark:
    """This process's life: its name, which every row it writes carries, and a mark in the run
    directory that says it runs: a file under a flock, which the kernel drops when the process ends,
    however it ends (as the node containers' core and GPU locks, and app/cluster/cores.py's registry).
    Taken before the life writes its first row, so a reader that finds the name in a row finds it
    marked while it runs."""

    def __init__(self, run_dir: Path) -> None:
        self.name = uuid.uuid4().hex[:12]
        self._path = run_dir / MARKS / self.name
        self._path.parent.mkdir(exist_ok=True)
        self._file = open(self._path, "w")
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:         # a file system without locks: this life is taken for gone (killed) while it runs
            pass

    def close(self) -> None:
        self._path.unlink(missing_ok=True)
        self._file.close()


def running(run_dir: Path, names: Iterable[str]) -> list[str]:
    """The named lives whose process still runs: their mark is locked. Why the mark and not the rows:
    in the survivor modes a node's rank 0 writes no row between its start and goodput rows unless it
    holds the writer lease, so "no recent row" says nothing; and a node that comes back is a new life,
    so "started again" says nothing about a node killed for good. A process that holds its mark
    lives (or is paused); one that does not is gone, whatever ended it."""
    return [name for name in names if _held(run_dir / MARKS / str(name))]


def _held(path: Path) -> bool:
    try:
        with open(path) as mark:
            fcntl.flock(mark, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:         # no mark (ended and removed, or written before lives were marked): gone
        return False
    return False


def job_account(rows: list[dict[str, Any]], still_running: Iterable[str] = ()) -> dict[str, Any] | None:
    """Every life of a run directory's metrics rows (in file order) that has ended, summed: the parts in
    seconds, `down` and `unrecorded` added, the job's wall time from the first life's exec to the last
    end, and goodput = train / the sum of the parts (the process-seconds of the job plus its down time;
    with one life at a time, as in elastic mode, that sum is the wall time). `still_running`: lives
    without a goodput row that are not gone (`running`), left out and counted in `running`. None
    without a life that ended."""
    still = set(still_running)
    every = lives(rows, still)
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
    return {"wall_s": round(last - first, 3), "lives": len(every), "running": len(still), "parts_s": parts,
            "goodput": round(parts[GOOD] / total, 4) if total > 0 else None, "largest_badput": (bad, parts[bad])}


def lives(rows: list[dict[str, Any]], still_running: Iterable[str] = ()) -> list[dict[str, Any]]:
    """Each life that has ended, in the order of its start row: its exec time, its end, its parts. A
    life ended at its goodput row; one without it was killed, unless it is `still_running`, and counts
    from its exec to its own last row, all of it unrecorded (its later seconds are not known)."""
    spans, written = _spans(rows)
    still, found = set(still_running), []
    for name, (start, end) in spans.items():
        if name in written:
            found.append(_written(written.pop(name)))
        elif name not in still:
            found.append({"start": start, "end": end, "parts_s": {UNRECORDED: end - start}})
    return found + [_written(r) for r in written.values()]   # a row whose start row was lost: still a life


def _spans(rows: list[dict[str, Any]]) -> tuple[dict[Any, list[float]], dict[Any, dict[str, Any]]]:
    """Each life's exec time and last row's time, by name in the order of its start row; and its goodput row."""
    spans: dict[Any, list[float]] = {}
    written: dict[Any, dict[str, Any]] = {}
    for name, row in _named(rows):
        if row["event"] == "goodput" and "life_started" in row:
            written[name] = row
        elif row["event"] == "start" and row.get("process_started") is not None:
            spans.setdefault(name, [row["process_started"], row["time"]])
        elif name in spans:
            spans[name][1] = row["time"]
    return spans, written


def unwritten(rows: list[dict[str, Any]]) -> list[Any]:
    """The lives with a start row and no goodput row: gone, or still running."""
    named = list(_named(rows))
    ended = {name for name, row in named if row["event"] == "goodput"}
    return list(dict.fromkeys(name for name, row in named if row["event"] == "start" and name not in ended))


def _named(rows: list[dict[str, Any]]) -> Iterator[tuple[Any, dict[str, Any]]]:
    """Each row with the life that wrote it: its `life`. Rows written before lives were named: a start
    row's exec time, the goodput row's of the same, and every other row the last such start row's
    (right where one life wrote at a time, as in elastic mode)."""
    last = None
    for row in rows:
        name = row.get("life")
        if name is None and row["event"] == "start":
            name = last = row.get("process_started")
        elif name is None:
            name = row.get("life_started") if row["event"] == "goodput" else last
        yield name, row


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
    """The done line's part: `goodput 0.87 of 123.4 s (3 lives); largest badput startup 8.1 s`, and
    the lives still running where some are (`(1 life, 1 more running: not counted)`)."""
    if account is None or account["goodput"] is None:
        return "goodput unknown (no goodput rows)"
    bad, seconds = account["largest_badput"]
    lives = account["lives"]
    counted = f"{lives} li{'ves' if lives > 1 else 'fe'}"
    if account["running"]:
        counted += f", {account['running']} more running: not counted"
    return (f"goodput {account['goodput']:.2f} of {account['wall_s']:.1f} s ({counted}); "
            f"largest badput {bad} {seconds:.1f} s")
