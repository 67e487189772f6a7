"""One replica group of a torchft-mode job: the quorum at every step, the all-reduce across groups, the commit.

A node is one replica group: its own torchrun (or one plain process) with its own process group for
the ranks inside it. Across nodes nothing is formed once and for all: before every step the group
asks torchft's Manager for a quorum (the Lighthouse decides who is in), the gradients are averaged
across the groups in it, and the step counts only if every group committed. A group that died is
simply not in the next quorum; one that comes back is behind, and the Manager copies the state from
a live group into it (app/ft/transport.py) before it steps again.
"""
from __future__ import annotations

import logging
import os
import socket
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from app.cluster.distributed import World
from app.cluster.secret import SECRET_ENV
from app.core.errors import UserError
from app.ft.pace import SharedPace
from app.ft.writer import WriterLease
from app.recovery.failures import short_cause
from app.core.policy import FaultPolicy
from app.training.evaluate import Scorer

REPLICA_ENV = "FT_REPLICA_ID"       # the node's name (the container entrypoint gives each start one)


def advertised_host() -> str:
    """How the other nodes reach this one: NODE_ADDR (set by the entrypoint and multi-host runs), else the host name."""
    return os.environ.get("NODE_ADDR") or socket.gethostname()


class Replica:
    """This process's view of the replica groups: which share of each step's samples is its own
    (app/ft/membership.py's Membership)."""

    def __init__(self, world: World, policy: FaultPolicy, lighthouse: str,
                 state: Callable[[], Any], load: Callable[[Any], None], pace: SharedPace | None = None) -> None:
        """pace: this node's step times and its watch over the others' (app/ft/pace.py), on the group's
        first process; they ride each step's all-reduce."""
        # torchft (and the transport built on it) only here: inplace mode shares this module's helpers
        # and runs where torchft is not installed.
        from torchft import Manager
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

        from app.ft.transport import SecretTransport

        # Its Python side logs each failed all-reduce with a traceback; the trainer says it in one line.
        logging.getLogger("torchft").setLevel(logging.CRITICAL)
        self.world = world
        host = advertised_host()
        self._store, store_port = _group_store(world, host)
        pg_class = ProcessGroupNCCL if world.device.type == "cuda" else ProcessGroupGloo
        self._backend = "nccl" if pg_class is ProcessGroupNCCL else "gloo"
        self.transport = SecretTransport(host, stage_wait_s=policy.ft_stage_wait_s)
        self.name = os.environ.get(REPLICA_ENV) or f"{socket.gethostname()}-{os.getpid()}"
        try:
            self.manager = Manager(
                pg=pg_class(timeout=timedelta(seconds=policy.ft_collective_timeout_s)),
                load_state_dict=load, state_dict=state, min_replica_size=1,
                use_async_quorum=False,     # the quorum decides this step's share of the samples: known first
                timeout=timedelta(seconds=policy.collective_timeout_s),
                quorum_timeout=timedelta(seconds=policy.ft_quorum_timeout_s),
                quorum_retries=policy.ft_quorum_retries,
                connect_timeout=timedelta(seconds=policy.collective_timeout_s),
                rank=world.local_rank, world_size=world.local_size,
                store_addr=host, store_port=store_port, lighthouse_addr=lighthouse,
                replica_id=self.name, hostname=host,
                heartbeat_interval=timedelta(seconds=policy.ft_heartbeat_interval_s),
                checkpoint_transport=self.transport)
        except Exception as exc:    # torchft raises RuntimeError from Rust for an unreachable Lighthouse
            raise UserError(f"no torchft Lighthouse answered at {lighthouse} within {policy.collective_timeout_s:g} s "
                            f"({short_cause(str(exc)).split(': ')[-1]}); start one with `python -m app.ft.lighthouse` "
                            "or pass --lighthouse") from None
        self._lease = WriterLease(self.name, policy.ft_heartbeat_timeout_s)
        self._lighthouse, self._quorum_timeout_s = lighthouse, policy.ft_quorum_timeout_s
        self._pace = pace
        self._quorums = QuorumNames(self.manager._client)   # torchft keeps the quorum's names nowhere else
        self.manager._client = self._quorums

    # ------------------------------------------------------------ one step

    def start_step(self) -> None:
        """Join this step's quorum; a group that is behind is healed here (the Manager calls `load`)."""
        try:
            self.manager.start_quorum()
        except (TimeoutError, RuntimeError) as exc:     # from torchft's Rust client: no type of its own
            raise UserError(f"no quorum from the torchft Lighthouse at {self._lighthouse} within "
                            f"{self._quorum_timeout_s:g} s ({short_cause(str(exc))}): is it still running?") from None

    def share(self) -> tuple[int, int]:
        """(this process's slot, slots in this step): groups in the quorum x processes per group."""
        group = self.manager.participating_rank()
        slots = self.manager.num_participants() * self.world.local_size
        return (0 if group is None else group) * self.world.local_size + self.world.local_rank, slots

    def average_gradients(self, parameters: list[torch.nn.Parameter], buffers: list[torch.Tensor]) -> None:
        """The gradients and batch-norm statistics averaged over the groups of this quorum, in one flat
        all-reduce. A failure (a group that died mid-step) is not raised: it makes commit() say no, and
        what it left in the tensors (torchft: maybe corrupted) is undone by the step loop."""
        group, nodes = self.manager.participating_rank(), self.manager.num_participants()
        riding = SharedPace.numbers(nodes) if self._pace is not None and group is not None else 0
        tensors, flat = flat_copy(parameters, buffers, spare=riding)
        if riding:
            self._pace.put(flat[-riding:], group)
        self.manager.allreduce(flat).wait()     # averaged: the sum over the groups / their number
        copy_back(flat, tensors)
        names = self._quorums.names()
        if riding and self.manager.errored() is None and len(names) == nodes and names[group] == self.name:
            self._pace.got(flat[-riding:], names, scale=nodes)

    def commit(self) -> bool:
        """Whether every group of the quorum finished this step: step the optimizer only if so."""
        return self.manager.should_commit()

    def score_test_set(self, scorer: Scorer) -> list[float] | None:
        """None: each replica group scores the test set on its own. torchft's all-reduce runs inside a
        quorum's step only; one at the epoch's end would cost a quorum of its own."""
        return None

    @property
    def backend(self) -> str:
        return self._backend

    @property
    def errored(self) -> str | None:
        error = self.manager.errored()
        return None if error is None else short_cause(str(error.original_exception))

    def check_secret(self, warn: Callable[[str], None]) -> None:
        """Stop if this group was refused the state for the job secret (bad input: one line, exit 2);
        say once per address which strangers this group refused."""
        from app.ft.transport import StateRefused

        error = self.manager.errored()
        if error is not None and isinstance(error.original_exception, StateRefused):
            raise UserError(str(error.original_exception))
        while self.transport.refused:
            warn(f"refused the state to {self.transport.refused.pop()}: it does not hold the job secret "
                 f"({SECRET_ENV}); nothing was sent")

    def set_step(self, step: int, samples: int) -> None:
        """After a restore from a snapshot: the Lighthouse makes the most advanced group the source."""
        self.manager.load_state_dict({"step": step, "batches_committed": samples})

    # ------------------------------------------------------------ writing

    def writes(self, directory: Path) -> bool:
        """Whether this group writes snapshots and metrics rows into `directory` now (app/ft/writer.py):
        local rank 0 of the group that holds the directory's lease."""
        return self.world.local_rank == 0 and self._lease.holds(directory)

    @property
    def lineage(self) -> str:
        return ""       # torchft's quorums are no lines of the job: a healing group copies a live one's state

    def finished(self) -> None:
        """Nothing: torchft mode has no spares, and a replica group that comes later finds the Lighthouse
        gone with the job's nodes."""

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)
        self.transport.shutdown()


class QuorumNames:
    """torchft's ManagerClient, passed through, keeping the names of the last quorum's replica groups:
    a group's participating rank is its place in that list (torchft sorts them by replica id), which
    is how a number riding the all-reduce in a group's slot is known to be that node's."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self._ids: list[str] = []

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        result = self._client._quorum(*args, **kwargs)
        self._ids = list(result.replica_ids)
        return result

    def names(self) -> list[str]:
        """The groups' names (REPLICA_ENV, without the suffix torchft adds) in participating-rank order."""
        return [replica.rpartition(":")[0] or replica for replica in self._ids]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def flat_copy(parameters: list[torch.nn.Parameter], buffers: list[torch.Tensor],
              spare: int = 0) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The parameters' gradients and the model's floating-point buffers, and one flat copy of them all
    (one all-reduce instead of one per tensor), with `spare` more zeros at its end for numbers that
    ride along.

    The buffers (batch-norm running statistics) ride here so that every node holds the same model
    after each step: each node's forward updates them from its own samples, and nothing else syncs
    them across nodes. Averaged with the gradients, not rank 0's as DDP broadcasts them: the flat
    copy is averaged whole in both modes (torchft's Manager over the quorum's participants), and the
    statistics then come from every node's samples, not one node's (docs/fault-tolerance.md)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    tensors = grads + buffers
    spares = [grads[0].new_zeros(spare)] if spare else []
    return tensors, torch.cat([t.reshape(-1) for t in tensors] + spares)


def copy_back(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """The flat copy (all-reduced) back into the tensors it came from."""
    sizes = [t.numel() for t in tensors]
    chunks = flat[:sum(sizes)].split(sizes)
    torch._foreach_copy_(tensors, [chunk.view_as(t) for chunk, t in zip(chunks, tensors)])


def _group_store(world: World, host: str) -> tuple[dist.TCPStore | None, int]:
    """A TCPStore of this group's own for torchft's Manager, served by local rank 0 (the launcher's
    store may hold a previous incarnation's keys), and its port, on every rank of the group."""
    store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False) if world.local_rank == 0 else None
    return store, world.broadcast_object(store.port if store is not None else None)
