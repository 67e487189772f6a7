"""What a snapshot costs as the state grows: states of many tensors and of many bytes through the trainer's
own path (Snapshots.save: the copy into the arena, the hand-over, the saver's write) and back
(read_snapshot), checked bit for bit.

    python -m bench.snapshot_size                               # resnet152+adamw, 20,000 tensors, 2 GB
    python -m bench.snapshot_size --states tensors:20000,bytes:64MB --out /tmp/small.json

Each state is saved `--repeats` times (the first save makes the arena, the others reuse it, as in
training) into a temporary directory on the disk the bench runs on, then read back once. Per state:
its tensors and bytes, the stall each save cost the caller (the copy into the arena), the saver's write
seconds (serialise, hash, write, fsync, rename), the read's seconds, and whether every tensor came back
equal. Results go to bench/snapshot_size.json with the machine.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from app.cluster.distributed import World
from app.core.config import Config, resolve
from app.training.snapshot import Snapshots, flatten, read_snapshot
from app.training.state import State
from bench.overhead import ROOT, machine

SOLO = World(rank=0, local_rank=0, size=1, local_size=1, device=torch.device("cpu"), restart_count=0)
DEFAULT_STATES = "resnet152-adamw,tensors:20000,bytes:2GB"
UNITS = {"KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30}


def resnet152_adamw() -> State:
    """ResNet-152 (CIFAR stem, 100 classes) with AdamW's two moments after one step: about 2,300 tensors."""
    from app.training.models import build

    model = build("resnet152", num_classes=100)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    optimizer.step()
    return _state(model.state_dict(), optimizer.state_dict())


def many_tensors(count: int) -> State:
    """`count` small tensors: the weights and one moment each, as an optimizer keeps them."""
    weights = {f"layer{i}.weight": torch.randn(16) for i in range(count // 2)}
    moments = {i: {"exp_avg": torch.randn(16)} for i in range(count - count // 2)}
    return _state(weights, {"state": moments, "param_groups": [{"lr": 1e-3, "params": list(moments)}]})


def many_bytes(total: int) -> State:
    """`total` bytes of float32 in tensors of 64 MB at most, a model's weights and its optimizer's state."""
    piece = min(16 << 20, max(1, total // 4))       # float32 elements: 64 MB at most
    count = max(1, total // (piece * 4))
    weights = {f"block{i}.weight": torch.randn(piece) for i in range(count // 2)}
    moments = {i: {"exp_avg": torch.randn(piece)} for i in range(count - count // 2)}
    return _state(weights, {"state": moments, "param_groups": [{"lr": 1e-3, "params": list(moments)}]})


def _state(model: dict, optimizer: dict) -> State:
    return {"model": model, "optimizer": optimizer, "scheduler": {}, "scaler": {}, "train_state": {"step": 1}}


def make_state(name: str) -> State:
    if name == "resnet152-adamw":
        return resnet152_adamw()
    kind, _, size = name.partition(":")
    if kind == "tensors":
        return many_tensors(int(size))
    if kind == "bytes":
        return many_bytes(int(float(size[:-2]) * UNITS[size[-2:]]))
    raise SystemExit(f"error: unknown state {name!r}: resnet152-adamw, tensors:N or bytes:NMB|NGB")


def measure(name: str, repeats: int, directory: Path) -> dict[str, Any]:
    state = make_state(name)
    tensors = [t for _, _, t in flatten(state)[1]]
    cfg = resolve(Config(snapshot_dir=directory, keep=1), "digits")
    warnings: list[str] = []
    snapshots = Snapshots(cfg, SOLO, lambda line: None, warnings.append)
    stalls, writes = [], []
    try:
        for step in range(1, repeats + 1):
            state["train_state"]["step"] = step
            stalls.append(snapshots.save(step, state))
            snapshots.wait()
            writes.append(snapshots.last_write_s)
    finally:
        snapshots.close()
    began = time.perf_counter()
    back = read_snapshot(directory / f"step-{repeats:08d}")
    read_s = time.perf_counter() - began
    return {"state": name, "tensors": len(tensors), "bytes": sum(t.numel() * t.element_size() for t in tensors),
            "save_stall_s": stalls, "write_s": writes, "read_s": read_s, "warnings": warnings,
            "bit_for_bit": _equal(state, back)}


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def show(row: dict[str, Any]) -> None:
    print(f"{row['state']:>16}: {row['tensors']:>6} tensors, {row['bytes'] / 2**20:8.1f} MB; stall "
          f"{statistics.median(row['save_stall_s']) * 1000:7.1f} ms, write {statistics.median(row['write_s']):6.2f} s, "
          f"read {row['read_s']:6.2f} s, bit for bit: {row['bit_for_bit']}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--states", default=DEFAULT_STATES, help=f"comma-separated (default {DEFAULT_STATES})")
    p.add_argument("--repeats", type=int, default=3, help="saves per state")
    p.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary directory)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "snapshot_size.json")
    args = p.parse_args(argv)
    rows = []
    for name in args.states.split(","):
        with tempfile.TemporaryDirectory(dir=args.dir) as directory:
            rows.append(measure(name, args.repeats, Path(directory)))
        show(rows[-1])
    args.out.write_text(json.dumps({"states": rows, "config": {**vars(args), "out": str(args.out),
                                                               "dir": str(args.dir)}, "machine": machine()}, indent=2))
    return 0 if all(row["bit_for_bit"] and not row["warnings"] for row in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
