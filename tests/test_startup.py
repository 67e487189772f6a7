"""Where a start's seconds go (app/reporting/startup.py): the start row's phases, from the exec on."""
from __future__ import annotations

import time

import pytest

from app.reporting.startup import StartupClock
from bench.launch_times import summarise
from tests.helpers import read_metrics, run_trainer

pytestmark = pytest.mark.unit

# app/train.py's and app/job/'s phases, in the order a start passes them.
PHASES = ["interpreter", "config", "torch", "imports", "process_group", "data", "device", "dynamo", "model", "snapshot"]


def test_marks_made_before_the_clock_come_first_and_the_phases_run_on_from_the_exec():
    loaded = time.time() - 0.2
    clock = StartupClock([("loaded", loaded)])
    before = time.time()
    clock.mark("later")
    after = time.time()
    seconds = clock.seconds()
    assert list(seconds) == ["loaded", "later"]
    assert seconds["loaded"] == pytest.approx(loaded - clock.started, abs=0.001)
    assert before - loaded - 0.001 <= seconds["later"] <= after - loaded + 0.001     # from the mark before it


def test_the_start_row_splits_every_second_from_the_exec_to_the_row(synthetic_data, tmp_path):
    """The phases come in the order they happen, none negative, and add up to the start row's time
    after the exec: no second of a start is left out of them."""
    run_trainer(["--dataset", "synthetic", "--data-dir", synthetic_data, "--model", "tiny", "--progress", "lines",
                 "--batch-size", 16, "--epochs", 1, "--max-steps", 1, "--run-dir", tmp_path], nproc=0)
    (start,) = read_metrics(tmp_path, "start")
    phases = start["startup_s"]
    assert list(phases) == PHASES and min(phases.values()) >= 0, phases
    # The importing phases hold the start's bulk; the row follows its last phase at once.
    assert phases["torch"] > phases["interpreter"] and phases["torch"] > phases["imports"], phases
    assert sum(phases.values()) == pytest.approx(start["time"] - start["process_started"], abs=0.1), start


def test_the_launch_bench_reports_medians_and_none_where_a_run_never_trained():
    """bench.launch_times --repeats: each figure's median beside its runs; a run without a first
    step (None, and so no kill figure) leaves that line's figures unknown instead of a median of the rest."""
    assert summarise([{"start_s": 3.0}, {"start_s": 1.0}, {"start_s": 2.5}]) == {
        "start_s": 2.5, "start_runs_s": [3.0, 1.0, 2.5]}
    phased = summarise([{"start_s": 3.0, "phases": {"torch": 1.0, "first_step": 2.0}},
                        {"start_s": 1.0, "phases": {"torch": 3.0, "first_step": 0.5}}, {"start_s": None}])
    assert phased["phases_s"] == {"torch": 2.0, "first_step": 1.25} and "phases" not in phased
    failed = summarise([{"start_s": None}, {"start_s": 2.0, "kill_to_training_s": 1.5}])
    assert failed["start_s"] is None and failed["kill_to_training_s"] is None
    assert failed["kill_to_training_runs_s"] == [None, 1.5]


def test_the_launch_bench_kills_a_training_process_never_its_saver():
    """`python -m app.train`'s one child is its snapshot saver: killing it measured 'kill to training
    0.01 s' for a line with nothing to restart it. A launcher's worker is killed; a saver, never."""
    import subprocess
    import sys

    from bench.launch_times import _argv, _victim

    child = "import time; time.sleep(30)"
    parent = (f"import subprocess, sys, time; kids = [subprocess.Popen([sys.executable, '-c', {child!r}, *a]) "
              "for a in (['-m', 'app.train'], ['-m', 'app.training.saver'])]; print(flush=True); time.sleep(30)")
    lone = (f"import subprocess, sys, time; kid = subprocess.Popen([sys.executable, '-c', {child!r}, '-m', "
            "'app.training.saver']); print(flush=True); time.sleep(30)")
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) for code in (parent, lone)]
    try:
        for proc in procs:
            proc.stdout.readline()      # its children started
        victim = _victim(procs[:1])
        assert victim is not None and "app.train" in _argv(victim)
        assert _victim(procs[1:]) is None, "a saver is no worker"
    finally:
        for proc in procs:
            subprocess.run(["pkill", "-KILL", "-P", str(proc.pid)])
            proc.kill()
            proc.wait()
