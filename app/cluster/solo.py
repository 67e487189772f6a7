"""A node of one training process, started and restarted by app/launch.py itself, without torch.

`python -m app.launch --standalone --nproc-per-node=1 -m app.train ...` comes here rather than to
torchrun: each node of the survivor modes on a CPU host (docker/entrypoint.sh starts every node of
those modes on its own) and README's inplace and torchft lines. torchrun's agent is torch: through it
such a node imported torch (about 1.3 s here) before it started the trainer, which imports it again,
and a node container of one core (`make up NODES=2` on two cores) cannot overlap the two. Here the
trainer starts at once and is the one process that imports torch.

For one standalone process torchrun's agent does little, and this does it alike: the worker's
variables (`worker_env`, the names and values torchrun gives; tests/test_launch.py holds them to
its), its process group's store hosted by the worker at a free port, a session of its own, a restart
after a failure up to --max-restarts (the launcher's bound on restarts without progress asked first),
and a stop signal passed on to it with torchrun's grace, then SIGKILL. Any other launch (more
processes, a rendezvous, another torchrun flag, another program) is torchrun's.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from app.core.policy import TORCHRUN_WORKER_STOP_GRACE_S
from app.recovery.failures import BAD_INPUT_SIGNAL, EXIT_BAD_INPUT, BadInput, summary

MODULE = "app.train"
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)     # torchrun's agent's


class Stopped(Exception):
    """A stop signal reached the launcher: its worker is stopped with the same signal."""

    def __init__(self, sig: signal.Signals) -> None:
        super().__init__(sig.name)
        self.sig = sig


@dataclass(frozen=True)
class Solo:
    script_args: list[str]          # the trainer's flags
    max_restarts: int | None        # --max-restarts as given; None: the fault policy's


def parse(argv: Sequence[str]) -> Solo | None:
    """The launch this module runs (the launcher's arguments name one standalone app.train process and
    nothing else torchrun would read), or None: torchrun's."""
    argv = list(argv)
    if "-m" not in argv or argv[argv.index("-m") + 1:argv.index("-m") + 2] != [MODULE]:
        return None
    cut = argv.index("-m")
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    p.add_argument("--standalone", action="store_true")
    p.add_argument("--nproc-per-node", "--nproc_per_node")
    p.add_argument("--max-restarts", "--max_restarts", type=int)
    try:
        given, rest = p.parse_known_args(argv[:cut])
    except argparse.ArgumentError:
        return None
    if rest or not given.standalone or given.nproc_per_node != "1" or (given.max_restarts or 0) < 0:
        return None
    return Solo(argv[cut + 2:], given.max_restarts)


def worker_env(attempt: int, restarts: int, run_id: str, port: int, error_file: Path) -> dict[str, str]:
    """This process's environment with the variables torchrun's agent gives one standalone worker."""
    ranks = dict.fromkeys(("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK"), "0")
    sizes = dict.fromkeys(("WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE"), "1")
    return {**os.environ, **ranks, **sizes, "ROLE_NAME": "default", "MASTER_ADDR": "localhost",
            "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": str(attempt),
            "TORCHELASTIC_MAX_RESTARTS": str(restarts), "TORCHELASTIC_RUN_ID": run_id,
            "TORCHELASTIC_USE_AGENT_STORE": "False", "TORCHELASTIC_ERROR_FILE": str(error_file),
            "TORCHELASTIC_SIGNALS_TO_HANDLE": ",".join(s.name for s in STOP_SIGNALS),
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")}


def run(solo: Solo, max_restarts: int, restarting: Callable[[str], None], folder: Path) -> tuple[str, int] | None:
    """The trainer to its end, restarted after each failure while restarts are left; None once it
    finished, else the launcher's last line and its exit status. restarting(cause): asked before each
    restart (the bound on restarts without progress raises there). Bad input raises BadInput."""
    restarts = max_restarts if solo.max_restarts is None else solo.max_restarts
    run_id, attempt = uuid.uuid4().hex, 0
    _arm()
    try:
        while True:
            error_file = folder / f"attempt_{attempt}" / "error.json"
            code, said = _attempt(solo, worker_env(attempt, restarts, run_id, _free_port(), error_file))
            if code == 0:
                return None
            line, status = summary([code], 0, said)
            if code == EXIT_BAD_INPUT:
                signal.signal(BAD_INPUT_SIGNAL, signal.SIG_IGN)     # its signal may still be on its way: said once
                raise BadInput()
            if attempt >= restarts:
                return line, status
            cause = line.removeprefix("error: ")
            restarting(cause)
            attempt += 1
            print(f"[node] {cause}: restarting it ({attempt} of {restarts} restarts)", file=sys.stderr, flush=True)
    except Stopped as exc:
        return f"launcher stopped by {exc.sig.name}", 1      # torchrun's status


def _attempt(solo: Solo, env: dict[str, str]) -> tuple[int, str | None]:
    """One run of the trainer: its exit status and its own error line (or the signal that ended it). On
    the way out by an exception (a stop signal, bad input said by signal) the worker is stopped first."""
    error_file = Path(env["TORCHELASTIC_ERROR_FILE"])
    error_file.parent.mkdir(parents=True)
    worker = subprocess.Popen([sys.executable, "-u", "-m", MODULE, *solo.script_args], env=env,
                              start_new_session=True)
    try:
        code = worker.wait()
    except BaseException as exc:
        _stop(worker, exc.sig if isinstance(exc, Stopped) else signal.SIGTERM)
        raise
    return code, _said(worker.pid, code, error_file)


def _arm() -> None:
    """The stop signals end the wait for the worker (Stopped), once: a second one is ignored."""
    def stop(signum: int, frame: object) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        raise Stopped(signal.Signals(signum))

    for sig in STOP_SIGNALS:
        signal.signal(sig, stop)


def _stop(worker: subprocess.Popen, sig: signal.Signals) -> None:
    """The worker's session gets `sig`, then SIGKILL after torchrun's grace, as torchrun's agent does it."""
    if worker.poll() is not None:
        return
    os.killpg(worker.pid, sig)
    try:
        worker.wait(TORCHRUN_WORKER_STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait()


def _said(pid: int, code: int, error_file: Path) -> str | None:
    """The worker's own error line (its error file), or the signal that ended it, worded as torchrun does."""
    try:
        return str(json.loads(error_file.read_text())["message"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return f"Signal {-code} ({signal.Signals(-code).name}) received by PID {pid}" if code < 0 else None


def _free_port() -> int:
    """A port free now, for the worker's store (torchrun picks its own the same way)."""
    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        return probe.getsockname()[1]
