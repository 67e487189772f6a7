"""bench/gpu_survivors.py's dry run (CPU, gloo, the digits job, every part at once: about 40 s on this
2-core machine): the GPU script runs end to end where no GPU is, so that it works the first time it
meets one. What it cannot run here: NCCL itself, two NCCL_HOSTIDs on one GPU, torchft's fault
scenario (the same code as inplace's, with torchft's Lighthouse: bench/ft_modes.py's Job)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import REPO, clean_env


@pytest.mark.multiprocess
def test_the_gpu_survivors_script_runs_its_parts_on_cpu(tmp_path):
    out = tmp_path / "gpu_survivors.json"
    done = subprocess.run([sys.executable, "-m", "bench.gpu_survivors", "--dry-run", "--out", str(out)], cwd=REPO,
                          env=clean_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    faults = result["faults"]["inplace"]
    assert faults["ft_backend"] == "gloo" and faults["kill"]["back_s"] is not None, faults
    assert not faults["kill"]["survivor_restarted"] and faults["freeze"]["drop_s"] is not None, faults
    assert "skipped" in result["faults"]["torchft"]
    generations = result["generations"]
    assert (generations["backend"], generations["generations"], generations["flat"]) == ("gloo", 50, True), generations
    assert [r["mode"] for r in result["pace"]["runs"]] == ["elastic", "inplace"]
    assert all(r["steps_per_s"] for r in result["pace"]["runs"]), result["pace"]
    assert "| inplace | gloo |" in out.with_suffix(".md").read_text()


@pytest.mark.unit
def test_without_a_gpu_and_without_dry_run_it_says_so_in_one_line(capsys):
    import torch

    from bench import gpu_survivors

    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    assert gpu_survivors.main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no GPU here") and err.count("\n") == 1
