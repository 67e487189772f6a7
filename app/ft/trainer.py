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
from app.core.errors import JobOver
from app.datasets.data import Data
from app.ft.inplace import InPlaceGroup
from app.ft.membership import Membership
from app.ft.pace import SharedPace
from app.ft.protocol import further, node_of
from app.ft.replica import Replica
from app.reporting.metrics import Reporter
from app.reporting.startup import StartupClock
from app.training.evaluate import Scorer
from app.training.guard import Terminated
from app.training.snapshot import SnapshotInvalid, read_snapshot
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
    # Set when a SIGTERM ended this process's wait as a spare (inplace): the members it waited beside
    # train on, so whatever step it trained to before a round left it out, the job is past it.
    stopped_as_a_spare = False

    def __init__(self, cfg: Config, world: World, data: Data, model: nn.Module, reporter: Reporter) -> None:
        # First: the membership writes the shared directories (by lease), and the Trainer takes its writer
        # when it is made. It asks for the state only once in a quorum, after restore().
        # The nodes' step times ride each step's all-reduce (app/ft/pace.py), from the step clock to the watch
        # the Trainer makes below: torchft, the group's first process for its node; inplace, every member.
        pace = SharedPace(lambda: self.steps.clock.take(), lambda: self.slow, world.device, node_of)
        self.replica: Membership = _membership(cfg, world, self._share_state, self._heal, self._refresh,
                                               lambda: self.guard.slow_phase(), lambda: self.guard.stop_requested,
                                               reporter.say, lambda line: self.guard.leave_keeping(line),
                                               pace if world.local_rank == 0 or cfg.ft == "inplace" else None)
        super().__init__(cfg, world, data, model, reporter, writer=self.replica)
        if world.local_rank != 0:
            self.slow.say = lambda line: None   # a node's first process names slow nodes for it
        self._epoch: tuple[int, torch.Tensor, tuple[torch.Tensor, ...]] | None = None    # _epoch_data()
        if world.gpu_claim is not None:     # a spare-ready node's process: it may move to the GPU it claims
            world.gpu_claim.relocate = self._relocate
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
        importlib.import_module("torch._dynamo")   # the optimizer's first step needs it (app/job/ starts it)
        self.sampler.set_position(0, 0)
        first = self.sampler.order(self.world.device)[:self.cfg.batch_size * self.cfg.grad_accum]
        self.steps.accumulate(first, self.batches.epoch_augmentation(0))
        self.steps.optimizer.zero_grad(set_to_none=True)

    def computing(self) -> dict[str, str]:
        """The start row's, and the backend the members' all-reduce runs on (`backend` is the node's own group's)."""
        return {**super().computing(), "ft_backend": self.replica.backend}

    def trained_to(self) -> None:
        return None     # a group behind the job is healed from a live one at its first quorum: nothing lost

    def holds_a_step_to_keep(self) -> bool:
        return not self.stopped_as_a_spare

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
            with self.goodput.phase("regroup"):
                try:
                    self.replica.start_step()   # may heal: epoch and position are then the live group's
                except JobOver as over:         # a spare or a member held off when the job finished
                    self.left = str(over)
                    self.report.say(self.left)
                    return
                except Terminated:              # only a spare's wait raises it (app/ft/inplace.py)
                    self.stopped_as_a_spare = True
                    raise
            self.state.lineage = self.replica.lineage       # what its snapshots record
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
        if self.state.position.epoch >= self.cfg.epochs:
            self.replica.finished()     # before this process stops beating: nobody trains the job again

    def _step(self, indices: torch.Tensor, augmentation: tuple[torch.Tensor, ...], slots: int) -> bool:
        began = time.perf_counter()
        clock = self.steps.clock
        clock.begin()
        self.state.schedule.set_progress(self.state.progress())
        step_loss = self.steps.accumulate(indices, augmentation)
        clock.wait_begin()
        waiting = time.perf_counter()
        self.replica.average_gradients(self.state.params, self.state.float_buffers)
        committed = self.replica.commit()
        clock.wait_end()
        self.replica.check_secret(self.report.warn)
        if not committed:
            clock.cancel()
            self.steps.optimizer.zero_grad(set_to_none=True)
            self.state.undo_statistics()
            self._uncommitted += 1
            # Its compute is lost work; its wait at the all-reduce went to finding the failure.
            ended = time.perf_counter()
            self.goodput.move(ended - waiting, self.goodput.current, "detection")
            self.goodput.move(waiting - began, self.goodput.current, "redo")
            why = f"step {self.state.step + 1} not committed ({self.replica.errored or 'a group failed'})"
            # Once per step taken again: across a cut link torchft fails the same step at every
            # all-reduce timeout (3 s), and each try's stacks would say the same (a 60 s cut of four
            # nodes left 151 files).
            if any(mark in why for mark in HANG_MARKS) and self._stacks_step != self.state.step + 1:
                self._stacks_step = self.state.step + 1
                self.guard.take_stacks(why)
            self.report.warn(f"{why}: taken again with the groups left")
            return False
        if slots != self.state.world_size:
            clock.not_ordinary("join")      # a node came or went: a new group's first steps
            if self.world.cpu_share is not None:
                self.world.cpu_share.apply()    # the host's cores are shared anew
        self.state.world_size = slots
        self.count_step(step_loss, len(indices) * slots)
        return True                         # the step clock's span ends with after_step

    def _epoch_data(self) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """The epoch's global order and augmentation, made once per epoch, on the device."""
        epoch = self.state.position.epoch
        if self._epoch is None or self._epoch[0] != epoch:
            self.sampler.set_position(epoch, 0)
            self._epoch = (epoch, self.sampler.order(self.world.device), self.batches.epoch_augmentation(epoch))
            self.steps.clock.not_ordinary("epoch")
        return self._epoch[1], self._epoch[2]

    # ------------------------------------------------------------ each group's own

    def log(self) -> bool:
        """The elastic row, summed over this group's processes only (its world), with the steps not
        committed since the last row and the lineage that trained them where the mode names one."""
        uncommitted, self._uncommitted = self._uncommitted, 0
        lineage = self.replica.lineage
        return super().log(uncommitted=uncommitted, **({"lineage": lineage} if lineage else {}))

    def test_counts(self, scorer: Scorer) -> list[float]:
        """Shared across the members where the membership can (inplace); else this group's own, scored
        across its processes as the elastic loop does."""
        shared = self.replica.score_test_set(scorer)
        return shared if shared is not None else super().test_counts(scorer)

    def _relocate(self, device: torch.device) -> None:
        """Everything this process computes with onto `device`, another GPU it claimed when named
        (app/cluster/gpus.py), before its next generation's group forms there. At a step boundary: no
        gradient, no operation pending."""
        torch.cuda.set_device(device)
        self.steps.relocate(device)
        self.state.relocate(self.steps, device)
        self.batches.relocate(device)
        self.world.relocate(device)
        self._epoch = None                  # made again on the new device
        torch.cuda.empty_cache()            # what it held on the GPU it left goes back to the node there

    # ------------------------------------------------------------ what a healing group copies

    def _share_state(self) -> State:
        """This group's state at the step boundary, for a group that heals from it. The loss of the
        open log interval stays here: it is this group's to report."""
        return self.state.state_dict()

    def _refresh(self) -> tuple[int, int, str]:
        """inplace's look before this process arrives at a round (app/ft/protocol.py's Refresh): the newest
        snapshot on this node's disk, loaded if it is further than this state (protocol.further): a
        process that was frozen, held off or waiting while the others trained on, wrote it and left
        must not bring the job back to its older state. Only its train_state part is read otherwise."""
        try:
            found = self.snapshots.newest_here()
            if found is not None:
                path, saved = found
                mine = (self.state.lineage, self.state.samples())
                if further((saved.get("lineage", ""), self.state.samples(saved)), mine):
                    self.state.load_state_dict(read_snapshot(path))
                    self.report.say(f"loaded {path}: the job went further than this process's state while it waited")
        except (SnapshotInvalid, OSError, MemoryError, ImportError) as exc:     # its bytes, or this reader's fault
            self.report.warn(f"the newest snapshot here did not read ({type(exc).__name__}: {exc}): arriving at the "
                             "round with this process's own state")
        return self.state.step, self.state.samples(), self.state.lineage

    def _heal(self, parts: State) -> None:
        with self.goodput.phase("heal"):
            self.state.load_state_dict(parts)
        self.steps.clock.not_ordinary("join")
        self.report.say(f"healed from a live replica group: now at step {self.state.step}")


def _membership(cfg: Config, world: World, state: Callable[[], State], load: Callable[[State], None],
                refresh: Callable[[], tuple[int, int, str]], idle: Callable[[], ContextManager[None]],
                stopping: Callable[[], bool], say: Callable[[str], None], stuck: Callable[[str], None],
                pace: SharedPace | None) -> Membership:
    """`refresh`: this state after the newest snapshot here, if further, is loaded (inplace, before a round);
    `idle`: around a wait for a data link or as a spare (inplace), which the node's progress bound must not
    take for a hang; `stopping`: whether a SIGTERM came, which ends a spare's wait; `stuck`: how a process
    whose NCCL call never returns leaves (inplace: its last step kept first); `pace`: the node's step
    times to share (and, inplace, its choice to step aside once named slow)."""
    if cfg.ft == "inplace":
        return InPlaceGroup(world, cfg.fault_policy(), cfg.group_store_endpoint(), cfg.job_id(), state, load, idle,
                            cfg.full_size, stopping, say, stuck, cfg.epochs, refresh, pace)
    return Replica(world, cfg.fault_policy(), cfg.lighthouse_url(), state, load, pace)
