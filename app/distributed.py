"""Rank awareness in one place: who am I, which device, and the few collectives the trainer needs.

Works the same as one plain process (no process group), under `torchrun` on one node,
across nodes, and under Slurm (`srun torchrun ...`, or plain `srun` with MASTER_ADDR/PORT set).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from app import process_group
from app.errors import UserError


@dataclass(frozen=True)
class Dist:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    restart_count: int

    @property
    def master(self) -> bool:
        """Global rank 0: the only process that prints, writes metrics and reads or writes snapshots."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    def print(self, *args: Any) -> None:
        if self.master:
            print(*args, flush=True)

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        tensor = torch.tensor(values, dtype=torch.float64, device=self._comm_device)
        if self.distributed:
            dist.all_reduce(tensor)
        return tensor.tolist()

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank (how snapshot state reaches nodes that cannot see the files)."""
        if not self.distributed:
            return obj
        box = [obj if self.master else None]
        dist.broadcast_object_list(box, src=0, device=self._comm_device)
        return box[0]

    @property
    def _comm_device(self) -> torch.device:
        # NCCL moves data between GPUs only; gloo works on CPU tensors.
        return self.device if self.device.type == "cuda" else torch.device("cpu")


def _launch_env(environ: dict[str, str]) -> dict[str, str]:
    """torchrun's variables; a plain `srun` launch is translated to them."""
    if "RANK" not in environ and int(environ.get("SLURM_NTASKS", "1")) > 1:
        if "MASTER_ADDR" not in environ:
            raise UserError("launched by srun without torchrun: set MASTER_ADDR and MASTER_PORT, or use `srun torchrun`")
        return {**environ, "RANK": environ["SLURM_PROCID"], "WORLD_SIZE": environ["SLURM_NTASKS"],
                "LOCAL_RANK": environ.get("SLURM_LOCALID", "0"),
                "LOCAL_WORLD_SIZE": environ.get("SLURM_NTASKS_PER_NODE", "1")}
    return environ


def setup(collective_timeout_s: float) -> Dist:
    """Pick the device and backend (NCCL on GPUs, gloo on CPU) and join the process group if launched."""
    env = _launch_env(dict(os.environ))
    launched = "RANK" in env
    rank, world = int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1))
    local_rank, local_world = int(env.get("LOCAL_RANK", 0)), int(env.get("LOCAL_WORLD_SIZE", 1))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        # N processes on one host share its cores; oversubscribing them costs far more than it gains.
        cores = len(os.sched_getaffinity(0))
        torch.set_num_threads(max(1, cores // max(1, local_world)))
    if launched:
        os.environ.update({k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")})
        # Not plain init_process_group: a restarted worker group must not meet its predecessor's keys.
        process_group.join("nccl" if device.type == "cuda" else "gloo", rank, world, collective_timeout_s,
                           device if device.type == "cuda" else None)
    restarts = int(env.get("TORCHELASTIC_RESTART_COUNT", 0))
    return Dist(rank, local_rank, world, local_world, device, restarts)


def teardown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
