"""Helpers for the docker tier (tests/test_docker.py): the engine, one compose job, measured times.

Everything here acts only on containers of the compose project PROJECT (found by their compose
labels), so a concurrent job in another project (e.g. the chaos runner's `ftt-chaos`) is never
touched. The store of every job listens on RDZV_PORT, which is this tier's own.
"""
from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, clean_env

from app import metrics

PROJECT = "ftt-test"            # compose project of this tier (never ftt, never ftt-chaos)
RDZV_PORT = 29421               # rendezvous store port on this host (chaos: 29411, make up: 29400)
IMAGE = "ftt-trainer:latest"
UID = GID = "1000"              # owner of the files the trainers write into runs/<name>
TIMES_FILE = REPO / "runs" / "docker-test-times.json"   # runs/ is gitignored

ENTRYPOINT_NODE = re.compile(r"\[entrypoint\] node (\S+)")


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


@functools.lru_cache(maxsize=1)
def compose_files() -> str:
    """compose.yaml alone on a GPU host, with the CPU override everywhere else (as the Makefile does)."""
    try:
        gpu = subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=20, check=False).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        gpu = False
    return "compose.yaml" if gpu else "compose.yaml:compose.cpu.yaml"


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

class ComposeJob:
    """One training job of this tier's compose project: its own run name, run directory and rendezvous id."""

    def __init__(self, client: Any, label: str, nodes: int = 2, epochs: int = 200, **train: Any) -> None:
        self.client = client
        self.run_name = f"dockertest-{label}-{uuid.uuid4().hex[:6]}"
        self.run_dir = REPO / "runs" / self.run_name
        self.rdzv_id = self.run_name
        self.nodes = nodes
        # Small and fast: the tiny CNN on the 8x8 digits, a metrics row every step, a snapshot
        # every 10 steps, and a 20 s bound on a collective that waits for a lost peer.
        self.train = {"dataset": "digits", "model": "tiny", "epochs": epochs, "batch_size": 32, "lr": 0.05,
                      "log_every_steps": 1, "save_every_steps": 10, "save_every_seconds": 0,
                      "collective_timeout": 20, "progress": "lines", **train}
        # compose passes only the TRAIN_* keys listed under the trainer's `environment:` from the
        # shell (dataset, epochs, model, batch size, lr, seed, resume); every other one has to come
        # from the env file (FTT_ENV_FILE, default ./train.env), or it is silently dropped.
        self.env_file = REPO / "runs" / f".{self.run_name}.env"
        self.env_file.parent.mkdir(parents=True, exist_ok=True)
        self.env_file.write_text("".join(f"TRAIN_{k.upper()}={v}\n" for k, v in self.train.items()))

    # ------------------------------------------------------------ compose

    def env(self, **extra: str) -> dict[str, str]:
        # Nothing of the caller's shell may redirect this job (clean_env drops TRAIN_* already).
        env = {k: v for k, v in clean_env().items()
               if k not in ("NODE_ADDR", "RDZV_HOST", "FTT_IMAGE", "FTT_TAG", "FTT_RUNS_DIR")}
        env.update(COMPOSE_PROJECT_NAME=PROJECT, FTT_PROJECT=PROJECT, COMPOSE_FILE=compose_files(),
                   FTT_RUN_NAME=self.run_name, FTT_NODES=str(self.nodes), FTT_UID=UID, FTT_GID=GID,
                   RDZV_PORT=str(RDZV_PORT), RDZV_ID=self.rdzv_id, NNODES=f"1:{self.nodes}",
                   TRAINER_RESTART="no", FTT_ENV_FILE=str(self.env_file),
                   **{f"TRAIN_{k.upper()}": str(v) for k, v in self.train.items()})
        env.update(extra)
        return env

    def compose(self, *words: str, check: bool = True, timeout: float = 600,
                env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        cmd = ["docker", "compose", *words]
        try:
            done = subprocess.run(cmd, cwd=REPO, env=env or self.env(), capture_output=True, text=True,
                                  timeout=timeout, check=False)
        except subprocess.TimeoutExpired as exc:
            pytest.fail(f"`{' '.join(cmd)}` did not finish within {timeout}s\n{_text(exc.stdout)[-3000:]}"
                        f"\n{_text(exc.stderr)[-3000:]}")
        if check and done.returncode != 0:
            pytest.fail(f"`{' '.join(cmd)}` exited with {done.returncode}\n--- stdout\n{done.stdout[-3000:]}"
                        f"\n--- stderr\n{done.stderr[-3000:]}")
        return done

    def up(self) -> None:
        """`make up NODES=n` without make: the store, the run-dir one-shot and n trainer nodes."""
        self.compose("up", "--detach", "--scale", f"trainer={self.nodes}", "store", "trainer")

    def down(self) -> None:
        """Stop and remove every container of this project (one-off `run` containers too)."""
        self.compose("down", "--remove-orphans", "--timeout", "5", check=False, timeout=180)
        import docker

        for c in self.containers():
            try:
                c.remove(force=True)
            except docker.errors.NotFound:      # removed by compose in the meantime
                pass

    def cleanup(self) -> None:
        self.down()
        shutil.rmtree(self.run_dir, ignore_errors=True)
        self.env_file.unlink(missing_ok=True)

    # ------------------------------------------------------------ containers

    def containers(self, service: str | None = None) -> list[Any]:
        labels = [f"com.docker.compose.project={PROJECT}"]
        if service:
            labels.append(f"com.docker.compose.service={service}")
        return self.client.containers.list(all=True, filters={"label": labels})

    def trainers(self, running: bool = False) -> list[Any]:
        """The node containers of `compose up` (not one-off `compose run` ones), by name."""
        found = [c for c in self.containers("trainer")
                 if c.labels.get("com.docker.compose.oneoff", "False") != "True"]
        return sorted((c for c in found if not running or c.status == "running"), key=lambda c: c.name)

    @staticmethod
    def node_addr(container: Any) -> str | None:
        """The --local-addr of the container's current start (the newest `[entrypoint] node` line)."""
        found = ENTRYPOINT_NODE.findall(container.logs(tail=500).decode(errors="replace"))
        return found[-1] if found else None

    def rank0_container(self) -> Any | None:
        """The running node whose address is MASTER_ADDR of the newest start row (it holds rank 0)."""
        starts = self.rows("start")
        addr = starts[-1].get("master_addr") if starts else None
        for c in self.trainers(running=True):
            if addr is not None and self.node_addr(c) == addr:
                return c
        return None

    def logs(self, tail: int = 60) -> str:
        done = self.compose("logs", "--no-color", "--tail", str(tail), check=False, timeout=60)
        return (done.stdout + done.stderr)[-6000:]

    # ------------------------------------------------------------ metrics

    def rows(self, event: str | None = None) -> list[dict[str, Any]]:
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return []
        return [r for r in metrics.read(path) if event is None or r["event"] == event]

    def wait_row(self, what: str, predicate: Callable[[dict[str, Any]], bool], timeout: float,
                 event: str = "train") -> dict[str, Any]:
        """The first metrics row of this event that satisfies predicate; fails with the logs on timeout."""
        deadline = time.monotonic() + timeout
        while True:
            for row in self.rows(event):
                if predicate(row):
                    return row
            if time.monotonic() > deadline:
                pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}\n--- last rows\n"
                            + "\n".join(json.dumps(r) for r in self.rows()[-8:])
                            + f"\n--- docker compose logs\n{self.logs()}")
            time.sleep(0.2)

    def wait_exited(self, timeout: float) -> list[Any]:
        """Wait until every node container has exited; returns them (reloaded)."""
        deadline = time.monotonic() + timeout
        while True:
            nodes = self.trainers()
            if nodes and all(c.status == "exited" for c in nodes):
                return nodes
            if time.monotonic() > deadline:
                pytest.fail(f"the nodes did not exit within {timeout:.0f}s: "
                            f"{[(c.name, c.status) for c in nodes]}\n--- last rows\n"
                            + "\n".join(json.dumps(r) for r in self.rows()[-5:])
                            + f"\n--- docker compose logs\n{self.logs()}")
            time.sleep(1.0)


def _text(value: Any) -> str:
    if value is None:
        return ""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)
