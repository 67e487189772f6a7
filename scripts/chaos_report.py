"""Measurements of a chaos run, computed from its recorded event log alone (so they can be tested).

The runner records three kinds of events in chaos/events.jsonl, all with wall-clock `time`:
  {"kind": "fault", "fault": NAME, "target": CONTAINER, ...}   an injected fault
  {"kind": "heal", "action": NAME, "target": CONTAINER, ...}   the runner undoing one (a start, unpause)
  {"kind": "log", "container": NAME, "line": TEXT}             a node's log line that shows it noticed
and a copy of the job's metrics.jsonl rows (kind "metric"; see app/metrics.py).

Definitions, for a fault at time t0 (window: until the next fault or heal):
  detection_s  first log line from a node saying it noticed (a worker stopped, a peer lost) - t0
  resumed_step step of the first `start` row after t0 (the job's next incarnation)
  recovery_s   first `train` row after that start - t0: training steps advance again
  steps_lost   last step trained before t0 - resumed_step (never negative)
  world        world size before t0 and in the next incarnation
The window of a fault or a heal ends at the next fault (heals belong to the fault before them).
For a heal (a node started again) rejoin_s is the time until a `train` row shows the world size
back at the size it had before the fault.
These use every metrics row, also those a resume superseded (app.metrics.latest_per_step drops them
for curves): the rows a fault made the job redo are exactly what steps_lost counts.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any, Iterable

Event = dict[str, Any]

# Lines by which a node shows it noticed a fault: torchrun's agent and the trainer itself.
DETECTION_MARKS = ("Stopping worker group", "will restart worker group", "lost contact with another rank",
                   "stopped by SIGTERM", "Worker group failed")


SUPERSEDED_S = 10.0


def load_events(path: Path) -> list[Event]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _metrics(events: Iterable[Event], event: str) -> list[Event]:
    return [e for e in events if e["kind"] == "metric" and e["event"] == event]


def _first(rows: Iterable[Event], after: float, until: float) -> Event | None:
    return next((r for r in sorted(rows, key=lambda r: r["time"]) if after < r["time"] <= until), None)


def measure_fault(events: list[Event], fault: Event, until: float) -> dict[str, Any]:
    t0 = fault["time"]
    train, starts = _metrics(events, "train"), _metrics(events, "start")
    before = [r for r in train if r["time"] <= t0]
    marks = [e for e in events if e["kind"] == "log" and any(m in e["line"] for m in DETECTION_MARKS)
             and e.get("container") != fault.get("target")]
    detected = _first(marks, t0, until)
    start = _first(starts, t0, until)
    resumed = _first(train, start["time"], until) if start else None
    last_step = max((r["step"] for r in before), default=0)
    row = {
        "fault": fault["fault"], "target": fault.get("target"), "time": t0,
        "world_before": before[-1]["world_size"] if before else None,
        "world_after": start["world_size"] if start else None,
        "last_step_before": last_step,
        "resumed_step": start["step"] if start else None,
        "steps_lost": max(0, last_step - start["step"]) if start else None,
        "detection_s": round(detected["time"] - t0, 2) if detected else None,
        "recovery_s": round(resumed["time"] - t0, 2) if resumed else None,
    }
    if detected is None and resumed is not None:   # no node said so, but the job did restart
        row["detection_s"] = round(start["time"] - t0, 2)
    row.update({k: v for k, v in fault.items() if k not in ("kind", "time", "fault", "target")})
    return row


def measure_heal(events: list[Event], heal: Event, until: float) -> dict[str, Any]:
    t0 = heal["time"]
    want = heal.get("world_size")
    back = _first([r for r in _metrics(events, "train") if want is None or r["world_size"] >= want], t0, until)
    return {"heal": heal["action"], "target": heal.get("target"), "time": t0, "world_wanted": want,
            "rejoin_s": round(back["time"] - t0, 2) if back else None}


def measure(events: list[Event]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Per-fault and per-heal rows, each measured up to the next injected fault.

    A fault followed by another within SUPERSEDED_S (back to back) is marked `superseded`:
    the job is still recovering from it when the next one lands, so it has no recovery of its own.
    """
    actions = sorted((e for e in events if e["kind"] in ("fault", "heal")), key=lambda e: e["time"])
    fault_times = [a["time"] for a in actions if a["kind"] == "fault"]
    end = max((e["time"] for e in events), default=0.0) + 1.0
    faults, heals = [], []
    for action in actions:
        nxt = next((t for t in fault_times if t > action["time"]), end)
        if action["kind"] == "heal":
            heals.append(measure_heal(events, action, nxt))
            continue
        row = measure_fault(events, action, nxt)
        row["superseded"] = nxt - action["time"] < SUPERSEDED_S and row["recovery_s"] is None
        faults.append(row)
    return faults, heals


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.median(present), 2) if present else None


def summarise(faults: list[dict[str, Any]], heals: list[dict[str, Any]]) -> dict[str, Any]:
    kills = [f for f in faults if f["fault"].startswith("kill")]
    return {
        "faults": len(faults),
        "recovery_s_median": _median([f["recovery_s"] for f in kills]),
        "recovery_s_max": max((f["recovery_s"] for f in faults if f["recovery_s"] is not None), default=None),
        "detection_s_median": _median([f["detection_s"] for f in faults]),
        "rejoin_s_median": _median([h["rejoin_s"] for h in heals]),
        "rejoin_s_max": max((h["rejoin_s"] for h in heals if h["rejoin_s"] is not None), default=None),
        "steps_lost_max": max((f["steps_lost"] for f in faults if f["steps_lost"] is not None), default=0),
        "unrecovered_faults": sum(1 for f in faults if f["recovery_s"] is None and not f["superseded"]),
    }


def plot_timeline(events: list[Event], out: Path) -> Path:
    """World size and step over time, with the faults marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = sorted(_metrics(events, "train"), key=lambda r: r["time"])
    t_start = min((e["time"] for e in events), default=0.0)
    fig, (ax_step, ax_world) = plt.subplots(2, 1, figsize=(12, 6), sharex=True)
    ax_step.plot([r["time"] - t_start for r in train], [r["step"] for r in train], ".", ms=2)
    ax_step.set(ylabel="step", title="chaos run: training progress, world size and faults")
    ax_world.step([r["time"] - t_start for r in train], [r["world_size"] for r in train], where="post")
    ax_world.set(ylabel="world size", xlabel="seconds since start")
    for e in events:
        if e["kind"] in ("fault", "heal"):
            colour = "red" if e["kind"] == "fault" else "green"
            for ax in (ax_step, ax_world):
                ax.axvline(e["time"] - t_start, color=colour, lw=0.8, alpha=0.6)
            ax_step.annotate(e.get("fault") or e.get("action"), (e["time"] - t_start, ax_step.get_ylim()[1]),
                             rotation=90, fontsize=7, va="top", color=colour)
    for ax in (ax_step, ax_world):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
