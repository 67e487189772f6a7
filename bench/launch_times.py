"""How long each documented launch line takes to start training, and to train again after a worker is killed.

    python -m bench.launch_times                       # -> bench/launch_times.json and a table
    python -m bench.launch_times --only one-process --repeats 3 --out bench/startup.json

Each line of README.md's "Run it" section runs the default digits job (tiny CNN, a train row every
step) on this host; the runner reads `metrics.jsonl` for the first train row after the launch, then
SIGKILLs one worker (a rank other than 0 where there is one) and waits for the next train row. The
multi-node line runs two agents on this host against one endpoint, as two hosts would.
Every repeat also times `python -c "import torch"` from its launch to its exit, side by side with
the lines: the floor any start pays on this host that day, which the one-process start is divided by.
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

from app.datasets.files import DIGITS_FILE
from app.launch import _children
from app.core.policy import DEFAULT
from app.reporting import metrics
from bench.progress import say
from scripts.prepare import write_digits

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "launch_times.json"


def lines(port: int) -> dict[str, list[list[str]]]:
    """The README's launch lines (each a list of commands started together), trainer flags apart."""
    py = [sys.executable, "-m"]
    node = [*py, "app.launch", "--nnodes=1:2", "--nproc-per-node=1", f"--rdzv-endpoint=127.0.0.1:{port}",
            "--rdzv-id=bench", "-m", "app.train"]
    return {"one-process": [[*py, "app.train"]],
            "one-node": [[*py, "app.launch", "--standalone", "--nproc-per-node=2", "-m", "app.train"]],
            "two-nodes": [node, node]}


def _train_rows(run_dir: Path, after: float) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [r for r in metrics.read(path) if r["event"] == "train" and r["time"] > after]


def _wait_row(run_dir: Path, after: float, timeout: float) -> float | None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        rows = _train_rows(run_dir, after)
        if rows:
            return rows[0]["time"]
        time.sleep(0.05)
    return None


def _phases(run_dir: Path, launched: float, first: float) -> dict[str, float]:
    """Where the start's seconds went: the start row's phases (app/train.py), then its first step
    (the start row to the first train row)."""
    start = next(r for r in metrics.read(run_dir / "metrics.jsonl") if r["event"] == "start" and r["time"] > launched)
    return {**start["startup_s"], "first_step": round(first - start["time"], 3)}


def _victim(procs: list[subprocess.Popen]) -> int | None:
    """A worker to kill: the last launcher's last one (the second node's, or rank 1). Only a training
    process: a plain `python -m app.train`'s one child is its snapshot saver, whose kill the trainer
    rides through (it measured "kill to training 0.01 s" for a line with nothing to restart it)."""
    workers = [pid for proc in procs for pid in _children(proc.pid) if "app.train" in _argv(pid)]
    return workers[-1] if workers else None


def _argv(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().split("\0")
    except OSError:
        return []


def measure(name: str, commands: list[list[str]], flags: list[str], timeout: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as tmp:
        run_dir = Path(tmp) / "run"
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        launched = time.time()
        procs = [subprocess.Popen([*c, *flags, "--run-dir", str(run_dir)], cwd=REPO, env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                 for c in commands]
        try:
            first = _wait_row(run_dir, launched, timeout)
            result: dict[str, Any] = {"start_s": None if first is None else round(first - launched, 2)}
            if first is not None:
                result["phases"] = _phases(run_dir, launched, first)
            victim = _victim(procs) if first else None
            if victim is not None:      # one plain process has nothing to restart it: nothing to measure
                killed = time.time()
                os.kill(victim, signal.SIGKILL)
                again = _wait_row(run_dir, killed, timeout)
                result["kill_to_training_s"] = None if again is None else round(again - killed, 2)
            return result
        finally:
            for pid in [pid for proc in procs for pid in (*_children(proc.pid), proc.pid)]:
                try:
                    os.kill(pid, signal.SIGKILL)    # workers too: torchrun starts them in sessions of their own
                except ProcessLookupError:
                    pass
            for proc in procs:
                proc.wait()


def import_torch_s() -> float:
    """Seconds from launching `python -c "import torch"` to its exit, timed as a line's start is."""
    launched = time.time()
    subprocess.run([sys.executable, "-c", "import torch"], cwd=REPO, check=True,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    return time.time() - launched


def _median(runs: list[float | None]) -> float | None:
    """The median of the runs, rounded; None if any run did not get there."""
    return None if None in runs else round(statistics.median(runs), 2)


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One line's repeats as one result: each figure's median, and the runs it came from."""
    out: dict[str, Any] = {}
    for key in dict.fromkeys(k for r in runs for k in r if k != "phases"):     # a run that never trained has no kill figure
        values = [r.get(key) for r in runs]
        out[key], out[f"{key.removesuffix('_s')}_runs_s"] = _median(values), values
    phases = [r["phases"] for r in runs if "phases" in r]
    if phases:      # each phase's median over the runs that trained
        out["phases_s"] = {name: _median([p.get(name, 0.0) for p in phases]) for name in phases[0]}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.launch_times", description=__doc__.splitlines()[0])
    p.add_argument("--only", default="", help="comma-separated line names (default: all)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--port", type=int, default=DEFAULT.store_port + 7)
    p.add_argument("--timeout", type=float, default=180.0)
    p.add_argument("--repeats", type=int, default=1, help="runs of each line (and of import torch), interleaved")
    p.add_argument("--data-dir", default="data", help="the trainer's --data-dir (one without digits.pt: a fresh clone)")
    p.add_argument("--prepare", action="store_true", help="write the digits into --data-dir first where they are "
                   "missing, as `make venv` leaves them here (a GPU host's own python3 has no prepared data)")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    prepared = args.prepare and not (REPO / args.data_dir / DIGITS_FILE).is_file()
    if prepared:
        write_digits(REPO / args.data_dir)
    flags = ["--dataset", "digits", "--data-dir", args.data_dir, "--epochs", str(args.epochs),
             "--log-every-steps", "1", "--progress", "lines"]
    chosen = [n for n in args.only.split(",") if n] or list(lines(args.port))
    torch_runs: list[float | None] = []
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in chosen}
    began = time.monotonic()
    for _ in range(args.repeats):
        torch_runs.append(import_torch_s())
        say(began, f"import torch {torch_runs[-1]:.2f} s")
        for name in chosen:
            runs[name].append(measure(name, lines(args.port)[name], flags, args.timeout))
            say(began, f"{name}: {json.dumps(runs[name][-1])}")
    results = {name: summarise(r) for name, r in runs.items()}
    floor = _median(torch_runs)
    one = results.get("one-process", {}).get("start_s")
    record = {"machine": f"{platform.node()} {os.cpu_count()} cores", "flags": flags, "repeats": args.repeats,
              "digits_prepared_here": prepared,
              "import_torch_s": floor, "import_torch_runs_s": [round(t, 2) for t in torch_runs],
              "one_process_over_import_torch": round(one / floor, 2) if one and floor else None,
              "results": results, "measured": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"{'import torch':12} {floor} s (median of {args.repeats})")
    for name, r in results.items():
        print(f"{name:12} start {r['start_s']} s   kill to training {r.get('kill_to_training_s', '-')} s")
    if record["one_process_over_import_torch"] is not None:
        print(f"one-process start / import torch: {record['one_process_over_import_torch']}")
    return 0 if all(r["start_s"] is not None for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
