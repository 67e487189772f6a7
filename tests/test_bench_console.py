"""bench/'s console lines, as a person reads them: figures rounded to what they mean (the JSON files
the benchmarks write keep every digit); and which steps bench.overhead times in each loop."""
from __future__ import annotations

import argparse
import json

import pytest

from bench import overhead

pytestmark = pytest.mark.unit


def test_the_overhead_table_gives_gpu_utilisation_in_whole_percent(capsys):
    """It printed the dict as Python writes it: {'bare': 87.33333333333333, 'trainer': None}."""
    result = {"ratio_interval_90": [0.6, 0.7], "bare_loop": {"compiled": False}, "bare_images_per_s": 53587.2,
              "trainer_images_per_s": 30463.4, "trainer_images_per_s_per_process": 30463.4, "ratio": 0.631,
              "overhead_pct": 36.9, "ratio_min": 0.568, "ratio_max": 0.644, "snapshot_stall_s": None,
              "peak_memory_mb": {"what": "max RSS", "bare": 902.3, "trainer": 924.1},
              "gpu_utilisation_pct": {"bare": 262 / 3, "trainer": None}}
    overhead.show(result, argparse.Namespace(save_every=100, calibrate=False))
    line = [line for line in capsys.readouterr().out.splitlines() if line.startswith("GPU utilisation")][0]
    assert line.endswith("  bare 87%, trainer -"), line
    assert overhead.utilisation_shown(None) == "- (not readable here)"


def test_the_trainer_is_timed_over_the_same_steps_as_the_bare_loop():
    """Its train row at step s covers the log interval before s: with --warmup-steps 5 and rows every 10
    the row at step 10 held the first steps and the start-up, which the bare loop's clock leaves out
    (issue 35's 0.956 was read that way). Both now warm up 10 steps and time the 40 after them."""
    args = argparse.Namespace(warmup_steps=5, log_every=10, steps=40)
    assert overhead.warm_up(args) == 10
    rows = [{"event": "start", "step": 0}] + [{"event": "train", "step": s} for s in range(10, 60, 10)]
    assert [r["step"] for r in overhead.timed_rows(rows, 10, 40, 10)] == [20, 30, 40, 50]
    with pytest.raises(SystemExit, match="cover steps \\[20, 30\\]"):
        overhead.timed_rows(rows[:4], 10, 40, 10)


def test_timed_steps_that_are_not_whole_log_intervals_are_refused(capsys):
    with pytest.raises(SystemExit) as exit_:
        overhead.main(["--steps", "45", "--log-every", "10"])
    assert exit_.value.code == 2 and "error: --steps (45) must be a multiple of --log-every (10)" in capsys.readouterr().err


def test_calibrate_runs_the_bare_loop_on_both_sides_of_every_pair(tmp_path, monkeypatch, capsys):
    """The ratio's spread when nothing differs: what a trainer/bare ratio on the same machine can resolve."""
    paces = iter([50.0, 49.0, 52.0, 51.0])
    monkeypatch.setattr(overhead, "bare", lambda *a: {"bare_images_per_s": next(paces), "peak_memory_mb": 900.0})
    monkeypatch.setattr(overhead, "trainer", lambda *a: pytest.fail("the trainer ran"))
    overhead.main(["--calibrate", "--repeats", "2", "--train-images", "64", "--out", str(tmp_path / "r.json")])
    result = json.loads((tmp_path / "r.json").read_text())
    # pair 1: bare 50, then its twin 49; pair 2 in the other order: the twin 52, then bare 51
    assert result["runs"] == {"trainer_images_per_s": [49.0, 52.0], "bare_images_per_s": [50.0, 51.0]}
    assert result["config"]["calibrate"] is True and result["snapshot_stall_s"] is None
    out = capsys.readouterr().out
    assert "bare loop again" in out and "ratio bare again/bare" in out


def test_the_store_scale_benchmark_runs_the_watch_of_today(tmp_path):
    """bench.store_scale drives app/ft/inplace.py's Watch from outside; it fell behind a rename of
    InPlaceGroup's members and crashed in every worker. Four members for a second: every round counted,
    and the frozen member seen by all three others."""
    import subprocess
    import sys

    from tests.helpers import REPO, clean_env

    out = tmp_path / "scale.json"
    subprocess.run([sys.executable, "-m", "bench.store_scale", "--members", "4", "--seconds", "1",
                    "--processes", "1", "--out", str(out)], cwd=REPO, env=clean_env(), check=True,
                   capture_output=True, text=True, timeout=120)
    (row,) = json.loads(out.read_text())["new"]["measured"]
    assert row["members"] == 4 and row["rounds_per_member_s"] > 0 and row["generation_ended_before_the_freeze"] == 0
    assert row["hung_member_seen_by_all_s"] is not None, row
