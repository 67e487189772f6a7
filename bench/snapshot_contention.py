"""What a snapshot's host side costs the training steps that run beside it, part by part.

    python -m bench.snapshot_contention              # on a GPU host: ResNet-18, 512 images, bf16
    python -m bench.snapshot_contention --batch-size 16 --steps 6      # a CPU host

The trainer hands each snapshot to a writer thread (app/training/snapshot.py), which serialises,
hashes and writes the state while the training thread goes on. On one H200 the steps right after a
snapshot ran at half pace (docs/gpu.md). This bench tells the parts apart: a ResNet-18 trains in
this process, and each part of a write runs alone in a thread beside it. The table gives each
part's time alone and the training steps' time while it runs, against steps with nothing beside
them. A part that holds the interpreter lock slows the step launches; one that releases it (hashing,
file writes) should cost the steps nothing. `python spin` is pure Python, which holds the lock
throughout. Nothing is written to disk but temporary files.
"""
from __future__ import annotations

import argparse
import hashlib
import io
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from app.training import models
from app.training.snapshot import to_cpu, write_snapshot
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

    def host_parts(self) -> dict:
        """The parts a snapshot writes, already on the host (the writer gets them so)."""
        state = to_cpu({"model": self.model.state_dict(), "optimizer": self.opt.state_dict()})
        return {name: state.get(name, {"step": 1}) for name in PARTS}


def parts_of_a_write(parts: dict, data: bytes) -> dict[str, Callable[[], None]]:
    """Each part of app.training.snapshot.write_snapshot on its own (`data`: `parts` serialised),
    and the whole of it."""
    def serialise() -> None:
        torch.save(parts, io.BytesIO())

    def write_and_fsync() -> None:
        with tempfile.NamedTemporaryFile() as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    def whole_write() -> None:
        with tempfile.TemporaryDirectory() as folder:
            write_snapshot(Path(folder), 1, parts)

    def python_spin() -> None:
        end = time.perf_counter() + 0.3
        while time.perf_counter() < end:
            sum(range(1000))

    return {"torch.save to memory": serialise, "sha256": lambda: hashlib.sha256(data).hexdigest(),
            "write + fsync": write_and_fsync, "write_snapshot (all)": whole_write, "python spin": python_spin}


def steps_beside(loop: Loop, work: Callable[[], None] | None, steps: int) -> tuple[float, int]:
    """Seconds per training step while `work` runs in a thread (at least `steps` steps, and until it ends)."""
    loop.sync()
    thread = threading.Thread(target=work) if work else None
    start, done = time.perf_counter(), 0
    if thread:
        thread.start()
    while done < steps or (thread and thread.is_alive()):
        loop.step()
        done += 1
        if done % 5 == 0:
            loop.sync()         # as the trainer's log rows read the loss: the host does not run ahead
    loop.sync()
    per_step = (time.perf_counter() - start) / done
    if thread:
        thread.join()
    return per_step, done


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.snapshot_contention", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-size", type=int, default=512, help="images per step")
    p.add_argument("--steps", type=int, default=30, help="timed steps per row, at the least")
    p.add_argument("--warmup-steps", type=int, default=30)
    args = p.parse_args(argv)
    loop = Loop(args.batch_size)
    for _ in range(args.warmup_steps):
        loop.step()
    parts = loop.host_parts()
    data = _serialised(parts)
    print(f"{loop.device}, ResNet-18, batch {args.batch_size}, a snapshot of {len(data) / 1e6:.0f} MB")
    print(f"{'beside the steps':24}{'alone ms':>10}{'ms per step':>13}{'steps':>7}")
    rows = [("nothing", None), *parts_of_a_write(parts, data).items(), ("nothing", None)]
    for name, work in rows:
        alone = _timed(work) if work else None
        per_step, done = steps_beside(loop, work, args.steps)
        print(f"{name:24}{'-' if alone is None else f'{alone * 1000:.0f}':>10}{per_step * 1000:>13.2f}{done:>7}")
    return 0


def _serialised(parts: dict) -> bytes:
    buf = io.BytesIO()
    torch.save(parts, buf)
    return buf.getvalue()


def _timed(work: Callable[[], None]) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


if __name__ == "__main__":
    raise SystemExit(main())
