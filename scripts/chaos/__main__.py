"""`make chaos`: run a training job in containers and inject faults at random moments, in each
fault-tolerance mode, and compare them.

    python -m scripts.chaos --faults 20 --seed 0 --epochs 600 --pace-before 60
                                                                  # the full run -> chaos/table.md, chaos/MODE/report.json
    python -m scripts.chaos --ft torchft --faults 3               # one mode only
    python -m scripts.chaos --config cifar-size --faults 6        # ResNet-18 on 50000 CIFAR-size images
    python -m scripts.chaos --only partition,freeze_worker        # these kinds only
    python -m scripts.chaos --spares 1 --only kill_worker,freeze_worker,partition   # inplace with a warm spare
    python -m scripts.chaos --spares 1 --faults 0                 # what an idle spare costs the pace (A B A B)
    python -m scripts.chaos --only slow_node --faults 1 --slow-for 90    # a node's CPU quota cut to 0.2 for 90 s
    python -m scripts.chaos --every 60 --faults 8                 # a fault a minute, every set-up side by side:
                                                                  # elastic, torchft, inplace, inplace-spare

Faults, one at a time and some back to back: docker kill of a node that does not hold rank 0 and
of the one that does, a kill while a snapshot is being written, a fast docker restart, a docker
pause, one training process frozen (SIGSTOP) while its node's agent runs on, a network partition
of one node (its packets dropped, the container running), one node's data path to its peers cut
and the nodes split into two halves (each still reaching the store), the snapshot volume full during saves,
the newest snapshot corrupted on disk before every node is killed at once, a node joining (scale
up) and one leaving cleanly (scale down), a restart of the rendezvous store, every node's
snapshots wiped at once (new machines: the job resumes from the object store, which every chaos
job has unless --no-object-store), the same after the newest snapshot was damaged on disk
before its upload (the job resumes from the store's newest good snapshot), a node's CPU quota cut
(slow_node: alive and beating, only slow) and a node's link to its peers cut and healed again and
again (flap). With --every S the faults come at a steady rate instead, one every S seconds of the
clock (kinds mixed: by default kills, a frozen worker and a partition), and the report holds the
images the job trained and kept against its fault-free pace (committed_over_fault_free). The runner brings
nodes back and measures how long the job takes to notice, to train again (with where those seconds
went) and to take the node back (definitions in scripts/chaos/report.py). Snapshots live on a
volume of fixed size (scripts/chaos/host.py; the runner needs root). At the end every snapshot
on disk is checked and the final accuracy is compared with an uninterrupted run. Every mode
(--ft elastic,torchft,inplace, the default) gets the same schedule of faults; chaos/table.md puts them
side by side (scripts/chaos/table.py's compare).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from typing import Any

from app.core.config import FT_MODES
from app.datasets.files import SYNTHETIC_FOLDER, SYNTHETIC_MANIFEST
from app.core.policy import DEFAULT as DEFAULT_POLICY
from app.reporting.metrics import PACE_SETTLE_S
from scripts.chaos import spare_cost
from scripts.chaos.runner import SETUPS, run_modes
from scripts.chaos.schedule import EVERY_KINDS, FAULTS, NEEDS_NFT, NEEDS_OBJECT_STORE, kinds
from scripts.chaos.table import print_table
from scripts.job import REPO, UserError, compose_placement, env_port

# Job configurations: the quick one (digits, a tiny CNN, seconds per epoch) and one of CIFAR's size
# (ResNet-18 on 50000 generated 32x32 images, on the host's ./data mounted at /mnt/data).
CONFIGS: dict[str, dict[str, Any]] = {
    "quick": {"dataset": "digits", "data_dir": None, "model": "tiny", "epochs": 400, "batch_size": 32, "lr": 0.05,
              "save_every": 20, "volume_mb": 256},
    "cifar-size": {"dataset": "synthetic", "data_dir": "/mnt/data", "model": "resnet18", "epochs": 40,
                   "batch_size": 32, "lr": 0.05, "save_every": 20, "volume_mb": 1024},
}
CIFAR_SIZE_TRAIN, CIFAR_SIZE_TEST = 50000, 10000


def prepare_cifar_size_data() -> None:
    """The CIFAR-size configuration's images, generated once into ./data (mounted at /mnt/data)."""
    from scripts.prepare import write_synthetic

    manifest = REPO / "data" / SYNTHETIC_FOLDER / SYNTHETIC_MANIFEST
    if manifest.exists() and json.loads(manifest.read_text()).get("train") == CIFAR_SIZE_TRAIN:
        return
    print(f"generating {CIFAR_SIZE_TRAIN} CIFAR-size images into {manifest.parent}", flush=True)
    write_synthetic(REPO / "data", CIFAR_SIZE_TRAIN, CIFAR_SIZE_TEST)


def parser() -> argparse.ArgumentParser:
    """The defaults of where the jobs live come from compose's own variables when the shell sets them
    (COMPOSE_PROJECT_NAME, RDZV_PORT, OBJECTS_PORT, LIGHTHOUSE_PORT), as for `make up`: a second
    checkout runs its chaos jobs beside the first's."""
    placement = compose_placement()
    p = argparse.ArgumentParser(prog="python -m scripts.chaos", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", choices=sorted(CONFIGS), default="quick",
                   help="the job: quick (digits, tiny CNN) or cifar-size (ResNet-18, 50000 images); "
                        "the flags below override its values")
    p.add_argument("--ft", type=lambda v: [m for m in v.split(",") if m], default=None,
                   help=f"comma-separated fault-tolerance modes to run, one after another (default: {','.join(FT_MODES)}; "
                        f"inplace with --spares; with --every also {','.join(SETUPS)}); {','.join(SETUPS)}: "
                        "inplace with a warm spare")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--nproc", type=int, default=1, help="processes per node")
    p.add_argument("--spares", type=int, default=0,
                   help="warm spares beside the nodes (--ft inplace): each fault's full_again_s is then the swap")
    p.add_argument("--pairs", type=int, default=2,
                   help="with --spares and --faults 0: pairs of no-fault jobs without and with the spares")
    p.add_argument("--faults", type=int, default=20)
    p.add_argument("--every", type=float, default=0.0,
                   help="a steady fault rate: one fault every this many seconds of the clock (default 0: at random "
                        f"points of the job's progress); kinds default to {','.join(EVERY_KINDS)}, --pace-before to 60")
    p.add_argument("--slow-cpus", type=float, default=0.2, help="slow_node: the node's CPU quota (docker update --cpus)")
    p.add_argument("--slow-for", type=float, default=90.0, help="slow_node: seconds the node stays slow")
    p.add_argument("--flaps", type=int, default=10, help="flap: how often the link is cut and healed")
    p.add_argument("--flap-cut", type=float, default=2.0, help="flap: seconds each cut lasts")
    p.add_argument("--flap-up", type=float, default=4.0, help="flap: seconds the link is up between cuts")
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
    p.add_argument("--collective-timeout", type=float, default=DEFAULT_POLICY.collective_timeout_s,
                   help="seconds; the last line of defence (heartbeats catch hung nodes first)")
    p.add_argument("--pause", type=float, default=20.0, help="seconds a paused node stays paused")
    p.add_argument("--cut", type=float, default=20.0, help="seconds a cut between nodes (cut_peers, split_halves) lasts")
    p.add_argument("--gap", type=float, nargs=2, default=(3.0, 8.0),
                   help="seconds a partition, a full volume or an extra node lasts (min max); the faults "
                        "themselves come at random points of the first half of the epochs")
    p.add_argument("--pace-before", type=float, default=0.0,
                   help="seconds the job trains at full size before the first fault, so that the report "
                        f"measures its pace before the faults (the first {PACE_SETTLE_S:g} s are left out); "
                        "the faults then come in the first half of the epochs left (default 0: no window)")
    p.add_argument("--fault-timeout", type=float, default=120.0)
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--finish-timeout", type=float, default=1800.0)
    p.add_argument("--port", type=int, default=placement.get("rdzv_port", 29411), help="rendezvous store port on this host")
    p.add_argument("--lighthouse-port", type=int, default=env_port("LIGHTHOUSE_PORT") or 29511,
                   help="torchft Lighthouse port on this host")
    p.add_argument("--objects-port", type=int, default=placement.get("objects_port", 8343),
                   help="the object store's S3 port on this host (it also takes the next four, and each + 10000)")
    p.add_argument("--no-object-store", dest="object_store", action="store_false",
                   help="jobs without the object store, to measure what it costs (the faults that need it are not drawn)")
    p.add_argument("--run-name", default="chaos", help="run directory runs/NAME-DATE and rendezvous id")
    p.add_argument("--project", default=placement.get("project", "ftt-chaos"), help="compose project name")
    p.add_argument("--no-baseline", dest="baseline", action="store_false")
    p.add_argument("--out", default=str(REPO / "chaos"))
    return p


def refusal(args: argparse.Namespace) -> str | None:
    """Why this run cannot start, or None."""
    unknown = sorted(set(args.only or ()) - set(FAULTS))
    if unknown:
        return f"unknown fault kind {', '.join(unknown)}; choose from {', '.join(FAULTS)}"
    stranded = sorted(set(args.only or ()) & set(NEEDS_OBJECT_STORE)) if not args.object_store else []
    if stranded:
        return f"{', '.join(stranded)} needs the object store; drop --no-object-store or the kind"
    modes = sorted(set(args.ft) - set(FT_MODES) - set(SETUPS))
    if modes or not args.ft:
        return f"unknown mode {', '.join(modes) or '(none)'} for --ft; choose from {', '.join((*FT_MODES, *SETUPS))}"
    if args.every < 0:
        return "--every must be 0 (faults at points of progress) or more seconds"
    if not 0 < args.slow_cpus:
        return "--slow-cpus must be more than 0 (a share of a core)"
    if args.spares and args.ft != ["inplace"]:
        return "--spares needs --ft inplace (the one mode with spares; docs/spares.md)"
    if args.spares < 0:
        return "--spares must be 0 or more"
    if args.nodes < 2:
        return "--nodes must be at least 2 (faults need a survivor)"
    cuts = [k for k in kinds(args.only, args.object_store) if k in NEEDS_NFT]
    if cuts and shutil.which("nft") is None:
        return f"{', '.join(cuts)} needs nft (apt-get install nftables), or leave the kind out with --only"
    if os.getuid() != 0:
        return "the chaos runner needs root (a loop-mounted snapshot volume, iptables, cgroups)"
    return None


def main(argv: list[str] | None = None) -> int:
    try:
        args = parser().parse_args(argv)
    except UserError as exc:        # a placement variable that is no port
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for key, value in CONFIGS[args.config].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.gap = tuple(args.gap)
    args.ft = args.ft if args.ft is not None else ["inplace"] if args.spares else [*FT_MODES, *SETUPS] if args.every \
        else list(FT_MODES)
    if args.every:      # a steady rate: measured against the pace before its first fault
        args.only = args.only or list(EVERY_KINDS)
        args.pace_before = args.pace_before or 60.0
    why = refusal(args)
    if why:
        print(f"error: {why}", file=sys.stderr)
        return 2
    if args.config == "cifar-size":
        prepare_cifar_size_data()
    if args.spares and args.faults == 0:       # what an idle spare costs: no faults, with and without it
        return 0 if spare_cost.measure(args)["kept"] else 1
    combined = run_modes(args)
    for mode, report in combined["modes"].items():
        print(f"---- {mode} mode")
        print_table(report)
    print("\n".join(combined["table"]))
    return 0 if all(r["summary"]["completed"] for r in combined["modes"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
