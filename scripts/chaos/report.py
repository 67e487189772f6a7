"""Measurements of a chaos run, computed from its recorded event log alone (so they can be tested), but
for the snapshots it left on disk (check_snapshots). How they are shown (the console and markdown
tables, the timeline plot) is scripts/chaos/table.py.

The runner records four kinds of events in chaos/events.jsonl, all with wall-clock `time`:
  {"kind": "fault", "fault": NAME, "target": CONTAINER, ...}   an injected fault
  {"kind": "heal", "action": NAME, "target": CONTAINER, ...}   the runner undoing one (a start, unpause)
  {"kind": "log", "container": NAME, "line": TEXT}             a node's log line that shows it noticed
  {"kind": "step", "container": NAME, "step": N, "world": W}   a node's console line for a step it took
and a copy of the job's metrics.jsonl rows (kind "metric"; see app/reporting/metrics.py).

The job runs in one of the modes of app/core/config.py's --ft. In elastic mode a fault restarts every
worker; in torchft and inplace modes (SURVIVOR_MODES) the survivors' processes go on, and no start
row follows a fault.

Definitions, for a fault at time t0 (window: until the next fault or heal):
  detection_s  first log line from a node saying it noticed (a worker stopped, a peer lost) - t0
  resumed_step step of the first `start` row after t0 (the job's next incarnation)
  recovery_s   first `train` row after that start - t0: training steps advance again
  steps_lost   committed steps lost: the last step trained before t0 (a `train` row, logged after
               every rank's optimizer step) - resumed_step, never negative
  stall_s      the survivors' stall: the longest gap between consecutive step lines, from the last one
               before t0 to the first one showing the job on without the node (lines of the target
               after t0 do not count); it includes the step in flight at t0
In torchft and inplace modes there is no next incarnation: recovery_s is the first step line of another node
after t0 at a smaller world size (or, for a fault that takes no node out, any step line after t0;
after a cut's heal, for a cut nobody trained through),
detection_s the first of that line and a node's log line saying it noticed (a step not committed),
steps_lost the last step before t0 + 1 - the smallest step of a `train` row after it, and there is
no breakdown (nothing restarts).
  full_again_s (survivor modes) the first step line of a node other than the target at the world size
               before t0 (or more), after a node noticed (its log line), - t0: the job trains at full size
               again. With a warm spare (--spares) that is the spare's swap; without one, the node back.
  steps_since_upload, lost_beyond_upload   (a fault that loses every node's disk, the object store the one
               copy: its event's uploaded_step) the steps trained since the snapshot in the store the job
               may resume from (the most the fault may cost), and how many committed steps the job lost
               beyond them (the resume older than that snapshot): 0 when the store did its job, the
               summary's upload_bound_kept. wipe_disks: the newest snapshot in the store at t0;
               damage_then_wipe: the newest whose files match their manifest (a damaged snapshot the
               store took, bad_uploads, is no place to resume from)
  world        world size before t0 and in the next incarnation
  breakdown    where recovery_s went, in order (seconds; they add up to recovery_s):
               detect       t0 -> a node noticed
               restart      -> the new rank-0 process exec'd: torchrun stopping the workers, its next
                               rendezvous round (the dead node's keep-alive running out, the last
                               call for more nodes), spawning the workers
               imports, process_group, data, model, snapshot   its start-up phases (app/reporting/startup.py)
               first_step   -> its first `train` row
A cut between nodes (cut_peers, split_halves: its event names the `sides`, each still reaching the
store) has, from t0 to its heal (`reconnect`):
  cut_trained  the nodes with step lines below the world size before t0: who trained during the cut
  cut_world    the world sizes of those lines
  cut_gap_s    the longest gap between step lines from the first of them to the heal: whether the
               job trained for the rest of the cut (recovery_s says how soon it began)
  split_brain  nodes of more than one side among cut_trained (the target: never)
and its heal's rejoin_s says when the job was whole again.
A fault the job should ride through without a restart (the snapshot volume full) has instead
kept_training: training rows after t0 and no restart in its window, and saves_failed: how many
snapshot writes the job reported failing.
The window of a fault or a heal ends at the next fault (heals belong to the fault before them).
A heal's back_as_spare: its target said it waits as a spare (a warm spare took its place meanwhile).
For a heal (a node started again) rejoin_s is the time until a `train` row shows the world size
back at the size it had before the fault (for a node that comes back by itself, a frozen worker's,
counted from the fault: the heal then carries `since`), and stall_s the longest gap between step lines (any
node's) from the last one before the heal to the first one back at that size. Its breakdown says where
rejoin_s went, from the newest start row of a process exec'd after the heal (the node back's own in torchft
and inplace modes, the new rank 0's in elastic mode):
               launch       -> that process exec'd: the container's start, its entrypoint, the launcher
               interpreter, torch, imports, process_group, ...   its start-up phases
               join         -> the first `train` row back at full size: in the survivor modes the member
                               joining the others' next round, healing from them and the step with them
The pace of a run (pace_change): steps per second over wall time at full size (the world size
before the first fault), before the first fault and after the last fault or heal, each counted from
app.reporting.metrics.PACE_SETTLE_S after the job trained at full size (app.reporting.metrics.pace), and their ratio;
a ratio under PACE_KEPT says that the faults left the job slower (pace_kept false).
These use every metrics row, also those a resume superseded (app.reporting.metrics.latest_per_step drops them
for curves): the rows a fault made the job redo are exactly what steps_lost counts.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any, Iterable

from app.core.config import SURVIVOR_MODES
from app.reporting.goodput import job_account
from app.reporting.metrics import latest_per_step, pace
from app.training.snapshot import SnapshotInvalid, TMP_PREFIX, UNUSABLE_PREFIX, complete_snapshots, read_snapshot

Event = dict[str, Any]

# Lines by which a node shows it noticed a fault: torchrun's agent and the trainer itself.
DETECTION_MARKS = ("Stopping worker group", "will restart worker group", "lost contact with another rank",
                   "stopped by SIGTERM", "Worker group failed",
                   "not committed (",                      # app/ft/trainer.py: a step taken again
                   "ended before step")                    # app/ft/inplace.py: a generation ended between steps
SAVE_FAILED_MARK = "warning: snapshot at step"             # app/training/snapshot.py, a write that failed
# Every log line the runner keeps (the others are not recorded).
SPARE_MARK = "waiting as a spare"                         # app/ft/inplace.py, a node that found the job full
LOG_MARKS = (*DETECTION_MARKS, SAVE_FAILED_MARK, SPARE_MARK)


SUPERSEDED_S = 10.0
PACE_KEPT = 0.95        # the target: after the last fault, at least this share of the pace before the first
HUNG_FAULTS = ("pause", "freeze_worker", "partition")     # a node alive but silent


def load_events(path: Path) -> list[Event]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def metric_rows(events: Iterable[Event], event: str) -> list[Event]:
    return [e for e in events if e["kind"] == "metric" and e["event"] == event]


def _first(rows: Iterable[Event], after: float, until: float) -> Event | None:
    return next((r for r in sorted(rows, key=lambda r: r["time"]) if after < r["time"] <= until), None)


def _logs(events: Iterable[Event], marks: tuple[str, ...], exclude: str | None = None) -> list[Event]:
    return [e for e in events if e["kind"] == "log" and any(m in e["line"] for m in marks)
            and e.get("container") != exclude]


def measure_fault(events: list[Event], fault: Event, until: float, mode: str = "elastic") -> dict[str, Any]:
    t0 = fault["time"]
    train = metric_rows(events, "train")
    before = sorted((r for r in train if r["time"] <= t0), key=lambda r: r["time"])
    # The newest row's step, not the largest ever: after a resume that went back (every disk wiped,
    # the newest snapshot corrupt) the job trains those steps again, and a fault among them loses
    # only what it trained since (the full chaos run of 22:35 counted a partition there as 479 lost).
    last_step = before[-1]["step"] if before else 0
    row = {"fault": fault["fault"], "target": fault.get("target"), "time": t0,
           "world_before": before[-1]["world_size"] if before else None, "last_step_before": last_step}
    if mode in SURVIVOR_MODES:
        row.update(_went_on(events, fault, until, row["world_before"], last_step))
    else:
        row.update(_restarted(events, fault, until, last_step))
    row["stall_s"] = _stall(events, t0, _job_on(events, fault, until, row["world_before"], mode),
                            exclude=fault.get("target"))
    if fault.get("restart_expected") is False:
        row["kept_training"] = row.pop("restarted", False) is False and _first(train, t0, until) is not None
        row["saves_failed"] = sum(1 for e in _logs(events, (SAVE_FAILED_MARK,)) if t0 < e["time"] <= until)
        row["steps_lost"] = row["steps_lost"] or 0
    row.pop("restarted", None)
    if "sides" in fault:
        row.update(_cut(events, fault, until, row["world_before"]))
    row.update({k: v for k, v in fault.items() if k not in ("kind", "time", "fault", "target")})
    if "uploaded_step" in fault:
        row.update(_against_upload(fault["uploaded_step"], last_step, row["steps_lost"]))
    return row


def _against_upload(uploaded: int, last_step: int, steps_lost: int | None) -> dict[str, Any]:
    """What a fault that left only the object store's copy cost, against what it could cost at most."""
    resumed = None if steps_lost is None else last_step - steps_lost
    return {"steps_since_upload": max(0, last_step - uploaded),
            "lost_beyond_upload": None if resumed is None else max(0, uploaded - resumed)}


def _restarted(events: list[Event], fault: Event, until: float, last_step: int) -> dict[str, Any]:
    """Elastic mode: the fault is over when the job's next incarnation trains."""
    t0 = fault["time"]
    train, starts = metric_rows(events, "train"), metric_rows(events, "start")
    start = _first(starts, t0, until)
    # A node's line counts as detection only before the next start (later ones are about later events).
    detected = _first(_logs(events, DETECTION_MARKS, exclude=fault.get("target")), t0,
                      start["time"] if start else until)
    resumed = _first(train, start["time"], until) if start else None
    row = {
        "world_after": start["world_size"] if start else None,
        "resumed_step": start["step"] if start else None,
        "steps_lost": max(0, last_step - start["step"]) if start else None,
        "detection_s": round(detected["time"] - t0, 2) if detected else None,
        "recovery_s": round(resumed["time"] - t0, 2) if resumed else None,
        "restarted": start is not None,
    }
    if detected is None and resumed is not None:   # no node said so, but the job did restart
        row["detection_s"] = round(start["time"] - t0, 2)
    if start and resumed:
        row["breakdown"] = breakdown(events, t0, t0 + row["detection_s"], start, resumed)
    return row


def _went_on(events: list[Event], fault: Event, until: float, world_before: int | None,
             last_step: int) -> dict[str, Any]:
    """torchft mode: the fault is over when another node steps without the target (no restart)."""
    t0 = fault["time"]
    on = _steps(events, t0, until, exclude=fault.get("target"))
    smaller = _back(on, lambda world: world_before is not None and world < world_before)
    # A cut takes no node out: a step at full size before its heal is the one in flight as it began,
    # and a job that never went on without the other side trains again only once it has healed.
    since = _healed(events, fault, until) if "sides" in fault else t0
    resumed = smaller or next((e for e in on if e["time"] > since), None)
    noticed = _first(_logs(events, DETECTION_MARKS, exclude=fault.get("target")), t0, until)
    detected = min((e["time"] for e in (noticed, smaller) if e is not None), default=None)
    after = [r["step"] for r in metric_rows(events, "train") if t0 < r["time"] <= until]
    return {
        "world_after": resumed["world"] if resumed else None,
        "resumed_step": min(after) - 1 if after else None,
        "steps_lost": max(0, last_step + 1 - min(after)) if after else None,
        "detection_s": round(detected - t0, 2) if detected is not None else None,
        "recovery_s": round(resumed["time"] - t0, 2) if resumed else None,
        "restarted": _first(metric_rows(events, "start"), t0, until) is not None,
        "full_again_s": _seconds(full_again(events, t0, until, world_before, fault.get("target")), t0),
    }


def _cut(events: list[Event], fault: Event, until: float, world_before: int | None) -> dict[str, Any]:
    """Who trained while a cut between nodes lasted, at what world sizes, how steadily, and whether more
    than one side did (see the module docstring)."""
    t0, healed = fault["time"], _healed(events, fault, until)
    lines = _steps(events, t0, healed)
    apart = [e for e in lines if world_before is None or e["world"] < world_before]
    times = [e["time"] for e in lines if apart and e["time"] >= apart[0]["time"]] + [healed]
    side = {name: i for i, names in enumerate(fault["sides"]) for name in names}
    trained = sorted({e["container"] for e in apart})
    return {"cut_trained": trained, "cut_world": sorted({e["world"] for e in apart}),
            "cut_gap_s": round(max(b - a for a, b in zip(times, times[1:])), 2) if apart else None,
            "split_brain": len({side.get(name) for name in trained}) > 1}


def _healed(events: list[Event], fault: Event, until: float) -> float:
    """When the runner undid a fault: its first heal in the fault's window (else the window's end)."""
    return min((e["time"] for e in events if e["kind"] == "heal" and fault["time"] < e["time"] <= until), default=until)


def full_again(events: list[Event], t0: float, until: float, world: int | None, target: str | None) -> Event | None:
    """The first step line at `world` (or more) of a node other than `target` after a node noticed the
    fault at t0 (steps committed before it do not count): the job at full size again."""
    noticed = _first(_logs(events, DETECTION_MARKS, exclude=target), t0, until)
    if noticed is None or world is None:
        return None
    return _back(_steps(events, noticed["time"], until, exclude=target), lambda w: w >= world)


def _seconds(event: Event | None, t0: float) -> float | None:
    return round(event["time"] - t0, 2) if event is not None else None


def _job_on(events: list[Event], fault: Event, until: float, world_before: int | None, mode: str) -> Event | None:
    """The first step line of another node showing the job on after a fault: at a smaller world size,
    or (elastic mode) after the restart, at whatever size it formed (a frozen worker's own agent may
    bring it back before the others' next round closes: the job then never trains smaller)."""
    restart = _first(metric_rows(events, "start"), fault["time"], until) if mode not in SURVIVOR_MODES else None
    # After a restart every node's processes are new ones: the target's own step lines count then (when
    # the frozen worker was rank 0's, only its node prints them).
    return next((e for e in _steps(events, fault["time"], until)
                 if (e.get("container") != fault.get("target") and (world_before is None or e["world"] < world_before))
                 or (restart is not None and e["time"] > restart["time"])), None)


def _steps(events: Iterable[Event], after: float, until: float, exclude: str | None = None) -> list[Event]:
    """Step lines in (after, until], in time order; a target's own do not count."""
    return sorted((e for e in events if e["kind"] == "step" and after < e["time"] <= until
                   and e.get("container") != exclude), key=lambda e: e["time"])


def _back(lines: list[Event], world_ok: Any) -> Event | None:
    return next((e for e in lines if world_ok(e["world"])), None)


def _stall(events: list[Event], t0: float, until: Event | None, exclude: str | None = None) -> float | None:
    """The longest gap between consecutive step lines from the last one at or before t0 to `until`."""
    if until is None:
        return None
    last = [e["time"] for e in events if e["kind"] == "step" and e["time"] <= t0][-1:]
    times = last + [e["time"] for e in _steps(events, t0, until["time"], exclude) if e is not until] + [until["time"]]
    return round(max(b - a for a, b in zip(times, times[1:])), 2) if len(times) > 1 else None


def breakdown(events: list[Event], t0: float, detected: float, start: Event, resumed: Event) -> dict[str, float]:
    """Where a recovery's seconds went (see the module docstring); a start row without its start-up
    phases leaves them in first_step."""
    return _spans(t0, [("detect", detected), *_started(start, "restart", detected), ("first_step", resumed["time"])])


def heal_breakdown(events: list[Event], since: float, back: Event) -> dict[str, float] | None:
    """Where a node-back's seconds went (see the module docstring): the newest start row between the heal
    and the train row back at full size, read the way `breakdown` reads a restart's."""
    start = next((r for r in reversed(metric_rows(events, "start"))
                  if since <= (r.get("process_started") or -1.0) and r["time"] <= back["time"]), None)
    if start is None:
        return None
    return _spans(since, [*_started(start, "launch", since), ("join", back["time"])])


def _started(start: Event, first: str, after: float) -> list[tuple[str, float]]:
    """The marks of a start row: its process's exec (named `first`), then the end of each start-up phase."""
    at = start.get("process_started")
    if at is None or at < after:
        return []
    marks = [(first, at)]
    for phase, seconds in (start.get("startup_s") or {}).items():
        at += seconds
        marks.append((phase, at))
    return marks


def _spans(t0: float, marks: list[tuple[str, float]]) -> dict[str, float]:
    """Each mark's seconds since the one before it (from t0), never negative: they add up to the last mark - t0."""
    out, previous = {}, t0
    for phase, at in marks:
        out[phase] = round(max(0.0, at - previous), 2)
        previous = max(previous, at)
    return out


def measure_heal(events: list[Event], heal: Event, until: float) -> dict[str, Any]:
    t0 = heal["time"]
    want = heal.get("world_size")
    back = _first([r for r in metric_rows(events, "train") if want is None or r["world_size"] >= want], t0, until)
    line = _back(_steps(events, t0, until), lambda world: want is None or world >= want)
    since = heal.get("since", t0)       # a node that comes back by itself: from the fault
    row = {"heal": heal["action"], "target": heal.get("target"), "time": t0, "world_wanted": want,
           "rejoin_s": round(back["time"] - since, 2) if back else None, "stall_s": _stall(events, t0, line),
           "back_as_spare": _first([e for e in _logs(events, (SPARE_MARK,)) if e.get("container") == heal.get("target")],
                                   t0, until) is not None}
    went = heal_breakdown(events, since, back) if back else None
    return {**row, "breakdown": went} if went else row


def measure(events: list[Event], mode: str = "elastic") -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Per-fault and per-heal rows, each measured up to the next injected fault; a heal names the
    fault it undoes (`after_fault`).

    A fault followed by another within SUPERSEDED_S (back to back) is marked `superseded`:
    the job is still recovering from it when the next one lands, so it has no recovery of its own.
    """
    actions = sorted((e for e in events if e["kind"] in ("fault", "heal")), key=lambda e: e["time"])
    fault_times = [a["time"] for a in actions if a["kind"] == "fault"]
    end = max((e["time"] for e in events), default=0.0) + 1.0
    faults: list[dict[str, Any]] = []
    heals: list[dict[str, Any]] = []
    for action in actions:
        nxt = next((t for t in fault_times if t > action["time"]), end)
        if action["kind"] == "heal":
            heals.append({**measure_heal(events, action, nxt), "after_fault": faults[-1]["fault"] if faults else None})
            continue
        row = measure_fault(events, action, nxt, mode)
        row["superseded"] = nxt - action["time"] < SUPERSEDED_S and row["recovery_s"] is None
        faults.append(row)
    return faults, heals


def median(values: list[float | None]) -> float | None:
    """The median of the values present, to the hundredth (a second's); None without any."""
    present = [v for v in values if v is not None]
    return round(statistics.median(present), 2) if present else None


def summarise(faults: list[dict[str, Any]], heals: list[dict[str, Any]]) -> dict[str, Any]:
    """The figures the targets are set on. Steps lost count only where a node survived the fault
    (`survivor` False: every node was killed at once, and the periodic snapshot is the bound)."""
    kills = [f for f in faults if f["fault"].startswith("kill")]
    hung = [f for f in faults if f["fault"] in HUNG_FAULTS]
    survived = [f for f in faults if f.get("survivor", True) and f["steps_lost"] is not None]
    # Every disk lost: committed steps lost beyond the snapshot in the store the job could resume from (target: 0)
    beyond = max((f["lost_beyond_upload"] for f in faults if f.get("lost_beyond_upload") is not None), default=None)
    return {
        "faults": len(faults),
        "recovery_s_median": median([f["recovery_s"] for f in kills]),
        # The warm spares' target: kills and hung nodes alike, from the fault to full size again.
        "full_again_s_median": median([f.get("full_again_s") for f in kills + hung]),
        "full_again_s_max": max((f["full_again_s"] for f in kills + hung if f.get("full_again_s") is not None),
                                default=None),
        "stall_s_median": median([f["stall_s"] for f in kills]),
        "heal_stall_s_median": median([h["stall_s"] for h in heals]),
        "recovery_s_max": max((f["recovery_s"] for f in faults if f["recovery_s"] is not None), default=None),
        "detection_s_median": median([f["detection_s"] for f in faults]),
        "hung_detection_s_max": max((f["detection_s"] for f in hung if f["detection_s"] is not None), default=None),
        "rejoin_s_median": median([h["rejoin_s"] for h in heals]),
        "heals_back_as_spare": sum(1 for h in heals if h.get("back_as_spare")),
        "rejoin_s_max": max((h["rejoin_s"] for h in heals if h["rejoin_s"] is not None), default=None),
        "steps_lost_max": max((f["steps_lost"] for f in survived), default=0),
        "steps_lost_all_killed": max((f["steps_lost"] for f in faults if f.get("survivor") is False
                                      and f["steps_lost"] is not None), default=None),
        "steps_lost_beyond_upload": beyond,
        "upload_bound_kept": None if beyond is None else beyond == 0,
        "split_brain": any(f["split_brain"] for f in faults if "split_brain" in f),
        "unrecovered_faults": sum(1 for f in faults if f["recovery_s"] is None and not f["superseded"]
                                  and not f.get("kept_training")),
        "breakdown_median": _median_breakdown([f for f in kills if f.get("breakdown")]),
        "rejoin_breakdown_median": _median_breakdown([h for h in heals if h.get("breakdown")]),
    }


def pace_change(events: list[Event]) -> dict[str, Any]:
    """Steps/s at full size before the first fault and after the last fault or heal, and their ratio
    (see the module docstring); None where the run has too little of either."""
    train = metric_rows(events, "train")
    actions = [e["time"] for e in events if e["kind"] in ("fault", "heal")]
    first = min(actions, default=float("inf"))
    full = max((r["world_size"] for r in train if r["time"] <= first), default=None)
    if full is None or not actions:
        return {"pace_before": None, "pace_after": None, "pace_ratio": None, "pace_kept": None}
    before, after = pace(train, full, until=first), pace(train, full, since=max(actions))
    ratio = after / before if before and after is not None else None
    return {"pace_before": _round(before), "pace_after": _round(after), "pace_ratio": _round(ratio, 3),
            "pace_kept": None if ratio is None else ratio >= PACE_KEPT}


def _round(value: float | None, digits: int = 1) -> float | None:
    return None if value is None else round(value, digits)


def _median_breakdown(faults: list[dict[str, Any]]) -> dict[str, float]:
    """Per phase, the median over the faults that have it (so the medians need not add up exactly)."""
    phases = list(dict.fromkeys(p for f in faults for p in f["breakdown"]))
    return {p: median([f["breakdown"].get(p) for f in faults]) for p in phases}


def check_snapshots(directory: Path) -> dict[str, Any]:
    """Every snapshot in rotation must read back; those the job set aside as unusable are counted apart."""
    valid, corrupt = 0, []
    for path in complete_snapshots(directory):
        try:
            read_snapshot(path)
            valid += 1
        except SnapshotInvalid as exc:
            corrupt.append(f"{path.name}: {exc}")
    partial = [p.name for p in directory.glob(f"{TMP_PREFIX}*")]
    set_aside = sorted(p.name for p in directory.glob(f"{UNUSABLE_PREFIX}*"))
    return {"valid_snapshots": valid, "corrupt_snapshots": len(corrupt), "corrupt": corrupt, "temp_leftovers": partial,
            "set_aside_unusable": set_aside}


def final_accuracy(rows: list[dict[str, Any]]) -> float | None:
    """A job's final accuracy from its metrics rows: its newest eval row that no later resume superseded."""
    evals = [r for r in latest_per_step(rows) if r["event"] == "eval"]
    return evals[-1]["test_acc"] if evals else None


def goodput(rows: list[dict[str, Any]]) -> float | None:
    """A job's goodput from its metrics rows (app/reporting/goodput.py): the fraction of its time in steps that count."""
    account = job_account(rows)
    return account["goodput"] if account else None

