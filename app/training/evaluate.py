"""Distributed evaluation: every rank scores its shard of the test set; the counts are summed."""
from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch import nn

from app.cluster.distributed import World
from app.datasets.data import Batches


@torch.no_grad()
def evaluate(model: nn.Module, batches: Batches, world: World, batch_size: int,
             autocast: Callable[[], contextlib.AbstractContextManager]) -> tuple[float, float]:
    """(accuracy, mean loss) over the whole test set, the same on every rank."""
    model.eval()
    # Summed on the device: one host sync for the whole test set, not one per batch.
    sums = torch.zeros(3, dtype=torch.float64, device=batches.device)
    for x, y in batches.test_batches(world.rank, world.size, batch_size):
        with autocast():
            logits = model(x)
        sums[0] += (logits.argmax(1) == y).sum()
        sums[1] += nn.functional.cross_entropy(logits.float(), y, reduction="sum")
        sums[2] += len(y)
    model.train()
    correct, loss, total = world.all_reduce_sum(sums.tolist())
    return correct / total, loss / total
