"""Measurements of a chaos run, computed from its recorded event log alone (so they can be tested), but
for the snapshots it left on disk (check_snapshots). How they are shown (the console and markdown
tables, the timeline plot) is scripts/chaos/table.py.

The runner records four kinds of events in chaos/events.jsonl, all with wall-clock `time`:
  {"kind": "fault", "fault": NAME, "target": CONTAINER, ...}   an injected fault
  {"kind": "heal", "action": NAME, "target": CONTAINER, ...}   the runner undoing one (a start, unpause)
  {"kind": "log", "container": NAME, "line": TEXT}             a node's log line that shows it noticed
  {"kind": "step", "container": NAME, "step": N, "world": W}   a node's console line for a step it took
                                                    (inplace: also "lineage", the generation that trained it)
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
  cut_trained  the nodes with step lines of a lineage other than the one training at t0 (a group formed
               since, at whatever world size), or of that one past IN_FLIGHT_S (a cut that split no
               generation); lines without a lineage: below the world size before t0. Who trained during
               the cut; recovery_s is its first such line
  cut_world    the world sizes of those lines
  cut_gap_s    the longest gap between step lines from the first of them to the heal: whether the
               job trained for the rest of the cut (recovery_s says how soon it began)
  split_brain  two lineages that each trained the same two consecutive steps during the cut: two groups
               that trained one step with different states, whatever the world sizes and the spares (the
               target: never). Lines without a lineage (elastic, torchft): nodes of more than one side
               among cut_trained
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
A gray fault (slow_node: a node's CPU quota cut; flap: its link to its peers cut and healed again and
again) leaves every node up; from t0 to its heal (`restore_cpus`, `stop_flapping`) it has:
  named_s      (slow_node) the first line of any node naming the target's node slow - t0 (also its
               detection_s); named_by: how many nodes said so before the heal; chose: the lines in which
               the node said what it did about it (inplace: stepped aside for a spare, left out or kept)
  pace_before  steps per second (over wall time, from the train rows) in the PACE_WINDOW_S before t0
  pace_during  ... from t0 to the heal; pace_last (slow_node) in the heal's last PACE_WINDOW_S,
               pace_after in the PACE_WINDOW_S after it (or to the next fault); each ratio to pace_before
  full_pace_s  from t0 to the start of the first FULL_WINDOW_S stretch at FULL_PACE of pace_before or
               more after the pace had fallen under it (0: it never fell; None: it never came back)
  world_changes (flap) how often the step lines' world size changed from t0 to the heal: the regroups
A summary's named_slow_falsely counts the lines naming a node slow that no slow_node fault explains
(another node, or outside its window and the window after it): a false alarm.
A steady fault rate (--every, steady_rate): over the fault window, from the first fault to the last
fault's heal (or the last fault), the images trained and kept (every committed step once, at its world
size, x the batch) over what the run's pace before the first fault trains at full size in the same
time (committed_over_fault_free), the rate kept (every_s_kept), what the job fell short by while
processes started in it (starts_cost: on one host their imports take the training nodes' cores), and
the job's goodput with its badput by category (app/reporting/goodput.py).
"""
from __future__ import annotations

import bisect
import itertools
import json
import statistics
from pathlib import Path
from typing import Any, Iterable

from app.core.config import SURVIVOR_MODES
from app.reporting.goodput import job_account
from app.reporting.metrics import latest_per_step, pace
from app.training.snapshot import SnapshotInvalid, TMP_PREFIX, UNUSABLE_PREFIX, complete_snapshots, read_snapshot

Event = dict[str, Any]

SLOW_MARK = " is slow: its steps take "                 # app/recovery/slow.py: a node named slow
KEPT_UP_MARK = " keeps up again"                           # ... and that node back at the others' pace
# Lines by which a node shows it noticed a fault: torchrun's agent and the trainer itself.
DETECTION_MARKS = ("Stopping worker group", "will restart worker group", "lost contact with another rank",
                   "stopped by SIGTERM", "Worker group failed",
                   "not committed (",                      # app/ft/trainer.py: a step taken again
                   "ended before step",                    # app/ft/inplace.py: a generation ended between steps
                   SLOW_MARK)
SAVE_FAILED_MARK = "warning: snapshot at step"             # app/training/snapshot.py, a write that failed
# Every log line the runner keeps (the others are not recorded).
SPARE_MARK = "waiting as a spare"                         # app/ft/inplace.py, a node that found the job full
# app/ft/slow_nodes.py: what a slow node chose (a spare's place, or the estimate's verdict)
CHOICE_MARKS = (" steps aside for the waiting spare", " (estimated from the step times): the job ")
LOG_MARKS = (*DETECTION_MARKS, SAVE_FAILED_MARK, SPARE_MARK, KEPT_UP_MARK, *CHOICE_MARKS)
GRAY_FAULTS = ("slow_node", "flap")                        # every node up, one slow or its link flapping
PACE_WINDOW_S = 30.0    # a gray fault's pace before it, in its last seconds and after it (the 30 s)
FULL_WINDOW_S = 5.0     # ... back at full pace: a stretch this long at FULL_PACE of the pace before
FULL_PACE = 0.9


SUPERSEDED_S = 10.0
PACE_KEPT = 0.95        # the target: after the last fault, at least this share of the pace before the first
HUNG_FAULTS = ("pause", "freeze_worker", "partition")     # a node alive but silent
# A cut's steps in flight: committed before its rules took hold (a few at 100 steps/s), their lines read by
# the runner this long after it at most. A generation it split prints none later: ending it takes the
# stall bound (INPLACE_STALL, 1 s) and the next is another lineage.
IN_FLIGHT_S = 1.0


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
    if fault["fault"] in GRAY_FAULTS:
        row.update(_gray(events, fault, until))
        if "named_s" in row:
            row["detection_s"] = row["named_s"]
    return row


def steps_per_s(rows: list[Event], since: float, until: float) -> float | None:
    """Committed steps per second over wall time between two moments, from the train rows in (since, until]:
    each step forward counted (a step gone back, redone, is not), over the time between the first row and
    the last. None with fewer than two rows."""
    inside = sorted((r for r in rows if since < r["time"] <= until), key=lambda r: r["time"])
    if len(inside) < 2 or inside[-1]["time"] <= inside[0]["time"]:
        return None
    ahead = sum(max(0, b["step"] - a["step"]) for a, b in zip(inside, inside[1:]))
    return ahead / (inside[-1]["time"] - inside[0]["time"])


def _gray(events: list[Event], fault: Event, until: float) -> dict[str, Any]:
    """A slow node's or a flapping link's course (see the module docstring)."""
    t0, healed = fault["time"], _healed(events, fault, until)
    train = metric_rows(events, "train")
    before = steps_per_s(train, t0 - PACE_WINDOW_S, t0)
    paces = {"pace_during": steps_per_s(train, t0, healed),
             "pace_after": steps_per_s(train, healed, min(until, healed + PACE_WINDOW_S))}
    if fault["fault"] == "slow_node":
        paces["pace_last"] = steps_per_s(train, max(t0, healed - PACE_WINDOW_S), healed)
    row: dict[str, Any] = {"pace_before": _round(before, 2), **{k: _round(v, 2) for k, v in paces.items()}}
    row.update({f"{k}_ratio": _round(v / before, 3) if before and v is not None else None for k, v in paces.items()})
    row["full_pace_s"] = _full_pace(train, t0, until, before)
    if fault["fault"] == "slow_node":
        said = [e for e in _logs(events, (f"node {fault.get('node')}{SLOW_MARK}",)) if t0 < e["time"] <= healed]
        row["named_s"] = round(said[0]["time"] - t0, 2) if said else None
        row["named_by"] = len({e["container"] for e in said})
        row["chose"] = [e["line"] for e in _logs(events, CHOICE_MARKS) if t0 < e["time"] <= healed
                        and e["line"].startswith(f"node {fault.get('node')}")]
    else:
        worlds = [e["world"] for e in _steps(events, t0, healed)]
        row["world_changes"] = sum(1 for a, b in zip(worlds, worlds[1:]) if a != b)
    return row


def _full_pace(train: list[Event], t0: float, until: float, before: float | None) -> float | None:
    """From t0 to the start of the first FULL_WINDOW_S stretch at FULL_PACE of `before` or more after the
    pace fell under it, stretches begun each second; 0 when it never fell, None when it never came back."""
    if not before:
        return None
    fell, t = False, t0
    while t + FULL_WINDOW_S <= until:
        pace_here = steps_per_s(train, t, t + FULL_WINDOW_S)
        if pace_here is not None and pace_here < FULL_PACE * before:
            fell = True
        elif pace_here is not None and fell:
            return round(t - t0, 2)
        t += 1.0
    return None if fell else 0.0


def named_slow_falsely(events: list[Event]) -> int:
    """Lines naming a node slow that no slow_node fault explains: not its node, or not from the fault to
    the end of the window after its heal (a node kept slow by a quota lifted a moment ago is no alarm)."""
    windows = []
    for fault in (e for e in events if e["kind"] == "fault" and e["fault"] == "slow_node"):
        healed = _healed(events, fault, float("inf"))
        windows.append((fault["time"], healed + PACE_WINDOW_S, fault.get("node")))
    return sum(1 for e in _logs(events, (SLOW_MARK,))
               if not any(start < e["time"] <= end and f"node {node}{SLOW_MARK}" in e["line"]
                          for start, end, node in windows))


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
    # A cut takes no node out: a step at full size before its heal is the one in flight as it began (unless
    # its lineage says the job went on: with a spare, or a cut that split no generation), and a job that
    # never went on without the other side trains again only once it has healed.
    since = _healed(events, fault, until) if "sides" in fault else t0
    resumed = (_apart(events, on, t0, world_before)[:1] or [None])[0] if "sides" in fault else smaller
    resumed = resumed or next((e for e in on if e["time"] > since), None)
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
    """Who trained while a cut between nodes lasted, at what world sizes, how steadily, and whether two
    groups trained apart (see the module docstring)."""
    t0, healed = fault["time"], _healed(events, fault, until)
    lines = _steps(events, t0, healed)
    apart = _apart(events, lines, t0, world_before)
    times = [e["time"] for e in lines if apart and e["time"] >= apart[0]["time"]] + [healed]
    side = {name: i for i, names in enumerate(fault["sides"]) for name in names}
    trained = sorted({e["container"] for e in apart})
    forked = _forked(lines)
    return {"cut_trained": trained, "cut_world": sorted({e["world"] for e in apart}),
            "cut_gap_s": round(max(b - a for a, b in zip(times, times[1:])), 2) if apart else None,
            "split_brain": forked if forked is not None else len({side.get(name) for name in trained}) > 1}


def _apart(events: list[Event], lines: list[Event], t0: float, world_before: int | None) -> list[Event]:
    """The step lines of the job going on after a fault at t0, not the steps in flight as it came: those
    of a lineage other than the one that trained at t0 (a group formed since, at whatever world size:
    with a warm spare, the full one), and that one's past IN_FLIGHT_S (a cut that split no generation,
    one that left a waiting spare apart); for lines without a lineage, those below the world size
    before t0."""
    trained = [e for e in events if e["kind"] == "step" and e["time"] <= t0 and e.get("lineage")]
    before = max(trained, key=lambda e: e["time"])["lineage"] if trained else None
    return [e for e in lines if (e["lineage"] != before or e["time"] > t0 + IN_FLIGHT_S if e.get("lineage")
                                 else world_before is None or e["world"] < world_before)]


def _forked(lines: list[Event]) -> bool | None:
    """Whether two lineages each trained the same two consecutive steps among these step lines: each then
    trained the second from a state of its own (two groups, one step, different states). A group trains
    every step from its first line to its last; two that share one step only are no fork (a member that
    committed a step its peers did not, and the group formed without it from the step before). None
    when no line names its lineage."""
    spans: dict[str, tuple[int, int]] = {}
    for e in lines:
        if e.get("lineage"):
            low, high = spans.get(e["lineage"], (e["step"], e["step"]))
            spans[e["lineage"]] = (min(low, e["step"]), max(high, e["step"]))
    if not spans:
        return None
    return any(min(a[1], b[1]) - max(a[0], b[0]) >= 1 for a, b in itertools.combinations(spans.values(), 2))


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
        **_gray_summary(faults),
    }


def _gray_summary(faults: list[dict[str, Any]]) -> dict[str, Any]:
    """The slow nodes' and flapping links' figures the targets are set on: the slowest naming, the
    lowest pace in a slowdown's last seconds and while a link flapped, against the pace before."""
    slow = [f for f in faults if f["fault"] == "slow_node"]
    flaps = [f for f in faults if f["fault"] == "flap"]
    if not slow and not flaps:
        return {}
    worst = lambda values: min((v for v in values if v is not None), default=None)
    named = [f.get("named_s") for f in slow]
    return {"slow_named_s_max": None if None in named else max(named, default=None),
            "slow_pace_last_ratio_min": worst(f.get("pace_last_ratio") for f in slow),
            "flap_pace_during_ratio_min": worst(f.get("pace_during_ratio") for f in flaps)}


def steady_rate(events: list[Event], every_s: float, batch_size: int) -> dict[str, Any]:
    """A run with a fault every `every_s` seconds: its fault window (from the first fault to every_s after
    the last, or the last heal if later), the images trained and kept in it (every committed step of
    the job's final course once, at its world size, x the batch) over what the pace before the first
    fault trains at full size in that time, and the rate the run kept (see the module docstring)."""
    faults = sorted((e for e in events if e["kind"] == "fault"), key=lambda e: e["time"])
    rows = metric_rows(events, "train")
    before = pace_change(events)
    full = max((r["world_size"] for r in rows if faults and r["time"] <= faults[0]["time"]), default=None)
    if not faults or full is None or not before["pace_before"]:
        return {"every_s": every_s, "committed_over_fault_free": None, "every_s_kept": None}
    start = faults[0]["time"]
    end = max(faults[-1]["time"] + every_s,
              max((e["time"] for e in events if e["kind"] == "heal"), default=start))
    at = lambda t: max((r for r in rows if r["time"] <= t), key=lambda r: r["time"], default={"step": 0})["step"]
    first, last = at(start), at(end)
    kept = [r for r in latest_per_step(rows) if r["event"] == "train" and first < r["step"] <= last]
    images = sum(r["world_size"] for r in kept) * batch_size
    fault_free = before["pace_before"] * full * batch_size * (end - start)
    kept_every = (faults[-1]["time"] - start) / (len(faults) - 1) if len(faults) > 1 else None
    return {"every_s": every_s, "fault_window_s": round(end - start, 1),
            "committed_over_fault_free": round(images / fault_free, 4) if fault_free > 0 else None,
            "every_s_kept": _round(kept_every, 1), **starts_cost(events, start, end, before["pace_before"])}


def starts_cost(events: list[Event], start: float, end: float, pace_before: float) -> dict[str, Any]:
    """The processes that started in the window (their start rows: from the exec to the row) and what the
    job trained while each started: the seconds at the pace before that it fell short by (`starts_lost_s`)
    and their share of the window. On one host a start's imports take the training nodes' cores; on
    hosts of their own they would not."""
    steps = sorted((r["time"], r["step"]) for r in metric_rows(events, "train"))
    times = [t for t, _ in steps]
    at = lambda t: steps[bisect.bisect_right(times, t) - 1][1] if times and times[0] <= t else 0     # noqa: E731
    starts = [r for r in metric_rows(events, "start") if start <= r["process_started"] and r["time"] <= end]
    lost = sum((r["time"] - r["process_started"]) - (at(r["time"]) - at(r["process_started"])) / pace_before
               for r in starts)
    return {"starts": len(starts), "starts_s": round(sum(r["time"] - r["process_started"] for r in starts), 1),
            "starts_lost_s": round(lost, 1), "starts_lost_share": round(lost / (end - start), 3) if end > start else None}


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


def badput(rows: list[dict[str, Any]]) -> dict[str, float] | None:
    """Where a job's time went but to steps that count, by category, in seconds (app/reporting/goodput.py's
    parts, `train` left out, none that is zero)."""
    account = job_account(rows)
    return {k: v for k, v in account["parts_s"].items() if k != "train" and v} if account else None

