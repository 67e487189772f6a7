"""What rank 0 reports: metrics.jsonl in the run directory, and a progress bar or plain lines."""
from __future__ import annotations

import json
import math
import re
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from app.core.errors import UserError, warning
from app.reporting import goodput

# Every line of metrics.jsonl has these keys (None where not known yet), plus `event`:
# "start" when a (re)started job begins, "train" every --log-every-steps, "eval" after each
# evaluation, "snapshot" after each save, "goodput" when a process life ends (app/reporting/goodput.py).
# Each also names the life that wrote it, `life` (goodput.LifeMark).
KEYS = ("step", "epoch", "loss", "lr", "test_acc", "images_per_s", "world_size", "restart_count")
ROW_KEYS = ("event", "time", *KEYS)
# Rows every replica group writes, also in torchft mode: each is about the life of its own processes.
LIFE_ROWS = ("start", "goodput")
# The console's line for a train row (Reporter.record), as a reader of a node's log finds it: step, world size,
# and the lineage that trained it where the row has one (inplace: the generation, app/ft/membership.py).
STEP_LINE = re.compile(r"\bstep +(\d+)  epoch .* world (\d+)(?:  lineage (\S+))?$")


# How often a life that waits for the others' goodput rows reads them (Reporter.job_account).
POLL_S = 0.1

# A start's first seconds (imports finishing, first allocations, a healing node catching up) are not its pace.
PACE_SETTLE_S = 10.0


def pace(rows: list[dict[str, Any]], world: int, since: float = -math.inf, until: float = math.inf) -> float | None:
    """Steps per second over wall time at one world size, never a median of per-row rates: from
    PACE_SETTLE_S after the first train row at that size after `since`, to the last one at or before
    `until`, the steps between them over the seconds between them. Steps taken again after a resume
    start the count anew. None with fewer than two such rows."""
    train = sorted((r for r in rows if r["event"] == "train" and r["world_size"] == world and since < r["time"] <= until),
                   key=lambda r: r["time"])
    if not train:
        return None
    counted: list[dict[str, Any]] = []
    for row in train:
        if row["time"] < train[0]["time"] + PACE_SETTLE_S:
            continue
        if counted and row["step"] < counted[-1]["step"]:
            counted = []            # a resume went back: count from it
        counted.append(row)
    if len(counted) < 2 or counted[-1]["time"] <= counted[0]["time"]:
        return None
    return (counted[-1]["step"] - counted[0]["step"]) / (counted[-1]["time"] - counted[0]["time"])


def done_line(epochs: int, steps: int, test_acc: float | None, images: int, wall_s: float) -> str:
    """The last line of a run that trained to the end: its throughput is every image this start
    trained on (all processes together) over the wall time from its first step to its end,
    evaluations, snapshots and faults included, never a median of per-row rates. The accuracy reads
    as the eval line's (4 decimals; `-` where there was no evaluation)."""
    speed = f"{images / wall_s:.0f} img/s" if wall_s > 0 else "- img/s"
    acc = "-" if test_acc is None else f"{test_acc:.4f}"
    return f"done: {epochs} epochs, {steps} steps, test_acc {acc}, {speed} ({images} images in {wall_s:.1f} s)"


class Reporter:
    """Rank 0's one output channel: console lines, the progress bar and metrics.jsonl.

    Active on global rank 0 only; elsewhere every method does nothing.
    """

    def __init__(self, run_dir: Path, active: bool, mode: str) -> None:
        self.active = active
        self.path = run_dir / "metrics.jsonl"
        self._mode = mode
        self._file = None
        self._life: goodput.LifeMark | None = None
        self._bar = None
        self._board = None      # TensorBoard, opened at the first point to draw (_write)
        self._resumed: int | None = None    # the step the start row resumed from: the Board's purge step
        if not active:
            return
        if run_dir.exists() and not run_dir.is_dir():
            raise UserError(f"run directory {run_dir} is not a directory")
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", buffering=1)   # line-buffered: a kill loses no full line
            self._life = goodput.LifeMark(run_dir)          # before the first row: every row names it
        except OSError as exc:
            raise UserError(f"cannot write {self.path}: {exc.strerror}") from None

    def start_progress(self, total_steps: int) -> None:
        """A progress bar from here on (on a terminal, or with --progress bar); plain lines otherwise."""
        if self.active and (self._mode == "bar" or (self._mode == "auto" and sys.stderr.isatty())):
            self._bar = tqdm(total=total_steps, unit="step", dynamic_ncols=True)

    def say(self, line: str) -> None:
        """Information, on stdout."""
        if not self.active:
            return
        if self._bar is not None:
            self._bar.write(line)
        else:
            print(line, flush=True)

    def warn(self, line: str) -> None:
        """Something the user should look at while the job goes on, on stderr."""
        if not self.active:
            return
        if self._bar is not None:
            self._bar.write(warning(line), file=sys.stderr)
        else:
            print(warning(line), file=sys.stderr, flush=True)

    def record(self, event: str, to_file: bool = True, **values: Any) -> None:
        """One row: said on the console, and written to metrics.jsonl `to_file` (the survivor modes: one
        replica group per run directory writes the rows, the trainer's Writer; every group says them)."""
        if not self.active:
            return
        row = {"event": event, "time": round(time.time(), 3), **{k: values.pop(k, None) for k in KEYS}, **values,
               "life": self._life.name}
        if to_file:
            self._write(row)
        if event == "train" and self._bar is None:
            speed = "-" if row["images_per_s"] is None else f"{row['images_per_s']:.0f}"
            lineage = f"  lineage {row['lineage']}" if row.get("lineage") else ""
            self.say(f"step {row['step']:>6}  epoch {row['epoch']:.2f}  loss {row['loss']:.4f}  "
                     f"lr {row['lr']:.4g}  {speed} img/s  world {row['world_size']}{lineage}")
        elif event == "eval":
            self.say(f"eval   epoch {row['epoch']:.2f}  test_acc {row['test_acc']:.4f}  "
                     f"test_loss {row['test_loss']:.4f}")

    def _write(self, row: dict[str, Any]) -> None:
        self._file.write(json.dumps(_json_ready(row), allow_nan=False) + "\n")
        if row["event"] == "start":
            self._resumed = row["step"]
        elif self._board is None and self._resumed is not None and row["event"] in SERIES:
            # Opened once the first point is in metrics.jsonl, not with the start row: its import (0.085 s
            # here) then follows the first training step instead of delaying it. Here, not at the top:
            # readers of metrics.jsonl need no torch.
            from app.reporting.tboard import Board
            self._board = Board(self.path.parent, self._resumed)
        if self._board is not None:
            self._board.add(row)

    def last_step(self) -> int | None:
        """The last training step this run directory's metrics.jsonl shows (rank 0; None elsewhere)."""
        if not self.active or not self.path.exists():
            return None
        steps = [r["step"] for r in read(self.path) if r.get("event") == "train"]
        return max(steps) if steps else None

    def job_account(self, wait_s: float = goodput.END_WAIT_S) -> dict[str, Any] | None:
        """The job's goodput account (rank 0; None elsewhere) once every life in this run directory without
        its goodput row is gone (killed) or has written it, or after wait_s: those still running are then
        left out, and the account says how many."""
        if not self.active:
            return None
        deadline = time.monotonic() + wait_s
        while True:
            still = goodput.running(self.path.parent, goodput.unwritten(read(self.path)))
            if not still or time.monotonic() >= deadline:
                break
            time.sleep(POLL_S)
        # Read again after the marks: a life that ended between the read and its mark's check wrote its
        # row before its mark fell, so the rows read now hold it (the first read would count it killed).
        rows = read(self.path)
        unwritten = set(goodput.unwritten(rows))
        return goodput.job_account(rows, [name for name in still if name in unwritten])

    def advance(self, step: int, **postfix: Any) -> None:
        if self._bar is not None:
            self._bar.n = step
            self._bar.set_postfix(postfix, refresh=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._file is not None:
            self._file.close()
        if self._life is not None:
            self._life.close()
        if self._board is not None:
            self._board.close()


def _json_ready(value: Any) -> Any:
    """value with every non-finite float as None: json.dumps writes them as NaN and Infinity, which
    JSON does not have (strict readers refuse the whole line). The trainer stops on a non-finite loss
    (app/training/trainer.py); any other value, a throughput over no time say, is null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_ready(v) for v in value]
    return value


def read(path: Path) -> list[dict[str, Any]]:
    """All usable rows of a metrics.jsonl; the rest (a line torn by a kill, an edit by hand, a row of
    another program) are skipped with one warning that counts them."""
    rows, skipped = [], 0
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if _usable(row):
            rows.append(row)
        else:
            skipped += 1
    if skipped:
        print(warning(f"{path}: skipped {skipped} unusable line{'s' * (skipped > 1)} (each must be a JSON "
                      f"object with {', '.join(ROW_KEYS)})"), file=sys.stderr, flush=True)
    return rows


def _usable(row: Any) -> bool:
    """A row the readers can use without a check of their own: every key, and the types they compute with."""
    return (isinstance(row, dict) and all(k in row for k in ROW_KEYS) and isinstance(row["event"], str)
            and isinstance(row["step"], int) and isinstance(row["time"], (int, float)))


SERIES = ("train", "eval")   # rows that form curves; start and snapshot rows are events


def latest_per_step(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows in file order with only the newest train/eval row for a step, the way TensorBoard shows them.

    A resumed job redoes the steps after its snapshot: its start row at step k supersedes every
    earlier train/eval row past k (also those it never reaches again, e.g. after a world-size change
    moved the epoch ends), and of the rest the last row for each (event, step) wins. All start and
    snapshot rows are kept.
    """
    kept: list[dict[str, Any]] = []
    for row in rows:
        if row["event"] == "start":
            kept = [r for r in kept if r["event"] not in SERIES or r["step"] <= row["step"]]
        kept.append(row)
    last = {(r["event"], r["step"]): i for i, r in enumerate(kept) if r["event"] in SERIES}
    return [r for i, r in enumerate(kept) if r["event"] not in SERIES or last[(r["event"], r["step"])] == i]
