"""README.md's launch lines, run exactly as written (the default digits job, 3 epochs), each to its end.

The shell around them only places the run: TRAIN_RUN_DIR (the one rule for settings) puts it in a
temporary directory, and HOST, which the multi-node line leaves to the user, is this host.
"""
from __future__ import annotations

import json
import socket
import subprocess
from pathlib import Path

import pytest

from tests.helpers import REPO, clean_env

# serial: README's lines as written listen on their fixed ports (29400, 29510)
pytestmark = [pytest.mark.multiprocess, pytest.mark.serial]

ONE_PROCESS = ".venv/bin/python -m app.train --epochs 3"
ONE_NODE = ".venv/bin/python -m app.launch --standalone --nproc-per-node=2 -m app.train --epochs 3"
EACH_NODE = (".venv/bin/python -m app.launch --nnodes=1:2 --nproc-per-node=1 --rdzv-endpoint=$HOST:29400 "
             "--rdzv-id=job1 -m app.train --epochs 3")


def _start(command: str, run_dir: Path, **env: str) -> subprocess.Popen:
    return subprocess.Popen(["bash", "-c", command], cwd=REPO, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=clean_env(TRAIN_RUN_DIR=str(run_dir), HOST="127.0.0.1", **env))


def _finished(run_dir: Path, procs: list[subprocess.Popen], world: int) -> None:
    outputs = [proc.communicate(timeout=600) for proc in procs]
    for proc, (out, err) in zip(procs, outputs):
        assert proc.returncode == 0, f"exit {proc.returncode}\n{out[-2000:]}\n{err[-3000:]}"
    assert any("done: 3 epochs" in out for out, _ in outputs)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert {r["world_size"] for r in rows if r["event"] == "train"} == {world}
    assert max(r["epoch"] for r in rows if r["event"] == "eval") == 3


def test_one_process(tmp_path):
    _finished(tmp_path, [_start(ONE_PROCESS, tmp_path)], world=1)


def test_one_node(tmp_path):
    _finished(tmp_path, [_start(ONE_NODE, tmp_path)], world=2)


def test_two_nodes(tmp_path):
    """Two agents on this host against one endpoint: one job of world size 2, as two hosts would form.

    With 1:2 nodes the first round closes 2 s (the policy's last call) after the first node arrives; a
    loaded CI machine can start the second later than that, and the first then trains alone (and may
    finish before the second joins). A longer last call, through its variable, keeps this test about
    the command rather than the machine's load."""
    with socket.socket() as probe:      # the line's port: a `make up` job's store there would be joined instead
        assert probe.connect_ex(("127.0.0.1", 29400)) != 0, "port 29400 is in use (a `make up` job?): make down first"
    nodes = [_start(EACH_NODE, tmp_path, RDZV_LAST_CALL_TIMEOUT="20") for _ in range(2)]
    _finished(tmp_path, nodes, world=2)


LIGHTHOUSE = ".venv/bin/python -m app.ft.lighthouse"
EACH_GROUP = (".venv/bin/python -m app.launch --standalone --nproc-per-node=1 -m app.train --ft torchft "
              "--lighthouse http://$HOST:29510 --epochs 3")


def test_torchft_groups(tmp_path):
    """The torchft lines: the Lighthouse, and two replica groups (two nodes' worth) sharing a run directory.
    The first group to start trains alone until the second joins the quorum (it heals first)."""
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", 29510)) != 0, "port 29510 is in use (a Lighthouse?)"
    lighthouse = _start(LIGHTHOUSE, tmp_path)
    try:
        groups = [_start(EACH_GROUP, tmp_path, FT_REPLICA_ID=f"node{i}") for i in range(2)]
        outputs = [proc.communicate(timeout=600) for proc in groups]
    finally:
        lighthouse.terminate()
        lighthouse.communicate(timeout=30)
    for proc, (out, err) in zip(groups, outputs):
        assert proc.returncode == 0, f"exit {proc.returncode}\n{out[-2000:]}\n{err[-3000:]}"
        assert "done: 3 epochs" in out
    assert lighthouse.returncode == 0, "the Lighthouse ends cleanly on SIGTERM"
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert 2 in {r["world_size"] for r in rows if r["event"] == "train"}
    assert sum(r["event"] == "start" for r in rows) == 2, "one start per group, none after"


STORE = ".venv/bin/python -m app.node store"
EACH_MEMBER = (".venv/bin/python -m app.launch --standalone --nproc-per-node=1 -m app.train --ft inplace "
               "--group-store $HOST:29400 --epochs 3")


def test_inplace_nodes(tmp_path):
    """The inplace lines: the store, and two nodes sharing a run directory. Nodes starting within the
    join window form one group; one that starts later comes in at the next step and is healed."""
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", 29400)) != 0, "port 29400 is in use (a `make up` job?): make down first"
    store = _start(STORE, tmp_path, RDZV_BIND="127.0.0.1", LIGHTHOUSE_PORT="29519")
    try:
        nodes = [_start(EACH_MEMBER, tmp_path, FT_REPLICA_ID=f"node{i}", RDZV_ID="readme") for i in range(2)]
        outputs = [proc.communicate(timeout=600) for proc in nodes]
    finally:
        store.terminate()
        store.communicate(timeout=30)
    for proc, (out, err) in zip(nodes, outputs):
        assert proc.returncode == 0, f"exit {proc.returncode}\n{out[-2000:]}\n{err[-3000:]}"
        assert "done: 3 epochs" in out
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert 2 in {r["world_size"] for r in rows if r["event"] == "train"}
    assert sum(r["event"] == "start" for r in rows) == 2, "one start per node, none after"
