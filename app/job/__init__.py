"""One training process of a job whose config is checked (app/train.py parses and checks it before
torch's import): join the process group, load the data, build and restore the trainer, fit; `run`
turns each expected failure into its one line and exit status (app/recovery/failures.py)."""
from __future__ import annotations

import time

# The start row's phases marked while this module loads (app/reporting/startup.py): torch's import,
# then this package's own modules; the entry point's come before them.
_LOADING: list[tuple[str, float]] = []

import importlib
import json
import random
import threading
from typing import Sequence

import torch

_LOADING.append(("torch", time.time()))

from app.cluster import distributed
from app.cluster.process_group import RefusedPeer
from app.core import config
from app.core.errors import JobOver, UserError
from app.datasets import data
from app.ft import groups
from app.recovery import failures, stacks
from app.training.guard import PeerLost, Terminated
from app.reporting.metrics import Reporter
from app.reporting.startup import StartupClock
from app.training import models
from app.training.trainer import Trainer

_LOADING.append(("imports", time.time()))


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
    # Survivor modes: each node's launch is a world of its own; the job's changes with every quorum.
    sizes = {"node_world_size": world.size} if cfg.ft in config.SURVIVOR_MODES else {"world_size": world.size}
    record = {"config": cfg.to_dict(), "dataset_used": dataset, **sizes,
              "torch": torch.__version__, **numerics}
    (cfg.run_dir / "config.json").write_text(json.dumps(record, indent=2) + "\n")


def main(cfg: config.Config, loading: Sequence[tuple[str, float]] = ()) -> None:
    """Train the job `cfg` (checked) in this process: join the group, load the data, restore, fit.
    `loading`: the entry point's start-up phases before this module loaded."""
    clock = StartupClock([*loading, *_LOADING])
    # Every torch optimizer imports torch._dynamo (add_param_group, every step: 1.1 s of CPU here): begin
    # it now, so that it overlaps joining the process group and reading the data instead of following them.
    dynamo = threading.Thread(target=importlib.import_module, args=("torch._dynamo",), daemon=True)
    dynamo.start()
    if cfg.ft == "inplace":
        groups.set_nccl_environment()   # before the first NCCL group (the node's own): torch reads it then
    world = distributed.setup(cfg.collective_timeout, cfg.threads)
    clock.mark("process_group")
    stacks.arm()        # from here on a peer or the agent can ask this process for its stacks
    try:
        _seed_everything(cfg.seed, cfg.deterministic)
        report = Reporter(cfg.run_dir, world.is_main, cfg.progress)
        try:
            _train(cfg, world, report, clock, dynamo)
        finally:
            report.close()
    finally:
        stacks.disarm()
        distributed.teardown()


def _train(cfg: config.Config, world: distributed.World, report: Reporter, clock: StartupClock,
           dynamo: threading.Thread) -> None:
    dataset_name = data.resolve(cfg.dataset, cfg.data_dir)
    if dataset_name != cfg.dataset:
        report.say(f"CIFAR-10 is not prepared under {cfg.data_dir} (python -m scripts.prepare --dataset cifar10); "
                   "training on scikit-learn's bundled digits instead")
    dataset = data.load(dataset_name, cfg.data_dir, report.say)
    clock.mark("data")
    if world.device.type == "cuda":     # its context now, while torch._dynamo imports in its thread, not at the first step
        torch.empty(0, device=world.device)
    clock.mark("device")
    dynamo.join()       # what of torch._dynamo's import the process group, the data and the device did not hide
    clock.mark("dynamo")
    cfg = config.resolve(cfg, dataset.name, world.device.type)  # the dataset's and device's defaults, before anything reads them
    model = models.build(cfg.model, dataset.num_classes)
    if cfg.sync_bn and world.distributed:
        if world.device.type != "cuda":   # DDP refuses SyncBatchNorm on CPU; say so instead of a traceback
            raise UserError("--sync-bn needs GPUs: PyTorch's SyncBatchNorm does not run on CPU processes")
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    steps_per_epoch = len(dataset.train) // (world.size * cfg.batch_size * cfg.grad_accum)
    if steps_per_epoch == 0:
        raise UserError(f"--batch-size {cfg.batch_size} x {world.size} processes x --grad-accum "
                        f"{cfg.grad_accum} is larger than the {len(dataset.train)} training images")
    trainer = _trainer_class(cfg)(cfg, world, dataset, model, report)
    clock.mark("model")
    trainer.restore(clock)
    if world.is_main:
        _write_config(cfg, world, dataset.name, trainer.steps.numerics.describe())
    report.start_progress(cfg.epochs * steps_per_epoch)
    trainer.fit()


def _trainer_class(cfg: config.Config) -> type[Trainer]:
    if cfg.ft in config.SURVIVOR_MODES:
        from app.ft.trainer import FtTrainer     # only in the modes that keep survivors (torchft's: at its Replica)
        return FtTrainer
    return Trainer


def run(cfg: config.Config, loading: Sequence[tuple[str, float]] = ()) -> int:
    """main() with every expected failure turned into one line and an exit status."""
    try:
        main(cfg, loading)
    except RefusedPeer as exc:
        failures.error_line(f"error: {exc}", own=False)
        return failures.EXIT_PEER_LOST
    except UserError as exc:
        return failures.bad_input(exc)
    except Terminated:
        return failures.EXIT_TERMINATED
    except JobOver as over:             # came to a job that had finished: nothing to train
        if failures.prints_errors(own=False):
            print(over, flush=True)
        return failures.EXIT_DONE
    except KeyboardInterrupt:
        return failures.EXIT_INTERRUPTED
    except PeerLost as exc:
        failures.error_line(f"error: lost contact with another rank ({exc.reason}); {exc.saved}; the launcher "
                            "restarts the job", own=True)
        return failures.EXIT_PEER_LOST
    return failures.EXIT_DONE
