"""`make test`'s two passes (tests/run.py): what each selects, and how their statuses combine."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests import run
from tests.helpers import REPO, clean_env

pytestmark = pytest.mark.unit


def test_the_first_pass_runs_what_is_not_serial_one_per_core_and_the_second_the_rest_alone():
    assert run.passes(None, 2) == [["-m", "not serial", "-n", "2"], ["-m", "serial"]]
    assert run.passes("unit or multiprocess", 1) == [["-m", "(unit or multiprocess) and not serial"],
                                                     ["-m", "(unit or multiprocess) and serial"]]


@pytest.mark.parametrize("statuses, status", [([0, 0], 0), ([0, 5], 0), ([5, 0], 0), ([5, 5], 5), ([1, 0], 1),
                                              ([0, 1], 1), ([2, 1], 2), ([5, 1], 1)])
def test_the_status_is_the_first_failure_and_a_pass_without_tests_is_none(statuses, status):
    assert run.combined(statuses) == status


def _collected(expression: str) -> list[str]:
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", expression], cwd=REPO,
                          env=clean_env(), capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode in (0, 5), done.stdout[-2000:] + done.stderr[-2000:]
    return [line for line in done.stdout.splitlines() if "::" in line]


def test_every_docker_and_slurm_test_runs_alone_and_so_do_readmes_fixed_ports():
    """conftest.py adds the serial marker to the docker and slurm tiers before `-m` selects: without it the
    first pass would run the containers and the Slurm jobs beside other tests."""
    assert _collected("(docker or slurm) and not serial") == []
    serial = _collected("serial")
    assert any(t.startswith("tests/test_docker.py::") for t in serial), serial
    assert any(t.startswith("tests/test_readme_launch.py::") for t in serial), serial
    assert not any(t.startswith("tests/test_config.py::") for t in serial), serial
