"""The training loop: epochs of steps (app/training/step.py), evaluation (app/training/evaluate.py), logs and snapshots."""
from __future__ import annotations

import functools
import math
import os
import threading
import time
from typing import Any, Sequence

import torch
from torch import nn

from app.cluster.distributed import World
from app.core.config import Config
from app.core.errors import UserError
from app.datasets.data import Batches, Data, ResumableSampler
from app.recovery.slow import SlowWatch
from app.training.guard import FaultGuard
from app.reporting.goodput import Account, describe
from app.reporting.metrics import LIFE_ROWS, Reporter, done_line
from app.reporting.startup import StartupClock
from app.training import models
from app.training.evaluate import Scorer, accuracy_and_loss, score
from app.training.snapshot import FirstRanks, Snapshots, Writer
from app.training.state import TrainingState
from app.training.step import StepRunner, peak_memory_mb


class Diverged(UserError):
    """The loss or the weights went non-finite: the settings cannot train this model (bad input, exit 2),
    which restarting cannot mend; not a fault to recover from."""


def diverged(loss: float | None, tensors: Sequence[torch.Tensor], name: str = "loss") -> str | None:
    """What is not finite, the loss (None: not looked at) or any of the tensors; None if nothing.
    One reduction on the device and one read."""
    if loss is not None and not math.isfinite(loss):
        return f"the {name} is {loss}"
    if tensors and not all_finite(list(tensors)):
        return "the model's weights or statistics are not finite"
    return None


def all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether every value is finite. The 2-norm says so in one pass (2 ms for a ResNet-18 on one CPU core,
    against the max-norm's 30, at every log row and snapshot) but also overflows for finite values
    beyond about 1e19: the max-norm settles that rare case."""
    if bool(torch.stack(torch._foreach_norm(tensors, 2)).isfinite().all()):
        return True
    return bool(torch.stack(torch._foreach_norm(tensors, math.inf)).isfinite().all())


class Pace:
    """Images per second: over the log interval (a train row's) and over this start (the done line's)."""

    def __init__(self) -> None:
        self.steps = 0          # steps since this process started (compile warm-up)
        self.images = 0         # images trained on since then, by all processes together
        self.restart()

    def restart(self) -> None:
        """A new interval: what came before it (compiling, evaluating) is not training throughput."""
        self._since, self._steps = time.perf_counter(), 0

    def count(self, samples: int) -> None:
        self._steps += 1
        self.steps += 1
        self.images += samples

    def per_second(self, images_per_step: int) -> float | None:
        """The interval's images per second; None before its first step."""
        images = self._steps * images_per_step
        return images / (time.perf_counter() - self._since) if images else None


class Trainer:
    """The training loop of one process, elastic mode's as it is.

    The survivor modes' loop (app/ft/trainer.py) extends it through its public members only: it
    overrides the hooks `trained_to`, `holds_a_step_to_keep`, `run_steps`, `log`, `test_counts` and
    `computing`, builds its
    steps from `stopping`, `count_step`, `after_step`, `end_epoch`, `stop_if_diverged`,
    `record_train` and `introduce`, and passes its membership as the Writer. What a snapshot or a
    live copy holds is `state` (app/training/state.py). Each step's time outside the collective wait
    is `steps.clock`'s (app/training/step_time.py); `slow` judges every node's (app/recovery/slow.py),
    fed by elastic mode's heartbeat here and by the survivor modes' membership there.
    """

    def __init__(self, cfg: Config, world: World, data: Data, model: nn.Module, reporter: Reporter,
                 writer: Writer | None = None) -> None:
        """writer: who writes the snapshots and metrics rows; None: elastic mode's FirstRanks."""
        self.cfg, self.world, self.report = cfg, world, reporter
        self.batches = Batches(data, world.device, cfg.seed, cfg.augment)
        self.steps = StepRunner(cfg, world, model, self.batches)
        self.state = TrainingState(cfg, world, self.steps, len(data.train), reporter.say)
        self.sampler = ResumableSampler(len(data.train), world.size, world.rank, cfg.seed)
        self.snapshots = Snapshots(cfg, world, reporter.say, reporter.warn)
        self.writer = writer or FirstRanks(self.snapshots)
        policy = cfg.fault_policy()
        # Who is slow: every node's first process says it (rank 0 through the Reporter, for the progress bar).
        self.slow = SlowWatch(policy.slow_factor, policy.slow_window_s, policy.heartbeat_interval_s,
                              reporter.say if world.is_main else functools.partial(print, flush=True))
        # Elastic mode's heartbeat carries the step times; the survivor modes' membership does (its all-reduce).
        self.guard = FaultGuard(world, policy, self._keep_step, cfg.run_dir, self._leaving,
                                pace=self.steps.clock.take if self.launch_is_the_job else None,
                                slow=self.slow if self.launch_is_the_job else None)
        self.pace = Pace()
        self._keeping = threading.Lock()    # one just-in-time snapshot at a time
        self._kept_step: int | None = None
        self._finite_step = 0           # the last step found finite (stop_if_diverged)
        # Why this process left before the job's end without a fault (a survivor mode's finished job, seen by
        # a spare): it keeps no state of its own then, and its goodput row says it left.
        self.left: str | None = None
        self._redo_until: int | None = None     # steps up to this one were trained before (rank 0 knows)
        self.goodput = Account(time.time(), 0.0)    # replaced once restored (restore): with the start-up
        self._stepped_at = time.perf_counter()      # the last step boundary, for the goodput account
        self._intro: str | None = (     # the start line's first part, until introduce() says it
            f"{data.name}: {len(data.train)} train / {len(data.test)} test images, {cfg.model} "
            f"({models.parameter_count(model) / 1e6:.2f}M params)")

    # ------------------------------------------------------------ public

    # Whether this process's launch is the world the job trains at, as in elastic mode, where every
    # process of the job is in it. In the survivor modes each node's launch is a world of its own, and
    # the job's is whoever is in a step: known at this process's first quorum (app/ft/trainer.py).
    launch_is_the_job = True

    def introduce(self, world_size: int) -> None:
        """The start line, once: what trains, at which world size (the job's), on what, after how many restarts."""
        if self._intro is not None:
            self.report.say(f"{self._intro}, world size {world_size} on {self.world.device.type}, "
                            f"restart {self.world.restart_count}")
            self._intro = None

    def restore(self, clock: StartupClock) -> None:
        """Continue from the newest valid snapshot, if the config allows and one exists."""
        if self.launch_is_the_job:
            self.introduce(self.world.size)
        fresh_allowed = self.world.restart_count == 0   # an elastic restart always resumes
        trained_to = self.trained_to()
        parts = self.snapshots.restore(self.cfg.resume, fresh_allowed, trained_to)
        if parts is not None:
            self.state.load_state_dict(parts)
        self._finite_step = self.state.step
        clock.mark("snapshot")          # read on one node, broadcast, loaded
        if trained_to is not None and trained_to > self.state.step:
            self._redo_until = trained_to
        self.guard.arm()
        self._record_start(clock, resumed=parts is not None)
        self.goodput = Account(clock.started, time.time() - clock.started)    # start-up: up to here

    def trained_to(self) -> int | None:
        """Hook: how far this run directory's metrics say the job trained; a fresh start behind it loses steps."""
        return self.report.last_step()

    def holds_a_step_to_keep(self) -> bool:
        """Hook: whether this process's last step may be one the job needs kept when it leaves (a waiting
        spare's is not: the members it waits beside hold a newer one)."""
        return True

    def _record_start(self, clock: StartupClock, resumed: bool) -> None:
        """One row per incarnation of the job: where it starts, on which world, computing how, and which
        node has which host GPUs (NODE_ADDR and NODE_GPUS come from the container entrypoint)."""
        nodes = self.world.gather_object((os.environ.get("NODE_ADDR"), os.environ.get("NODE_GPUS")))
        self.report.say(self.snapshots.cadence())
        # Survivor modes: this node's launch is no world of the job's, which its first quorum makes (and the
        # train rows say); the row gives the launch's size apart, and no job world it does not know.
        world = {} if self.launch_is_the_job else {"world_size": None, "node_world_size": self.world.size}
        self._record("start", **world, at_risk_s=self.snapshots.every_seconds or None, epoch=self.state.progress(), resumed=resumed,
                     master_addr=os.environ.get("MASTER_ADDR"),
                     node_gpus={addr: gpus for addr, gpus in nodes if addr and gpus} or None,
                     process_started=round(clock.started, 3), startup_s=clock.seconds(),
                     threads=torch.get_num_threads(),
                     **self.computing())

    def computing(self) -> dict[str, str]:
        """Hook: how this process computes, as the start row says it (backend, device, dtype, layout)."""
        return self.steps.numerics.describe()

    def fit(self) -> None:
        """Train to the end; a lost peer or SIGTERM keeps the last step and ends the rank (app/training/guard.py)."""
        started = time.perf_counter()
        self.pace.restart()         # restoring and the start row are start-up, not the first row's steps
        self.goodput.switch("redo" if self._redo_until is not None else "train")
        ended = "fault"
        try:
            try:
                self.run_steps()
            except Diverged:
                raise       # every rank found it at the same point: no peer is lost, no step to keep
            except Exception as exc:
                self._fault_found()
                self.guard.after_failure(exc)
            self.guard.stop_if_requested()
            if self.state.position.consumed and self.left is None:     # --max-steps stopped it inside an epoch
                self._save(self.snapshots.due(self.state.step, stopping=True))
            ended = "left" if self.left is not None else "done"
        finally:
            self.guard.disarm()
            with self.goodput.phase("snapshot"):
                self.snapshots.close()      # the final write is never cut off; then the saver leaves
            self._record_goodput(ended if not self.guard.stop_requested else "stopped")
        self.snapshots.raise_if_failed()
        if self.state.position.epoch >= self.cfg.epochs:
            self.report.say(done_line(self.cfg.epochs, self.state.step, self.state.position.test_acc, self.pace.images,
                                      time.perf_counter() - started) + "; " + describe(self.report.job_account()))

    def _leaving(self, final: bool) -> None:
        """The guard's hook when the heartbeat thread ends this process: the fault found, then (final) the row."""
        if final:
            self._record_goodput("fault")
        else:
            self._fault_found()

    def _fault_found(self) -> None:
        """From the last step boundary on, the time went to finding the fault (the step in flight never
        counts); from now on to the way out."""
        self.goodput.switch("detection", since=self._stepped_at)
        self.goodput.switch("regroup")

    def _record_goodput(self, ended: str) -> None:
        """This life's goodput row (rank 0's Reporter writes it): at its end, or on its way out after a fault."""
        self.goodput.switch(None)
        self._record("goodput", epoch=self.state.progress(), ended=ended, **self.goodput.row())

    def _record(self, event: str, **values: Any) -> None:
        """A metrics row with what every row says; in the file where this process writes the run
        directory (its Writer), and a row about this life (LIFE_ROWS) wherever it is."""
        to_file = event in LIFE_ROWS or self.writer.writes(self.cfg.run_dir)
        values = {"world_size": self.state.world_size, **values}
        self.report.record(event, to_file, step=self.state.step, restart_count=self.world.restart_count, **values)

    # ------------------------------------------------------------ epoch

    def run_steps(self) -> None:
        """Hook: the steps to the end of the last epoch, or until stopping()."""
        while self.state.position.epoch < self.cfg.epochs and not self.stopping():
            if self._train_epoch():
                self.end_epoch()

    def _train_epoch(self) -> bool:
        """Train on what is left of the current epoch; False if stopped before its end."""
        self.sampler.set_position(self.state.position.epoch, self.state.position.consumed)
        # Made on the device once per epoch: a step then slices it, with no host-to-device copy (a sync).
        indices = self.sampler.indices(self.world.device)
        augmentation = self.batches.epoch_augmentation(self.state.position.epoch)
        per_step = self.cfg.batch_size * self.cfg.grad_accum
        self.steps.clock.not_ordinary("epoch")      # the epoch's order and augmentation were just made
        for start in range(0, len(indices) - per_step + 1, per_step):
            self._train_step(indices[start:start + per_step], augmentation)
            self.after_step()
            if self.stopping():
                return False
        return True

    def end_epoch(self) -> None:
        """The epoch is complete: evaluate when it is time, and snapshot."""
        self.state.end_epoch()
        epoch = self.state.position.epoch
        if epoch == self.cfg.epochs or epoch % self.cfg.eval_every_epochs == 0:
            self._evaluate()
        self._save(self.snapshots.due(self.state.step, epoch=epoch))

    def stopping(self) -> bool:
        return self.guard.stop_requested or (0 < self.cfg.max_steps <= self.state.step)

    # ------------------------------------------------------------ step

    def _train_step(self, indices: torch.Tensor, augmentation: tuple[torch.Tensor, ...]) -> None:
        self.steps.clock.begin()
        self.state.schedule.set_progress(self.state.progress())
        step_loss = self.steps.accumulate(indices, augmentation)    # DDP's waits marked by its hooks
        self.count_step(step_loss, len(indices) * self.state.world_size)

    def count_step(self, step_loss: torch.Tensor, samples: int) -> None:
        """Update the weights and count the step: `samples` trained on by all processes together."""
        with self.guard.updating:     # a just-in-time snapshot from the heartbeat thread waits for this
            self.steps.update()
            # Only a completed step counts, so that a failure inside the next one leaves a clean boundary.
            self.state.count_step(step_loss, self.cfg.grad_accum, samples)
        self.pace.count(samples)

    def after_step(self) -> None:
        """At each step boundary: the log row and the snapshot when due, the heartbeat's and goodput's marks."""
        step = self.state.step
        if self.pace.steps == 1:
            self._first_step_done()
        self.guard.stepped()
        stepped_at, self._stepped_at = self._stepped_at, time.perf_counter()
        if self.slow.lost_s and self.goodput.current in ("train", "redo"):   # what this step waited for a slow node
            self.goodput.move(min(self.slow.lost_s, self._stepped_at - stepped_at), self.goodput.current, "slow_peer")
        if self._redo_until is not None and step >= self._redo_until:
            self._redo_until = None         # back where the job had trained to: steps count again
            self.goodput.switch("train")
        timer = self.log() if step % self.cfg.log_every_steps == 0 else False
        self._save(self.snapshots.due(step, timer=timer))
        self.report.advance(step, epoch=self.state.position.epoch)
        self.steps.clock.end()      # the step's own work ends here: its row and its snapshot decision too

    def _first_step_done(self) -> None:
        """This process's first step is done: compiling it was not training throughput, and the optimizer's
        state now exists, so the snapshots' arena can be made for it before a save waits on that."""
        if self.cfg.compile:
            self.pace.restart()
        if self.writer.writes(self.cfg.snapshot_dir):
            self.snapshots.prepare(self.state.state_dict())

    # ------------------------------------------------------------ logging and evaluation

    def log(self, **extra: Any) -> bool:
        """Hook: all-reduce the interval's loss, with rank 0's snapshot-timer vote riding along, and
        write one metrics line (`extra` added); returns the agreed vote (a timed snapshot is due), the
        same on every rank: a vote taken alone would send rank 0 into the save's collectives alone."""
        self.steps.clock.wait_begin()
        loss_sum, count, timer = self.world.all_reduce_sum([*self.state.loss(), self.snapshots.timer_vote()])
        self.steps.clock.wait_end()
        self.state.reset_loss()
        self.stop_if_diverged(loss_sum, self.state.params)
        self.record_train(loss_sum / max(count, 1), **extra)
        return timer > 0

    def record_train(self, loss: float, **extra: Any) -> None:
        """The log interval's train row, `extra` added; the next interval starts."""
        images_per_step = self.cfg.batch_size * self.cfg.grad_accum * self.state.world_size
        self._record("train", epoch=self.state.progress(), loss=loss, lr=self.state.optimizer.param_groups[0]["lr"],
                     test_acc=self.state.position.test_acc, images_per_s=self.pace.per_second(images_per_step),
                     peak_memory_mb=round(peak_memory_mb(self.world.device), 1), **extra)
        self.pace.restart()

    @torch.no_grad()
    def _evaluate(self) -> None:
        """Every rank scores its shard of the test set; the counts are summed across ranks."""
        with self.guard.slow_phase(), self.goodput.phase("eval"):
            self._score_test_set()
        self.pace.restart()             # evaluation time is not training throughput
        self.steps.clock.not_ordinary("eval")

    def _score_test_set(self) -> None:
        def shard(index: int, shards: int) -> list[float]:
            return score(self.state.model, self.batches, index, shards, 2 * self.cfg.batch_size, self.steps.autocast)

        test_acc, loss = accuracy_and_loss(self.test_counts(shard))
        self.state.position.test_acc = test_acc
        self.stop_if_diverged(loss, self.state.params, name="test loss")
        self._record("eval", epoch=float(self.state.position.epoch), test_acc=test_acc, test_loss=loss,
                     lr=self.state.optimizer.param_groups[0]["lr"])

    def test_counts(self, scorer: Scorer) -> list[float]:
        """Hook: the test set's counts summed over the processes that share its scoring; here every rank
        scores its shard and the job sums them."""
        return self.world.all_reduce_sum(scorer(self.world.rank, self.world.size))

    # ------------------------------------------------------------ snapshots

    def _save(self, reason: str | None) -> None:
        """A snapshot, when one is due (reason from Snapshots.due), at a point every rank agrees on:
        the loss accumulators are summed first. The Writer is asked at every step boundary, due or
        not: the survivor modes' lease is read at each ask and renewed by its holder when due (app/ft/writer.py)."""
        writes = self.writer.writes(self.cfg.snapshot_dir)
        if reason is None:
            return
        with self.goodput.phase("snapshot"):
            self._save_now(reason, writes)
        self.steps.clock.not_ordinary("snapshot")

    def _save_now(self, reason: str, writes: bool) -> None:
        loss = self.world.all_reduce_sum(list(self.state.loss()))
        self.world.broadcast_buffers(self.state.model)     # every node's copy of this step is the same
        self.stop_if_diverged(loss[0], self.state.params + self.state.float_buffers)
        if not writes:
            return
        if diverged(None, self.state.float_buffers):   # a replica group's own statistics (FtTrainer): its own to skip
            self.report.warn(f"snapshot at step {self.state.step} skipped: the batch-norm statistics are not finite")
            return
        with self.guard.slow_phase():    # it may wait for the previous write to finish
            stall = self.snapshots.save(self.state.step, self.state.state_dict((loss[0], int(loss[1]))))
        self._record("snapshot", epoch=self.state.progress(), reason=reason, snapshot_stall_s=round(stall, 6),
                     previous_write_s=round(self.snapshots.last_write_s, 4))

    # ------------------------------------------------------------ divergence

    # Whether the losses and batch-norm statistics this process checks are the job's: summed over, or
    # broadcast to, every rank (elastic), not those of one replica group of the survivor modes.
    checks_the_jobs_values = True

    def stop_if_diverged(self, loss: float, tensors: list[torch.Tensor], name: str = "loss") -> None:
        """End the run with one error line (exit 2: the launcher does not restart it) once the loss or
        the model is not finite, before it reaches a metrics row or a snapshot.

        Checked where the host reads values anyway, not in the step (app/training/step.py has no host sync): at
        each log row, where the loss comes to the host, at each evaluation, and before each snapshot.
        So a divergence is found at most --log-every-steps steps late and never after a snapshot of it:
        the newest snapshot stays the last finite one.

        Every process must decide alike, or one would stop and leave the others waiting for it in a
        collective (elastic) or recovering from its exit as from a fault (survivor modes). So only the
        job's values count: the loss summed over every rank, the statistics broadcast before a save,
        and the parameters, which every process holds the same of: DDP, and the survivor modes across
        their members, apply the same averaged gradients (a NaN in one member's gradient is in the
        average, and so in every member's weights after that step).
        """
        job_wide = self.checks_the_jobs_values
        what = diverged(loss if job_wide else None, tensors if job_wide else self.state.params, name)
        if what is None:
            self._finite_step = self.state.step
            return
        amp = "--amp false" if self.steps.numerics.amp_dtype is not None else "a longer --warmup-epochs"
        raise Diverged(f"training diverged by step {self.state.step}: {what} (finite at step {self._finite_step}); "
                       f"stopped with nothing after step {self._finite_step} saved. Try a lower --lr than "
                       f"{self.cfg.lr:g}, or {amp}")

    # ------------------------------------------------------------ the state at the last step boundary

    def _keep_step(self, why: str) -> str:
        """A just-in-time snapshot of the last completed step, written now by every node that survives.

        Every DDP replica holds the whole state, so one surviving process per snapshot directory (the
        one that claims it first) writes it, synchronously and without a collective (peers may be
        gone; the partial loss interval is this rank's alone); the others leave at once.
        """
        with self._keeping:             # the main thread and the heartbeat thread may both get here
            step = self.state.step
            if step in (self.state.loaded_step, self._kept_step):
                return "nothing new to save on this rank"
            if not self.holds_a_step_to_keep():
                return f"nothing saved: step {step} is behind the job, whose members hold a newer one"
            loss = self.state.loss()
            if diverged(loss[0], self.state.params + self.state.float_buffers):     # this rank's own: no snapshot of it
                return f"nothing saved: step {step} is not finite"
            policy = self.guard.policy      # half the budget for a claimant's write, half for this rank's own
            if not self.snapshots.claim(step, policy.rank0_first_s, policy.jit_snapshot_budget_s / 2):
                return f"step {step} is kept by another rank of this node"
            self.snapshots.save(step, self.state.state_dict(loss, at_boundary=True), background=False)
            self._kept_step = step
        # Whichever rank wrote it says so (only rank 0's Reporter speaks, and rank 0 may be gone).
        (self.report.say if self.world.is_main else functools.partial(print, flush=True))(
            f"{why}: snapshot at step {step} written")
        return f"snapshot at step {step} written by rank {self.world.rank}"
