"""`make chaos`: run a training job in containers and inject faults at random moments.

    python -m scripts.chaos --nodes 2 --faults 20 --seed 0        # -> chaos/report.json, chaos/timeline.png
    python -m scripts.chaos --config cifar-size --faults 6        # ResNet-18 on 50000 CIFAR-size images
    python -m scripts.chaos --only partition,freeze_worker        # these kinds only

Faults, one at a time and some back to back: docker kill of a node that does not hold rank 0 and
of the one that does, a kill while a snapshot is being written, a fast docker restart, a docker
pause, one training process frozen (SIGSTOP) while its node's agent runs on, a network partition
of one node (its packets dropped, the container running), the snapshot volume full during saves,
the newest snapshot corrupted on disk before every node is killed at once, a node joining (scale
up) and one leaving cleanly (scale down), and a restart of the rendezvous store. The runner brings
nodes back and measures how long the job takes to notice, to train again (with where those seconds
went) and to take the node back (definitions in scripts/chaos/report.py). Snapshots live on a
volume of fixed size (scripts/chaos/host.py; the runner needs root). At the end every snapshot
on disk is checked and the final accuracy is compared with an uninterrupted run.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import docker

from app.metrics import latest_per_step, read as read_metrics
from app.config import Config
from app.dataset_files import SYNTHETIC_FOLDER, SYNTHETIC_MANIFEST
from app.snapshot import SnapshotInvalid, TMP_PREFIX, UNUSABLE_PREFIX, complete_snapshots, read_snapshot
from scripts.chaos import report as chaos_report
from scripts.chaos.host import Partition, SnapshotVolume, worker_pids
from scripts.job import ComposeJob, owner

ROOT = Path(__file__).resolve().parents[2]
FAULTS = ("kill_worker", "kill_rank0", "kill_during_save", "restart_fast", "pause", "freeze_worker", "partition",
          "disk_full", "corrupt_newest", "scale_up", "store_restart", "back_to_back")
# Job configurations: the quick one (digits, a tiny CNN, seconds per epoch) and one of CIFAR's size
# (ResNet-18 on 50000 generated 32x32 images, on the host's ./data mounted at /mnt/data).
CONFIGS: dict[str, dict[str, Any]] = {
    "quick": {"dataset": "digits", "data_dir": None, "model": "tiny", "epochs": 400, "batch_size": 32, "lr": 0.05,
              "save_every": 20, "volume_mb": 256},
    "cifar-size": {"dataset": "synthetic", "data_dir": "/mnt/data", "model": "resnet18", "epochs": 40,
                   "batch_size": 32, "lr": 0.05, "save_every": 20, "volume_mb": 1024},
}
CIFAR_SIZE_TRAIN, CIFAR_SIZE_TEST = 50000, 10000


# ---------------------------------------------------------------- the job in containers

def trainer_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The job's trainer flags: a train row every step (steps lost are counted in steps)."""
    settings = {"dataset": args.dataset, "model": args.model, "epochs": args.epochs, "batch_size": args.batch_size,
                "lr": args.lr, "seed": args.seed, "log_every_steps": 1, "save_every_steps": args.save_every,
                "save_every_seconds": 0, "collective_timeout": args.collective_timeout, "progress": "lines"}
    if args.data_dir:
        settings["data_dir"] = args.data_dir
    return settings


def prepare_cifar_size_data() -> None:
    """The CIFAR-size configuration's images, generated once into ./data (mounted at /mnt/data)."""
    from scripts.prepare import write_synthetic

    manifest = ROOT / "data" / SYNTHETIC_FOLDER / SYNTHETIC_MANIFEST
    if manifest.exists() and json.loads(manifest.read_text()).get("train") == CIFAR_SIZE_TRAIN:
        return
    print(f"generating {CIFAR_SIZE_TRAIN} CIFAR-size images into {manifest.parent}", flush=True)
    write_synthetic(ROOT / "data", CIFAR_SIZE_TRAIN, CIFAR_SIZE_TEST)


class Job:
    """A ComposeJob (the store and N trainer nodes) plus what the runner sees of it: its events."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        # A run directory of its own per invocation: a reused one would resume (or already be
        # finished) from an earlier run's snapshots and metrics.
        name = f"{args.run_name}-{time.strftime('%Y%m%d-%H%M%S')}"
        self.compose_job = ComposeJob(name, args.nodes, nproc=args.nproc, project=args.project, rdzv_port=args.port,
                                  settings=trainer_settings(args), inherit_env=False,
                                  extra_env={"NNODES": f"1:{args.nodes + 1}", "TRAINER_RESTART": "no"})
        self.run_dir = self.compose_job.run_dir
        self.volume = SnapshotVolume(Path(args.out) / "snapshot-volume.img", self.run_dir / "snapshots", args.volume_mb)
        self.events: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._watched: set[str] = set()

    @property
    def nodes(self) -> int:
        return self.compose_job.nodes

    def up(self) -> None:
        self.compose_job.down()          # leftovers of an earlier run of this project
        self.volume.create(owner())
        self.compose_job.up()
        threading.Thread(target=self._follow_metrics, daemon=True).start()
        threading.Thread(target=self._follow_logs, daemon=True).start()

    def down(self) -> None:
        """Stop following the job and remove its containers."""
        self._stop.set()
        self.compose_job.down()

    def trainers(self, running: bool = False) -> list[Any]:
        return self.compose_job.trainers(running)

    # ------------------------------------------------------------ recording

    def record(self, **event: Any) -> dict[str, Any]:
        event.setdefault("time", time.time())
        with self._lock:
            self.events.append(event)
        return event

    def snapshot_events(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self.events)

    def _follow_metrics(self) -> None:
        path, offset = self.run_dir / "metrics.jsonl", 0
        while not self._stop.is_set():
            if path.exists():
                with open(path) as f:
                    f.seek(offset)
                    chunk = f.read()
                complete = chunk[: chunk.rfind("\n") + 1]
                offset += len(complete.encode())
                for line in complete.splitlines():
                    try:
                        self.record(kind="metric", **json.loads(line))
                    except (json.JSONDecodeError, TypeError):
                        continue
            time.sleep(0.2)

    def _follow_logs(self) -> None:
        while not self._stop.is_set():
            for c in self.trainers():
                key = f"{c.id}-{c.attrs['State'].get('StartedAt')}"
                if c.status == "running" and key not in self._watched:
                    self._watched.add(key)
                    threading.Thread(target=self._watch, args=(c,), daemon=True).start()
            time.sleep(0.5)

    def _watch(self, container: Any) -> None:
        try:
            for raw in container.logs(stream=True, follow=True, since=int(time.time()) - 1):
                line = raw.decode(errors="replace").rstrip()
                if any(mark in line for mark in chaos_report.LOG_MARKS):
                    self.record(kind="log", container=container.name, line=line[:300])
        except docker.errors.APIError:
            pass

    # ------------------------------------------------------------ waiting

    def wait_for(self, predicate: Callable[[list[dict[str, Any]]], bool], timeout: float) -> bool:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if predicate(self.snapshot_events()):
                return True
            time.sleep(0.2)
        return False

    def wait_training(self, world: int, since: float, timeout: float) -> bool:
        """A train row newer than `since` at this world size (steps advancing with everybody in)."""
        return self.wait_for(lambda ev: any(e["kind"] == "metric" and e["event"] == "train" and e["time"] > since
                                            and e["world_size"] == world for e in ev), timeout)

    def wait_restarted(self, since: float, timeout: float) -> bool:
        """A start row, then a train row, newer than `since`: the job went through a restart and trains."""
        def ok(ev: list[dict[str, Any]]) -> bool:
            starts = [e["time"] for e in ev if e["kind"] == "metric" and e["event"] == "start" and e["time"] > since]
            return bool(starts) and any(e["kind"] == "metric" and e["event"] == "train" and e["time"] > starts[0]
                                        for e in ev)
        return self.wait_for(ok, timeout)

    def finished(self) -> bool:
        return any(e["kind"] == "metric" and e["event"] == "eval" and e["epoch"] >= self.args.epochs
                   for e in self.snapshot_events())


# ---------------------------------------------------------------- faults

class Chaos:
    def __init__(self, job: Job, rng: random.Random, args: argparse.Namespace) -> None:
        self.job, self.rng, self.args = job, rng, args

    def schedule(self, count: int) -> list[str]:
        """Every kind at least once (when count allows), the rest drawn at random; scale_up brings scale_down."""
        kinds = list(self.args.only or FAULTS)
        self.rng.shuffle(kinds)
        plan = kinds[:count] + [self.rng.choice(kinds) for _ in range(max(0, count - len(kinds)))]
        return plan

    def inject(self, kind: str) -> None:
        getattr(self, f"_{kind}")()

    def _victim(self, rank0: bool) -> Any:
        running = self.job.trainers(running=True)
        if not running:
            raise RuntimeError("no trainer container is running: the job is down")
        holder = self.job.compose_job.rank0_container()
        pool = [c for c in running if (c == holder) == rank0] if holder is not None else running
        return self.rng.choice(pool or running)

    def _kill(self, fault: str, rank0: bool) -> None:
        victim = self._victim(rank0)
        fault_event = self.job.record(kind="fault", fault=fault, target=victim.name)
        victim.kill()
        self._recover_then_heal(fault_event, victim)

    def _kill_worker(self) -> None:
        self._kill("kill_worker", rank0=False)

    def _kill_rank0(self) -> None:
        self._kill("kill_rank0", rank0=True)

    def _kill_during_save(self) -> None:
        victim = self._victim(rank0=True)          # rank 0 is the writer
        snapshots = self.job.run_dir / "snapshots"
        deadline, hit = time.time() + 120, False
        while time.time() < deadline and not hit:
            hit = any(p.name.startswith(TMP_PREFIX) for p in snapshots.iterdir())
            if not hit:
                time.sleep(0.001)
        fault_event = self.job.record(kind="fault", fault="kill_during_save", target=victim.name, mid_save=hit)
        victim.kill()
        self._recover_then_heal(fault_event, victim)

    def _restart_fast(self) -> None:
        victim = self._victim(rank0=self.rng.random() < 0.5)
        self.job.record(kind="fault", fault="restart_fast", target=victim.name)
        t0 = time.time()
        victim.restart(timeout=0)
        self.job.record(kind="heal", action="back_from_restart", target=victim.name, world_size=self._world())
        self.job.wait_training(self._world(), t0, self.args.fault_timeout)

    def _pause(self) -> None:
        victim = self._victim(rank0=self.rng.random() < 0.5)
        fault_event = self.job.record(kind="fault", fault="pause", target=victim.name, pause_s=self.args.pause)
        victim.pause()
        self.job.wait_restarted(fault_event["time"], self.args.pause)
        time.sleep(max(0.0, fault_event["time"] + self.args.pause - time.time()))
        self.job.record(kind="heal", action="unpause", target=victim.name, world_size=self._world())
        victim.unpause()
        self.job.wait_training(self._world(), time.time(), self.args.fault_timeout)

    def _freeze_worker(self) -> None:
        """SIGSTOP one training process; its node's agent runs on and sees it alive. The other ranks
        miss its heartbeat; the agent stops it when the next rendezvous round asks it to (SIGTERM
        waits while it is stopped: torchrun's SIGKILL follows 30 s later), and the node rejoins."""
        victim = self._victim(rank0=self.rng.random() < 0.5)
        pid = self.rng.choice(worker_pids(victim))
        fault_event = self.job.record(kind="fault", fault="freeze_worker", target=victim.name, pid=pid)
        os.kill(pid, signal.SIGSTOP)
        self.job.wait_restarted(fault_event["time"], self.args.fault_timeout)
        self.job.record(kind="heal", action="rejoin_by_itself", target=victim.name, world_size=self._world())
        self.job.wait_training(self._world(), time.time(), self.args.fault_timeout)

    def _partition(self) -> None:
        """Cut one node off the network while it runs; reconnect it once the others train without it."""
        victim = self._victim(rank0=self.rng.random() < 0.5)
        cut = Partition(victim)
        fault_event = self.job.record(kind="fault", fault="partition", target=victim.name)
        cut.cut()
        try:
            self.job.wait_restarted(fault_event["time"], self.args.fault_timeout)
            time.sleep(self.rng.uniform(*self.args.gap))
        finally:
            self.job.record(kind="heal", action="reconnect", target=victim.name, world_size=self._world())
            cut.heal()
        self.job.wait_training(self._world(), time.time(), self.args.fault_timeout)

    def _disk_full(self) -> None:
        """Fill the snapshot volume until a save fails, let the job train on, then free the space."""
        fault_event = self.job.record(kind="fault", fault="disk_full", target="snapshot volume", restart_expected=False)
        filled = self.job.volume.fill()
        self.job.wait_for(lambda ev: any(e["kind"] == "log" and chaos_report.SAVE_FAILED_MARK in e["line"]
                                         and e["time"] > fault_event["time"] for e in ev), self.args.fault_timeout)
        time.sleep(self.rng.uniform(*self.args.gap))
        self.job.record(kind="heal", action="free_space", target=f"{filled >> 20} MB", world_size=self._world())
        self.job.volume.free()

    def _corrupt_newest(self) -> None:
        """Corrupt the newest snapshot on disk, then kill every node at once (paused first, so that none
        can write a newer one) and start them: the job must skip it and resume from the one before."""
        running = self.job.trainers(running=True)
        for node in running:
            node.pause()
        snapshots = complete_snapshots(self.job.run_dir / "snapshots")
        if not snapshots:
            for node in running:
                node.unpause()
            return self._kill_worker()
        part = snapshots[0] / "model.pt"
        with open(part, "r+b") as f:                # flip bytes in the middle of the weights
            f.seek(part.stat().st_size // 2)
            chunk = f.read(64)
            f.seek(-len(chunk), os.SEEK_CUR)
            f.write(bytes(b ^ 0xFF for b in chunk))
        fault_event = self.job.record(kind="fault", fault="corrupt_newest", target=snapshots[0].name, survivor=False)
        for node in running:
            node.kill()
        time.sleep(self.rng.uniform(0.5, 2.0))
        self.job.record(kind="heal", action="start_all", target=f"{len(running)} nodes", world_size=self._world())
        for node in running:
            node.start()
        self.job.wait_training(self._world(), fault_event["time"], self.args.fault_timeout)

    def _scale_up(self) -> None:
        nodes = self.job.nodes + 1
        self.job.record(kind="heal", action="scale_up", target=f"node {nodes}", world_size=nodes * self.args.nproc)
        t0 = time.time()
        self.job.compose_job.scale(nodes)
        self.job.wait_training(self._world(), t0, self.args.fault_timeout)
        time.sleep(self.rng.uniform(*self.args.gap))
        self.job.record(kind="fault", fault="scale_down", target=f"node {nodes}")   # one leaves cleanly
        t0 = time.time()
        self.job.compose_job.scale(nodes - 1)
        self.job.wait_training(self._world(), t0, self.args.fault_timeout)

    def _store_restart(self) -> None:
        store = self.job.compose_job.store()
        self.job.record(kind="fault", fault="store_restart", target=store.name)
        t0 = time.time()
        store.restart(timeout=0)
        # The agents lose the rendezvous state with the store: each one exits, its entrypoint
        # brings the node back under a new identity, and the job resumes from its snapshot.
        self.job.wait_restarted(t0, self.args.fault_timeout)
        self.job.wait_training(self._world(), t0, self.args.fault_timeout)

    def _back_to_back(self) -> None:
        """Two kills a moment apart: the second lands while the job is still recovering from the first."""
        running = self.job.trainers(running=True)
        if len(running) < 2:
            return self._kill_worker()
        first, second = running[:2]
        self.job.record(kind="fault", fault="kill_back_to_back_1", target=first.name, back_to_back=True)
        first.kill()
        time.sleep(self.rng.uniform(1.0, 3.0))
        fault_event = self.job.record(kind="fault", fault="kill_back_to_back_2", target=second.name, back_to_back=True)
        second.kill()
        for victim in (first, second):
            victim.start()
        self.job.record(kind="heal", action="start", target=f"{first.name}+{second.name}", world_size=self._world())
        self.job.wait_training(self._world(), fault_event["time"], self.args.fault_timeout)

    def _recover_then_heal(self, fault_event: dict[str, Any], victim: Any) -> None:
        survivors = len(self.job.trainers(running=True))
        if survivors:
            self.job.wait_restarted(fault_event["time"], self.args.fault_timeout)
        time.sleep(self.rng.uniform(0.5, 2.0))
        self.job.record(kind="heal", action="start", target=victim.name, world_size=self._world())
        t0 = time.time()
        victim.start()
        self.job.wait_training(self._world(), t0, self.args.fault_timeout)

    def _world(self) -> int:
        return self.job.nodes * self.args.nproc


# ---------------------------------------------------------------- the run

def baseline_accuracy(args: argparse.Namespace, job: Job) -> float | None:
    """The same configuration, uninterrupted, under torchrun on this host with the same world size."""
    run_dir = job.run_dir.with_name(f"{job.run_dir.name}-baseline")
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in trainer_settings(args).items()]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nodes * args.nproc}",
           "-m", "app.train", *flags, f"--run-dir={run_dir}", "--no-resume"]
    done = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    rows = latest_per_step(read_metrics(run_dir / "metrics.jsonl")) if done.returncode == 0 else []
    evals = [r for r in rows if r["event"] == "eval"]
    return evals[-1]["test_acc"] if evals else None


def check_snapshots(directory: Path) -> dict[str, Any]:
    """Every snapshot in rotation must read back; those the job set aside as unusable are counted apart."""
    valid, corrupt = 0, []
    for path in complete_snapshots(directory):
        try:
            read_snapshot(path)
            valid += 1
        except SnapshotInvalid as exc:
            corrupt.append(f"{path.name}: {exc}")
    partial = [p.name for p in directory.glob(f"{TMP_PREFIX}*")]
    set_aside = sorted(p.name for p in directory.glob(f"{UNUSABLE_PREFIX}*"))
    return {"valid_snapshots": valid, "corrupt_snapshots": len(corrupt), "corrupt": corrupt, "temp_leftovers": partial,
            "set_aside_unusable": set_aside}


def run(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.config == "cifar-size":
        prepare_cifar_size_data()
    job, rng = Job(args), random.Random(args.seed)
    chaos = Chaos(job, rng, args)
    started = time.time()
    job.up()
    try:
        if not job.wait_training(args.nodes * args.nproc, started, args.start_timeout):
            raise SystemExit(f"error: the job did not start training at world size {args.nodes * args.nproc} "
                             f"within {args.start_timeout:.0f} s; see `docker compose -p {args.project} logs`")
        job.record(kind="ready", seconds=round(time.time() - started, 2))
        plan = chaos.schedule(args.faults)
        for i, kind in enumerate(plan):
            if job.finished():
                print(f"the job finished after {i} faults; raise --epochs for more", flush=True)
                break
            time.sleep(rng.uniform(*args.gap))
            print(f"[{time.time() - started:7.1f}s] fault {i + 1}/{len(plan)}: {kind}", flush=True)
            chaos.inject(kind)
        completed = job.wait_for(lambda ev: job.finished(), args.finish_timeout)
    except Exception as exc:   # keep what was measured: the report says where the run broke
        job.record(kind="runner_error", error=f"{type(exc).__name__}: {exc}")
        completed = False
    finally:
        time.sleep(1.0)
        events = job.snapshot_events()
        (out / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
        job.down()
    faults, heals = chaos_report.measure(events)
    summary = chaos_report.summarise(faults, heals)
    summary.update(check_snapshots(job.run_dir / "snapshots"))
    job.volume.remove()
    # The job's final accuracy is its newest eval row that no later resume superseded.
    evals = [e for e in latest_per_step([e for e in events if e["kind"] == "metric"]) if e["event"] == "eval"]
    summary["completed"] = bool(completed)
    summary["final_test_acc"] = evals[-1]["test_acc"] if evals else None
    summary["baseline_test_acc"] = baseline_accuracy(args, job) if args.baseline and completed else None
    if summary["final_test_acc"] is not None and summary["baseline_test_acc"] is not None:
        summary["acc_delta_points"] = round(100 * (summary["final_test_acc"] - summary["baseline_test_acc"]), 2)
    summary["wall_s"] = round(time.time() - started, 1)
    report = {"summary": summary, "faults": faults, "heals": heals,
              "config": {**vars(args), "run_dir": str(job.run_dir), "trainer": trainer_settings(args)}}
    summary["runner_errors"] = [e["error"] for e in events if e["kind"] == "runner_error"]
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    chaos_report.plot_timeline(events, out / "timeline.png")
    return report


def print_table(report: dict[str, Any]) -> None:
    print(f"{'fault':18}{'target':18}{'world':>7}{'detect s':>9}{'recover s':>10}{'lost':>5}  where the seconds went")
    for f in report["faults"]:
        world = f"{f['world_before']}->{_fmt(f['world_after'])}"
        went = " ".join(f"{phase} {seconds}" for phase, seconds in (f.get("breakdown") or {}).items())
        if "kept_training" in f:
            went = f"kept training: {f['kept_training']}, saves failed: {f['saves_failed']}"
        print(f"{f['fault']:18}{str(f['target'])[:17]:18}{world:>7}{_fmt(f['detection_s']):>9}"
              f"{_fmt(f['recovery_s']):>10}{_fmt(f['steps_lost']):>5}  {went}")
    for h in report["heals"]:
        print(f"{'  heal: ' + h['heal']:18}{str(h['target'])[:17]:18}{'':>7}{'rejoin':>9}{_fmt(h['rejoin_s']):>10}")
    print(json.dumps(report["summary"], indent=1))


def _fmt(value: Any) -> str:
    return "-" if value is None else str(value)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", choices=sorted(CONFIGS), default="quick",
                   help="the job: quick (digits, tiny CNN) or cifar-size (ResNet-18, 50000 images); "
                        "the flags below override its values")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--nproc", type=int, default=1, help="processes per node")
    p.add_argument("--faults", type=int, default=20)
    p.add_argument("--only", type=lambda v: [k for k in v.split(",") if k], default=None,
                   help=f"comma-separated fault kinds to draw from (default all: {', '.join(FAULTS)})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dataset")
    p.add_argument("--data-dir", help="the dataset's directory inside the containers")
    p.add_argument("--model")
    p.add_argument("--epochs", type=int, help="long enough to outlast the faults")
    p.add_argument("--batch-size", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--save-every", type=int, help="periodic snapshot interval, steps")
    p.add_argument("--volume-mb", type=int, help="size of the snapshot volume, MB")
    p.add_argument("--collective-timeout", type=float, default=Config().collective_timeout,
                   help="seconds; the last line of defence (heartbeats catch hung nodes first)")
    p.add_argument("--pause", type=float, default=20.0, help="seconds a paused node stays paused")
    p.add_argument("--gap", type=float, nargs=2, default=(3.0, 8.0), help="seconds between faults (min max)")
    p.add_argument("--fault-timeout", type=float, default=120.0)
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--finish-timeout", type=float, default=1800.0)
    p.add_argument("--port", type=int, default=29411, help="rendezvous store port on this host")
    p.add_argument("--run-name", default="chaos", help="run directory runs/NAME-DATE and rendezvous id")
    p.add_argument("--project", default="ftt-chaos", help="compose project name")
    p.add_argument("--no-baseline", dest="baseline", action="store_false")
    p.add_argument("--out", default=str(ROOT / "chaos"))
    args = p.parse_args(argv)
    for key, value in CONFIGS[args.config].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.gap = tuple(args.gap)
    unknown = sorted(set(args.only or ()) - set(FAULTS))
    if unknown:
        print(f"error: unknown fault kind {', '.join(unknown)}; choose from {', '.join(FAULTS)}", file=sys.stderr)
        return 2
    if args.nodes < 2:
        print("error: --nodes must be at least 2 (faults need a survivor)", file=sys.stderr)
        return 2
    if os.getuid() != 0:
        print("error: the chaos runner needs root (a loop-mounted snapshot volume, iptables, cgroups)", file=sys.stderr)
        return 2
    report = run(args)
    print_table(report)
    return 0 if report["summary"]["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
