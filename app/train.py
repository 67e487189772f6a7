"""Train a ResNet on CIFAR with DistributedDataParallel; resumes by itself from the newest valid snapshot.

One process (CPU or one GPU):
    python -m app.train --dataset cifar10 --model resnet18 --epochs 30

One node, N processes (NCCL on GPUs, gloo on CPU, picked by itself; app.launch is torchrun with the
project's fault timings, app/core/policy.py):
    python -m app.launch --standalone --nproc-per-node=4 -m app.train --model resnet50

Two nodes (run on each; the store lives at the endpoint; every node keeps its own snapshots):
    python -m app.launch --nnodes=1:2 --nproc-per-node=4 --rdzv-endpoint=HOST:29400 --rdzv-id=job1 -m app.train

Slurm (srun torchrun, one task per node, requeue-safe):
    sbatch --nodes=2 scripts/train.sbatch --epochs 30

Every flag can also come from the environment: --batch-size 64 is TRAIN_BATCH_SIZE=64.
"""
from __future__ import annotations

import time

# The start row's first phase (app/reporting/startup.py): the interpreter, up to this module's first line.
_LOADING: list[tuple[str, float]] = [("interpreter", time.time())]

from typing import Sequence

from app.core import config
from app.core.errors import UserError
from app.recovery import failures


def run(argv: Sequence[str] | None = None) -> int:
    """The flags and TRAIN_* variables checked first, before torch's import (2-3 s of CPU): a bad one
    or --help answers at once. Then the job's process (app/job/), its exit status."""
    try:
        cfg = config.parse(argv)
    except UserError as exc:
        return failures.bad_input(exc)
    _LOADING.append(("config", time.time()))
    from app import job

    return job.run(cfg, _LOADING)


if __name__ == "__main__":
    failures.exit_process(run())
