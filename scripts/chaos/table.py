"""How a chaos run's measurements are shown to people: the console table of one mode's faults and heals
(print_table), the markdown table that puts the modes side by side (compare, the runner's
chaos/table.md) and the timeline plot. The figures themselves are computed in scripts/chaos/report.py
and written unrounded to report.json; what is printed here is rounded to what it means (PEOPLE_DIGITS).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from scripts.chaos.report import GRAY_FAULTS, PACE_KEPT, PACE_WINDOW_S, Event, median, metric_rows

# Decimals of a figure a person reads: an accuracy or a goodput to 4, as the eval line gives test_acc (seconds
# come measured to the hundredth already).
PEOPLE_DIGITS = 4


def print_table(report: dict[str, Any]) -> None:
    """A row per fault and per heal, then the summary."""
    print(f"{'fault':18}{'target':18}{'world':>7}{'detect s':>9}{'recover s':>10}{'lost':>5}  where the seconds went")
    for f in report["faults"]:
        world = f"{f['world_before']}->{_fmt(f['world_after'])}"
        went = " ".join(f"{phase} {seconds}" for phase, seconds in (f.get("breakdown") or {}).items())
        if f.get("full_again_s") is not None:
            went = f"full size again {f['full_again_s']} s; {went}"
        if "kept_training" in f:
            went = f"kept training: {f['kept_training']}, saves failed: {f['saves_failed']}"
        if "lost_beyond_upload" in f:
            went = f"{_upload_bound(f)}; {went}"
        if "cut_trained" in f:
            went = _cut_course(f)
        if f["fault"] in GRAY_FAULTS:
            went = _gray_course(f)
        print(f"{f['fault']:18}{str(f['target'])[:17]:18}{world:>7}{_fmt(f['detection_s']):>9}"
              f"{_fmt(f['recovery_s']):>10}{_fmt(f['steps_lost']):>5}  {went}")
    for h in report["heals"]:
        went = " ".join(f"{phase} {seconds}" for phase, seconds in (h.get("breakdown") or {}).items())
        print(f"{'  heal: ' + h['heal']:18}{str(h['target'])[:17]:18}{'':>7}{'rejoin':>9}{_fmt(h['rejoin_s']):>10}"
              f"{'':>5}  {went}")
    s = report["summary"]
    if s.get("pace_ratio") is not None:
        verdict = "" if s["pace_kept"] else f": under {PACE_KEPT}, the faults left the job slower"
        print(f"pace at full size: {s['pace_before']} steps/s before the first fault, {s['pace_after']} after "
              f"the last (ratio {s['pace_ratio']}{verdict})")
    if s.get("upload_bound_kept") is False:
        print(f"every disk lost: {s['steps_lost_beyond_upload']} committed steps lost beyond the snapshot in the "
              "object store the job could resume from (target 0)")
    print(json.dumps(_rounded(s), indent=1))


def _upload_bound(fault: dict[str, Any]) -> str:
    """A fault that left the object store the one copy: where the job resumed against where it could."""
    said = (f"upload {fault['uploaded_step']} ({fault['steps_since_upload']} steps before the fault), resumed from "
            f"{_fmt(fault['resumed_step'])}, lost beyond it {_fmt(fault['lost_beyond_upload'])}")
    if "damaged_step" in fault:
        said += f"; damaged {_fmt(fault['damaged_step'])}, bad commits {fault['bad_uploads'] or 'none'}"
    return said


def _cut_course(fault: dict[str, Any]) -> str:
    """A cut between nodes: who trained during it (the nodes' numbers), at what world size, how steadily."""
    nodes = ",".join(name.rsplit("-", 1)[-1] for name in fault["cut_trained"]) or "nobody"
    said = f"trained during the cut: nodes {nodes} at world {_fmt(fault['cut_world'])}, longest gap {_fmt(fault['cut_gap_s'])} s"
    return said + ("; SPLIT BRAIN: both sides trained" if fault["split_brain"] else "")


def _gray_course(fault: dict[str, Any]) -> str:
    """A slow node or a flapping link: when it was named, the pace (steps/s) before, during and after."""
    said = (f"named after {_fmt(fault.get('named_s'))} s by {fault.get('named_by', 0)} nodes; "
            if fault["fault"] == "slow_node" else f"world changed {fault.get('world_changes')} times; ")
    last = (f", last {PACE_WINDOW_S:.0f} s {_fmt(fault.get('pace_last'))} ({_fmt(fault.get('pace_last_ratio'))})"
            if fault["fault"] == "slow_node" else "")
    return (said + f"steps/s before {_fmt(fault.get('pace_before'))}, during {_fmt(fault.get('pace_during'))} "
            f"({_fmt(fault.get('pace_during_ratio'))}){last}, after {_fmt(fault.get('pace_after'))}; "
            f"full pace after {_fmt(fault.get('full_pace_s'))} s")


# The two-mode table's columns: (heading, where the value comes from, how the fault kind's rows combine).
COLUMNS = ("n", "detected after s", "survivors' stall s", "node back after s", "committed steps lost")


def compare(reports: dict[str, dict[str, Any]]) -> list[str]:
    """The same faults against each mode, one markdown table: a row per fault kind and mode
    (medians over its faults; steps lost: the most), then each mode's final accuracy."""
    lines = ["| fault | mode | " + " | ".join(COLUMNS) + " |", "| --- | --- |" + " --- |" * len(COLUMNS)]
    kinds = list(dict.fromkeys(f["fault"] for r in reports.values() for f in r["faults"]))
    for kind in kinds:
        for mode, rep in reports.items():
            faults = [f for f in rep["faults"] if f["fault"] == kind and not f["superseded"]]
            heals = [h for h in rep["heals"] if h["after_fault"] == kind]
            # Every node lost at once: what counts is what was lost beyond the bound the store sets.
            lost = [f["lost_beyond_upload"] if "lost_beyond_upload" in f else f["steps_lost"] for f in faults
                    if f["steps_lost"] is not None and (f.get("survivor", True) or "lost_beyond_upload" in f)]
            cells = (len(faults), median([f["detection_s"] for f in faults]), median([f["stall_s"] for f in faults]),
                     median([h["rejoin_s"] for h in heals]), max(lost) if lost else None)
            lines.append(f"| {kind} | {mode} | " + " | ".join(_fmt(c) for c in cells) + " |")
    header = ("mode", "faults", "stall after a kill, median s", "node back, median s",
              "survivors' stall while it heals, median s", "committed steps lost, most",
              "pace at full size, steps/s: before, after (ratio)", "final test accuracy", "uninterrupted", "goodput")
    lines += ["", "| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for mode, rep in reports.items():
        s = rep["summary"]
        cells = (s["faults"], s["stall_s_median"], s["rejoin_s_median"], s["heal_stall_s_median"], s["steps_lost_max"],
                 _pace_cell(s), s["final_test_acc"], s["baseline_test_acc"], s.get("goodput"))
        lines.append(f"| {mode} | " + " | ".join(_fmt(c) for c in cells) + " |")
    return lines + _gray_table(reports) + _rate_table(reports)


GRAY_HEADER = ("fault", "mode", "n", "named after s, most", "steps/s before", "during (ratio)",
               f"last {PACE_WINDOW_S:.0f} s (ratio)", "after", "full pace after s, most", "world changes")


def _gray_table(reports: dict[str, dict[str, Any]]) -> list[str]:
    """Slow nodes and flapping links, a row per kind and mode: medians of the paces, the worst of the rest."""
    if not any(f["fault"] in GRAY_FAULTS for r in reports.values() for f in r["faults"]):
        return []
    lines = ["", "| " + " | ".join(GRAY_HEADER) + " |", "|" + " --- |" * len(GRAY_HEADER)]
    worst = lambda values: None if None in values else max(values, default=None)
    for kind in GRAY_FAULTS:
        for mode, rep in reports.items():
            faults = [f for f in rep["faults"] if f["fault"] == kind]
            if not faults:
                continue
            paced = lambda key: median([f.get(key) for f in faults])
            cells = (len(faults), worst([f.get("named_s") for f in faults]) if kind == "slow_node" else None,
                     paced("pace_before"), f"{_fmt(paced('pace_during'))} ({_fmt(paced('pace_during_ratio'))})",
                     f"{_fmt(paced('pace_last'))} ({_fmt(paced('pace_last_ratio'))})" if kind == "slow_node" else None,
                     paced("pace_after"), worst([f.get("full_pace_s") for f in faults]),
                     max((f.get("world_changes") or 0 for f in faults), default=None) if kind == "flap" else None)
            lines.append(f"| {kind} | {mode} | " + " | ".join(_fmt(c) for c in cells) + " |")
    return lines


# What torchft published for a steady fault rate ("Fault Tolerant Llama", June 2025, 300 GPUs): (a fault every
# s, steps committed over the fault-free pace, training efficiency).
TORCHFT_PUBLISHED = ((60.0, "0.823 (ceiling 0.833)", 0.812), (15.0, "-", 0.134))
BADPUT = ("startup", "detection", "regroup", "heal", "redo", "slow_peer", "down", "unrecorded")
RATE_HEADER = ("set-up", "a fault every s (kept)", "faults", "committed over fault-free", "lost while processes started",
               "goodput",
               *(f"{part} s" for part in BADPUT))


def _rate_table(reports: dict[str, dict[str, Any]]) -> list[str]:
    """A steady fault rate (--every): each set-up's share of its fault-free pace kept and where its time
    went, with torchft's published figures at that rate beside them."""
    if not any(r["summary"].get("every_s") for r in reports.values()):
        return []
    lines = ["", "| " + " | ".join(RATE_HEADER) + " |", "|" + " --- |" * len(RATE_HEADER)]
    for mode, rep in reports.items():
        s = rep["summary"]
        parts = s.get("badput_s") or {}
        cells = (f"{_fmt(s.get('every_s'))} ({_fmt(s.get('every_s_kept'))})", s["faults"],
                 s.get("committed_over_fault_free"), _starts_cell(s), s.get("goodput"), *(parts.get(p, 0.0) for p in BADPUT))
        lines.append(f"| {mode} | " + " | ".join(_fmt(c) for c in cells) + " |")
    every = next(r["summary"]["every_s"] for r in reports.values() if r["summary"].get("every_s"))
    for rate, committed, efficiency in TORCHFT_PUBLISHED:
        if rate == every:
            lines.append(f"| torchft, published (300 GPUs, June 2025) | {rate:g} | - | {committed} | - | "
                         f"{efficiency} (efficiency) |" + " - |" * len(BADPUT))
    return lines


def _starts_cell(summary: dict[str, Any]) -> str:
    """`31.4 s in 8 starts (0.196)`: what the window lost at the pace before while processes started."""
    if summary.get("starts_lost_s") is None:
        return "-"
    return f"{summary['starts_lost_s']} s in {summary['starts']} starts ({summary['starts_lost_share']})"


def _pace_cell(summary: dict[str, Any]) -> str:
    """`92.4, 89.3 (0.967)`; the ratio in bold when under PACE_KEPT."""
    ratio = summary.get("pace_ratio")
    shown = "-" if ratio is None else (f"**{ratio}**" if ratio < PACE_KEPT else str(ratio))
    return f"{_fmt(summary.get('pace_before'))}, {_fmt(summary.get('pace_after'))} ({shown})"


def _fmt(value: Any) -> str:
    return "-" if value is None else str(_rounded(value))


def _rounded(value: Any) -> Any:
    """A value as a person reads it: every float in it rounded to PEOPLE_DIGITS decimals."""
    if isinstance(value, float):
        return round(value, PEOPLE_DIGITS)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_rounded(v) for v in value]
    return value


def plot_timeline(events: list[Event], out: Path) -> Path:
    """World size and step over time, with the faults marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = sorted(metric_rows(events, "train"), key=lambda r: r["time"])
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
