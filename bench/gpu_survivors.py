"""Both survivor modes on a GPU host: faults timed, 50 generations formed and aborted, inplace's pace.

    python -m bench.gpu_survivors               # a host with a GPU, its own torch, no Docker: at most 8 minutes
    python -m bench.gpu_survivors --dry-run     # any host, CPU and gloo, tiny sizes: the script itself (in the suite)
    python3 -m bench.gpu_survivors --budget 210 --timeout 60 --generations 50 --pace-rounds 0 \
        --communicators blocking,nonblocking    # the kill and the freeze with each kind of NCCL communicator

Writes bench/gpu_survivors.json and bench/gpu_survivors.md (--out). One GPU is enough: every process
uses the first one, and two nodes of one job talk as two hosts over sockets (each its own
NCCL_HOSTID, NCCL_SOCKET_IFNAME=lo, no InfiniBand; NCCL refuses two ranks of one host on one GPU).
That transport is slow and unsupported: its figures time the fault handling, not NCCL's bandwidth.

1. faults, in each survivor mode (inplace, torchft; torchft skipped, and said so, where it is not
   installed): two nodes of one process each (`app.launch --standalone`, the README's lines) train
   the default GPU job with a row every step; then
   - kill: node 1's agent and worker SIGKILLed at a random moment of a step (over sockets the
     all-reduce is most of it), started again after --down seconds: the survivor's stall (its
     longest gap between rows until its first row alone), whether its process was replaced (and
     its node's `error:` lines if so), committed steps lost, and the rejoin (new start to a row
     with both nodes);
   - freeze: node 1's worker SIGSTOPped: the hung-peer drop (freeze to the survivor's first row
     alone) and its stall; then SIGCONT: back (to a row with both again), and whether the woken
     process is the one that came back.
   Then the survivor's `warning:` lines about NCCL groups (an end past INPLACE_GROUP_BOUND, left
   behind; one that ended after all). inplace's targets on NCCL (issues 36, 54): stall after a kill
   <= 2 s in the same process, a frozen peer dropped <= 2 s. --communicators runs inplace's faults
   once per kind of NCCL communicator: blocking (torch's default) and nonblocking
   (TORCH_NCCL_USE_COMM_NONBLOCKING=1, TORCH_NCCL_NONBLOCKING_TIMEOUT=INPLACE_GROUP_BOUND), each
   its own row ("inplace", "inplace nonblocking").
2. generations: one process alone forms a group of one, all-reduces on it and ends it (inplace's own
   code, app/ft/groups.py: NCCL on a GPU, aborted and dropped in a thread of its own), 50 times:
   GPU memory (the device's used memory, which includes NCCL's own buffers, and torch's allocated)
   and the process's thread count after the first and after the last, each once the ends are
   through, must be flat; the longest end, and the ends stuck past INPLACE_GROUP_BOUND.
3. pace: the default GPU job in one process, elastic (`app.launch`) against inplace (one member, its
   store), interleaved A B A B: steps per second over wall time (app.reporting.metrics.pace), and
   inplace's over elastic's. One process each: what inplace's step costs beside elastic's on the same
   GPU (two nodes on one GPU would time the socket transport).
Each part gets what is left of the --budget; a part that does not fit is skipped and said so. The
dry run (CPU, gloo, the digits job, the faults in inplace mode only, every part at once) checks the
script, not the figures: tests/test_gpu_survivors.py runs it.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import signal
import socket
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from app.core.policy import DEFAULT
from app.ft.groups import groups_for, set_nccl_environment
from app.launch import _children
from app.reporting import metrics
from app.reporting.metrics import PACE_SETTLE_S
from bench.ft_modes import Job, one_fault
from bench.overhead import machine
from bench.progress import say
from scripts.prepare import write_decoded, write_synthetic

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "gpu_survivors.json"
# What each kind of NCCL communicator adds to a training process's environment (--communicators). The
# non-blocking timeout bounds an init or abort inside torch (its default: 30 minutes).
COMMUNICATORS: dict[str, dict[str, str]] = {
    "blocking": {},
    "nonblocking": {"TORCH_NCCL_USE_COMM_NONBLOCKING": "1",
                    "TORCH_NCCL_NONBLOCKING_TIMEOUT": str(int(DEFAULT.inplace_group_bound_s))},
}
ENDS_SAID = "NCCL group"        # in the survivor's warning lines about a generation's end (app/ft/groups.py)
TARGET_S = 2.0          # issue 36: inplace on NCCL, survivors' stall after a kill and a frozen peer's drop
FLAT_MEMORY_MIB = 64    # device memory that may move across the generations without counting as growth
# Threads likewise: an aborted group's threads end after its abort returns (the H200, NCCL: 36 -> 37
# over 20 generations, 36 -> 36 over 50). A leak grows with the generations.
FLAT_THREADS = 2
ENDS_EXIT_S = 0.2       # after the ends are through: their threads and their bounds' timers have exited


class Budget:
    """The seconds left of --budget: every wait takes at most what is left."""

    def __init__(self, seconds: float) -> None:
        self.until = time.monotonic() + seconds

    def left(self, wanted: float | None = None) -> float:
        left = max(0.0, self.until - time.monotonic())
        return left if wanted is None else min(wanted, left)


class TwoHosts(Job):
    """A job whose nodes each count as a host of their own to NCCL, on one GPU."""

    def node_env(self, i: int) -> dict[str, str]:
        return {**super().node_env(i), "NCCL_HOSTID": f"gpu-survivors-{os.getpid()}-{i}"}


def gpu() -> bool:
    return torch.cuda.is_available()


def job_flags(args: argparse.Namespace, data_dir: Path | None, log_every: int = 1) -> list[str]:
    """The default GPU job (bench/overhead.py's: ResNet-18, 512 images, synthetic CIFAR-size, bf16 on its
    own), a row every `log_every` steps; the dry run's digits job."""
    flags = ["--epochs", "1000", "--log-every-steps", str(log_every), "--progress", "lines"]
    if args.dry_run:
        return ["--dataset", "digits", *flags]
    return ["--dataset", "synthetic", "--data-dir", str(data_dir), "--model", "resnet18", "--batch-size", "512",
            "--augment", "false", *flags]


def training_env(args: argparse.Namespace, communicator: str = "blocking") -> dict[str, str]:
    """What every training process of this script gets: the environment this script was started with
    (not the NCCL settings it gave itself: each mode sets its own), the first GPU only, NCCL over
    loopback sockets, the communicator's settings."""
    env = {k: v for k, v in args.environ.items() if k != "OMP_NUM_THREADS"}
    env.update({"NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1", "GLOO_SOCKET_IFNAME": "lo"})
    env.update(COMMUNICATORS[communicator])
    if gpu():
        env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    return env


def free_port_pair() -> int:
    """A port p with p + 1 free too (inplace's store puts its idle Lighthouse one port up)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue


def started(job: Job, budget: Budget, timeout: float) -> str | None:
    """None once the job trains at its full size; else why not: its nodes' first error line, else the
    last lines they wrote (the first run on a new machine has only this file to go by)."""
    if job.wait(lambda r: r["world_size"] == job.world, budget.left(timeout)) is not None:
        return None
    lines = [(job.tmp / f"node{i}.err").read_text().splitlines() for i in range(job.world)]
    said = [line for i in range(job.world) for line in job.said(i)]
    last = " | ".join(line.strip()[:300] for node in lines for line in node[-3:])
    return f"never trained at world size {job.world}: " + (said[0] if said else last or "nothing said")


def one_freeze(job: Job, timeout: float) -> dict[str, Any]:
    """SIGSTOP node 1's worker until the survivor trains alone, then SIGCONT: the drop, the stall, the way back."""
    workers = _children(job.nodes[1].pid)
    if not workers:
        return {"error": "node 1 has no worker to freeze"}
    worker = workers[0]
    frozen = time.time()
    os.kill(worker, signal.SIGSTOP)
    alone = job.wait(lambda r: r["time"] > frozen and r["world_size"] == 1, timeout)
    rows = [r["time"] for r in job.rows() if r["time"] > frozen - 5]
    stall = max((b - a for a, b in zip(rows, rows[1:]) if b > frozen), default=None)
    try:
        os.kill(worker, signal.SIGCONT)
    except ProcessLookupError:
        pass                # its agent killed it meanwhile (a worker stopped too long)
    woke = time.time()
    back = job.wait(lambda r: r["time"] > woke and r["world_size"] == 2, timeout)
    return {"drop_s": None if alone is None else round(alone["time"] - frozen, 2),
            "stall_s": None if stall is None else round(stall, 2),
            "back_s": None if back is None else round(back["time"] - woke, 2),
            "same_process_back": worker in _children(job.nodes[1].pid)}


def faults(mode: str, args: argparse.Namespace, flags: list[str], budget: Budget,
           communicator: str = "blocking") -> dict[str, Any]:
    """Part 1 in one survivor mode: a kill, then a freeze, of node 1 of a two-node job."""
    if mode == "torchft" and importlib.util.find_spec("torchft") is None:
        return {"skipped": "torchft is not installed in this Python"}
    if budget.left() < args.timeout / 2:
        return {"skipped": "over the budget"}
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as tmp:
        job = TwoHosts(mode, free_port_pair(), flags, Path(tmp), env=training_env(args, communicator))
        try:
            why = started(job, budget, args.timeout)
            if why:
                return {"error": why}
            start = job.rows("start")[0]
            time.sleep(random.uniform(0.5, 1.5))        # a random moment of some step
            kill = one_fault(job, args.down, budget.left(args.timeout))
            if kill["back_s"] is None:
                return {"kill": kill, "error": "the restarted node never trained with the survivor again"}
            time.sleep(random.uniform(0.5, 1.5))
            freeze = one_freeze(job, budget.left(args.timeout))
            return {"backend": start.get("backend"), "ft_backend": start.get("ft_backend"),
                    "device": start.get("device"), "communicator": communicator, "kill": kill, "freeze": freeze,
                    "survivor_warned": warned(job, 0)}
        finally:
            job.stop()


def warned(job: Job, i: int) -> list[str]:
    """Node i's `warning:` lines about the end of a generation's NCCL group (one past its bound, left
    behind; one that ended after all), the first five."""
    path = job.tmp / f"node{i}.err"
    lines = path.read_text(errors="replace").splitlines() if path.exists() else []
    return [line.strip()[:300] for line in lines if line.startswith("warning:") and ENDS_SAID in line][:5]


def generations(args: argparse.Namespace, budget: Budget) -> dict[str, Any]:
    """Part 2: n groups of one formed, used and ended in this process, as inplace forms its generations."""
    device = torch.device("cuda", 0) if gpu() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    groups = groups_for(device, DEFAULT)
    store = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False, timeout=timedelta(seconds=30))
    tensor = torch.ones(1 << 20, device=device)
    marks: list[dict[str, float]] = []
    began = time.monotonic()
    for g in range(1, args.generations + 1):
        if budget.left() <= 0:
            return {"skipped": f"over the budget after {g - 1} generations"}
        pg = groups.form(dist.PrefixStore(f"bench/{g}/", store), 0, 1, g)
        failed = groups.wait(pg.allreduce([tensor]), threading.Event())
        if failed is not None:
            return {"error": f"generation {g}'s all-reduce: {failed}"}
        groups.end(pg, None)        # returns at once: a thread of its own ends it (NCCL)
        del pg
        if g in (1, args.generations):
            groups.settle()         # the ends through, their threads on their way out
            time.sleep(ENDS_EXIT_S)
            marks.append(_resources(device))
    first, last = marks
    flat = (last["threads"] - first["threads"] <= FLAT_THREADS
            and last["device_used_mib"] - first["device_used_mib"] <= FLAT_MEMORY_MIB)
    ends = getattr(groups, "ends", None)        # NCCL's (app/ft/groups.py's Ends); gloo has no abort
    return {"backend": groups.name, "generations": args.generations, "after_first": first, "after_last": last,
            "seconds_each": round((time.monotonic() - began) / args.generations, 3), "flat": flat,
            **({"end_longest_s": round(ends.longest_s, 3), "ends_stuck": ends.stuck} if ends is not None else {})}


def _resources(device: torch.device) -> dict[str, float]:
    """The process's threads, and the device's memory in use (its RSS on CPU)."""
    threads = len(os.listdir("/proc/self/task"))
    if device.type == "cuda":
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info(device)
        return {"threads": threads, "device_used_mib": round((total - free) / 2**20, 1),
                "torch_allocated_mib": round(torch.cuda.memory_allocated(device) / 2**20, 1)}
    rss = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return {"threads": threads, "device_used_mib": round(rss / 2**20, 1), "torch_allocated_mib": 0.0}


def pace_once(mode: str, args: argparse.Namespace, flags: list[str], budget: Budget) -> dict[str, Any]:
    """One process of `mode` (elastic, inplace) training for --pace-seconds: its steps per second."""
    wanted = args.timeout + args.pace_seconds
    if budget.left() < wanted / 2:
        return {"skipped": "over the budget"}
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as tmp:
        job = Job(mode, free_port_pair(), flags, Path(tmp), nodes=1, env=training_env(args))
        try:
            why = started(job, budget, args.timeout)
            if why:
                return {"error": why}
            time.sleep(budget.left(args.pace_seconds))
            steps_per_s = metrics.pace(job.rows(), 1, until=time.time())
            start = job.rows("start")[0]
            return {"steps_per_s": None if steps_per_s is None else round(steps_per_s, 2),
                    "backend": start.get("ft_backend", start.get("backend")), "device": start.get("device")}
        finally:
            job.stop()


def pace(args: argparse.Namespace, flags: list[str], budget: Budget, parallel: bool) -> dict[str, Any]:
    """Part 3: elastic and inplace interleaved, A B A B; inplace's pace over elastic's, pair by pair. A row
    every 10 steps (`flags`): a row every step would have elastic wait for the device at each step too,
    as inplace does to read its all-reduce, and hide that cost."""
    order = [mode for _ in range(args.pace_rounds) for mode in ("elastic", "inplace")]
    runs = _run([lambda mode=mode: pace_once(mode, args, flags, budget) for mode in order], parallel)
    by_mode = {mode: [r.get("steps_per_s") for m, r in zip(order, runs) if m == mode] for mode in ("elastic", "inplace")}
    ratios = [round(i / e, 3) for e, i in zip(by_mode["elastic"], by_mode["inplace"]) if e and i]
    return {"runs": [{"mode": m, **r} for m, r in zip(order, runs)], "inplace_over_elastic": ratios}


def _run(parts: list[Callable[[], dict[str, Any]]], parallel: bool) -> list[dict[str, Any]]:
    """Each part in turn, or all at once (the dry run: its figures are not the point, the suite's time is)."""
    if not parallel:
        return [part() for part in parts]
    with ThreadPoolExecutor(len(parts)) as pool:
        return list(pool.map(lambda part: part(), parts))


def prepare(args: argparse.Namespace, tmp: Path) -> Path | None:
    """The default GPU job's data: a CIFAR-size synthetic set, decoded once (none for the dry run's digits)."""
    if args.dry_run:
        return None
    write_synthetic(tmp, n_train=args.train_images, n_test=1000)
    write_decoded("synthetic", tmp)
    return tmp


def verdict(result: dict[str, Any]) -> list[str]:
    """What the figures say against issues 36 and 54's targets (inplace mode, each kind of communicator
    measured; on NCCL only where the backend was): a stall after a kill is met only in the same process."""
    lines = []
    for label, inplace in result["faults"].items():
        if not label.startswith("inplace") or "kill" not in inplace:
            continue
        kill, backend = inplace["kill"], inplace.get("ft_backend", "?")
        stall, drop = kill.get("stall_s"), inplace.get("freeze", {}).get("drop_s")
        kept = not kill.get("survivor_restarted")
        for what, value, ok in ((f"{label}: survivors' stall after a kill", stall, kept),
                                (f"{label}: a frozen peer dropped", drop, True)):
            met = ok and value is not None and value <= TARGET_S
            lines.append(f"{what}: {value} s ({'met' if met else 'NOT met'}: target <= {TARGET_S:g} s, {backend})")
        if not kept:
            why = (kill.get("survivor_said") or ["it said no error line"])[0]
            lines.append(f"{label}: the survivor's process was started again after the kill: {why}")
        if inplace.get("survivor_warned"):
            lines.append(f"{label}: the survivor said: {' | '.join(inplace['survivor_warned'])}")
    flat = result["generations"].get("flat")
    lines.append(f"{result['generations'].get('generations', '?')} generations: memory and threads "
                 f"{'flat' if flat else 'NOT flat'} ({result['generations'].get('backend', '?')})")
    return lines


def markdown(result: dict[str, Any]) -> str:
    """The figures as docs/gpu.md takes them."""
    lines = [f"# Survivor modes on {result['machine']['gpu'] or 'CPU (no GPU)'}", "",
             f"`python -m bench.gpu_survivors{' --dry-run' if result['dry_run'] else ''}`, {result['measured']}, "
             f"{result['machine']['host']}, torch {result['machine']['torch']}, {result['seconds']:.0f} s.", "",
             "| mode | backend | kill: stall s | lost steps | survivor restarted | rejoin s | freeze: drop s | "
             "stall s | back s | same process back |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for mode, r in result["faults"].items():
        if "kill" not in r:
            lines.append(f"| {mode} | {r.get('skipped') or r.get('error')} | | | | | | | | |")
            continue
        k, f = r["kill"], r.get("freeze", {})
        lines.append(f"| {mode} | {r.get('ft_backend')} | {k.get('stall_s')} | {k.get('lost_steps')} | "
                     f"{k.get('survivor_restarted')} | {k.get('back_s')} | {f.get('drop_s')} | {f.get('stall_s')} | "
                     f"{f.get('back_s')} | {f.get('same_process_back')} |")
    g = result["generations"]
    if "after_last" in g:
        lines += ["", f"{g['generations']} generations of one process ({g['backend']}, {g['seconds_each']} s each): "
                  f"threads {g['after_first']['threads']} -> {g['after_last']['threads']}, device memory used "
                  f"{g['after_first']['device_used_mib']} -> {g['after_last']['device_used_mib']} MiB, torch allocated "
                  f"{g['after_first']['torch_allocated_mib']} -> {g['after_last']['torch_allocated_mib']} MiB: "
                  f"{'flat' if g['flat'] else 'NOT flat'}"
                  + (f"; the longest end {g['end_longest_s']} s, {g['ends_stuck']} stuck." if "end_longest_s" in g else ".")]
    else:
        lines += ["", f"generations: {g.get('skipped') or g.get('error')}"]
    p = result["pace"]
    runs = ", ".join(f"{r['mode']} {r.get('steps_per_s', r.get('skipped') or r.get('error'))}" for r in p["runs"])
    pace_line = (f"Pace, one process each, steps/s in order: {runs}; inplace over elastic by pair: "
                 f"{p['inplace_over_elastic']}." if p["runs"] else "Pace: not run (--pace-rounds 0).")
    lines += ["", pace_line, "", *(f"- {line}" for line in verdict(result))]
    return "\n".join(lines) + "\n"


def fault_label(communicator: str, communicators: list[str]) -> str:
    """The faults' row of inplace with `communicator`: `inplace` for the first asked, as before there was a choice."""
    return "inplace" if communicator == communicators[0] else f"inplace {communicator}"


def said(began: float, part: str, figures: dict[str, Any]) -> dict[str, Any]:
    """A part's figures as they come (stderr): a run cut short still shows what it measured."""
    say(began, f"{part}: {json.dumps(figures)}")
    return figures


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_survivors", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="CPU and gloo, the digits job, every part at once: "
                   "checks the script, not the figures (tests/test_gpu_survivors.py runs it)")
    p.add_argument("--out", type=Path, default=RESULTS, help="the JSON; the markdown beside it (.md)")
    p.add_argument("--budget", type=float, default=480.0, help="seconds for everything (issue 36: 8 minutes)")
    p.add_argument("--down", type=float, default=2.0, help="seconds a killed node stays down")
    p.add_argument("--timeout", type=float, default=90.0, help="the longest wait for any one event")
    p.add_argument("--generations", type=int, default=50)
    p.add_argument("--pace-seconds", type=float, default=25.0,
                   help=f"each pace run's training, the pace counted after its first {PACE_SETTLE_S:g}")
    p.add_argument("--pace-rounds", type=int, default=2, help="elastic-inplace pairs")
    p.add_argument("--train-images", type=int, default=50000, help="the synthetic set of the default GPU job")
    p.add_argument("--communicators", default="blocking", help="inplace's faults once per kind of NCCL communicator, "
                   f"comma-separated: {', '.join(COMMUNICATORS)} (the first is the row `inplace`)")
    args = p.parse_args(argv)
    args.communicators = [c.strip() for c in args.communicators.split(",") if c.strip()]
    unknown = [c for c in args.communicators if c not in COMMUNICATORS]
    if unknown or not args.communicators:
        p.error(f"--communicators takes {', '.join(COMMUNICATORS)}, got {', '.join(unknown) or 'none'}")
    if args.generations < 2:
        p.error("--generations must be 2 or more: the first is the baseline the last is compared with")
    if args.pace_rounds < 0:
        p.error("--pace-rounds must be 0 (no pace) or more")
    if args.pace_seconds <= PACE_SETTLE_S:
        p.error(f"--pace-seconds must be more than the {PACE_SETTLE_S:g} s before the pace is counted")
    if args.dry_run:
        args.pace_rounds, args.pace_seconds, args.down = 1, PACE_SETTLE_S + 2, 1.0
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the three parts (a GPU report may call this with its own argv); 0 if each part ran, 1 if not."""
    args = parse(argv)
    if not args.dry_run and not gpu():
        print("error: no GPU here: run with --dry-run to check the script on CPU", file=sys.stderr)
        return 2
    args.environ = dict(os.environ)
    set_nccl_environment()      # before this process's first NCCL group (the generations part)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))      # the jobs are stopped on the way out
    began, budget = time.monotonic(), Budget(args.budget)
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = prepare(args, Path(tmp))
        flags = job_flags(args, data_dir)
        labels = [fault_label(c, args.communicators) for c in args.communicators]
        parts: dict[str, Callable[[], dict[str, Any]]] = {
            **{label: lambda c=c: faults("inplace", args, flags, budget, c) for label, c in zip(labels, args.communicators)},
            "torchft": lambda: faults("torchft", args, flags, budget),
            "generations": lambda: generations(args, budget),
            "pace": lambda: pace(args, job_flags(args, data_dir, log_every=10), budget, args.dry_run)}
        if args.dry_run:        # one survivor mode is enough to run the script's every line
            parts["torchft"] = lambda: {"skipped": "the dry run runs the fault scenario in inplace mode only"}
        figures = dict(zip(parts, _run([lambda name=name: said(began, name, parts[name]()) for name in parts],
                                       args.dry_run)))
    result: dict[str, Any] = {"faults": {label: figures[label] for label in [*labels, "torchft"]},
                              "generations": figures["generations"], "pace": figures["pace"]}
    result.update({"dry_run": args.dry_run, "machine": machine(), "flags": flags, "communicators": args.communicators,
                   "pace_flags": job_flags(args, data_dir, 10), "seconds": time.monotonic() - began,
                   "measured": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "budget_s": args.budget})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result), end="")
    failed = [part for part, r in [*result["faults"].items(), ("generations", result["generations"]),
                                   *((r["mode"], r) for r in result["pace"]["runs"])] if "error" in r]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
