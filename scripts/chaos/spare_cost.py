"""What an idle warm spare costs the job: no-fault jobs of the chaos configuration without and with
--spares, interleaved (A B A B ...: the host's other load falls on both alike), each measured at full
size over --pace-before seconds (60 when not given) by app.reporting.metrics.pace, and the ratio of
the medians (target: at least SPARE_COST_KEPT). The pace moves with the host's other load; what the
spare itself spends does not: the CPU seconds of every process of the waiting spare's container over
the same window (/proc, as the chaos runner reaches the containers' processes: it runs as root).
`python -m scripts.chaos --spares 1 --faults 0`.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from app.reporting.metrics import pace, read as read_metrics
from scripts.chaos.host import container_pids
from scripts.chaos.observe import Observer
from scripts.chaos.report import SPARE_MARK
from scripts.chaos.runner import compose_job

SPARE_COST_KEPT = 0.98      # the job with an idle spare trains at this share of its pace without one, at least
WINDOW_S = 60.0


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """--pairs pairs of jobs, without then with the spares; OUT/spare_cost.json."""
    paces: dict[int, list[float | None]] = {0: [], args.spares: []}
    idle_cpu_s: list[float | None] = []
    for _ in range(args.pairs):
        for spares in paces:
            steps_s, cpu_s = _one(args, spares)
            paces[spares].append(steps_s)
            if spares:
                idle_cpu_s.append(cpu_s)
            print(f"spares {spares}: {steps_s} steps/s at full size; the waiting spare's CPU: {cpu_s} s", flush=True)
    without, with_spares = (statistics.median([p for p in paces[s] if p is not None] or [0.0]) for s in paces)
    ratio = round(with_spares / without, 3) if without else None
    result = {"spares": args.spares, "nodes": args.nodes, "window_s": args.pace_before or WINDOW_S,
              "pace_without": paces[0], "pace_with": paces[args.spares], "ratio_of_medians": ratio,
              "spare_cpu_s_in_window": idle_cpu_s,
              "kept": ratio is not None and ratio >= SPARE_COST_KEPT}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "spare_cost.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def _one(args: argparse.Namespace, spares: int) -> tuple[float | None, float | None]:
    """One job without faults: its pace at full size over the window, in steps/s, and the CPU seconds the
    waiting spare's container spent in it (None: it never trained, or no spare)."""
    job = compose_job(argparse.Namespace(**{**vars(args), "ft": "inplace", "spares": spares, "object_store": False}))
    seen, full = Observer(job, args.epochs), args.nodes * args.nproc
    job.down(volumes=True)
    job.build()
    started = time.time()
    job.up()
    seen.start()
    try:
        if not seen.wait_training(full, started, args.start_timeout):
            return None, None
        spare = _waiting_spare(job, args.start_timeout) if spares else None
        since, cpu_before = time.time(), _cpu_s(spare)
        time.sleep(args.pace_before or WINDOW_S)
        cpu = _cpu_s(spare)
        spent = round(cpu - cpu_before, 2) if cpu is not None and cpu_before is not None else None
        return pace(read_metrics(job.run_dir / "metrics.jsonl"), full, since=since), spent
    finally:
        seen.stop()
        job.down(volumes=True)


def _waiting_spare(job: Any, timeout: float) -> Any:
    """The node container that said it waits as a spare."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        for c in job.trainers(running=True):
            if SPARE_MARK in c.logs().decode(errors="replace"):
                return c
        time.sleep(1)
    return None


def _cpu_s(container: Any) -> float | None:
    """User and system CPU seconds of every process of `container` so far (/proc/PID/stat)."""
    if container is None:
        return None
    ticks = 0
    for pid in container_pids(container):
        try:
            fields = open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()
        except OSError:
            continue
        ticks += int(fields[11]) + int(fields[12])      # utime, stime (the 14th and 15th of the whole line)
    return ticks / os.sysconf("SC_CLK_TCK")
