"""A worker killed under plain torchrun: the restarted worker group forms and the job finishes.

Launched exactly as a new user would (`torchrun --standalone ... --max-restarts=2`, nothing else
set), so the workers get the agent's shared TCPStore (TORCHELASTIC_USE_AGENT_STORE=True), whose
keys outlive every restart: the case where a restarted rank used to read its dead peer's
address and fail or hang in init_process_group.
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.helpers import (clean_env, finish, free_port, kill_all, read_metrics, run_trainer, start_trainer, wait_for,
                           worker_pids)

pytestmark = pytest.mark.multiprocess

KILL_AT_STEP = 10          # mid-epoch: 44 steps per epoch at world size 2 and --batch-size 16
EPOCHS = 1


def logged_step(run_dir: Path) -> int:
    if not (run_dir / "metrics.jsonl").exists():
        return 0
    return max((r["step"] for r in read_metrics(run_dir, "train")), default=0)


@pytest.mark.parametrize("rank", [1, 0])
def test_sigkilled_worker_under_plain_torchrun_restarts_and_finishes(tmp_path, rank):
    env = clean_env()
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)      # the agent shares its store, as by default
    args = ["--dataset", "digits", "--model", "tiny", "--progress", "lines", "--batch-size", 16,
            "--epochs", EPOCHS, "--save-every-steps", 1000, "--save-every-seconds", 0, "--log-every-steps", 1,
            "--run-dir", tmp_path]
    launcher = ["--standalone", "--nproc-per-node=2", "--max-restarts=2"]
    proc = start_trainer(args, env=env, launcher_args=launcher)
    try:
        wait_for(lambda: logged_step(tmp_path) >= KILL_AT_STEP, proc, timeout=60, what=f"step {KILL_AT_STEP}")
        workers = worker_pids(proc.pid)
        assert sorted(workers) == [0, 1], workers
        os.kill(workers[rank], signal.SIGKILL)
        killed_at = time.monotonic()
        result = finish(proc, timeout=90)
    finally:
        kill_all(proc)
    assert result.returncode == 0, f"--- stdout\n{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-3000:]}"
    assert "connectFullMesh" not in result.stderr
    starts = [(r["restart_count"], r["world_size"]) for r in read_metrics(tmp_path, "start")]
    assert starts == [(0, 2), (1, 2)], starts                     # one restart was enough
    evals = read_metrics(tmp_path, "eval")
    assert evals and evals[-1]["epoch"] == float(EPOCHS)
    print(f"rank {rank} killed at step >= {KILL_AT_STEP}; job done {time.monotonic() - killed_at:.1f}s later")


def test_a_rank_that_finds_only_a_dead_group_says_so_within_the_collective_timeout(tmp_path):
    """The store holds the previous worker group's token and nobody answers: exit 1 with one error line."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    store.set("app/pg/token", "a-previous-group")
    env = clean_env(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(store.port), TORCHELASTIC_USE_AGENT_STORE="True")
    timeout = 3
    result = run_trainer(["--dataset", "digits", "--model", "tiny", "--collective-timeout", timeout,
                          "--heartbeat-timeout", 1,     # the fault policy: shorter than the collective timeout
                          "--run-dir", tmp_path], nproc=0, env=env, timeout=120, check=False)
    assert result.returncode == 1, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr[-3000:]
    assert f"did not form within {timeout}s" in errors[0] or "lost contact with another rank" in errors[0]
    assert store.get("app/pg/a-previous-group/hello/1")     # it did ask, and was not answered


def test_a_node_with_another_job_secret_is_refused_and_both_nodes_say_why(tmp_path):
    """Two one-process nodes (each its node's local rank 0) with different JOB_SECRETs: each ends with one
    error line, the refused one too (its rank is not 0, which used to keep it silent). The refused node's
    input is bad (exit 2: its launcher stops); the refusing side's is not (exit 1: its launcher restarts
    the group without the stranger, so a stranger cannot stop a job)."""
    env = dict(WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()))
    nodes = [start_trainer(["--dataset", "digits", "--model", "tiny", "--run-dir", tmp_path / f"node{rank}"], nproc=0,
                           env=clean_env(**env, RANK=str(rank), JOB_SECRET=secret))
             for rank, secret in ((0, "ours"), (1, "theirs"))]
    ours, theirs = [finish(node, timeout=120) for node in nodes]
    assert (ours.returncode, theirs.returncode) == (1, 2), ours.stderr[-2000:] + theirs.stderr[-2000:]
    assert ours.stderr.splitlines() == ["error: refused rank 1: it does not share this node's job secret (JOB_SECRET); "
                                        "the group was not formed and nothing was sent to it"]
    assert theirs.stderr.splitlines() == ["error: rank 0 refused this node: they do not share the job's secret "
                                          "(JOB_SECRET); nothing was sent"]
