"""The training loop: epochs of steps (app/step.py), evaluation (app/evaluate.py), logs and snapshots."""
from __future__ import annotations

import functools
import math
import os
import random
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import torch
from torch import nn

from app.config import Config
from app.data import Batches, Data, ResumableSampler
from app.distributed import World
from app.errors import UserError
from app.evaluate import evaluate
from app.goodput import Account, describe, job_account
from app.metrics import Reporter, done_line, read
from app.optim import WarmupCosine
from app.recovery.guard import FaultGuard
from app.snapshot import Snapshots, State
from app.startup import StartupClock
from app.step import StepRunner, peak_memory_mb


class Diverged(UserError):
    """The loss or the weights went non-finite: the settings cannot train this model (bad input, exit 2),
    which restarting cannot mend; not a fault to recover from."""


def diverged(loss: float | None, tensors: Sequence[torch.Tensor], name: str = "loss") -> str | None:
    """What is not finite, the loss (None: not looked at) or any of the tensors; None if nothing.
    One reduction on the device and one read."""
    if loss is not None and not math.isfinite(loss):
        return f"the {name} is {loss}"
    if tensors and not bool(torch.stack(torch._foreach_norm(list(tensors), math.inf)).isfinite().all()):
        return "the model's weights or statistics are not finite"
    return None


@dataclass
class TrainState:
    epoch: int = 0            # epochs completed
    step: int = 0             # optimizer steps completed, in total
    consumed: int = 0         # samples of the current epoch trained on, by all ranks together
    loss_sum: float = 0.0     # training loss summed over micro-batches since the last log line
    loss_count: int = 0       # micro-batches in loss_sum
    test_acc: float | None = None


class Trainer:
    def __init__(self, cfg: Config, world: World, data: Data, model: nn.Module, reporter: Reporter) -> None:
        self.cfg, self.world, self.data, self.report = cfg, world, data, reporter
        self.batches = Batches(data, world.device, cfg.seed, cfg.augment)
        self.steps = StepRunner(cfg, world, model, self.batches)
        self.raw_model, self.optimizer, self.scaler = self.steps.raw_model, self.steps.optimizer, self.steps.scaler
        self.schedule = WarmupCosine(self.optimizer, cfg.lr, cfg.warmup_epochs, cfg.epochs)
        self.sampler = ResumableSampler(len(data.train), world.size, world.rank, cfg.seed)
        self.snapshots = Snapshots(cfg, world, reporter.say, reporter.warn)
        self.state = TrainState()
        self._loss_acc = torch.zeros((), device=world.device)
        self._params = [p for p in self.raw_model.parameters() if p.requires_grad]
        self.guard = FaultGuard(world, cfg.fault_policy(), self._keep_step, cfg.run_dir, self._leaving)
        self._interval_start = time.perf_counter()
        self._interval_steps = 0
        self._steps_this_start = 0      # steps since this process started (compile warm-up)
        self._images_this_start = 0     # images trained on since then, by all processes together
        self._keeping = threading.Lock()    # one just-in-time snapshot at a time
        self._kept_step: int | None = None
        saved = self.raw_model.state_dict().keys()      # persistent buffers only
        self._live_buffers = {name: b for name, b in self.raw_model.named_buffers() if name in saved}
        self._boundary_buffers = {name: b.detach().clone() for name, b in self._live_buffers.items()}
        self._float_buffers = [b for b in self._live_buffers.values() if b.is_floating_point()]
        self._restored_step = 0         # where this incarnation started: nothing to save before it
        self._finite_step = 0           # the last step found finite (_stop_if_diverged)
        self._redo_until: int | None = None     # steps up to this one were trained before (rank 0 knows)
        self.job_size = world.size      # processes training together (torchft mode: of this step's quorum)
        self.goodput = Account(time.time(), 0.0)    # replaced once restored (restore): with the start-up
        self._stepped_at = time.perf_counter()      # the last step boundary, for the goodput account

    # ------------------------------------------------------------ public

    def restore(self, clock: StartupClock) -> None:
        """Continue from the newest valid snapshot, if the config allows and one exists."""
        fresh_allowed = self.world.restart_count == 0   # an elastic restart always resumes
        trained_to = self._trained_to()
        parts = self.snapshots.restore(self.cfg.resume, fresh_allowed, trained_to)
        if parts is not None:
            self._load(parts)
        self._restored_step = self._finite_step = self.state.step
        clock.mark("snapshot")          # read on one node, broadcast, loaded
        if trained_to is not None and trained_to > self.state.step:
            self._redo_until = trained_to
        self.guard.arm()
        self._record_start(clock, resumed=parts is not None)
        self.goodput = Account(clock.started, time.time() - clock.started)    # start-up: up to here

    def _trained_to(self) -> int | None:
        """How far this run directory's metrics say the job trained: a fresh start behind it loses steps."""
        return self.report.last_step()

    def _record_start(self, clock: StartupClock, resumed: bool) -> None:
        """One row per incarnation of the job: where it starts, on which world, computing how, and which
        node has which host GPUs (NODE_ADDR and NODE_GPUS come from the container entrypoint)."""
        nodes = self.world.gather_object((os.environ.get("NODE_ADDR"), os.environ.get("NODE_GPUS")))
        self.report.record("start", step=self.state.step, epoch=self._progress(), world_size=self.job_size,
                           restart_count=self.world.restart_count, resumed=resumed,
                           master_addr=os.environ.get("MASTER_ADDR"),
                           node_gpus={addr: gpus for addr, gpus in nodes if addr and gpus} or None,
                           process_started=round(clock.started, 3), startup_s=clock.seconds(),
                           threads=torch.get_num_threads(),
                           **self.steps.numerics.describe())

    def fit(self) -> None:
        """Train to the end; a lost peer or SIGTERM keeps the last step and ends the rank (app/recovery/guard.py)."""
        started = time.perf_counter()
        self.goodput.switch("redo" if self._redo_until is not None else "train")
        ended = "fault"
        try:
            try:
                self._run_epochs()
            except Diverged:
                raise       # every rank found it at the same point: no peer is lost, no step to keep
            except Exception as exc:
                self._fault_found()
                self.guard.after_failure(exc)
            self.guard.stop_if_requested()
            if self.state.consumed:         # --max-steps stopped it inside an epoch
                self._save(self.snapshots.due(self.state.step, stopping=True))
            ended = "done"
        finally:
            self.guard.disarm()
            with self.goodput.phase("snapshot"):
                self.snapshots.wait()       # the final write is never cut off
            self._record_goodput(ended if not self.guard.stop_requested else "stopped")
        self.snapshots.raise_if_failed()
        if self.state.epoch >= self.cfg.epochs:
            self.report.say(done_line(self.cfg.epochs, self.state.step, self.state.test_acc, self._images_this_start,
                                      time.perf_counter() - started) + "; "
                            + describe(job_account(read(self.report.path)) if self.report.active else None))

    def _leaving(self, final: bool) -> None:
        """The guard's hook when the heartbeat thread ends this process: the fault found, then (final) the row."""
        if final:
            self._record_goodput("fault")
        else:
            self._fault_found()

    def _fault_found(self) -> None:
        """From the last step boundary on, the time went to a lost peer (the step in flight never counts)."""
        self.goodput.switch("peer_wait", since=self._stepped_at)

    def _record_goodput(self, ended: str) -> None:
        """This life's goodput row (rank 0's Reporter writes it): at its end, or on its way out after a fault."""
        self.goodput.switch(None)
        self.report.record("goodput", step=self.state.step, epoch=self._progress(), world_size=self.job_size,
                           restart_count=self.world.restart_count, ended=ended, **self.goodput.row())

    # ------------------------------------------------------------ epoch

    def _run_epochs(self) -> None:
        while self.state.epoch < self.cfg.epochs and not self._stopping():
            if self._train_epoch():
                self._end_epoch()

    def _train_epoch(self) -> bool:
        """Train on what is left of the current epoch; False if stopped before its end."""
        self.sampler.set_position(self.state.epoch, self.state.consumed)
        # Made on the device once per epoch: a step then slices it, with no host-to-device copy (a sync).
        indices = self.sampler.indices(self.world.device)
        augmentation = self.batches.epoch_augmentation(self.state.epoch)
        per_step = self.cfg.batch_size * self.cfg.grad_accum
        for start in range(0, len(indices) - per_step + 1, per_step):
            self._train_step(indices[start:start + per_step], augmentation)
            self._after_step()
            if self._stopping():
                return False
        return True

    def _end_epoch(self) -> None:
        self.state.epoch += 1
        self.state.consumed = 0
        last = self.state.epoch == self.cfg.epochs
        if last or self.state.epoch % self.cfg.eval_every_epochs == 0:
            self._evaluate()
        self._save(self.snapshots.due(self.state.step, epoch_end=True))

    def _stopping(self) -> bool:
        return self.guard.stop_requested or (0 < self.cfg.max_steps <= self.state.step)

    # ------------------------------------------------------------ step

    def _train_step(self, indices: torch.Tensor, augmentation: tuple[torch.Tensor, ...]) -> None:
        self.schedule.set_progress(self._progress())
        step_loss = self.steps.accumulate(indices, augmentation)
        self._count_step(step_loss, len(indices) * self.job_size)

    def _count_step(self, step_loss: torch.Tensor, samples: int) -> None:
        """Update the weights and count the step: `samples` trained on by all processes together."""
        with self.guard.updating:     # a just-in-time snapshot from the heartbeat thread waits for this
            self.steps.update()
            # Only a completed step counts, so that a failure inside the next one leaves a clean boundary.
            self._loss_acc += step_loss
            self.state.loss_count += self.cfg.grad_accum
            self.state.step += 1
            self.state.consumed += samples
            self._keep_boundary_buffers()
        self._interval_steps += 1
        self._steps_this_start += 1
        self._images_this_start += samples

    def _take_loss(self) -> float:
        """Move this rank's device-side loss sum into the train state (one host sync)."""
        self.state.loss_sum += float(self._loss_acc)
        self._loss_acc.zero_()
        return self.state.loss_sum

    def _after_step(self) -> None:
        step = self.state.step
        if self.cfg.compile and self._steps_this_start == 1:
            self._restart_interval()        # the first step compiles: not training throughput
        self.guard.stepped()
        self._stepped_at = time.perf_counter()
        if self._redo_until is not None and step >= self._redo_until:
            self._redo_until = None         # back where the job had trained to: steps count again
            self.goodput.switch("train")
        timer = self._log() if step % self.cfg.log_every_steps == 0 else False
        self._save(self.snapshots.due(step, timer=timer))
        self.report.advance(step, epoch=self.state.epoch)

    # ------------------------------------------------------------ logging and evaluation

    def _log(self) -> bool:
        """All-reduce the interval's loss, with rank 0's snapshot-timer vote riding along, and write one
        metrics line; returns the agreed vote (a timed snapshot is due), the same on every rank."""
        loss_sum, count, timer = self.world.all_reduce_sum([self._take_loss(), self.state.loss_count,
                                                            self.snapshots.timer_vote()])
        self.state.loss_sum, self.state.loss_count = 0.0, 0
        self._stop_if_diverged(loss_sum, self._params)
        self._record_train(loss_sum / max(count, 1))
        return timer > 0

    def _record_train(self, loss: float, **extra: Any) -> None:
        elapsed = time.perf_counter() - self._interval_start
        images = self._interval_steps * self.cfg.batch_size * self.cfg.grad_accum * self.job_size
        self.report.record("train", step=self.state.step, epoch=self._progress(), loss=loss,
                           lr=self.optimizer.param_groups[0]["lr"], test_acc=self.state.test_acc,
                           images_per_s=images / elapsed if images else None, world_size=self.job_size,
                           restart_count=self.world.restart_count,
                           peak_memory_mb=round(peak_memory_mb(self.world.device), 1), **extra)
        self._restart_interval()

    def _restart_interval(self) -> None:
        self._interval_start, self._interval_steps = time.perf_counter(), 0

    @torch.no_grad()
    def _evaluate(self) -> None:
        """Every rank scores its shard of the test set; the counts are summed across ranks."""
        with self.guard.slow_phase(), self.goodput.phase("eval"):
            self._score_test_set()
        self._restart_interval()            # evaluation time is not training throughput

    def _score_test_set(self) -> None:
        self.state.test_acc, loss = evaluate(self.raw_model, self.batches, self.world, 2 * self.cfg.batch_size,
                                             self.steps.autocast)
        self._stop_if_diverged(loss, self._params, name="test loss")
        self.report.record("eval", step=self.state.step, epoch=float(self.state.epoch), test_acc=self.state.test_acc,
                           test_loss=loss, world_size=self.job_size,
                           restart_count=self.world.restart_count, lr=self.optimizer.param_groups[0]["lr"])

    # ------------------------------------------------------------ snapshots

    def _save(self, reason: str | None) -> None:
        """A snapshot, when one is due (reason from Snapshots.due), at a point every rank agrees on:
        the loss accumulators are summed first."""
        if reason is None:
            return
        with self.goodput.phase("snapshot"):
            self._save_now(reason)

    def _save_now(self, reason: str) -> None:
        loss_sum, count = self.world.all_reduce_sum([self._take_loss(), self.state.loss_count])
        self.world.broadcast_buffers(self.raw_model)     # every node's copy of this step is the same
        self._stop_if_diverged(loss_sum, self._params + self._float_buffers)
        if not self.snapshots.is_writer:
            return
        if diverged(None, self._float_buffers):   # a replica group's own statistics (FtTrainer): its own to skip
            self.report.warn(f"snapshot at step {self.state.step} skipped: the batch-norm statistics are not finite")
            return
        with self.guard.slow_phase():    # it may wait for the previous write to finish
            stall = self.snapshots.save(self.state.step, self._parts(loss_sum, int(count)))
        self.report.record("snapshot", step=self.state.step, epoch=self._progress(), reason=reason,
                           snapshot_stall_s=round(stall, 6), previous_write_s=round(self.snapshots.last_write_s, 4),
                           world_size=self.job_size, restart_count=self.world.restart_count)

    # ------------------------------------------------------------ divergence

    # Whether the losses and batch-norm statistics this process checks are the job's: summed over, or
    # broadcast to, every rank (elastic), not those of one replica group of the survivor modes.
    checks_the_jobs_values = True

    def _stop_if_diverged(self, loss: float, tensors: list[torch.Tensor], name: str = "loss") -> None:
        """End the run with one error line (exit 2: the launcher does not restart it) once the loss or
        the model is not finite, before it reaches a metrics row or a snapshot.

        Checked where the host reads values anyway, not in the step (app/step.py has no host sync): at
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
        what = diverged(loss if job_wide else None, tensors if job_wide else self._params, name)
        if what is None:
            self._finite_step = self.state.step
            return
        amp = "--amp false" if self.steps.numerics.amp_dtype is not None else "a longer --warmup-epochs"
        raise Diverged(f"training diverged by step {self.state.step}: {what} (finite at step {self._finite_step}); "
                       f"stopped with nothing after step {self._finite_step} saved. Try a lower --lr than "
                       f"{self.cfg.lr:g}, or {amp}")

    def _parts(self, loss_sum: float, loss_count: int, at_boundary: bool = False) -> State:
        train_state = {**asdict(self.state), "loss_sum": loss_sum, "loss_count": loss_count,
                       "world_size": self.job_size, "config": self.cfg.to_dict(), "rng": _rng_state()}
        model = self.raw_model.state_dict()
        if at_boundary and self.state.step > self._restored_step:
            model.update(self._boundary_buffers)
        return {"model": model, "optimizer": self.optimizer.state_dict(),
                "scheduler": self.schedule.state_dict(), "scaler": self.scaler.state_dict(),
                "train_state": train_state}

    def _check_same_run(self, saved: dict[str, Any]) -> None:
        for key in ("model", "dataset"):
            if saved[key] != getattr(self.cfg, key) and not (key == "dataset" and self.cfg.dataset == "auto"):
                raise UserError(f"the snapshot was made with --{key} {saved[key]}, this run asks for "
                                f"--{key} {getattr(self.cfg, key)}; use another --snapshot-dir or --no-resume")

    def _load(self, parts: State) -> None:
        ts = parts["train_state"]
        self._check_same_run(ts["config"])
        # load_state_dict restores each group's kernel choice too: keep this run's (a snapshot from
        # before the fused optimizer would otherwise bring back the per-parameter loop).
        kernels = [{k: g[k] for k in ("fused", "foreach") if k in g} for g in self.optimizer.param_groups]
        try:
            self.raw_model.load_state_dict(parts["model"])
            self.optimizer.load_state_dict(parts["optimizer"])
        except (RuntimeError, ValueError, KeyError) as exc:
            raise UserError(f"the snapshot does not fit this model: {str(exc).splitlines()[0]}") from None
        for group, kernel in zip(self.optimizer.param_groups, kernels):
            group.update(kernel)
        self.schedule.load_state_dict(parts["scheduler"])
        self.scaler.load_state_dict(parts["scaler"])
        self.state = TrainState(**{k: ts[k] for k in asdict(TrainState())})
        # The sums are global: give them to rank 0 alone so the next all-reduce counts them once.
        if not self.world.is_main:
            self.state.loss_sum, self.state.loss_count = 0.0, 0
        _set_rng_state(ts["rng"])
        if ts["world_size"] != self.job_size:
            self.report.say(f"world size changed {ts['world_size']} -> {self.job_size}: the rest of epoch "
                            f"{self.state.epoch} is dealt out anew in the same global order")
        self.report.say(f"resumed at epoch {self.state.epoch}, step {self.state.step}, "
                        f"{self.state.consumed} samples into the epoch")

    # ------------------------------------------------------------ the state at the last step boundary

    def _keep_step(self, why: str) -> str:
        """A just-in-time snapshot of the last completed step, written now by every node that survives.

        Every DDP replica holds the whole state, so one surviving process per snapshot directory (the
        one that claims it first) writes it, synchronously and without a collective (peers may be
        gone; the partial loss interval is this rank's alone); the others leave at once.
        """
        with self._keeping:             # the main thread and the heartbeat thread may both get here
            step = self.state.step
            if step in (self._restored_step, self._kept_step):
                return "nothing new to save on this rank"
            loss = self._take_loss()
            if diverged(loss, self._params + self._float_buffers):     # this rank's own: no snapshot of it
                return f"nothing saved: step {step} is not finite"
            if not self.snapshots.claim(step, self.guard.policy.rank0_first_s):
                return f"step {step} is kept by another rank of this node"
            self.snapshots.save(step, self._parts(loss, self.state.loss_count, at_boundary=True), background=False)
            self._kept_step = step
        # Whichever rank wrote it says so (only rank 0's Reporter speaks, and rank 0 may be gone).
        (self.report.say if self.world.is_main else functools.partial(print, flush=True))(
            f"{why}: snapshot at step {step} written")
        return f"snapshot at step {step} written by rank {self.world.rank}"

    def _keep_boundary_buffers(self) -> None:
        """Batch-norm statistics as they are at this step boundary: the next step's forward changes
        them before its backward can fail, and a just-in-time snapshot must be the boundary's."""
        if self._boundary_buffers:
            torch._foreach_copy_(list(self._boundary_buffers.values()), list(self._live_buffers.values()))

    # ------------------------------------------------------------ helpers

    def _progress(self) -> float:
        return self.state.epoch + self.state.consumed / len(self.data.train)


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": list(random.getstate()[1])}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate((3, tuple(state["python"]), None))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
