"""TensorBoard event files beside metrics.jsonl, written from the same rows (global rank 0 only).

    make tensorboard RUN=default          # serves runs/default on http://127.0.0.1:6006

Every incarnation of a job (a fresh start, an elastic restart, a requeue) opens its own event file
with `purge_step` = the step it resumed from + 1: TensorBoard then hides every point an earlier
incarnation wrote past the snapshot, so the steps redone after a resume replace the lost ones and
each curve has one value per step.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from torch.utils.tensorboard import SummaryWriter

# Which keys of which metrics rows become which scalars. World size and restarts come from the
# train rows only: every train row carries them, and a second source would put two values at a step.
TAGS: dict[str, dict[str, str]] = {
    "train": {"loss": "train/loss", "lr": "train/lr", "images_per_s": "train/images_per_s",
              "world_size": "job/world_size", "restart_count": "job/restarts"},
    "eval": {"test_acc": "eval/test_acc", "test_loss": "eval/test_loss"},
}


class Board:
    """The TensorBoard writer of one incarnation of the job, fed the rows Reporter.record builds."""

    def __init__(self, run_dir: Path, resumed_step: int) -> None:
        self._writer = SummaryWriter(str(run_dir), purge_step=resumed_step + 1)

    def add(self, row: dict[str, Any]) -> None:
        scalars = {tag: row[key] for key, tag in TAGS.get(row["event"], {}).items() if row.get(key) is not None}
        for tag, value in scalars.items():
            self._writer.add_scalar(tag, value, global_step=row["step"], walltime=row["time"])
        if scalars:
            self._writer.flush()    # like metrics.jsonl's line buffering: a kill loses no written row

    def close(self) -> None:
        self._writer.close()
