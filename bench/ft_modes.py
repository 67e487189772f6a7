"""The fault-tolerance modes side by side: their pace with no fault, then a node killed and started
again, on this host; and one process alone for comparison.

    python -m bench.ft_modes                      # -> bench/ft_modes.json and a table
    python -m bench.ft_modes --kills 0 --seconds 140 --modes one-core,alone,elastic,inplace,torchft
                                                  # issue 28's table: the pace of each mode, no fault

Two nodes, one process each, on the default digits job (tiny CNN, batch 32 per process, a train row
every step), as the README's launch lines start them: elastic mode is two `app.launch --nnodes=1:2`
agents against one rendezvous endpoint; torchft mode is two `app.launch --standalone` replica groups
and a Lighthouse (`python -m app.ft.lighthouse`); inplace mode is two `app.launch --standalone`
nodes and a store (`python -m app.node store`, as the compose store service runs it). Each process
takes its own share of the host's cores (app/cluster/cores.py: nothing sets OMP_NUM_THREADS here). The
comparisons: `alone` is one plain `python -m app.train` (every core), `one-core` the same on the
first core only (as `taskset -c 0`).
Read from their shared metrics.jsonl:
- pace: steps per second over wall time at full size (2 nodes; 1 alone) from app.reporting.metrics.PACE_SETTLE_S
  after the first such row to --seconds later (app.reporting.metrics.pace); img/s: the pace times the
  images of a step, never a median of the rows' rates; vs one-core: img/s over one-core's.
For each kill (SIGKILL of the second node's agent and worker, then the same command again after
--down seconds):
- stall: the survivor's longest gap between train rows from the kill until it trains without the
  killed node (a row of a step that ended before the kill was noticed is not the end of it);
- restarted: whether the survivor's worker process was replaced (its pid, read from /proc);
- back: from the node's new start until a train row with both nodes again;
- lost: committed steps the survivor lost (its last step before the kill minus its first alone, +1).
The machine's load average is recorded beside each mode: on a shared machine the figures move with it.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from app.core.config import DATASET_DEFAULTS
from app.launch import _children
from app.core.policy import DEFAULT
from app.reporting import metrics
from app.reporting.metrics import PACE_SETTLE_S

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "ft_modes.json"
PY = [sys.executable, "-m"]
BATCH = DATASET_DEFAULTS["digits"]["batch_size"]       # images per process per step, the default job's


ALONE = ("alone", "one-core")      # one plain process, for comparison


def node_command(mode: str, port: int) -> list[str]:
    if mode in ALONE:
        return [*PY, "app.train"]
    if mode == "elastic":
        return [*PY, "app.launch", "--nnodes=1:2", "--nproc-per-node=1", f"--rdzv-endpoint=127.0.0.1:{port}",
                "--rdzv-id=bench-ft", "-m", "app.train"]
    meet = (["--lighthouse", f"http://127.0.0.1:{port}"] if mode == "torchft"
            else ["--group-store", f"127.0.0.1:{port}"])
    return [*PY, "app.launch", "--standalone", "--nproc-per-node=1", "-m", "app.train", "--ft", mode, *meet]


class Job:
    """Two nodes of one mode sharing one run directory (as the node containers of one host do), or
    one process alone."""

    def __init__(self, mode: str, port: int, flags: list[str], tmp: Path, nodes: int | None = None,
                 env: dict[str, str] | None = None) -> None:
        """nodes: 2 (1 in the ALONE modes) unless given; env: the nodes' environment (this one's by default)."""
        self.mode, self.port, self.flags, self.tmp = mode, port, flags, tmp
        self.world = nodes or (1 if mode in ALONE else 2)
        self.env = {**(os.environ if env is None else env), "RDZV_ID": f"bench-{os.getpid()}-{port}"}   # inplace: this run's keys
        self.env.pop("OMP_NUM_THREADS", None)               # each process takes its share (app/cluster/cores.py)
        if mode not in ALONE:
            self.env["LIGHTHOUSE_PORT"] = str(port)
        self.extra: list[subprocess.Popen] = []
        if mode == "torchft":
            self.extra.append(subprocess.Popen([*PY, "app.ft.lighthouse", "--host", "127.0.0.1"], cwd=REPO,
                                               env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        if mode == "inplace":       # its idle Lighthouse one port up
            store_env = {**self.env, "RDZV_PORT": str(port), "RDZV_BIND": "127.0.0.1",
                         "LIGHTHOUSE_PORT": str(port + 1)}
            self.extra.append(subprocess.Popen([*PY, "app.node", "store"], cwd=REPO, env=store_env,
                                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        self.nodes = [self.start(i) for i in range(self.world)]

    def start(self, i: int) -> subprocess.Popen:
        first_core = {min(os.sched_getaffinity(0))}
        return subprocess.Popen([*node_command(self.mode, self.port), *self.flags, "--run-dir", str(self.tmp / "run")],
                                cwd=REPO, env=self.node_env(i),
                                stdout=subprocess.DEVNULL, stderr=open(self.tmp / f"node{i}.err", "a"),
                                preexec_fn=(lambda: os.sched_setaffinity(0, first_core)) if self.mode == "one-core" else None)

    def node_env(self, i: int) -> dict[str, str]:
        """Node i's environment (its name; a subclass may add its own)."""
        return {**self.env, "FT_REPLICA_ID": f"n{i}"}

    def said(self, i: int) -> list[str]:
        """Node i's `error:` lines so far (why a process of it ended), the first three."""
        path = self.tmp / f"node{i}.err"
        lines = path.read_text(errors="replace").splitlines() if path.exists() else []
        return [line.strip()[:300] for line in lines if line.startswith("error:")][:3]

    def rows(self, event: str = "train") -> list[dict[str, Any]]:
        path = self.tmp / "run" / "metrics.jsonl"
        return [r for r in metrics.read(path) if r["event"] == event] if path.exists() else []

    def wait(self, condition: Any, timeout: float) -> dict[str, Any] | None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            found = next((r for r in self.rows() if condition(r)), None)
            if found:
                return found
            time.sleep(0.05)
        return None

    def kill(self, i: int) -> None:
        for pid in (*_children(self.nodes[i].pid), self.nodes[i].pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.nodes[i].wait()

    def stop(self) -> None:
        for i in range(len(self.nodes)):
            self.kill(i)
        for proc in self.extra:
            proc.kill()
            proc.wait()


def one_fault(job: Job, down_s: float, timeout: float) -> dict[str, Any]:
    """Node 1 killed, started again `down_s` later: the survivor's stall (its longest gap between rows
    up to its first row alone: a row of a step that ended before the kill does not end it), whether its
    process was replaced, the committed steps lost, the killed node's way back."""
    survivor = _children(job.nodes[0].pid)
    killed = time.time()
    before = max((r["step"] for r in job.rows() if r["time"] <= killed), default=0)
    job.kill(1)
    again = job.wait(lambda r: r["time"] > killed and r["world_size"] < job.world, timeout)
    rows = [r["time"] for r in job.rows() if killed - 5 < r["time"] <= (again or {"time": killed})["time"]]
    stall = max((b - a for a, b in zip(rows, rows[1:]) if b > killed), default=None) if again else None
    time.sleep(max(0.0, down_s - (time.time() - killed)))
    restarted_at = time.time()
    job.nodes[1] = job.start(1)
    back = job.wait(lambda r: r["time"] > restarted_at and r["world_size"] == 2, timeout)
    restarted = _children(job.nodes[0].pid) != survivor
    return {"stall_s": None if stall is None else round(stall, 2),
            "survivor_restarted": restarted,
            "lost_steps": None if again is None else max(0, before - again["step"] + 1),
            "back_s": None if back is None else round(back["time"] - restarted_at, 2),
            **({"survivor_said": job.said(0)} if restarted else {})}


def measure(mode: str, port: int, flags: list[str], args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as tmp:
        job = Job(mode, port, flags, Path(tmp))
        try:
            if job.wait(lambda r: r["world_size"] == job.world, args.timeout) is None:
                said = [line for i in range(job.world) for line in job.said(i)]
                return {"error": f"never trained at world size {job.world}", "said": said[:2]}
            load_before = os.getloadavg()[0]
            time.sleep(args.seconds)        # no fault: the pace
            steps_per_s = metrics.pace(job.rows(), job.world, until=time.time())
            result = {"threads": [r.get("threads") for r in job.rows("start")],
                      "steps_per_s": None if steps_per_s is None else round(steps_per_s, 1),
                      "images_per_s": None if steps_per_s is None else round(steps_per_s * BATCH * job.world),
                      "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)]}
            if mode in ALONE:
                return result
            faults = []
            for _ in range(args.kills):
                faults.append(one_fault(job, args.down, args.timeout))
                time.sleep(2)
            return {**result, "faults": faults, **_medians(faults)}
        finally:
            job.stop()


def _medians(faults: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in ("stall_s", "back_s", "lost_steps"):
        values = [f[key] for f in faults if f[key] is not None]
        out[f"median_{key}"] = round(statistics.median(values), 2) if values else None
    out["survivor_restarts"] = sum(f["survivor_restarted"] for f in faults)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ft_modes", description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=3)
    p.add_argument("--down", type=float, default=5.0, help="seconds a killed node stays down")
    p.add_argument("--seconds", type=float, default=60.0,
                   help=f"seconds of training with no fault, the pace counted after the first {PACE_SETTLE_S:g}")
    p.add_argument("--epochs", type=int, default=1000, help="long enough for the pace and every kill "
                   "(digits: 22 steps an epoch at world size 2); the job is stopped after them")
    p.add_argument("--timeout", type=float, default=180.0)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--modes", default="one-core,elastic,torchft,inplace",
                   help="comma-separated, measured in this order; also alone and one-core (one process, no "
                        "kill; put one-core first for the other modes' ratio to it)")
    args = p.parse_args(argv)
    if args.seconds <= PACE_SETTLE_S:
        p.error(f"--seconds must be more than the {PACE_SETTLE_S:g} s before the pace is counted")
    flags = ["--dataset", "digits", "--epochs", str(args.epochs), "--log-every-steps", "1", "--progress", "lines"]
    ports = {"elastic": DEFAULT.store_port + 9, "torchft": DEFAULT.lighthouse_port + 9,
             "inplace": DEFAULT.store_port + 19, "alone": 0, "one-core": 0}
    modes = args.modes.split(",")
    if set(modes) - set(ports):
        p.error(f"--modes: choose from {','.join(ports)}")
    # `timeout` or Ctrl-C: the nodes are stopped on the way out (measure's finally), not left training.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    print(f"{'mode':9} {'threads':>8} {'steps/s':>8} {'img/s':>6} {'vs one-core':>12} {'load':>11} "
          f"{'stall s':>8} {'back s':>7} {'lost':>5} {'survivor restarts':>18}", flush=True)
    results: dict[str, dict[str, Any]] = {}
    for mode in modes:      # each row as soon as it is measured; one-core's ratio needs one-core first
        r = results[mode] = measure(mode, ports[mode], flags, args)
        base = results.get("one-core", {}).get("images_per_s")
        r["vs_one_core"] = round(r["images_per_s"] / base, 2) if base and r.get("images_per_s") else None
        load = "-".join(map(str, r.get("load_average", [])))
        restarts = f"{r['survivor_restarts']} of {args.kills}" if "survivor_restarts" in r else "-"
        print(f"{mode:9} {','.join(map(str, r.get('threads', []))):>8} {r.get('steps_per_s')!s:>8} "
              f"{r.get('images_per_s')!s:>6} {r['vs_one_core']!s:>12} {load:>11} {r.get('median_stall_s', '-')!s:>8} "
              f"{r.get('median_back_s', '-')!s:>7} {r.get('median_lost_steps', '-')!s:>5} {restarts:>18}", flush=True)
        record = {"machine": f"{platform.node()} {os.cpu_count()} cores", "flags": flags, "kills": args.kills,
                  "seconds": args.seconds, "down_s": args.down, "results": results,
                  "measured": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        args.out.write_text(json.dumps(record, indent=1) + "\n")
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
