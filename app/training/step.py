"""One optimizer step, and the per-process choices that make it fast (docs/gpu.md).

The step never waits for the device: the loss is summed into a device tensor that is read only
when a log row or a snapshot needs it, the batch indices are already on the device, and the
optimizer is one fused kernel per parameter group.
"""
from __future__ import annotations

import contextlib
import dataclasses
import resource
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from app.cluster.distributed import World
from app.core.config import Config
from app.datasets.data import Batches
from app.training.optim import build_optimizer
from app.training.step_time import StepClock, mark_ddp_waits


@dataclass(frozen=True)
class Numerics:
    """How this process computes: what the start row and config.json say it chose."""
    backend: str                        # nccl, gloo, or none (one process)
    device: torch.device
    amp_dtype: torch.dtype | None       # autocast dtype; None: fp32
    memory_format: torch.memory_format

    def describe(self) -> dict[str, str]:
        return {"backend": self.backend, "device": str(self.device),
                "dtype": str(self.amp_dtype or torch.float32).removeprefix("torch."),
                "memory_format": "channels_last" if self.memory_format == torch.channels_last else "contiguous"}


def choose_numerics(cfg: Config, world: World) -> Numerics:
    cuda = world.device.type == "cuda"
    backend = dist.get_backend() if world.distributed else "none"
    # channels_last feeds the GPU's tensor cores without transposes; on CPU it only costs copies.
    return Numerics(backend, world.device, _amp_dtype(cfg.amp, cuda),
                    torch.channels_last if cuda else torch.contiguous_format)


def _amp_dtype(amp: bool | None, cuda: bool) -> torch.dtype | None:
    """--amp auto (None) is bf16 on a GPU that has it, else off (fp16 needs loss scaling: asked for,
    not assumed); explicit true is fp16 on GPUs without bf16, and bf16 on CPU."""
    if not (amp if amp is not None else cuda and torch.cuda.is_bf16_supported()):
        return None
    return torch.float16 if cuda and not torch.cuda.is_bf16_supported() else torch.bfloat16


def wrap(model: nn.Module, cfg: Config, world: World) -> tuple[DDP | None, nn.Module]:
    """(the DDP wrapper or None, what the step calls). torch.compile goes around DDP, whose bucket
    hooks then split the graph at bucket boundaries (dynamo's DDP optimizer): each bucket's all-reduce
    still overlaps the backward of the layers before it."""
    ddp = None
    # A world of one process (a node of one in the survivor modes, whose gradients are averaged across
    # nodes by their own all-reduce; a single-process launch) has nothing to average: DDP over it would
    # only cost its bucket copies and an all-reduce with itself every step (0.5 ms of 7 on the digits job).
    if world.distributed and world.size > 1:
        # Gradients are views into the buckets (no copy, less memory); a static graph (the same
        # parameters every step) lets DDP skip its per-step search, but not with no_sync's
        # accumulation steps or under dynamo, which need the dynamic path.
        ddp = DDP(model, device_ids=[world.device] if world.device.type == "cuda" else None,
                  bucket_cap_mb=cfg.bucket_mb, gradient_as_bucket_view=True,
                  static_graph=cfg.grad_accum == 1 and not cfg.compile)
    called = ddp or model
    return ddp, torch.compile(called) if cfg.compile else called


def peak_memory_mb(device: torch.device) -> float:
    """The device's peak allocation on a GPU; the process's peak resident set on CPU. Host-side
    counters both: reading them does not wait for the device."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024     # Linux reports KiB


class StepRunner:
    """Forward, backward and update of one optimizer step, over grad_accum micro-batches."""

    def __init__(self, cfg: Config, world: World, model: nn.Module, batches: Batches) -> None:
        self.numerics = choose_numerics(cfg, world)
        self.raw_model = model.to(world.device, memory_format=self.numerics.memory_format)
        self.ddp, self.model = wrap(self.raw_model, cfg, world)
        self.clock = StepClock(world.device)    # the steps' time outside the collective wait (slow nodes)
        if self.ddp is not None:
            mark_ddp_waits(self.ddp, self.raw_model, self.clock, hooks_on_forward=not cfg.compile)
        self.optimizer = build_optimizer(cfg, self.raw_model)
        self.scaler = torch.amp.GradScaler(world.device.type, enabled=self.numerics.amp_dtype == torch.float16)
        self.criterion = nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing)
        self.batches, self.batch_size, self.accum = batches, cfg.batch_size, cfg.grad_accum

    def relocate(self, device: torch.device) -> None:
        """Model, optimizer state and scaler onto another GPU (a spare that claimed it when named,
        app/cluster/gpus.py). Parameters keep their identity (the optimizer's references hold); buffers
        do not (module.to replaces them)."""
        old = self.numerics.device
        self.raw_model.to(device)
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.device == old:     # Adam's step counts stay on the CPU
                    state[key] = value.to(device)
        if self.scaler.is_enabled():
            kept = self.scaler.state_dict()
            self.scaler = torch.amp.GradScaler(device.type, enabled=True)
            self.scaler.load_state_dict(kept)
        self.numerics = dataclasses.replace(self.numerics, device=device)

    def autocast(self) -> contextlib.AbstractContextManager:
        dtype = self.numerics.amp_dtype
        return torch.autocast(self.numerics.device.type, dtype=dtype, enabled=dtype is not None)

    def accumulate(self, indices: torch.Tensor, augmentation: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Gradients of one step's micro-batches; returns their summed loss, on the device."""
        b = self.batch_size
        step_loss = torch.zeros((), device=self.numerics.device)
        for micro in range(self.accum):
            x, y = self.batches.train_batch(indices[micro * b:(micro + 1) * b], augmentation)
            # Only the last micro-batch all-reduces gradients; the others accumulate locally.
            sync = micro == self.accum - 1 or self.ddp is None
            with contextlib.nullcontext() if sync else self.ddp.no_sync():
                with self.autocast():
                    loss = self.criterion(self.model(x), y)
                self.scaler.scale(loss / self.accum).backward()
            if sync and self.ddp is not None:
                self.clock.wait_end()       # DDP's backward returns once its all-reduce is done
            step_loss += loss.detach().float()
        return step_loss

    def update(self) -> None:
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
