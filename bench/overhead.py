"""`make bench`: trainer throughput against a bare DDP loop, and what one snapshot costs the loop.

Both run in this one invocation, alternately, on the same model, batch size and synthetic data,
under torchrun with the same number of processes. Augmentation is off in both (it is training
work, not trainer overhead). The trainer saves a snapshot every --save-every-steps (100 by
default), so the ratio includes the snapshot cost. Results go to bench/results.json together
with the exact configuration that produced them.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from app.config import boolean as bool_flag
from app.metrics import read
from scripts.prepare import write_synthetic

ROOT = Path(__file__).resolve().parent.parent


def torchrun(nproc: int, module: list[str], env: dict[str, str]) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *module]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        sys.exit(f"error: {' '.join(module[:2])} failed:\n{done.stderr[-2000:]}")
    return done.stdout


def speed_flags(args: argparse.Namespace) -> list[str]:
    """The same numerics for both sides: bf16 autocast and torch.compile, or neither."""
    return ["--amp", str(args.amp).lower(), "--compile", str(args.compile).lower()]


def bare(args: argparse.Namespace, data_dir: Path, env: dict[str, str]) -> float:
    out = torchrun(args.nproc, ["bench/bare_ddp.py", "--data-dir", str(data_dir), "--model", args.model,
                                "--batch-size", str(args.batch_size), "--steps", str(args.steps),
                                "--warmup-steps", str(args.warmup_steps), *speed_flags(args)], env)
    return json.loads(out.strip().splitlines()[-1])["bare_images_per_s"]


def trainer(args: argparse.Namespace, data_dir: Path, env: dict[str, str]) -> tuple[float, list[float]]:
    with tempfile.TemporaryDirectory() as run_dir:
        torchrun(args.nproc, ["-m", "app.train", "--dataset", "synthetic", "--data-dir", str(data_dir),
                              "--model", args.model, "--batch-size", str(args.batch_size), "--augment", "false",
                              "--epochs", "1000", "--max-steps", str(args.warmup_steps + args.steps),
                              "--log-every-steps", str(args.log_every), "--save-every-steps",
                              str(args.save_every), "--save-every-seconds", "0", "--run-dir", run_dir,
                              "--progress", "lines", "--no-resume", *speed_flags(args)], env)
        rows = read(Path(run_dir) / "metrics.jsonl")
    train = [r for r in rows if r["event"] == "train" and r["step"] > args.warmup_steps]
    images = len(train) * args.log_every * args.batch_size * args.nproc
    seconds = sum(args.log_every * args.batch_size * args.nproc / r["images_per_s"] for r in train)
    stalls = [r["snapshot_stall_s"] for r in rows if r["event"] == "snapshot"]
    return images / seconds, stalls


def median_interval(values: list[float], confidence: float = 0.9, resamples: int = 4000) -> tuple[float, float]:
    """A bootstrap interval for the median: how far the measured ratio can be trusted."""
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    tail = int(resamples * (1 - confidence) / 2)
    return medians[tail], medians[-tail - 1]


def main(argv: list[str] | None = None) -> int:
    gpus = torch.cuda.device_count()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="resnet18" if gpus else "tiny", help="resnet18 on GPU hosts, tiny on CPU")
    p.add_argument("--nproc", type=int, default=gpus or 2, help="processes: one per GPU, 2 on CPU")
    p.add_argument("--batch-size", type=int, default=256 if gpus else 64, help="images per process")
    p.add_argument("--amp", type=bool_flag, default=bool(gpus), help="bf16 autocast in both (default on GPUs)")
    p.add_argument("--compile", type=bool_flag, default=bool(gpus), help="torch.compile in both (default on GPUs)")
    p.add_argument("--steps", type=int, default=100, help="timed steps per run")
    p.add_argument("--warmup-steps", type=int, default=20, help="steps before the clock starts (compilation)")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--repeats", type=int, default=8,
                   help="alternating bare/trainer pairs; the ratio is the median of the pairs' ratios")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results.json")
    args = p.parse_args(argv)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    with tempfile.TemporaryDirectory() as data_dir:
        write_synthetic(Path(data_dir), n_train=20000, n_test=1000)
        bare_runs, trainer_runs, stalls = [], [], []
        for _ in range(args.repeats):
            bare_runs.append(bare(args, Path(data_dir), env))
            ips, stall = trainer(args, Path(data_dir), env)
            trainer_runs.append(ips)
            stalls += stall
    # Runs drift by several percent on a shared machine: compare each trainer run with the bare
    # run just before it, and report the median of those paired ratios with their spread.
    ratios = [t / b for t, b in zip(trainer_runs, bare_runs)]
    low, high = median_interval(ratios)
    result = {
        "trainer_images_per_s": statistics.median(trainer_runs),
        "bare_images_per_s": statistics.median(bare_runs),
        "trainer_images_per_s_per_process": statistics.median(trainer_runs) / args.nproc,
        "ratio": statistics.median(ratios),
        "ratio_interval_90": [low, high],
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "overhead_pct": 100 * (1 - statistics.median(ratios)),
        "snapshot_stall_s": statistics.median(stalls) if stalls else None,
        "snapshot_stall_max_s": max(stalls) if stalls else None,
        "runs": {"trainer_images_per_s": trainer_runs, "bare_images_per_s": bare_runs},
        "config": {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                   "dataset": "synthetic 20000/1000", "augment": False, "torch": torch.__version__,
                   "device": "cuda" if torch.cuda.is_available() else "cpu", "cpus": os.cpu_count(),
                   "host": platform.node(), "date": time.strftime("%Y-%m-%d %H:%M:%S")},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'':28}{'images/s':>12}")
    print(f"{'bare DDP loop':28}{result['bare_images_per_s']:>12.0f}")
    print(f"{'trainer (snapshot/' + str(args.save_every) + ' steps)':28}{result['trainer_images_per_s']:>12.0f}")
    print(f"{'per process (GPU)':28}{result['trainer_images_per_s_per_process']:>12.0f}")
    print(f"{'ratio trainer/bare':28}{result['ratio']:>12.3f}   overhead {result['overhead_pct']:.1f}% "
          f"(90% interval {low:.3f}-{high:.3f}; pairs {result['ratio_min']:.3f}-{result['ratio_max']:.3f})")
    print(f"{'snapshot stall (median)':28}{result['snapshot_stall_s'] * 1000:>10.1f}ms   max "
          f"{result['snapshot_stall_max_s'] * 1000:.1f}ms")
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
