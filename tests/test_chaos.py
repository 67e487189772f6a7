"""A bounded chaos run in containers: three faults with a fixed seed.

It fails only when a target is missed by a wide margin (the targets themselves are reported
by `make chaos`): a 2-core CI machine running four containers is slower and noisier than a
training cluster.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docker_helpers import ensure_engine

pytestmark = pytest.mark.docker

REPO = Path(__file__).resolve().parent.parent
SAVE_EVERY = 20


def test_three_faults_are_survived_within_wide_bounds(tmp_path):
    client, why = ensure_engine()
    if client is None:
        pytest.skip(why)
    out = tmp_path / "chaos"
    cmd = [sys.executable, "-m", "scripts.chaos", "--nodes", "2", "--faults", "3", "--seed", "3",
           "--epochs", "60", "--save-every", str(SAVE_EVERY), "--no-baseline", "--pause", "30",
           "--project", "ftt-chaos-test", "--port", "29441", "--run-name", "chaos-test", "--out", str(out)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1500)
    assert (out / "report.json").exists(), done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    summary = report["summary"]
    print(json.dumps(summary, indent=1))
    assert summary["runner_errors"] == []
    assert summary["completed"], "the job did not finish after the faults"
    assert summary["corrupt_snapshots"] == 0 and summary["valid_snapshots"] >= 1
    assert summary["unrecovered_faults"] == 0, report["faults"]
    assert summary["steps_lost_max"] <= SAVE_EVERY
    for fault in report["faults"]:      # targets: 10 s median recovery, 60 s for a hung node
        if fault["recovery_s"] is not None:
            assert fault["recovery_s"] < 90, fault
    for heal in report["heals"]:        # target: back within 20 s
        assert heal["rejoin_s"] is not None and heal["rejoin_s"] < 90, heal
    assert (out / "timeline.png").read_bytes()[:4] == b"\x89PNG"
