"""Draw loss and accuracy curves from a run's metrics.jsonl to a PNG.

    python -m app.plot runs/latest                 # writes runs/latest/curves.png
    python -m app.plot runs/latest/metrics.jsonl -o curves.png
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")   # files only, no display needed
import matplotlib.pyplot as plt  # noqa: E402

from app.metrics import read  # noqa: E402


def plot(metrics: Path, out: Path) -> Path:
    rows = read(metrics)
    train = [r for r in rows if r["event"] == "train"]
    evals = [r for r in rows if r["event"] == "eval"]
    if not train and not evals:
        raise ValueError(f"{metrics} has no train or eval rows yet")
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
    ax_loss.plot([r["epoch"] for r in train], [r["loss"] for r in train], lw=1)
    ax_loss.set(xlabel="epoch", ylabel="training loss", title="loss")
    ax_acc.plot([r["epoch"] for r in evals], [r["test_acc"] for r in evals], marker="o")
    ax_acc.set(xlabel="epoch", ylabel="test accuracy", title="accuracy", ylim=(0, 1))
    for prev, cur in zip(train, train[1:]):   # restarts are part of the story: mark them
        if (cur["restart_count"], cur["world_size"]) != (prev["restart_count"], prev["world_size"]):
            ax_loss.axvline(cur["epoch"], color="grey", ls=":", lw=0.8)
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", type=Path, help="a run directory or its metrics.jsonl")
    p.add_argument("-o", "--out", type=Path, help="PNG to write (default: curves.png beside the metrics)")
    args = p.parse_args(argv)
    metrics = args.source / "metrics.jsonl" if args.source.is_dir() else args.source
    try:
        out = plot(metrics, args.out or metrics.with_name("curves.png"))
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
