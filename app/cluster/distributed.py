"""Rank awareness in one place: who this process is in the job, its device, and the few collectives
the trainer needs.

Works the same as one plain process (no process group), under `torchrun` on one node,
across nodes, and under Slurm (`srun torchrun ...`, or plain `srun` with MASTER_ADDR/PORT set).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Mapping

import torch
import torch.distributed as dist

from app.cluster import process_group
from app.cluster.cores import CoreClaim, HostShare, explicit_threads
from app.cluster.gpus import GpuClaim
from app.core.errors import UserError


@dataclass(frozen=True)
class World:
    rank: int               # global rank
    local_rank: int         # rank on this node
    size: int               # processes in the job
    local_size: int         # processes on this node
    device: torch.device
    restart_count: int      # worker-group restarts so far (torchrun's TORCHELASTIC_RESTART_COUNT)
    store: dist.Store | None = None     # the process group's store (None without one)
    cpu_share: HostShare | None = None  # on CPU: this process's share of its host's cores (app/cluster/cores.py)
    gpu_claim: GpuClaim | None = None   # a spare-ready node's process on a GPU host: its GPU, claimed when named
    job: str | None = None  # the launcher's name for the job (job_of); None: a plain process

    def relocate(self, device: torch.device) -> None:
        """This process computes on `device` from now on (a spare that claimed another GPU when named,
        app/cluster/gpus.py): every holder of the World reads it here."""
        object.__setattr__(self, "device", device)

    @property
    def is_main(self) -> bool:
        """Global rank 0: the process that prints progress and writes metrics (snapshots: config.SNAPSHOT_RULE)."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    @property
    def collective(self) -> bool:
        """Whether a collective over the node's process group does anything: one of a process is the
        identity (and an NCCL group of one stays bound to the GPU it began on, while a spare may move)."""
        return self.distributed and self.size > 1

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        tensor = torch.tensor(values, dtype=torch.float64, device=self._comm_device)
        if self.collective:
            dist.all_reduce(tensor)
        return tensor.tolist()

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Rank src's `obj` on every rank (how snapshot state reaches nodes that cannot see the files)."""
        if not self.collective:
            return obj
        box = [obj if self.rank == src else None]
        dist.broadcast_object_list(box, src=src, device=self._comm_device)
        return box[0]

    def broadcast_buffers(self, module: torch.nn.Module) -> None:
        """Rank 0's buffers (batch-norm running statistics) everywhere. DDP sends them at the start of
        each forward, after which every rank updates its copy from its own batch; a snapshot written
        by any node is rank 0's state only after this."""
        if self.collective:
            for buffer in module.buffers():
                dist.broadcast(buffer, src=0)

    def wait_for_all(self, name: str, timeout_s: float) -> None:
        """Return once every rank has called this with `name`: a barrier through the group's store, with a
        timeout of its own. A collective's is the group's (--collective-timeout), which would end the ranks
        that got here first while another still works at something long (a download, a large read)."""
        if not self.distributed or self.store is None:
            return
        done = f"app/all/{name}"
        if self.store.add(f"{done}/count", 1) == self.size:
            self.store.set(done, "1")
        self.store.wait([done], timedelta(seconds=timeout_s))

    def gather_object(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order, on every rank."""
        if not self.collective:
            return [obj]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj)
        return out

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


def setup(collective_timeout_s: float, threads: int = 0) -> World:
    """Pick the device and backend (NCCL on GPUs, gloo on CPU) and join the process group if launched.
    On CPU, the process takes its share of the host's cores once every process of the job has
    joined (threads: --threads, 0 for the share; app/cluster/cores.py)."""
    env = _launch_env(dict(os.environ))
    launched = "RANK" in env
    rank, size = int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1))
    local_rank, local_size = int(env.get("LOCAL_RANK", 0)), int(env.get("LOCAL_WORLD_SIZE", 1))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        # NCCL's watchdog ends the process when a collective outlives the timeout given below, so a
        # lost peer costs at most --collective-timeout (3 is torch's default; set it against a stray 0).
        # Inplace mode, whose survivors must live through an NCCL error, sets its own before (app/ft/groups.py).
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    else:
        device = torch.device("cpu")
    # Entered before joining, so that every process of the job has entered itself once any has joined.
    share = (HostShare(explicit_threads(threads, env), claim=CoreClaim.from_env(env, local_size))
             if device.type == "cpu" else None)
    if launched:
        os.environ.update({k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")})
        # Not plain init_process_group: a restarted worker group must not meet its predecessor's keys.
        store = process_group.join("nccl" if device.type == "cuda" else "gloo", rank, size, collective_timeout_s,
                                   device if device.type == "cuda" else None)
    if share is not None:
        share.apply()
    restarts = int(env.get("TORCHELASTIC_RESTART_COUNT", 0))
    return World(rank, local_rank, size, local_size, device, restarts, store if launched else None, share,
                 GpuClaim.from_env(env, device), job_of(env))


# Where a launcher names the job, first found first: Slurm's job id (its requeues keep it; train.sbatch's
# RDZV_ID adds the requeue's count), the containers' RDZV_ID (compose.yaml: one per job, RUN unless given;
# every node, a node started again and a spare have it), torchrun's run id (its --rdzv-id; --standalone
# and app/launch.py's single process: a new one per launch, kept by its restarts).
JOB_VARIABLES = ("SLURM_JOB_ID", "RDZV_ID", "TORCHELASTIC_RUN_ID")


def job_of(environ: Mapping[str, str]) -> str | None:
    """The job this process belongs to, the same for every start of any of its nodes and new for the next
    job; None for a plain process (nothing starts it again: each start is a job of its own)."""
    return next((environ[name] for name in JOB_VARIABLES if environ.get(name)), None)


def teardown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
