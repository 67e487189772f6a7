"""What an idle warm spare costs the job: no-fault jobs of the chaos configuration without and with
--spares, interleaved (A B A B ...: the host's other load falls on both alike), each measured at full
size over --pace-before seconds (60 when not given) by app.reporting.metrics.pace, and the ratio of
the medians (target: at least SPARE_COST_KEPT). `python -m scripts.chaos --spares 1 --faults 0`.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from app.reporting.metrics import pace, read as read_metrics
from scripts.chaos.observe import Observer
from scripts.chaos.runner import compose_job

SPARE_COST_KEPT = 0.98      # the job with an idle spare trains at this share of its pace without one, at least
WINDOW_S = 60.0
ROUNDS = 2


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """ROUNDS pairs of jobs, without then with the spares; OUT/spare_cost.json."""
    paces: dict[int, list[float | None]] = {0: [], args.spares: []}
    for _ in range(ROUNDS):
        for spares in paces:
            paces[spares].append(_one(args, spares))
            print(f"spares {spares}: {paces[spares][-1]} steps/s at full size", flush=True)
    without, with_spares = (statistics.median([p for p in paces[s] if p is not None] or [0.0]) for s in paces)
    ratio = round(with_spares / without, 3) if without else None
    result = {"spares": args.spares, "nodes": args.nodes, "window_s": args.pace_before or WINDOW_S,
              "pace_without": paces[0], "pace_with": paces[args.spares], "ratio_of_medians": ratio,
              "kept": ratio is not None and ratio >= SPARE_COST_KEPT}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "spare_cost.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def _one(args: argparse.Namespace, spares: int) -> float | None:
    """One job without faults: its pace at full size over the window, in steps/s (None if it never trained)."""
    job = compose_job(argparse.Namespace(**{**vars(args), "ft": "inplace", "spares": spares, "object_store": False}))
    seen, full = Observer(job, args.epochs), args.nodes * args.nproc
    job.down(volumes=True)
    job.build()
    started = time.time()
    job.up()
    seen.start()
    try:
        if not seen.wait_training(full, started, args.start_timeout):
            return None
        since = time.time()
        time.sleep(args.pace_before or WINDOW_S)
        return pace(read_metrics(job.run_dir / "metrics.jsonl"), full, since=since)
    finally:
        seen.stop()
        job.down(volumes=True)
