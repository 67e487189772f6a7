"""The training loop of the modes whose survivors keep training (torchft, inplace): the elastic loop
(app/training/trainer.py) with a membership check around every step.

What changes against the elastic loop, and only that:
- before each step the replica group joins the step's quorum (torchft: app/ft/replica.py) or finds
  its generation unchanged (inplace: app/ft/inplace.py, re-formed only when a member comes or goes);
  a group that is behind is healed there from a live one (its whole state: weights, optimizer,
  schedule, position in the epoch);
- the step's samples are the epoch's global order from the consumed position, dealt round-robin
  over the slots of this quorum (groups x processes): the same rule as the elastic sampler, so the
  order does not depend on who is in;
- gradients are averaged across the groups after the backward, and the step counts (weights
  updated, samples consumed) only if every group committed; otherwise it is taken again with
  whoever is left;
- logs and snapshot decisions are each group's own (no collective across groups outside the step):
  one group per run directory writes the rows and the snapshots. Evaluation is too in torchft mode;
  inplace's members share it at the epoch's end (each scores a shard, one all-reduce sums them).
"""
from __future__ import annotations

import importlib
import time
from typing import Callable, ContextManager

import torch
from torch import nn

from app.cluster.distributed import World
from app.core.config import Config
from app.datasets.data import Data
from app.ft.inplace import InPlaceGroup
from app.ft.membership import Membership
from app.ft.replica import Replica
from app.reporting.metrics import Reporter
from app.reporting.startup import StartupClock
from app.training.evaluate import Scorer
from app.training.state import State
from app.training.trainer import Trainer


# A step that failed on a hang, not on a peer that went: inplace's watch cut a silent member off
# (app/ft/inplace.py's reason), or torchft's all-reduce ran out its timeout (gloo's "Timed out").
HANG_MARKS = ("stopped beating", "Timed out", "timed out", "timeout")


class FtTrainer(Trainer):
    """Extends the Trainer through its public members only (see its docstring): its membership is
    the Writer, its state (app/training/state.py) what a healing group copies."""

    # A replica group's loss is its own: a NaN in it alone would stop this group and leave the others
    # to recover from its exit as from a fault. Its gradients are in every group's average, so every
    # group's weights show it after the same step; all stop there together.
    checks_the_jobs_values = False
    launch_is_the_job = False       # the start line waits for the first quorum (run_steps)

    def __init__(self, cfg: Config, world: World, data: Data, model: nn.Module, reporter: Reporter) -> None:
        # First: the membership writes the shared directories (by lease), and the Trainer takes its writer
        # when it is made. It asks for the state only once in a quorum, after restore().
        self.replica: Membership = _membership(cfg, world, self._share_state, self._heal,
                                               lambda: self.guard.slow_phase(), lambda: self.guard.stop_requested,
                                               reporter.say, lambda line: self.guard.leave_keeping(line))
        super().__init__(cfg, world, data, model, reporter, writer=self.replica)
        self._epoch: tuple[int, torch.Tensor, tuple[torch.Tensor, ...]] | None = None    # _epoch_data()
        self._uncommitted = 0
        self._stacks_step: int | None = None     # the step whose failure last left hang stacks

    def restore(self, clock: StartupClock) -> None:
        super().restore(clock)
        self.replica.set_step(self.state.step, self.state.step)
        with self.goodput.phase("startup"):
            self._warm_up()

    def _warm_up(self) -> None:
        """A first forward and backward before the first quorum: once in a quorum, the others wait at
        the all-reduce for this group's step, and a first step (lazy imports, allocations) took
        longer than the all-reduce's timeout here, failing the step it should have joined."""
        importlib.import_module("torch._dynamo")   # the optimizer's first step needs it (app/train.py starts it)
        self.sampler.set_position(0, 0)
        first = self.sampler.order(self.world.device)[:self.cfg.batch_size * self.cfg.grad_accum]
        self.steps.accumulate(first, self.batches.epoch_augmentation(0))
        self.steps.optimizer.zero_grad(set_to_none=True)

    def computing(self) -> dict[str, str]:
        """The start row's, and the backend the members' all-reduce runs on (`backend` is the node's own group's)."""
        return {**super().computing(), "ft_backend": self.replica.backend}

    def trained_to(self) -> None:
        return None     # a group behind the job is healed from a live one at its first quorum: nothing lost

    def fit(self) -> None:
        try:
            super().fit()
        finally:
            self.replica.shutdown()

    # ------------------------------------------------------------ the quorum's step

    def run_steps(self) -> None:
        """Steps until the last epoch ends. No loop per epoch: a group healed at a quorum may land in
        another epoch, and must still take the step that quorum was formed for (the others wait for
        it at the all-reduce)."""
        per_step = self.cfg.batch_size * self.cfg.grad_accum
        while self.state.position.epoch < self.cfg.epochs and not self.stopping():
            with self.goodput.phase("peer_wait"):
                self.replica.start_step()   # may heal: epoch and position are then the live group's
            position = self.state.position  # a heal replaces it
            if position.epoch >= self.cfg.epochs:
                break
            slot, slots = self.replica.share()
            self.introduce(slots)           # the first quorum's: the world this process starts training at
            start = position.consumed
            if start + slots * per_step > self.state.epoch_size:
                self.end_epoch()            # the same in every group: same position, same quorum
                continue
            order, augmentation = self._epoch_data()
            if self._step(order[start:start + slots * per_step][slot::slots], augmentation, slots):
                self.after_step()

    def _step(self, indices: torch.Tensor, augmentation: tuple[torch.Tensor, ...], slots: int) -> bool:
        began = time.perf_counter()
        self.state.schedule.set_progress(self.state.progress())
        step_loss = self.steps.accumulate(indices, augmentation)
        self.replica.average_gradients(self.state.params, self.state.float_buffers)
        committed = self.replica.commit()
        self.replica.check_secret(self.report.warn)
        if not committed:
            self.steps.optimizer.zero_grad(set_to_none=True)
            self.state.undo_statistics()
            self._uncommitted += 1
            self.goodput.move(time.perf_counter() - began, self.goodput.current, "redo")   # lost work
            why = f"step {self.state.step + 1} not committed ({self.replica.errored or 'a group failed'})"
            # Once per step taken again: across a cut link torchft fails the same step at every
            # all-reduce timeout (3 s), and each try's stacks would say the same (a 60 s cut of four
            # nodes left 151 files).
            if any(mark in why for mark in HANG_MARKS) and self._stacks_step != self.state.step + 1:
                self._stacks_step = self.state.step + 1
                self.guard.take_stacks(why)
            self.report.warn(f"{why}: taken again with the groups left")
            return False
        if slots != self.state.world_size and self.world.cpu_share is not None:
            self.world.cpu_share.apply()    # a node came or went: the host's cores are shared anew
        self.state.world_size = slots
        self.count_step(step_loss, len(indices) * slots)
        return True

    def _epoch_data(self) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """The epoch's global order and augmentation, made once per epoch, on the device."""
        epoch = self.state.position.epoch
        if self._epoch is None or self._epoch[0] != epoch:
            self.sampler.set_position(epoch, 0)
            self._epoch = (epoch, self.sampler.order(self.world.device), self.batches.epoch_augmentation(epoch))
        return self._epoch[1], self._epoch[2]

    # ------------------------------------------------------------ each group's own

    def log(self) -> bool:
        """The elastic row, summed over this group's processes only (its world), with the steps not
        committed since the last row."""
        uncommitted, self._uncommitted = self._uncommitted, 0
        return super().log(uncommitted=uncommitted)

    def test_counts(self, scorer: Scorer) -> list[float]:
        """Shared across the members where the membership can (inplace); else this group's own, scored
        across its processes as the elastic loop does."""
        shared = self.replica.score_test_set(scorer)
        return shared if shared is not None else super().test_counts(scorer)

    # ------------------------------------------------------------ what a healing group copies

    def _share_state(self) -> State:
        """This group's state at the step boundary, for a group that heals from it. The loss of the
        open log interval stays here: it is this group's to report."""
        return self.state.state_dict()

    def _heal(self, parts: State) -> None:
        self.state.load_state_dict(parts)
        self.report.say(f"healed from a live replica group: now at step {self.state.step}")


def _membership(cfg: Config, world: World, state: Callable[[], State], load: Callable[[State], None],
                idle: Callable[[], ContextManager[None]], stopping: Callable[[], bool],
                say: Callable[[str], None], stuck: Callable[[str], None]) -> Membership:
    """`idle`: around a wait for a data link or as a spare (inplace), which the node's progress bound must not
    take for a hang; `stopping`: whether a SIGTERM came, which ends a spare's wait; `stuck`: how a process
    whose NCCL call never returns leaves (inplace: its last step kept first)."""
    if cfg.ft == "inplace":
        return InPlaceGroup(world, cfg.fault_policy(), cfg.group_store_endpoint(), cfg.job_id(), state, load, idle,
                            cfg.full_size, stopping, say, stuck)
    return Replica(world, cfg.fault_policy(), cfg.lighthouse_url(), state, load)
