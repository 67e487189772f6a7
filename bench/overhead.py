"""`make bench`: trainer throughput against the fastest bare DDP loop, and what one snapshot costs.

Both run in this one invocation, alternately, on the same model, batch size and synthetic data,
under torchrun with the same number of processes. Augmentation is off in both (it is training
work, not trainer overhead). The trainer saves a snapshot every --save-every steps (100 by
default), so the ratio includes the snapshot cost; `--save-every default` leaves the trainer its
own cadence instead (on a GPU, by the clock: app/core/config.py's SNAPSHOT_DEFAULTS). The defaults follow the host: on GPUs
ResNet-18 at 512 images per GPU on a CIFAR-size set with bf16, the bare loop eager or compiled,
whichever the first pair finds faster; on CPU the tiny CNN. Results go to bench/results.json
together with the machine and the exact configuration that produced them. `--calibrate` puts the
bare loop on both sides of every pair: the spread of the ratio when nothing differs, what a
trainer/bare ratio on the same machine can resolve.
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
import threading
import time
from pathlib import Path
from typing import Sequence

import torch

from app.core.config import Config, boolean as bool_flag
from app.reporting.metrics import read
from bench.progress import say
from scripts.prepare import write_decoded, write_synthetic

ROOT = Path(__file__).resolve().parent.parent


def torchrun(nproc: int, module: list[str], env: dict[str, str]) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *module]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        sys.exit(f"error: {' '.join(module[:2])} failed:\n{done.stderr[-2000:]}")
    return done.stdout


def speed_flags(args: argparse.Namespace, compile_: bool) -> list[str]:
    return ["--amp", str(args.amp).lower(), "--compile", str(compile_).lower(), "--bucket-mb", str(args.bucket_mb)]


class GpuUtilisation:
    """Samples the GPU's utilisation while a run is under way (NVML through torch, else nvidia-smi);
    the median of the samples, or None where neither answers (CPU hosts)."""

    def __init__(self, every_s: float = 0.5) -> None:
        self.every_s, self.samples, self._stop = every_s, [], threading.Event()

    def __enter__(self) -> GpuUtilisation:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            value = gpu_utilisation()
            if value is None:
                return
            self.samples.append(value)

    def median(self) -> float | None:
        return statistics.median(self.samples) if self.samples else None


def gpu_utilisation() -> float | None:
    if not torch.cuda.is_available():
        return None
    try:
        return float(torch.cuda.utilization())
    except Exception:      # no pynvml: ask the driver's tool
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=10).stdout
            return statistics.mean(float(v) for v in out.split())
        except (OSError, ValueError, subprocess.SubprocessError, statistics.StatisticsError):
            return None


def warm_up(args: argparse.Namespace) -> int:
    """The steps both loops take before their timed steps: --warmup-steps rounded up to a whole number of
    the trainer's log intervals, so that its timed train rows cover the timed steps and nothing before
    them (its first steps and its start row would otherwise count against it, and not against the bare loop)."""
    return -(-args.warmup_steps // args.log_every) * args.log_every


def timed_rows(rows: list[dict], warm: int, steps: int, log_every: int) -> list[dict]:
    """The trainer's train rows over the timed steps warm+1 .. warm+steps, one per log interval."""
    train = [r for r in rows if r["event"] == "train" and warm < r["step"] <= warm + steps]
    if [r["step"] for r in train] != list(range(warm + log_every, warm + steps + 1, log_every)):
        raise SystemExit(f"error: the trainer's train rows cover steps {[r['step'] for r in train]}, "
                         f"not every {log_every} from {warm} to {warm + steps}")
    return train


def bare(args: argparse.Namespace, data_dir: Path, env: dict[str, str], compile_: bool) -> dict[str, float]:
    out = torchrun(args.nproc, ["bench/bare_ddp.py", "--data-dir", str(data_dir), "--model", args.model,
                                "--batch-size", str(args.batch_size), "--steps", str(args.steps),
                                "--warmup-steps", str(warm_up(args)), *speed_flags(args, compile_)], env)
    return json.loads(out.strip().splitlines()[-1])


def trainer(args: argparse.Namespace, data_dir: Path, env: dict[str, str], extra: Sequence[str] = ()) -> dict[str, object]:
    """One trainer run (`extra`: more of its flags): its pace over the timed steps, images over their seconds."""
    with tempfile.TemporaryDirectory() as run_dir:
        torchrun(args.nproc, ["-m", "app.train", "--dataset", "synthetic", "--data-dir", str(data_dir),
                              "--model", args.model, "--batch-size", str(args.batch_size), "--augment", "false",
                              "--epochs", "1000", "--max-steps", str(warm_up(args) + args.steps),
                              "--log-every-steps", str(args.log_every), *cadence(args.save_every), "--run-dir", run_dir,
                              "--progress", "lines", "--no-resume", *speed_flags(args, args.compile), *extra], env)
        rows = read(Path(run_dir) / "metrics.jsonl")
    train = timed_rows(rows, warm_up(args), args.steps, args.log_every)
    per_row = args.log_every * args.batch_size * args.nproc      # images in each timed row's interval
    seconds = sum(per_row / r["images_per_s"] for r in train)
    return {"images_per_s": args.steps * args.batch_size * args.nproc / seconds, "peak_memory_mb": train[-1]["peak_memory_mb"],
            "stalls": [r["snapshot_stall_s"] for r in rows if r["event"] == "snapshot"],
            "start": next(r for r in rows if r["event"] == "start")}


def bare_again(args: argparse.Namespace, data_dir: Path, env: dict[str, str], compile_: bool) -> dict[str, object]:
    """--calibrate: a bare run in the trainer's place, read as a trainer run is."""
    run = bare(args, data_dir, env, compile_)
    return {"images_per_s": run["bare_images_per_s"], "peak_memory_mb": run["peak_memory_mb"], "stalls": [], "start": {}}


def cadence(save_every: str) -> list[str]:
    """The trainer's snapshot flags: every N steps and no clock, or (`default`) none: its own defaults."""
    return [] if save_every == "default" else ["--save-every-steps", save_every, "--save-every-seconds", "0"]


def pick_bare_compile(args: argparse.Namespace, data_dir: Path, env: dict[str, str]) -> tuple[bool, dict]:
    """The bare loop is the fastest honest loop: eager or compiled, whichever runs faster here."""
    if args.bare_compile is not None:
        return args.bare_compile, {}
    tried = {mode: bare(args, data_dir, env, mode)["bare_images_per_s"] for mode in (False, True)}
    return max(tried, key=tried.get), {("compiled" if k else "eager"): v for k, v in tried.items()}


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
    p.add_argument("--batch-size", type=int, default=512 if gpus else 64, help="images per process")
    p.add_argument("--train-images", type=int, default=50000 if gpus else 20000, help="synthetic training set")
    p.add_argument("--amp", type=bool_flag, default=bool(gpus), help="bf16 autocast in both (default on GPUs)")
    p.add_argument("--compile", type=bool_flag, default=False, help="torch.compile the trainer (its default: off)")
    p.add_argument("--bare-compile", type=bool_flag, default=None if gpus else False,
                   help="torch.compile the bare loop (default: whichever is faster on GPUs, eager on CPU)")
    p.add_argument("--bucket-mb", type=float, default=Config().bucket_mb, help="DDP bucket size in both")
    p.add_argument("--steps", type=int, default=100, help="timed steps per run")
    p.add_argument("--warmup-steps", type=int, default=20,
                   help="steps before the clock starts (compilation), rounded up to a multiple of --log-every")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--save-every", default="100", help="steps between snapshots, or `default`: the trainer's own")
    p.add_argument("--repeats", type=int, default=8,
                   help="bare/trainer pairs, each in the other order from the one before; the ratio is the "
                        "median of the pairs' ratios")
    p.add_argument("--calibrate", action="store_true",
                   help="the bare loop on both sides of every pair: how far the ratio strays on this machine "
                        "when nothing differs")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results.json")
    args = p.parse_args(argv)
    if args.steps % args.log_every:
        p.error(f"--steps ({args.steps}) must be a multiple of --log-every ({args.log_every}): the trainer's "
                "pace is read from its train rows, one per log interval")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    began = time.monotonic()
    with tempfile.TemporaryDirectory() as data_dir:
        write_synthetic(Path(data_dir), n_train=args.train_images, n_test=1000)
        write_decoded("synthetic", Path(data_dir))
        say(began, f"data: {args.train_images} synthetic images")
        bare_compile, tried = pick_bare_compile(args, Path(data_dir), env)
        bare_runs, trainer_runs, stalls = [], [], []
        bare_util, trainer_util = GpuUtilisation(), GpuUtilisation()

        def run_bare() -> None:
            with bare_util:
                bare_runs.append(bare(args, Path(data_dir), env, bare_compile))
            say(began, f"bare run {len(bare_runs)}: {bare_runs[-1]['bare_images_per_s']:.0f} img/s")

        def run_trainer() -> None:
            with trainer_util:
                trainer_runs.append(bare_again(args, Path(data_dir), env, bare_compile) if args.calibrate
                                    else trainer(args, Path(data_dir), env))
            say(began, f"trainer run {len(trainer_runs)}: {trainer_runs[-1]['images_per_s']:.0f} img/s")

        for i in range(args.repeats):
            # Each pair in the other order from the one before: a machine that drifts within a pair
            # (another tenant, the page cache) then weighs on both loops alike over the pairs.
            for run in ((run_bare, run_trainer) if i % 2 == 0 else (run_trainer, run_bare)):
                run()
            stalls += trainer_runs[-1]["stalls"]
    result = summarise(args, bare_runs, trainer_runs, stalls, bare_compile, tried,
                       {"bare": bare_util.median(), "trainer": trainer_util.median()})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    show(result, args)
    print(f"written to {args.out}")
    return 0


def summarise(args: argparse.Namespace, bare_runs: list[dict], trainer_runs: list[dict], stalls: list[float],
              bare_compile: bool, tried: dict, utilisation: dict) -> dict:
    # Runs drift by several percent on a shared machine: compare each trainer run with the bare
    # run just before it, and report the median of those paired ratios with their spread.
    bare_ips = [r["bare_images_per_s"] for r in bare_runs]
    trainer_ips = [r["images_per_s"] for r in trainer_runs]
    ratios = [t / b for t, b in zip(trainer_ips, bare_ips)]
    low, high = median_interval(ratios)
    start = trainer_runs[-1]["start"]
    return {
        "trainer_images_per_s": statistics.median(trainer_ips),
        "bare_images_per_s": statistics.median(bare_ips),
        "trainer_images_per_s_per_process": statistics.median(trainer_ips) / args.nproc,
        "ratio": statistics.median(ratios),
        "ratio_interval_90": [low, high],
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "overhead_pct": 100 * (1 - statistics.median(ratios)),
        "snapshot_stall_s": statistics.median(stalls) if stalls else None,
        "snapshot_stall_max_s": max(stalls) if stalls else None,
        "peak_memory_mb": {"bare": max(r["peak_memory_mb"] for r in bare_runs),
                           "trainer": max(r["peak_memory_mb"] for r in trainer_runs),
                           "what": "torch.cuda.max_memory_allocated" if torch.cuda.is_available() else "max RSS"},
        "gpu_utilisation_pct": utilisation if any(v is not None for v in utilisation.values()) else None,
        "bare_loop": {"compiled": bare_compile, "tried_images_per_s": tried or None},
        "runs": {"trainer_images_per_s": trainer_ips, "bare_images_per_s": bare_ips},
        "trainer_start": {k: start.get(k) for k in ("backend", "device", "dtype", "memory_format", "startup_s")},
        "config": {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                   "dataset": f"synthetic {args.train_images}/1000", "augment": False},
        "machine": machine(),
    }


def machine() -> dict[str, object]:
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"host": platform.node(), "cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "gpu": gpu, "gpus": torch.cuda.device_count(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if gpu else None,
            "date": time.strftime("%Y-%m-%d %H:%M:%S")}


def show(result: dict, args: argparse.Namespace) -> None:
    low, high = result["ratio_interval_90"]
    bare_name = "bare DDP loop (" + ("compiled" if result["bare_loop"]["compiled"] else "eager") + ")"
    print(f"{'':28}{'images/s':>12}")
    print(f"{bare_name:28}{result['bare_images_per_s']:>12.0f}")
    every = "defaults" if args.save_every == "default" else f"snapshot/{args.save_every} steps"
    other = "bare loop again" if args.calibrate else "trainer (" + every + ")"
    print(f"{other:28}{result['trainer_images_per_s']:>12.0f}")
    print(f"{'per process':28}{result['trainer_images_per_s_per_process']:>12.0f}")
    ratio = "ratio bare again/bare" if args.calibrate else "ratio trainer/bare"
    print(f"{ratio:28}{result['ratio']:>12.3f}   overhead {result['overhead_pct']:.1f}% "
          f"(90% interval {low:.3f}-{high:.3f}; pairs {result['ratio_min']:.3f}-{result['ratio_max']:.3f})")
    if result["snapshot_stall_s"] is not None:
        print(f"{'snapshot stall (median)':28}{result['snapshot_stall_s'] * 1000:>10.1f}ms   max "
              f"{result['snapshot_stall_max_s'] * 1000:.1f}ms")
    memory = result["peak_memory_mb"]
    print(f"{'peak memory (' + memory['what'] + ')':28}  bare {memory['bare']:.0f} MiB, trainer {memory['trainer']:.0f} MiB")
    print(f"{'GPU utilisation (median)':28}  {utilisation_shown(result['gpu_utilisation_pct'])}")


def utilisation_shown(pct: dict[str, float | None] | None) -> str:
    """`bare 88%, trainer 62%` (whole percent: what the driver's counter resolves); `-` where unread."""
    if pct is None:
        return "- (not readable here)"
    return ", ".join(f"{side} {'-' if v is None else f'{v:.0f}%'}" for side, v in pct.items())

if __name__ == "__main__":
    sys.exit(main())
