"""What a survivor mode's membership does for the step loop (app/ft/trainer.py): the one interface that
torchft mode's Replica (replica.py) and inplace mode's InPlaceGroup (inplace.py) implement, so that a
new survivor mode is one more class with these methods, and tests/test_membership.py checks both."""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Protocol

import torch

from app.training.evaluate import Scorer


class Membership(Protocol):
    """This process as one of the job's survivors: who is in this step, the all-reduce across them,
    and whether the step counts. Healing a member that is behind happens inside start_step()."""

    @property
    def errored(self) -> str | None:
        """Why this step's all-reduce failed, in one line; None if it did not."""
        ...

    @property
    def backend(self) -> str:
        """The c10d backend the members' all-reduce runs on (nccl, gloo): the start row says it."""
        ...

    @property
    def lineage(self) -> str:
        """Which line of the job this process's state continues, as its snapshots, train rows and step
        lines record it: inplace's generation (app/ft/protocol.py's lineage_of); "" where the mode has no
        such thing. Two groups that train one step from different states have different ones (the chaos
        report's split brain)."""
        ...

    def start_step(self) -> None:
        """Settle who is in this step (join a quorum, re-form a group); may load a live member's state."""
        ...

    def share(self) -> tuple[int, int]:
        """(this process's slot, slots in this step): which share of the step's samples is its own."""
        ...

    def average_gradients(self, parameters: list[torch.nn.Parameter], buffers: list[torch.Tensor]) -> None:
        """The gradients and the floating-point buffers (batch-norm statistics) averaged over this step's
        members; a failure is not raised: commit() says no."""
        ...

    def commit(self) -> bool:
        """Whether the step counts: every member's all-reduce completed."""
        ...

    def score_test_set(self, scorer: Scorer) -> list[float] | None:
        """The test set's counts summed over this generation's members, each scoring its own shard with
        `scorer(shard, shards)` (app/training/evaluate.py); None where each group scores it on its own."""
        ...

    def check_secret(self, warn: Callable[[str], None]) -> None:
        """Say what the job secret kept out since the last step (strangers, values no member signed)."""
        ...

    def set_step(self, step: int, samples: int) -> None:
        """After a restore from a snapshot: the step and samples this member's state holds."""
        ...

    def writes(self, directory: Path) -> bool:
        """Whether this process writes snapshots and metrics rows into `directory` now."""
        ...

    def finished(self) -> None:
        """This process trained the job to its end: whatever the mode needs so that the processes still
        waiting for the job (spares, members held off) leave instead of training it again."""
        ...

    def shutdown(self) -> None:
        ...
