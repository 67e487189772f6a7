"""The yardstick: a bare DDP loop over the same model and in-memory data as the trainer.

No config, sampler, logging, evaluation or snapshots: only index -> normalise -> forward ->
backward -> step. Run under torchrun; rank 0 prints one JSON line with images/s.
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

from app import data, distributed, models
from app.config import Config, boolean as bool_flag


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--data-dir", type=Path, required=True)
    p.add_argument("--model", default="tiny")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--amp", type=bool_flag, default=False, help="bf16 autocast, as the trainer's --amp")
    p.add_argument("--compile", type=bool_flag, default=False, help="torch.compile, as the trainer's --compile")
    args = p.parse_args()
    world = distributed.setup(Config().collective_timeout)
    torch.manual_seed(0)
    ds = data.load("synthetic", args.data_dir)
    batches = data.Batches(ds, world.device, seed=0, augment=False)
    cuda = world.device.type == "cuda"
    model = models.build(args.model, ds.num_classes).to(world.device)
    model = DDP(model.to(memory_format=torch.channels_last) if cuda else model)
    model = torch.compile(model) if args.compile else model
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4)
    loss_fn = nn.CrossEntropyLoss(label_smoothing=0.1)
    order = torch.randperm(len(ds.train)).tolist()[world.rank::world.size]
    per_epoch = len(order) // args.batch_size
    for step in range(args.warmup_steps + args.steps):
        if step == args.warmup_steps:
            start = time.perf_counter()
        i = step % per_epoch
        x, y = batches.train_batch(order[i * args.batch_size:(i + 1) * args.batch_size], None)
        with torch.autocast(world.device.type, dtype=torch.bfloat16, enabled=args.amp):
            loss = loss_fn(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    float(loss)   # wait for the device before reading the clock
    elapsed = time.perf_counter() - start
    if world.is_main:
        print(json.dumps({"bare_images_per_s": args.steps * args.batch_size * world.size / elapsed}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
