"""Helpers shared by the test modules: launching trainers and reading what they wrote."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Sequence

import pytest
import torch

from app.reporting import metrics
from app.training import snapshot

REPO = Path(__file__).resolve().parent.parent

# Small enough that a launch is dominated by process start-up, large enough for several
# full steps per epoch at every world size the tests use.
SYNTHETIC_TRAIN, SYNTHETIC_TEST = 384, 96

# Keys the launcher or the caller's shell may have set that would change how a run behaves.
# make's own variables too: under `make test` a `make` a test runs would be a sub-make, print
# "make[1]:" and inherit the outer command line's settings (TESTS=..., NODES=...) through MAKEFLAGS.
_LEAKY_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID",
              "MAKELEVEL", "MAKEFLAGS", "MFLAGS", "MAKEOVERRIDES")


# ---------------------------------------------------------------- processes

def clean_env(**extra: str) -> dict[str, str]:
    """The caller's environment without TRAIN_* / launcher / Slurm variables, one thread per process."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TRAIN_", "SLURM_", "TORCHELASTIC_")) and k not in _LEAKY_ENV}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONDONTWRITEBYTECODE="1")
    env.update(extra)
    return env


def trainer_cmd(args: Sequence[str], nproc: int = 1, launcher_args: Sequence[str] = ()) -> list[str]:
    """`python -m app.train ARGS` for nproc=0, else the same under torchrun with nproc processes."""
    args = [str(a) for a in args]
    if nproc == 0:
        return [sys.executable, "-m", "app.train", *args]
    launcher = list(launcher_args) or ["--standalone", f"--nproc-per-node={nproc}"]
    return [sys.executable, "-m", "torch.distributed.run", *launcher, "-m", "app.train", *args]


RUN_TAG = "TRAINER_TEST_RUN"     # set in every launch's environment, inherited by its workers


def start_trainer(args: Sequence[str], nproc: int = 1, env: dict[str, str] | None = None,
                  launcher_args: Sequence[str] = (), prefix: Sequence[str] = (), **popen: Any) -> subprocess.Popen:
    """Start a trainer without waiting; stop it with kill_all(), collect it with finish(). `prefix`: a
    command that runs it (`ip netns exec NAME`); `popen`: Popen's own (stdout and stderr: pipes unless
    given, which a trainer printing a line a step fills in minutes unless they are read)."""
    tag = uuid.uuid4().hex
    popen = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **popen}
    proc = subprocess.Popen([*prefix, *trainer_cmd(args, nproc, launcher_args)], cwd=REPO,
                            env={**(env or clean_env()), RUN_TAG: tag}, text=True, start_new_session=True, **popen)
    proc.run_tag = tag  # type: ignore[attr-defined]
    return proc


def _tagged(tag: str) -> list[int]:
    """Processes whose environment carries this launch's tag (found even after the launcher is gone)."""
    found = []
    needle = f"{RUN_TAG}={tag}".encode()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if needle in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def kill_all(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    """Signal a launch's every process (launcher and workers) as close to at once as possible.

    torchrun starts each worker in a session of its own, so the launcher's process group alone
    would miss them; they are found by the tag in their environment instead.
    """
    targets = [proc.pid] if proc.poll() is None else []
    tag = getattr(proc, "run_tag", None)
    if tag:
        targets += [pid for pid in _tagged(tag) if pid != proc.pid]
    for pid in targets:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def finish(proc: subprocess.Popen, timeout: float) -> subprocess.CompletedProcess:
    """Wait for a started trainer; on timeout kill all its processes and fail."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_all(proc)
        out, err = proc.communicate()
        pytest.fail(f"trainer did not finish within {timeout}s\n--- stdout\n{out[-3000:]}\n--- stderr\n{err[-3000:]}")
    finally:
        kill_all(proc)       # stray workers, if the launcher itself died
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run_trainer(args: Sequence[str], nproc: int = 1, env: dict[str, str] | None = None, timeout: float = 120,
                launcher_args: Sequence[str] = (), check: bool = True, **popen: Any) -> subprocess.CompletedProcess:
    """Run the trainer to completion. nproc=0: plain `python -m app.train` (no process group)."""
    result = finish(start_trainer(args, nproc, env, launcher_args, **popen), timeout)
    if check and result.returncode != 0:
        pytest.fail(describe(result, f"trainer exited with {result.returncode}"))
    return result


def describe(result: subprocess.CompletedProcess, headline: str) -> str:
    return (f"{headline}: {' '.join(map(str, result.args))}\n--- stdout\n{result.stdout[-4000:]}"
            f"\n--- stderr\n{result.stderr[-4000:]}")


def wait_for(condition: Callable[[], bool], proc: subprocess.Popen, timeout: float, what: str,
             interval: float = 0.01) -> None:
    """Poll until condition() holds; fail if the process exits first or time runs out."""
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"trainer exited ({proc.returncode}) before {what}\n--- stdout\n{(out or '')[-3000:]}"
                        f"\n--- stderr\n{(err or '')[-3000:]}")     # none: its output went to a file
        if time.monotonic() > deadline:
            kill_all(proc)
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- results

def read_metrics(run_dir: Path, event: str | None = None) -> list[dict[str, Any]]:
    rows = metrics.read(Path(run_dir) / "metrics.jsonl")
    return [r for r in rows if event is None or r["event"] == event]


def snapshot_steps(checkpoint_dir: Path) -> list[int]:
    """Steps of the complete snapshots, oldest first."""
    return sorted(int(p.name[len(snapshot.PREFIX):]) for p in snapshot.complete_snapshots(Path(checkpoint_dir)))


def newest_snapshot(checkpoint_dir: Path) -> snapshot.State:
    found = snapshot.complete_snapshots(Path(checkpoint_dir))
    assert found, f"no complete snapshot in {checkpoint_dir}"
    return snapshot.read_snapshot(found[0])


def newest_weights(checkpoint_dir: Path) -> dict[str, torch.Tensor]:
    """Model weights and buffers of the newest complete snapshot."""
    return newest_snapshot(checkpoint_dir)["model"]


def assert_weights_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 0.0,
                         rtol: float = 0.0) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if atol == 0 and rtol == 0:
            diff = (a[key].double() - b[key].double()).abs().max()
            assert torch.equal(a[key], b[key]), f"{key} differs: max |diff| {diff}"
        else:
            torch.testing.assert_close(a[key], b[key], atol=atol, rtol=rtol, msg=lambda m: f"{key}: {m}")


def worker_pids(launcher_pid: int) -> dict[int, int]:
    """{global rank: pid} of the workers a torchrun process has started (read from /proc)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid != launcher_pid:
                continue
            environ = dict(item.split("=", 1) for item in (entry / "environ").read_text().split("\0") if "=" in item)
        except (OSError, ValueError, IndexError):
            continue
        if "RANK" in environ:
            found[int(environ["RANK"])] = int(entry.name)
    return found


class Throttle:
    """A process held to `share` of a core, as a container's CPU quota (`docker update --cpus`) holds it:
    the kernel's CFS quota lets it run for its share of each period, then stops it to the period's
    end. Here SIGSTOP and SIGCONT from a thread, while the `with` block lasts."""

    def __init__(self, pid: int, share: float, period_s: float = 0.05) -> None:
        self.pid, self.share, self.period_s = pid, share, period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._cycle, daemon=True)

    def _cycle(self) -> None:
        while not self._stop.is_set():
            time.sleep(self.share * self.period_s)
            _signal(self.pid, signal.SIGSTOP)
            time.sleep((1 - self.share) * self.period_s)
            _signal(self.pid, signal.SIGCONT)

    def __enter__(self) -> "Throttle":
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()
        _signal(self.pid, signal.SIGCONT)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
