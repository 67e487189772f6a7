"""Test tiers and shared fixtures.

Tiers (every test carries exactly one, checked at collection):
    unit          in-process tests and single-process CLI runs
    multiprocess  real torchrun launches (gloo on CPU)
    docker        needs a Docker engine
    slurm         needs a Slurm cluster on this host (scripts/slurm-cluster.sh)

and `serial` on the tests that run alone (tests/run.py, `make test`'s second pass): every test of
the docker and slurm tiers (added here) and those that bound a time tightly or listen on a fixed port.

Run one tier with e.g. `python -m pytest -m unit`. Helpers live in tests/helpers.py.
"""
from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from scripts.job import IMAGE
from tests.docker_helpers import Times, cleanup, ensure_engine, tier_job
from app.cluster.object_server import LocalServer
from tests.helpers import REPO, SYNTHETIC_TEST, SYNTHETIC_TRAIN, clean_env

TIERS = ("unit", "multiprocess", "docker", "slurm")
# Tiers whose every test runs alone (tests/run.py's second pass): they hold the Docker engine or the Slurm
# cluster, and bound recoveries in seconds on a host whose two cores they fill.
SERIAL_TIERS = ("docker", "slurm")


@pytest.hookimpl(tryfirst=True)     # before `-m` selects: the serial marker added here counts there
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        tiers = [t for t in TIERS if item.get_closest_marker(t) is not None]
        if len(tiers) != 1:
            raise pytest.UsageError(f"{item.nodeid} must carry exactly one of the markers {TIERS}, has {tiers}")
        if tiers[0] in SERIAL_TIERS:
            item.add_marker(pytest.mark.serial)


# ---------------------------------------------------------------- fixtures

@pytest.fixture(scope="session")
def synthetic_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small synthetic dataset in CIFAR's on-disk format, made by scripts/prepare.py's CLI entry point."""
    from scripts import prepare

    root = tmp_path_factory.mktemp("data")
    assert prepare.main(["--data-dir", str(root), "--dataset", "synthetic", "--synthetic-train", str(SYNTHETIC_TRAIN),
                         "--synthetic-test", str(SYNTHETIC_TEST)]) == 0
    return root


@pytest.fixture(scope="session")
def object_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServer]:
    """A real S3 server (SeaweedFS, started as the compose service starts it) for the session; each test
    takes a prefix of its own."""
    server = LocalServer(tmp_path_factory.mktemp("objects"))
    try:
        yield server
    finally:
        server.stop()


# ---------------------------------------------------------------- the docker tier's engine and image

@pytest.fixture(scope="session")
def docker_engine() -> Any:
    """A docker SDK client; one `scripts/docker-engine.sh ensure` if no engine answers, else skip."""
    client, why = ensure_engine()
    if client is None:
        pytest.skip(why)
    yield client
    client.close()


@pytest.fixture(scope="module")
def times() -> Iterator[Times]:
    t = Times()
    yield t
    t.data["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    t.save()
    print(f"\n[docker-tier] measured times -> {t.path}:\n" + "\n".join(
        f"  {k:40} {v:8.2f} s" for k, v in t.data["times_s"].items()), flush=True)


@pytest.fixture(scope="module")
def image(docker_engine, times: Times) -> str:
    """`make image` (compose build of the trainer; offline: pip --no-index from the host wheelhouse).

    Timed: a cold build takes minutes, a cached one seconds. Leftovers of an interrupted earlier
    session of this tier (same project) are removed first.
    """
    cleanup(tier_job("stale"))
    start = time.monotonic()
    done = subprocess.run(["make", "image"], cwd=REPO, env=clean_env(),
                          capture_output=True, text=True, timeout=3600, check=False)
    seconds = time.monotonic() - start
    output = done.stdout + done.stderr
    times.record("image_build", seconds, command="make image", exit_code=done.returncode,
                 cached_steps=output.count("CACHED"))
    assert done.returncode == 0, f"`make image` failed ({done.returncode}):\n{output[-5000:]}"
    return IMAGE
