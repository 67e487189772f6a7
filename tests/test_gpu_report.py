"""The GPU report's dry run: every bench it runs on a GPU works here first, at toy sizes, the survivor
modes' (bench/gpu_survivors.py: CPU, gloo, the digits job, every part at once) among them."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench.gpu_report import BUDGET_S, OWN_S, STEPS
from tests.helpers import REPO, clean_env


@pytest.mark.multiprocess
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
    survivors = next(s["result"] for s in report["steps"] if s["command"].startswith("bench.gpu_survivors "))
    _the_survivor_parts_ran(survivors)
    assert "inplace: a frozen peer dropped" in table and "generations: memory and threads flat (gloo)" in table


def _the_survivor_parts_ran(result: dict) -> None:
    """What the GPU script's dry run must show: each part ran, in inplace mode on gloo."""
    faults = result["faults"]["inplace"]
    assert faults["ft_backend"] == "gloo" and faults["kill"]["back_s"] is not None, faults
    assert not faults["kill"]["survivor_restarted"] and faults["freeze"]["drop_s"] is not None, faults
    assert "skipped" in result["faults"]["torchft"]
    generations = result["generations"]
    assert (generations["backend"], generations["generations"], generations["flat"]) == ("gloo", 50, True), generations
    assert [r["mode"] for r in result["pace"]["runs"]] == ["elastic", "inplace"]
    assert all(r["steps_per_s"] for r in result["pace"]["runs"]), result["pace"]


@pytest.mark.unit
def test_the_steps_limits_add_up_to_the_reports_budget_of_10_minutes():
    """A GPU machine is lent for 15 minutes, its start included: the report must end in 10, leaving time
    to run a failed step again."""
    assert BUDGET_S == 600 and sum(step.limit_s for step in STEPS) + OWN_S <= BUDGET_S
    survivors = next(step for step in STEPS if step.module == "bench.gpu_survivors")
    budget = float(survivors.full[survivors.full.index("--budget") + 1])
    assert budget < survivors.limit_s, "it stops itself before the report stops it"


@pytest.mark.unit
def test_a_step_past_its_limit_is_stopped_with_every_process_it_started_and_says_where_they_were(tmp_path, monkeypatch):
    """On a GPU host a bench's jobs left running would hold the GPU through the steps after it; and a
    step stopped at its limit must say where it was (the first GPU run's four such steps said nothing)."""
    import time

    from bench import gpu_report

    step = gpu_report.Step("sleeper", "sleeper", "sleeper", [], [], limit_s=4)
    child = "from app.recovery import stacks; stacks.arm(); import time; time.sleep(60)"    # a trainer, armed
    sleeper = (f"import subprocess, sys, time; child = subprocess.Popen([sys.executable, '-c', {child!r}]); "
               "print(child.pid, flush=True); print('half way', file=sys.stderr, flush=True); time.sleep(60)")
    monkeypatch.setattr(gpu_report, "STEPS", [step])
    monkeypatch.setattr(gpu_report, "STOP_GRACE_S", 1)
    monkeypatch.setattr(gpu_report.Step, "command", lambda self, dry_run, out: [sys.executable, "-c", sleeper])
    started = time.monotonic()
    entry = gpu_report.run(step, False, tmp_path)     # a GPU run's limit (a dry run has room)
    assert time.monotonic() - started < step.limit_s + 3 and not entry["ok"], entry
    assert entry["why"] == "ran past its 4 s, after: half way", entry
    said = entry["tail"].splitlines()
    assert said[0] == "ran past its 4 s", said
    child_pid = int(said[1])
    assert "Current thread" in entry["tail"], "the bench's own stack (faulthandler on SIGABRT)"
    assert f"# rank 0 pid {child_pid}, asked by pid" in entry["tail"], "the armed child's stacks"
    deadline = time.monotonic() + 5
    while _alive(child_pid):
        assert time.monotonic() < deadline, "the step's child outlived it"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie waiting to be reaped does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False
