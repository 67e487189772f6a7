"""app/recovery/failures.py: a lost peer told apart from a bug, and the line left for the launcher."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from app.recovery import failures
from tests.helpers import REPO, clean_env, free_port

# Two gloo processes; rank 1 dies after the first all-reduce; rank 0 reports how each later failure
# is classified: a plain all-reduce, DDP's gradient all-reduce inside backward, and a local bug.
_PEER = textwrap.dedent("""
    import json, os, sys, datetime, torch, torch.distributed as dist
    from app.recovery.failures import peer_lost
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=5))
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
    dist.all_reduce(torch.ones(8))
    if dist.get_rank() == 1:
        os._exit(9)
    seen = {}
    for name, fail in {"all_reduce": lambda: dist.all_reduce(torch.ones(8)),
                       "ddp_backward": lambda: model(torch.ones(3, 4)).sum().backward(),
                       "bug": lambda: torch.ones(2, 3) @ torch.ones(2, 3)}.items():
        try:
            fail()
            seen[name] = None
        except Exception as exc:
            seen[name] = [type(exc).__name__, peer_lost(exc)]
    print(json.dumps(seen), flush=True)
    os._exit(0)
""")


@pytest.mark.multiprocess
def test_a_dead_gloo_peer_is_a_lost_peer_and_a_bug_is_not():
    """Pins the torch behaviour the adapter relies on: gloo reports a dead peer as a RuntimeError
    naming its own source file, whether the collective is ours or DDP's."""
    env = clean_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2")
    procs = [subprocess.Popen([sys.executable, "-c", _PEER], cwd=REPO, env={**env, "RANK": str(rank)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    out, err = procs[0].communicate(timeout=120)
    procs[1].wait(timeout=30)
    seen = json.loads(out.strip().splitlines()[-1]) if out.strip() else pytest.fail(f"rank 0 said nothing:\n{err}")
    assert seen["all_reduce"][1] is True, seen
    assert seen["ddp_backward"][1] is True, seen
    assert seen["bug"] == ["RuntimeError", False], seen


@pytest.mark.unit
def test_typed_distributed_errors_are_lost_peers_and_other_errors_are_not():
    assert failures.peer_lost(torch.distributed.DistNetworkError("store gone"))
    assert failures.peer_lost(torch.distributed.DistStoreError("timed out"))
    assert not failures.peer_lost(RuntimeError("CUDA out of memory. Tried to allocate 2 GiB (gloo was mentioned)"))
    assert not failures.peer_lost(ValueError("[x/gloo/y.cc:1] not a runtime error"))


@pytest.mark.unit
def test_a_collective_that_ran_out_its_timeout_is_told_from_a_peer_that_went():
    """The first leaves the stacks of a hang (app/recovery/guard.py); the second is a plain loss."""
    assert failures.timed_out(RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] "
                                           "Timed out waiting 30000ms for recv operation to complete"))
    assert failures.timed_out(torch.distributed.DistBackendError("Watchdog caught collective operation timeout"))
    assert not failures.timed_out(RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] "
                                               "Connection closed by peer [127.0.0.1]:4242"))


@pytest.mark.unit
def test_the_launcher_gets_the_line_in_torchs_error_file_format(tmp_path, monkeypatch):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    failures.tell_launcher("error: no dataset under /nowhere")
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=2, error_file=str(path))
    assert failure.message == "error: no dataset under /nowhere"


# Two gloo ranks train a few DDP steps with torch._dynamo imported (as a fused or foreach optimizer
# does), then end either through the interpreter's finalization or through failures.exit_process.
_EXIT = textwrap.dedent("""
    import importlib, os, sys, torch, torch.distributed as dist
    importlib.import_module("torch._dynamo")
    dist.init_process_group("gloo")
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 10))
    for _ in range(50):
        model(torch.randn(32, 64)).sum().backward()
    dist.destroy_process_group()
    if sys.argv[1] == "exit_process":
        from app.recovery.failures import exit_process
        exit_process(0)
""")


def _exit_statuses(how: str, runs: int) -> list[int]:
    statuses = []
    for _ in range(runs):
        env = clean_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2", OMP_NUM_THREADS="1")
        ranks = [subprocess.Popen([sys.executable, "-c", _EXIT, how], cwd=REPO, env={**env, "RANK": str(r)},
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for r in (0, 1)]
        statuses += [rank.wait(timeout=120) for rank in ranks]
    return statuses


@pytest.mark.multiprocess
def test_a_finished_ddp_rank_aborts_in_finalization_unless_it_exits_at_once():
    """The torch behaviour exit_process works around (torch 2.14.1): an orderly end aborts some runs
    (-6, SIGABRT, from a gloo worker thread); exit_process never does."""
    assert -6 in _exit_statuses("finalize", 6), "torch no longer aborts here: exit_process may be dropped"
    assert set(_exit_statuses("exit_process", 6)) == {0}
