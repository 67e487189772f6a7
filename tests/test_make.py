"""Docker tier: the container targets of the Makefile, run as README.md writes them, on one job.

    make up NODES=2; make ps; make kill NODE=2; make restart NODE=2; make down
    then plain `docker compose run trainer --resume` continuing the stopped job (this host's compose
    file from the .env that `make up` wrote), the job run to its end, `make up` on the finished run
    (refused, with the two ways on), a continuation with more epochs, `make logs` following it until
    the nodes exit, and `docker compose run trainer --resume` on the finished job (elastic: refused in
    one line; the survivor modes, inplace being compose's default on hosts without GPUs: a node of the
    job says done again, nothing trained).

    make up NODES=2 OBJECT_STORE=1, every node and its snapshot directory lost, the same `make up`
    again: the job resumes from the object store at its last uploaded step.

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

from app.training.snapshot_files import complete_snapshots, step_of_name

pytest.importorskip("docker", reason="the docker tier needs the docker SDK (pip install docker)")

from scripts.job import ComposeJob
from tests.docker_helpers import Times
from tests.helpers import REPO, clean_env

pytestmark = [pytest.mark.docker, pytest.mark.usefixtures("docker_engine", "image")]

PROJECT, PORT = "ftt-make-test", 29431     # this module's own (docker tier: ftt-test 29421)
LIGHTHOUSE_PORT = 29531                    # the object store test's (make up: 29510)
# The object store's S3 port; it takes the next four too, and each of the five + 10000 (make up: 8333).
# Both ranges below the ephemeral ports (32768-), which an outgoing connection may hold at any time.
OBJECTS_PORT = 18431
WORLD_TIMEOUT_S = 240                      # a kill or a restart -> the next train row at the new size
FINISH_TIMEOUT_S = 300                     # one more epoch of digits, start-up included
# The first job's length, from the shell (TRAIN_EPOCHS, as README's rule has it): the default digits job
# trains its 15 epochs in about 10 s here, and an inplace job, whose kill and restart cost it seconds,
# had finished before `make down`, leaving `docker compose run trainer --resume` nothing to continue.
FIRST_JOB_EPOCHS = "1000"


def _make(command: str, env: dict[str, str], timeout: float = 420, cwd: Path = REPO) -> subprocess.CompletedProcess:
    done = subprocess.run(shlex.split(command), cwd=cwd, env=env, capture_output=True, text=True,
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

        # Trained further: the finished job's store (its rendezvous closed) is replaced. From the newest
        # snapshot on disk: its step, not necessarily its epoch end (a stop inside an epoch's trimmed tail
        # keeps a snapshot of that step), and in the survivor modes not necessarily one with a metrics row
        # (the rows are the lease holder's; a member that finished after it snapshots its own last step).
        finished_step = step_of_name(complete_snapshots(job.run_dir / "snapshots")[0].name)
        t_more = time.time()
        more = _make(f"make up NODES=2 EPOCHS={epochs + 1}", env)
        assert more.returncode == 0, more.stderr[-3000:]
        start = next(r for r in job.rows("start") if r["time"] >= t_more)
        assert start["resumed"] is True and start["step"] == finished_step

        # `make logs` follows the nodes until they have all exited (the store runs on).
        t_logs = time.time()
        try:
            logs = _make("make logs", env, timeout=FINISH_TIMEOUT_S)
        except subprocess.TimeoutExpired:   # which node ran on, and what it said last
            running = [c.name for c in job.trainers(running=True)]
            pytest.fail(f"nodes still running {FINISH_TIMEOUT_S} s after the continuation: {running}\n{job.logs(80)}")
        times.record("make_logs_until_the_end", time.time() - t_logs)
        assert logs.returncode == 0 and "done:" in logs.stdout
        assert all(c.status == "exited" for c in job.trainers()) and job.store().status == "running"

        # The same plain line on the finished job. Elastic: one line that says so and how to go on (its
        # rendezvous is closed). The survivor modes close no rendezvous: a node of the job (its secret,
        # which plain compose takes from the shell; without one the store refuses it in one line while it
        # holds the job) finds nothing left to train: torchft resumes from the last snapshot and says done
        # again, inplace reads the job's done mark in the store and leaves in one line before it restores.
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
            finished = (f"the job finished: {epochs + 1} epochs, " if job.ft() == "inplace" else f"done: {epochs + 1} epochs")
            assert again.returncode == 0 and "Traceback" not in said and finished in said, said[-3000:]
            assert not [r for r in job.rows("train") if r["time"] > t_again], "a finished job trained again"
    finally:
        job.down()


def _uploaded(job: ComposeJob, timeout: float) -> list[int]:
    """The steps committed in the job's object store (ObjectStore.committed, newest first), once there is
    one; pytest.fail with the nodes' last lines when none comes within timeout."""
    from app.training.object_store import ObjectStore

    store = ObjectStore(job.snapshot_url())
    deadline = time.monotonic() + timeout
    while not (steps := store.committed()):
        if time.monotonic() > deadline:
            pytest.fail(f"no snapshot in {job.snapshot_url()} within {timeout:.0f} s\n{job.logs()}")
        time.sleep(0.5)
    return steps


def test_make_up_with_the_object_store_resumes_on_new_machines(tmp_path: Path, times: Times, monkeypatch) -> None:
    """README's object store lines as written. Both node containers killed and removed and the run's
    snapshot directory removed (what new machines have of the job: nothing); the same `make up` then
    resumes from the store, at its newest committed step. No credential in any output; `make down`
    stops the store and keeps its volume. Small: digits and the tiny CNN, a snapshot every 10 steps,
    more epochs than the test lets it train."""
    # RUNS_DIR is tmp_path/runs, and `rm -rf runs/default/snapshots` runs in tmp_path: this job's
    # run directory, never the checkout's runs/.
    runs = tmp_path / "runs"
    env = clean_env(COMPOSE_PROJECT_NAME=PROJECT, RDZV_PORT=str(PORT), RUNS_DIR=str(runs), OBJECTS_PORT=str(OBJECTS_PORT),
                    LIGHTHOUSE_PORT=str(LIGHTHOUSE_PORT), TRAIN_DATASET="digits", TRAIN_MODEL="tiny", TRAIN_EPOCHS="500",
                    TRAIN_LOG_EVERY_STEPS="1", TRAIN_SAVE_EVERY_STEPS="10", TRAIN_SAVE_EVERY_SECONDS="0")
    job = ComposeJob("default", 2, project=PROJECT, rdzv_port=PORT, runs_dir=runs, inherit_env=False,
                     object_store=True, objects_port=OBJECTS_PORT)
    job.down(volumes=True)          # no store data of an earlier session: the run starts fresh
    try:
        t0 = time.time()
        up = _make("make up NODES=2 OBJECT_STORE=1", env)
        times.record("make_up_2_nodes_object_store", time.time() - t0, exit_code=up.returncode)
        assert up.returncode == 0 and "snapshots also go to s3://snapshots/default" in up.stdout, up.stderr[-3000:]
        assert job.rows("start")[0]["resumed"] is False
        key, secret = job.object_credentials()      # what the store and the nodes were given (runs/default/.job-secret)
        for name, value in {"AWS_ENDPOINT_URL": job.objects_endpoint(), "AWS_ACCESS_KEY_ID": key,
                            "AWS_SECRET_ACCESS_KEY": secret}.items():
            monkeypatch.setenv(name, value)         # for this test's own client (ObjectStore reads them)
        _uploaded(job, 120)

        # Every node lost, and its disk: the containers killed and removed, the snapshot directory gone.
        assert _make("docker compose kill trainer", env).returncode == 0
        assert _make("docker compose rm -f trainer", env).returncode == 0
        assert _make("rm -rf runs/default/snapshots", env, cwd=tmp_path).returncode == 0
        assert not job.trainers() and not (runs / "default" / "snapshots").exists()
        newest = _uploaded(job, 0)[0]               # nothing uploads any more: the last step that went up

        t1 = time.time()
        again = _make("make up NODES=2 OBJECT_STORE=1", env)
        times.record("make_up_resumed_from_the_object_store", time.time() - t1, step=newest)
        assert again.returncode == 0, again.stderr[-3000:]
        start = next(r for r in job.rows("start") if r["time"] >= t1)
        assert start["resumed"] is True and start["step"] == newest, start
        logs = job.compose("--profile", "objects", "logs", "--no-color").stdout
        assert f"downloaded step-{newest:08d} from s3://snapshots/default" in logs, logs[-3000:]

        # No credential anywhere the job writes: every service's logs (the store's too), metrics, config.
        written = {"docker compose logs": logs, "metrics.jsonl": (runs / "default" / "metrics.jsonl").read_text(),
                   "config.json": (runs / "default" / "config.json").read_text(),
                   "make up": up.stdout + up.stderr + again.stdout + again.stderr}
        assert not [name for name, text in written.items() if key in text or secret in text]

        assert _make("make down", env).returncode == 0
        assert not job.containers(), [c.name for c in job.containers()]
        assert job.client.volumes.get(job.objects_volume()).name == job.objects_volume()   # the store's data stays
    finally:
        job.down(volumes=True)

