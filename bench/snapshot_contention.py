"""What a snapshot costs the training steps that run beside it, whole and part by part.

    python -m bench.snapshot_contention              # on a GPU host: ResNet-18, 512 images, bf16
    python -m bench.snapshot_contention --batch-size 32 --steps 20     # a CPU host
    python -m bench.snapshot_contention --batch-size 32 --steps 10 --saver-only     # the trainer's way alone

The trainer copies each snapshot into shared memory and hands it to its saver process
(app/training/saver.py), which serialises, hashes and writes it while the training goes on. Before
the saver, a writer thread in the training process did that, and on one H200 the steps beside it
ran a third slower (docs/gpu.md): `torch.save` holds the interpreter lock. A ResNet-18 trains in
this process; each row runs one piece of work beside it: the parts of the old thread's write, the
old thread's whole write, and the saver's whole write (the copy into shared memory on the training
thread, as the trainer does it, then the hand-over). The table gives each one's time alone and
the training steps' time while it runs (steps_beside), against steps with nothing beside them. `python spin` is
pure Python, which holds the lock throughout. On a CPU host the training runs on one core with one
thread, and the writer (thread or saver process) on another, so that only the interpreter lock and
memory are shared. Nothing is written to disk but temporary files.
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from app.training import models
from app.training.saver import Saver
from app.training.snapshot import map_tensors, stage
from app.training.snapshot_files import fsync_dir, write_file
from app.training.state import PARTS


class Loop:
    """A ResNet-18 step on one fixed random batch, as the trainer's step runs it on this device."""

    def __init__(self, batch_size: int) -> None:
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.cuda = self.device.type == "cuda"
        layout = torch.channels_last if self.cuda else torch.contiguous_format
        self.model = models.build("resnet18", 10).to(self.device, memory_format=layout)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9, fused=self.cuda)
        self.x = torch.randn(batch_size, 3, 32, 32, device=self.device).to(memory_format=layout)
        self.y = torch.randint(0, 10, (batch_size,), device=self.device)
        self.loss = nn.CrossEntropyLoss()

    def step(self) -> None:
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cuda):
            loss = self.loss(self.model(self.x), self.y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def parts(self) -> dict:
        """The parts a snapshot writes, as the trainer's state has them (on the device)."""
        state = {"model": self.model.state_dict(), "optimizer": self.opt.state_dict()}
        return {name: state.get(name, {"step": 1}) for name in PARTS}


def parts_of_a_write(parts: dict, data: bytes, writer_cores: set[int] | None) -> dict[str, Callable[[], None]]:
    """Each part of the old writer thread's write on its own (`data`: `parts` serialised), and the
    whole of it, each pinned to the writer's cores."""
    def serialise() -> None:
        torch.save(parts, io.BytesIO())

    def write_and_fsync() -> None:
        with tempfile.NamedTemporaryFile() as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    def thread_write() -> None:
        """What the writer thread did before the saver: torch.save, sha256, write and fsync each part."""
        with tempfile.TemporaryDirectory() as folder:
            for name in PARTS:
                buf = io.BytesIO()
                torch.save(parts[name], buf)
                write_file(Path(folder) / f"{name}.pt", buf.getvalue())
            fsync_dir(Path(folder))

    def python_spin() -> None:
        end = time.perf_counter() + 0.3
        while time.perf_counter() < end:
            sum(range(1000))

    work = {"torch.save to memory": serialise, "sha256": lambda: hashlib.sha256(data).hexdigest(),
            "write + fsync": write_and_fsync, "writer thread (before)": thread_write, "python spin": python_spin}
    return {name: _pinned(fn, writer_cores) for name, fn in work.items()}


def _pinned(work: Callable[[], None], cores: set[int] | None) -> Callable[[], None]:
    def run() -> None:
        if cores:
            os.sched_setaffinity(0, cores)      # 0: the calling thread alone
        work()
    return run


class SaverWrite:
    """The trainer's way: the state copied into shared memory on the training thread, then the
    saver process writes it while a thread waits for its answer."""

    def __init__(self, loop: "Loop", folder: Path, writer_cores: set[int] | None) -> None:
        self.loop, self.folder, self.arena = loop, folder, None
        self.saver = Saver(print)
        self.saver.start()
        if writer_cores:
            os.sched_setaffinity(self.saver.process.pid, writer_cores)
        self.step = 0

    def first(self) -> Callable[[], None]:
        """On the training thread: the copy (the trainer's snapshot stall); returns the hand-over."""
        spec, self.arena, copied = stage(self.loop.parts(), self.arena)
        self.step += 1
        request = {"step": self.step, "directory": str(self.folder), "keep": 1, "torch": torch.__version__,
                   "parts": spec}

        def hand_over() -> None:
            if copied is not None:
                copied.synchronize()
            reply = self.saver.write(request, self.arena)
            assert reply["error"] is None, reply["error"]
        return hand_over


def steps_beside(loop: Loop, stage: Callable[[], Callable[[], None]] | None, steps: int) -> tuple[float, int]:
    """Seconds per training step over the steps that run while a write is under way, and the writes.

    A write starts at a step boundary (`stage()` on the training thread: the trainer's own share of
    a snapshot; the work it returns in a thread), the steps go on until it has ended, and so on until
    `steps` steps have run. Without work, the same in stretches of one step (five on a GPU, where a
    stretch ends with a sync)."""
    least = 5 if loop.cuda else 1
    elapsed, done, writes = 0.0, 0, 0
    loop.sync()
    while done < steps:
        start, thread, n = time.perf_counter(), None, 0
        if stage:
            thread = threading.Thread(target=stage())
            thread.start()
            writes += 1
        while n < least or (thread and thread.is_alive()):
            loop.step()
            n += 1
            if n % 5 == 0:
                loop.sync()     # as the trainer's log rows read the loss: the host does not run ahead
        loop.sync()
        elapsed, done = elapsed + time.perf_counter() - start, done + n
        if thread:
            thread.join()
    return elapsed / done, writes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.snapshot_contention", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-size", type=int, default=512, help="images per step")
    p.add_argument("--steps", type=int, default=30, help="timed steps per row, at the least")
    p.add_argument("--warmup-steps", type=int, default=30)
    p.add_argument("--repeats", type=int, default=1, help="times each row runs; the table gives the median")
    p.add_argument("--out", type=Path, default=None, help="also write the table here as JSON")
    p.add_argument("--saver-only", action="store_true",
                   help="only the trainer's way (nothing, the saver process, nothing), without the old thread's rows")
    args = p.parse_args(argv)
    writer_cores = _one_core_each()
    loop = Loop(args.batch_size)
    for _ in range(args.warmup_steps):
        loop.step()
    host = map_tensors(loop.parts(), lambda t: t.detach().cpu())
    data = _serialised(host)
    print(f"{loop.device}, ResNet-18, batch {args.batch_size}, a snapshot of {len(data) / 1e6:.0f} MB"
          + (f"; training on core {sorted(os.sched_getaffinity(0))}, writers on {sorted(writer_cores)}" if writer_cores else ""))
    print(f"{'beside the steps':24}{'alone ms':>10}{'ms per step':>13}{'writes':>8}   (at least {args.steps} steps a row)")
    table = []
    with tempfile.TemporaryDirectory() as folder:
        saver = SaverWrite(loop, Path(folder), writer_cores)
        others = [] if args.saver_only else parts_of_a_write(host, data, writer_cores).items()
        # The saver's row first, beside the first `nothing`: the old thread's rows leave their mark on
        # the steps after them (memory the process has touched, threads it has run), and the trainer's
        # process runs none of them. --saver-only leaves them out altogether.
        rows = [("nothing", None), ("saver process (now)", saver.first), *((n, (lambda w=w: w)) for n, w in others),
                ("nothing", None)]
        for name, starts in rows:
            alone = _timed(starts() if starts else None)
            runs = [steps_beside(loop, starts, args.steps) for _ in range(args.repeats)]
            per_step = sorted(r[0] for r in runs)[len(runs) // 2]
            print(f"{name:24}{'-' if alone is None else f'{alone * 1000:.0f}':>10}{per_step * 1000:>13.2f}"
                  f"{runs[0][1]:>8}", flush=True)
            table.append({"beside": name, "alone_ms": None if alone is None else alone * 1000,
                          "ms_per_step": per_step * 1000, "runs_ms_per_step": [r[0] * 1000 for r in runs]})
        saver.saver.close()
    if args.out:
        args.out.write_text(json.dumps({"device": str(loop.device), "batch_size": args.batch_size,
                                        "snapshot_mb": len(data) / 1e6, "writer_cores": sorted(writer_cores or []),
                                        "rows": table}, indent=1) + "\n")
    return 0


def _one_core_each() -> set[int] | None:
    """On a CPU host with two cores or more: this thread (the training) on the first, one compute
    thread; the writers' cores (the rest) returned. None on a GPU host: nothing pinned."""
    cores = sorted(os.sched_getaffinity(0))
    if torch.cuda.is_available() or len(cores) < 2:
        return None
    torch.set_num_threads(1)
    os.sched_setaffinity(0, {cores[0]})
    return set(cores[1:])


def _serialised(parts: dict) -> bytes:
    buf = io.BytesIO()
    torch.save(parts, buf)
    return buf.getvalue()


def _timed(work: Callable[[], None] | None) -> float | None:
    if work is None:
        return None
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


if __name__ == "__main__":
    raise SystemExit(main())
