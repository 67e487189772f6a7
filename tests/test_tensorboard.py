"""TensorBoard event files written by the Reporter, read back with TensorBoard's own loader."""
from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
from tests.helpers import run_trainer
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from app.reporting import metrics
from app.reporting.metrics import Reporter

pytestmark = pytest.mark.unit

TAGS = {"train/loss", "train/lr", "train/images_per_s", "job/world_size", "job/restarts",
        "eval/test_acc", "eval/test_loss"}


def incarnation(run_dir: Path, resumed_step: int, steps: range, loss_offset: float, restarts: int, world: int,
                eval_at: int) -> None:
    """What one (re)start of a job records: its start row, a train row per step, one eval and one snapshot."""
    report = Reporter(run_dir, active=True, mode="lines")
    report.record("start", step=resumed_step, epoch=resumed_step / 10, world_size=world, restart_count=restarts)
    for step in steps:
        report.record("train", step=step, epoch=step / 10, loss=loss_offset + step, lr=0.01 * step,
                      test_acc=None, images_per_s=100.0 * world, world_size=world, restart_count=restarts)
        if step == eval_at:
            report.record("eval", step=step, epoch=step / 10, test_acc=step / 10, test_loss=1.0 / step,
                          world_size=world, restart_count=restarts)
            report.record("snapshot", step=step, epoch=step / 10, world_size=world, restart_count=restarts)
    report.close()


def board(run_dir: Path) -> EventAccumulator:
    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    return acc


def series(acc: EventAccumulator, tag: str) -> list[tuple[int, float]]:
    return [(e.step, round(e.value, 4)) for e in acc.Scalars(tag)]


def next_second() -> None:
    """Event file names start with the creation second, and TensorBoard reads a directory's files in
    name order: a second writer in the same second of the same process could sort first."""
    now = int(time.time())
    while int(time.time()) == now:
        time.sleep(0.05)


def test_event_files_beside_metrics_hold_every_scalar(tmp_path):
    incarnation(tmp_path, 0, range(1, 4), loss_offset=0.0, restarts=0, world=2, eval_at=3)
    assert list(tmp_path.glob("events.out.tfevents.*")) and (tmp_path / "metrics.jsonl").exists()
    acc = board(tmp_path)
    assert set(acc.Tags()["scalars"]) == TAGS
    assert series(acc, "train/loss") == [(1, 1.0), (2, 2.0), (3, 3.0)]
    assert series(acc, "train/lr") == [(1, 0.01), (2, 0.02), (3, 0.03)]
    assert series(acc, "train/images_per_s") == [(1, 200.0), (2, 200.0), (3, 200.0)]
    assert series(acc, "job/world_size") == [(1, 2.0), (2, 2.0), (3, 2.0)]
    assert series(acc, "job/restarts") == [(1, 0.0), (2, 0.0), (3, 0.0)]
    assert series(acc, "eval/test_acc") == [(3, 0.3)]
    assert series(acc, "eval/test_loss") == [(3, round(1 / 3, 4))]
    # The event wall times are the rows' own, so TensorBoard's time axis matches metrics.jsonl.
    rows = [r for r in metrics.read(tmp_path / "metrics.jsonl") if r["event"] == "train"]
    assert [round(e.wall_time, 3) for e in acc.Scalars("train/loss")] == [r["time"] for r in rows]


def test_only_the_active_reporter_writes_events(tmp_path):
    report = Reporter(tmp_path, active=False, mode="lines")   # any rank but global rank 0
    report.record("start", step=0, epoch=0.0, world_size=2, restart_count=0)
    report.record("train", step=1, epoch=0.1, loss=1.0, lr=0.1, images_per_s=1.0, world_size=2, restart_count=0)
    report.close()
    assert list(tmp_path.iterdir()) == []


def test_a_resume_replaces_the_steps_it_redoes(tmp_path):
    # Trained to step 6 (an eval at 5), then died; the next incarnation resumed from step 3 at world 1.
    incarnation(tmp_path, 0, range(1, 7), loss_offset=0.0, restarts=0, world=2, eval_at=5)
    next_second()
    incarnation(tmp_path, 3, range(4, 9), loss_offset=100.0, restarts=1, world=1, eval_at=7)
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 2
    acc = board(tmp_path)
    newer = [(s, 100.0 + s) for s in range(4, 9)]
    assert series(acc, "train/loss") == [(1, 1.0), (2, 2.0), (3, 3.0), *newer]
    assert series(acc, "job/restarts") == [(s, 0.0) for s in (1, 2, 3)] + [(s, 1.0) for s in range(4, 9)]
    assert series(acc, "job/world_size") == [(s, 2.0) for s in (1, 2, 3)] + [(s, 1.0) for s in range(4, 9)]
    # The eval at step 5 came after the snapshot the job resumed from: superseded, though never redone.
    assert series(acc, "eval/test_acc") == [(7, 0.7)]
    # metrics.jsonl keeps every row; its readers see what TensorBoard shows.
    rows = metrics.latest_per_step(metrics.read(tmp_path / "metrics.jsonl"))
    assert [(r["step"], r["loss"]) for r in rows if r["event"] == "train"] == series(acc, "train/loss")
    assert [(r["step"], r["test_acc"]) for r in rows if r["event"] == "eval"] == series(acc, "eval/test_acc")


def test_the_trainer_continues_its_curves_after_a_resume(tmp_path):
    """The real trainer: snapshots at 4 and 8, the one at 8 lost, so the rerun redoes steps 5..8."""
    args = ["--dataset", "digits", "--model", "tiny", "--batch-size", "32", "--progress", "lines",
            "--log-every-steps", "2", "--save-every-steps", "4", "--run-dir", tmp_path]
    run_trainer([*args, "--max-steps", "8"], nproc=0)
    shutil.rmtree(tmp_path / "snapshots" / "step-00000008")
    next_second()
    run_trainer([*args, "--max-steps", "12"], nproc=0)
    rows = metrics.read(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows if r["event"] == "start"] == [0, 4]
    assert [r["step"] for r in rows if r["event"] == "train"] == [2, 4, 6, 8, 6, 8, 10, 12]
    acc = board(tmp_path)
    newest = [(r["step"], round(r["loss"], 4)) for r in metrics.latest_per_step(rows) if r["event"] == "train"]
    assert [s for s, _ in newest] == [2, 4, 6, 8, 10, 12]
    assert series(acc, "train/loss") == newest
