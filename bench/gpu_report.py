"""Every GPU figure the project has, in one command: `make gpu-report` on a GPU host, in at most 8 minutes.

    python3 -m bench.gpu_report                # -> bench/gpu_report.json and bench/gpu_report.md
    python3 -m bench.gpu_report --dry-run      # any host, toy sizes: every step runs, the report is written

It needs only the machine's own python3 and torch (no Docker engine, no virtualenv). Each figure
comes from the bench that owns it, run as a command of its own with a time limit: the trainer
against the fastest bare loop with a snapshot every 100 steps and at the trainer's defaults
(bench.overhead), what a snapshot costs the steps beside it (bench.snapshot_contention), and the
start-up to the first training step beside `import torch` (bench.launch_times). A step that fails
or runs out of time is reported with its last lines, and the others still run. The JSON holds every
step's whole result and command, with the machine and the commit; the markdown is the table for
docs/gpu.md. The dry run is in the test suite, so the report works the first time it meets a GPU.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
TOY_OVERHEAD = ["--model", "tiny", "--nproc", "1", "--batch-size", "16", "--train-images", "256", "--steps", "4",
                "--warmup-steps", "2", "--repeats", "1", "--log-every", "2", "--bare-compile", "false"]


class Step:
    """One bench run: its command at full size and at toy size, its time limit, and how to read its output."""

    def __init__(self, name: str, module: str, full: list[str], toy: list[str], limit_s: float) -> None:
        self.name, self.module, self.full, self.toy, self.limit_s = name, module, full, toy, limit_s

    def command(self, dry_run: bool, out: Path) -> list[str]:
        return [sys.executable, "-m", self.module, *(self.toy if dry_run else self.full), "--out", str(out)]


# Their time limits add up to 8 minutes: at 50k images/s on one GPU, 300 steps take 3 s and 6500 steps
# 65 s, long enough for one of the default cadence's snapshots (every 60 s) to fall inside the run.
STEPS = [
    Step("overhead, a snapshot every 100 steps", "bench.overhead",
         ["--repeats", "3", "--steps", "300", "--save-every", "100"], [*TOY_OVERHEAD, "--save-every", "2"], 150),
    Step("overhead, the trainer's defaults", "bench.overhead",
         ["--repeats", "1", "--steps", "6500", "--save-every", "default", "--bare-compile", "false"],
         [*TOY_OVERHEAD, "--save-every", "default"], 200),
    Step("what a snapshot costs the steps beside it", "bench.snapshot_contention",
         ["--repeats", "3"], ["--batch-size", "4", "--steps", "2", "--warmup-steps", "1"], 60),
    Step("start-up to the first step", "bench.launch_times",
         ["--only", "one-process", "--repeats", "3", "--epochs", "1"],
         ["--only", "one-process", "--repeats", "1", "--epochs", "1"], 70),
]


def run(step: Step, dry_run: bool, folder: Path) -> dict[str, Any]:
    out = folder / f"{step.module.split('.')[-1]}-{STEPS.index(step)}.json"
    command = step.command(dry_run, out)
    start = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=step.limit_s)
        ok, tail = done.returncode == 0 and out.exists(), (done.stdout + done.stderr)[-2000:]
    except subprocess.TimeoutExpired as exc:
        ok, tail = False, f"ran past its {step.limit_s:g} s\n{(exc.stdout or b'')[-1500:]!r}"
    print(f"{'done' if ok else 'FAILED'}: {step.name} ({time.perf_counter() - start:.0f} s)", flush=True)
    return {"name": step.name, "command": " ".join(command[2:]).replace(str(out), "OUT"), "ok": ok,
            "seconds": round(time.perf_counter() - start, 1), "result": json.loads(out.read_text()) if ok else None,
            "tail": None if ok else tail}


# ------------------------------------------------------------------ the table

def _overhead(result: dict) -> str:
    low, high = result["ratio_interval_90"]
    stall = result["snapshot_stall_s"]
    return (f"trainer {result['trainer_images_per_s']:,.0f} img/s, bare {result['bare_images_per_s']:,.0f}: "
            f"**{result['ratio']:.3f}** (90% {low:.3f}-{high:.3f})"
            + ("" if stall is None else f"; snapshot stall {stall * 1000:.1f} ms median, "
                                        f"{result['snapshot_stall_max_s'] * 1000:.1f} ms max"))


def _contention(result: dict) -> str:
    rows = {row["beside"]: row["ms_per_step"] for row in result["rows"]}
    alone = min(row["ms_per_step"] for row in result["rows"] if row["beside"] == "nothing")
    return (f"ms per step: nothing {alone:.2f}, the saver process's write **{rows['saver process (now)']:.2f}** "
            f"({rows['saver process (now)'] / alone:.3f}x), the old writer thread's "
            f"{rows['writer thread (before)']:.2f} ({rows['writer thread (before)'] / alone:.3f}x)")


def _startup(result: dict) -> str:
    first_step = result["results"]["one-process"].get("start_s")
    return (f"`python -m app.train` to its first step {first_step} s, `import torch` {result['import_torch_s']} s: "
            f"**{result['one_process_over_import_torch']}x** (medians of {result['repeats']})")


READERS: dict[str, Callable[[dict], str]] = {"bench.overhead": _overhead, "bench.snapshot_contention": _contention,
                                             "bench.launch_times": _startup}


def markdown(report: dict) -> str:
    m = report["machine"]
    lines = [f"GPU report: {m['gpu'] or 'no GPU (dry run)'}, {m['cpus']} CPUs, torch {m['torch']}, "
             f"commit {report['commit']}, {m['date']}; `{report['command']}` ({report['seconds']:.0f} s)", "",
             "| figure | result | command |", "| --- | --- | --- |"]
    for step, entry in zip(STEPS, report["steps"]):
        shown = READERS[step.module](entry["result"]) if entry["ok"] else "FAILED: " + entry["tail"].splitlines()[-1]
        lines.append(f"| {entry['name']} | {shown} | `python3 -m {entry['command']}` |")
    return "\n".join(lines) + "\n"


def commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m bench.gpu_report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="toy sizes on any host: that every step runs")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "gpu_report",
                   help="writes OUT.json and OUT.md (default bench/gpu_report)")
    args = p.parse_args(argv)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        steps = [run(step, args.dry_run, Path(folder)) for step in STEPS]
    from bench.overhead import machine      # here: torch's import waits until the benches have run
    report = {"machine": machine(), "commit": commit(), "dry_run": args.dry_run,
              "command": " ".join(["python3 -m bench.gpu_report", *(["--dry-run"] if args.dry_run else [])]),
              "seconds": time.perf_counter() - start, "steps": steps}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    print(f"written to {args.out.with_suffix('.json')} and {args.out.with_suffix('.md')}")
    return 0 if all(s["ok"] for s in steps) else 1


if __name__ == "__main__":
    sys.exit(main())
