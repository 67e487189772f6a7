"""The step loop's fast path on CPU: host syncs only where a log row or a snapshot is due, the
numerics each device gets, and the fused optimizer."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from app import job
from app.cluster.distributed import World
from app.core.config import Config, parse
from app.datasets.data import Batches, load
from app.training import models, step

pytestmark = pytest.mark.unit

SOLO = World(rank=0, local_rank=0, size=1, local_size=1, device=torch.device("cpu"), restart_count=0)


def run_digits(run_dir: Path, *flags: str) -> list[dict]:
    job.main(parse(["--dataset", "digits", "--epochs", "1", "--max-steps", "20", "--log-every-steps", "10",
                    "--save-every-steps", "0", "--progress", "lines", "--run-dir", str(run_dir), "--no-resume", *flags]))
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_collectives_come_only_with_log_rows_and_snapshots_and_carry_the_timer(tmp_path, monkeypatch):
    sizes: list[int] = []
    reduce = World.all_reduce_sum
    monkeypatch.setattr(World, "all_reduce_sum", lambda self, values: sizes.append(len(values)) or reduce(self, values))
    run_digits(tmp_path / "quiet", "--save-every-seconds", "3600")
    # Two log rows (loss, count and rank 0's timer vote in one all-reduce), then the snapshot at the stop.
    assert sizes == [3, 3, 2]
    rows = run_digits(tmp_path / "timed", "--save-every-seconds", "0.001")
    assert [(r["step"], r["reason"]) for r in rows if r["event"] == "snapshot"][:2] == [(10, "timer"), (20, "timer")]


def test_the_start_row_and_config_json_say_how_this_process_computes(tmp_path):
    start = run_digits(tmp_path, "--amp", "true")[0]
    said = {k: start[k] for k in ("backend", "device", "dtype", "memory_format")}
    assert said == {"backend": "none", "device": "cpu", "dtype": "bfloat16", "memory_format": "contiguous"}
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"


@pytest.mark.parametrize("amp, cuda, bf16, dtype", [
    (None, False, False, None),                 # auto on CPU: off
    (None, True, True, torch.bfloat16),         # auto on a GPU with bf16: on
    (None, True, False, None),                  # auto on an older GPU: off (fp16 needs asking)
    (True, True, False, torch.float16),         # asked for on an older GPU: fp16 with loss scaling
    (True, False, False, torch.bfloat16),       # asked for on CPU: bf16 autocast
    (False, True, True, None),                  # explicit false wins
])
def test_amp_auto_is_bf16_where_a_gpu_has_it(monkeypatch, amp, cuda, bf16, dtype):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    assert step._amp_dtype(amp, cuda) is dtype


def test_amp_flag_takes_auto_true_and_false():
    assert parse([]).amp is None and parse(["--amp"]).amp is True
    assert parse(["--amp", "auto"]).amp is None and parse(["--amp", "false"]).amp is False
    assert parse([], {"TRAIN_AMP": "auto"}).amp is None


def test_a_bf16_step_on_cpu_uses_the_fused_optimizer_and_learns():
    data = load("digits", Path("/nonexistent"), say=lambda line: None)
    cfg = Config(model="tiny", batch_size=32, amp=True)
    runner = step.StepRunner(cfg, SOLO, models.build("tiny", 10), Batches(data, SOLO.device, 0, False))
    assert all(group["fused"] for group in runner.optimizer.param_groups)
    indices = torch.arange(32)
    losses = []
    for _ in range(8):
        losses.append(float(runner.accumulate(indices, ())))
        runner.update()
    assert all(map(torch.isfinite, map(torch.tensor, losses))) and losses[-1] < losses[0]


def test_a_snapshot_from_before_the_fused_optimizer_resumes_with_it(tmp_path):
    """Optimizer.load_state_dict brings back the saved group's `fused` setting: this run's choice must win."""
    from app.reporting.metrics import Reporter
    from app.training.trainer import Trainer

    data = load("digits", Path("/nonexistent"), say=lambda line: None)
    cfg = Config(model="tiny", batch_size=32, run_dir=tmp_path)
    trainer = Trainer(cfg, SOLO, data, models.build("tiny", 10), Reporter(tmp_path, False, "lines"))
    parts = trainer.state.state_dict()
    for group in parts["optimizer"]["param_groups"]:
        group["fused"], group["foreach"] = None, None
    trainer.state.load_state_dict(parts)
    assert all(g["fused"] is True for g in trainer.state.optimizer.param_groups)


def test_a_step_that_did_not_count_leaves_no_mark_on_the_batch_norm_statistics(tmp_path):
    """The survivor modes take an uncommitted step again; its forward had moved the statistics (and
    counted a batch), so a member that lived through it held other statistics than one that joined at
    the same step (app/ft/trainer.py undoes them)."""
    from app.reporting.metrics import Reporter
    from app.training.trainer import Trainer

    data = load("digits", Path("/nonexistent"), say=lambda line: None)
    cfg = Config(model="tiny", batch_size=32, augment=False, run_dir=tmp_path)
    trainer = Trainer(cfg, SOLO, data, models.build("tiny", 10), Reporter(tmp_path, False, "lines"))
    before = {k: v.clone() for k, v in trainer.state.model.state_dict().items()}
    trainer.steps.accumulate(torch.arange(32), ())
    assert not torch.equal(before["1.running_mean"], trainer.state.model.state_dict()["1.running_mean"])
    trainer.state.undo_statistics()
    after = trainer.state.model.state_dict()
    assert [k for k in before if not torch.equal(before[k], after[k])] == []


def test_the_writing_rank_has_its_snapshot_arena_after_its_first_step(tmp_path):
    """The optimizer's state exists once a step is done: the arena is made then, not in the first save."""
    from app.reporting.metrics import Reporter
    from app.training.trainer import Trainer

    data = load("digits", Path("/nonexistent"), say=lambda line: None)
    cfg = Config(model="tiny", batch_size=32, run_dir=tmp_path, snapshot_dir=tmp_path / "snapshots",
                 save_every_steps=1000, save_every_seconds=0, log_every_steps=1000)
    trainer = Trainer(cfg, SOLO, data, models.build("tiny", 10), Reporter(tmp_path, False, "lines"))
    trainer.snapshots.first_in_directory = True      # restore() finds this out; this rank writes
    assert trainer.snapshots._arena is None
    trainer._train_step(torch.arange(32), trainer.batches.epoch_augmentation(0))
    trainer.after_step()
    arena = trainer.snapshots._arena
    assert arena is not None
    trainer.snapshots.save(1, trainer.state.state_dict())
    trainer.snapshots.close()
    assert trainer.snapshots._arena is arena


@pytest.fixture
def process_group_of_one():
    """This process joined a gloo group of itself, as a node of one process under torchrun is."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_world_of_one_process_trains_without_ddp_and_takes_the_steps_ddp_over_it_took(process_group_of_one):
    """A node of one process in the survivor modes (its gradients averaged across nodes by their own
    all-reduce) paid DDP's bucket copies and an all-reduce with itself every step; a world of two
    still gets DDP. The same steps as the model wrapped in DDP over the group of one, bit for bit."""
    data = load("digits", Path("/nonexistent"), say=lambda line: None)
    cfg = Config(model="tiny", batch_size=32)
    batches = Batches(data, SOLO.device, 0, False)
    pair = World(rank=0, local_rank=0, size=2, local_size=2, device=SOLO.device, restart_count=0)
    assert isinstance(step.wrap(models.build("tiny", 10), cfg, pair)[0], DDP), "a world of two is wrapped"

    torch.manual_seed(0)
    bare = step.StepRunner(cfg, SOLO, models.build("tiny", 10), batches)
    assert bare.ddp is None and bare.model is bare.raw_model
    torch.manual_seed(0)
    wrapped = step.StepRunner(cfg, SOLO, models.build("tiny", 10), batches)
    wrapped.ddp = wrapped.model = DDP(wrapped.raw_model, gradient_as_bucket_view=True, static_graph=True)
    for i in range(4):
        indices = torch.arange(32 * i, 32 * (i + 1))
        assert torch.equal(bare.accumulate(indices, ()), wrapped.accumulate(indices, ()))
        bare.update()
        wrapped.update()
    for a, b in zip(bare.raw_model.state_dict().values(), wrapped.raw_model.state_dict().values()):
        assert torch.equal(a, b)


def test_the_first_train_rows_pace_counts_from_the_first_step_not_from_the_start_up(tmp_path, monkeypatch):
    """The start-up (restoring, the start row's collectives) is the start row's startup_s; counted in
    the first row's images/s it also made bench.overhead charge it to the trainer's timed steps."""
    from app.training.trainer import Trainer
    record_start = Trainer._record_start
    monkeypatch.setattr(Trainer, "_record_start", lambda self, *a, **k: (record_start(self, *a, **k), time.sleep(2.0)))
    rows = run_digits(tmp_path)
    first = next(r for r in rows if r["event"] == "train")
    images = 10 * json.loads((tmp_path / "config.json").read_text())["config"]["batch_size"]
    assert first["images_per_s"] > images / 1.0, "ten steps of the tiny CNN take well under the 2 s slept before them"


class WaitingSpare:
    """inplace's membership while this node waits as a spare: a SIGTERM ends the wait (InPlaceGroup._spare
    raises the guard's Terminated, the signal's flag set); it writes every directory, as a lease holder."""

    def __init__(self, guard) -> None:
        self.guard = guard

    def start_step(self) -> None:
        from app.training.guard import Terminated

        self.guard.stop_requested = True
        raise Terminated()

    def writes(self, directory: Path) -> bool:
        return True

    def shutdown(self) -> None:
        pass


def test_a_spare_that_trained_before_it_was_left_out_keeps_nothing_on_sigterm(tmp_path):
    """docs/spares.md: a waiting spare stopped by SIGTERM `holds no step to keep`. One that had trained as
    a member before a round left it out (it froze, say, and came back to a full job) wrote its step, which
    the job is past, as a just-in-time snapshot: seconds of its stop, and an upload, for nothing."""
    from app.ft.trainer import FtTrainer
    from app.reporting.metrics import Reporter
    from app.training.guard import Terminated
    from app.training.trainer import Trainer

    data = load("digits", Path("/nonexistent"), say=lambda line: None)
    cfg = Config(model="tiny", batch_size=32, run_dir=tmp_path, snapshot_dir=tmp_path / "snapshots", ft="inplace",
                 save_every_steps=1000, save_every_seconds=0, log_every_steps=1000)
    trainer = FtTrainer.__new__(FtTrainer)      # its membership a stand-in: no group store
    Trainer.__init__(trainer, cfg, SOLO, data, models.build("tiny", 10), Reporter(tmp_path, False, "lines"))
    trainer.replica = trainer.writer = WaitingSpare(trainer.guard)
    (tmp_path / "snapshots").mkdir()        # as its start left it
    trainer._train_step(torch.arange(32), trainer.batches.epoch_augmentation(0))
    trainer.after_step()
    assert trainer.state.step == 1 > trainer.state.loaded_step      # it trained as a member
    with pytest.raises(Terminated):
        trainer.fit()
    assert list((tmp_path / "snapshots").glob("step-*")) == []
