"""Train a ResNet on CIFAR with DistributedDataParallel; resumes by itself from the newest valid snapshot.

One process (CPU or one GPU):
    python -m app.train --dataset cifar10 --model resnet18 --epochs 30

One node, N processes (NCCL on GPUs, gloo on CPU, picked by itself):
    torchrun --standalone --nproc-per-node=4 -m app.train --model resnet50

Two nodes (run on each; the store lives at the endpoint; every node keeps its own snapshots):
    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1     # a fresh worker store every rendezvous round
    torchrun --nnodes=1:2 --nproc-per-node=4 --rdzv-backend=c10d --rdzv-endpoint=HOST:29400 \
        --rdzv-id=job1 --max-restarts=10 -m app.train

Slurm (srun torchrun, one task per node, requeue-safe):
    sbatch --nodes=2 scripts/train.sbatch --epochs 30

Every flag can also come from the environment: --batch-size 64 is TRAIN_BATCH_SIZE=64.
"""
from __future__ import annotations

import json
import os
import random
import sys
from typing import Sequence

import torch

from app import config, data, distributed, models
from app.errors import UserError
from app.metrics import Reporter
from app.startup import StartupClock
from app.trainer import PeerLost, Terminated, Trainer


def _seed_everything(seed: int, deterministic: bool) -> None:
    # The same seed on every rank gives every rank the same initial weights.
    random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    else:
        torch.backends.cudnn.benchmark = True


def _write_config(cfg: config.Config, world: distributed.World, dataset: str, numerics: dict[str, str]) -> None:
    """Results are saved next to the exact configuration that produced them."""
    record = {"config": cfg.to_dict(), "dataset_used": dataset, "world_size": world.size,
              "torch": torch.__version__, **numerics}
    (cfg.run_dir / "config.json").write_text(json.dumps(record, indent=2) + "\n")


def main(argv: Sequence[str] | None = None) -> None:
    clock = StartupClock()
    clock.mark("imports")           # the interpreter, torch and this package
    cfg = config.parse(argv)
    world = distributed.setup(cfg.collective_timeout)
    clock.mark("process_group")
    try:
        _seed_everything(cfg.seed, cfg.deterministic)
        report = Reporter(cfg.run_dir, world.is_main, cfg.progress)
        try:
            _train(cfg, world, report, clock)
        finally:
            report.close()
    finally:
        distributed.teardown()


def _train(cfg: config.Config, world: distributed.World, report: Reporter, clock: StartupClock) -> None:
    dataset_name = data.resolve(cfg.dataset, cfg.data_dir)
    if dataset_name != cfg.dataset:
        report.say(f"CIFAR-10 is not prepared under {cfg.data_dir} (python -m scripts.prepare --dataset cifar10); "
                   "training on scikit-learn's bundled digits instead")
    dataset = data.load(dataset_name, cfg.data_dir, report.say)
    clock.mark("data")
    cfg = config.resolve(cfg, dataset.name)     # the dataset's defaults, before anything reads them
    model = models.build(cfg.model, dataset.num_classes)
    if cfg.sync_bn and world.distributed:
        if world.device.type != "cuda":   # DDP refuses SyncBatchNorm on CPU; say so instead of a traceback
            raise UserError("--sync-bn needs GPUs: PyTorch's SyncBatchNorm does not run on CPU processes")
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    steps_per_epoch = len(dataset.train) // (world.size * cfg.batch_size * cfg.grad_accum)
    if steps_per_epoch == 0:
        raise UserError(f"--batch-size {cfg.batch_size} x {world.size} processes x --grad-accum "
                        f"{cfg.grad_accum} is larger than the {len(dataset.train)} training images")
    report.say(f"{dataset.name}: {len(dataset.train)} train / {len(dataset.test)} test images, "
               f"{cfg.model} ({models.parameter_count(model) / 1e6:.2f}M params), world size {world.size} "
               f"on {world.device.type}, restart {world.restart_count}")
    trainer = Trainer(cfg, world, dataset, model, report)
    clock.mark("model")
    trainer.restore(clock)
    if world.is_main:
        _write_config(cfg, world, dataset.name, trainer.steps.numerics.describe())
    report.start_progress(cfg.epochs * steps_per_epoch)
    trainer.fit()


def run(argv: Sequence[str] | None = None) -> int:
    """main() with every expected failure turned into one line and an exit status."""
    try:
        main(argv)
    except UserError as exc:
        _error(f"error: {exc}")
        return 2
    except Terminated:
        return 143
    except KeyboardInterrupt:
        return 130
    except PeerLost as exc:
        _error(f"error: lost contact with another rank ({exc.reason}); {exc.saved}; the launcher restarts the job")
        return 1
    return 0


def _error(line: str) -> None:
    # Under torchrun every rank would print the same line; one is enough unless rank 0 is silent.
    if os.environ.get("RANK", "0") == "0" or "lost contact" in line:
        print(line, file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(run())
