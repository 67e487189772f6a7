"""Inplace mode's end of a generation on NCCL (app/ft/groups.py, Ends), in whole training processes on
CPU: two nodes of one process each train on tests/nccl_double.py's double of ProcessGroupNCCL over gloo,
whose abort of generation 1 never returns. One is SIGKILLed: the survivor trains on in the same
process, the dead peer's group left in its end thread, said once past INPLACE_GROUP_BOUND. Before
Ends, the survivor's main thread waited in that abort and its process left at the bound (on the H200:
a 32.6 s stall, its node starting it again)."""
from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import REPO, clean_env, finish, free_port, kill_all, start_trainer, wait_for, worker_pids
from tests.nccl_double import NEVER_ENDS_ENV
from tests.survivors import LONG, MeetingPoint, train_rows, training_with

BOUND_S = 3     # INPLACE_GROUP_BOUND here: the old code's survivor left this long after the kill


def _node(i: int, tmp_path: Path, env: dict[str, str]) -> subprocess.Popen:
    """Node i, as tests/survivors.py's standalone_node, its output in files (a pipe nobody reads fills)."""
    out = open(tmp_path / f"node{i}.out", "a")
    return start_trainer(["--dataset", "digits", "--epochs", LONG, "--log-every-steps", 10,
                          "--run-dir", tmp_path / f"run{i}"], nproc=1, env={**env, "FT_REPLICA_ID": f"node{i}"},
                         launcher_args=["--standalone", "--nproc-per-node=1"], stdout=out, stderr=subprocess.STDOUT)


@pytest.mark.multiprocess
def test_the_survivor_of_a_kill_trains_on_in_its_process_while_the_dead_peers_group_never_ends(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(
        "import os\n"
        "if os.environ.get('LOCAL_RANK') is not None:     # a training process, not its launcher\n"
        "    import tests.nccl_double\n"
        "    tests.nccl_double.install()\n")
    port = free_port()
    store_env = clean_env(RDZV_PORT=str(port), LIGHTHOUSE_PORT=str(free_port()), RDZV_BIND="127.0.0.1",
                          RDZV_ID="test-job", TRAIN_FT="inplace", TRAIN_GROUP_STORE=f"127.0.0.1:{port}",
                          JOB_SECRET="test-secret")
    with MeetingPoint(["app.node", "store"], store_env, ready="TCPStore listening") as store:
        env = {**store.env, "PYTHONPATH": f"{tmp_path}:{REPO}", NEVER_ENDS_ENV: "inplace-1",
               "INPLACE_GROUP_BOUND": str(BOUND_S)}
        survivor, victim = _node(0, tmp_path, env), _node(1, tmp_path, env)
        run0 = tmp_path / "run0"
        try:
            wait_for(training_with(run0, 2), survivor, 180, "both nodes training")
            pids = worker_pids(survivor.pid)
            killed_at = time.time()
            kill_all(victim)
            wait_for(training_with(run0, 1, killed_at), survivor, 60, "the survivor training alone")
            past_bound = time.time() + BOUND_S + 2
            wait_for(lambda: bool(train_rows(run0, past_bound)), survivor, 60, "the survivor training past the bound")
            assert worker_pids(survivor.pid) == pids, "the survivor's worker was started again"
            kill_all(survivor, signal.SIGTERM)
            finish(survivor, 120)
        finally:
            for proc in (survivor, victim):
                kill_all(proc)
    said = (tmp_path / "node0.out").read_text()
    assert f"warning: ending inplace-1's NCCL group did not return within {BOUND_S} s (INPLACE_GROUP_BOUND)" in said, \
        said[-3000:]
    assert "error:" not in said, said[-3000:]
    steps = [r["step"] for r in train_rows(run0)]
    assert steps == sorted(set(steps)), "a committed step was lost or taken twice on the survivor"
