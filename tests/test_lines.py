"""What a job of two nodes prints is true in every mode (elastic, torchft, inplace), as `make up NODES=2`
runs it: the nodes share one run directory. Each start line names the world its process starts
training at (the job's: in the survivor modes each node's own launch is a world of one), and each
done line the job's goodput over the lives there were, also where a node finishes before the other
has written its goodput row, and where a third node waited as a spare (inplace): it leaves with the job."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from app.reporting.goodput import job_account
from app.reporting.metrics import STEP_LINE
from tests.helpers import clean_env, finish, free_port, read_metrics, start_trainer
from tests.survivors import MeetingPoint

pytestmark = pytest.mark.multiprocess

START_LINE = re.compile(r"^digits: .* world size (\d+) on cpu, restart 0$", re.M)
DONE_LINE = re.compile(r"^done: .*; goodput (\d\.\d\d) of [\d.]+ s \((\d+) li(?:fe|ves)\); largest badput", re.M)
ARGS = ["--dataset", "digits", "--epochs", 2, "--log-every-steps", 1, "--progress", "lines"]


def _nodes(run_dir: Path, env: dict[str, str], launchers: list[list[str]]) -> list[str]:
    """One node per launcher, to their end; their outputs."""
    nodes = [start_trainer([*ARGS, "--run-dir", run_dir], env={**env, "FT_REPLICA_ID": f"node{i}"},
                           launcher_args=launcher) for i, launcher in enumerate(launchers)]
    ended = [finish(node, 600) for node in nodes]
    for result in ended:
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return [result.stdout for result in ended]


def _assert_true(outputs: list[str], run_dir: Path, lives: int) -> None:
    """Each node's start line against its first step line, each done line against the rows of every life."""
    account = job_account(read_metrics(run_dir))     # every node has ended: every life is in the rows
    assert account["lives"] == lives, account
    said = [out for out in outputs if START_LINE.search(out)]
    assert said, outputs
    for out in said:
        first_step = next(STEP_LINE.search(line) for line in out.splitlines() if STEP_LINE.search(line))
        assert START_LINE.search(out)[1] == first_step[2], "the start line's world is not the first step's"
        done = DONE_LINE.search(out)
        assert done and int(done[2]) == lives and abs(float(done[1]) - account["goodput"]) <= 0.05, (done, account)


def test_elastic(tmp_path):
    port = free_port()
    node = ["--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
            "--rdzv-id=lines"]
    _assert_true(_nodes(tmp_path, clean_env(), [node, node]), tmp_path, lives=1)


def test_torchft(tmp_path):
    port = free_port()
    env = clean_env(LIGHTHOUSE_PORT=str(port), TRAIN_FT="torchft", TRAIN_LIGHTHOUSE=f"http://127.0.0.1:{port}",
                    JOB_SECRET="test-secret")
    with MeetingPoint(["app.ft.lighthouse"], env):
        outputs = _nodes(tmp_path, env, [["--standalone", "--nproc-per-node=1"]] * 2)
    _assert_true(outputs, tmp_path, lives=2)


def test_inplace(tmp_path):
    port = free_port()
    env = clean_env(RDZV_PORT=str(port), LIGHTHOUSE_PORT=str(free_port()), RDZV_BIND="127.0.0.1", RDZV_ID="lines",
                    TRAIN_FT="inplace", TRAIN_GROUP_STORE=f"127.0.0.1:{port}", JOB_SECRET="test-secret")
    with MeetingPoint(["app.node", "store"], env, ready="TCPStore listening"):
        outputs = _nodes(tmp_path, env, [["--standalone", "--nproc-per-node=1"]] * 2)
    _assert_true(outputs, tmp_path, lives=2)
    steps = [found for out in outputs for found in map(STEP_LINE.search, out.splitlines()) if found]
    assert steps and all(found[3] for found in steps), "a step line without the lineage that trained it"


def test_inplace_with_a_spare(tmp_path):
    """Three nodes of a job of two (--full-size 2), one run directory: the one that waits as the spare
    leaves when the others finish, in one line, and their done lines count its life, none still running."""
    port = free_port()
    env = clean_env(RDZV_PORT=str(port), LIGHTHOUSE_PORT=str(free_port()), RDZV_BIND="127.0.0.1", RDZV_ID="lines",
                    TRAIN_FT="inplace", TRAIN_GROUP_STORE=f"127.0.0.1:{port}", JOB_SECRET="test-secret",
                    TRAIN_FULL_SIZE="2")
    with MeetingPoint(["app.node", "store"], env, ready="TCPStore listening"):
        outputs = _nodes(tmp_path, env, [["--standalone", "--nproc-per-node=1"]] * 3)
    _assert_true(outputs, tmp_path, lives=3)
    left = [out for out in outputs if not DONE_LINE.search(out)]
    assert len(left) == 1 and "more running" not in "".join(outputs), outputs
    assert re.search(r"^the job finished: 2 epochs, \d+ steps .*; this node leaves without training$", left[0], re.M)
