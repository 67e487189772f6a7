"""Inplace against elastic in containers: the pace of each mode with no fault, side by side, as `make up
NODES=2 FT=...` starts them on this host.

    python -m bench.container_modes          # -> bench/container_modes.json and a markdown table

Each job is scripts/job.py's ComposeJob, as `make up NODES=2 FT=MODE DATASET=digits EPOCHS=...
LOG_EVERY_STEPS=N` starts it (the store service and two node containers of one process, each node on
a core of its own; the default digits job, tiny CNN, batch 32 per process, its default snapshots and
an evaluation every epoch), but in a compose project, on ports and under an image tag of this
bench's own: other jobs on this host (`make up`, the docker tier, the chaos runner) are never
touched, and a concurrent rebuild of ftt-trainer:latest from another checkout cannot change what is
measured. The image is built from this checkout first (layers cached; --no-build uses it as it is).

The modes are interleaved, A B A B, at each row cadence (--log-every-steps 10, the default, and 1,
a train row and a console line every step): a drift of the machine's load moves both modes alike.
Each job is started, seen training at world size 2, left --seconds, then stopped.
- pace: steps per second over wall time at world size 2 from metrics.jsonl
  (app.reporting.metrics.pace: from PACE_SETTLE_S after the first such row to the last one);
  img/s = pace x 32 images x 2 processes;
- ratio: inplace's pace over elastic's, per pair, and over the means of the repeats;
- load: the host's 1-minute load average before and after the window, the running containers of
  other compose projects then, and the CPU the counted window saw (/proc/stat, the containers'
  cgroups): the job's containers, the docker daemons (dockerd, containerd and its shims, which
  also carry the nodes' console output to `docker logs`), and every other process of the host
  (`others`, in cores): on a shared machine the figures move with them;
- disturbed: a world size other than 2, or another start, within the window (the pace then counts
  only the rows at world size 2; the table marks it).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from app.core.config import DATASET_DEFAULTS
from app.reporting import metrics
from app.reporting.metrics import PACE_SETTLE_S
from scripts.job import REPO, ComposeJob, JobError

RESULTS = REPO / "bench" / "container_modes.json"
PROJECT = "ftt-bench-modes"     # never ftt (make up), ftt-test / ftt-make-test (docker tier), ftt-chaos
RDZV_PORT = 29441               # make up 29400, chaos 29411, docker tier 29421, make tier 29431
LIGHTHOUSE_PORT = 29541         # make up 29510, docker tier 29521
IMAGE = "ftt-trainer:bench-modes"
NODES = 2
BATCH = DATASET_DEFAULTS["digits"]["batch_size"]       # images per process per step
WORLD_TIMEOUT_S = 240           # a start until a train row at world size 2


def job_for(mode: str, cadence: int, repeat: int, args: argparse.Namespace) -> ComposeJob:
    """`make up NODES=2 FT=mode DATASET=digits EPOCHS=... LOG_EVERY_STEPS=cadence`, placed beside any other job."""
    run = f"modes-{mode}-every{cadence}-{repeat}-{time.strftime('%H%M%S')}"
    settings = {"ft": mode, "dataset": "digits", "epochs": args.epochs, "log_every_steps": cadence}
    return ComposeJob(run, NODES, project=args.project, rdzv_port=args.port, settings=settings,
                      inherit_env=False, runs_dir=args.runs_dir,
                      extra_env={"IMAGE": args.image, "LIGHTHOUSE_PORT": str(args.lighthouse_port)})


def others_running(job: ComposeJob) -> int:
    """Running containers of other compose projects (other engineers' jobs and tests)."""
    return sum(c.labels.get("com.docker.compose.project") != job.project for c in job.client.containers.list())


def host_busy_s() -> float:
    """CPU seconds the host's cores have been busy since boot (/proc/stat: all but idle and iowait)."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, Path("/proc/stat").read_text().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def container_cpu_s(container_id: str) -> float | None:
    """CPU seconds a container's processes have used (its cgroup, v1 or v2), None where unreadable."""
    for path in (f"/sys/fs/cgroup/cpuacct/docker/{container_id}/cpuacct.usage",
                 f"/sys/fs/cgroup/cpu,cpuacct/docker/{container_id}/cpuacct.usage"):
        if os.path.exists(path):
            return int(Path(path).read_text()) / 1e9
    path = f"/sys/fs/cgroup/system.slice/docker-{container_id}.scope/cpu.stat"
    if os.path.exists(path):
        return int(re.search(r"usage_usec (\d+)", Path(path).read_text()).group(1)) / 1e6
    return None


def daemons_cpu_s() -> float:
    """CPU seconds of dockerd, containerd and containerd's shims (host processes)."""
    total = 0.0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:     # gone meanwhile
            continue
        comm, rest = text[text.index("(") + 1:text.rindex(")")], text[text.rindex(")") + 2:].split()
        if comm == "dockerd" or comm.startswith("containerd"):
            total += (int(rest[11]) + int(rest[12])) / os.sysconf("SC_CLK_TCK")    # utime, stime
    return total


def cpu_now(job: ComposeJob) -> dict[str, float | None]:
    containers = [container_cpu_s(c.id) for c in job.containers() if c.status == "running"]
    return {"host": host_busy_s(), "job": None if None in containers else sum(containers),
            "docker_daemons": daemons_cpu_s(), "time": time.time()}


def cpu_between(a: dict[str, float | None], b: dict[str, float | None]) -> dict[str, float | None]:
    """Cores busy on average between two cpu_now()s: the job's containers, the docker daemons, the rest."""
    seconds = b["time"] - a["time"]
    used = {k: None if a[k] is None or b[k] is None else (b[k] - a[k]) / seconds for k in ("host", "job", "docker_daemons")}
    others = None if None in used.values() else used["host"] - used["job"] - used["docker_daemons"]
    return {**{k: None if v is None else round(v, 2) for k, v in used.items()},
            "others": None if others is None else round(others, 2)}


def measure(job: ComposeJob, seconds: float) -> dict[str, Any]:
    since = time.time()
    job.start(WORLD_TIMEOUT_S)
    full = job.wait_row(f"a train row at world size {NODES}",
                        lambda r: r["time"] >= since and r["world_size"] == NODES, WORLD_TIMEOUT_S)
    time.sleep(max(0.0, full["time"] + PACE_SETTLE_S - time.time()))     # where the pace begins to count
    load_before, others_before, cpu_before = os.getloadavg()[0], others_running(job), cpu_now(job)
    time.sleep(max(0.0, full["time"] + seconds - time.time()))
    until = time.time()
    load_after, others_after, cpu_after = os.getloadavg()[0], others_running(job), cpu_now(job)
    rows = [r for r in job.rows() if since <= r["time"] <= until]
    steps_per_s = metrics.pace(rows, NODES, since=since, until=until)
    window = [r for r in rows if r["event"] == "train" and r["time"] >= full["time"]]
    starts = [r for r in rows if r["event"] == "start"]
    worlds = sorted({r["world_size"] for r in window})
    return {"run": job.run, "steps_per_s": None if steps_per_s is None else round(steps_per_s, 2),
            "images_per_s": None if steps_per_s is None else round(steps_per_s * BATCH * NODES),
            "steps": window[-1]["step"] - window[0]["step"], "train_rows": len(window),
            "world_sizes": worlds, "start_rows": len(starts),
            "disturbed": worlds != [NODES] or any(r["time"] > full["time"] for r in starts),
            "threads": [r.get("threads") for r in starts], "ft_backend": [r.get("ft_backend") for r in starts],
            "to_full_size_s": round(full["time"] - since, 1),
            "load_average": [round(load_before, 2), round(load_after, 2)],
            "other_containers": [others_before, others_after],
            "cores_busy": cpu_between(cpu_before, cpu_after)}


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def summarise(runs: list[dict[str, Any]], modes: list[str], cadences: list[int]) -> dict[str, Any]:
    """Per cadence: each mode's mean pace over its repeats, and the last mode's over the first's."""
    out: dict[str, Any] = {}
    for cadence in cadences:
        mean = {}
        for mode in modes:
            paces = [r["steps_per_s"] for r in runs if r["mode"] == mode and r["cadence"] == cadence
                     and r.get("steps_per_s")]
            mean[mode] = round(statistics.fmean(paces), 2) if paces else None
        pairs = [ratio(b.get("steps_per_s"), a.get("steps_per_s"))
                 for a, b in _pairs(runs, modes, cadence)]
        out[str(cadence)] = {"mean_steps_per_s": mean, "ratio_of_means": ratio(mean[modes[-1]], mean[modes[0]]),
                             "pair_ratios": pairs}
    return out


def _pairs(runs: list[dict[str, Any]], modes: list[str], cadence: int) -> list[tuple[dict, dict]]:
    first = [r for r in runs if r["cadence"] == cadence and r["mode"] == modes[0]]
    last = [r for r in runs if r["cadence"] == cadence and r["mode"] == modes[-1]]
    return list(zip(first, last))


def table(runs: list[dict[str, Any]], summary: dict[str, Any], modes: list[str], cadences: list[int]) -> str:
    a, b = modes[0], modes[-1]
    lines = [f"| train row every | repeat | {a} steps/s | {b} steps/s | {b}/{a} | load average ({a}; {b}) "
             f"| cores busy: job, docker daemons, others ({a}; {b}) | other containers running |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]

    def pace(r: dict[str, Any]) -> str:
        if "error" in r:
            return "failed"
        return f"{r['steps_per_s']}{' (disturbed)' if r['disturbed'] else ''}"

    def around(r: dict[str, Any], key: str) -> str:
        return "-".join(map(str, r.get(key, []))) or "-"

    def cores(r: dict[str, Any]) -> str:
        busy = r.get("cores_busy") or {}
        return ", ".join(str(busy.get(k, "-")) for k in ("job", "docker_daemons", "others"))

    for cadence in cadences:
        for i, (ra, rb) in enumerate(_pairs(runs, modes, cadence), 1):
            steps = "step" if cadence == 1 else f"{cadence} steps"
            lines.append(f"| {steps} | {i} | {pace(ra)} | {pace(rb)} | {ratio(rb.get('steps_per_s'), ra.get('steps_per_s'))} "
                         f"| {around(ra, 'load_average')}; {around(rb, 'load_average')} | {cores(ra)}; {cores(rb)} "
                         f"| {around(ra, 'other_containers')}; {around(rb, 'other_containers')} |")
        s = summary[str(cadence)]
        lines.append(f"| {'step' if cadence == 1 else f'{cadence} steps'} | mean | {s['mean_steps_per_s'][a]} "
                     f"| {s['mean_steps_per_s'][b]} | **{s['ratio_of_means']}** | | | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.container_modes", description=__doc__.splitlines()[0])
    p.add_argument("--modes", default="elastic,inplace", help="comma-separated, interleaved in this order; "
                   "the ratio is the last one's pace over the first one's")
    p.add_argument("--cadences", default="10,1", help="--log-every-steps values, comma-separated: a train row "
                   "(and a console line) every N steps")
    p.add_argument("--repeats", type=int, default=2, help="A B pairs at each cadence")
    p.add_argument("--seconds", type=float, default=70.0,
                   help=f"seconds each job trains at world size {NODES}, the first {PACE_SETTLE_S:g} not counted")
    p.add_argument("--epochs", type=int, default=2000, help="more than the window takes; the job is stopped after it")
    p.add_argument("--image", default=IMAGE, help="the image tag the jobs run (built from this checkout first)")
    p.add_argument("--no-build", action="store_true", help="run --image as it is")
    p.add_argument("--project", default=PROJECT, help="the compose project of the jobs")
    p.add_argument("--port", type=int, default=RDZV_PORT, help="the store service's port")
    p.add_argument("--lighthouse-port", type=int, default=LIGHTHOUSE_PORT)
    p.add_argument("--runs-dir", type=Path, default=None,
                   help="where the jobs' run directories are kept (default: a temporary one, removed at the end)")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    modes = args.modes.split(",")
    if len(modes) < 2 or not set(modes) <= {"elastic", "inplace", "torchft"}:
        p.error("--modes: two or more of elastic, inplace, torchft")
    try:
        cadences = [int(c) for c in args.cadences.split(",")]
    except ValueError:
        p.error("--cadences: whole numbers, e.g. 10,1")
    if any(c < 1 for c in cadences) or args.repeats < 1:
        p.error("--cadences and --repeats must be positive")
    if args.seconds <= PACE_SETTLE_S + 5:
        p.error(f"--seconds must be more than {PACE_SETTLE_S + 5:g}: the first {PACE_SETTLE_S:g} are not counted")
    keep = args.runs_dir is not None
    args.runs_dir = (args.runs_dir or Path(tempfile.mkdtemp(prefix="container-modes-"))).resolve()
    # `timeout` or Ctrl-C: the job running is stopped on the way out (the finally below), not left training.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))

    from bench.overhead import machine     # torch: only once the arguments are good

    record: dict[str, Any] = {"command": " ".join(["python -m bench.container_modes", *(argv or sys.argv[1:])]),
                              "machine": machine(), "image": args.image, "project": args.project,
                              "seconds": args.seconds, "counted_after_s": PACE_SETTLE_S, "epochs": args.epochs,
                              "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "runs": []}
    runs: list[dict[str, Any]] = record["runs"]
    try:
        if not args.no_build:
            job_for(modes[0], cadences[0], 0, args).build()
        for cadence in cadences:
            for repeat in range(1, args.repeats + 1):
                for mode in modes:
                    job = job_for(mode, cadence, repeat, args)
                    job.down()          # anything this project left (only its own containers)
                    run: dict[str, Any] = {"mode": mode, "cadence": cadence, "repeat": repeat}
                    try:
                        run.update(measure(job, args.seconds))
                    except JobError as exc:
                        run["error"] = str(exc).splitlines()[0]
                        print(f"{mode}, a row every {cadence}: {exc}", file=sys.stderr, flush=True)
                    finally:
                        job.down()
                    runs.append(run)
                    print(json.dumps(run), flush=True)
                    record["summary"] = summarise(runs, modes, cadences)
                    record["ended"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
                    args.out.write_text(json.dumps(record, indent=1) + "\n")
    finally:
        if not keep:
            shutil.rmtree(args.runs_dir, ignore_errors=True)
    print(table(runs, record["summary"], modes, cadences), flush=True)
    return 0 if all("error" not in r for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
