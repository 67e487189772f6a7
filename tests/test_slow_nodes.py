"""A node alive and beating but slow (its worker held to a fifth of a core, as `docker update --cpus 0.2`
holds a container) is named on every node, in elastic mode (the step times ride the heartbeat) and in
torchft mode (they ride each step's all-reduce), and keeps up again once released; the fast node's
goodput counts what it waited for the slow one. In inplace mode it steps aside: for a waiting spare,
or, without one, while the others alone train faster, and comes back on trial. Nodes of one process on
this host; a window of 3 s (SLOW_WINDOW) so that the test takes seconds, not the default's tens."""
from __future__ import annotations

import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import (Throttle, clean_env, finish, free_port, kill_all, read_metrics, start_trainer, wait_for,
                           worker_pids)
from tests.survivors import LONG, MeetingPoint, inplace_store, spares_listed, standalone_node, train_rows

pytestmark = pytest.mark.multiprocess

WINDOW = 3
SLOW_LINE = re.compile(r"^node (\S+) is slow: its steps take ([\d.]+)x the others' for 3 s$", re.M)


def _started(procs: list[subprocess.Popen], run_dir: Path) -> None:
    wait_for(lambda: (run_dir / "metrics.jsonl").exists() and len(read_metrics(run_dir, "train")) >= 3, procs[0],
             180, "the job training")


def _named_then_kept_up(procs: list[subprocess.Popen], logs: list[Path], slow_pid: int, slow_node: str) -> None:
    """Hold the slow node's worker to a fifth of a core until every node has named it, then let it go
    until every node says it keeps up again; then stop the job (SIGTERM: every node writes its rows)."""
    named = lambda: all(SLOW_LINE.search(log.read_text()) for log in logs)
    with Throttle(slow_pid, share=0.2):
        wait_for(named, procs[0], 10 * WINDOW, "every node naming the slow one")
    wait_for(lambda: all(f"node {slow_node} keeps up again" in log.read_text() for log in logs), procs[0],
             10 * WINDOW, "every node saying it keeps up again")
    time.sleep(1.0)
    for proc in procs:
        kill_all(proc, signal.SIGTERM)
    for proc in procs:
        finish(proc, 120)
    for log in logs:
        lines = SLOW_LINE.findall(log.read_text())
        assert [node for node, _ in lines] == [slow_node], (log, lines)      # once, and only that node
        assert float(lines[0][1]) >= 2.0, lines


def test_elastic_mode_names_a_node_held_to_a_fifth_of_a_core_on_every_node(tmp_path):
    port, run_dir = free_port(), tmp_path / "run"
    procs, logs = [], [tmp_path / f"node{node}.log" for node in (0, 1)]
    try:
        for node in (0, 1):
            launcher = ["--nnodes=2", "--nproc-per-node=1", f"--node-rank={node}", "--master-addr=127.0.0.1",
                        f"--master-port={port}"]
            procs.append(start_trainer(["--dataset", "digits", "--epochs", LONG, "--log-every-steps", 50,
                                        "--progress", "lines", "--run-dir", run_dir, "--no-resume"],
                                       env=clean_env(SLOW_WINDOW=str(WINDOW)), launcher_args=launcher,
                                       stdout=open(logs[node], "w"), stderr=subprocess.STDOUT))
        _started(procs, run_dir)
        (slow_pid,) = worker_pids(procs[1].pid).values()
        _named_then_kept_up(procs, logs, slow_pid, f"{socket.gethostname()}-1")
    finally:
        for proc in procs:
            kill_all(proc)
    (row,) = read_metrics(run_dir, "goodput")       # rank 0's, on the fast node
    assert row["parts_s"]["slow_peer"] > 0, row


def test_torchft_mode_names_a_node_held_to_a_fifth_of_a_core_on_every_node(tmp_path):
    port = free_port()
    env = clean_env(LIGHTHOUSE_PORT=str(port), TRAIN_FT="torchft", TRAIN_LIGHTHOUSE=f"http://127.0.0.1:{port}",
                    JOB_SECRET="test-secret", SLOW_WINDOW=str(WINDOW))
    logs = [tmp_path / f"node{node}.log" for node in (0, 1)]
    with MeetingPoint(["app.ft.lighthouse", "--host", "127.0.0.1"], env):
        procs = [standalone_node(node, tmp_path, env, LONG, "--progress", "lines", stdout=open(logs[node], "w"),
                                 stderr=subprocess.STDOUT) for node in (0, 1)]
        try:
            _started(procs, tmp_path / "run0")
            (slow_pid,) = worker_pids(procs[1].pid).values()
            _named_then_kept_up(procs, logs, slow_pid, "node1")
        finally:
            for proc in procs:
                kill_all(proc)
    rows = read_metrics(tmp_path / "run0", "goodput")
    assert rows and rows[-1]["parts_s"]["slow_peer"] > 0, rows


def _nodes(tmp_path: Path, env: dict[str, str], count: int, *args: object) -> tuple[list[subprocess.Popen], list[Path]]:
    logs = [tmp_path / f"node{node}.log" for node in range(count)]
    return [standalone_node(node, tmp_path, env, LONG, "--progress", "lines", *args, stdout=open(logs[node], "w"),
                            stderr=subprocess.STDOUT) for node in range(count)], logs


def _stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        kill_all(proc, signal.SIGTERM)
    for proc in procs:
        finish(proc, 120)


def _steps_kept(run_dir: Path) -> None:
    steps = [r["step"] for r in train_rows(run_dir)]
    assert steps == sorted(set(steps)), "a committed step was lost or taken twice"


# Alone: beside the first pass's other tests another node of this job read 2.2x its peers' step time
# (the machine's load, not the throttle), was named and stepped aside first.
@pytest.mark.serial
def test_inplace_mode_swaps_a_slow_node_for_the_waiting_spare_which_it_becomes(tmp_path):
    """--full-size 2, a third node waiting as the spare: node 1 held to a fifth of a core is named, steps
    aside, and the spare trains in its place at full size; released, node 1 waits as the spare."""
    with inplace_store() as store:
        env = {**store.env, "SLOW_WINDOW": str(WINDOW), "FLAP_STABLE": "4"}
        spares = spares_listed(store.env)
        procs, logs = _nodes(tmp_path, env, 2, "--full-size", 2)
        try:
            _started(procs, tmp_path / "run0")
            procs.append(standalone_node(2, tmp_path, env, LONG, "--progress", "lines", "--full-size", 2,
                                         stdout=open(tmp_path / "node2.log", "w"), stderr=subprocess.STDOUT))
            wait_for(lambda: spares() == 1, procs[2], 180, "the third node waiting as a spare")
            (slow_pid,) = worker_pids(procs[1].pid).values()
            with Throttle(slow_pid, share=0.2):
                throttled_at = time.time()
                wait_for(lambda: "node node1 steps aside for the waiting spare" in logs[1].read_text(), procs[1],
                         10 * WINDOW, "the slow node stepping aside")
                wait_for(lambda: any(r["world_size"] == 2 for r in train_rows(tmp_path / "run2", throttled_at)),
                         procs[2], 60, "the spare training in the slow node's place")
            wait_for(lambda: spares() == 2, procs[1], 60, "the slow node waiting as the spare")
            _stop(procs)
        finally:
            for proc in procs:
                kill_all(proc)
    said = logs[1].read_text()
    assert SLOW_LINE.search(said) and "waiting as a spare" in said.split("steps aside")[1], said[-3000:]
    assert "node node1 steps aside (slow): the others train on without it" in logs[0].read_text()
    _steps_kept(tmp_path / "run0")


# The choice rests on measured step times: beside the first pass's other tests a fifth of a core read 2.3x
# and the estimate (35.1 node-steps/s with it, 35.5 without) rightly kept the node. Alone, at a tenth.
@pytest.mark.serial
def test_inplace_mode_leaves_a_slow_node_out_while_the_others_train_faster_and_takes_it_back(tmp_path):
    """No spare: node 2 of three held to a tenth of a core is left out (the line says why, from the measured
    step times), comes back on trial after FLAP_STABLE, is left out again while still slow (for twice as
    long), and once released stays in."""
    with inplace_store() as store:
        env = {**store.env, "SLOW_WINDOW": str(WINDOW), "FLAP_STABLE": "4"}
        procs, logs = _nodes(tmp_path, env, 3)
        run0 = tmp_path / "run0"
        try:
            wait_for(lambda: any(r["world_size"] == 3 for r in train_rows(run0)), procs[0], 180, "three nodes training")
            time.sleep(WINDOW)      # rounds with no node slow: the collective's own cost measured (app/ft/pace.py)
            (slow_pid,) = worker_pids(procs[2].pid).values()
            out = lambda: logs[2].read_text().count("the job leaves it out; it comes back on trial in")
            with Throttle(slow_pid, share=0.1):
                wait_for(lambda: out() >= 2, procs[2], 20 * WINDOW, "the slow node left out twice")
            released_at = time.time()
            wait_for(lambda: any(r["world_size"] == 3 for r in train_rows(run0, released_at + 9)), procs[0], 60,
                     "the node back in after its time aside")
            time.sleep(3 * WINDOW)      # judged on a whole window again: not named
            _stop(procs)
        finally:
            for proc in procs:
                kill_all(proc)
    said = logs[2].read_text()
    assert "comes back on trial in 4 s" in said and "comes back on trial in 8 s" in said, said[-3000:]
    assert said.count("node node2 is slow") == out(), "named again once released"
    _steps_kept(run0)
    assert any(r["world_size"] == 2 for r in train_rows(run0)), "the others never trained without it"
