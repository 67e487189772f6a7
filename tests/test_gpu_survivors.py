"""bench/gpu_survivors.py without a GPU. Its dry run (CPU, gloo, the digits job, every part at once:
about 40 s on this 2-core machine) is a step of the GPU report's, and tests/test_gpu_report.py checks
its figures there: the GPU script runs end to end where no GPU is, so that it works the first time it
meets one. What it cannot run here: NCCL itself, two NCCL_HOSTIDs on one GPU, torchft's fault
scenario (the same code as inplace's, with torchft's Lighthouse: bench/ft_modes.py's Job)."""
from __future__ import annotations

import pytest


@pytest.mark.unit
def test_without_a_gpu_and_without_dry_run_it_says_so_in_one_line(capsys):
    import torch

    from bench import gpu_survivors

    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    assert gpu_survivors.main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no GPU here") and err.count("\n") == 1
