"""The goodput account (app/reporting/goodput.py): a life's phases add up to its wall time, the job's sum over
its lives with the time no process was up, lost work after a resume, and the done line's fraction."""
from __future__ import annotations

import shutil
import time

import pytest

from app.reporting import goodput
from app.reporting.goodput import Account, job_account
from app.training.snapshot import complete_snapshots
from tests.helpers import read_metrics, run_trainer

pytestmark = pytest.mark.unit


def test_a_lives_parts_add_up_to_its_wall_time_with_each_second_in_the_phase_it_was_spent():
    account = Account(time.time() - 0.2, startup_s=0.2)
    account.switch("train")
    time.sleep(0.05)
    with account.phase("eval"):
        time.sleep(0.1)
    assert account.current == "train"           # back to the phase that was open
    time.sleep(0.05)
    account.switch(None)
    row = account.row()
    parts = row["parts_s"]
    assert sum(parts.values()) == pytest.approx(row["wall_s"], abs=0.005)
    assert parts["startup"] == pytest.approx(0.2, abs=0.005)
    assert parts["eval"] == pytest.approx(0.1, abs=0.03)
    assert parts["train"] == pytest.approx(0.1, abs=0.03)
    assert 0 <= parts["other"] < 0.03


def test_a_fault_found_now_counts_from_the_last_step_boundary_never_before_the_previous_edge():
    account = Account(time.time(), startup_s=0.0)
    account.switch("train")
    boundary = time.perf_counter()
    time.sleep(0.1)                             # the step in flight when the peer hung
    account.switch("peer_wait", since=boundary)
    account.switch(None)
    assert account.seconds["peer_wait"] == pytest.approx(0.1, abs=0.03)
    assert account.seconds["train"] < 0.03
    account.switch("eval", since=boundary)      # before the last edge: clamped to it
    assert account.seconds["peer_wait"] == pytest.approx(0.1, abs=0.03)


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
