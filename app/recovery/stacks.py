"""The Python stacks of a hang, taken before anything is killed, in <run-dir>/hangs/.

Every training process arms the standard library's faulthandler at start (`arm`): STACKS_SIGNAL
makes it write the stacks of all its threads, from the signal handler itself, so a process whose
main thread is stuck in a collective, holding the GIL or not, still answers. The file it writes to
is its own, host-local (`_armed_path`); whoever asks (`ask`: a peer on the same host that found it
silent) copies the answer into the run directory. A process that finds a hang dumps its own stacks
(`dump_own`). A stopped process (SIGSTOP, a frozen cgroup) cannot answer: `ask` says so at once
instead of waiting.

The files: <run-dir>/hangs/<UTC time>-rank<R>-pid<P>.txt, a first line saying why, then
faulthandler's text (a "Thread 0x..." block per thread, the innermost call first).
"""
from __future__ import annotations

import faulthandler
import os
import signal
import tempfile
import time
from pathlib import Path
from typing import IO

# Unused elsewhere: SIGUSR2 is app/launch.py's (failures.BAD_INPUT_SIGNAL), torchrun's agent handles
# SIGTERM, SIGINT, SIGHUP and SIGQUIT, Slurm sends SIGUSR1 to the batch shell (scripts/train.sbatch).
STACKS_SIGNAL = signal.SIGRTMIN + 1
FOLDER = "hangs"
ANSWER_WAIT_S = 1.0         # how long `ask` waits for a live process's stacks (faulthandler: milliseconds)

_armed: IO[str] | None = None


def _armed_path(pid: int) -> Path:
    """Where process `pid` of this host writes its stacks when asked."""
    return Path(tempfile.gettempdir()) / "app-stacks" / f"{pid}.txt"


def arm() -> None:
    """From now on STACKS_SIGNAL makes this process write every thread's stacks to its armed file."""
    global _armed
    path = _armed_path(os.getpid())
    path.parent.mkdir(exist_ok=True)
    for left in path.parent.glob("*.txt"):      # of processes killed before they could disarm
        if left.stem.isdigit() and process_state(int(left.stem)) is None:
            left.unlink(missing_ok=True)
    _armed = open(path, "w")
    os.set_inheritable(_armed.fileno(), False)
    faulthandler.register(STACKS_SIGNAL, file=_armed, all_threads=True, chain=False)


def disarm() -> None:
    """A process that ends on purpose leaves no armed file behind."""
    global _armed
    if _armed is None:
        return
    faulthandler.unregister(STACKS_SIGNAL)
    _armed.close()
    Path(_armed.name).unlink(missing_ok=True)
    _armed = None


def dump_own(run_dir: Path, rank: int, why: str) -> Path:
    """This process's stacks, every thread, to a new file in the run directory; its path."""
    out = _new_file(run_dir, rank, os.getpid())
    with open(out, "w") as f:
        f.write(f"# rank {rank} pid {os.getpid()}: {why}\n")
        f.flush()
        faulthandler.dump_traceback(file=f, all_threads=True)
    return out


def ask(run_dir: Path, rank: int, pid: int, why: str) -> str:
    """Ask process `pid` of this host (rank `rank`) for its stacks; what became of them, in words."""
    state = process_state(pid)
    if state is None:
        return f"rank {rank} (pid {pid}) is gone"
    if state in ("T", "t"):
        return f"rank {rank} (pid {pid}) is stopped and cannot answer: no stacks"
    armed = _armed_path(pid)
    if not armed.exists():
        # Not a process that armed itself: on a host whose containers share its name but not their PID
        # namespaces or /tmp, the peer's pid is another process here (a launcher, whom the signal would end).
        return f"rank {rank} (pid {pid}) is not a process of this host that answers (another container?): not asked"
    start = armed.stat().st_size
    try:
        os.kill(pid, STACKS_SIGNAL)
    except OSError as exc:
        return f"rank {rank} (pid {pid}) cannot be asked: {exc.strerror}"
    text = _answer(armed, start)
    if not text:
        return f"rank {rank} (pid {pid}) did not answer within {ANSWER_WAIT_S:g} s"
    out = _new_file(run_dir, rank, pid)
    out.write_text(f"# rank {rank} pid {pid}, asked by pid {os.getpid()}: {why}\n{text}")
    return f"rank {rank} (pid {pid}) in {out}"


def _answer(armed: Path, start: int) -> str:
    """What the asked process appended to its armed file once it stops growing ('' if nothing came)."""
    deadline, size = time.monotonic() + ANSWER_WAIT_S, start
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = armed.stat().st_size if armed.exists() else 0
        if now > start and now == size:
            with open(armed) as f:
                f.seek(start)
                return f.read()
        size = now
    return ""


def _new_file(run_dir: Path, rank: int, pid: int) -> Path:
    folder = Path(run_dir) / FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime()) + f".{int(time.time() * 1000) % 1000:03d}"
    return folder / f"{stamp}-rank{rank}-pid{pid}.txt"


def process_state(pid: int) -> str | None:
    """The kernel's one-letter state of a process (R, S, D, T stopped, t traced, Z); None if gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None
