"""The yardstick: the fastest honest DDP loop over the same model and in-memory data as the trainer.

No config, sampler, logging, evaluation or snapshots, and every technique the trainer's step uses
(app/training/step.py): data and the epoch's permutation on the device, no host sync inside the timed steps,
the fused optimizer, channels_last and bf16 autocast on GPUs, DDP with gradient views and a static
graph; eager or torch.compile'd as asked. Run under torchrun; rank 0 prints one JSON line.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from app.cluster import distributed
from app.core.config import Config, boolean as bool_flag
from app.datasets import data
from app.recovery import failures
from app.training import models
from app.training.optim import implementation
from app.training.step import peak_memory_mb


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--data-dir", type=Path, required=True)
    p.add_argument("--model", default="tiny")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--amp", type=bool_flag, default=False, help="bf16 autocast")
    p.add_argument("--compile", type=bool_flag, default=False, help="torch.compile around DDP")
    p.add_argument("--bucket-mb", type=float, default=Config().bucket_mb)
    args = p.parse_args()
    world = distributed.setup(Config().collective_timeout)
    torch.manual_seed(0)
    device, cuda = world.device, world.device.type == "cuda"
    ds = data.load("synthetic", args.data_dir)
    batches = data.Batches(ds, device, seed=0, augment=False)
    model = models.build(args.model, ds.num_classes).to(device, memory_format=torch.channels_last if cuda else
                                                        torch.contiguous_format)
    model = DDP(model, device_ids=[device] if cuda else None, bucket_cap_mb=args.bucket_mb,
                gradient_as_bucket_view=True, static_graph=not args.compile)
    model = torch.compile(model) if args.compile else model
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4,
                          **implementation(device))
    loss_fn = nn.CrossEntropyLoss(label_smoothing=0.1)
    g = torch.Generator(device).manual_seed(0)
    order = torch.randperm(len(ds.train), generator=g, device=device)[world.rank::world.size]
    per_epoch = len(order) // args.batch_size
    loss_sum = torch.zeros((), device=device)
    for i in range(args.warmup_steps + args.steps):
        if i == args.warmup_steps:
            float(loss_sum)     # the device is done with the warm-up: start the clock
            start = time.perf_counter()
        j = i % per_epoch
        x, y = batches.train_batch(order[j * args.batch_size:(j + 1) * args.batch_size], None)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.amp):
            loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_sum += loss.detach()
    float(loss_sum)   # wait for the device before reading the clock
    elapsed = time.perf_counter() - start
    if world.is_main:
        print(json.dumps({"bare_images_per_s": args.steps * args.batch_size * world.size / elapsed,
                          "peak_memory_mb": peak_memory_mb(device)}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    failures.exit_process(0)    # as the trainer: an orderly finalization may abort in gloo's threads
