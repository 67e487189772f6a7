"""No endless restarts without progress: restarts that find no newer committed step end the job.

Progress is the newest committed step a node can see at a (re)start: its newest complete snapshot,
or the last train row of the run directory's metrics.jsonl, whichever is newer (a node that trained
keeps a just-in-time snapshot of its last step when a peer fails, so every node sees its own
progress). Each start is compared with the one before it; more than MAX_NO_PROGRESS_RESTARTS
(app/core/policy.py) restarts in a row without a newer step end the job with one `error:` line
naming the last cause. Three places restart, and each keeps its own list of starts:
- torchrun's agent, restarting a failed worker group (app/launch.py: every mode runs under it);
- the container entrypoint, rejoining with a new agent (docker/entrypoint.sh), and a Slurm requeue
  (scripts/train.sbatch): both through this module's command line, with a file of the starts:

    python -m app.progress STARTS_FILE CAUSE [TRAINER FLAGS...]

  which adds this start's step to STARTS_FILE, or says why not and exits 3 (EXIT_NO_PROGRESS).
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable, Sequence

from app.core.errors import UserError, one_line_errors
from app.recovery.failures import EXIT_NO_PROGRESS


class NoProgress(Exception):
    """The bound is reached: the message is the job's last line."""


def committed_step(run_dir: Path, snapshot_dir: Path) -> int:
    """The newest step this node can see as done: its newest complete snapshot, or metrics.jsonl's last train row."""
    from app.reporting.metrics import read
    from app.training.snapshot_files import PREFIX, complete_snapshots     # not snapshot.py: no torch here

    newest = complete_snapshots(snapshot_dir) if snapshot_dir.is_dir() else []
    step = int(newest[0].name[len(PREFIX):]) if newest else 0
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file():
        step = max([step, *(r["step"] for r in read(metrics) if r["event"] == "train")])
    return step


def restarts_without_progress(steps: Sequence[int]) -> int:
    """Of the starts' steps, oldest first: how many of the latest starts found no newer step than the one before."""
    count = 0
    for before, after in zip(reversed(steps[:-1]), reversed(steps)):
        if after > before:
            break
        count += 1
    return count


def check(steps: Sequence[int], bound: int, cause: str) -> None:
    """Raise NoProgress when the latest start is one restart without progress too many."""
    if restarts_without_progress(steps) > bound:
        raise NoProgress(f"error: no newer committed step than {steps[-1]} after {bound} restarts in a row "
                         f"(MAX_NO_PROGRESS_RESTARTS={bound}): not restarting again; the last cause: {cause}")


class RestartBound:
    """The starts of one restarting process (torchrun's agent): `restarting(cause)` before each restart."""

    def __init__(self, bound: int, measure: Callable[[], int]) -> None:
        self.bound, self.measure = bound, measure
        self.steps = [measure()]

    def restarting(self, cause: str) -> None:
        self.steps.append(self.measure())
        check(self.steps, self.bound, cause)


def record_start(starts: Path, cause: str, trainer_args: Sequence[str]) -> int:
    """The command line's work: this start's step appended to `starts`, unless the bound is reached
    (then its line, and EXIT_NO_PROGRESS)."""
    from app.core.config import parse
    from app.core.policy import FaultPolicy

    cfg = parse(trainer_args)
    try:
        steps = [int(line) for line in starts.read_text().split()] if starts.is_file() else []
    except (OSError, ValueError) as exc:
        raise UserError(f"{starts} is not a readable list of steps: {exc}") from None
    steps.append(committed_step(cfg.run_dir, cfg.snapshot_dir))
    try:
        check(steps, FaultPolicy.from_env().max_no_progress_restarts, cause)
    except NoProgress as exc:
        print(exc, file=sys.stderr, flush=True)
        return EXIT_NO_PROGRESS
    try:
        with open(starts, "a") as f:
            f.write(f"{steps[-1]}\n")
    except OSError as exc:
        raise UserError(f"cannot write {starts}: {exc.strerror}") from None
    return 0


USAGE = "usage: python -m app.progress STARTS_FILE CAUSE [TRAINER FLAGS...]"


def main(argv: Sequence[str]) -> int:
    if argv[:1] in (["-h"], ["--help"]):
        print(f"{USAGE}\n\n{__doc__.strip()}")
        return 0
    if len(argv) < 2:
        raise UserError(USAGE)
    return record_start(Path(argv[0]), argv[1], argv[2:])


if __name__ == "__main__":
    sys.exit(one_line_errors(lambda: main(sys.argv[1:])))
