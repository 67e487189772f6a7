"""Test tiers and shared fixtures.

Tiers (every test carries exactly one, checked at collection):
    unit          in-process tests and single-process CLI runs
    multiprocess  real torchrun launches (gloo on CPU)
    docker        needs a Docker engine
    slurm         needs a Slurm cluster on this host (scripts/slurm-cluster.sh)

Run one tier with e.g. `python -m pytest -m unit`. Helpers live in tests/helpers.py.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import SYNTHETIC_TEST, SYNTHETIC_TRAIN

TIERS = ("unit", "multiprocess", "docker", "slurm")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        tiers = [t for t in TIERS if item.get_closest_marker(t) is not None]
        if len(tiers) != 1:
            raise pytest.UsageError(f"{item.nodeid} must carry exactly one of the markers {TIERS}, has {tiers}")


# ---------------------------------------------------------------- fixtures

@pytest.fixture(scope="session")
def synthetic_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small synthetic dataset in CIFAR's on-disk format, made by scripts/prepare.py's CLI entry point."""
    from scripts import prepare

    root = tmp_path_factory.mktemp("data")
    assert prepare.main(["--data-dir", str(root), "--dataset", "synthetic", "--synthetic-train", str(SYNTHETIC_TRAIN),
                         "--synthetic-test", str(SYNTHETIC_TEST)]) == 0
    return root
