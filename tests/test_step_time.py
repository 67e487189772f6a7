"""app/training/step_time.py: a step's time outside the collective wait, the steps left out of it and
why; and on two real DDP processes, the fast one's time without its wait for the slow one."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from app.training.step_time import JOIN_STEPS, StepClock


class Ticks:
    """A clock the test moves."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def step(clock: StepClock, ticks: Ticks, compute: float, waits: tuple[float, ...] = ()) -> None:
    """One step: `compute` seconds of its own, then each wait."""
    clock.begin()
    ticks.now += compute
    for wait in waits:
        clock.wait_begin()
        ticks.now += wait
        clock.wait_end()
    clock.end()


def warmed(ticks: Ticks) -> StepClock:
    clock = StepClock(torch.device("cpu"), ticks)
    for _ in range(JOIN_STEPS):
        step(clock, ticks, 1.0)
    assert clock.take() == (None, frozenset({"join"})), "a start's first steps are left out, as a join's"
    return clock


@pytest.mark.unit
def test_a_steps_time_is_its_span_less_its_waits():
    ticks = Ticks()
    clock = warmed(ticks)
    step(clock, ticks, 0.010, waits=(0.003, 0.040))       # DDP: the buffer broadcast, then the all-reduce
    step(clock, ticks, 0.020, waits=(0.030,))
    mean, flags = clock.take()
    assert mean == pytest.approx(0.015) and flags == frozenset()
    assert clock.take() == (None, frozenset()), "taken: the count starts again"
    assert clock.last_s == pytest.approx(0.020)


@pytest.mark.unit
def test_a_wait_marked_outside_a_step_or_twice_counts_nothing():
    """An evaluation's forward through DDP calls its hooks outside any step; a wait's end without its start
    (a backward without DDP's all-reduce) is none."""
    ticks = Ticks()
    clock = warmed(ticks)
    clock.wait_begin()
    ticks.now += 5.0
    clock.wait_end()
    clock.begin()
    ticks.now += 0.010
    clock.wait_end()
    clock.wait_begin()
    ticks.now += 0.020
    clock.wait_begin()
    ticks.now += 0.020
    clock.end()
    assert clock.take() == (pytest.approx(0.010), frozenset())


@pytest.mark.unit
@pytest.mark.parametrize("flag", ["eval", "epoch", "snapshot"])
def test_the_step_after_an_evaluation_an_epochs_data_or_a_snapshot_is_left_out_and_only_that_one(flag):
    ticks = Ticks()
    clock = warmed(ticks)
    clock.not_ordinary(flag)
    step(clock, ticks, 0.500)
    step(clock, ticks, 0.010)
    assert clock.take() == (pytest.approx(0.010), frozenset({flag}))


@pytest.mark.unit
def test_a_step_that_hands_a_snapshot_over_is_left_out_with_the_next_one():
    """The hand-over's stall is in the step's span (its snapshot decision is), and on a GPU the copy runs
    beside the next step."""
    ticks = Ticks()
    clock = warmed(ticks)
    clock.begin()
    ticks.now += 0.300
    clock.not_ordinary("snapshot")
    clock.end()
    step(clock, ticks, 0.200)
    step(clock, ticks, 0.010)
    assert clock.take() == (pytest.approx(0.010), frozenset({"snapshot"}))


@pytest.mark.unit
def test_a_join_leaves_out_its_first_steps_and_an_uncommitted_step_is_nothing():
    ticks = Ticks()
    clock = warmed(ticks)
    clock.not_ordinary("join")
    for _ in range(JOIN_STEPS):
        step(clock, ticks, 0.300)
    clock.begin()
    ticks.now += 0.900
    clock.cancel()
    clock.end()         # nothing begun since: no step
    step(clock, ticks, 0.010)
    assert clock.take() == (pytest.approx(0.010), frozenset({"join"}))


# ---------------------------------------------------------------- two DDP processes

class Slowed(nn.Module):
    """The tiny CNN (batch norm: DDP broadcasts its buffers before each forward), slowed on one rank by
    `delay` seconds of its own in each forward, as a node with a cut CPU quota is."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        from app.training import models
        self.inner, self.delay = models.build("tiny", 10), delay

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.delay)
        return self.inner(x)


def _ddp_rank(rank: int, slow: int, store_file: str, out: str) -> None:
    from app.cluster.distributed import World
    from app.core.config import Config
    from app.datasets.data import Batches, load
    from app.training.step import StepRunner

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=2)
    world = World(rank=rank, local_rank=rank, size=2, local_size=2, device=torch.device("cpu"), restart_count=0)
    data = load("digits", Path("/nonexistent"), say=lambda line: None)
    runner = StepRunner(Config(model="tiny", batch_size=16), world, Slowed(0.05 if rank == slow else 0.0),
                        Batches(data, world.device, 0, False))
    walls = []
    for i in range(JOIN_STEPS + 6):
        began = time.perf_counter()
        runner.clock.begin()
        runner.accumulate(torch.arange(16 * i, 16 * (i + 1)), ())
        runner.update()
        runner.clock.end()
        walls.append(time.perf_counter() - began)
    compute, _ = runner.clock.take()
    Path(out).write_text(json.dumps({"compute_s": compute, "wall_s": sorted(walls[JOIN_STEPS:])[3]}))
    dist.destroy_process_group()


@pytest.mark.multiprocess
@pytest.mark.parametrize("slow", [0, 1], ids=["rank0-slow-others-wait-at-the-broadcast", "rank1-slow"])
def test_on_ddp_the_fast_rank_publishes_its_own_time_not_its_wait_for_the_slow_one(tmp_path, slow):
    """Each step of both ranks takes the slow one's 50 ms of wall time; the fast one's own time (outside
    DDP's buffer broadcast and gradient all-reduce) stays a fraction of it."""
    outs = [str(tmp_path / f"rank{r}.json") for r in range(2)]
    mp.spawn(_ddp_rank_main, args=(slow, str(tmp_path / "store"), outs), nprocs=2, join=True)
    said = [json.loads(Path(o).read_text()) for o in outs]
    fast = said[1 - slow]
    assert said[slow]["compute_s"] >= 0.05 and fast["wall_s"] >= 0.05, said
    assert fast["compute_s"] < 0.5 * said[slow]["compute_s"], said


def _ddp_rank_main(rank: int, slow: int, store_file: str, outs: list[str]) -> None:
    _ddp_rank(rank, slow, store_file, outs[rank])


# ---------------------------------------------------------------- on a GPU (skipped without one)

@pytest.mark.unit
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: the step clock's CUDA events")
def test_on_a_gpu_the_clock_and_the_shared_pace_never_sync_and_leave_the_wait_out():
    """With torch's sync debug mode set to raise, steps marked with CUDA events and their times riding an
    all-reduce's tail (app/ft/pace.py) run without one host sync; the device's own wait (a 50-70 ms spin
    between wait_begin and wait_end, as a stream waiting on NCCL) is left out of the step's time."""
    from app.ft.pace import SharedPace
    from app.recovery.slow import SlowWatch

    device = torch.device("cuda")
    model = nn.Linear(1024, 1024).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    clock = StepClock(device)
    fed: list[list[tuple]] = []
    watch = SlowWatch(2.0, 10.0, 0.0, lambda line: None)
    watch.feed = lambda now, samples: fed.append(list(samples))      # what the all-reduce brought, once a round
    pace = SharedPace(clock.take, lambda: watch, device)
    spin = 100_000_000      # cycles: 50-70 ms at a GPU's 1.4-2 GHz
    began = time.perf_counter()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(JOIN_STEPS + 40):
            clock.begin()
            model(torch.randn(512, 1024, device=device)).square().mean().backward()
            clock.wait_begin()
            torch.cuda._sleep(spin)
            clock.wait_end()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            clock.end()
            tail = torch.zeros(SharedPace.numbers(2), device=device)
            pace.put(tail, 0)
            pace.got(tail, ["this", "other"])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    span = (time.perf_counter() - began) / (JOIN_STEPS + 40)
    assert clock.last_s is not None and clock.last_s < 0.5 * span, (clock.last_s, span)
    assert fed and fed[-1][0][0] == "this" and fed[-1][0][1] is not None, fed[-3:]
