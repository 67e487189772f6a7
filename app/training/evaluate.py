"""Evaluation: the test set scored shard by shard, and the shards' counts summed by whoever shares it
(every rank of the job: app/training/trainer.py; inplace mode's members: app/ft/inplace.py)."""
from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch import nn

from app.datasets.data import Batches

# A shard's counts: score(shard, shards) -> [correct, summed loss, images] of shard `shard` of `shards`.
Scorer = Callable[[int, int], list[float]]


@torch.no_grad()
def score(model: nn.Module, batches: Batches, shard: int, shards: int, batch_size: int,
          autocast: Callable[[], contextlib.AbstractContextManager]) -> list[float]:
    """[correct, summed loss, images] over one shard of the test set (unpadded: summed shards are exact)."""
    model.eval()
    # Summed on the device: one host sync for the whole shard, not one per batch.
    sums = torch.zeros(3, dtype=torch.float64, device=batches.device)
    for x, y in batches.test_batches(shard, shards, batch_size):
        with autocast():
            logits = model(x)
        sums[0] += (logits.argmax(1) == y).sum()
        sums[1] += nn.functional.cross_entropy(logits.float(), y, reduction="sum")
        sums[2] += len(y)
    model.train()
    return sums.tolist()


def accuracy_and_loss(counts: list[float]) -> tuple[float, float]:
    """(accuracy, mean loss) of the test set's summed counts."""
    correct, loss, total = counts
    return correct / total, loss / total
