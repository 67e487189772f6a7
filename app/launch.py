"""torchrun with the project's fault policy: `python -m app.launch` takes torchrun's own arguments.

    python -m app.launch --standalone --nproc-per-node=4 -m app.train            # one node
    python -m app.launch --nnodes=1:2 --nproc-per-node=4 --rdzv-endpoint=HOST:29400 \
        --rdzv-id=job1 -m app.train                                              # each node

What it adds to plain torchrun, each a default that an explicit argument overrides:
- the rendezvous timings, restarts and monitor interval of app/core/policy.py (torchrun's own
  defaults wait 30 s of last call at every start and 15 s for a dead node's keep-alive, and never
  restart a failed worker), the c10d backend when an endpoint is given, and a fresh worker store
  per rendezvous round (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: with the shared one, agents keep a
  store address that goes stale when a node that comes back takes rank 0, pytorch#135712);
- a rendezvous name no earlier incarnation of this node had (see `_unique_node_names`);
- a watcher that kills its own workers once they have been stopped (SIGSTOP) past the heartbeat
  timeout, so the node can rejoin (torchrun waits 30 s on a SIGTERM a stopped process never handles);
- one summary line when the workers fail, with the failing rank's own error line, instead of
  torchrun's ChildFailedError traceback; exit status 2 when every failure was bad input;
- one line and exit status 4, instead of torchrun's RendezvousClosedError traceback, when the job
  has finished and closed its rendezvous (a node joining it late, or a finished job started again);
- no restarts after bad input: a worker that stops on a UserError signals this launcher
  (app/recovery/failures.py `stop_restarts`), which stops the group instead of restarting it
  --max-restarts times into the same error;
- no endless restarts without progress: before each restart after a failure, the committed step
  this node sees must have moved within MAX_NO_PROGRESS_RESTARTS restarts (app/progress.py),
  else the group is stopped with one line naming the last failure, exit status 3;
- a node of one standalone app.train process (the survivor modes' node on a CPU host) is started
  and restarted here without torchrun (app/cluster/solo.py), so that only the trainer imports torch.
"""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import sys
import tempfile
import threading
import time
from argparse import Namespace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from app.core.config import endpoint, parse as parse_config
from app.core.errors import UserError
from app import progress
from app.cluster import solo
from app.recovery.failures import (BAD_INPUT_ENV, BAD_INPUT_SIGNAL, EXIT_BAD_INPUT, EXIT_NO_PROGRESS, EXIT_RDZV_CLOSED,
                                    BadInput, short_cause, summary)
from app.core.policy import FaultPolicy
from app.recovery.stacks import process_state

if TYPE_CHECKING:
    from app.core.config import Config


def torchrun_args(argv: Sequence[str], policy: FaultPolicy) -> Namespace:
    """torchrun's parsed arguments with the policy's defaults under the user's own."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import DEFAULT_PORT
    from torch.distributed.run import parse_args

    given = list(argv)
    defaults = [f"--max-restarts={policy.max_restarts}", f"--monitor-interval={policy.monitor_interval_s:g}"]
    as_given = parse_args(given)
    if as_given.rdzv_endpoint and not as_given.standalone:
        defaults.append("--rdzv-backend=c10d")
    args = parse_args(defaults + given)     # argparse keeps the last value: the user's
    if args.rdzv_endpoint:     # torch's own check of it is a traceback from inside the agent
        endpoint(args.rdzv_endpoint, "--rdzv-endpoint", default_port=DEFAULT_PORT)
    if args.standalone or args.rdzv_backend == "c10d":
        conf = {k: str(v) for k, v in policy.rdzv_conf().items()}
        conf.update(_conf_pairs(args.rdzv_conf))
        args.rdzv_conf = ",".join(f"{k}={v}" for k, v in conf.items())
    return args


def _conf_pairs(text: str) -> dict[str, str]:
    pairs = [p.split("=", 1) for p in text.split(",") if p.strip()]
    if any(len(p) != 2 for p in pairs):
        raise UserError(f"--rdzv-conf takes key=value pairs separated by commas, got {text!r}")
    return {k.strip(): v.strip() for k, v in pairs}


def _trainer_config(args: Namespace) -> Config | None:
    """The trainer's config when the workers are app.train (it also checks the policy's order, in one
    error line); None for another program."""
    if not args.module or args.training_script != solo.MODULE:
        return None
    return parse_config(args.training_script_args)


def _policy_for(cfg: Config | None) -> FaultPolicy:
    """The policy, the trainer's own where the workers are app.train (its two flags in it, checked
    when its config was parsed)."""
    return FaultPolicy.from_env().check() if cfg is None else cfg.fault_policy()


# ---------------------------------------------------------------- node names

def _unique_node_names() -> None:
    """Start this agent's rendezvous node counter at a random 48-bit number.

    The c10d rendezvous names a node "<addr>_<pid>_<n>", n counting from 0 in each agent. A node
    container with a fixed address starts its agent under the same pid in every fresh PID namespace,
    so a restarted node would come back under its old name, which the rendezvous still lists as a
    participant of the last round (it then believes it is already in, and waits forever). torch has
    no public way to name a node: this sets the private counter of DynamicRendezvousHandler's node
    generator (checked against torch 2.14.1; tests/test_launch.py fails if the attribute moves).
    """
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    DynamicRendezvousHandler._node_desc_generator._local_id = secrets.randbits(48)


# ---------------------------------------------------------------- stopped workers

def reap_stopped_workers(grace_s: float, poll_s: float = 0.5, stop: threading.Event | None = None) -> None:
    """SIGKILL a worker of this agent that has been stopped (state T: SIGSTOP, a frozen cgroup) for
    grace_s. Its peers see its heartbeat stop and leave within that time, but the next rendezvous
    round cannot form while this agent waits on it. A stopped process can save nothing anyway; the
    survivors have kept the step. Runs for the agent's life, or until `stop` is set."""
    stopped_since: dict[int, float] = {}
    stop = stop or threading.Event()
    while not stop.is_set():
        now = time.monotonic()
        for pid in _children(os.getpid()):
            if process_state(pid) != "T":
                stopped_since.pop(pid, None)
            elif now - stopped_since.setdefault(pid, now) >= grace_s:
                # Its Python stacks cannot be taken (app/recovery/stacks.py): a stopped process runs no handler.
                print(f"[node] worker pid {pid} has been stopped for {grace_s:g} s: killing it so that this "
                      "node can rejoin (hang stacks: it is stopped and cannot answer; its peers leave theirs)",
                      file=sys.stderr, flush=True)
                os.kill(pid, signal.SIGKILL)
                stopped_since.pop(pid)
        stop.wait(poll_s)


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    try:
        return [int(child) for child in path.read_text().split()]
    except OSError:
        return []


# ---------------------------------------------------------------- failures

def failure_summary(exc: Exception) -> tuple[str, int]:
    """One line for torchrun's ChildFailedError, and the exit status: 2 when every worker said bad input."""
    rank, first = exc.get_first_failure()       # the earliest: the root cause
    # The trainer's own line (app/train.py), or the signal; else it printed its own.
    said = first.message if os.path.isfile(first.error_file) or first.exitcode < 0 else None
    return summary([f.exitcode for f in exc.failures.values()], rank, said)


def _bound_restarts(bound: progress.RestartBound) -> None:
    """Ask the bound before each restart of a failed worker group (a membership change restarts a
    healthy one: not counted). torch has no hook there: this wraps LocalElasticAgent's private
    _monitor_workers (to keep the last failure) and _restart_workers (checked against torch 2.14.1;
    tests/test_launch.py fails if they move). NoProgress then leaves the agent's run, which stops
    the workers on its way out."""
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    monitor, restart = LocalElasticAgent._monitor_workers, LocalElasticAgent._restart_workers
    last = ["the worker group was unhealthy"]

    def monitored(agent: LocalElasticAgent, group: Any) -> Any:
        result = monitor(agent, group)
        if result.failures:
            line, _ = failure_summary(ChildFailedError(group.spec.get_entrypoint_name(), result.failures))
            last[0] = line.removeprefix("error: ")
        return result

    def restarting(agent: LocalElasticAgent, group: Any) -> None:
        if group.state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
            bound.restarting(last[0])
        restart(agent, group)

    LocalElasticAgent._monitor_workers, LocalElasticAgent._restart_workers = monitored, restarting


FOLDER_PREFIX = "app-launch-"     # a launcher's own folder (the bad-input line): app-launch-PID-random


def remove_orphaned_folders(tmp: Path) -> None:
    """Remove the folders of launchers that are gone: one killed outright (SIGKILL, the OOM killer)
    leaves its folder behind, and the test suite alone left 159 in a day."""
    for folder in tmp.glob(f"{FOLDER_PREFIX}*-*"):
        pid = folder.name.removeprefix(FOLDER_PREFIX).split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)     # another user's, or just gone: theirs to remove


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass            # another user's process
    return True


def _listen_for_bad_input(folder: str) -> str:
    """Arm the signal a worker sends on bad input; returns the file it leaves its line in."""
    path = os.path.join(folder, "bad-input")
    os.environ[BAD_INPUT_ENV] = f"{os.getpid()}:{path}"

    def stop(signum: int, frame: object) -> None:
        signal.signal(BAD_INPUT_SIGNAL, signal.SIG_IGN)     # once: every rank may send it
        raise BadInput()

    signal.signal(BAD_INPUT_SIGNAL, stop)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    given = list(sys.argv[1:] if argv is None else argv)
    alone = solo.parse(given)
    try:
        args = None if alone else torchrun_args(given, FaultPolicy.from_env())
        cfg = parse_config(alone.script_args) if alone else _trainer_config(args)
        policy = _policy_for(cfg)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    threading.Thread(target=reap_stopped_workers, args=(policy.stopped_worker_grace_s,), daemon=True).start()
    remove_orphaned_folders(Path(tempfile.gettempdir()))
    ended = _workers(alone, args, cfg, policy)
    if ended is None:
        return 0
    print(ended[0], file=sys.stderr, flush=True)
    return ended[1]


def _workers(alone: solo.Solo | None, args: Namespace | None, cfg: Config | None,
             policy: FaultPolicy) -> tuple[str, int] | None:
    """The workers to their end, started by this process (one standalone trainer: app/cluster/solo.py)
    or by torchrun's agent: None once they finished, else the launcher's last line and exit status."""
    bound = None if cfg is None else progress.RestartBound(
        policy.max_no_progress_restarts, lambda: progress.committed_step(cfg.run_dir, cfg.snapshot_dir))
    with tempfile.TemporaryDirectory(prefix=f"{FOLDER_PREFIX}{os.getpid()}-") as folder:
        said = _listen_for_bad_input(folder)
        try:
            if alone is not None:
                return solo.run(alone, policy.max_restarts, bound.restarting, Path(folder))
            return _torchrun(args, bound)
        except BadInput:
            reason = open(said).read().strip() if os.path.exists(said) else "see the line above"
            return f"error: {reason} (bad input: the training processes were not restarted)", EXIT_BAD_INPUT
        except progress.NoProgress as exc:
            return str(exc), EXIT_NO_PROGRESS


def _torchrun(args: Namespace, bound: progress.RestartBound | None) -> tuple[str, int] | None:
    """torchrun's agent with its workers, to their end: None once they finished, else the launcher's
    last line and exit status."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousClosedError
    from torch.distributed.run import run

    _unique_node_names()
    _close_the_rendezvous_only_at_the_end()
    if bound is not None:
        _bound_restarts(bound)
    try:
        run(args)
    except ChildFailedError as exc:
        return failure_summary(exc)
    except RendezvousClosedError:
        return (f"error: job '{args.rdzv_id}' has finished and closed its rendezvous at {args.rdzv_endpoint}; "
                "continue it under a new rendezvous id (--rdzv-id; RDZV_ID in containers): it resumes from its "
                "last snapshot"), EXIT_RDZV_CLOSED
    except SignalException as exc:
        # SIGTERM (a Slurm requeue, docker stop): torchrun has passed it on to the workers, which
        # say what they kept; its own exception would be a traceback. Status 1, as torchrun's.
        return f"launcher stopped by {exc.sigval.name}", 1
    except RuntimeError as exc:     # the agent's own (DistStoreError: a rendezvous round's read timed out)
        return (f"error: this node's launcher failed ({short_cause(str(exc))}); the rendezvous stays open: "
                "start the node again to rejoin"), 1
    return None


def _close_the_rendezvous_only_at_the_end() -> None:
    """torchrun's agent closes the rendezvous for good whenever it ends other than by a signal
    (launch_agent's `finally`): after a failure of its own too, such as a store read in a rendezvous
    round that timed out while a peer was killed, and then every other node took the job for finished
    and stopped. Only an agent whose workers all finished closes it here; any other just stops its
    keep-alives, as a signalled one does. Wraps the agent's run and DynamicRendezvousHandler.shutdown
    (its private _stop_heartbeats: checked against torch 2.14.1; tests/test_launch.py fails if it moves)."""
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent, WorkerState
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    agent_run, shutdown, finished = SimpleElasticAgent.run, DynamicRendezvousHandler.shutdown, threading.Event()

    def run_and_note(agent: Any, *args: Any, **kwargs: Any) -> Any:
        result = agent_run(agent, *args, **kwargs)
        if result.state == WorkerState.SUCCEEDED:
            finished.set()
        return result

    def shutdown_at_the_end(handler: DynamicRendezvousHandler) -> bool:
        if finished.is_set():
            return shutdown(handler)
        handler._stop_heartbeats()
        return True

    SimpleElasticAgent.run, DynamicRendezvousHandler.shutdown = run_and_note, shutdown_at_the_end


if __name__ == "__main__":
    sys.exit(main())
