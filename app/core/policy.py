"""The fault-timing budget: every number that decides how fast a fault is found and recovered from.

One owner. The trainer's flags (--heartbeat-timeout, --collective-timeout), the launcher that wraps
torchrun (app/launch.py: rendezvous timings, restarts, the monitor interval), the container
entrypoint (rejoin attempts), compose.yaml (the stop grace, the store port), scripts/train.sbatch and
the chaos runner all take their values from FaultPolicy; tests/test_policy.py checks the shell and
compose files against it. The numbers depend on each other, and `check()` says, in one line naming
both settings, when a pair is in the wrong order:

    heartbeat interval  <  heartbeat timeout  <  collective timeout
        several beats fit in the timeout, and a hung peer is declared (and the step kept) before the
        collective that waits for it fails on its own
    just-in-time snapshot budget  <  torchrun's worker stop grace  <  container stop grace
        a snapshot written on the way out finishes before torchrun, then docker, kill the process
    monitor interval  <  rendezvous last call
        every surviving agent notices the failure and reaches the next round before it closes;
        one that misses it costs a second restart
    rendezvous keep-alive interval  <  keep-alive interval x attempts (the dead-node window)
    heartbeat interval (either)  <  slow-node window
        a node is named slow on many step times, each published with a beat (app/recovery/slow.py)

Every field can be overridden by the environment variable named in its metadata (the trainer's
two through their TRAIN_* flags). Seconds are floats except where torch's rendezvous reads whole
seconds (`get_as_int`).
"""
from __future__ import annotations

import dataclasses
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from app.core.errors import UserError, one_line_errors

# torch.distributed.elastic's LocalElasticAgent stops its workers with SIGTERM and sends SIGKILL
# after this long (`_shutdown(..., timeout=30)`, not settable from torchrun; checked against torch
# 2.14.1 by tests/test_policy.py).
TORCHRUN_WORKER_STOP_GRACE_S = 30.0
# torchft's manager, between two tries of a quorum call that failed (see ft_quorum_retries).
FT_QUORUM_RETRY_PAUSE_S = 1.0
PORTS = range(1, 65536)     # a TCP port a store or a Lighthouse can listen on and be reached at


def _setting(default: Any, env: str, meaning: str) -> Any:
    return field(default=default, metadata={"env": env, "meaning": meaning})


@dataclass(frozen=True)
class FaultPolicy:
    # ---- inside the job: every rank
    heartbeat_interval_s: float = _setting(
        0.25, "HEARTBEAT_INTERVAL", "how often each rank beats through the job's store and reads the others' beats")
    heartbeat_timeout_s: float = _setting(
        3.0, "TRAIN_HEARTBEAT_TIMEOUT", "a peer silent this long is lost; the others keep their step and restart (0: off)")
    collective_timeout_s: float = _setting(
        30.0, "TRAIN_COLLECTIVE_TIMEOUT", "a collective, or forming the process group, fails after this (gloo's own: 30 min)")
    progress_floor_s: float = _setting(
        60.0, "PROGRESS_FLOOR", "a rank that beats but makes no step this long (at least) is stuck")
    progress_slack: float = _setting(
        10.0, "PROGRESS_SLACK", "... or this many times its slowest recent step, whichever is longer")
    jit_snapshot_budget_s: float = _setting(
        10.0, "JIT_SNAPSHOT_BUDGET", "how long a rank that lost a peer may spend writing its step before it leaves")
    sigterm_wait_s: float = _setting(
        2.0, "SIGTERM_WAIT", "after a failed collective, how long SIGTERM may still be on its way (a shutdown, not a loss)")
    rank0_first_s: float = _setting(
        1.0, "RANK0_FIRST", "how long the other ranks of rank 0's node let it claim a just-in-time snapshot first")
    # ---- the node's agent (torchrun, through app/launch.py)
    monitor_interval_s: float = _setting(
        1.0, "MONITOR_INTERVAL", "how often torchrun checks its workers")
    max_restarts: int = _setting(
        10, "MAX_RESTARTS", "worker-group restarts per agent before it gives up (a membership change counts none)")
    max_no_progress_restarts: int = _setting(
        3, "MAX_NO_PROGRESS_RESTARTS", "restarts in a row that find no newer committed step before the job ends "
        "(the agent's, a container's rejoins, Slurm's requeues: app/progress.py)")
    rdzv_keep_alive_interval_s: int = _setting(
        1, "RDZV_KEEP_ALIVE_INTERVAL", "how often an agent tells the rendezvous it is alive (torch: 5)")
    rdzv_keep_alive_max_attempt: int = _setting(
        3, "RDZV_KEEP_ALIVE_MAX_ATTEMPT", "missed keep-alives before the rendezvous drops a node (torch: 3)")
    rdzv_last_call_s: int = _setting(
        2, "RDZV_LAST_CALL_TIMEOUT", "once the minimum of nodes is in, how long a round waits for more (torch: 30)")
    rdzv_join_timeout_s: int = _setting(
        600, "RDZV_JOIN_TIMEOUT", "how long a node waits for the minimum of nodes")
    rdzv_read_timeout_s: int = _setting(
        60, "RDZV_READ_TIMEOUT", "a rendezvous store operation fails after this")
    rdzv_close_timeout_s: int = _setting(
        30, "RDZV_CLOSE_TIMEOUT", "how long a finished job waits for the others to see the rendezvous closed")
    # ---- the node container
    rejoin_attempts: int = _setting(
        10, "REJOIN_ATTEMPTS", "agent incarnations before a node container gives up")
    rejoin_pause_s: float = _setting(
        2.0, "REJOIN_PAUSE", "pause before a node whose agent died rejoins as a new node")
    stop_grace_s: float = _setting(
        60.0, "STOP_GRACE", "docker stop: SIGTERM, then SIGKILL after this (compose.yaml's stop_grace_period)")
    store_port: int = _setting(
        29400, "RDZV_PORT", "the rendezvous store's TCP port")
    # ---- the survivor modes (--ft torchft, --ft inplace): survivors keep training (app/ft/); the
    # FT_HEARTBEAT pair serves both, the others say their mode
    ft_quorum_tick_s: float = _setting(
        0.1, "FT_QUORUM_TICK", "torchft mode: how often the Lighthouse tries to form a quorum of the replica groups "
        "waiting")
    ft_join_timeout_s: float = _setting(
        1.0, "FT_JOIN_TIMEOUT", "torchft mode: how long a quorum waits for a beating replica group that has not "
        "asked to join")
    ft_heartbeat_interval_s: float = _setting(
        0.1, "FT_HEARTBEAT_INTERVAL", "how often a replica group beats to the Lighthouse (torchft), a member "
        "through the group store (inplace)")
    ft_heartbeat_timeout_s: float = _setting(
        1.0, "FT_HEARTBEAT_TIMEOUT", "how long a replica group (torchft) or a member (inplace) may be silent before "
        "it counts as gone: it is left out of the next quorum or generation, and its writer lease may be taken")
    ft_collective_timeout_s: float = _setting(
        3.0, "FT_COLLECTIVE_TIMEOUT", "torchft mode: the replica groups' all-reduce fails after this; the step is "
        "not committed")
    ft_quorum_timeout_s: float = _setting(
        600.0, "FT_QUORUM_TIMEOUT", "how long a replica group waits for a quorum (torchft), a member for a "
        "generation to form (inplace): the first nodes to arrive")
    ft_stage_wait_s: float = _setting(
        30.0, "FT_STAGE_WAIT", "torchft mode: how long a request for a live group's state waits for that step to be staged")
    # ---- inplace mode (--ft inplace)
    inplace_poll_s: float = _setting(
        0.02, "INPLACE_POLL", "inplace mode: how often a member closing a round looks at the store for arrivals")
    inplace_join_window_s: float = _setting(
        1.0, "INPLACE_JOIN_WINDOW", "inplace mode: a job's first round closes this long after its last arrival")
    inplace_round_timeout_s: float = _setting(
        30.0, "INPLACE_ROUND_TIMEOUT", "inplace mode: a round closes without a member that still beats but has not "
        "come this long (stuck); it comes back as a newcomer")
    inplace_job_gone_s: float = _setting(
        30.0, "INPLACE_JOB_GONE", "inplace mode: a job in the store whose members all stopped beating this long "
        "ago is over; a node with another secret may start a new one there")
    inplace_group_bound_s: float = _setting(
        20.0, "INPLACE_GROUP_BOUND", "inplace mode on NCCL: forming a group that has not returned this long ends the "
        "process in one line; an end that has not is left behind")
    inplace_stuck_groups: int = _setting(
        2, "INPLACE_STUCK_GROUPS", "inplace mode on NCCL: ends past INPLACE_GROUP_BOUND a process leaves behind and "
        "trains on; one more ends it")
    inplace_stall_s: float = _setting(
        1.0, "INPLACE_STALL", "inplace mode: a member whose all-reduce is pending this long probes its generation's "
        "peers over the data path (app/ft/reach.py); one it cannot reach ends the generation")
    inplace_probe_timeout_s: float = _setting(
        0.5, "INPLACE_PROBE_TIMEOUT", "inplace mode: a probe's TCP connect to a peer's data address not done within "
        "this counts that peer unreachable")
    inplace_form_bound_s: float = _setting(
        5.0, "INPLACE_FORM_BOUND", "inplace mode on gloo: a generation's group not connected within this is a failed "
        "round, retried with fresh reachability (gloo's own connect retries outlast its timeout across a cut link)")
    store_warning_interval_s: float = _setting(
        60.0, "STORE_WARNING_INTERVAL", "inplace mode: values in the group store that no member signed are said once this often")
    lighthouse_port: int = _setting(
        29510, "LIGHTHOUSE_PORT", "the torchft Lighthouse's TCP port (on the store's host)")
    # ---- slow nodes: alive and beating, only slow (app/recovery/slow.py judges them, in every mode)
    slow_factor: float = _setting(
        2.0, "SLOW_FACTOR", "a node whose ordinary steps take more than this many times the others' median, "
        "outside the collective wait, for SLOW_WINDOW is slow: named on every node")
    slow_window_s: float = _setting(
        10.0, "SLOW_WINDOW", "how long a node's steps stay that slow before it is named (and how long it keeps up "
        "again before it counts as keeping up)")
    slow_replace: int = _setting(
        1, "SLOW_REPLACE", "1: a slow node steps aside for a waiting spare, or while the others alone train "
        "faster, and waits (inplace mode); 2: the same, but it leaves the job; 0: slow nodes are only named")
    flap_stable_s: float = _setting(
        20.0, "FLAP_STABLE", "a node whose link went down again within this long of its return (a flapping link) "
        "is let back in only once its link has stayed up this long")

    # ------------------------------------------------------------ derived

    @property
    def dead_node_window_s(self) -> int:
        """Seconds without a keep-alive after which the rendezvous drops a node (torch's rule)."""
        return self.rdzv_keep_alive_interval_s * self.rdzv_keep_alive_max_attempt

    @property
    def stopped_worker_grace_s(self) -> float:
        """A worker stopped (SIGSTOP) this long is killed by its own agent: its peers have left by then."""
        return self.heartbeat_timeout_s or self.collective_timeout_s

    @property
    def ft_quorum_retries(self) -> int:
        """How often a replica group's torchft manager asks the Lighthouse again after a quorum call
        failed (a Lighthouse that restarted mid-call). torchft pauses quorum timeout / (retries + 1)
        between tries: this makes the pause FT_QUORUM_RETRY_PAUSE_S. With torchft's default of no
        retry, the failed call was never answered and every group waited out the whole quorum timeout."""
        return max(0, math.ceil(self.ft_quorum_timeout_s / FT_QUORUM_RETRY_PAUSE_S) - 1)

    def rdzv_conf(self) -> dict[str, int | str]:
        """torchrun's --rdzv-conf for the c10d backend (unknown keys are silently ignored by torch)."""
        return {"join_timeout": self.rdzv_join_timeout_s, "last_call_timeout": self.rdzv_last_call_s,
                "read_timeout": self.rdzv_read_timeout_s, "close_timeout": self.rdzv_close_timeout_s,
                "keep_alive_interval": self.rdzv_keep_alive_interval_s,
                "keep_alive_max_attempt": self.rdzv_keep_alive_max_attempt}

    # ------------------------------------------------------------ order

    def check(self) -> "FaultPolicy":
        """Raise UserError naming the first two settings that are in the wrong order; self otherwise."""
        for name in _POSITIVE:
            if not getattr(self, name) > 0:
                raise UserError(f"{_label(name)} must be positive, got {getattr(self, name)}")
        for name in ("store_port", "lighthouse_port"):
            check_port(getattr(self, name), _label(name))
        if not self.slow_factor > 1:
            raise UserError(f"{_label('slow_factor')} must be more than 1 (a node slower than the others), "
                            f"got {self.slow_factor:g}")
        if self.slow_replace not in (0, 1, 2):
            raise UserError(f"{_label('slow_replace')} must be 1 (a slow node waits aside), 2 (it leaves) or 0 (off), "
                            f"got {self.slow_replace}")
        if self.heartbeat_timeout_s < 0:
            raise UserError(f"{_label('heartbeat_timeout_s')} must be zero (off) or more, got {self.heartbeat_timeout_s}")
        pairs = [("rdzv_keep_alive_interval_s", self.rdzv_keep_alive_interval_s, "dead_node_window_s",
                  self.dead_node_window_s),
                 ("monitor_interval_s", self.monitor_interval_s, "rdzv_last_call_s", self.rdzv_last_call_s),
                 ("jit_snapshot_budget_s", self.jit_snapshot_budget_s, "torchrun's worker stop grace",
                  TORCHRUN_WORKER_STOP_GRACE_S),
                 ("torchrun's worker stop grace", TORCHRUN_WORKER_STOP_GRACE_S, "stop_grace_s", self.stop_grace_s)]
        pairs += [("ft_quorum_tick_s", self.ft_quorum_tick_s, "ft_heartbeat_timeout_s", self.ft_heartbeat_timeout_s),
                  ("ft_heartbeat_interval_s", self.ft_heartbeat_interval_s, "ft_heartbeat_timeout_s",
                   self.ft_heartbeat_timeout_s),
                  ("ft_heartbeat_timeout_s", self.ft_heartbeat_timeout_s, "ft_collective_timeout_s",
                   self.ft_collective_timeout_s),
                  ("heartbeat_interval_s", self.heartbeat_interval_s, "slow_window_s", self.slow_window_s),
                  ("ft_heartbeat_interval_s", self.ft_heartbeat_interval_s, "slow_window_s", self.slow_window_s)]
        if self.heartbeat_timeout_s:
            pairs[:0] = [("heartbeat_interval_s", self.heartbeat_interval_s, "heartbeat_timeout_s",
                          self.heartbeat_timeout_s),
                         ("heartbeat_timeout_s", self.heartbeat_timeout_s, "collective_timeout_s",
                          self.collective_timeout_s)]
        for shorter, a, longer, b in pairs:
            if not a < b:
                raise UserError(f"{_label(shorter)} ({a:g} s) must be shorter than {_label(longer)} ({b:g} s): "
                                f"{_WHY.get((shorter, longer)) or _WHY[shorter]}")
        return self

    # ------------------------------------------------------------ sources

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **given: Any) -> "FaultPolicy":
        """The defaults, overridden by environment variables, then by `given` (e.g. the trainer's flags)."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            raw = environ.get(f.metadata["env"], "").strip()
            if raw:
                try:
                    values[f.name] = _number(f.type, raw)
                except ValueError:
                    raise UserError(f"{f.metadata['env']}={raw!r}: expected a number of "
                                    f"{'whole ' if f.type == 'int' else ''}seconds or a count") from None
        values.update({k: v for k, v in given.items() if v is not None})
        return cls(**values)

    def shell(self, names: Sequence[str]) -> str:
        """`NAME=value` lines for a shell script, for the variables it names:
        `eval "$(python -m app.core.policy REJOIN_ATTEMPTS REJOIN_PAUSE)"`."""
        by_env = {f.metadata["env"]: f.name for f in dataclasses.fields(self)}
        unknown = [n for n in names if n not in by_env]
        if unknown:
            raise UserError(f"no fault-policy setting {', '.join(unknown)}: the settings are {', '.join(by_env)}")
        return "\n".join(f"{n}={_format(getattr(self, by_env[n]))}" for n in names)


_POSITIVE = ("heartbeat_interval_s", "collective_timeout_s", "progress_floor_s", "progress_slack",
             "jit_snapshot_budget_s", "sigterm_wait_s", "monitor_interval_s", "rdzv_keep_alive_interval_s",
             "rdzv_keep_alive_max_attempt", "rdzv_last_call_s", "rdzv_join_timeout_s", "rdzv_read_timeout_s",
             "rdzv_close_timeout_s", "rejoin_attempts", "max_no_progress_restarts", "stop_grace_s", "store_port",
             "ft_quorum_tick_s", "ft_join_timeout_s", "ft_heartbeat_interval_s", "ft_heartbeat_timeout_s", "ft_collective_timeout_s",
             "ft_quorum_timeout_s", "ft_stage_wait_s", "inplace_poll_s", "inplace_join_window_s",
             "inplace_round_timeout_s", "inplace_job_gone_s", "inplace_group_bound_s", "inplace_stuck_groups", "inplace_stall_s",
             "inplace_probe_timeout_s", "inplace_form_bound_s", "store_warning_interval_s",
             "lighthouse_port", "slow_window_s", "flap_stable_s")
_WHY: dict[str | tuple[str, str], str] = {     # by the shorter setting, or by the pair where it has two
    "heartbeat_interval_s": "a peer must have several chances to beat before it counts as lost",
    "heartbeat_timeout_s": "a hung peer must be declared lost (and the step kept) before the collective "
                           "waiting for it fails on its own",
    "rdzv_keep_alive_interval_s": "a node must get several keep-alives in before the rendezvous drops it",
    "monitor_interval_s": "every surviving agent must notice the failure and join the next round before its "
                          "last call closes it",
    "jit_snapshot_budget_s": "the snapshot a rank writes on its way out must finish before torchrun kills it",
    "ft_quorum_tick_s": "the Lighthouse must look for a quorum several times before it drops a silent replica group",
    "ft_heartbeat_interval_s": "a replica group or member must have several chances to beat before it counts as gone",
    "ft_heartbeat_timeout_s": "a hung replica group must be out of the quorum before the survivors' all-reduce "
                              "waiting for it times out, or the next step waits for it again",
    ("heartbeat_interval_s", "slow_window_s"): "a node is judged slow on many step times, each published with a beat",
    ("ft_heartbeat_interval_s", "slow_window_s"): "a node is judged slow on many step times, each published with a "
                                                  "beat",
    "torchrun's worker stop grace": "on docker stop, torchrun must be done stopping its workers (and their "
                                    "snapshot) before docker kills the container",
}


def _label(name: str) -> str:
    """How a setting is named to the user: its flag or variable."""
    fields = {f.name: f for f in dataclasses.fields(FaultPolicy)}
    if name == "dead_node_window_s":
        return "RDZV_KEEP_ALIVE_INTERVAL x RDZV_KEEP_ALIVE_MAX_ATTEMPT"
    if name not in fields:
        return name
    env = fields[name].metadata["env"]
    return "--" + env[len("TRAIN_"):].lower().replace("_", "-") if env.startswith("TRAIN_") else env


def _number(kind: Any, raw: str) -> int | float:
    value = int(raw) if kind in (int, "int") else float(raw)
    if not math.isfinite(value):
        raise ValueError(raw)       # float() takes inf and nan: no timing can be either
    return value


def check_port(port: int, label: str) -> int:
    """The port, if a TCP port can be it; else UserError naming the setting that gave it."""
    if port not in PORTS:
        raise UserError(f"{label}: port {port} is out of range ({PORTS.start} to {PORTS.stop - 1})")
    return port


def _format(value: float | int) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


DEFAULT = FaultPolicy()


def usage() -> str:
    """`--help`: how to call this module, and every setting with its value here and what it decides."""
    policy = FaultPolicy.from_env()
    rows = [f"  {f.metadata['env']}={_format(getattr(policy, f.name))}  {f.metadata['meaning']}"
            for f in dataclasses.fields(FaultPolicy)]
    return "\n".join(["usage: python -m app.core.policy NAME...", "Prints the named fault-policy settings as "
                      "NAME=value lines for a shell, after checking their order. The settings:", *rows])


def main(names: Sequence[str]) -> None:
    """Print the named settings as shell variables, after checking the policy's order."""
    if any(name in ("-h", "--help") for name in names):
        print(usage())
        return
    print(FaultPolicy.from_env().check().shell(names))


if __name__ == "__main__":
    sys.exit(one_line_errors(lambda: main(sys.argv[1:])))
