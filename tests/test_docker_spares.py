"""Docker tier: a warm spare (`make up NODES=2 SPARES=1`, inplace mode) takes a killed node's place
and the cores it held, and the killed node, started again, waits as the spare.

A job of its own, small (the tiny CNN on the digits), in the compose project `ftt-spares-test` with
its store on port 29831 (no other tier's): the swap's figures are the chaos runner's
(`python -m scripts.chaos --spares 1`); this pins what happens, not how fast.
"""
from __future__ import annotations

import re
import shlex
import subprocess
import time
from pathlib import Path
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("docker", reason="the docker tier needs the docker SDK (pip install docker)")

from scripts.job import ComposeJob
from tests.docker_helpers import cleanup
from tests.helpers import REPO, clean_env

pytestmark = [pytest.mark.docker, pytest.mark.usefixtures("docker_engine")]

PROJECT, RDZV_PORT, LIGHTHOUSE_PORT = "ftt-spares-test", 29831, 29931
SPARE_SAYS, HEALED_SAYS = "waiting as a spare", "healed from a live replica group"   # app/ft/inplace.py, app/ft/trainer.py
CLAIMED = re.compile(r"running on cores ([\d,]+) \(claimed now\)")                     # app/cluster/cores.py
TIMEOUT_S = 240
COMMAND = "make up NODES=2 SPARES=1"       # README's line, as written


@pytest.fixture
def spare_job(tmp_path: Path) -> Iterator[tuple[ComposeJob, dict[str, str]]]:
    """The job in its own project, and the environment that places README's `make up NODES=2 SPARES=1`
    there (compose's own variables, as tests/test_make.py does) with this test's settings (TRAIN_*)."""
    settings = {"ft": "inplace", "dataset": "digits", "model": "tiny", "epochs": 2000, "batch_size": 32, "lr": 0.05,
                "log_every_steps": 1, "save_every_steps": 10, "save_every_seconds": 0, "progress": "lines"}
    env = clean_env(COMPOSE_PROJECT_NAME=PROJECT, RDZV_PORT=str(RDZV_PORT), RUNS_DIR=str(tmp_path),
                    TRAINER_RESTART="no", LIGHTHOUSE_PORT=str(LIGHTHOUSE_PORT),
                    **{f"TRAIN_{k.upper()}": str(v) for k, v in settings.items()})
    job = ComposeJob("default", 2, project=PROJECT, rdzv_port=RDZV_PORT, runs_dir=tmp_path, inherit_env=False,
                     spares=1)
    cleanup(job)
    try:
        yield job, env
    finally:
        cleanup(job)


def _saying(job: ComposeJob, line: str, timeout: float, since: float = 0.0) -> Any:
    """The running node container whose log says `line` (after `since`, epoch seconds)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for c in job.trainers(running=True):
            if line in c.logs(since=since or None).decode(errors="replace"):
                return c
        time.sleep(1)
    raise AssertionError(f"no node said {line!r} within {timeout:.0f} s\n{job.logs(40)}")


def _claimed(node: Any) -> str | None:
    """The cores a node's training process said it claimed when the job named it (app/cluster/cores.py)."""
    found = CLAIMED.findall(node.logs().decode(errors="replace"))
    return found[-1] if found else None


def test_a_spare_takes_a_killed_nodes_place_and_the_node_back_waits_as_the_spare(spare_job) -> None:
    job, env = spare_job
    up = subprocess.run(shlex.split(COMMAND), cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert up.returncode == 0, up.stdout[-2000:] + up.stderr[-2000:]
    job.wait_row("both training nodes in", lambda r: r["world_size"] == 2, TIMEOUT_S)
    spare = _saying(job, SPARE_SAYS, TIMEOUT_S)
    assert len(job.trainers(running=True)) == 3
    victim = next(c for c in job.trainers(running=True) if c.id != spare.id)
    victim_cores = _claimed(victim)
    assert victim_cores and _claimed(spare) is None, "a node claims cores when named, a waiting spare none"
    step_before = job.rows("train")[-1]["step"]
    killed_at = time.time()
    victim.kill()
    job.wait_row("a train row at world size 2 after the kill", lambda r: r["time"] > killed_at + 1
                 and r["world_size"] == 2, TIMEOUT_S)
    assert _saying(job, HEALED_SAYS, TIMEOUT_S, since=killed_at).id == spare.id, "the spare healed in the victim's place"
    # Said just after the heal: waited for, not read once (the log may not hold it yet).
    assert _saying(job, f"running on cores {victim_cores} (claimed now)", TIMEOUT_S, since=killed_at).id == spare.id, \
        "the spare does not run on the cores the victim held"
    back_at = time.time()
    victim.start()
    assert _saying(job, SPARE_SAYS, TIMEOUT_S, since=back_at).id == victim.id, "the node back waits as the spare"
    waited = time.time()
    job.wait_row("steps after the node came back", lambda r: r["time"] > waited, 60)
    after = [r for r in job.rows("train") if r["time"] > killed_at]
    assert all(r["world_size"] == 2 for r in after), "the job trained short-handed: the spare missed the round"
    steps = [r["step"] for r in job.rows("train")]
    assert steps == sorted(set(steps)) and min(r["step"] for r in after) <= step_before + 1, "a committed step was lost"
