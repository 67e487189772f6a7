"""Helpers for the docker tier (tests/test_docker.py): the engine, this tier's jobs, measured times.

A job in containers is scripts/compose_job.ComposeJob, as for the Makefile and the chaos runner.
This tier's jobs live in the compose project PROJECT (containers found by their compose labels),
so a concurrent job in another project (e.g. the chaos runner's `ftt-chaos`) is never touched.
The store of every job listens on RDZV_PORT, which is this tier's own.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

from scripts.job import ComposeJob
from tests.helpers import REPO

PROJECT = "ftt-test"            # compose project of this tier (never ftt, never ftt-chaos)
RDZV_PORT = 29421               # rendezvous store port on this host (chaos: 29411, make up: 29400)
LIGHTHOUSE_PORT = 29521         # the store service's torchft Lighthouse (make up: 29510)
TIMES_FILE = REPO / "runs" / "docker-test-times.json"   # runs/ is gitignored


# ---------------------------------------------------------------- engine

def engine_client(timeout: float = 60):
    """A docker SDK client whose engine answers a ping, or None."""
    # Imported here, not at the top: importing this module must not need the SDK.
    import docker

    try:
        client = docker.from_env(timeout=timeout)
        client.ping()
        return client
    except (docker.errors.DockerException, OSError):
        return None


def ensure_engine() -> tuple[Any, str]:
    """(client, "") when an engine answers, after one `scripts/docker-engine.sh ensure` if needed;
    else (None, why)."""
    client = engine_client()
    if client is not None:
        return client, ""
    try:
        done = subprocess.run(["bash", "scripts/docker-engine.sh", "ensure"], cwd=REPO, capture_output=True,
                              text=True, timeout=1800, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"no Docker engine reachable and `scripts/docker-engine.sh ensure` failed: {exc}"
    client = engine_client()
    if client is None:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        return None, (f"no Docker engine reachable and `scripts/docker-engine.sh ensure` failed "
                      f"(exit {done.returncode}): {' | '.join(tail)[:300]}")
    return client, ""


# ---------------------------------------------------------------- measured times

class Times:
    """Seconds measured by the tests, printed as they come and kept in TIMES_FILE."""

    def __init__(self, path: Path = TIMES_FILE) -> None:
        self.path = path
        self.data: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host_cores": os.cpu_count(),
                                     "project": PROJECT, "rdzv_port": RDZV_PORT, "times_s": {}, "details": {}}

    def record(self, key: str, seconds: float, **details: Any) -> float:
        seconds = round(seconds, 2)
        self.data["times_s"][key] = seconds
        if details:
            self.data["details"][key] = details
        print(f"\n[docker-tier] {key}: {seconds:.2f} s {json.dumps(details) if details else ''}", flush=True)
        self.save()
        return seconds

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.data, indent=2) + "\n")


# ---------------------------------------------------------------- one job

def tier_job(label: str, nodes: int = 2, epochs: int = 200, gpus: str = "", **train: Any) -> ComposeJob:
    """A job of this tier's compose project, under a run name (= rendezvous id) of its own.

    Small and fast: the tiny CNN on the 8x8 digits, a metrics row every step, a snapshot every
    10 steps, and a 20 s bound on a collective that waits for a lost peer (the default, 30 s,
    would only make the kill tests slower). Elastic mode unless given: this tier's tests are about
    torchrun's restarts and rank 0's node, and compose starts inplace by default (compose.yaml); the
    survivor modes in containers are the multi-host test's and the chaos runner's.
    """
    settings = {"ft": "elastic", "dataset": "digits", "model": "tiny", "epochs": epochs, "batch_size": 32, "lr": 0.05,
                "log_every_steps": 1, "save_every_steps": 10, "save_every_seconds": 0,
                "collective_timeout": 20, "progress": "lines", **train}
    return ComposeJob(f"dockertest-{label}-{uuid.uuid4().hex[:6]}", nodes, gpus=gpus, project=PROJECT,
                      rdzv_port=RDZV_PORT, settings=settings, inherit_env=False,
                      extra_env={"NNODES": f"1:{nodes}", "TRAINER_RESTART": "no",
                                 "LIGHTHOUSE_PORT": str(LIGHTHOUSE_PORT)})


def cleanup(job: ComposeJob) -> None:
    job.down()
    shutil.rmtree(job.run_dir, ignore_errors=True)


def trainer_pid(container: Any) -> int:
    """The host pid of the node's training process (not its launcher)."""
    top = container.top()
    column = top["Titles"].index("PID")
    found = [int(p[column]) for p in top["Processes"]      # not app.training.saver, the trainer's saver process
             if re.search(r"-m app\.train(\s|$)", p[-1]) and "app.launch" not in p[-1]]
    assert len(found) == 1, top["Processes"]
    return found[0]
