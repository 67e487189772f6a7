"""scripts/job.py without containers: settings, environment, what compose is told."""
from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from app.core import config
from app.core.errors import UserError
from scripts import job as job_cli
from scripts import prepare
from scripts.job import ComposeJob, JobError, job_from_words
from tests.helpers import REPO, clean_env

pytestmark = pytest.mark.unit


def test_words_split_into_the_jobs_variables_and_trainer_settings():
    job, node = job_from_words(["NODES=3", "RUN=x", "GPUS=0,1,2", "LR=0.05", "WARMUP_EPOCHS=2", "NODE=2"])
    assert (job.nodes, job.run, job.gpus, node, job.nproc) == (3, "x", "0,1,2", 2, None)
    assert job.settings == {"lr": "0.05", "warmup_epochs": "2"}
    env = job.env()
    assert env["TRAIN_LR"] == "0.05" and env["TRAIN_WARMUP_EPOCHS"] == "2"
    assert (env["NODES"], env["RUN"], env["GPUS"]) == ("3", "x", "0,1,2") and "NPROC" not in env


def test_a_fault_policy_timing_is_a_word_too_and_reaches_the_nodes_under_its_own_name():
    """Issue 26: `make up FT_HEARTBEAT_TIMEOUT=2` was refused as an unknown setting; every timing of
    app/core/policy.py that is no trainer flag is one (the two flags are HEARTBEAT_TIMEOUT=...)."""
    job, _ = job_from_words(["FT_HEARTBEAT_TIMEOUT=2", "INPLACE_POLL=0.05", "LR=0.05"])
    env = job.env()
    assert (env["FT_HEARTBEAT_TIMEOUT"], env["INPLACE_POLL"], env["TRAIN_LR"]) == ("2", "0.05", "0.05")
    assert job.settings == {"lr": "0.05"} and "TRAIN_FT_HEARTBEAT_TIMEOUT" not in env
    assert "RDZV_PORT" not in job_cli.policy_setting_names(), "the job's placement, not a word"
    assert not {"HEARTBEAT_TIMEOUT", "TRAIN_HEARTBEAT_TIMEOUT"} & job_cli.policy_setting_names(), "trainer flags"


@pytest.mark.parametrize("words, fragment", [
    (["FOO=1"], "unknown setting FOO"),
    (["NODES=two"], "NODES must be a positive integer"),
    (["NODES=0"], "NODES must be a positive integer"),
    (["NPROC=0"], "NPROC must be a positive integer"),
    (["NPROC=-1"], "NPROC must be a positive integer"),
    (["NODE=0"], "NODE must be a positive integer"),
    (["GPUS=a,b"], "GPUS must be distinct GPU indices"),
    (["LR"], "settings are NAME=value words"),
    (["OBJECT_STORE=yes"], "OBJECT_STORE must be 0 or 1, got 'yes'"),
])
def test_bad_words_are_one_error(words, fragment):
    with pytest.raises(UserError, match=fragment):
        job_from_words(words)


@pytest.mark.parametrize("words, fragment", [
    (["NODES=3", "GPUS=0,1,2,3"], "4 GPUs do not split evenly over 3 nodes"),
    (["EPOCHS=-1"], "--epochs must be positive"),
    (["DATASET=mnist"], "TRAIN_DATASET='mnist'"),
    (["FT_HEARTBEAT_TIMEOUT=5"], "FT_HEARTBEAT_TIMEOUT (5 s) must be shorter than FT_COLLECTIVE_TIMEOUT (3 s)"),
    (["INPLACE_POLL=x"], "INPLACE_POLL='x': expected a number"),
])
def test_a_job_that_cannot_work_is_refused_before_anything_starts(words, fragment, monkeypatch):
    monkeypatch.setattr(job_cli, "host_gpus", lambda: [])
    job, _ = job_from_words(words)
    with pytest.raises(UserError, match=re.escape(fragment)):
        job.validate()


def test_main_prints_one_error_line(capsys):
    assert job_cli.main(["up", "NODES=0"]) == 2
    assert capsys.readouterr().err == "error: NODES must be a positive integer, got '0'\n"


def test_an_isolated_job_ignores_the_callers_shell(monkeypatch):
    for key, value in {"TRAIN_EPOCHS": "99", "NODE_ADDR": "10.9.9.9", "RDZV_HOST": "10.9.9.9", "NNODES": "7"}.items():
        monkeypatch.setenv(key, value)
    isolated = ComposeJob("t", 2, settings={"epochs": 3}, inherit_env=False).env()
    assert isolated["TRAIN_EPOCHS"] == "3"
    assert not {"NODE_ADDR", "RDZV_HOST", "NNODES"} & isolated.keys()
    inherited = ComposeJob("t", 2, inherit_env=True).env()
    assert inherited["NODE_ADDR"] == "10.9.9.9" and inherited["TRAIN_EPOCHS"] == "99"


def test_compose_passes_every_trainer_setting_on():
    """compose drops variables it does not list: each TRAIN_* must be there, except the run directory
    (the mount point /runs, fixed by the image)."""
    text = (REPO / "compose.yaml").read_text()
    listed = set(re.findall(r"^\s+(TRAIN_[A-Z_]+):", text, re.M))
    assert listed == set(config.all_env_names()) - {"TRAIN_RUN_DIR"}


def test_cpu_hosts_add_the_cpu_override(monkeypatch):
    monkeypatch.setattr(job_cli, "host_gpus", lambda: [])
    assert job_cli.compose_files() == "compose.yaml:compose.cpu.yaml"
    monkeypatch.setattr(job_cli, "host_gpus", lambda: ["0"])
    assert job_cli.compose_files() == "compose.yaml"


def test_containers_start_inplace_on_cpu_and_gpu_hosts(monkeypatch):
    """Issue 36: inplace trained as fast as elastic in containers on CPUs (bench.container_modes); issue
    54: on an H200 its survivor of a kill trained on in its process (bench.gpu_survivors). compose.yaml's
    one default says inplace for both; FT chooses another."""
    monkeypatch.delenv("TRAIN_FT", raising=False)
    monkeypatch.setattr(job_cli, "host_gpus", lambda: [])
    assert ComposeJob("t", 2, inherit_env=False).ft() == "inplace"
    assert ComposeJob("t", 2, settings={"ft": "elastic"}, inherit_env=False).ft() == "elastic"
    monkeypatch.setenv("TRAIN_FT", "torchft")           # the shell's, as compose itself would take it
    assert ComposeJob("t", 2).ft() == "torchft" and ComposeJob("t", 2, inherit_env=False).ft() == "inplace"
    monkeypatch.setattr(job_cli, "host_gpus", lambda: ["0"])
    assert ComposeJob("t", 2, inherit_env=False).ft() == "inplace"


def test_a_nodes_first_line_names_its_address_and_gpus():
    line = ("[entrypoint] node 127.1.2.3 (nnodes=1:2 rdzv=127.0.0.1:29421 id=x, nproc=1, gpus 0,1, net_if=lo, "
            "incarnation 0): torchrun -m app.train")
    assert job_cli.NODE_LINE.findall(line) == [("127.1.2.3", "0,1")]


def test_a_node_that_has_trained_long_since_its_start_is_still_found_by_its_first_line():
    """Its start line has left the log's last 500 lines (a row every step): the whole log is read then."""
    start = ("[entrypoint] node 127.4.5.6 (standalone, nproc=1, gpus 2,3, net_if=lo, cpus all): "
             "torchrun -m app.train\n")

    class Node:
        def logs(self, tail: int | str) -> bytes:
            steps = [f"step {i}\n" for i in range(600)]
            return "".join(steps[-tail:] if isinstance(tail, int) else [start, *steps]).encode()

    assert ComposeJob.node_line(Node()) == ("127.4.5.6", "2,3")


# ---------------------------------------------------------------- the Makefile: settings first, each target its own

def _make(*words: str, dry_run: bool = False, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["make", *(["--dry-run"] if dry_run else []), *words], cwd=REPO, env=clean_env(**env),
                          capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.parametrize("words, fragment", [
    (["up", "NODES=0"], "NODES must be a positive integer, got '0'"),
    (["up", "GPUS=a,b"], "GPUS must be distinct GPU indices separated by commas, got 'a,b'"),
    (["run-ddp", "NPROC=0"], "NPROC must be a positive integer, got '0'"),
    (["run-ddp", "NPROC=x"], "NPROC must be a positive integer, got 'x'"),
    (["slurm-job", "NODES=-1"], "NODES must be a positive integer, got '-1'"),
    (["up", "OBJECT_STORE=2"], "OBJECT_STORE must be 0 or 1, got '2'"),
])
def test_bad_settings_fail_before_any_prerequisite(words, fragment):
    """The check comes first in make's order (no engine, image or cluster before it), then fails alone."""
    planned = _make(*words, dry_run=True).stdout.splitlines()
    first = next(i for i, line in enumerate(planned) if "scripts.job" in line)
    assert not [line for line in planned[:first] if "scripts/" in line], planned
    done = _make(*words)
    assert done.returncode == 2
    assert [line for line in done.stderr.splitlines() if not line.startswith("make:")] == [f"error: {fragment}"]


def test_the_image_build_gets_none_of_another_targets_settings():
    """`make chaos FAULTS=3` once handed FAULTS to `scripts.job build`, which refused it."""
    planned = _make("chaos", "FAULTS=3", "NODES=2", "EPOCHS=5", dry_run=True).stdout
    build = [line for line in planned.splitlines() if "scripts.job build" in line]
    assert build and not [line for line in build if "=" in line], build
    assert "--faults 3 --seed" not in planned and "--faults 3" in planned and "--epochs 5" in planned


# ---------------------------------------------------------------- up: what a run has left, and what it saw

def _write_rows(job: ComposeJob, *rows: dict) -> None:
    """Rows as the Reporter writes them: every key (None where not known), then the given values."""
    from app.reporting.metrics import KEYS

    job.run_dir.mkdir(parents=True, exist_ok=True)
    with (job.run_dir / "metrics.jsonl").open("a") as f:
        for row in rows:
            f.write(json.dumps({"time": time.time(), **dict.fromkeys(KEYS), **row}) + "\n")


def _isolated_job(tmp_path: Path, monkeypatch, words: list[str]) -> ComposeJob:
    monkeypatch.setattr(job_cli, "host_gpus", lambda: [])
    job, _ = job_from_words(words)
    job.runs_dir, job.run_dir = tmp_path, tmp_path / job.run
    job.inherit_env = False
    return job


def test_make_up_refuses_a_finished_run_before_the_engine_and_the_image(tmp_path, monkeypatch):
    job = _isolated_job(tmp_path, monkeypatch, [])
    _write_rows(job, {"event": "eval", "step": 110, "epoch": 5.0})
    done = _make("up", "EPOCHS=5", RUNS_DIR=str(tmp_path))
    assert done.returncode == 2 and "error: run 'default' has finished its 5 epochs" in done.stderr
    assert "docker-engine.sh" not in done.stdout and "scripts.job build" not in done.stdout


def test_a_finished_run_names_the_two_ways_on_and_starts_nothing(tmp_path, monkeypatch, capsys):
    job = _isolated_job(tmp_path, monkeypatch, ["EPOCHS=5"])
    _write_rows(job, {"event": "train", "step": 110, "epoch": 4.9}, {"event": "eval", "step": 110, "epoch": 5.0})
    monkeypatch.setattr(ComposeJob, "compose", lambda *a, **k: pytest.fail("compose must not run"))
    monkeypatch.setattr(job_cli, "job_from_words", lambda words: (job, None))
    assert job_cli.main(["up", "EPOCHS=5"]) == 2
    assert capsys.readouterr().err == (
        "error: run 'default' has finished its 5 epochs: train it further with `make up EPOCHS=N` (N > 5; it "
        "resumes from its last snapshot), or start a new run with `make up RUN=name`\n")


def test_more_epochs_or_steps_are_training_left(tmp_path, monkeypatch):
    job = _isolated_job(tmp_path, monkeypatch, ["RUN=r", "EPOCHS=30", "MAX_STEPS=200"])
    _write_rows(job, {"event": "train", "step": 110, "epoch": 4.9}, {"event": "eval", "step": 110, "epoch": 5.0})
    assert job.finished(job.validate()) is None
    job.settings["max_steps"] = 110
    assert "`make up RUN=r MAX_STEPS=N` (N > 110)" in job.finished(job.validate())


def _node(name: str, status: str, code: int = 0) -> SimpleNamespace:
    return SimpleNamespace(name=name, status=status, attrs={"State": {"ExitCode": code}})


def test_up_waits_for_a_train_row_of_its_own_start(tmp_path, monkeypatch):
    job = _isolated_job(tmp_path, monkeypatch, [])
    since = time.time()
    _write_rows(job, {"event": "train", "step": 7, "epoch": 0.3, "time": since - 60})   # an earlier start's
    monkeypatch.setattr(ComposeJob, "trainers", lambda self, running=False: [_node("ftt-trainer-1", "running")])
    with pytest.raises(JobError, match="no training within 1 s"):
        job.wait_started(since, timeout=1)
    _write_rows(job, {"event": "train", "step": 8, "epoch": 0.4, "world_size": 2})
    assert job.wait_started(since, timeout=1)["step"] == 8


def test_up_reports_nodes_that_exited_instead_of_training(tmp_path, monkeypatch):
    job = _isolated_job(tmp_path, monkeypatch, [])
    monkeypatch.setattr(ComposeJob, "trainers", lambda self, running=False: [
        _node("ftt-trainer-1", "exited", 2), _node("ftt-trainer-2", "exited", 2)])
    monkeypatch.setattr(ComposeJob, "logs", lambda self, tail=60: "job 'default' has finished")
    with pytest.raises(JobError, match=r"exited before training \(exit status: ftt-trainer-1 2, ftt-trainer-2 2\)"):
        job.wait_started(time.time(), timeout=60)


def test_a_job_that_finishes_before_its_first_train_row_counts_as_started(tmp_path, monkeypatch):
    """One step left: the nodes resume, finish and exit 0 before a log row is due. That is a start seen."""
    job = _isolated_job(tmp_path, monkeypatch, [])
    since = time.time()
    _write_rows(job, {"event": "start", "step": 152, "epoch": 3.9, "world_size": 2})
    monkeypatch.setattr(ComposeJob, "trainers", lambda self, running=False: [
        _node("ftt-trainer-1", "exited", 0), _node("ftt-trainer-2", "exited", 0)])
    assert job.wait_started(since, timeout=60)["event"] == "start"


def test_an_ended_jobs_containers_are_replaced_before_a_continuation(tmp_path, monkeypatch):
    """The ended job's store has closed the run's rendezvous: its containers go before the new start."""
    job = _isolated_job(tmp_path, monkeypatch, ["EPOCHS=30"])
    _write_rows(job, {"event": "eval", "step": 110, "epoch": 5.0})
    calls: list[str] = []
    monkeypatch.setattr(ComposeJob, "trainers", lambda self, running=False: [] if running else [_node("n", "exited")])
    monkeypatch.setattr(ComposeJob, "down", lambda self: calls.append("down"))
    monkeypatch.setattr(ComposeJob, "up", lambda self: calls.append("up"))
    monkeypatch.setattr(ComposeJob, "wait_started", lambda self, since, timeout: calls.append("wait") or {})
    job.start()
    assert calls == ["down", "up", "wait"]


def test_logs_follow_the_nodes_and_the_spares_only(monkeypatch):
    """The store outlives the job: following it too, `make logs` never returned. A spare is a node of the
    job: following the trainers alone, `make logs` returned while one still ran."""
    seen: list[tuple[str, ...]] = []
    monkeypatch.setattr(ComposeJob, "compose", lambda self, *words, **kw: seen.append(words))
    assert job_cli.main(["logs"]) == 0
    assert seen == [("logs", "--follow", "--tail=50", "trainer", "spare")]


# ---------------------------------------------------------------- the image build's optional CIFAR prefetch

def test_an_optional_dataset_that_cannot_be_fetched_is_one_warning(tmp_path, monkeypatch, capsys):
    def offline(name: str, data_dir: Path) -> None:
        raise OSError("Network is unreachable")

    monkeypatch.setattr(prepare, "download_cifar", offline)
    assert prepare.main(["--data-dir", str(tmp_path), "--dataset", "cifar10", "--optional"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err == [f"warning: could not prepare cifar10 under {tmp_path}: OSError: Network is unreachable; "
                   "continuing without it"]
    assert prepare.main(["--data-dir", str(tmp_path), "--dataset", "cifar10"]) == 1
    assert capsys.readouterr().err.startswith("error: could not prepare cifar10")


def test_compose_variables_of_the_shell_place_a_second_job(monkeypatch, tmp_path):
    """COMPOSE_PROJECT_NAME, RDZV_PORT and RUNS_DIR mean for `make up` what they mean for compose."""
    monkeypatch.setenv("COMPOSE_PROJECT_NAME", "ftt-b")
    monkeypatch.setenv("RDZV_PORT", "29499")
    monkeypatch.setenv("RUNS_DIR", str(tmp_path))
    job, _ = job_from_words(["RUN=b"])
    env = job.env()
    assert (env["COMPOSE_PROJECT_NAME"], env["RDZV_PORT"], job.run_dir) == ("ftt-b", "29499", tmp_path / "b")
    monkeypatch.setenv("RDZV_PORT", "x")
    with pytest.raises(UserError, match="RDZV_PORT must be a port number, got 'x'"):
        job_from_words([])


@pytest.mark.unit
def test_make_up_keeps_the_hosts_compose_file_for_plain_compose(tmp_path, monkeypatch):
    """`docker compose run trainer --resume` after `make up` reads COMPOSE_FILE from .env: the CPU
    override on a host without GPUs; other lines, and a COMPOSE_FILE of the user's own, stay."""
    env_file = tmp_path / ".env"
    env_file.write_text("TRAIN_EPOCHS=5\nCOMPOSE_FILE=compose.yaml\n")
    monkeypatch.setattr(job_cli, "host_gpus", lambda: [])
    job_cli.remember_compose_files(env_file)
    assert env_file.read_text() == "TRAIN_EPOCHS=5\nCOMPOSE_FILE=compose.yaml:compose.cpu.yaml\n"
    monkeypatch.setattr(job_cli, "host_gpus", lambda: ["0", "1"])
    job_cli.remember_compose_files(env_file)
    assert env_file.read_text() == "TRAIN_EPOCHS=5\nCOMPOSE_FILE=compose.yaml\n"
    env_file.write_text("COMPOSE_FILE=compose.yaml:my-gpus.yaml\n")
    job_cli.remember_compose_files(env_file)
    assert env_file.read_text() == "COMPOSE_FILE=compose.yaml:my-gpus.yaml\n"


# ---------------------------------------------------------------- the object store (OBJECT_STORE=1)

AWS = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")


def test_the_object_store_is_off_by_default_and_no_profile_of_the_shell_turns_it_on(tmp_path, monkeypatch):
    monkeypatch.setenv("COMPOSE_PROFILES", "objects")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "the-shells-own")
    env = _isolated_job(tmp_path, monkeypatch, ["RUN=r"]).env()
    assert not {"COMPOSE_PROFILES", "TRAIN_SNAPSHOT_URL", *AWS} & env.keys()


def test_object_store_1_gives_the_nodes_the_store_and_the_runs_prefix(tmp_path, monkeypatch):
    job = _isolated_job(tmp_path, monkeypatch, ["RUN=r", "OBJECT_STORE=1"])
    env = job.env()
    key, secret = job.object_credentials()
    assert (env["COMPOSE_PROFILES"], env["OBJECTS_PORT"], env["TRAIN_SNAPSHOT_URL"]) == ("objects", "8333", "s3://snapshots/r")
    assert (env["AWS_ENDPOINT_URL"], env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"]) == \
        ("http://127.0.0.1:8333", key, secret)
    job.validate()          # the URL is one the trainer takes


def test_the_stores_identity_is_one_per_run_made_from_its_job_secret(tmp_path, monkeypatch):
    """Kept as the job secret is (runs/RUN/.job-secret): the same at every start of the run, another for
    another run, the same on every host given the job's JOB_SECRET; it does not reveal the job secret."""
    first = _isolated_job(tmp_path, monkeypatch, ["RUN=a", "OBJECT_STORE=1"])
    key, secret = first.object_credentials()
    assert first.object_credentials() == (key, secret) and key != secret and len(key) == 20
    assert _isolated_job(tmp_path, monkeypatch, ["RUN=a"]).object_credentials() == (key, secret)
    assert _isolated_job(tmp_path, monkeypatch, ["RUN=b"]).object_credentials()[1] != secret
    job_secret = (tmp_path / "a" / ".job-secret").read_text().strip()
    assert job_secret not in key + secret

    monkeypatch.setenv("JOB_SECRET", "the-jobs-secret-on-every-host")
    hosts = [ComposeJob("a", 1, runs_dir=tmp_path / host, object_store=True) for host in ("host-a", "host-b")]
    assert hosts[0].object_credentials() == hosts[1].object_credentials() != (key, secret)


def test_a_snapshot_url_of_the_shell_or_the_words_is_kept_in_the_stores_bucket(tmp_path, monkeypatch):
    job = _isolated_job(tmp_path, monkeypatch, ["OBJECT_STORE=1", "SNAPSHOT_URL=s3://snapshots/mine"])
    assert job.env()["TRAIN_SNAPSHOT_URL"] == "s3://snapshots/mine"
    job.validate()
    other = _isolated_job(tmp_path, monkeypatch, ["OBJECT_STORE=1", "SNAPSHOT_URL=s3://elsewhere/mine"])
    with pytest.raises(UserError, match=re.escape(
            "OBJECT_STORE=1 keeps snapshots in the bucket 'snapshots': give SNAPSHOT_URL as s3://snapshots/PREFIX, "
            "or leave it out (s3://snapshots/default)")):
        other.validate()
    monkeypatch.setenv("TRAIN_SNAPSHOT_URL", "s3://snapshots/from-the-shell")    # `make up` passes the shell's on
    monkeypatch.setenv("RDZV_HOST", "10.1.2.3")
    inherited = ComposeJob("r", 2, runs_dir=tmp_path, object_store=True).env()
    assert (inherited["TRAIN_SNAPSHOT_URL"], inherited["AWS_ENDPOINT_URL"]) == \
        ("s3://snapshots/from-the-shell", "http://10.1.2.3:8333")


def test_objects_port_of_the_shell_places_the_store_and_a_bad_one_is_one_error(monkeypatch):
    monkeypatch.setenv("OBJECTS_PORT", "18000")
    job, _ = job_from_words(["OBJECT_STORE=1"])
    assert job.objects_port == 18000 and job.objects_endpoint() == "http://127.0.0.1:18000"
    for bad in ("x", "0", "60000"):
        monkeypatch.setenv("OBJECTS_PORT", bad)
        with pytest.raises(UserError, match=re.escape(f"OBJECTS_PORT must be a port number below 55531, got '{bad}'")):
            job_from_words([])


def test_up_starts_the_store_with_the_nodes_and_down_stops_it_whether_on_or_not(tmp_path, monkeypatch):
    seen: list[tuple[str, ...]] = []
    monkeypatch.setattr(ComposeJob, "compose", lambda self, *words, **kw: seen.append(words))
    _isolated_job(tmp_path, monkeypatch, ["OBJECT_STORE=1"]).up()
    _isolated_job(tmp_path, monkeypatch, []).up()
    assert seen == [("up", "--detach", "--scale", "trainer=2", "store", "objects", "trainer"),
                    ("up", "--detach", "--scale", "trainer=2", "store", "trainer")]
    seen.clear()
    monkeypatch.setattr(job_cli, "job_from_words", lambda words: (_isolated_job(tmp_path, monkeypatch, words), None))
    assert job_cli.main(["down"]) == 0 and job_cli.main(["ps"]) == 0
    assert seen == [("--profile", "objects", "down", "--remove-orphans"), ("--profile", "objects", "ps", "--all")]



def test_spares_start_the_spare_service_and_bound_the_job_to_its_nodes(monkeypatch):
    """`make up NODES=2 SPARES=1`: the trainers train on 2 nodes (--full-size), the spare service runs 1."""
    job, _ = job_from_words(["NODES=2", "SPARES=1", "FT=inplace"])
    env = job.env()
    assert job.spares == 1 and env["SPARES"] == "1" and env["TRAIN_FULL_SIZE"] == "2"
    assert config.parse([], environ=env).full_size == 2
    called: list[tuple[str, ...]] = []
    monkeypatch.setattr(ComposeJob, "compose", lambda self, *words, **kw: called.append(words))
    monkeypatch.setattr(ComposeJob, "validate", lambda self: None)
    monkeypatch.setattr(prepare, "prepare_run_dir", lambda *a: None)
    job.up()
    assert called[-1][-3:] == ("store", "trainer", "spare") and "spare=1" in called[-1]
    assert "TRAIN_FULL_SIZE" not in job_from_words(["NODES=2"])[0].env()
    with pytest.raises(UserError, match="SPARES must be a number of nodes"):
        job_from_words(["SPARES=some"])
    with pytest.raises(UserError, match=r"--full-size \(spares\) works in --ft inplace only, not elastic"):
        job_from_words(["SPARES=1", "FT=elastic"])[0].validate_settings()
