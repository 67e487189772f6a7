"""Docker tier: the container targets of the Makefile, run as README.md writes them, on one job.

    make up NODES=2; make ps; make kill NODE=2; make restart NODE=2; make down
    then plain `docker compose run trainer --resume` continuing the stopped job (this host's compose
    file from the .env that `make up` wrote), the job run to its end, `make up` on the finished run
    (refused, with the two ways on), a continuation with more epochs, `make logs` following it until
    the nodes exit, and `docker compose run trainer --resume` on the finished job (elastic: refused in
    one line; the survivor modes, inplace being compose's default on hosts without GPUs: a node of the
    job says done again, nothing trained).

The commands are typed as in README.md (tests/readme_commands.py checks that they are the ones it
shows); the shell around them places the job beside any other (compose's own COMPOSE_PROJECT_NAME,
RDZV_PORT and RUNS_DIR), so a user's `ftt` job and runs/ are never touched.
"""
from __future__ import annotations

import shlex
import subprocess
import time
from pathlib import Path

import pytest

pytest.importorskip("docker", reason="the docker tier needs the docker SDK (pip install docker)")

from scripts.job import ComposeJob
from tests.docker_helpers import Times
from tests.helpers import REPO, clean_env

pytestmark = [pytest.mark.docker, pytest.mark.usefixtures("docker_engine", "image")]

PROJECT, PORT = "ftt-make-test", 29431     # this module's own (docker tier: ftt-test 29421)
WORLD_TIMEOUT_S = 240                      # a kill or a restart -> the next train row at the new size
FINISH_TIMEOUT_S = 300                     # one more epoch of digits, start-up included
# The first job's length, from the shell (TRAIN_EPOCHS, as README's rule has it): the default digits job
# trains its 15 epochs in about 10 s here, and an inplace job, whose kill and restart cost it seconds,
# had finished before `make down`, leaving `docker compose run trainer --resume` nothing to continue.
FIRST_JOB_EPOCHS = "1000"


def _make(command: str, env: dict[str, str], timeout: float = 420) -> subprocess.CompletedProcess:
    done = subprocess.run(shlex.split(command), cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)
    print(f"$ {command}  -> {done.returncode}\n{done.stdout[-1500:]}{done.stderr[-1500:]}", flush=True)
    return done


def _errors(done: subprocess.CompletedProcess) -> list[str]:
    return [line for line in done.stderr.splitlines() if line.startswith("error:")]


def _world_after(job: ComposeJob, size: int, since: float) -> dict:
    return job.wait_row(f"a train row at world size {size}", lambda r: r["time"] > since and r["world_size"] == size,
                        WORLD_TIMEOUT_S)


def test_make_targets_of_one_job(tmp_path: Path, times: Times) -> None:
    env = clean_env(COMPOSE_PROJECT_NAME=PROJECT, RDZV_PORT=str(PORT), RUNS_DIR=str(tmp_path))
    job = ComposeJob("default", 2, project=PROJECT, rdzv_port=PORT, runs_dir=tmp_path, inherit_env=False)
    try:
        t0 = time.time()
        long = {**env, "TRAIN_EPOCHS": FIRST_JOB_EPOCHS}
        up = _make("make up NODES=2", long)
        times.record("make_up_2_nodes", time.time() - t0, exit_code=up.returncode)
        assert up.returncode == 0 and "job started: 2 nodes" in up.stdout, up.stderr[-3000:]
        assert [r for r in job.rows("train") if r["time"] >= t0], "`make up` reported a start it did not see"

        ps = _make("make ps", env)
        assert ps.returncode == 0 and f"{PROJECT}-trainer-1" in ps.stdout and f"{PROJECT}-trainer-2" in ps.stdout

        t_kill = time.time()
        assert _make("make kill NODE=2", env).returncode == 0
        _world_after(job, 1, t_kill)
        t_restart = time.time()
        assert _make("make restart NODE=2", env).returncode == 0
        _world_after(job, 2, t_restart)
        times.record("make_kill_restart_to_world_2", time.time() - t_kill)

        assert _make("make down", env).returncode == 0
        assert not job.containers()

        # The plain compose line continues the stopped job, here with one node: no GPU reservation is
        # asked of a host without GPUs (COMPOSE_FILE in .env), it resumes from the newest snapshot.
        t_run = time.time()
        with subprocess.Popen(shlex.split("docker compose run trainer --resume"), cwd=REPO, env=long,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as plain:
            try:
                start = job.wait_row("the start row of `docker compose run`", lambda r: r["time"] > t_run,
                                     WORLD_TIMEOUT_S, event="start")
                job.wait_row("a train row of `docker compose run`", lambda r: r["time"] > t_run, WORLD_TIMEOUT_S)
            finally:
                assert _make("make down", env).returncode == 0
                said = plain.communicate(timeout=60)[0]
        assert start["resumed"] is True, said[-3000:]

        # Run it to an end: one epoch more than it has done.
        epochs = int(max((r["epoch"] for r in job.rows("eval")), default=0)) + 1
        assert _make(f"make up NODES=2 EPOCHS={epochs}", env).returncode == 0
        assert all(c.attrs["State"]["ExitCode"] == 0 for c in job.wait_exited(FINISH_TIMEOUT_S))

        # The same `make up` again: nothing left to train, said in one line, nothing started.
        again = _make(f"make up NODES=2 EPOCHS={epochs}", env)
        assert again.returncode == 2 and _errors(again) == [
            f"error: run 'default' has finished its {epochs} epochs: train it further with `make up EPOCHS=N` "
            f"(N > {epochs}; it resumes from its last snapshot), or start a new run with `make up RUN=name`"]

        # Trained further: the finished job's store (its rendezvous closed) is replaced.
        t_more = time.time()
        more = _make(f"make up NODES=2 EPOCHS={epochs + 1}", env)
        assert more.returncode == 0, more.stderr[-3000:]
        start = next(r for r in job.rows("start") if r["time"] >= t_more)
        # From the newest snapshot: its step, not necessarily its epoch end (a stop inside an epoch's
        # trimmed tail keeps a snapshot of that step, and the epoch end takes no further step to save).
        finished_step = max(r["step"] for r in job.rows("snapshot") if r["time"] < t_more)
        assert start["resumed"] is True and start["step"] == finished_step

        # `make logs` follows the nodes until they have all exited (the store runs on).
        t_logs = time.time()
        logs = _make("make logs", env, timeout=FINISH_TIMEOUT_S)
        times.record("make_logs_until_the_end", time.time() - t_logs)
        assert logs.returncode == 0 and "done:" in logs.stdout
        assert all(c.status == "exited" for c in job.trainers()) and job.store().status == "running"

        # The same plain line on the finished job. Elastic: one line that says so and how to go on (its
        # rendezvous is closed). The survivor modes close no rendezvous: a node of the job (its secret,
        # which plain compose takes from the shell; without one the store refuses it in one line while it
        # holds the job) resumes from the last snapshot, finds nothing left to train and says done again.
        if job.ft() == "elastic":
            closed = _make("docker compose run trainer --resume", env, timeout=FINISH_TIMEOUT_S)
            said = closed.stdout + closed.stderr
            assert closed.returncode == 2 and "Traceback" not in said, said[-3000:]
            assert [line for line in said.splitlines() if "error" in line.lower()] == [
                f"error: job 'default' has finished and closed its rendezvous at 127.0.0.1:{PORT}; continue it "
                "under a new rendezvous id (--rdzv-id; RDZV_ID in containers): it resumes from its last snapshot"], \
                said[-3000:]
        else:
            t_again = time.time()
            member = {**env, "TRAIN_EPOCHS": str(epochs + 1), "JOB_SECRET": job.secret()}
            again = _make("docker compose run trainer --resume", member, timeout=FINISH_TIMEOUT_S)
            said = again.stdout + again.stderr
            assert again.returncode == 0 and "Traceback" not in said and f"done: {epochs + 1} epochs" in said, \
                said[-3000:]
            assert not [r for r in job.rows("train") if r["time"] > t_again], "a finished job trained again"
    finally:
        job.down()
