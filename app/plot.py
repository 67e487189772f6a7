"""Draw loss, accuracy and throughput curves, and where each process life's time went (goodput), from a
run's metrics.jsonl to a PNG.

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
from matplotlib.figure import Figure  # noqa: E402

from app.reporting import goodput  # noqa: E402
from app.reporting.metrics import latest_per_step, read  # noqa: E402

# One colour per part of a life (app/reporting/goodput.py), the good one first.
PART_COLOURS = {"train": "tab:green", "startup": "tab:blue", "redo": "tab:red", "detection": "tab:orange",
                "regroup": "gold", "heal": "tab:olive", "slow_peer": "tab:pink", "eval": "tab:purple",
                "snapshot": "tab:brown", goodput.OTHER: "tab:grey", goodput.UNRECORDED: "black"}


def plot(metrics: Path, out: Path) -> Path:
    rows = read(metrics)
    fig = figure(latest_per_step(rows), str(metrics), every_row=rows)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def figure(rows: list[dict], name: str, every_row: list[dict] | None = None) -> Figure:
    """Loss, test accuracy and images/s of rows that hold one row per step (latest_per_step), and a
    stacked bar per process life of `every_row` (all rows, superseded ones too; default `rows`)."""
    train = [r for r in rows if r["event"] == "train"]
    evals = [r for r in rows if r["event"] == "eval"]
    if not train and not evals:
        raise ValueError(f"{name} has no train or eval rows yet")
    t0 = min(r["time"] for r in rows)
    fig, (ax_loss, ax_acc, ax_speed, ax_lives) = plt.subplots(1, 4, figsize=(21, 4))
    ax_loss.plot([r["epoch"] for r in train], [r["loss"] for r in train], lw=1)
    ax_loss.set(xlabel="epoch", ylabel="training loss", title="loss")
    ax_acc.plot([r["epoch"] for r in evals], [r["test_acc"] for r in evals], marker="o")
    ax_acc.set(xlabel="epoch", ylabel="test accuracy", title="accuracy", ylim=(0, 1))
    # Throughput against wall-clock time, one line per incarnation: the time a restart costs is a gap.
    for part in _incarnations(rows):
        ax_speed.plot([(r["time"] - t0) / 60 for r in part], [r["images_per_s"] for r in part],
                      marker=".", lw=1, color="tab:blue")
    ax_speed.set(xlabel="minutes since the first row", ylabel="images/s", title="throughput", ylim=(0, None))
    # Restarts are part of the story: a line where each later incarnation began, with its world size.
    for start in [r for r in rows if r["event"] == "start"][1:]:
        for ax, x in ((ax_loss, start["epoch"]), (ax_acc, start["epoch"]), (ax_speed, (start["time"] - t0) / 60)):
            ax.axvline(x, color="grey", ls=":", lw=0.8)
            said = f"restart, world {start['world_size']}" if start["world_size"] else "a node started"   # survivor modes
            ax.annotate(said, (x, 0), xycoords=("data", "axes fraction"),
                        rotation=90, fontsize=7, va="bottom", ha="right", color="grey")
    for ax in (ax_loss, ax_acc, ax_speed):
        ax.grid(alpha=0.3)
    _lives_panel(ax_lives, rows if every_row is None else every_row)
    fig.tight_layout()
    return fig


def _lives_panel(ax: plt.Axes, rows: list[dict]) -> None:
    """A bar per process life, stacked by where its seconds went; the title gives the job's goodput."""
    lives = goodput.lives(rows)
    for i, life in enumerate(lives, start=1):
        bottom = 0.0
        for part, colour in PART_COLOURS.items():
            seconds = life["parts_s"].get(part, 0.0)
            ax.bar(i, seconds, bottom=bottom, color=colour, label=part if i == 1 else None)
            bottom += seconds
    account = goodput.job_account(rows)
    title = "no goodput rows yet" if account is None else (
        f"goodput {account['goodput']:.2f}; down between lives {account['parts_s'][goodput.DOWN]:.0f} s")
    ax.set(xlabel="process life (rank 0 of each start)", ylabel="seconds", title=title)
    if lives:
        ax.set_xticks(range(1, len(lives) + 1))
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    ax.grid(alpha=0.3, axis="y")


def _incarnations(rows: list[dict]) -> list[list[dict]]:
    """The train rows split at each start row: one list per (re)start of the job."""
    parts: list[list[dict]] = [[]]
    for row in rows:
        if row["event"] == "start" and parts[-1]:
            parts.append([])
        elif row["event"] == "train":
            parts[-1].append(row)
    return [p for p in parts if p]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", type=Path, help="a run directory or its metrics.jsonl")
    p.add_argument("-o", "--out", type=Path, help="PNG to write (default: curves.png beside the metrics)")
    args = p.parse_args(argv)
    metrics = args.source / "metrics.jsonl" if args.source.is_dir() else args.source
    try:
        out = plot(metrics, args.out or metrics.with_name("curves.png"))
    except OSError as exc:
        print(f"error: {exc.filename or metrics}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
