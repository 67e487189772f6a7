"""The fault-tolerance modes side by side: a node killed, then started again, on this host.

    python -m bench.ft_modes                      # -> bench/ft_modes.json and a table
    python -m bench.ft_modes --kills 3 --epochs 40

Two nodes, one process each, on the default digits job (tiny CNN, a train row every step), as the
README's launch lines start them: elastic mode is two `app.launch --nnodes=1:2` agents against
one rendezvous endpoint; torchft mode is two `app.launch --standalone` replica groups and a
Lighthouse (`python -m app.ft.lighthouse`); inplace mode is two `app.launch --standalone` nodes and
a store (`python -m app.node store`, as the compose store service runs it). For each kill (SIGKILL
of the second node's agent and worker, then the same command again after --down seconds), read
from their shared metrics.jsonl:
- stall: the survivor's longest gap between train rows from the kill until it trains again;
- restarted: whether the survivor's worker process was replaced (its pid, read from /proc);
- back: from the node's new start until a train row with both nodes again;
- lost: committed steps the survivor lost (its last step before the kill minus the first after, +1);
- img/s: the median train-row throughput with both nodes and no fault, per mode.
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

from app import metrics
from app.launch import _children
from app.recovery.policy import DEFAULT

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "ft_modes.json"
PY = [sys.executable, "-m"]


def node_command(mode: str, port: int) -> list[str]:
    if mode == "elastic":
        return [*PY, "app.launch", "--nnodes=1:2", "--nproc-per-node=1", f"--rdzv-endpoint=127.0.0.1:{port}",
                "--rdzv-id=bench-ft", "-m", "app.train"]
    meet = (["--lighthouse", f"http://127.0.0.1:{port}"] if mode == "torchft"
            else ["--group-store", f"127.0.0.1:{port}"])
    return [*PY, "app.launch", "--standalone", "--nproc-per-node=1", "-m", "app.train", "--ft", mode, *meet]


class Job:
    """Two nodes of one mode sharing one run directory (as the node containers of one host do)."""

    def __init__(self, mode: str, port: int, flags: list[str], tmp: Path) -> None:
        self.mode, self.port, self.flags, self.tmp = mode, port, flags, tmp
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", "LIGHTHOUSE_PORT": str(port),
                    "RDZV_ID": f"bench-{os.getpid()}"}     # inplace: this run's keys in the store
        self.extra: list[subprocess.Popen] = []
        if mode == "torchft":
            self.extra.append(subprocess.Popen([*PY, "app.ft.lighthouse", "--host", "127.0.0.1"], cwd=REPO,
                                               env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        if mode == "inplace":       # its idle Lighthouse one port up
            store_env = {**self.env, "RDZV_PORT": str(port), "RDZV_BIND": "127.0.0.1",
                         "LIGHTHOUSE_PORT": str(port + 1)}
            self.extra.append(subprocess.Popen([*PY, "app.node", "store"], cwd=REPO, env=store_env,
                                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        self.nodes = [self.start(i) for i in range(2)]

    def start(self, i: int) -> subprocess.Popen:
        return subprocess.Popen([*node_command(self.mode, self.port), *self.flags, "--run-dir", str(self.tmp / "run")],
                                cwd=REPO, env={**self.env, "FT_REPLICA_ID": f"n{i}"},
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

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
    survivor = _children(job.nodes[0].pid)
    killed = time.time()
    before = max((r["step"] for r in job.rows() if r["time"] <= killed), default=0)
    job.kill(1)
    again = job.wait(lambda r: r["time"] > killed, timeout)
    rows = [r["time"] for r in job.rows() if r["time"] > killed - 5]
    stall = max((b - a for a, b in zip(rows, rows[1:]) if b > killed), default=None)
    time.sleep(max(0.0, down_s - (time.time() - killed)))
    restarted_at = time.time()
    job.nodes[1] = job.start(1)
    back = job.wait(lambda r: r["time"] > restarted_at and r["world_size"] == 2, timeout)
    return {"stall_s": None if stall is None else round(stall, 2),
            "survivor_restarted": _children(job.nodes[0].pid) != survivor,
            "lost_steps": None if again is None else max(0, before - again["step"] + 1),
            "back_s": None if back is None else round(back["time"] - restarted_at, 2)}


def measure(mode: str, port: int, flags: list[str], kills: int, down_s: float, timeout: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as tmp:
        job = Job(mode, port, flags, Path(tmp))
        try:
            if job.wait(lambda r: r["world_size"] == 2, timeout) is None:
                return {"error": "the two nodes never trained together"}
            time.sleep(3)       # a few rows with no fault: the throughput
            speeds = [r["images_per_s"] for r in job.rows() if r["world_size"] == 2 and r["images_per_s"]]
            faults = []
            for _ in range(kills):
                faults.append(one_fault(job, down_s, timeout))
                time.sleep(2)
            return {"images_per_s": round(statistics.median(speeds)), "faults": faults, **_medians(faults)}
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
    p.add_argument("--epochs", type=int, default=60, help="long enough for every kill (digits: 22 steps an epoch)")
    p.add_argument("--timeout", type=float, default=180.0)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--modes", default="elastic,torchft,inplace", help="comma-separated, measured in this order")
    args = p.parse_args(argv)
    flags = ["--dataset", "digits", "--epochs", str(args.epochs), "--log-every-steps", "1", "--progress", "lines"]
    ports = {"elastic": DEFAULT.store_port + 9, "torchft": DEFAULT.lighthouse_port + 9,
             "inplace": DEFAULT.store_port + 19}
    modes = args.modes.split(",")
    if set(modes) - set(ports):
        p.error(f"--modes: choose from {','.join(ports)}")
    results = {mode: measure(mode, ports[mode], flags, args.kills, args.down, args.timeout) for mode in modes}
    record = {"machine": f"{platform.node()} {os.cpu_count()} cores", "flags": flags, "kills": args.kills,
              "down_s": args.down, "results": results, "measured": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"{'mode':8} {'img/s':>6} {'stall s':>8} {'back s':>7} {'lost':>5} {'survivor restarts':>18}")
    for mode, r in results.items():
        print(f"{mode:8} {r.get('images_per_s', '-')!s:>6} {r.get('median_stall_s')!s:>8} {r.get('median_back_s')!s:>7} "
              f"{r.get('median_lost_steps')!s:>5} {r.get('survivor_restarts', '-')!s:>10} of {args.kills}")
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
