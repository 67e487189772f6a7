"""A chaos run from start to end, in each mode asked for: the job up with its snapshot volume and
observer, the scheduled faults one after another, then the measurements written to OUT/MODE
(report.json, events.jsonl, timeline.png, and each container's last log lines in logs/); an error
while the faults run is recorded in the report, not raised. With every mode done, one uninterrupted
run of the same configuration and the two-mode table (OUT/report.json, OUT/table.md)."""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from app.reporting.metrics import read as read_metrics
from app.training.object_store import ObjectStore
from scripts.chaos import report, schedule
from scripts.chaos.faults import Injector
from scripts.chaos.host import SnapshotVolume
from scripts.chaos.observe import Observer
from scripts.chaos.table import compare, plot_timeline
from scripts.job import REPO, ComposeJob, owner


# Between a fault's heal and the next fault at least this long, however far the job has come: the
# job shows it trains at full size again before it is hit again.
SETTLE_S = 1.0


def trainer_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The job's trainer flags: a train row every step (steps lost are counted in steps)."""
    settings = {"ft": args.ft, "dataset": args.dataset, "model": args.model, "epochs": args.epochs,
                "batch_size": args.batch_size, "lr": args.lr, "seed": args.seed, "log_every_steps": 1, "save_every_steps": args.save_every,
                "save_every_seconds": 0, "collective_timeout": args.collective_timeout, "progress": "lines"}
    if args.data_dir:
        settings["data_dir"] = args.data_dir
    return settings


def compose_job(args: argparse.Namespace) -> ComposeJob:
    """The store and NODES trainer nodes; room for one more node (scale_up); a killed node stays down."""
    # A run directory of its own per invocation: a reused one would resume (or already be
    # finished) from an earlier run's snapshots and metrics.
    name = f"{args.run_name}-{args.ft}-{time.strftime('%Y%m%d-%H%M%S')}"
    # With the object store on, in every mode, unless --no-object-store: the wipe_disks fault needs it,
    # and every other fault then also shows that uploading costs the job nothing it would notice.
    return ComposeJob(name, args.nodes, nproc=args.nproc, project=args.project, rdzv_port=args.port,
                      settings=trainer_settings(args), inherit_env=False, object_store=args.object_store,
                      objects_port=args.objects_port, spares=args.spares,
                      extra_env={"NNODES": f"1:{args.nodes + 1}", "TRAINER_RESTART": "no",
                                 "LIGHTHOUSE_PORT": str(args.lighthouse_port)})


def job_store(job: ComposeJob) -> ObjectStore | None:
    """The job's snapshots in its object store, read with the job's identity (not put in this process's
    environment); None for a job without one."""
    if not job.object_store:
        return None
    key, secret = job.object_credentials()
    return ObjectStore(job.snapshot_url(), environ={"AWS_ENDPOINT_URL": job.objects_endpoint(),
                                                    "AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret})


def baseline_accuracy(args: argparse.Namespace) -> float | None:
    """The same configuration, uninterrupted, under torchrun on this host with the same world size."""
    run_dir = REPO / "runs" / f"{args.run_name}-baseline-{time.strftime('%Y%m%d-%H%M%S')}"
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in trainer_settings(args).items() if k != "ft"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nodes * args.nproc}",
           "-m", "app.train", *flags, f"--run-dir={run_dir}", "--no-resume"]
    done = subprocess.run(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    return report.final_accuracy(read_metrics(run_dir / "metrics.jsonl")) if done.returncode == 0 else None


def inject_all(args: argparse.Namespace, seen: Observer, injector: Injector, rng: random.Random,
               started: float) -> bool:
    """Training at full size first, then the faults at their points of progress; whether the job finished."""
    if not seen.wait_training(args.nodes * args.nproc, started, args.start_timeout):
        raise SystemExit(f"error: the job did not start training at world size {args.nodes * args.nproc} "
                         f"within {args.start_timeout:.0f} s; see `docker compose -p {args.project} logs`")
    seen.record(kind="ready", seconds=round(time.time() - started, 2))
    start = pace_window(args, seen)
    plan = schedule.plan(rng, args.faults, schedule.kinds(args.only, args.object_store))
    if args.every:      # a steady rate: each fault at its moment on the clock, or at once if the last one ran late
        due = schedule.every(time.time(), len(plan), args.every)
        waits = [lambda at=at: time.sleep(max(0.0, at - time.time())) for at in due]
    else:               # points of the job's progress
        waits = [lambda epoch=epoch: (time.sleep(SETTLE_S), seen.wait_epoch(epoch, args.finish_timeout))
                 for epoch in schedule.moments(rng, len(plan), args.epochs, start)]
    for i, (kind, wait) in enumerate(zip(plan, waits)):
        wait()
        if seen.finished() or (args.pace_before > 0 and schedule.too_late(seen.epoch(), args.epochs)):
            print(f"the job {'finished' if seen.finished() else 'is past most of its epochs'} after {i} faults; "
                  "raise --epochs for more", flush=True)
            break
        print(f"[{time.time() - started:7.1f}s] fault {i + 1}/{len(plan)} at epoch {seen.epoch():.1f}: {kind}",
              flush=True)
        injector.inject(kind)
    return seen.wait_finished(args.finish_timeout)


def pace_window(args: argparse.Namespace, seen: Observer) -> float:
    """--pace-before seconds of training at full size before the first fault, so that the report has a
    pace before the faults to hold the pace after them against (report.pace_change); the epoch
    reached, from which the faults' points of progress then count (0 without the window)."""
    if args.pace_before <= 0:
        return 0.0
    time.sleep(args.pace_before)
    return min(seen.epoch(), args.epochs / 2)


# A set-up that is a mode with something more: inplace with a warm spare (at least one), so that one run
# puts inplace with and without spares beside the other modes.
SETUPS = {"inplace-spare": ("inplace", 1)}


def setup_args(args: argparse.Namespace, setup: str) -> argparse.Namespace:
    """One set-up's run: its mode, its spares, and where it writes (OUT/SETUP)."""
    mode, spares = SETUPS.get(setup, (setup, 0))
    return argparse.Namespace(**{**vars(args), "ft": mode, "spares": max(spares, args.spares),
                                 "run_name": args.run_name + ("-spare" if setup in SETUPS else ""),
                                 "out": str(Path(args.out) / setup)})


def run_modes(args: argparse.Namespace) -> dict[str, Any]:
    """The same faults (same seed: same schedule) against each set-up in args.ft (a mode, or inplace-spare),
    one after another."""
    reports = {}
    for mode in args.ft:
        print(f"---- {mode} mode", flush=True)
        reports[mode] = run(setup_args(args, mode))
    baseline = baseline_accuracy(args) if args.baseline and any(r["summary"]["completed"]
                                                                 for r in reports.values()) else None
    for mode, result in reports.items():
        summary = result["summary"]
        summary["baseline_test_acc"] = baseline
        if summary["final_test_acc"] is not None and baseline is not None:
            summary["acc_delta_points"] = round(100 * (summary["final_test_acc"] - baseline), 2)
        _save(Path(args.out) / mode / "report.json", result)
    table = compare(reports)
    combined = {"modes": reports, "table": table, "config": vars(args)}
    _save(Path(args.out) / "report.json", combined)
    (Path(args.out) / "table.md").write_text("\n".join(table) + "\n")
    return combined


def _save(path: Path, result: dict[str, Any]) -> None:
    path.write_text(json.dumps(result, indent=2) + "\n")


def run(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    job, rng = compose_job(args), random.Random(args.seed)
    volume = SnapshotVolume(out / "snapshot-volume.img", job.run_dir / "snapshots", args.volume_mb)
    seen = Observer(job, args.epochs)
    started, cpu_started = time.time(), time.process_time()
    job.down(volumes=True)      # leftovers of an earlier run of this project
    job.build()         # the image from this checkout (cached: a second), also without `make chaos`
    volume.create(owner())
    job.up()
    seen.start()
    try:
        completed = inject_all(args, seen, Injector(job, seen, volume, job_store(job), rng, args), rng, started)
    except Exception as exc:   # keep what was measured: the report says where the run broke
        seen.record(kind="runner_error", error=f"{type(exc).__name__}: {exc}")
        completed = False
    finally:
        time.sleep(1.0)
        events = seen.events()
        (out / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
        seen.stop()
        keep_logs(job, out / "logs")
        job.down(volumes=True)      # the object store's data too: each run is its own
    cpu_s = time.process_time() - cpu_started
    return write_report(args, job.run_dir, volume, events, completed, started, cpu_s)


def keep_logs(job: ComposeJob, folder: Path, lines: int = 3000) -> None:
    """Each container's last lines, before `down` removes them: the evidence for what the report shows."""
    folder.mkdir(parents=True, exist_ok=True)
    for container in job.containers():
        text = container.logs(tail=lines, timestamps=True).decode(errors="replace")
        (folder / f"{container.name}.log").write_text(text)


def write_report(args: argparse.Namespace, run_dir: Path, volume: SnapshotVolume, events: list[report.Event],
                 completed: bool, started: float, cpu_s: float) -> dict[str, Any]:
    """report.json and timeline.png in OUT; the snapshots are checked before their volume goes. The
    runner's own CPU seconds too: it shares the host's cores with the nodes whose pace it measures."""
    out = Path(args.out)
    faults, heals = report.measure(events, args.ft)
    summary = report.summarise(faults, heals)
    summary.update(report.pace_change(events))
    summary.update(report.check_snapshots(run_dir / "snapshots"))
    volume.remove()
    summary["completed"] = bool(completed)
    rows = [e for e in events if e["kind"] == "metric"]
    summary["final_test_acc"] = report.final_accuracy(rows)
    summary["goodput"] = report.goodput(rows)
    summary["badput_s"] = report.badput(rows)
    summary["named_slow_falsely"] = report.named_slow_falsely(events)
    if args.every:
        summary.update(report.steady_rate(events, args.every, args.batch_size))
    summary["baseline_test_acc"] = None      # run_modes: one uninterrupted run for every mode
    summary["wall_s"] = round(time.time() - started, 1)
    summary["runner_cpu_s"] = round(cpu_s, 1)
    summary["runner_errors"] = [e["error"] for e in events if e["kind"] == "runner_error"]
    summary["mode"] = args.ft
    summary["spares"] = args.spares
    result = {"summary": summary, "faults": faults, "heals": heals,
              "config": {**vars(args), "run_dir": str(run_dir), "trainer": trainer_settings(args)}}
    _save(out / "report.json", result)
    plot_timeline(events, out / "timeline.png")
    return result
