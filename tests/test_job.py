"""scripts/job.py without containers: settings, environment, what compose is told."""
from __future__ import annotations

import re

import pytest

from app import config
from app.errors import UserError
from scripts import job as job_cli
from scripts.job import ComposeJob, job_from_words
from tests.helpers import REPO

pytestmark = pytest.mark.unit


def test_words_split_into_the_jobs_variables_and_trainer_settings():
    job, node = job_from_words(["NODES=3", "RUN=x", "GPUS=0,1,2", "LR=0.05", "WARMUP_EPOCHS=2", "NODE=2"])
    assert (job.nodes, job.run, job.gpus, node, job.nproc) == (3, "x", "0,1,2", 2, None)
    assert job.settings == {"lr": "0.05", "warmup_epochs": "2"}
    env = job.env()
    assert env["TRAIN_LR"] == "0.05" and env["TRAIN_WARMUP_EPOCHS"] == "2"
    assert (env["NODES"], env["RUN"], env["GPUS"]) == ("3", "x", "0,1,2") and "NPROC" not in env


@pytest.mark.parametrize("words, fragment", [
    (["FOO=1"], "unknown setting FOO"),
    (["NODES=two"], "NODES must be a positive integer"),
    (["LR"], "settings are NAME=value words"),
])
def test_bad_words_are_one_error(words, fragment):
    with pytest.raises(UserError, match=fragment):
        job_from_words(words)


@pytest.mark.parametrize("words, fragment", [
    (["NODES=0"], "NODES must be a positive integer"),
    (["NODES=3", "GPUS=0,1,2,3"], "4 GPUs do not split evenly over 3 nodes"),
    (["EPOCHS=-1"], "--epochs must be positive"),
    (["DATASET=mnist"], "TRAIN_DATASET='mnist'"),
])
def test_a_job_that_cannot_work_is_refused_before_anything_starts(words, fragment, monkeypatch):
    monkeypatch.setattr(job_cli, "host_gpus", lambda: [])
    job, _ = job_from_words(words)
    with pytest.raises(UserError, match=re.escape(fragment)):
        job.validate()


def test_main_prints_one_error_line(capsys):
    assert job_cli.main(["up", "NODES=0"]) == 2
    assert capsys.readouterr().err == "error: NODES must be a positive integer, got 0\n"


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


def test_a_nodes_first_line_names_its_address_and_gpus():
    line = ("[entrypoint] node 127.1.2.3 (nnodes=1:2 rdzv=127.0.0.1:29421 id=x, nproc=1, gpus 0,1, net_if=lo, "
            "incarnation 0): torchrun -m app.train")
    assert job_cli.NODE_LINE.findall(line) == [("127.1.2.3", "0,1")]
