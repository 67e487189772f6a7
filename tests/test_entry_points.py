"""Every command-line entry point: `--help` prints help and exits 0 (and starts nothing), and a
training process ends one way only, through failures.exit_process.

In-process (runpy runs each module as `python -m` does, its `__main__` block included): no new
interpreter per entry point. An entry point that ignores --help and goes on to serve or train is
stopped by an alarm, and os._exit (failures.exit_process) becomes a SystemExit the test sees.
"""
from __future__ import annotations

import runpy
import signal
import sys
from pathlib import Path

import pytest

from app.recovery import failures
from tests.helpers import REPO

pytestmark = [pytest.mark.unit, pytest.mark.filterwarnings("ignore:.*found in sys.modules:RuntimeWarning")]

# (module, words before --help): each module run with `python -m`, and each subcommand of app.node.
ENTRY_POINTS = [
    ("app", []), ("app.train", []), ("app.launch", []), ("app.plot", []), ("app.ft.lighthouse", []),
    ("app.core.policy", []), ("app.progress", []), ("app.node", []), ("app.node", ["store"]),
    ("app.node", ["objects"]), ("app.node", ["objects-health"]),
    ("app.node", ["check-config"]), ("app.node", ["gpus"]), ("app.node", ["cpus"]), ("app.node", ["iface"]),
    ("scripts.prepare", []), ("scripts.job", []), ("scripts.job", ["up"]), ("scripts.chaos", []),
    ("bench.overhead", []), ("bench.bare_ddp", []), ("bench.ft_modes", []), ("bench.launch_times", []),
    ("bench.store_scale", []), ("bench.snapshot_contention", []), ("bench.gpu_report", []), ("app.training.saver", []),
    ("bench.gpu_survivors", []), ("bench.object_store", []), ("app.node", ["objects"]), ("bench.container_modes", []),
    ("bench.snapshot_size", []),
]
HELP_WITHIN_S = 60      # printing help takes imports only; anything longer is the command running


class WentOn(Exception):
    """The entry point was still running when help should long have been printed."""


class ExitedProcess(SystemExit):
    """failures.exit_process, which would end this process at once (os._exit), as an exception."""


def _as_main(module: str, argv: list[str], monkeypatch: pytest.MonkeyPatch) -> SystemExit | None:
    """Run `python -m module ARGV` in this process; how it exited (None: it returned)."""
    def exit_process(status: int) -> None:
        raise ExitedProcess(status)

    def went_on(*_: object) -> None:
        raise WentOn(f"python -m {module} {' '.join(argv)} was still running after {HELP_WITHIN_S} s")

    monkeypatch.setattr(failures, "exit_process", exit_process)
    monkeypatch.setattr(sys, "argv", [module, *argv])
    previous = signal.signal(signal.SIGALRM, went_on)
    signal.alarm(HELP_WITHIN_S)
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as done:
        return done
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    return None


@pytest.mark.parametrize("module, words", ENTRY_POINTS, ids=[" ".join([m, *w]) for m, w in ENTRY_POINTS])
def test_help_prints_help_and_exits_zero(module, words, monkeypatch, capsys):
    done = _as_main(module, [*words, "--help"], monkeypatch)
    out, err = capsys.readouterr()
    assert done is None or done.code in (0, None), f"exit {done.code}\n{out}{err}"
    assert "usage" in out.lower() and err == "", out + err


def test_every_entry_point_is_tried():
    mains = {".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__main__")
             for folder in ("app", "scripts", "bench") for path in (REPO / folder).rglob("*.py")
             if path.name == "__main__.py" or 'if __name__ == "__main__":' in path.read_text()}
    assert mains == {module for module, _ in ENTRY_POINTS}


@pytest.mark.parametrize("module", ["app", "app.train"])
def test_a_training_process_ends_through_exit_process(module, monkeypatch, capsys):
    # Bad input is the quickest way through the trainer's whole entry point and out of it.
    done = _as_main(module, ["--epochs", "0"], monkeypatch)
    assert isinstance(done, ExitedProcess) and done.code == failures.EXIT_BAD_INPUT
    assert capsys.readouterr().err == "error: --epochs must be positive, got 0\n"
