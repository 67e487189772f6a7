"""The chaos runner's measurements, on recorded event logs, and their tables (scripts/chaos/table.py)."""
from __future__ import annotations

import json
import time

import pytest

from scripts.chaos import report, table as tables
from scripts.chaos.observe import Observer

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
    faults, heals = report.measure(kill_and_rejoin_log())
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
    (fault,), _ = report.measure(events)
    assert fault["recovery_s"] is None and fault["steps_lost"] is None and fault["detection_s"] is None


def test_detection_falls_back_to_the_restart_when_no_node_logged_it():
    events = [e for e in kill_and_rejoin_log() if e["kind"] != "log"]
    (fault,), _ = report.measure(events)
    assert fault["detection_s"] == 6.0


def test_a_fast_restart_is_measured_past_its_own_heal():
    """restart_fast records its heal a moment after the fault; the restart comes after both."""
    events = [metric(1.0, "train", 10, 2),
              {"kind": "fault", "time": 2.0, "fault": "restart_fast", "target": "node-1"},
              {"kind": "heal", "time": 2.3, "action": "back_from_restart", "target": "node-1", "world_size": 2},
              metric(12.0, "start", 10, 2), metric(13.0, "train", 11, 2)]
    (fault,), (heal,) = report.measure(events)
    assert fault["recovery_s"] == 11.0 and fault["steps_lost"] == 0
    assert heal["rejoin_s"] == 10.7


def test_back_to_back_faults_mark_the_first_superseded():
    events = [metric(1.0, "train", 10, 2),
              {"kind": "fault", "time": 2.0, "fault": "kill_back_to_back_1", "target": "a", "back_to_back": True},
              {"kind": "fault", "time": 4.0, "fault": "kill_back_to_back_2", "target": "b", "back_to_back": True},
              {"kind": "heal", "time": 4.5, "action": "start", "target": "a+b", "world_size": 2},
              metric(15.0, "start", 8, 2), metric(16.0, "train", 9, 2)]
    faults, heals = report.measure(events)
    assert faults[0]["superseded"] and faults[0]["recovery_s"] is None
    assert not faults[1]["superseded"] and faults[1]["recovery_s"] == 12.0 and faults[1]["steps_lost"] == 2
    assert faults[1]["back_to_back"] is True
    assert report.summarise(faults, heals)["unrecovered_faults"] == 0


def test_summary_and_timeline(tmp_path):
    events = kill_and_rejoin_log()
    path = tmp_path / "events.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    faults, heals = report.measure(report.load_events(path))
    summary = report.summarise(faults, heals)
    assert summary["recovery_s_median"] == 7.5
    assert summary["rejoin_s_median"] == 11.0
    assert summary["steps_lost_max"] == 10
    assert summary["unrecovered_faults"] == 0
    png = tables.plot_timeline(events, tmp_path / "timeline.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_breakdown_says_where_a_recovery_went_and_adds_up():
    """Killed at 100; the survivor logs at 101, the new rank 0 is exec'd at 104.3 and spends its
    start-up phases until its start row; first train row at 107.5."""
    events = [e for e in kill_and_rejoin_log() if not (e["kind"] == "metric" and e["event"] == "start")]
    events = [e for e in events if e["kind"] != "log"]
    events += [
        {"kind": "log", "time": 101.0, "container": "node-1", "line": "error: lost contact with another rank (x)"},
        metric(106.0, "start", 50, 1, resumed=True, process_started=104.3,
               startup_s={"imports": 1.0, "process_group": 0.2, "data": 0.1, "model": 0.2, "snapshot": 0.2}),
    ]
    (fault,), _ = report.measure(events)
    assert fault["steps_lost"] == 0 and fault["detection_s"] == 1.0
    assert fault["breakdown"] == {"detect": 1.0, "restart": 3.3, "imports": 1.0, "process_group": 0.2,
                                  "data": 0.1, "model": 0.2, "snapshot": 0.2, "first_step": 1.5}
    assert sum(fault["breakdown"].values()) == pytest.approx(fault["recovery_s"])
    summary = report.summarise([fault], [])
    assert summary["breakdown_median"]["restart"] == 3.3


def test_a_heals_breakdown_says_where_the_node_back_went_and_adds_up(capsys):
    """node-2 started at 120; its process exec'd at 121.5 (container, entrypoint, launcher), its start-up
    phases end at its start row (124.0), and it trains with the others at 124.75. A start row of a process
    exec'd before the heal (the survivor's) is not the node back's."""
    events = [e for e in kill_and_rejoin_log() if not (e["kind"] == "metric" and e["time"] >= 128.0)]
    events += [
        metric(119.0, "start", 44, 1, process_started=50.0, startup_s={"torch": 1.0}),
        metric(124.0, "start", 45, 2, resumed=True, process_started=121.5,
               startup_s={"torch": 1.25, "process_group": 1.0, "snapshot": 0.25}),
        metric(124.75, "train", 46, 2),
    ]
    _, (heal,) = report.measure(events)
    assert heal["rejoin_s"] == 4.75
    assert heal["breakdown"] == {"launch": 1.5, "torch": 1.25, "process_group": 1.0, "snapshot": 0.25, "join": 0.75}
    assert sum(heal["breakdown"].values()) == pytest.approx(heal["rejoin_s"])
    summary = report.summarise([], [heal])
    assert summary["rejoin_breakdown_median"]["launch"] == 1.5
    tables.print_table({"faults": [], "heals": [heal], "summary": summary})
    assert "rejoin      4.75       launch 1.5 torch 1.25 process_group 1.0 snapshot 0.25 join 0.75\n" in capsys.readouterr().out


def test_a_full_disk_is_ridden_through_without_a_restart():
    events = [metric(1.0, "train", 1, 2),
              {"kind": "fault", "time": 2.0, "fault": "disk_full", "target": "volume", "restart_expected": False},
              {"kind": "log", "time": 3.0, "container": "node-1",
               "line": "warning: snapshot at step 20 failed (/runs/snapshots: No space left on device); earlier snapshots are kept"},
              metric(4.0, "train", 21, 2)]
    (fault,), _ = report.measure(events)
    assert fault["kept_training"] and fault["saves_failed"] == 1 and fault["steps_lost"] == 0
    assert report.summarise([fault], [])["unrecovered_faults"] == 0
    events[-1] = metric(4.0, "start", 0, 2)           # it restarted instead: not ridden through
    (fault,), _ = report.measure(events)
    assert not fault["kept_training"]


def step(t: float, container: str, n: int, world: int) -> dict:
    return {"kind": "step", "time": t, "container": container, "step": n, "world": world}


def torchft_kill_and_heal_log() -> list[dict]:
    """torchft mode: node-2 (the writer) is killed at t=100 after step 50; node-1 takes the step
    again alone (its console at t=101.2), takes over the rows at step 53, and stalls 1.5 s at the
    quorum where node-2, started at t=110, comes back."""
    events = [step(95 + i / 10, "node-1", i, 2) for i in range(1, 51)]            # step 50 at t=100.0
    events += [metric(95 + i / 10 - 0.01, "train", i, 2) for i in range(1, 51)]
    events += [
        {"kind": "fault", "time": 100.02, "fault": "kill_rank0", "target": "node-2"},
        {"kind": "log", "time": 100.4, "container": "node-1", "line": "warning: step 51 not committed (Connection reset)"},
        step(101.2, "node-1", 51, 1), step(101.3, "node-1", 52, 1), step(101.5, "node-1", 53, 1),
        metric(101.5, "train", 53, 1),
        {"kind": "heal", "time": 110.0, "action": "start", "target": "node-2", "world_size": 2},
        *[step(101 + i, "node-1", 53 + i, 1) for i in range(1, 18)],               # to t=118
        metric(118.2, "start", 20, 1, resumed=True),                              # the returned group's own start
        step(119.5, "node-1", 71, 2), metric(119.6, "train", 71, 2),
    ]
    return events


def test_torchft_mode_is_measured_on_the_survivors_own_steps():
    faults, heals = report.measure(torchft_kill_and_heal_log(), "torchft")
    (fault,), (heal,) = faults, heals
    assert fault["detection_s"] == 0.38         # the survivor's step not committed
    assert fault["recovery_s"] == 1.18          # its first step without the victim
    assert fault["stall_s"] == 1.2              # from its last step before the kill
    assert fault["steps_lost"] == 0 and fault["world_after"] == 1 and "breakdown" not in fault
    assert heal["rejoin_s"] == 9.6 and heal["stall_s"] == 1.5 and heal["after_fault"] == "kill_rank0"


def test_in_torchft_mode_the_returned_groups_start_row_is_no_resume_and_a_step_gone_back_is_lost():
    events = torchft_kill_and_heal_log()
    (fault,), _ = report.measure(events, "torchft")
    assert fault["steps_lost"] == 0, "the returned group's start row (step 20) is not the job's"
    events.append(metric(101.4, "train", 48, 1))     # had the survivor gone back to step 48
    (fault,), _ = report.measure(events, "torchft")
    assert fault["steps_lost"] == 3


def test_the_elastic_stall_spans_the_restart():
    events = kill_and_rejoin_log() + [step(99.0, "node-1", 50, 2), step(107.5, "node-1", 41, 1),
                                      step(119.0, "node-1", 43, 1), step(131.0, "node-2", 46, 2)]
    faults, heals = report.measure(events)
    assert faults[0]["stall_s"] == 8.5 and heals[0]["stall_s"] == 12.0


def test_the_two_mode_table_has_a_row_per_fault_kind_and_mode():
    reports = {}
    life = metric(145.0, "goodput", 60, 2, life_started=105.0, wall_s=40.0,
                  parts_s={"startup": 10.0, "train": 30.0})       # the rows of the job's other lives lack it
    for mode, events in (("elastic", kill_and_rejoin_log() + [step(99.0, "node-1", 50, 2),
                                                              step(107.5, "node-1", 41, 1), life]),
                         ("torchft", torchft_kill_and_heal_log())):
        faults, heals = report.measure(events, mode)
        faults[0]["fault"] = "kill_rank0"
        heals[0]["after_fault"] = "kill_rank0"
        summary = {**report.summarise(faults, heals), **report.pace_change(events), "final_test_acc": 0.9,
                   "baseline_test_acc": 0.91, "goodput": report.goodput([e for e in events if e["kind"] == "metric"])}
        reports[mode] = {"faults": faults, "heals": heals, "summary": summary}
    table = tables.compare(reports)
    assert table[2] == "| kill_rank0 | elastic | 1 | 3.0 | 8.5 | 11.0 | 10 |"
    assert table[3] == "| kill_rank0 | torchft | 1 | 0.38 | 1.2 | 9.6 | 0 |"
    assert table[-2].endswith(" | 0.9 | 0.91 | 0.75 |"), table[-2]
    assert table[-1] == "| torchft | 1 | 1.2 | 9.6 | 1.5 | 0 | -, - (-) | 0.9 | 0.91 | - |"   # 5 s before the kill: no pace; no goodput rows


def test_a_frozen_worker_counts_as_recovered_by_a_restart_at_full_size_or_by_going_on_without_it():
    """Elastic mode: the frozen worker's own agent may restart it before the others' next round closes,
    so the job comes back at full size and no row below it ever comes (the runner waited for one until
    the job ended). torchft mode: the survivors go on at a smaller size."""
    from scripts.chaos.observe import Observer

    def seen(*rows: dict) -> Observer:
        observer = Observer(job=None)
        for row in rows:
            observer.record(kind="metric", **row)
        return observer

    before = {"event": "train", "time": 1.0, "world_size": 2}
    restart = seen(before, {"event": "start", "time": 5.0, "world_size": 2},
                   {"event": "train", "time": 6.0, "world_size": 2})
    without = seen(before, {"event": "train", "time": 3.0, "world_size": 1})
    stuck = seen(before, {"event": "start", "time": 5.0, "world_size": 2})
    assert restart.wait_recovered(2.0, 2, timeout=0.1) and without.wait_recovered(2.0, 2, timeout=0.1)
    assert not stuck.wait_recovered(2.0, 2, timeout=0.1)
    assert not restart.wait_without(2.0, 2, timeout=0.1)


def test_an_elastic_restart_at_full_size_ends_the_stall_and_the_node_back_counts_from_the_fault():
    """A frozen worker whose own agent restarted it before the others' next round closed: the job came
    back at world 2 without ever training smaller. The stall ends at the first step after the restart;
    the node, back by itself, is back when the job trains at full size, counted from the fault."""
    events = [metric(90 + i, "train", 41 + i, 2) for i in range(10)] + [step(99.0, "node-1", 50, 2)]
    events += [
        {"kind": "fault", "time": 100.0, "fault": "freeze_worker", "target": "node-2"},
        metric(106.0, "start", 50, 2, resumed=True),
        step(109.0, "node-1", 51, 2),
        metric(109.0, "train", 51, 2),
        {"kind": "heal", "time": 109.5, "action": "rejoin_by_itself", "target": "node-2", "world_size": 2,
         "since": 100.0},
        step(109.7, "node-1", 52, 2),
        metric(109.7, "train", 52, 2),
    ]
    (fault,), (heal,) = report.measure(events)
    assert fault["stall_s"] == 10.0 and fault["recovery_s"] == 9.0 and fault["steps_lost"] == 0
    assert heal["rejoin_s"] == 9.7


def paced_run(after_rate: float) -> list[dict]:
    """Two nodes at 10 steps/s for 100 s; node-2 killed at t=100, the survivor alone at 6 steps/s;
    node-2 started at t=120 and the job at full size again from t=125, at after_rate steps/s to t=200."""
    events = [metric(t / 10, "train", t, 2) for t in range(1, 1000)]
    events += [{"kind": "fault", "time": 100.0, "fault": "kill_worker", "target": "node-2"}]
    events += [metric(101 + i / 6, "train", 1000 + i, 1) for i in range(114)]
    events += [{"kind": "heal", "time": 120.0, "action": "start", "target": "node-2", "world_size": 2}]
    events += [metric(125 + i / after_rate, "train", 1200 + i, 2) for i in range(int(75 * after_rate))]
    return events


def test_the_pace_at_full_size_before_the_first_fault_and_after_the_last():
    """Counted from PACE_SETTLE_S after training at full size: from t=10.1 to the fault, and from
    t=135 to the end; the survivor's steps alone do not count."""
    slower = report.pace_change(paced_run(9.0))
    assert slower["pace_before"] == 10.0 and slower["pace_after"] == 9.0
    assert slower["pace_ratio"] == 0.9 and slower["pace_kept"] is False
    kept = report.pace_change(paced_run(9.7))
    assert kept["pace_ratio"] == 0.97 and kept["pace_kept"] is True
    assert report.pace_change([metric(1.0, "train", 1, 2)])["pace_ratio"] is None      # no fault: nothing to compare


def test_a_run_that_lost_its_pace_says_so(capsys):
    events = paced_run(9.0)
    faults, heals = report.measure(events)
    summary = {**report.summarise(faults, heals), **report.pace_change(events), "final_test_acc": 0.99,
               "baseline_test_acc": 0.99}
    tables.print_table({"faults": faults, "heals": heals, "summary": summary})
    assert ("pace at full size: 10.0 steps/s before the first fault, 9.0 after the last (ratio 0.9: under 0.95, "
            "the faults left the job slower)") in capsys.readouterr().out
    assert tables.compare({"elastic": {"faults": faults, "heals": heals, "summary": summary}})[-1].endswith(
        "| 10.0, 9.0 (**0.9**) | 0.99 | 0.99 | - |")


def test_the_console_summary_rounds_what_a_person_reads_and_report_json_keeps_it_whole(capsys):
    """print_table's summary: an accuracy of 359 in 360 reads 0.9972, not 0.9972222222222222."""
    events = paced_run(9.0)
    faults, heals = report.measure(events)
    summary = {**report.summarise(faults, heals), **report.pace_change(events), "final_test_acc": 359 / 360,
               "baseline_test_acc": 1.0, "goodput": 0.123456789}
    tables.print_table({"faults": faults, "heals": heals, "summary": summary})
    out = capsys.readouterr().out
    shown = json.loads(out[out.index("\n{") + 1:])                 # the summary, after the table's rows
    assert shown["final_test_acc"] == 0.9972 and shown["goodput"] == 0.1235 and shown["baseline_test_acc"] == 1.0
    assert summary["final_test_acc"] == 359 / 360       # the report's own value is not touched


def test_a_frozen_rank0_worker_stalls_the_job_until_its_restart_trains():
    """Elastic mode, rank 0's worker frozen: only its node prints step lines, before the fault and after
    the restart (which brings it back in the same container). The stall runs to the first line after
    the restart, the target's own: before it, nothing of the target's counts."""
    step = lambda t, n: {"kind": "step", "time": t, "container": "node-1", "step": n, "world": 2}  # noqa: E731
    events = [step(9.0, 9), metric(9.5, "train", 9, 2), step(10.0, 10),
              {"kind": "fault", "time": 10.5, "fault": "freeze_worker", "target": "node-1"},
              {"kind": "log", "time": 14.0, "container": "node-2", "line": "error: lost contact with another rank"},
              metric(30.0, "start", 10, 2, resumed=True), step(30.2, 11), metric(30.3, "train", 11, 2)]
    (fault,), _ = report.measure(events)
    assert fault["stall_s"] == 20.2 and fault["recovery_s"] == 19.8 and fault["steps_lost"] == 0


def test_every_row_of_the_mode_table_has_its_headers_cells():
    faults, heals = report.measure(kill_and_rejoin_log())
    summary = {**report.summarise(faults, heals), "final_test_acc": 0.9, "baseline_test_acc": None}
    table = tables.compare({"elastic": {"faults": faults, "heals": heals, "summary": summary}})
    modes = table[table.index("") + 1:]
    assert len({row.count("|") for row in modes}) == 1, modes


def test_a_wait_for_the_end_that_sees_the_last_row_come_between_its_checks_reports_the_end():
    """The 20-fault run's elastic mode ended at epoch 600 and was reported not completed: the eval row
    of the last epoch came after the wait asked its predicate and before it asked whether the job had
    finished, and the wait ended as for a heal after the end."""
    seen = Observer(job=None, epochs=2)

    def finished(events: list) -> bool:
        if not events:
            seen.record(kind="metric", event="eval", epoch=2.0)     # the last row, just after this check
            return False
        return seen.finished()

    assert seen.wait_for(finished, timeout=5)
    assert not seen.wait_for(lambda events: False, timeout=5), "a wait for anything else still ends at the end"


def test_a_wait_is_asked_of_the_events_since_its_fault_not_the_whole_run():
    """The runner shares the host's cores with the nodes: a wait that scanned every event of the run
    five times a second took a growing share of a core from them. A metric row written before `since`
    but read after it is still asked about (its own time decides, in the predicate)."""
    seen = Observer(job=None, epochs=3)
    for i in range(1000):
        seen.record(kind="metric", event="train", epoch=i / 1000, step=i, world_size=2, time=float(i))
    time.sleep(0.01)
    since = time.time()
    late_row = seen.record(kind="metric", event="train", epoch=1.0, step=1000, world_size=1, time=since - 0.5)
    asked: list[int] = []
    assert not seen.wait_for(lambda ev: asked.append(len(ev)) or False, timeout=0.3, since=since)
    assert set(asked) == {1} and seen.events(since) == [late_row] and len(seen.events()) == 1001
    assert seen.epoch() == 1.0 and not seen.finished()
    seen.record(kind="metric", event="eval", epoch=3.0, time=time.time())
    assert seen.finished() and seen.wait_finished(timeout=5) and seen.wait_epoch(2.0, timeout=5)


def wiped_log(resumed_at: int, mode_survives: bool = False, fault: str = "wipe_disks", **recorded) -> list[dict]:
    """Two nodes train to step 50; at t=100 every node's disk is wiped with step 40 the snapshot in the
    object store to resume from; the nodes start again and the job resumes at `resumed_at`."""
    events = [metric(90 + i, "train", 41 + i, 2) for i in range(10)]
    events += [{"kind": "fault", "time": 100.0, "fault": fault, "target": "2 nodes", "survivor": False,
                "uploaded_step": 40, **recorded},
               {"kind": "heal", "time": 101.0, "action": "start_all", "target": "2 nodes", "world_size": 2}]
    if not mode_survives:
        events.append(metric(110.0, "start", resumed_at, 2, resumed=True))
    events.append(metric(111.0, "train", resumed_at + 1, 2))
    return events


@pytest.mark.parametrize("mode", ["elastic", "inplace"])
def test_a_wiped_job_is_measured_against_the_last_upload(mode):
    (kept,), _ = report.measure(wiped_log(40, mode != "elastic"), mode)
    assert (kept["steps_lost"], kept["steps_since_upload"], kept["lost_beyond_upload"]) == (10, 10, 0)
    (older,), _ = report.measure(wiped_log(30, mode != "elastic"), mode)
    assert (older["steps_lost"], older["steps_since_upload"], older["lost_beyond_upload"]) == (20, 10, 10)
    faults, heals = report.measure(wiped_log(30))
    assert report.summarise(faults, heals)["steps_lost_beyond_upload"] == 10


def test_the_mode_table_shows_a_wipe_by_the_steps_lost_beyond_the_last_upload():
    reports = {}
    for mode, resumed in (("elastic", 40), ("inplace", 30)):
        faults, heals = report.measure(wiped_log(resumed, mode == "inplace"), mode)
        reports[mode] = {"faults": faults, "heals": heals, "summary": {**report.summarise(faults, heals),
                         "final_test_acc": None, "baseline_test_acc": None}}
    rows = [line for line in tables.compare(reports) if line.startswith("| wipe_disks")]
    assert [row.split("|")[-2].strip() for row in rows] == ["0", "10"]


def damaged_log(resumed_at: int, mode_survives: bool = False) -> list[dict]:
    """wiped_log's job, where step 45 was damaged on disk before its upload and the store took it (the
    upload code before issue 44's fix): step 40 is the newest good snapshot in the store."""
    return wiped_log(resumed_at, mode_survives, "damage_then_wipe", damaged_step=45, bad_uploads=[45])


@pytest.mark.parametrize("mode", ["elastic", "inplace"])
def test_a_damaged_upload_then_a_wipe_is_measured_against_the_newest_good_upload(mode):
    """Resumed at the newest good upload: the steps since it lost, none beyond it, the check passes."""
    faults, heals = report.measure(damaged_log(40, mode != "elastic"), mode)
    (fault,) = faults
    assert (fault["resumed_step"], fault["uploaded_step"], fault["damaged_step"], fault["bad_uploads"]) == (40, 40, 45, [45])
    assert (fault["steps_lost"], fault["steps_since_upload"], fault["lost_beyond_upload"]) == (10, 10, 0)
    summary = report.summarise(faults, heals)
    assert (summary["steps_lost_beyond_upload"], summary["upload_bound_kept"]) == (0, True)
    assert summary["steps_lost_all_killed"] == 10 and summary["steps_lost_max"] == 0, "no node survived it"


@pytest.mark.parametrize("mode", ["elastic", "inplace"])
@pytest.mark.parametrize("resumed_at, beyond", [(30, 10), (0, 40)])
def test_a_resume_older_than_the_newest_good_upload_fails_the_check(mode, resumed_at, beyond):
    """Resumed older than step 40 (30: a good snapshot passed over; 0: the start that met the damaged
    upload and gave up on the store): every step lost beyond the newest good upload is a failure."""
    faults, heals = report.measure(damaged_log(resumed_at, mode != "elastic"), mode)
    (fault,) = faults
    assert (fault["resumed_step"], fault["steps_since_upload"], fault["lost_beyond_upload"]) == (resumed_at, 10, beyond)
    summary = report.summarise(faults, heals)
    assert (summary["steps_lost_beyond_upload"], summary["upload_bound_kept"]) == (beyond, False)


def test_the_check_takes_the_worst_of_the_faults_that_left_only_the_store():
    """One rule for both kinds: a wipe that kept the bound does not hide a damaged upload's loss."""
    wiped, _ = report.measure(wiped_log(40))
    damaged, _ = report.measure(damaged_log(30))
    summary = report.summarise(wiped + damaged, [])
    assert (summary["steps_lost_beyond_upload"], summary["upload_bound_kept"]) == (10, False)
    assert report.summarise([], [])["upload_bound_kept"] is None, "no such fault: nothing to check"


def test_the_tables_show_a_damaged_upload_by_the_resume_against_the_newest_good_upload(capsys):
    faults, heals = report.measure(damaged_log(30))
    summary = {**report.summarise(faults, heals), "final_test_acc": None, "baseline_test_acc": None}
    tables.print_table({"faults": faults, "heals": heals, "summary": summary})
    out = capsys.readouterr().out
    assert ("upload 40 (10 steps before the fault), resumed from 30, lost beyond it 10; damaged 45, "
            "bad commits [45];") in out
    assert ("every disk lost: 10 committed steps lost beyond the snapshot in the object store the job could "
            "resume from (target 0)\n") in out
    (row,) = [line for line in tables.compare({"elastic": {"faults": faults, "heals": heals, "summary": summary}})
              if line.startswith("| damage_then_wipe")]
    assert row.split("|")[-2].strip() == "10"


def test_a_fault_while_the_job_trains_steps_again_loses_only_what_it_trained_since_the_resume():
    """wipe_disks resumed the job 545 steps back; a partition 66 steps later was counted against the
    largest step ever trained (479 lost) where the survivors lost nothing."""
    events = [metric(t, "train", 400 + t, 2) for t in range(1, 101)]                 # steps 401..500
    events.append(metric(102.0, "start", 300, 2, resumed=True))                       # every disk lost: back to 300
    events += [metric(103 + i, "train", 301 + i, 2) for i in range(20)]               # steps 301..320 again
    events.append({"kind": "fault", "time": 123.5, "fault": "partition", "target": "node-1"})
    events += [metric(125 + i, "train", 321 + i, 1) for i in range(5)]                # the survivor goes on
    (fault,), _ = report.measure(events, "inplace")
    assert fault["last_step_before"] == 320 and fault["steps_lost"] == 0


def cut_log(apart: list[tuple[str, int]], end: float = 130.0) -> list[dict]:
    """Four nodes train at world 4; at t=100 node-1's data path to the others is cut (`sides`) for 30 s;
    from t=103 the nodes in `apart` (name, world) print a step line a second until the heal; at t=131.5
    the job trains at world 4 again."""
    events = [step(95 + i, f"node-{n}", 90 + i, 4) for i in range(5) for n in (1, 2, 3, 4)]
    events += [metric(99.0, "train", 94, 4),
               {"kind": "fault", "time": 100.0, "fault": "cut_peers", "target": "node-1", "cut_s": 30.0,
                "sides": [["node-1"], ["node-2", "node-3", "node-4"]]}]
    events += [step(103.0 + i, name, 95 + i, world) for i in range(0, int(end - 103)) for name, world in apart]
    events += [metric(103.0, "train", 95, 3),
               {"kind": "heal", "time": 130.0, "action": "reconnect", "target": "node-1", "world_size": 4},
               step(131.5, "node-2", 130, 4), metric(131.5, "train", 130, 4)]
    return events


def test_a_cut_says_who_trained_during_it_at_what_world_size_and_when_the_job_was_whole():
    (fault,), (heal,) = report.measure(cut_log([("node-2", 3), ("node-3", 3), ("node-4", 3)]), "inplace")
    assert fault["cut_trained"] == ["node-2", "node-3", "node-4"] and fault["cut_world"] == [3]
    assert fault["recovery_s"] == 3.0 and fault["cut_gap_s"] == 1.0 and fault["split_brain"] is False
    assert fault["steps_lost"] == 0
    assert heal["rejoin_s"] == 1.5                      # the job whole again
    assert report.summarise([fault], [heal])["split_brain"] is False


def test_a_cut_the_job_stopped_training_in_shows_the_gap_up_to_the_heal():
    (fault,), _ = report.measure(cut_log([("node-2", 3), ("node-3", 3)], end=110.0), "inplace")
    assert fault["cut_gap_s"] == 21.0                   # the last line at 109, the heal at 130


def test_both_sides_of_a_cut_training_apart_is_a_split_brain(capsys):
    (fault,), heals = report.measure(cut_log([("node-1", 1), ("node-2", 3)]), "inplace")
    assert fault["split_brain"] is True and fault["cut_world"] == [1, 3]
    summary = report.summarise([fault], heals)
    assert summary["split_brain"] is True
    tables.print_table({"faults": [fault], "heals": heals, "summary": summary})
    assert "trained during the cut: nodes 1,2 at world [1, 3]" in capsys.readouterr().out


def test_nobody_training_during_a_cut_has_no_gap_and_no_split_brain():
    """torchft under a cut: the step in flight as it began completes at full size, then nobody trains."""
    events = cut_log([]) + [step(100.07, "node-2", 95, 4)]
    (fault,), _ = report.measure(events, "torchft")
    assert (fault["cut_trained"], fault["cut_gap_s"], fault["split_brain"]) == ([], None, False)
    assert fault["recovery_s"] == 31.5 and fault["world_after"] == 4     # training again with the heal alone


def spare_cut_log(apart: list[tuple[str, int, str]], first: int = 95, training: tuple[str, str] = ("trainer-1", "trainer-2"),
                  sides: list[list[str]] = [["trainer-1"], ["trainer-2", "spare-1"]]) -> list[dict]:
    """inplace with a warm spare: trainer-1 and trainer-2 (`training`) train at world 2 in lineage 5.aaa, the
    third waits; at t=100 trainer-1's data path to the others is cut (`sides`) for 30 s; from t=103 each node
    in `apart` (name, world, lineage) prints a step line a second from step `first` until the heal."""
    line = lambda t, name, n, world, lineage: {**step(t, name, n, world), "lineage": lineage}
    events = [line(95 + i, name, 90 + i, 2, "5.aaa") for i in range(5) for name in training]
    events += [metric(99.0, "train", 94, 2),
               {"kind": "fault", "time": 100.0, "fault": "cut_peers", "target": sides[0][0], "cut_s": 30.0,
                "sides": sides}]
    events += [line(103.0 + i, name, first + i, world, lineage) for i in range(27) for name, world, lineage in apart]
    events += [{"kind": "heal", "time": 130.0, "action": "reconnect", "target": "trainer-1", "world_size": 2},
               line(131.5, "trainer-2", 130, 2, "8.ddd"), metric(131.5, "train", 130, 2)]
    return events


def test_with_a_spare_the_side_that_trains_at_full_size_during_a_cut_is_seen_and_is_no_split_brain():
    """The side holding the spare trains on at the world size before the cut, in a new generation: it
    trained during the cut (before: only lines below the world size counted, and nobody had)."""
    events = spare_cut_log([("trainer-2", 2, "6.bbb"), ("spare-1", 2, "6.bbb")], first=98)
    # Steps 95-97 in flight as the cut's rules took hold (100 steps/s), in the lineage of before: no going on.
    events += [{**step(100.0 + 0.01 * i, name, 94 + i, 2), "lineage": "5.aaa"} for i in (1, 2, 3)
               for name in ("trainer-1", "trainer-2")]
    (fault,), _ = report.measure(events, "inplace")
    assert fault["cut_trained"] == ["spare-1", "trainer-2"] and fault["cut_world"] == [2]
    assert fault["cut_gap_s"] == 1.0 and fault["split_brain"] is False and fault["recovery_s"] == 3.0


def test_a_cut_that_splits_no_generation_leaves_the_job_training_in_its_lineage_through_it():
    """trainer-2 waits as the spare and is cut off alone: trainer-1 and spare-1 train on in the same
    generation. They trained during the cut, at once (before: nobody had, recovered only at the heal)."""
    events = spare_cut_log([("trainer-1", 2, "5.aaa"), ("spare-1", 2, "5.aaa")], first=96,
                           training=("trainer-1", "spare-1"), sides=[["trainer-2"], ["trainer-1", "spare-1"]])
    (fault,), _ = report.measure(events, "inplace")
    assert fault["cut_trained"] == ["spare-1", "trainer-1"] and fault["recovery_s"] == 3.0
    assert fault["split_brain"] is False


def test_two_groups_training_one_step_with_different_states_are_a_split_brain_whatever_their_world_sizes():
    """The cut-off node trains alone (world 1) while the side with the spare trains at full size (world 2):
    two lineages take the same steps. Before, only the lines below the world size counted: one side."""
    events = spare_cut_log([("trainer-1", 1, "6.ccc"), ("trainer-2", 2, "7.bbb"), ("spare-1", 2, "7.bbb")])
    (fault,), heals = report.measure(events, "inplace")
    assert fault["split_brain"] is True and fault["cut_world"] == [1, 2]
    assert report.summarise([fault], heals)["split_brain"] is True
    # Both at full size (two spares, one each side): the same, where no world size tells them apart.
    events = spare_cut_log([("trainer-1", 2, "6.ccc"), ("spare-2", 2, "6.ccc"), ("trainer-2", 2, "7.bbb")])
    assert report.measure(events, "inplace")[0][0]["split_brain"] is True


def test_a_step_one_member_committed_alone_before_the_others_went_on_without_it_is_no_split_brain():
    """trainer-1 committed step 95 as the cut began (its all-reduce completed; trainer-2's watch had ended
    the generation): the others formed from step 94 and trained step 95 again from the same state."""
    events = spare_cut_log([("trainer-2", 2, "6.bbb"), ("spare-1", 2, "6.bbb")])
    events.append({**step(100.05, "trainer-1", 95, 2), "lineage": "5.aaa"})
    (fault,), _ = report.measure(events, "inplace")
    assert fault["split_brain"] is False and fault["cut_trained"] == ["spare-1", "trainer-2"]


def test_with_a_warm_spare_the_job_is_at_full_size_again_at_the_first_full_step_after_a_node_noticed():
    """inplace with --spares: the world never drops; full_again_s is the spare's swap (a step line at
    full size of another node after the survivor said a step was not committed), not a step of before."""
    step = lambda t, c, n, w: {"kind": "step", "time": t, "container": c, "step": n, "world": w}
    events = [metric(99.0, "train", 10, 2), step(99.0, "node-1", 10, 2),
              {"kind": "fault", "time": 100.0, "fault": "freeze_worker", "target": "node-2"},
              step(100.1, "node-1", 11, 2),     # committed before the fault reached it
              {"kind": "log", "time": 101.0, "container": "node-1", "line": "warning: step 12 not committed (x)"},
              step(101.6, "node-3", 12, 2), step(101.6, "node-1", 12, 2), metric(101.6, "train", 12, 2),
              {"kind": "heal", "time": 105.0, "action": "rejoin_by_itself", "target": "node-2", "world_size": 2},
              {"kind": "log", "time": 109.0, "container": "node-2", "line": "waiting as a spare: the job trains on 2"}]
    (fault,), (heal,) = report.measure(events, "inplace")
    assert fault["full_again_s"] == 1.6 and fault["steps_lost"] == 0 and heal["back_as_spare"]
    summary = report.summarise([fault], [heal])
    assert summary["full_again_s_median"] == 1.6 and summary["heals_back_as_spare"] == 1
    # A generation the watch ended between two steps fails no step: its member's line is the notice.
    between = [{**e, "line": "generation 3 ended before step 12 (a member stopped beating for 1 s): forming a "
                             "new one"} if e["kind"] == "log" and "not committed" in e["line"] else e for e in events]
    assert report.measure(between, "inplace")[0][0]["full_again_s"] == 1.6


# ---------------------------------------------------------------- slow nodes, flapping links, a steady rate

def slowed_log(named_at: float | None = 109.0) -> list[dict]:
    """Two nodes at 10 steps/s; node-2's CPU cut at t=100 for 90 s: 2 steps/s; named by both nodes at
    `named_at`; back at 10 steps/s from the quota's lift at t=190 (rows to t=230)."""
    events, step_no, t = [], 0, 60.0
    while t < 230.0:
        rate = 2.0 if 100.0 <= t < 190.0 else 10.0
        step_no += 1
        events.append(metric(round(t, 3), "train", step_no, 2))
        t += 1.0 / rate
    events += [{"kind": "fault", "time": 100.0, "fault": "slow_node", "target": "ftt-trainer-2",
                "node": "node-127.0.0.9", "cpus": 0.2, "restart_expected": False},
               {"kind": "heal", "time": 190.0, "action": "restore_cpus", "target": "ftt-trainer-2", "world_size": 2}]
    line = "node node-127.0.0.9 is slow: its steps take 4.8x the others' for 10 s"
    if named_at is not None:
        events += [{"kind": "log", "time": named_at, "container": c, "line": line}
                   for c in ("ftt-trainer-1", "ftt-trainer-2")]
    return sorted(events, key=lambda e: e["time"])


@pytest.mark.parametrize("mode", ["elastic", "inplace"])
def test_a_slow_node_is_measured_by_when_it_was_named_and_the_pace_before_during_and_after(mode):
    (fault,), (heal,) = report.measure(slowed_log(), mode)
    assert (fault["named_s"], fault["named_by"], fault["detection_s"]) == (9.0, 2, 9.0)
    assert (fault["pace_before"], fault["pace_during"], fault["pace_last"], fault["pace_after"]) == (10.0, 2.0, 2.0, 10.0)
    assert (fault["pace_during_ratio"], fault["pace_last_ratio"]) == (0.2, 0.2) and fault["steps_lost"] == 0
    # full pace again: the first 5 s stretch at 0.9 of the pace before after it fell is the one from the lift
    assert 89.0 <= fault["full_pace_s"] <= 90.0
    summary = report.summarise([fault], [heal])
    assert (summary["slow_named_s_max"], summary["slow_pace_last_ratio_min"]) == (9.0, 0.2)
    assert report.named_slow_falsely(slowed_log()) == 0


def test_a_slow_node_row_keeps_what_the_node_chose_in_its_own_words():
    chose = "node node-127.0.0.9: 5.0 node-steps/s with it, 10.0 without it (estimated from the step times): the " \
            "job leaves it out; it comes back on trial in 20 s"
    other = "node node-127.0.0.5 steps aside for the waiting spare (3.0x the others' step time): it waits as a spare"
    events = sorted(slowed_log() + [{"kind": "log", "time": 109.5, "container": "ftt-trainer-2", "line": chose},
                                    {"kind": "log", "time": 300.0, "container": "ftt-trainer-2", "line": chose},
                                    {"kind": "log", "time": 120.0, "container": "ftt-trainer-1", "line": other}],
                    key=lambda e: e["time"])
    (fault,), _ = report.measure(events, "inplace")
    assert fault["chose"] == [chose], "its own line, within its slowdown"
    assert all(any(mark in line for mark in report.LOG_MARKS) for line in (chose, other)), "the runner keeps them"


def test_a_slow_node_nobody_named_is_said_and_a_line_no_slow_node_explains_is_a_false_alarm():
    (fault,), _ = report.measure(slowed_log(named_at=None), "torchft")
    assert fault["named_s"] is None and fault["named_by"] == 0
    assert report.summarise([fault], [])["slow_named_s_max"] is None
    events = slowed_log() + [
        {"kind": "log", "time": 50.0, "container": "ftt-trainer-1", "line": "node node-127.0.0.9 is slow: its "
                                                                            "steps take 2.1x the others' for 10 s"},
        {"kind": "log", "time": 120.0, "container": "ftt-trainer-2", "line": "node node-127.0.0.5 is slow: its "
                                                                             "steps take 2.1x the others' for 10 s"}]
    assert report.named_slow_falsely(sorted(events, key=lambda e: e["time"])) == 2


def test_a_flapping_link_is_measured_by_the_pace_while_it_flaps_and_the_regroups():
    step = lambda t, c, n, w: {"kind": "step", "time": t, "container": c, "step": n, "world": w}
    events = [metric(70 + i * 0.1, "train", i, 3) for i in range(300)]                 # 10 steps/s to t=100
    events += [{"kind": "fault", "time": 100.0, "fault": "flap", "target": "ftt-trainer-3", "node": "node-x",
                "flaps": 2, "flap_cut_s": 2.0, "flap_up_s": 4.0}]
    events += [metric(100 + i * 0.125, "train", 300 + i, 2 if i < 60 else 3) for i in range(96)]   # 8/s: 0.8
    events += [step(101.0, "ftt-trainer-1", 308, 2), step(108.0, "ftt-trainer-1", 364, 3),
               step(109.0, "ftt-trainer-1", 372, 3)]
    events += [{"kind": "heal", "time": 112.0, "action": "stop_flapping", "target": "ftt-trainer-3", "world_size": 3}]
    events += [metric(112 + i * 0.1, "train", 396 + i, 3) for i in range(100)]
    (fault,), _ = report.measure(sorted(events, key=lambda e: e["time"]), "inplace")
    assert (fault["pace_before"], fault["pace_during"], fault["pace_during_ratio"]) == (10.0, 8.0, 0.8)
    assert fault["world_changes"] == 1 and fault["steps_lost"] == 0 and "named_s" not in fault
    assert report.summarise([fault], [])["flap_pace_during_ratio_min"] == 0.8


def steady_log() -> list[dict]:
    """Two nodes at 10 steps/s (batch 32: 640 images/s) from t=0.05; faults at 100, 120, 140 (every 20 s),
    each leaving one node to train alone at 10 steps/s for 10 s; heals at 110, 130, 150."""
    events, step_no = [], 0
    for i in range(2000):
        t = i * 0.1 + 0.05
        world = 1 if any(f <= t < f + 10 for f in (100.0, 120.0, 140.0)) else 2
        step_no += 1
        events.append(metric(round(t, 3), "train", step_no, world))
    for f in (100.0, 120.0, 140.0):
        events += [{"kind": "fault", "time": f, "fault": "kill_worker", "target": "n2"},
                   {"kind": "heal", "time": f + 10, "action": "start", "target": "n2", "world_size": 2}]
    return sorted(events, key=lambda e: e["time"])


def test_a_steady_rate_counts_the_images_kept_in_the_fault_window_against_the_fault_free_pace():
    """Window 100 -> 160 (the last fault + every): 30 s at world 1 and 30 s at world 2 = 600 x 32 and
    600 x 64 images, against 60 s x 10 steps/s x 2 x 32: 0.75."""
    rate = report.steady_rate(steady_log(), 20.0, 32)
    assert rate == {"every_s": 20.0, "fault_window_s": 60.0, "committed_over_fault_free": 0.75, "every_s_kept": 20.0,
                    "starts": 0, "starts_s": 0, "starts_lost_s": 0, "starts_lost_share": 0.0}
    assert report.steady_rate([metric(1.0, "train", 1, 2)], 20.0, 32)["committed_over_fault_free"] is None


def test_a_steady_rate_says_what_the_job_lost_while_processes_started_in_its_window():
    """10 steps/s; a fault at 100; a process started from 100 to 110 (exec to its start row) while the job
    trained at 5 steps/s: 5 s at the pace before lost, a quarter of the 20 s window. A start whose exec
    came before the window is not the window's."""
    events = [metric(t / 10, "train", t, 2) for t in range(1, 1001)]                    # to t=100 at 10/s
    events += [metric(100 + t / 5, "train", 1000 + t, 2) for t in range(1, 51)]         # to t=110 at 5/s
    events += [metric(110 + t / 10, "train", 1050 + t, 2) for t in range(1, 101)]       # to t=120 at 10/s
    events += [{"kind": "fault", "time": 100.0, "fault": "kill_worker", "target": "n2"},
               metric(110.0, "start", 1050, None, process_started=100.0),
               metric(95.0, "start", 950, None, process_started=90.0)]
    rate = report.steady_rate(sorted(events, key=lambda e: e["time"]), 20.0, 32)
    assert (rate["starts"], rate["starts_s"], rate["starts_lost_s"], rate["starts_lost_share"]) == (1, 10.0, 5.0, 0.25)


def test_the_tables_show_slow_nodes_flaps_and_a_steady_rate_beside_torchfts_published_figures(capsys):
    faults, heals = report.measure(slowed_log(), "inplace")
    summary = {**report.summarise(faults, heals), **report.pace_change(slowed_log()), "final_test_acc": None,
               "baseline_test_acc": None, "goodput": 0.8, "every_s": 60.0, "every_s_kept": 61.2,
               "committed_over_fault_free": 0.91, "badput_s": {"startup": 4.0, "detection": 1.5, "regroup": 2.0}}
    tables.print_table({"faults": faults, "heals": heals, "summary": summary})
    assert ("named after 9.0 s by 2 nodes; steps/s before 10.0, during 2.0 (0.2), last 30 s 2.0 (0.2), after 10.0"
            in capsys.readouterr().out)
    lines = tables.compare({"inplace-spare": {"faults": faults, "heals": heals, "summary": summary}})
    assert "| slow_node | inplace-spare | 1 | 9.0 | 10.0 | 2.0 (0.2) | 2.0 (0.2) | 10.0 |" in "\n".join(lines)
    assert "| inplace-spare | 60.0 (61.2) | 1 | 0.91 | - | 0.8 | 4.0 | 1.5 | 2.0 | 0.0 |" in "\n".join(lines)
    assert lines[-1].startswith("| torchft, published (300 GPUs, June 2025) | 60 | - | 0.823 (ceiling 0.833) | - | 0.812")
