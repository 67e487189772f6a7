"""A test double of ProcessGroupNCCL for whole training processes on CPU (tests/test_nccl_ends.py): inplace
mode's NCCL kind (app/ft/groups.py's NcclGroups: the polled wait, the ends in threads of their own) over a
real gloo group, so that members in separate processes train together, and whose abort never returns for
the generation named in NEVER_ENDS_ENV (NVIDIA/nccl#1777: ncclCommAbort joining a proxy thread stuck in
poll() once a peer died). A training process installs it at its start through a sitecustomize the test
writes (install()), before app.ft.inplace takes groups_for from app.ft.groups."""
from __future__ import annotations

import os
import threading
import types
from datetime import timedelta

import torch
import torch.distributed as dist

NEVER_ENDS_ENV = "TEST_NCCL_NEVER_ENDS"     # e.g. inplace-1: that generation's abort never returns
SUCCESS, COMM_ERROR = 0, 2                  # c10d's WorkResult


class Work:
    """A gloo operation as WorkNCCL shows it to NcclGroups: polled, then its result read."""

    def __init__(self, inner: dist.Work) -> None:
        self.inner = inner

    def is_completed(self) -> bool:
        return self.inner.is_completed()

    def get_future_result(self) -> torch.futures.Future:
        result = torch.futures.Future()
        try:
            self.inner.wait()       # completed: returns, or raises its failure (a peer reset)
            result.set_result(SUCCESS)
        except RuntimeError:
            result.set_result(COMM_ERROR)
        return result

    def wait(self, timeout: timedelta | None = None) -> bool:
        return self.inner.wait()


class GlooAsNccl:
    """allreduce, broadcast, abort and a group name, as nccl_group() builds them."""

    def __init__(self, store: dist.Store, rank: int, size: int, device: torch.device, timeout: timedelta,
                 name: str) -> None:
        self.pg = dist.ProcessGroupGloo(store, rank, size, timeout)
        self.options = types.SimpleNamespace(group_name=name)

    def allreduce(self, tensors: list[torch.Tensor]) -> Work:
        return Work(self.pg.allreduce(tensors))

    def broadcast(self, tensors: list[torch.Tensor], options: dist.BroadcastOptions) -> Work:
        return Work(self.pg.broadcast(tensors, options))

    def abort(self) -> None:
        if self.options.group_name == os.environ.get(NEVER_ENDS_ENV):
            threading.Event().wait()


def install() -> None:
    """Inplace members of this process form their generations on GlooAsNccl, through NcclGroups."""
    from app.ft import groups

    def groups_for(device: torch.device, policy, stuck=None) -> groups.NcclGroups:
        return groups.NcclGroups(policy, torch.device("cpu"), make=GlooAsNccl, stuck=stuck)

    groups.groups_for = groups_for
