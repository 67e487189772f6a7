"""A run that diverges stops with one error line (exit 2, not restarted), keeps its last finite
snapshot as the newest, and leaves metrics.jsonl valid JSON; every process decides alike."""
from __future__ import annotations

import json
import math
import re
from types import SimpleNamespace

import pytest
import torch

from app import train
from app.core import config
from app.ft.trainer import FtTrainer
from app.recovery import failures
from app.training import snapshot
from app.training.step_time import StepClock
from app.training.trainer import Diverged, Trainer, diverged
from tests.helpers import read_metrics, snapshot_steps

pytestmark = pytest.mark.unit

NAN = float("nan")
FINITE = [torch.ones(3, 3), torch.zeros(4)]
NOT_FINITE = [torch.ones(3, 3), torch.tensor([0.0, NAN, 1.0, 2.0])]


@pytest.mark.parametrize("loss, tensors, said", [
    (1.5, FINITE, None),
    (NAN, FINITE, "the loss is nan"),
    (math.inf, FINITE, "the loss is inf"),
    (None, FINITE, None),
    (1.5, NOT_FINITE, "the model's weights or statistics are not finite"),
    (None, [torch.ones(2), torch.tensor([-math.inf])], "the model's weights or statistics are not finite"),
    (None, [torch.full((4,), 3e38)], None),      # finite, though its 2-norm overflows
    (None, [torch.full((4,), 3e38), torch.tensor([NAN])], "the model's weights or statistics are not finite"),
])
def test_what_is_not_finite_is_named(loss, tensors, said):
    assert diverged(loss, tensors) == said


class Member:
    """What stop_if_diverged reads of a trainer: one process of a job, with its own loss and weights."""

    def __init__(self, kind: type[Trainer], weights: list[torch.Tensor]) -> None:
        self.checks_the_jobs_values = kind.checks_the_jobs_values
        self._finite_step = 0
        self.state, self.cfg = SimpleNamespace(params=weights, step=7), config.Config(lr=1e9)
        self.steps = SimpleNamespace(numerics=SimpleNamespace(amp_dtype=None))

    def stops(self, loss: float) -> bool:
        try:
            Trainer.stop_if_diverged(self, loss, self.state.params)
        except Diverged:
            return True
        return False


@pytest.mark.parametrize("weights, stop", [(FINITE, False), (NOT_FINITE, True)])
def test_members_of_the_survivor_modes_agree_on_a_nan_only_one_of_them_summed(weights, stop):
    """A replica group's loss is its own; the weights, after the same averaged gradients, are everyone's.
    Two members, one of which summed a NaN loss, stop together or go on together: neither exits alone
    for the other to recover from as from a fault."""
    members = [Member(FtTrainer, weights), Member(FtTrainer, weights)]
    assert [members[0].stops(NAN), members[1].stops(1.5)] == [stop, stop]


def test_an_elastic_job_stops_on_its_summed_loss():
    assert Member(Trainer, FINITE).stops(NAN) and not Member(Trainer, FINITE).stops(1.5)


def test_a_diverging_run_stops_at_once_and_keeps_its_last_finite_snapshot(tmp_path, synthetic_data, capsys):
    run_dir = tmp_path / "run"
    status = train.run(["--dataset", "synthetic", "--data-dir", str(synthetic_data), "--model", "tiny",
                        "--lr", "1e9", "--warmup-epochs", "0", "--epochs", "3", "--log-every-steps", "4",
                        "--save-every-steps", "1", "--keep", "100", "--run-dir", str(run_dir), "--progress", "lines"])
    out, err = capsys.readouterr()
    assert status == failures.EXIT_BAD_INPUT, out + err
    lines = err.splitlines()
    assert len(lines) == 1 and "Traceback" not in out + err, err
    said = re.fullmatch(r"error: training diverged by step (\d+): (the (?:test )?loss is (?:nan|inf)|the model's "
                        r"weights or statistics are not finite) \(finite at step (\d+)\); stopped with nothing after step \3 saved\. Try a lower "
                        r"--lr than 1e\+09, or a longer --warmup-epochs", lines[0])
    assert said, lines[0]
    stopped, finite = int(said[1]), int(said[3])
    assert 0 < finite < stopped

    def refuse(name: str) -> None:
        pytest.fail(f"metrics.jsonl holds {name}, which is not JSON")

    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        json.loads(line, parse_constant=refuse)
    # Nothing past the last finite step but the rows that describe the life (its start, where its time went).
    assert all(row["step"] <= finite for row in read_metrics(run_dir) if row["event"] not in ("start", "goodput"))
    snapshots = run_dir / "snapshots"
    assert snapshot_steps(snapshots)[-1] == finite      # saved every step: the last finite one is the newest
    for folder in snapshot.complete_snapshots(snapshots):
        weights = snapshot.read_snapshot(folder)["model"]
        assert all(t.isfinite().all() for t in weights.values() if t.is_floating_point()), folder.name


def test_a_step_that_keeps_failing_on_a_hang_leaves_its_stacks_once():
    """Across a cut link torchft's all-reduce runs out its timeout at every try of the same step: the
    first try's stacks say what the next ones would; a later step's hang leaves its own."""
    taken: list[str] = []
    trainer = SimpleNamespace(
        state=SimpleNamespace(step=41, schedule=SimpleNamespace(set_progress=lambda progress: None),
                              progress=lambda: 0.0, params=[], float_buffers=[], undo_statistics=lambda: None),
        steps=SimpleNamespace(accumulate=lambda indices, augmentation: 0.5, clock=StepClock(torch.device("cpu")),
                              optimizer=SimpleNamespace(zero_grad=lambda set_to_none: None)),
        replica=SimpleNamespace(average_gradients=lambda params, buffers: None, commit=lambda: False,
                                check_secret=lambda warn: None, errored="wait timeout after 3000ms"),
        goodput=SimpleNamespace(move=lambda *moved: None, current="train"), guard=SimpleNamespace(take_stacks=taken.append),
        report=SimpleNamespace(warn=lambda line: None), _uncommitted=0, _stacks_step=None)
    for _ in range(3):
        assert FtTrainer._step(trainer, torch.zeros(2), (), 4) is False
    trainer.state.step = 42
    assert FtTrainer._step(trainer, torch.zeros(2), (), 4) is False
    assert taken == ["step 42 not committed (wait timeout after 3000ms)", "step 43 not committed (wait timeout after 3000ms)"]
