"""How a training process ends when something goes wrong: what the failure was, and the exit it takes.

Exit statuses (app/train.py's and app/job/'s `run`, and the os._exit paths of threads that find a fault):
    0    done
    1    a peer was lost (killed, hung, cut off): the step is kept, the launcher restarts the group
    2    bad input (UserError): restarting cannot help; app/launch.py reports it as such
    3    restarts without progress (app/progress.py): the launcher, the container or Slurm gave up
    4    app/launch.py only: the job has finished and closed its rendezvous; joining it cannot help
    130  Ctrl-C
    143  SIGTERM from the launcher (a membership change, a stop): the step is kept

A lost peer is told apart from a bug by the exception's type wherever torch gives one (NCCL and the
store raise torch.distributed.DistError subclasses). gloo does not: a peer that died or went silent
surfaces as a plain RuntimeError whose text starts with the gloo source file that raised it. That
one fact is pinned by tests/test_failures.py, which kills a real gloo peer and classifies what the
survivor gets (checked against torch 2.14.1).
"""
from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from typing import Mapping

EXIT_DONE, EXIT_PEER_LOST, EXIT_BAD_INPUT, EXIT_NO_PROGRESS, EXIT_INTERRUPTED, EXIT_TERMINATED = 0, 1, 2, 3, 130, 143
EXIT_RDZV_CLOSED = 4

# gloo's errors name the source file of its transport or of the collective that failed, e.g.
# "[.../gloo/transport/tcp/pair.cc:561] Connection closed by peer" or "[.../gloo/transport/tcp/
# unbound_buffer.cc:81] Timed out waiting 5000ms for recv operation to complete".
_GLOO_SOURCE = "/gloo/"


def peer_lost(exc: BaseException) -> bool:
    """Did this failure come from the communication with a peer that is gone (killed, hung, cut off)?"""
    import torch.distributed as dist   # here: the launcher reads this module's statuses without importing torch

    if isinstance(exc, dist.DistError):
        return True
    return isinstance(exc, RuntimeError) and _GLOO_SOURCE in str(exc).split("]", 1)[0]


def timed_out(exc: BaseException) -> bool:
    """Did a collective run out its timeout (a peer alive but stuck, or hung) rather than see it go?
    gloo says "Timed out waiting ...", NCCL's watchdog "... collective operation timeout"."""
    line = first_line(exc).lower()
    return "timed out" in line or "timeout" in line


def first_line(exc: BaseException, limit: int = 200) -> str:
    """The first line of an exception's text (its type when it has none): what a one-line report shows."""
    text = str(exc).strip()
    return text.splitlines()[0][:limit] if text else type(exc).__name__


def short_cause(message: str) -> str:
    """gloo's '[/path/pair.cc:545] Read error [addr]: Connection reset by peer. This is typically...' -> its cause."""
    first = message.splitlines()[0] if message else "unknown error"
    return re.sub(r"^\[[^\]]*\] ", "", first).split(". ")[0]


def tell_launcher(line: str) -> None:
    """Leave this process's one error line where torchrun's agent reads it (TORCHELASTIC_ERROR_FILE, in
    the format of torch's ErrorHandler), so app/launch.py's summary can repeat it."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        with open(path, "w") as f:
            json.dump({"message": line, "timestamp": int(time.time())}, f)
    except OSError:
        pass        # the summary then points at the line printed above instead


# Set by app/launch.py for its workers: "<launcher pid>:<file>". Bad input ends the launch at once:
# torchrun would restart the worker group on it up to --max-restarts times, each failing the same way.
BAD_INPUT_ENV = "APP_LAUNCH_BAD_INPUT"
BAD_INPUT_SIGNAL = signal.SIGUSR2       # torchrun's agent handles SIGTERM, SIGINT, SIGHUP, SIGQUIT only


class BadInput(Exception):
    """Raised in the launcher's main thread when a worker reported bad input (stop_restarts): the launcher
    then stops its workers instead of restarting them, and says the worker's line once."""


def summary(exitcodes: list[int], rank: int, said: str | None) -> tuple[str, int]:
    """The launcher's one line for its failed workers (their exit statuses; `rank` failed first and
    said `said`, its own error line or the signal that ended it; None: it printed its own), and its exit
    status: 2 when every worker said bad input."""
    codes = sorted(set(exitcodes))
    line = (f"error: {len(exitcodes)} training process(es) failed (exit {', '.join(map(str, codes))}); "
            f"rank {rank} first: {said or 'its error line is above'}")
    return line, EXIT_BAD_INPUT if codes == [EXIT_BAD_INPUT] else EXIT_PEER_LOST


def stop_restarts(message: str) -> bool:
    """Bad input: tell app/launch.py (if it launched this process) not to restart the workers.
    True when the launcher was told: it prints the line itself, once for the node, because it stops
    every worker at once and a worker's own print could be cut off by that stop."""
    pid, _, path = os.environ.get(BAD_INPUT_ENV, "").partition(":")
    if not pid.isdigit():
        return False
    try:
        with open(path, "x") as f:      # the first rank's line; the others' are the same story
            f.write(message)
    except OSError:
        pass
    try:
        os.kill(int(pid), BAD_INPUT_SIGNAL)
    except OSError:
        return False        # the launcher is gone already
    return True


def exit_process(status: int) -> None:
    """End a training process with `status` without the interpreter's finalization.

    gloo's worker threads destroy a finished collective's work object, which holds a Python object
    in its thread-local state (with torch._dynamo imported, as every fused or foreach optimizer
    does); when that happens during finalization, the thread's wait for the GIL ends it with
    pthread_exit, whose unwinding through a noexcept destructor aborts the process ("terminate
    called without an active exception", exit -6). Seen at the end of a quarter of DDP runs with
    torch 2.14.1 (core dump: ProcessGroupGloo::runLoop -> ~AsyncAllreduceWork -> ~ThreadLocalState ->
    gil_scoped_acquire); torchrun then restarts a rank that had finished. Everything this process
    writes is closed by then: only stdio needs flushing."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def leave(line: str, status: int = EXIT_PEER_LOST) -> None:
    """Print one line and end the process now, from any thread (the main one may be stuck in a collective)."""
    print(line, file=sys.stderr, flush=True)
    tell_launcher(line)
    os._exit(status)


def prints_errors(own: bool, environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process prints an error that ends it. An error of its own (a lost peer) is printed
    by every rank that has it; an error every rank of a node meets alike (bad input, a refused job
    secret) by the node's local rank 0, so that each node's log says once why it stopped. Read from
    the launcher's variables: the error may come before the World exists."""
    env = os.environ if environ is None else environ
    return own or env.get("LOCAL_RANK", env.get("SLURM_LOCALID", "0")) == "0"


def error_line(line: str, own: bool) -> None:
    """A process's last error line: the launcher's summary repeats the first rank's, and the rank prints
    it where prints_errors says so."""
    tell_launcher(line)
    if prints_errors(own):
        print(line, file=sys.stderr, flush=True)


def bad_input(exc: Exception) -> int:
    """Bad input's one `error:` line (said by the launcher when it was told, else by this process) and
    its exit status."""
    tell_launcher(f"error: {exc}")
    if not stop_restarts(str(exc)):
        error_line(f"error: {exc}", own=False)
    return EXIT_BAD_INPUT
