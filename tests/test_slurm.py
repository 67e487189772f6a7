"""Slurm tier: the trainer under a real Slurm cluster on this host, submitted with scripts/train.sbatch.

    python -m pytest -m slurm -v -s        # -s prints the measured times

`scripts/slurm-cluster.sh ensure` installs Debian's slurm-wlm and munge when missing and runs
slurmctld and two slurmd on this host (nodes n1 and n2); a cluster of one node is used as one
node x 2 processes. One short job (digits, tiny CNN) of world size 2 is submitted with sbatch:
it must form ONE job of world size 2 and write a valid snapshot; then, while it trains, it is
requeued with `scontrol requeue` (what preemption does) and must resume from a snapshot in the
same run directory; then its batch script gets the SIGUSR1 that `--signal=B:USR1@120` sends
before a time limit and must requeue itself and resume again; at the end the job is COMPLETED
with every epoch done and a final snapshot that reads back.

Skipped only when Slurm cannot be started (not root, apt-get failing, a daemon refusing to
start). A cluster that was not running before is stopped again afterwards.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from tests.helpers import REPO, clean_env, read_metrics

from app.core.config import SNAPSHOT_FOLDER
from app.training.snapshot import complete_snapshots, read_snapshot

pytestmark = pytest.mark.slurm

CLUSTER = REPO / "scripts" / "slurm-cluster.sh"
SBATCH = REPO / "scripts" / "train.sbatch"
WORLD_SIZE = 2
EPOCHS = 1
# Small and quick: 1437 digits / (2 x 64) = 11 steps per epoch, a snapshot every 2 steps.
TRAIN_ARGS = ["--dataset", "digits", "--model", "tiny", "--epochs", str(EPOCHS), "--batch-size", "64",
              "--save-every-steps", "2", "--save-every-seconds", "0", "--log-every-steps", "2",
              "--progress", "lines"]
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


def _run(*cmd: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False, env=clean_env())


def _cluster_up() -> bool:
    try:
        return _run("scontrol", "ping").returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.fixture(scope="module")
def cluster() -> Iterator[dict[str, Any]]:
    """The running cluster: {"nodes": N, "setup_s": seconds `ensure` took}."""
    was_up = _cluster_up()
    start = time.monotonic()
    try:
        done = subprocess.run(["bash", str(CLUSTER), "ensure"], capture_output=True, text=True, timeout=900,
                              check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"Slurm cannot be started here: `scripts/slurm-cluster.sh ensure` failed: {exc}")
    setup_s = time.monotonic() - start
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-2:]
        pytest.skip(f"Slurm cannot be started here: `scripts/slurm-cluster.sh ensure` exited "
                    f"{done.returncode}: {' | '.join(tail)[:300]}")
    nodes = int(_run("sinfo", "-h", "-o", "%D").stdout.split()[0])
    _say(f"cluster set-up ({'already running' if was_up else 'started'}): {setup_s:.1f} s, {nodes} node(s)")
    try:
        yield {"nodes": nodes, "setup_s": setup_s}
    finally:
        if not was_up:
            subprocess.run(["bash", str(CLUSTER), "stop"], capture_output=True, timeout=120, check=False)


def _say(line: str) -> None:
    print(f"\n[slurm-tier] {line}", flush=True)


# ---------------------------------------------------------------- one job

class Job:
    """A train.sbatch job: its id, run directory and Slurm output file."""

    def __init__(self, tmp_path: Path, nodes: int, nproc: int, args: list[str], **env_extra: str) -> None:
        env = clean_env(PYTHON=sys.executable, RUNS_DIR=str(tmp_path), NPROC=str(nproc), **env_extra)
        done = subprocess.run(["sbatch", "--parsable", f"--nodes={nodes}", f"--output={tmp_path}/slurm-%j.out",
                               str(SBATCH), *args], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=30, check=False)
        assert done.returncode == 0, f"sbatch failed: {done.stderr.strip()}"
        self.id = done.stdout.strip().split(";")[0]
        self.submitted = time.time()
        self.run_dir = tmp_path / f"slurm-{self.id}"
        self.output = tmp_path / f"slurm-{self.id}.out"

    def info(self) -> dict[str, str]:
        """`scontrol show job` as a dict (finished jobs stay listed for MinJobAge, 300 s)."""
        out = _run("scontrol", "show", "job", "-o", self.id).stdout
        return dict(item.split("=", 1) for item in out.split() if "=" in item)

    def state(self) -> str:
        return self.info().get("JobState", "UNKNOWN")

    def starts(self) -> list[dict[str, Any]]:
        path = self.run_dir / "metrics.jsonl"
        return read_metrics(self.run_dir, "start") if path.exists() else []

    def snapshots(self) -> list[Path]:
        """Complete snapshots, newest first."""
        folder = self.run_dir / SNAPSHOT_FOLDER
        return complete_snapshots(folder) if folder.is_dir() else []

    def wait(self, condition: Callable[[], bool], what: str, timeout: float) -> float:
        """Poll until condition() holds; fail if the job ends first or time runs out. Returns time.time()."""
        deadline = time.monotonic() + timeout
        while not condition():
            state = self.state()
            if state in TERMINAL:
                pytest.fail(f"job {self.id} ended ({state}) before {what}\n{self.log()}")
            if time.monotonic() > deadline:
                pytest.fail(f"timed out after {timeout}s waiting for {what} (job {self.id} {state})\n{self.log()}")
            time.sleep(0.2)
        return time.time()

    def wait_done(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while (state := self.state()) not in TERMINAL:
            if time.monotonic() > deadline:
                pytest.fail(f"job {self.id} not finished after {timeout}s ({state})\n{self.log()}")
            time.sleep(0.5)
        return state

    def log(self) -> str:
        text = self.output.read_text() if self.output.exists() else "(no output file)"
        return f"--- {self.output}\n{text[-4000:]}"

    def cancel(self) -> None:
        _run("scancel", self.id)


def _resumed_starts(job: Job, after: int = 0) -> list[dict[str, Any]]:
    """The start rows past the first `after` ones that continue from a snapshot. A torchft replica group
    that joins a running job late also starts from the newest snapshot (then heals from the live
    group): a requeue's resumption is told apart by counting the rows written before it."""
    return [row for row in job.starts()[after:] if row["resumed"] and row["step"] > 0]


def _running_with_snapshot(job: Job) -> bool:
    return job.state() == "RUNNING" and bool(job.starts()) and bool(job.snapshots())


def test_job_trains_is_requeued_and_resumes(cluster: dict[str, Any], tmp_path: Path) -> None:
    nodes = min(cluster["nodes"], WORLD_SIZE)
    job = Job(tmp_path, nodes, WORLD_SIZE // nodes, TRAIN_ARGS)
    try:
        # 1. One job of world size 2 trains and writes a valid snapshot.
        t_started = job.wait(lambda: _running_with_snapshot(job), "the first snapshot", 180)
        first = job.starts()
        assert len(first) == 1, f"expected ONE job of world size {WORLD_SIZE}, got start rows {first}"
        assert first[0]["world_size"] == WORLD_SIZE and not first[0]["resumed"], first[0]
        state = read_snapshot(job.snapshots()[0])
        assert state["train_state"]["world_size"] == WORLD_SIZE and state["train_state"]["step"] > 0
        _say(f"job {job.id} ({nodes} node(s) x {WORLD_SIZE // nodes} process(es)): submit to first snapshot "
             f"{t_started - job.submitted:.1f} s")

        # 2. Requeued while it trains (as preemption does): it resumes from a snapshot.
        saved = max(int(p.name.split("-")[-1]) for p in job.snapshots())
        t_requeue = time.time()
        done = _run("scontrol", "requeue", job.id)
        assert done.returncode == 0, f"scontrol requeue failed: {done.stderr.strip()}"
        job.wait(lambda: len(_resumed_starts(job)) >= 1, "the resumed run's start", 180)
        resumed = _resumed_starts(job)[0]
        assert resumed["world_size"] == WORLD_SIZE and resumed["step"] >= saved, resumed
        _say(f"scontrol requeue -> resumed at step {resumed['step']} (snapshot at step >= {saved} before): "
             f"{resumed['time'] - t_requeue:.1f} s")

        # 3. Near its time limit the batch script gets SIGUSR1 (--signal=B:USR1@120): it requeues
        #    itself, and the next run resumes too.
        t_signal = time.time()
        done = _run("scancel", "--batch", "--signal=USR1", job.id)
        assert done.returncode == 0, f"scancel --signal=USR1 failed: {done.stderr.strip()}"
        job.wait(lambda: len(_resumed_starts(job)) >= 2, "the run after the time-limit signal", 180)
        again = _resumed_starts(job)[1]
        assert again["world_size"] == WORLD_SIZE and again["step"] >= resumed["step"], again
        _say(f"SIGUSR1 (time limit near) -> requeued and resumed at step {again['step']}: "
             f"{again['time'] - t_signal:.1f} s")

        # 4. The job ends COMPLETED, every epoch done, with a final snapshot that reads back.
        final_state = job.wait_done(240)
        t_done = time.time()
        info = job.info()
        assert final_state == "COMPLETED" and info["ExitCode"] == "0:0", f"{info}\n{job.log()}"
        assert info["Restarts"] == "2", info
        evals = read_metrics(job.run_dir, "eval")
        assert evals and evals[-1]["epoch"] == EPOCHS, evals[-1:]
        # The newest snapshot holds the last step (an epoch-end save at a step that already has an
        # interval snapshot keeps that one: the same weights, "the whole epoch consumed").
        last = read_snapshot(job.snapshots()[0])["train_state"]
        assert last["step"] == evals[-1]["step"], (last, evals[-1])
        _say(f"job {job.id}: submit to COMPLETED {t_done - job.submitted:.1f} s (2 requeues), "
             f"final test_acc {evals[-1]['test_acc']:.3f}; times: "
             + json.dumps({"setup_s": round(cluster["setup_s"], 1),
                           "requeue_to_resumed_s": round(resumed["time"] - t_requeue, 1),
                           "signal_to_resumed_s": round(again["time"] - t_signal, 1),
                           "job_s": round(t_done - job.submitted, 1)}))
    finally:
        if job.state() not in TERMINAL:
            job.cancel()


@pytest.mark.parametrize("mode, meeting", [("torchft", "torchft mode: Lighthouse http://"),
                                           ("inplace", "inplace mode: group store ")])
def test_a_survivor_mode_forms_one_job_of_standalone_nodes_is_requeued_and_resumes(cluster: dict[str, Any],
                                                                                   tmp_path: Path, mode: str,
                                                                                   meeting: str) -> None:
    """TRAIN_FT=torchft or inplace: the batch script runs where the nodes meet (the Lighthouse, the
    group store) on the first node and every node is a standalone launch; the nodes train together
    (world size 2 in the rows), a requeue stops both at a step boundary with a snapshot, and the next
    run resumes from it and completes."""
    if cluster["nodes"] < 2:
        pytest.skip(f"{mode} mode under Slurm needs two nodes")
    job = Job(tmp_path, 2, 1, [*TRAIN_ARGS, "--epochs", "3", "--log-every-steps", "1"],   # the last flag wins
              TRAIN_FT=mode)
    try:
        t_formed = job.wait(lambda: any(r["world_size"] == 2 for r in read_metrics(job.run_dir, "train"))
                            if (job.run_dir / "metrics.jsonl").exists() else False, "a step of both groups", 180)
        job.wait(lambda: bool(job.snapshots()), "a snapshot", 120)
        saved = max(int(p.name.split("-")[-1]) for p in job.snapshots())
        before = len(job.starts())
        assert _run("scontrol", "requeue", job.id).returncode == 0
        job.wait(lambda: len(_resumed_starts(job, before)) >= 1, "the resumed run's start", 180)
        assert _resumed_starts(job, before)[0]["step"] >= saved, job.starts()
        assert job.wait_done(240) == "COMPLETED", job.log()
        evals = read_metrics(job.run_dir, "eval")
        assert evals and evals[-1]["epoch"] == 3, evals[-1:]
        assert meeting in job.output.read_text()
        _say(f"job {job.id} ({mode}, 2 nodes): submit to both nodes training "
             f"{t_formed - job.submitted:.1f} s, then requeued, resumed from step >= {saved} and completed")
    finally:
        if job.state() not in TERMINAL:
            job.cancel()
