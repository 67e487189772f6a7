"""No endless restarts without progress (app/progress.py): what counts as progress, and the
bound kept in a file of starts by the container entrypoint and Slurm requeues."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from app import progress
from app.recovery.failures import EXIT_NO_PROGRESS
from tests.helpers import REPO, clean_env

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("steps, count", [([0], 0), ([0, 0, 0], 2), ([0, 5, 5], 1), ([5, 3], 1), ([3, 3, 8], 0)])
def test_restarts_without_progress_are_the_latest_starts_that_found_no_newer_step(steps, count):
    assert progress.restarts_without_progress(steps) == count


def test_progress_is_the_newest_snapshot_or_train_row_whichever_is_newer(tmp_path):
    snapshots = tmp_path / "snapshots"
    assert progress.committed_step(tmp_path, snapshots) == 0
    (snapshots / "step-00000004").mkdir(parents=True)
    (snapshots / ".tmp-step-00000009").mkdir()          # not committed
    assert progress.committed_step(tmp_path, snapshots) == 4
    row = {"event": "train", "time": 1.0, "step": 7, "epoch": 0.1, "loss": 1.0, "lr": 0.1, "test_acc": None,
           "images_per_s": None, "world_size": 1, "restart_count": 0}
    (tmp_path / "metrics.jsonl").write_text(json.dumps(row) + "\n")
    assert progress.committed_step(tmp_path, snapshots) == 7


def test_the_agent_bound_lets_restarts_through_while_the_step_moves():
    seen = iter([0, 2, 2, 2, 5, 5])
    bound = progress.RestartBound(1, lambda: next(seen))
    bound.restarting("a")                   # 0 -> 2
    bound.restarting("b")                   # 2 -> 2: one without progress
    with pytest.raises(progress.NoProgress, match="after 1 restarts in a row .* the last cause: c$"):
        bound.restarting("c")


def test_the_file_of_starts_ends_the_job_after_the_bound_with_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MAX_NO_PROGRESS_RESTARTS", "1")
    starts, run = tmp_path / "starts", ["--run-dir", str(tmp_path / "run")]
    assert progress.main([str(starts), "first", *run]) == 0
    assert progress.main([str(starts), "torchrun exited 1", *run]) == 0
    assert progress.main([str(starts), "torchrun exited 1", *run]) == EXIT_NO_PROGRESS
    assert capsys.readouterr().err == ("error: no newer committed step than 0 after 1 restarts in a row "
                                       "(MAX_NO_PROGRESS_RESTARTS=1): not restarting again; the last cause: "
                                       "torchrun exited 1\n")
    (tmp_path / "run" / "snapshots" / "step-00000003").mkdir(parents=True)
    assert progress.main([str(starts), "torchrun exited 1", *run]) == 0       # progress: counted afresh
    assert starts.read_text().split() == ["0", "0", "3"]


def test_a_file_of_starts_that_is_not_a_list_of_steps_is_one_line(tmp_path):
    starts = tmp_path / "starts"
    starts.write_text("3\nx\n")
    done = subprocess.run([sys.executable, "-m", "app.progress", str(starts), "torchrun exited 1",
                           "--run-dir", str(tmp_path / "run")], cwd=REPO, env=clean_env(), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr == f"error: {starts} is not a readable list of steps: invalid literal for int() with base 10: 'x'\n"
    assert starts.read_text() == "3\nx\n"        # left as it was
