"""bench/gpu_survivors.py without a GPU. Its dry run (CPU, gloo, the digits job, every part at once:
about 40 s on this 2-core machine) is a step of the GPU report's, and tests/test_gpu_report.py checks
its figures there: the GPU script runs end to end where no GPU is, so that it works the first time it
meets one. What it cannot run here: NCCL itself, two NCCL_HOSTIDs on one GPU, torchft's fault
scenario (the same code as inplace's, with torchft's Lighthouse: bench/ft_modes.py's Job)."""
from __future__ import annotations

import time
import types

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


@pytest.mark.unit
def test_a_short_stall_is_not_met_when_the_survivors_process_was_started_again():
    """The H200 run of 8467e1f read a stall of 0.06 s (a row of a step that ended before the kill was
    noticed) and called it met, beside a survivor whose process had left at INPLACE_GROUP_BOUND."""
    from bench.gpu_survivors import verdict

    result = {"faults": {"inplace": {"ft_backend": "nccl", "kill": {"stall_s": 0.06, "survivor_restarted": True,
                                                                    "survivor_said": ["error: ..."]},
                                     "freeze": {"drop_s": 1.5}},
                         "inplace nonblocking": {"ft_backend": "nccl", "kill": {"stall_s": 1.2, "survivor_restarted": False},
                                                 "freeze": {"drop_s": 1.6},
                                                 "survivor_warned": ["warning: ending inplace-1's NCCL group did not return"]},
                         "torchft": {"skipped": "torchft is not installed in this Python"}},
              "generations": {"generations": 50, "flat": True, "backend": "nccl"}}
    lines = verdict(result)
    assert lines[0] == "inplace: survivors' stall after a kill: 0.06 s (NOT met: target <= 2 s, nccl)", lines
    assert "inplace nonblocking: survivors' stall after a kill: 1.2 s (met: target <= 2 s, nccl)" in lines
    assert "inplace nonblocking: the survivor said: warning: ending inplace-1's NCCL group did not return" in lines


@pytest.mark.unit
def test_the_communicators_are_named_and_the_first_is_the_inplace_row(capsys):
    from bench.gpu_survivors import fault_label, parse

    args = parse(["--communicators", "blocking,nonblocking"])
    assert [fault_label(c, args.communicators) for c in args.communicators] == ["inplace", "inplace nonblocking"]
    with pytest.raises(SystemExit):
        parse(["--communicators", "babynccl"])
    assert "--communicators takes blocking, nonblocking, got babynccl" in capsys.readouterr().err


@pytest.mark.unit
def test_a_kills_stall_runs_to_the_survivors_first_row_alone(monkeypatch):
    """Rows come as they are written: both nodes until the kill, one more of a step that ended as the
    kill came (0.06 s after), then the survivor alone 1 s after. The stall is 0.94 s; the first row
    after the kill gave 0.11 s (the H200 run of 8467e1f read 0.06 s beside a survivor that had left)."""
    from bench import ft_modes

    class Killed:
        world = 2

        def __init__(self) -> None:
            self.nodes, self._rows = [types.SimpleNamespace(pid=0)] * 2, []

        def kill(self, i: int) -> None:
            t = time.time()
            self._rows = [{"time": t + dt, "step": step, "world_size": size} for dt, step, size in
                          ((-0.1, 8, 2), (-0.05, 9, 2), (0.06, 10, 2), (1.0, 10, 1), (1.1, 11, 1))]

        def rows(self) -> list[dict]:
            return [r for r in self._rows if r["time"] <= time.time()]

        def wait(self, condition, timeout: float):
            deadline = time.time() + timeout
            while time.time() < deadline:
                found = next((r for r in self.rows() if condition(r)), None)
                if found:
                    return found
                time.sleep(0.01)
            return None

        def start(self, i: int) -> None:
            return None

    monkeypatch.setattr(ft_modes, "_children", lambda pid: [])
    fault = ft_modes.one_fault(Killed(), 0.0, 2.0)
    assert fault["stall_s"] == pytest.approx(0.94, abs=0.02) and fault["lost_steps"] == 0, fault
