"""The GPU report's dry run: every bench it runs on a GPU works here first, at toy sizes."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench.gpu_report import STEPS
from tests.helpers import REPO, clean_env

pytestmark = pytest.mark.multiprocess


def test_the_dry_run_runs_every_step_and_writes_the_json_and_the_table(tmp_path):
    done = subprocess.run([sys.executable, "-m", "bench.gpu_report", "--dry-run", "--out", tmp_path / "report"],
                          cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert [s["name"] for s in report["steps"]] == [s.name for s in STEPS] and all(s["ok"] for s in report["steps"])
    assert report["dry_run"] and report["machine"]["torch"]
    table = (tmp_path / "report.md").read_text()
    for step in STEPS:
        row = next(line for line in table.splitlines() if line.startswith(f"| {step.name} |"))
        assert "FAILED" not in row and f"`python3 -m {step.module} " in row
