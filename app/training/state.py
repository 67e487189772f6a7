"""The training state: everything a job goes on from at a step boundary, and the one owner of its layout.

A snapshot's files hold it (app/training/snapshot.py), and a replica group or member that is behind copies it
from a live one (app/ft/transport.py in torchft mode, app/ft/inplace.py in inplace mode): all of them
carry what `TrainingState.state_dict()` gives and hand it back to `load_state_dict()`; nothing else
reads its keys. Its parts, one file each in a snapshot (PARTS):

    model        the weights and the persistent buffers (batch-norm statistics)
    optimizer    the optimizer's state
    scheduler    the learning-rate schedule
    scaler       the fp16 loss scaler
    train_state  the Position's fields, the world size, the config and the RNG states
"""
from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

from app.cluster.distributed import World
from app.core.config import Config
from app.core.errors import UserError
from app.training.optim import WarmupCosine

if TYPE_CHECKING:       # app/training/snapshot.py reads PARTS without the step's imports
    from app.training.step import StepRunner

PARTS = ("model", "optimizer", "scheduler", "scaler", "train_state")
State = dict[str, Any]      # the state in its saved form: state_dict()'s parts by name


@dataclass
class Position:
    """Where the training is, with the counters that go on from there (the `train_state` part's own)."""
    epoch: int = 0            # epochs completed
    step: int = 0             # optimizer steps completed, in total
    consumed: int = 0         # samples of the current epoch trained on, by all ranks together
    loss_sum: float = 0.0     # training loss summed over micro-batches since the last log line
    loss_count: int = 0       # micro-batches in loss_sum
    test_acc: float | None = None


def step_of(parts: State) -> int:
    """The step a state in its saved form is at."""
    return parts["train_state"]["step"]


class TrainingState:
    """The model, optimizer, schedule, scaler, RNG and position of one process, and the batch-norm
    statistics as they were at the last step boundary (a just-in-time snapshot must be the boundary's)."""

    def __init__(self, cfg: Config, world: World, steps: StepRunner, epoch_size: int,
                 say: Callable[[str], None]) -> None:
        self.cfg, self.world, self.say, self.epoch_size = cfg, world, say, epoch_size
        self.model, self.optimizer, self.scaler = steps.raw_model, steps.optimizer, steps.scaler
        self.schedule = WarmupCosine(self.optimizer, cfg.lr, cfg.warmup_epochs, cfg.epochs)
        self.position = Position()
        self.world_size = world.size    # processes training together (survivor modes: of this step's quorum)
        self.loaded_step = 0            # where the state last came from elsewhere: nothing new to keep there
        # inplace mode: the generation this state was last trained in (app/ft/protocol.py's lineage_of), kept
        # in snapshots so that a member loading one knows which line of the job it continues; "": none.
        self.lineage = ""
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self._loss = torch.zeros((), device=world.device)      # the step's loss, summed on the device
        saved = self.model.state_dict().keys()          # persistent buffers only
        self._live_buffers = {name: b for name, b in self.model.named_buffers() if name in saved}
        self._boundary_buffers = {name: b.detach().clone() for name, b in self._live_buffers.items()}
        self.float_buffers = [b for b in self._live_buffers.values() if b.is_floating_point()]

    def relocate(self, steps: StepRunner, device: torch.device) -> None:
        """After the model moved to another GPU (StepRunner.relocate): the new buffers and scaler, and this
        state's own tensors there."""
        self.scaler = steps.scaler
        self._loss = self._loss.to(device)
        saved = self.model.state_dict().keys()
        self._live_buffers = {name: b for name, b in self.model.named_buffers() if name in saved}
        self._boundary_buffers = {name: b.to(device) for name, b in self._boundary_buffers.items()}
        self.float_buffers = [b for b in self._live_buffers.values() if b.is_floating_point()]

    @property
    def step(self) -> int:
        return self.position.step

    def progress(self) -> float:
        """Epochs trained, with the fraction of the current one."""
        return self.position.epoch + self.position.consumed / self.epoch_size

    def samples(self, train_state: dict | None = None) -> int:
        """Samples trained on, all processes together: this state's, or a saved one's `train_state`."""
        p = self.position if train_state is None else Position(**{k: train_state[k] for k in asdict(Position())})
        return p.epoch * self.epoch_size + p.consumed

    # ------------------------------------------------------------ counting

    def count_step(self, step_loss: torch.Tensor, micro_batches: int, samples: int) -> None:
        """A completed step: its loss added on the device (no host sync), the step and its `samples`
        (all processes together) counted, the batch-norm statistics kept as they are at this boundary."""
        self._loss += step_loss
        self.position.loss_count += micro_batches
        self.position.step += 1
        self.position.consumed += samples
        self._keep_boundary_buffers()

    def end_epoch(self) -> None:
        self.position.epoch += 1
        self.position.consumed = 0

    def loss(self) -> tuple[float, int]:
        """This rank's loss sum and micro-batch count since the last log line (one host sync)."""
        self.position.loss_sum += float(self._loss)
        self._loss.zero_()
        return self.position.loss_sum, self.position.loss_count

    def reset_loss(self) -> None:
        """A log line has reported the sums: the next one starts from nothing."""
        self.position.loss_sum, self.position.loss_count = 0.0, 0

    def undo_statistics(self) -> None:
        """A step that did not count (survivor modes): its forward moved the batch-norm statistics, back
        to the last boundary's. So every member at a step holds that step's statistics, the integer
        counters (num_batches_tracked, which the average leaves out) included."""
        if self._boundary_buffers:
            torch._foreach_copy_(list(self._live_buffers.values()), list(self._boundary_buffers.values()))

    def _keep_boundary_buffers(self) -> None:
        """The next step's forward changes the statistics before its backward can fail."""
        if self._boundary_buffers:
            torch._foreach_copy_(list(self._boundary_buffers.values()), list(self._live_buffers.values()))

    # ------------------------------------------------------------ the saved form

    def state_dict(self, loss: tuple[float, int] = (0.0, 0), at_boundary: bool = False) -> State:
        """The state by part. `loss`: the open log interval's sum and count to save with it (a live
        copy leaves them to the group that trained them); `at_boundary`: the batch-norm statistics
        of the last step boundary, not the live ones."""
        train_state = {**asdict(self.position), "loss_sum": loss[0], "loss_count": loss[1],
                       "world_size": self.world_size, "config": self.cfg.to_dict(), "rng": _rng_state(),
                       "lineage": self.lineage}
        model = self.model.state_dict()
        if at_boundary:
            model.update(self._boundary_buffers)
        return {"model": model, "optimizer": self.optimizer.state_dict(),
                "scheduler": self.schedule.state_dict(), "scaler": self.scaler.state_dict(),
                "train_state": train_state}

    def load_state_dict(self, parts: State) -> None:
        """Go on from `parts` (a snapshot's, or a live group's); says where, and what changed."""
        ts = parts["train_state"]
        self._check_same_run(ts["config"])
        self._load_modules(parts)
        self.position = Position(**{k: ts[k] for k in asdict(Position())})
        self.lineage = ts.get("lineage", "")        # snapshots from before lineages: none
        # The sums are global: give them to rank 0 alone so the next all-reduce counts them once.
        if not self.world.is_main:
            self.reset_loss()
        _set_rng_state(ts["rng"])
        self.loaded_step = self.position.step
        self._keep_boundary_buffers()
        self._say_loaded(ts["world_size"])

    def _load_modules(self, parts: State) -> None:
        # load_state_dict restores each group's kernel choice too: keep this run's (a snapshot from
        # before the fused optimizer would otherwise bring back the per-parameter loop).
        kernels = [{k: g[k] for k in ("fused", "foreach") if k in g} for g in self.optimizer.param_groups]
        try:
            self.model.load_state_dict(parts["model"])
            self.optimizer.load_state_dict(parts["optimizer"])
        except (RuntimeError, ValueError, KeyError) as exc:
            raise UserError(f"the snapshot does not fit this model: {str(exc).splitlines()[0]}") from None
        for group, kernel in zip(self.optimizer.param_groups, kernels):
            group.update(kernel)
        self.schedule.load_state_dict(parts["scheduler"])
        self.scaler.load_state_dict(parts["scaler"])

    def _check_same_run(self, saved: dict[str, Any]) -> None:
        for key in ("model", "dataset"):
            if saved[key] != getattr(self.cfg, key) and not (key == "dataset" and self.cfg.dataset == "auto"):
                raise UserError(f"the snapshot was made with --{key} {saved[key]}, this run asks for "
                                f"--{key} {getattr(self.cfg, key)}; use another --snapshot-dir or --no-resume")

    def _say_loaded(self, saved_world_size: int) -> None:
        p = self.position
        if saved_world_size != self.world_size:
            self.say(f"world size changed {saved_world_size} -> {self.world_size}: the rest of epoch "
                     f"{p.epoch} is dealt out anew in the same global order")
        self.say(f"resumed at epoch {p.epoch}, step {p.step}, {p.consumed} samples into the epoch")


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
