"""Docker tier: a warm spare (`make up NODES=2 SPARES=1`, inplace mode) takes a killed node's place
and the cores it held, and the killed node, started again, waits as the spare. A job with a spare ends
when it is done: `make up NODES=2 SPARES=1 EPOCHS=2` then `make logs`, as README writes such lines,
returns once every container of the job, the spare's too, has exited (status 0) within END_BOUND_S of
the done lines, no metrics row after them, the newest snapshot the job's last step; the same with a
node held off by a cut of its data path (scripts/chaos/host.py's PeerCut) as the job ends.

Jobs of their own, small (the tiny CNN on the digits), in the compose project `ftt-spares-test` with
the store on port 29831 (no other tier's): the swap's figures are the chaos runner's
(`python -m scripts.chaos --spares 1`); this pins what happens, not how fast.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import time
from datetime import datetime
from pathlib import Path
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("docker", reason="the docker tier needs the docker SDK (pip install docker)")

from app.reporting.metrics import STEP_LINE
from app.training.snapshot_files import complete_snapshots, step_of_name
from scripts.chaos.host import PeerCut
from scripts.job import ComposeJob
from tests.docker_helpers import cleanup
from tests.helpers import REPO, clean_env

pytestmark = [pytest.mark.docker, pytest.mark.usefixtures("docker_engine")]

PROJECT, RDZV_PORT, LIGHTHOUSE_PORT = "ftt-spares-test", 29831, 29931
SPARE_SAYS, HEALED_SAYS = "waiting as a spare", "healed from a live replica group"   # app/ft/inplace.py, app/ft/trainer.py
CLAIMED = re.compile(r"running on cores ([\d,]+) \(claimed now\)")                     # app/cluster/cores.py
TIMEOUT_S = 240
COMMAND = "make up NODES=2 SPARES=1"       # README's line, as written
TO_THE_END = "make up NODES=2 SPARES=1 EPOCHS=2"       # and as README writes a setting: the whole job in seconds
# About 19 s of training here (22 steps an epoch): the cut and a new generation come first (the spare trained
# 3.2 s after the cut, at step 40 of 1320, 2026-12-02), then the job trains to its end. EPOCHS=200 trained
# 55 s for no check: the test took 65 s, 30 s with 60.
HELD_OFF = "make up NODES=2 SPARES=1 EPOCHS=60"
LOGS = "make logs"
DONE = re.compile(r"done: (\d+) epochs, (\d+) steps")     # app/reporting/metrics.py's done_line
LEFT = "this node leaves without training"                 # app/ft/inplace.py: a node that came to a finished job
END_BOUND_S = 30        # every container of the job has exited this long after its first done line


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


@pytest.fixture
def placed(tmp_path: Path) -> Iterator[tuple[ComposeJob, dict[str, str]]]:
    """This module's project with nothing set but where it lives (compose's own variables): the job is
    what README's lines make of the defaults."""
    env = clean_env(COMPOSE_PROJECT_NAME=PROJECT, RDZV_PORT=str(RDZV_PORT), RUNS_DIR=str(tmp_path),
                    LIGHTHOUSE_PORT=str(LIGHTHOUSE_PORT))
    job = ComposeJob("default", 2, project=PROJECT, rdzv_port=RDZV_PORT, runs_dir=tmp_path, inherit_env=False,
                     spares=1)
    cleanup(job)
    try:
        yield job, env
    finally:
        cleanup(job)


def _make(command: str, env: dict[str, str], timeout: float = 600) -> subprocess.CompletedProcess:
    done = subprocess.run(shlex.split(command), cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    print(f"$ {command}  -> {done.returncode}\n{done.stdout[-1500:]}{done.stderr[-1500:]}", flush=True)
    return done


def _instant(stamp: str) -> float:
    """Epoch seconds of the engine's RFC 3339 time (nanoseconds: cut to microseconds)."""
    head, _, fraction = stamp.rstrip("Z").partition(".")
    return datetime.fromisoformat(f"{head}.{(fraction + '000000')[:6]}+00:00").timestamp()


def _said(container: Any) -> list[tuple[float, str]]:
    """A container's log lines, each with when the engine got it."""
    lines = container.logs(timestamps=True).decode(errors="replace").splitlines()
    return [(_instant(stamp), line) for stamp, _, line in (raw.partition(" ") for raw in lines)]


def _ended_with_the_job(job: ComposeJob, logs: subprocess.CompletedProcess) -> dict[str, Any]:
    """`make logs` returned once every container of the job had exited, each with status 0 within
    END_BOUND_S of the first done line; no metrics row after it; the newest snapshot is the job's last
    step; no done line counts a life as still running. Returns what it measured."""
    assert logs.returncode == 0, logs.stdout[-3000:] + logs.stderr[-3000:]
    nodes = job.trainers()
    assert len(nodes) == 3 and all(c.status == "exited" for c in nodes), [(c.name, c.status) for c in nodes]
    codes = {c.name: c.attrs["State"]["ExitCode"] for c in nodes}
    assert set(codes.values()) == {0}, f"{codes}\n{job.logs(80)}"
    done = [(at, DONE.search(line)) for c in nodes for at, line in _said(c) if DONE.search(line)]
    assert done, job.logs(80)
    first = min(at for at, _ in done)
    exited = {c.name: round(_instant(c.attrs["State"]["FinishedAt"]) - first, 2) for c in nodes}
    assert max(exited.values()) <= END_BOUND_S, f"seconds from the first done line to each exit: {exited}"
    late = [r for r in job.rows() if r["time"] > first]
    assert not late, f"rows after the done line: {late}"
    steps = {int(found[2]) for _, found in done}
    newest = complete_snapshots(job.run_dir / "snapshots")[0]
    assert len(steps) == 1 and step_of_name(newest.name) in steps, (steps, newest.name)
    said = logs.stdout + logs.stderr
    assert "done:" in said and "more running" not in said, said[-3000:]
    return {"exited_after_done_s": exited, "final_step": steps.pop()}


def test_a_job_with_a_spare_ends_when_it_is_done(placed) -> None:
    job, env = placed
    up = _make(TO_THE_END, env)
    assert up.returncode == 0, up.stdout[-2000:] + up.stderr[-2000:]
    measured = _ended_with_the_job(job, _make(LOGS, env, timeout=300))
    left = [c.name for c in job.trainers() if any(LEFT in line for _, line in _said(c))]
    print(f"ended: {measured}; left without training: {left}", flush=True)


def test_a_node_held_off_by_a_cut_as_the_job_ends_leaves_with_it(placed) -> None:
    """A training node's data path to the others cut (the store still reached) until the job has ended: the
    other node and the spare train on at full size; the node cut off, held off, leaves with the job in
    one line when the done mark comes, exit 0, as the rest."""
    if os.getuid() != 0 or shutil.which("nft") is None:
        pytest.skip("a cut needs root and nft (apt-get install nftables)")
    job, env = placed
    up = _make(HELD_OFF, env)
    assert up.returncode == 0, up.stdout[-2000:] + up.stderr[-2000:]
    job.wait_row("both training nodes in", lambda r: r["world_size"] == 2, TIMEOUT_S)
    spare = _saying(job, SPARE_SAYS, TIMEOUT_S)
    victim = next(c for c in job.trainers(running=True) if c.id != spare.id)
    cut = PeerCut([[victim], [c for c in job.trainers(running=True) if c.id != victim.id]])
    cut_at = time.time()
    cut.cut()
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not any(at > cut_at and STEP_LINE.search(line) for at, line in _said(spare)):
            assert time.monotonic() < deadline, f"the spare did not train in the cut-off node's place\n{job.logs(40)}"
            time.sleep(1)
        rows = job.rows("train")
        print(f"the spare trained {time.time() - cut_at:.1f} s after the cut, at step {rows[-1]['step'] if rows else None}"
              f" of {HELD_OFF.split('EPOCHS=')[1]} epochs", flush=True)
        logs = _make(LOGS, env, timeout=600)
    finally:
        cut.heal()
    measured = _ended_with_the_job(job, logs)
    assert [line for _, line in _said(victim) if LEFT in line], "the node held off did not say it left"
    assert not [at for at, line in _said(victim) if DONE.search(line)], "the node held off trained to the end"
    print(f"ended: {measured}", flush=True)
