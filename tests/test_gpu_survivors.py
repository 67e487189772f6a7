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


@pytest.mark.unit
def test_a_survivor_started_again_is_reported_with_its_nodes_error_line():
    """The first H200 run: after a kill the survivor's process was started again (stall 32.6 s) and
    the report could not say why. Its node's first `error:` line goes into the verdict now."""
    from bench.gpu_survivors import verdict

    said = "error: aborting an NCCL group did not return within 20 s (INPLACE_GROUP_BOUND); ..."
    result = {"faults": {"inplace": {"ft_backend": "nccl", "kill": {"stall_s": 32.6, "survivor_restarted": True,
                                                                    "survivor_said": [said]},
                                     "freeze": {"drop_s": 1.85}}},
              "generations": {"generations": 20, "flat": True, "backend": "nccl"}}
    lines = verdict(result)
    assert lines[0] == "inplace: survivors' stall after a kill: 32.6 s (NOT met: target <= 2 s, nccl)"
    assert f"inplace: the survivor's process was started again after the kill: {said}" in lines


@pytest.mark.unit
def test_a_nodes_error_lines_are_its_first_three(tmp_path):
    from bench.ft_modes import Job

    job = Job.__new__(Job)          # its files alone: no processes
    job.tmp = tmp_path
    (tmp_path / "node0.err").write_text("[rank0] starting\nerror: one\nTraceback\nerror: two\nerror: three\nerror: four\n")
    assert job.said(0) == ["error: one", "error: two", "error: three"] and job.said(1) == []
