"""The GPU a training process of a node that may wait as a warm spare (inplace's --full-size) claims, and
only while the job names it.

A node container of such a job holds no GPU lock for its life (docker/entrypoint.sh hands its
processes the claim instead: the folder of the host's GPU locks, and every GPU the job may use as
CUDA_VISIBLE_DEVICES). Each process claims one GPU when a generation names it (`named`), by the
lock file the entrypoint's own claims use (`gpu-ID` under that folder, an exclusive flock, dropped by
the kernel when its process dies), and gives it back while it waits as a spare (`away`): a spare
that joins takes the GPU of the node it replaces, and a node back while the job is full holds none.

Which GPU: the one the process computes on if it is free, else the first free one, to which the
process moves (its model, optimizer, data and next NCCL group: `relocate`, the trainer's). Only
nodes of one GPU claim this way: a node of several keeps the claim the entrypoint made for its life,
its own NCCL group being bound to its GPUs. With no GPU free (a frozen node keeps its lock until it
wakes) the process trains where it is, unclaimed, and tries again at the next generation; it always
trains when named, as a spare named to replace a hung node must. While it waits, its CUDA context
and model stay on the GPU it last used (a few hundred MB beside the node training there).
"""
from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path
from typing import Callable, Iterator, Mapping, Sequence

import torch

# Set by docker/entrypoint.sh for a node of a job with spares on a GPU host, instead of claiming GPUs
# itself: the folder of the host's GPU locks, and how many GPUs the node claims.
CLAIM_LOCKS_ENV, CLAIM_GPUS_ENV = "NODE_GPU_LOCKS", "NODE_GPU_CLAIM"


class GpuClaim:
    """One process's claim among `gpus` (host GPU ids, in CUDA_VISIBLE_DEVICES's order: local index i is
    host GPU gpus[i]). `relocate(device)` moves the process's training to another local GPU; None: it
    never moves."""

    def __init__(self, locks: Path, gpus: Sequence[str], device: torch.device,
                 relocate: Callable[[torch.device], None] | None = None) -> None:
        self.locks, self.gpus, self.device, self.relocate = locks, list(gpus), device, relocate
        self._held: tuple[int, int] | None = None      # (local index, the descriptor of its lock)

    @classmethod
    def from_env(cls, environ: Mapping[str, str], device: torch.device) -> GpuClaim | None:
        """The claim docker/entrypoint.sh handed over (None where it claimed, or on CPU)."""
        locks, want = environ.get(CLAIM_LOCKS_ENV), environ.get(CLAIM_GPUS_ENV, "")
        if device.type != "cuda" or not locks or not want.isdigit() or int(want) < 1:
            return None
        visible = [g.strip() for g in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
        return cls(Path(locks), visible or [str(i) for i in range(torch.cuda.device_count())], device)

    @property
    def held(self) -> int | None:
        """The local index of the GPU held, if one is."""
        return None if self._held is None else self._held[0]

    def named(self) -> str | None:
        """The job names this process: claim a GPU if it holds none, moving to it where it may. What
        it computes on, in words; None when nothing changed (it held its GPU already)."""
        if self._held is not None:
            return None
        here = self.device.index or 0
        order = [here] + ([i for i in range(len(self.gpus)) if i != here] if self.relocate is not None else [])
        for index in order:
            fd = self._lock(index)
            if fd is None:
                continue
            self._held = (index, fd)
            if index != here:
                self.device = torch.device("cuda", index)
                self.relocate(self.device)
                return f"running on GPU {self.gpus[index]} (claimed now; moved from GPU {self.gpus[here]})"
            return f"running on GPU {self.gpus[index]} (claimed now)"
        return f"no GPU free to claim: running on GPU {self.gpus[here]}, unclaimed, until a generation finds one"

    @contextlib.contextmanager
    def away(self) -> Iterator[None]:
        """While this process waits as a spare: its GPU's lock goes back (a node that joins takes it);
        its model stays where it is, to be claimed again, or moved, when it is named."""
        self.give_back()
        yield

    def give_back(self) -> None:
        if self._held is not None:
            os.close(self._held[1])
            self._held = None

    def _lock(self, index: int) -> int | None:
        """The descriptor of local GPU `index`'s lock, now held; None if another process holds it."""
        try:
            self.locks.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.locks / f"gpu-{self.gpus[index]}", os.O_WRONLY | os.O_CREAT, 0o644)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        return fd
