"""`python -m app.train` with bad input: exit status 2 and exactly one `error: ...` line, never a traceback.

Each case is a separate Python process, and most of its time goes into importing torch; the
cases are independent, so one module fixture runs them all concurrently (one per core) and
every test checks its own result.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from app.datasets.files import SYNTHETIC_FOLDER
from app.training.snapshot import PARTS, write_snapshot
from tests.helpers import REPO, clean_env, trainer_cmd

pytestmark = pytest.mark.unit

NOBODY = 65534
FAST = ["--dataset", "digits", "--model", "tiny", "--epochs", "1", "--progress", "lines"]

# Root reads and writes every directory, so the unreadable-directory case needs an identity that
# file permissions apply to:
#  - "nobody": uid 65534, when that user can run this Python (not when it lives under /root);
#  - "no-dac": still uid 0, but without the two capabilities that bypass file permissions
#    (dropped by setpriv before exec), against a directory owned by uid 65534 with mode 0700.
# Both use subprocess arguments or a command prefix, not preexec_fn: the cases run from threads.
AS_NOBODY = {"user": NOBODY, "group": NOBODY, "extra_groups": []}
NO_DAC = ["setpriv", "--inh-caps=-dac_override,-dac_read_search",
          "--bounding-set=-dac_override,-dac_read_search", "--"]
DAC_BITS = (1 << 1) | (1 << 2)      # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH


@dataclass
class Case:
    args: list[Any]
    fragments: list[str]
    env: dict[str, str] = field(default_factory=dict)
    unprivileged: bool = False


def _unprivileged_mode(shared: Path) -> tuple[str | None, str]:
    """How to run a process that file permissions apply to: (mode, "") or (None, why not)."""
    if os.geteuid() != 0:
        return "self", ""
    try:
        probe = subprocess.run([sys.executable, "-c", "import torch, torchvision, sklearn, tqdm, app.train"],
                               cwd=REPO, env=clean_env(HOME=str(shared)), capture_output=True, text=True,
                               timeout=120, **AS_NOBODY)
        if probe.returncode == 0:
            return "nobody", ""
        why = (probe.stderr.strip().splitlines() or ["?"])[-1]
    except OSError as exc:
        why = str(exc)
    why = f"uid {NOBODY} cannot run {sys.executable} ({why})"
    if not shutil.which("setpriv"):
        return None, f"{why}, and setpriv is not installed"
    probe = subprocess.run([*NO_DAC, "cat", "/proc/self/status"], capture_output=True, text=True, timeout=30)
    effective = [int(line.split()[1], 16) for line in probe.stdout.splitlines() if line.startswith("CapEff:")]
    if probe.returncode != 0 or not effective or effective[0] & DAC_BITS:
        return None, f"{why}, and setpriv could not drop CAP_DAC_OVERRIDE: {probe.stderr.strip()}"
    return "no-dac", ""


def _corrupt_copy(synthetic_data: Path, dest: Path) -> Path:
    shutil.copytree(synthetic_data, dest)
    batch = dest / SYNTHETIC_FOLDER / "data_batch_1"
    payload = bytearray(batch.read_bytes())
    payload[-100] ^= 0x55                   # same size, different bytes
    batch.write_bytes(bytes(payload))
    return dest


def _cases(tmp: Path, shared: Path, synthetic_data: Path, mode: str | None) -> dict[str, Case]:
    """Every case gets its own directories; `shared` is writable by everyone (pytest's tmp is root-only)."""
    (tmp / "a-file").write_text("hello")
    (tmp / "empty-ckpt").mkdir()
    closed = shared / "ckpt"
    closed.mkdir(mode=0o700)
    (closed / "step-00000001").mkdir()
    closed_data = shutil.copytree(synthetic_data, shared / "data") / SYNTHETIC_FOLDER
    (shared / "data").chmod(0o755)          # copied from pytest's root-only tmp: open the way to the folder
    closed_data.chmod(0o700)
    if mode == "no-dac":
        os.chown(closed, NOBODY, NOBODY)    # root, without DAC override, is "other" here
        os.chown(closed_data, NOBODY, NOBODY)
    uid = NOBODY if mode == "nobody" else os.geteuid()
    (tmp / "other-ckpt").mkdir()
    other = {"train_state": {"config": {"model": "tiny", "dataset": "synthetic"}}}
    write_snapshot(tmp / "other-ckpt", 1, {**dict.fromkeys(PARTS, {}), **other})
    run = lambda name: ["--run-dir", tmp / f"run-{name}"]  # noqa: E731
    return {
        "unknown-dataset": Case(["--dataset", "imagenet"], ["argument --dataset: invalid choice: 'imagenet'"]),
        "unknown-model": Case(["--model", "vgg16"], ["argument --model: invalid choice: 'vgg16'"]),
        "zero-epochs": Case(["--epochs", "0"], ["--epochs must be positive, got 0"]),
        "negative-epochs": Case(["--epochs", "-2"], ["--epochs must be positive, got -2"]),
        "zero-batch-size": Case(["--batch-size", "0"], ["--batch-size must be positive, got 0"]),
        "zero-lr": Case(["--lr", "0"], ["--lr must be positive, got 0.0"]),
        "negative-lr": Case(["--lr", "-0.1"], ["--lr must be positive, got -0.1"]),
        "unknown-ft-mode": Case(["--ft", "restart"], ["argument --ft: invalid choice: 'restart' (choose from "
                                                      "'elastic', 'torchft', 'inplace')"]),
        "group-store-without-port": Case(["--ft", "inplace", "--group-store", "storehost"],
                                         ["--group-store must look like HOST:PORT, got 'storehost'"]),
        "resume-and-no-resume": Case(["--resume", "--no-resume"],
                                     ["argument --no-resume: not allowed with argument --resume"]),
        "adamw-with-nesterov": Case(["--optimizer", "adamw", "--nesterov", "true"],
                                    ["--nesterov applies to --optimizer sgd only, not adamw"]),
        "bad-environment-value": Case([], ["environment variable TRAIN_BATCH_SIZE='lots'"],
                                      env={"TRAIN_BATCH_SIZE": "lots"}),
        "missing-data-directory": Case(
            ["--dataset", "synthetic", "--data-dir", "/nonexistent", "--model", "tiny"],
            ["data directory /nonexistent does not exist",
             "python -m scripts.prepare --dataset synthetic --data-dir /nonexistent"]),
        "data-dir-unreadable": Case(
            ["--dataset", "synthetic", "--data-dir", shared / "data", "--model", "tiny",
             "--run-dir", shared / "run-data"],
            [f"cannot read {closed_data / 'decoded.pt'}: Permission denied (uid {uid})"],
            env={"HOME": str(shared)}, unprivileged=True),
        "corrupted-dataset": Case(
            ["--dataset", "synthetic", "--data-dir", _corrupt_copy(synthetic_data, tmp / "bad-data"),
             "--model", "tiny"],
            ["is missing or corrupted"]),
        "batch-larger-than-dataset": Case(
            [*FAST, "--batch-size", "5000", *run("big")],
            ["--batch-size 5000 x 1 processes x --grad-accum 1 is larger than the 1437 training images"]),
        "run-dir-is-a-file": Case([*FAST, "--run-dir", tmp / "a-file"],
                                  [f"run directory {tmp / 'a-file'} is not a directory"]),
        "snapshot-dir-is-a-file": Case(
            [*FAST, *run("file"), "--snapshot-dir", tmp / "a-file"],
            [f"snapshot directory {tmp / 'a-file'} is not a directory"]),
        "snapshot-dir-below-a-file": Case(
            [*FAST, *run("below"), "--snapshot-dir", tmp / "a-file" / "ckpt"],
            [f"cannot create snapshot directory {tmp / 'a-file' / 'ckpt'}"]),
        "snapshot-dir-in-proc": Case([*FAST, *run("proc"), "--snapshot-dir", "/proc"], ["snapshot directory /proc"]),
        "snapshot-dir-unreadable": Case(
            [*FAST, "--run-dir", shared / "run", "--snapshot-dir", closed],
            [f"snapshot directory {closed} is not readable and writable by this user (uid {uid})"],
            env={"HOME": str(shared)}, unprivileged=True),
        "snapshot-of-another-dataset": Case(
            [*FAST, *run("other"), "--snapshot-dir", tmp / "other-ckpt"],
            ["the snapshot was made with --dataset synthetic, this run asks for --dataset digits; "
             "use another --snapshot-dir or --no-resume"]),
        "resume-without-snapshot": Case(
            [*FAST, *run("resume"), "--snapshot-dir", tmp / "empty-ckpt", "--resume"],
            [f"--resume given but no valid snapshot in {tmp / 'empty-ckpt'}"]),
    }


CASE_NAMES = ["unknown-dataset", "unknown-model", "zero-epochs", "negative-epochs", "zero-batch-size", "zero-lr",
              "negative-lr", "unknown-ft-mode", "group-store-without-port", "resume-and-no-resume", "adamw-with-nesterov", "bad-environment-value",
              "missing-data-directory", "data-dir-unreadable", "corrupted-dataset", "batch-larger-than-dataset",
              "run-dir-is-a-file", "snapshot-dir-is-a-file", "snapshot-dir-below-a-file", "snapshot-dir-in-proc",
              "snapshot-dir-unreadable", "snapshot-of-another-dataset", "resume-without-snapshot"]


def _run(case: Case, mode: str | None) -> subprocess.CompletedProcess:
    cmd, extra = trainer_cmd(case.args, nproc=0), {}
    if case.unprivileged and mode == "nobody":
        extra = AS_NOBODY
    elif case.unprivileged and mode == "no-dac":
        cmd = [*NO_DAC, *cmd]
    return subprocess.run(cmd, cwd=REPO, env=clean_env(**case.env), capture_output=True, text=True, timeout=120,
                          **extra)


@pytest.fixture(scope="module")
def results(tmp_path_factory, synthetic_data):
    tmp = tmp_path_factory.mktemp("cli")
    shared = Path(tempfile.mkdtemp(prefix="cli-shared-", dir="/tmp"))
    try:
        shared.chmod(0o777)
        mode, why_not = _unprivileged_mode(shared)
        cases = _cases(tmp, shared, synthetic_data, mode)
        assert sorted(cases) == sorted(CASE_NAMES)
        cases["help"] = Case(["--help"], [])
        jobs = {name: case for name, case in cases.items() if mode is not None or not case.unprivileged}
        with ThreadPoolExecutor(max_workers=max(2, len(os.sched_getaffinity(0)))) as pool:
            futures = {name: pool.submit(_run, case, mode) for name, case in jobs.items()}
            out = {name: f.result() for name, f in futures.items()}
    finally:
        shutil.rmtree(shared, ignore_errors=True)
    return cases, out, why_not


def describe(result: subprocess.CompletedProcess) -> str:
    return (f"{' '.join(map(str, result.args))}\nexit {result.returncode}\n--- stdout\n{result.stdout}"
            f"\n--- stderr\n{result.stderr}")


@pytest.mark.parametrize("name", CASE_NAMES)
def test_bad_input_gives_one_error_line_and_exit_2(results, name):
    cases, out, why_not = results
    if name not in out:
        pytest.skip(why_not)
    result = out[name]
    report = describe(result)
    assert result.returncode == 2, report
    assert "Traceback" not in result.stderr + result.stdout, report
    lines = result.stderr.splitlines()
    assert len(lines) == 1, report
    line = lines[0]
    assert line.startswith("error: ") and line[len("error: "):].strip(), report
    for fragment in cases[name].fragments:
        assert fragment in line, report


def test_snapshot_dir_that_is_a_file_is_left_alone(results):
    cases = results[0]
    assert Path(cases["snapshot-dir-is-a-file"].args[-1]).read_text() == "hello"


def test_help_exits_zero(results):
    result = results[1]["help"]
    assert result.returncode == 0, describe(result)
    assert "TRAIN_FOO_BAR" in result.stdout and result.stderr == ""


@pytest.mark.parametrize("args, expected", [
    (["--epochs", "0"], (2, "", "error: --epochs must be positive, got 0\n")),
    (["--help"], (0, "usage: ", "")),
], ids=["bad-flag", "help"])
def test_the_flags_are_checked_before_torch_is_imported(tmp_path, args, expected):
    """A bad flag or --help answers before torch's import (2-3 s of CPU): here a `torch` that cannot be
    imported at all is first on the path."""
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("raise ImportError('torch imported')\n")
    done = subprocess.run([sys.executable, "-m", "app.train", *args], cwd=REPO, capture_output=True, text=True,
                          env=clean_env(PYTHONPATH=f"{tmp_path}:{REPO}"), timeout=60)
    status, out_start, err = expected
    assert (done.returncode, done.stdout[:len(out_start)], done.stderr) == (status, out_start, err), describe(done)


BAD_INPUTS = Path(__file__).with_name("BAD_INPUTS.md")
TEST_REF = re.compile(r"(tests/test_\w+\.py)::(\w+)(?:\[([^\]]+)\])?")


def test_the_bad_input_table_names_only_tests_that_exist_and_every_case_of_this_table():
    """tests/BAD_INPUTS.md is written by hand: keep it honest about which tests check its rows."""
    rows = [line for line in BAD_INPUTS.read_text().splitlines() if line.startswith("| ") and "::" in line]
    refs = [ref for row in rows for ref in TEST_REF.findall(row)]
    assert refs and len(refs) >= len(rows)
    for path, name, _ in refs:
        assert re.search(rf"^def {name}\(", (REPO / path).read_text(), re.M), f"{path}::{name} does not exist"
    cli_cases = {case for path, name, case in refs if name == test_bad_input_gives_one_error_line_and_exit_2.__name__}
    assert cli_cases == set(CASE_NAMES)
