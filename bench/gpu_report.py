"""Every GPU figure the project has, in one command: `make gpu-report` on a GPU host, in at most 10 minutes.

    python3 -m bench.gpu_report                # -> bench/gpu_report.json and bench/gpu_report.md
    python3 -m bench.gpu_report --dry-run      # any host, toy sizes: every step runs, the report is written

It needs only the machine's own python3 and torch (no Docker engine, no virtualenv). Each figure
comes from the bench that owns it, run as a command of its own with a time limit: the trainer
against the bare loop with a snapshot every 100 steps and at the trainer's defaults
(bench.overhead), what a snapshot costs the steps beside it (bench.snapshot_contention), the
start-up to the first training step beside `import torch` (bench.launch_times), and the survivor
modes' faults, generations and pace (bench.gpu_survivors). The limits add up to BUDGET_S: a GPU
machine is lent for 15 minutes, its start included. A step that fails is reported with its last
line; one that runs out of time is stopped with every process it started and reported with its last
progress line and its processes' Python stacks; the others still run. `--only` runs some steps. The
JSON holds every step's whole result and command, with the machine and the commit; the markdown is
the table for docs/gpu.md. The dry run is in the test suite, so the report works the first time it
meets a GPU.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from app.recovery import stacks

ROOT = Path(__file__).resolve().parent.parent
TOY_OVERHEAD = ["--model", "tiny", "--nproc", "1", "--batch-size", "16", "--train-images", "256", "--steps", "4",
                "--warmup-steps", "2", "--repeats", "1", "--log-every", "2", "--bare-compile", "false"]


class Step:
    """One bench run: its key (for --only), its command at full size and at toy size, its time limit."""

    def __init__(self, key: str, name: str, module: str, full: list[str], toy: list[str], limit_s: float) -> None:
        self.key, self.name, self.module, self.full, self.toy, self.limit_s = key, name, module, full, toy, limit_s

    def command(self, dry_run: bool, out: Path) -> list[str]:
        return [sys.executable, "-m", self.module, *(self.toy if dry_run else self.full), "--out", str(out)]


BUDGET_S = 600          # the whole report: 10 of the 15 minutes a GPU machine is lent for (its start: about 35 s)
OWN_S = 10              # the report's own: its start, then torch's import and CUDA's for the machine line
ABORTED = "Fatal Python error: Aborted"   # what faulthandler prints before a process's stacks on SIGABRT
STOP_GRACE_S = 5        # a step is sent SIGTERM this long before its limit, and killed at it
# The limits are a GPU machine's budget. A dry run shows that every step runs, not that it fits: on a
# loaded 2-core host a toy step ran past its 65 s (load average 14), so a dry run gives each step this
# many times its limit.
DRY_RUN_ROOM = 3

# What each step costs. The limits add up to BUDGET_S - OWN_S (tests/test_gpu_report.py checks the
# sum). From the H200 runs of 2026-11-27 (docs/gpu.md): writing the synthetic set 9 s, a torchrun
# run of 320 steps (bare or trainer) 22-27 s, start to first step 13 s, `import torch` 3-5 s.
SURVIVORS_S = 130
STEPS = [
    # The data, then 2 bare/trainer pairs of 320 steps: 4 runs, 83 s for the data and 3 of them. The bare
    # loop eager: on the H200 compiling it was slower (35.1k against 47.2k img/s), and choosing cost
    # two runs more, one of them compiling (about 45 s).
    Step("overhead-100", "overhead, a snapshot every 100 steps", "bench.overhead",
         ["--repeats", "2", "--steps", "300", "--save-every", "100", "--bare-compile", "false"],
         [*TOY_OVERHEAD, "--save-every", "2"], 130),
    # One pair of 6520 steps: long enough for one snapshot of the default cadence (every 60 s) to fall
    # inside the trainer's run. The bare loop about 70 s, the trainer 70-80 s, each start 15 s, the data.
    Step("overhead-default", "overhead, the trainer's defaults", "bench.overhead",
         ["--repeats", "1", "--steps", "6500", "--save-every", "default", "--bare-compile", "false"],
         [*TOY_OVERHEAD, "--save-every", "default"], 220),
    # 4-8 rows of at least 30 steps each, twice, beside a write of about 0.3 s: 20.5 s on the H200.
    Step("contention", "what a snapshot costs the steps beside it", "bench.snapshot_contention",
         ["--repeats", "2"], ["--batch-size", "4", "--steps", "2", "--warmup-steps", "1"], 30),
    # 3 repeats of `import torch` and of one process's start to its first step: 54 s on the H200.
    Step("startup", "start-up to the first step", "bench.launch_times",
         ["--only", "one-process", "--repeats", "3", "--epochs", "1", "--prepare"],
         ["--only", "one-process", "--repeats", "1", "--epochs", "1"], 70),
    # Within its --budget, part by part: inplace's faults (two starts, a kill and a rejoin, a freeze:
    # about 45 s), torchft's the same where it is installed, 20 generations (1.03 s each on the H200),
    # one elastic/inplace pace pair (a start and 15 s each: about 50 s). The rest of the limit is its
    # own start and its jobs' stop.
    Step("survivors", "survivor modes: faults, generations, pace", "bench.gpu_survivors",
         ["--budget", str(SURVIVORS_S - 15), "--timeout", "60", "--generations", "20", "--pace-rounds", "1",
          "--pace-seconds", "15"],
         ["--dry-run", "--budget", str(SURVIVORS_S - 15)], SURVIVORS_S),
]


def run(step: Step, dry_run: bool, folder: Path) -> dict[str, Any]:
    out = folder / f"{step.module.split('.')[-1]}-{STEPS.index(step)}.json"
    command = step.command(dry_run, out)
    limit_s = step.limit_s * (DRY_RUN_ROOM if dry_run else 1)
    start = time.perf_counter()
    # A session of its own: at its limit the step and the processes it started (its jobs' nodes, which
    # would hold the GPU through the steps after it) are stopped together. Python's faulthandler on:
    # a step stopped at its limit says where it was (stop()).
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env={**os.environ, "PYTHONFAULTHANDLER": "1"},
                            preexec_fn=no_core_files)
    try:
        said = "".join(proc.communicate(timeout=limit_s - STOP_GRACE_S))
        ok = proc.returncode == 0 and out.exists()
        why = None if ok else last_line(said) or f"exit status {proc.returncode}"
    except subprocess.TimeoutExpired:
        said, where = stop(proc, folder / step.key)
        last = last_line(said.partition(ABORTED)[0])       # its last line before its stacks
        ok, why = False, f"ran past its {limit_s:g} s" + (f", after: {last}" if last else "")
        said = f"ran past its {limit_s:g} s\n{said}{where}"
    print(f"{'done' if ok else 'FAILED'}: {step.name} ({time.perf_counter() - start:.0f} s)", flush=True)
    return {"key": step.key, "name": step.name, "command": " ".join(command[2:]).replace(str(out), "OUT"), "ok": ok,
            "seconds": round(time.perf_counter() - start, 1), "result": json.loads(out.read_text()) if ok else None,
            "why": why, "tail": None if ok else said[-6000:]}


def no_core_files() -> None:
    """In the step's process, before its exec: the SIGABRT that asks for its stacks (stop()) writes no
    core file of a process holding gigabytes into the checkout."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def last_line(text: str) -> str:
    """The last line a step printed, shortened for the table."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def stop(proc: subprocess.Popen, folder: Path) -> tuple[str, str]:
    """A step at its limit: (what it said, where its processes were). First the Python stacks of its
    training processes (app.recovery.stacks, each armed at start) and of the bench itself
    (faulthandler, on SIGABRT), then SIGTERM to every process it started, SIGKILL to what is left
    STOP_GRACE_S later. torchrun starts its workers in sessions of their own: the step's processes
    are found by parentage, not by session."""
    tree = descendants(proc.pid)
    for pid in tree:
        stacks.ask(folder, 0, pid, "the GPU report stopped this step at its limit")
    _signal(proc, [], signal.SIGABRT)
    time.sleep(0.5)
    _signal(proc, tree, signal.SIGTERM)
    try:
        said = "".join(proc.communicate(timeout=STOP_GRACE_S))
    except subprocess.TimeoutExpired:
        said = "(killed: nothing more read)\n"
    _signal(proc, [*tree, *descendants(proc.pid)], signal.SIGKILL)
    proc.wait()     # not for its pipes: a torchrun worker (a session of its own) may hold them still
    where = "".join(f"\n{f.read_text()}" for f in sorted((folder / stacks.FOLDER).glob("*.txt")))
    return said, where


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, from /proc's parent links (/proc/PID/task/TID/children lists one
    thread's children only, and the benches start jobs from threads of their own)."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found += children
        todo += children
    return found


def _signal(proc: subprocess.Popen, pids: list[int], sig: int) -> None:
    """`sig` to the step's process, its session (what an ended parent left there) and `pids`."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, sig)
    if sig != signal.SIGABRT:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


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
    one = result["results"]["one-process"]
    phases = ", ".join(f"{name} {s:g}" for name, s in one.get("phases_s", {}).items() if s is not None and s >= 0.1)
    prepared = " (digits prepared by the bench first, as `make venv` leaves them)" if result.get("digits_prepared_here") else ""
    return (f"`python -m app.train`{prepared} to its first step {one.get('start_s')} s, `import torch` {result['import_torch_s']} s: "
            f"**{result['one_process_over_import_torch']}x** (medians of {result['repeats']}); phases over 0.1 s: "
            f"{phases or '-'}")


def _survivors(result: dict) -> str:
    from bench.gpu_survivors import verdict     # here: its import loads torch, which the report leaves to the end

    pace = result["pace"]["inplace_over_elastic"]
    return "; ".join(verdict(result)) + f"; inplace's pace over elastic's {pace or '-'}"


READERS: dict[str, Callable[[dict], str]] = {"bench.overhead": _overhead, "bench.snapshot_contention": _contention,
                                             "bench.launch_times": _startup, "bench.gpu_survivors": _survivors}


def markdown(report: dict) -> str:
    m = report["machine"]
    lines = [f"GPU report: {m['gpu'] or 'no GPU (dry run)'}, {m['cpus']} CPUs, torch {m['torch']}, "
             f"commit {report['commit']}, {m['date']}; `{report['command']}` ({report['seconds']:.0f} s)", "",
             "| figure | result | command |", "| --- | --- | --- |"]
    for entry in report["steps"]:
        step = next(step for step in STEPS if step.key == entry["key"])
        shown = READERS[step.module](entry["result"]) if entry["ok"] else f"FAILED: {entry['why']}"
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
    p.add_argument("--only", default="", help="comma-separated steps to run (default: every one): "
                                              + ", ".join(step.key for step in STEPS))
    args = p.parse_args(argv)
    keys = [key for key in args.only.split(",") if key]
    if unknown := sorted(set(keys) - {step.key for step in STEPS}):
        p.error(f"--only: no step {', '.join(unknown)} (steps: {', '.join(step.key for step in STEPS)})")
    start = time.perf_counter()
    report = {"machine": None, "commit": commit(), "dry_run": args.dry_run,
              "command": " ".join(["python3 -m bench.gpu_report", *(["--dry-run"] if args.dry_run else []),
                                   *([f"--only {args.only}"] if keys else [])]),
              "seconds": None, "steps": []}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as folder:
        for step in (step for step in STEPS if not keys or step.key in keys):
            report["steps"].append(run(step, args.dry_run, Path(folder)))
            # Each step's result is kept as it comes: a report stopped from outside (the lent machine's
            # own limit on a command) still leaves the steps it finished.
            args.out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    from bench.overhead import machine      # here: torch's import waits until the benches have run
    report.update(machine=machine(), seconds=time.perf_counter() - start)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    print(f"written to {args.out.with_suffix('.json')} and {args.out.with_suffix('.md')}")
    return 0 if all(s["ok"] for s in report["steps"]) else 1


if __name__ == "__main__":
    sys.exit(main())
