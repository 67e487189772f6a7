"""The chaos runner's measurements, on recorded event logs."""
from __future__ import annotations

import json

import pytest

from scripts import chaos_report

pytestmark = pytest.mark.unit


def metric(t: float, event: str, step: int, world: int, **extra) -> dict:
    return {"kind": "metric", "time": t, "event": event, "step": step, "world_size": world, **extra}


def kill_and_rejoin_log() -> list[dict]:
    """Two nodes train; node-2 is killed at t=100, the job restarts at world 1 and resumes
    from the snapshot at step 40; node-2 is started at t=120 and the world is 2 again at t=131."""
    events = [metric(90 + i, "train", 41 + i, 2) for i in range(10)]              # steps 41..50 by t=99
    events += [
        {"kind": "fault", "time": 100.0, "fault": "kill_worker", "target": "node-2"},
        {"kind": "log", "time": 100.5, "container": "node-2", "line": "killed node says nothing useful"},
        {"kind": "log", "time": 103.0, "container": "node-1", "line": "[default] Stopping worker group"},
        metric(106.0, "start", 40, 1, resumed=True),
        metric(107.5, "train", 41, 1),
        metric(108.5, "train", 42, 1),
        {"kind": "heal", "time": 120.0, "action": "start", "target": "node-2", "world_size": 2},
        metric(128.0, "start", 45, 2, resumed=True),
        metric(131.0, "train", 46, 2),
    ]
    return events


def test_fault_measurements_follow_their_definitions():
    faults, heals = chaos_report.measure(kill_and_rejoin_log())
    (fault,) = faults
    assert fault["detection_s"] == 3.0          # the survivor's log line, not the victim's
    assert fault["recovery_s"] == 7.5           # first train row after the new start row
    assert fault["resumed_step"] == 40 and fault["last_step_before"] == 50
    assert fault["steps_lost"] == 10
    assert (fault["world_before"], fault["world_after"]) == (2, 1)
    (heal,) = heals
    assert heal["rejoin_s"] == 11.0             # world size back at 2


def test_a_fault_with_no_restart_has_no_recovery():
    events = [metric(1.0, "train", 1, 2), {"kind": "fault", "time": 2.0, "fault": "store_restart", "target": "s"},
              metric(3.0, "train", 2, 2)]
    (fault,), _ = chaos_report.measure(events)
    assert fault["recovery_s"] is None and fault["steps_lost"] is None and fault["detection_s"] is None


def test_detection_falls_back_to_the_restart_when_no_node_logged_it():
    events = [e for e in kill_and_rejoin_log() if e["kind"] != "log"]
    (fault,), _ = chaos_report.measure(events)
    assert fault["detection_s"] == 6.0


def test_summary_and_timeline(tmp_path):
    events = kill_and_rejoin_log()
    path = tmp_path / "events.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    faults, heals = chaos_report.measure(chaos_report.load_events(path))
    summary = chaos_report.summarise(faults, heals)
    assert summary["recovery_s_median"] == 7.5
    assert summary["rejoin_s_median"] == 11.0
    assert summary["steps_lost_max"] == 10
    assert summary["unrecovered_faults"] == 0
    png = chaos_report.plot_timeline(events, tmp_path / "timeline.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
