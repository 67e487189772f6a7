"""bench/'s console lines, as a person reads them: figures rounded to what they mean (the JSON files
the benchmarks write keep every digit)."""
from __future__ import annotations

import argparse

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
    overhead.show(result, argparse.Namespace(save_every=100))
    line = [line for line in capsys.readouterr().out.splitlines() if line.startswith("GPU utilisation")][0]
    assert line.endswith("  bare 87%, trainer -"), line
    assert overhead.utilisation_shown(None) == "- (not readable here)"
