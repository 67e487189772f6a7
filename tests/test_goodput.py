"""The goodput account (app/reporting/goodput.py): a life's phases add up to its wall time, the job's sum over
its lives with the time no process was up, lost work after a resume, and the done line's fraction."""
from __future__ import annotations

import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from app.reporting import goodput
from app.reporting.goodput import Account, job_account
from app.reporting.metrics import Reporter, read
from app.training.snapshot import complete_snapshots
from tests.helpers import REPO, read_metrics, run_trainer

pytestmark = pytest.mark.unit


class _Clock:
    """A perf_counter the test moves: each phase lasts exactly what the test says, however loaded the machine."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_a_lives_parts_add_up_to_its_wall_time_with_each_second_in_the_phase_it_was_spent():
    clock = _Clock()
    account = Account(time.time() - 0.2, startup_s=0.2, clock=clock)
    account.switch("train")
    clock.sleep(0.05)
    with account.phase("eval"):
        clock.sleep(0.1)
    assert account.current == "train"           # back to the phase that was open
    clock.sleep(0.05)
    account.switch(None)
    clock.sleep(0.02)                           # untracked: left to `other`
    row = account.row()
    parts = row["parts_s"]
    assert row["wall_s"] == pytest.approx(0.42) and sum(parts.values()) == pytest.approx(row["wall_s"])
    assert (parts["startup"], parts["eval"], parts["train"], parts["other"]) == pytest.approx((0.2, 0.1, 0.1, 0.02))


def test_a_fault_found_now_counts_from_the_last_step_boundary_never_before_the_previous_edge():
    clock = _Clock()
    account = Account(time.time(), startup_s=0.0, clock=clock)
    account.switch("train")
    boundary = clock()
    clock.sleep(0.1)                            # the step in flight when the peer hung
    account.switch("detection", since=boundary)
    account.switch(None)
    assert (account.seconds["detection"], account.seconds["train"]) == pytest.approx((0.1, 0.0))
    account.switch("eval", since=boundary)      # before the last edge: clamped to it
    assert account.seconds["detection"] == pytest.approx(0.1)
    clock.sleep(0.3)
    account.switch("train", since=clock() + 5)  # a boundary not yet reached: now
    assert account.seconds["eval"] == pytest.approx(0.3)


def test_a_step_not_committed_is_its_compute_redone_and_its_wait_at_the_all_reduce_detection():
    """A survivor mode's step whose all-reduce failed: the forward and backward are lost work, the wait
    for the peer that failed is what finding the failure took (app/ft/trainer.py)."""
    from types import SimpleNamespace

    import torch

    from app.ft.trainer import FtTrainer
    from app.training.step_time import StepClock

    account = Account(time.time(), startup_s=0.0)
    account.switch("train")
    trainer = SimpleNamespace(
        state=SimpleNamespace(step=3, schedule=SimpleNamespace(set_progress=lambda progress: None),
                              progress=lambda: 0.0, params=[], float_buffers=[], undo_statistics=lambda: None),
        steps=SimpleNamespace(accumulate=lambda indices, augmentation: time.sleep(0.02),
                              clock=StepClock(torch.device("cpu")),
                              optimizer=SimpleNamespace(zero_grad=lambda set_to_none: None)),
        replica=SimpleNamespace(average_gradients=lambda params, buffers: time.sleep(0.3), commit=lambda: False,
                                check_secret=lambda warn: None, errored="peer gone"),
        goodput=account, guard=SimpleNamespace(take_stacks=lambda why: None),
        report=SimpleNamespace(warn=lambda line: None), _uncommitted=0, _stacks_step=None)
    assert FtTrainer._step(trainer, torch.zeros(2), (), 2) is False
    account.switch(None)
    assert account.seconds["detection"] >= 0.3 and 0.02 <= account.seconds["redo"] < account.seconds["detection"]
    assert account.seconds["train"] < 0.3


def _life(start: float, wall: float, **parts: float) -> list[dict]:
    """A start row and the goodput row of one life that began at `start`."""
    return [{"event": "start", "time": start + parts.get("startup", 0), "step": 0, "process_started": start},
            {"event": "train", "time": start + wall - 1, "step": 5},
            {"event": "goodput", "time": start + wall, "step": 5, "life_started": start, "wall_s": wall,
             "parts_s": {**dict.fromkeys(goodput.PHASES, 0.0), "other": 0.0, **parts}}]


def test_the_job_sums_its_lives_and_counts_the_gaps_between_them_as_down_time():
    rows = _life(100.0, 50.0, startup=10.0, train=40.0) + _life(160.0, 30.0, startup=5.0, train=20.0, redo=5.0)
    account = job_account(rows)
    assert account["wall_s"] == 90.0 and account["lives"] == 2
    assert account["parts_s"]["down"] == 10.0            # 150 -> 160: no process up
    assert account["parts_s"]["redo"] == 5.0
    assert sum(account["parts_s"].values()) == pytest.approx(account["wall_s"])
    assert account["goodput"] == pytest.approx(60 / 90, abs=1e-4)
    assert account["largest_badput"] == ("startup", 15.0)
    assert goodput.describe(account) == "goodput 0.67 of 90.0 s (2 lives); largest badput startup 15.0 s"


def test_a_killed_life_without_its_row_counts_from_its_start_to_its_last_row_as_unrecorded():
    killed = [{"event": "start", "time": 104.0, "step": 0, "process_started": 100.0},
              {"event": "train", "time": 120.0, "step": 10}]
    rows = killed + _life(130.0, 20.0, startup=4.0, train=16.0)
    account = job_account(rows)
    assert account["parts_s"]["unrecorded"] == 20.0      # 100 -> 120
    assert account["parts_s"]["down"] == 10.0            # 120 -> 130
    assert account["wall_s"] == 50.0
    assert account["goodput"] == pytest.approx(16 / 50, abs=1e-4)


def test_a_killed_life_counts_its_own_rows_only_where_another_life_writes_between_them():
    """The survivor modes: every node's rank 0 writes its start and goodput rows into one run directory,
    so the rows after a life's start row are not all its own."""
    rows = [{"event": "start", "time": 104.0, "step": 0, "process_started": 100.0, "life": "a"},
            {"event": "start", "time": 105.0, "step": 0, "process_started": 101.0, "life": "b"},
            {"event": "train", "time": 110.0, "step": 10, "life": "a"},
            {"event": "train", "time": 140.0, "step": 40, "life": "b"},
            {"event": "goodput", "time": 141.0, "step": 40, "life_started": 101.0, "wall_s": 40.0, "life": "b",
             "parts_s": {**dict.fromkeys(goodput.PHASES, 0.0), "other": 0.0, "startup": 4.0, "train": 36.0}}]
    account = job_account(rows)
    assert account["lives"] == 2 and account["parts_s"]["unrecorded"] == 10.0     # a: 100 -> its last row, 110


class _Life:
    """One life of a run directory as the trainer's Reporter writes it: its start row now, its goodput
    row when it ends; its mark held while the object is open."""

    def __init__(self, run_dir: Path, train_s: float) -> None:
        self.report, self.started, self.train_s = Reporter(run_dir, True, "lines"), time.time() - train_s, train_s
        self.report.record("start", step=0, process_started=round(self.started, 3))

    def end(self) -> None:
        self.report.record("goodput", step=10, life_started=round(self.started, 3), wall_s=self.train_s,
                           parts_s={**dict.fromkeys(goodput.PHASES, 0.0), "other": 0.0, "train": self.train_s})


def test_a_life_still_running_is_waited_for_and_then_counted_never_taken_for_killed(tmp_path):
    """The first node to finish reads the run before the other has written its goodput row: that one runs
    on (its mark held) and is waited for; once its row is there, both lives count."""
    first, other = _Life(tmp_path, 10.0), _Life(tmp_path, 10.0)
    first.end()
    later = threading.Timer(0.3, other.end)
    later.start()
    began = time.monotonic()
    account = first.report.job_account()
    assert time.monotonic() - began >= 0.25, "it did not wait for the life that still ran"
    assert (account["lives"], account["running"], account["parts_s"]["unrecorded"]) == (2, 0, 0.0), account
    assert account["goodput"] == pytest.approx(job_account(read(tmp_path / "metrics.jsonl"))["goodput"])
    for life in (first, other):
        life.report.close()


def test_a_life_that_ends_between_the_read_and_its_marks_check_is_counted_with_its_row(tmp_path, monkeypatch):
    """The order CI met: the first node read the rows, then the other wrote its goodput row and ended (its
    mark fell) before the marks were checked; the account took that life for one killed without its row."""
    first, other = _Life(tmp_path, 10.0), _Life(tmp_path, 10.0)
    first.end()
    check, ended = goodput.running, []

    def other_ends_first(run_dir: Path, names: list[str]) -> list[str]:
        if not ended:
            other.end()
            other.report.close()
            ended.append(other)
        return check(run_dir, names)

    monkeypatch.setattr(goodput, "running", other_ends_first)
    account = first.report.job_account(wait_s=0.2)
    assert (account["lives"], account["running"], account["parts_s"]["unrecorded"]) == (2, 0, 0.0), account
    first.report.close()


def other_node(run_dir: str, ends: str) -> None:
    """Another node's life, in a process of its own: its start row, a line on stdout, then (ends="after") its
    goodput row a second after the run directory's first one, or (ends="never") nothing until it is killed."""
    life = _Life(Path(run_dir), 10.0)
    print(flush=True)
    while ends == "after" and not read_metrics(run_dir, "goodput"):
        time.sleep(0.05)
    time.sleep(1.0 if ends == "after" else 60.0)
    life.end()


def _start_other_node(run_dir: Path, ends: str) -> subprocess.Popen:
    other = subprocess.Popen([sys.executable, "-c", f"from tests.test_goodput import other_node; "
                              f"other_node({str(run_dir)!r}, {ends!r})"], cwd=REPO, stdout=subprocess.PIPE, text=True)
    other.stdout.readline()         # its start row written, its mark held
    return other


def test_a_life_that_runs_past_the_wait_is_said_and_left_out_and_one_killed_without_its_row_counts_as_killed(
        tmp_path):
    first = _Life(tmp_path, 10.0)
    first.end()
    other = _start_other_node(tmp_path, "never")
    try:
        account = first.report.job_account(wait_s=0.2)
        assert (account["lives"], account["running"], account["parts_s"]["unrecorded"]) == (1, 1, 0.0), account
        assert goodput.describe(account).startswith(f"goodput {account['goodput']:.2f} of 10.0 s "
                                                    "(1 life, 1 more running: not counted)")
    finally:
        other.kill()                    # gone without its row, its mark left behind unlocked
        other.wait()
    account = first.report.job_account(wait_s=0.2)
    assert (account["lives"], account["running"]) == (2, 0) and account["parts_s"]["unrecorded"] > 0, account
    first.report.close()


def test_the_done_line_of_the_node_that_ends_first_counts_the_other_life_once_it_has_ended(tmp_path):
    """The issue's job: the first node to end read the run before the other wrote its goodput row, and took
    that live node for a life killed before it could write ("largest badput unrecorded")."""
    other = _start_other_node(tmp_path, "after")
    done = run_trainer(["--dataset", "digits", "--epochs", 1, "--progress", "lines", "--run-dir", tmp_path], nproc=0)
    other.wait(timeout=30)
    line = [line for line in done.stdout.splitlines() if line.startswith("done:")][-1]
    account = job_account(read_metrics(tmp_path))
    assert account["lives"] == 2 and account["parts_s"]["unrecorded"] == 0, account
    assert line.endswith(goodput.describe(account)), line


def test_no_life_says_so_in_the_done_line():
    assert job_account([{"event": "train", "time": 1.0, "step": 1}]) is None
    assert goodput.describe(None) == "goodput unknown (no goodput rows)"


def test_steps_trained_again_after_a_resume_below_the_last_trained_step_are_lost_work(synthetic_data, tmp_path):
    """Steps 9-10 trained, the snapshot of 10 lost: the next life resumes at 8 and trains 9-10 again
    (redo), then the rest of the epoch (train); each life's row adds up, and the done line carries the
    job's fraction over both lives."""
    args = ["--dataset", "synthetic", "--data-dir", synthetic_data, "--model", "tiny", "--progress", "lines",
            "--batch-size", 16, "--epochs", 1, "--log-every-steps", 1, "--save-every-steps", 4,
            "--save-every-seconds", 0, "--keep", 100, "--run-dir", tmp_path]
    run_trainer([*args, "--max-steps", 10], nproc=0)
    shutil.rmtree(complete_snapshots(tmp_path / "snapshots")[0])     # step 10's
    done = run_trainer(args, nproc=0)
    assert read_metrics(tmp_path, "start")[-1]["step"] == 8
    first, second = read_metrics(tmp_path, "goodput")
    assert [r["ended"] for r in (first, second)] == ["done", "done"]
    for row in (first, second):
        assert sum(row["parts_s"].values()) == pytest.approx(row["wall_s"], abs=0.01)
        assert row["parts_s"]["other"] < 0.02 * row["wall_s"], row
    assert first["parts_s"]["redo"] == 0 and second["parts_s"]["redo"] > 0 and second["parts_s"]["train"] > 0
    account = job_account(read_metrics(tmp_path))
    assert account["lives"] == 2 and 0 < account["goodput"] < 1
    line = [line for line in done.stdout.splitlines() if line.startswith("done:")][-1]
    assert line.endswith(goodput.describe(account)), line
