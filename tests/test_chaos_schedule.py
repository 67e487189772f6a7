"""scripts/chaos/schedule.py: which faults a chaos run injects, and at which points of the job's progress;
and the parts of the faults themselves that run without docker (scripts/chaos/host.py, faults.py)."""
from __future__ import annotations

import argparse
import random
import re
import shutil
from pathlib import Path

import pytest

from app.training.object_store import StoreInvalid
from app.training.snapshot import write_snapshot
from app.training.snapshot_files import step_of_name
from scripts.chaos import schedule
from scripts.chaos.host import cut_ruleset
from tests.test_snapshot import make_parts

pytestmark = pytest.mark.unit


def test_every_kind_comes_once_before_any_repeats():
    kinds = schedule.plan(random.Random(0), 2 * len(schedule.FAULTS))
    assert sorted(kinds[:len(schedule.FAULTS)]) == sorted(schedule.FAULTS)
    assert schedule.plan(random.Random(3), 3, ["partition"]) == ["partition"] * 3


@pytest.mark.parametrize("count, epochs", [(3, 40), (20, 400), (1, 5)])
def test_faults_come_one_per_slice_of_progress_and_leave_the_end_to_train(count, epochs):
    """Points of progress, not of the clock: the same on a fast machine and a slow one, every fault
    due before the job ends, and the last half of the epochs left to train after them."""
    moments = schedule.moments(random.Random(1), count, epochs)
    width = schedule.SPAN * epochs / count
    assert len(moments) == count and moments == sorted(moments)
    assert all(i * width < m <= (i + 1) * width for i, m in enumerate(moments))
    assert moments[-1] <= schedule.SPAN * epochs
    assert moments == schedule.moments(random.Random(1), count, epochs), "the same seed, the same moments"


def test_a_run_that_measures_its_pace_first_has_its_faults_in_the_first_half_of_the_epochs_left():
    """--pace-before: the job trains a while at full size, then the faults come in the first half of
    what is left; without the window (start 0) the moments are those drawn before it existed."""
    moments = schedule.moments(random.Random(1), 20, 600, start=80.0)
    assert 80 < moments[0] and moments[-1] <= 80 + schedule.SPAN * (600 - 80) and moments == sorted(moments)
    assert schedule.moments(random.Random(1), 3, 60, start=0.0) == schedule.moments(random.Random(1), 3, 60)
    assert schedule.moments(random.Random(1), 3, 60) == [3.07, 18.78, 28.11]   # as drawn before the window existed


def test_a_freeze_picks_training_processes_only_not_their_snapshot_saver(monkeypatch):
    """`-m app.train` is a prefix of the saver's `-m app.training.saver`: a freeze that stopped the saver
    instead of a worker left the job waiting for a recovery that never came (the docker tier's chaos line)."""
    from scripts.chaos import host
    monkeypatch.setattr(host, "_processes", lambda container: [
        (1, "/opt/venv/bin/python -u -m app.train"), (2, "/opt/venv/bin/python -m app.training.saver 48"),
        (3, "python -m app.launch --nproc-per-node 1 --standalone -m app.train"),
        (4, "/opt/venv/bin/python -u -m app.train --epochs 3")])
    assert host.worker_pids(object()) == [1, 4]


def test_damage_then_wipe_stops_every_process_of_a_node_but_its_saver(monkeypatch):
    """The saver alone uploads on: no trainer hands it a newer snapshot, no launcher restarts one."""
    from scripts.chaos import host
    monkeypatch.setattr(host, "_processes", lambda container: [
        (1, "/bin/bash /entrypoint.sh"), (2, "python -m app.launch --nproc-per-node 1 -m app.train"),
        (3, "/opt/venv/bin/python -u -m app.train"), (4, "/opt/venv/bin/python -m app.training.saver 48 "
                                                         "--snapshot-url s3://snapshots/run")])
    assert host.all_but_saver_pids(object()) == [1, 2, 3]


class FolderStore:
    """An object store stand-in: its committed snapshots are local step-N folders, downloaded by copying;
    a step in `unreadable` has a commit that cannot be read."""

    def __init__(self, folders: list[Path], unreadable: tuple[int, ...] = ()) -> None:
        self.folders = {step_of_name(f.name): f for f in folders}
        self.unreadable = unreadable

    def committed(self) -> list[int]:
        return sorted(self.folders, reverse=True)

    def download(self, step: int, directory: Path) -> Path:
        if step in self.unreadable:
            raise StoreInvalid("its commit.json is unreadable")
        return Path(shutil.copytree(self.folders[step], directory / self.folders[step].name))


def test_the_newest_good_upload_is_the_newest_commit_that_reads_back(tmp_path):
    """damage_then_wipe's bound: a commit whose files do not match their manifest (the store took a
    snapshot damaged on disk) or that cannot be downloaded is passed over, and named."""
    from scripts.chaos.faults import _flip_bytes, uploads_checked

    folders = [write_snapshot(tmp_path, step, make_parts(step)) for step in (40, 45, 50)]
    assert uploads_checked(FolderStore(folders)) == (50, [])
    _flip_bytes(folders[1])
    assert uploads_checked(FolderStore(folders, unreadable=(50,))) == (40, [50, 45])
    _flip_bytes(folders[0])
    assert uploads_checked(FolderStore(folders[:2])) == (0, [45, 40])


def test_a_run_without_the_object_store_never_draws_the_faults_that_need_it():
    """--no-object-store (the store's cost measured apart): wipe_disks and damage_then_wipe would wait for
    a store that is not there."""
    without = schedule.kinds(None, object_store=False)
    assert schedule.NEEDS_OBJECT_STORE == ("wipe_disks", "damage_then_wipe")
    assert not set(without) & set(schedule.NEEDS_OBJECT_STORE) and len(without) == len(schedule.FAULTS) - 2
    assert schedule.kinds(None, object_store=True) == list(schedule.FAULTS)
    assert schedule.kinds(["partition"], object_store=False) == ["partition"]


def test_asking_for_wipe_disks_without_the_object_store_is_refused_with_one_line(capsys):
    from scripts.chaos.__main__ import main

    assert main(["--no-object-store", "--only", "wipe_disks,partition"]) == 2
    assert capsys.readouterr().err == ("error: wipe_disks needs the object store; "
                                       "drop --no-object-store or the kind\n")
    assert main(["--no-object-store", "--only", "damage_then_wipe"]) == 2
    assert capsys.readouterr().err.startswith("error: damage_then_wipe needs the object store")


def test_a_fault_that_falls_behind_into_the_last_fifth_of_the_epochs_is_left_out():
    """The faults are due in the first half, but each waits for the job to recover: a job faster
    than its faults are healed met its last one as it ended, and no pace after them was measured."""
    assert not schedule.too_late(480, 600) and schedule.too_late(481, 600)
    assert max(schedule.moments(random.Random(2), 20, 600, start=150)) <= schedule.LAST_FAULT_BY * 600


class _Seen:
    """The observer as far as a kill's heal reads it: the job went on without the node, then finished."""

    def __init__(self, finished: bool) -> None:
        self.events: list[dict] = []
        self._finished = finished

    def record(self, **event):
        self.events.append(event)
        return {**event, "time": 0.0}

    def wait_without(self, *_):
        return True

    def wait_training(self, *_):
        return True

    def finished(self) -> bool:
        return self._finished


class _Node:
    name = "trainer-1"

    def __init__(self) -> None:
        self.started = 0

    def start(self) -> None:
        self.started += 1


@pytest.mark.parametrize("finished", [True, False])
def test_a_killed_node_is_started_again_only_while_the_job_still_trains(finished, monkeypatch):
    """The survivors of a kill late in the job may train to its end before the node is started again:
    a node started into a finished job has nothing to rejoin, so no heal is recorded (its rejoin would
    read as never) and the node stays down; otherwise it is started and its heal recorded."""
    from scripts.chaos.faults import Injector

    monkeypatch.setattr("time.sleep", lambda _s: None)
    seen, node = _Seen(finished), _Node()
    injector = Injector.__new__(Injector)
    injector.seen, injector.rng = seen, random.Random(0)
    injector.job = type("Job", (), {"nodes": 2, "spares": 0, "trainers": lambda self, running=False: [object()]})()
    injector.args = type("Args", (), {"nproc": 1, "fault_timeout": 1.0})()
    injector._recover_then_heal({"time": 0.0}, node)
    kinds = [e["kind"] for e in seen.events]
    assert (node.started, kinds) == ((0, ["no_heal"]) if finished else (1, ["heal"]))


def test_a_cut_drops_packets_between_the_sides_sockets_both_ways_and_no_others():
    """nft marks a packet with its sender's side on output and drops it on input where the receiving
    socket is of another side: between sides, both ways; within a side and to or from the store
    (a container of neither side), nothing."""
    rules = cut_ruleset("t", [["/docker/a"], ["/docker/b", "/docker/c"]], "unified")
    marks = dict(re.findall(r'"unified/docker/(\w)" meta mark set (0x\w+)', rules))
    dropped = set(re.findall(r'meta mark (0x\w+) socket cgroupv2 level 2 "unified/docker/(\w)" drop', rules))
    assert marks == {"a": "0x46540000", "b": "0x46540001", "c": "0x46540001"}
    assert dropped == {(marks["a"], "b"), (marks["a"], "c"), (marks["b"], "a")}
    assert "hook output" in rules and "hook input" in rules and "level 2" in rules


def test_the_chaos_jobs_live_where_composes_variables_say(monkeypatch, capsys):
    """COMPOSE_PROJECT_NAME, RDZV_PORT, OBJECTS_PORT and LIGHTHOUSE_PORT place the chaos jobs as they
    place `make up`'s: a second checkout's runs beside the first's."""
    from scripts.chaos.__main__ import main, parser

    monkeypatch.setenv("COMPOSE_PROJECT_NAME", "ftt-other")
    monkeypatch.setenv("RDZV_PORT", "29601")
    monkeypatch.setenv("OBJECTS_PORT", "8601")
    monkeypatch.setenv("LIGHTHOUSE_PORT", "29701")
    args = parser().parse_args([])
    assert (args.project, args.port, args.objects_port, args.lighthouse_port) == ("ftt-other", 29601, 8601, 29701)
    monkeypatch.setenv("LIGHTHOUSE_PORT", "x")
    assert main([]) == 2
    assert capsys.readouterr().err == "error: LIGHTHOUSE_PORT must be a port number, got 'x'\n"


def test_a_cut_on_a_host_without_nft_is_refused_with_one_line(monkeypatch, capsys):
    from scripts.chaos import __main__ as chaos

    monkeypatch.setattr(chaos.shutil, "which", lambda name: None)
    assert chaos.main(["--only", "partition,cut_peers"]) == 2
    assert capsys.readouterr().err == ("error: cut_peers needs nft (apt-get install nftables), "
                                       "or leave the kind out with --only\n")


# ---------------------------------------------------------------- a steady fault rate, slow nodes, flaps

class _Clock:
    """time.time and time.sleep of the runner, moved by the test: a run of minutes in no time."""

    def __init__(self) -> None:
        self.now = 1000.0

    def time(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += max(0.0, seconds)


def test_a_steady_rate_injects_each_fault_at_its_moment_and_one_that_ran_late_at_once(monkeypatch):
    """--every 20: due at +20, +40, +60, +80 from the pace window's end. The second fault takes 30 s to
    heal: the third is due before it is over and comes at once; the fourth is back on its moment."""
    from scripts.chaos import runner

    clock = _Clock()
    monkeypatch.setattr(runner, "time", clock)
    injected: list[tuple[str, float]] = []
    lasting = iter([5.0, 30.0, 5.0, 5.0])

    class Seen:
        def wait_training(self, *_):
            return True

        def record(self, **_):
            return {}

        def finished(self):
            return False

        def epoch(self):
            return 1.0

        def wait_finished(self, _):
            return True

    class Injector:
        def inject(self, kind):
            injected.append((kind, clock.now))
            clock.now += next(lasting)

    args = argparse.Namespace(nodes=2, nproc=1, start_timeout=1.0, pace_before=0.0, faults=4, only=["kill_worker"],
                              object_store=True, every=20.0, epochs=100, finish_timeout=1.0)
    assert runner.inject_all(args, Seen(), Injector(), random.Random(0), started=clock.now)
    assert injected == [("kill_worker", 1020.0), ("kill_worker", 1040.0), ("kill_worker", 1070.0),
                        ("kill_worker", 1080.0)]
    assert schedule.every(0.0, 3, 15.0) == [15.0, 30.0, 45.0]


def test_a_steady_rate_runs_every_set_up_and_the_quick_faults_unless_told(monkeypatch):
    """`--every 60 --faults 8`: elastic, torchft, inplace and inplace with a spare, each against its pace
    in the minute before its first fault; inplace-spare is inplace with one spare, in a folder of its own."""
    from scripts.chaos import __main__ as chaos
    from scripts.chaos.runner import setup_args

    seen: list[argparse.Namespace] = []
    monkeypatch.setattr(chaos, "refusal", lambda args: None)
    monkeypatch.setattr(chaos, "run_modes", lambda args: seen.append(args) or {"modes": {}, "table": []})
    assert chaos.main(["--every", "60", "--faults", "8"]) == 0
    (args,) = seen
    assert args.ft == ["elastic", "torchft", "inplace", "inplace-spare"] and args.only == list(schedule.EVERY_KINDS)
    assert args.pace_before == 60.0
    spare = setup_args(args, "inplace-spare")
    assert (spare.ft, spare.spares, spare.out.endswith("/inplace-spare"), spare.run_name) == (
        "inplace", 1, True, "chaos-spare")
    assert (setup_args(args, "torchft").ft, setup_args(args, "torchft").spares) == ("torchft", 0)


def test_a_slow_node_and_a_flap_need_what_they_need_and_say_so_in_one_line(monkeypatch, capsys):
    from scripts.chaos.__main__ import main

    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert main(["--only", "flap"]) == 2
    assert capsys.readouterr().err == "error: flap needs nft (apt-get install nftables), or leave the kind out with --only\n"
    assert main(["--only", "slow_node", "--slow-cpus", "0"]) == 2
    assert capsys.readouterr().err == "error: --slow-cpus must be more than 0 (a share of a core)\n"
    assert main(["--every", "-1"]) == 2
    assert capsys.readouterr().err.startswith("error: --every must be 0")


def test_a_slow_node_cuts_and_lifts_its_quota_and_a_flap_cuts_and_heals_the_link_as_often_as_asked(monkeypatch):
    """The quota is cut, held for --slow-for, and lifted even when the wait breaks; the flap's cut is made
    --flaps times, each healed, and healed once more at the end."""
    from scripts.chaos import faults

    monkeypatch.setattr("time.sleep", lambda _s: None)
    calls: list[tuple] = []
    monkeypatch.setattr(faults, "set_cpus", lambda container, cpus: calls.append(("cpus", container.name, cpus)))

    class Cut:
        def __init__(self, sides):
            calls.append(("sides", [[c.name for c in side] for side in sides]))

        def cut(self):
            calls.append(("cut",))

        def heal(self):
            calls.append(("heal",))

    monkeypatch.setattr(faults, "PeerCut", Cut)
    seen = _Seen(False)
    nodes = [type("C", (), {"name": f"ftt-trainer-{i}"})() for i in (1, 2, 3)]
    injector = faults.Injector.__new__(faults.Injector)
    injector.seen, injector.rng = seen, random.Random(0)
    injector.job = type("Job", (), {"nodes": 3, "spares": 0, "trainers": lambda self, running=False: nodes,
                                    "writer_container": lambda self: None, "node_addr": lambda self, c: "127.0.0.7"})()
    injector.args = argparse.Namespace(nproc=1, fault_timeout=1.0, slow_cpus=0.2, slow_for=90.0, flaps=3,
                                       flap_cut=2.0, flap_up=4.0)
    injector.inject("slow_node")
    victim = calls[0][1]
    assert calls == [("cpus", victim, 0.2), ("cpus", victim, None)]
    assert seen.events[0]["node"] == "node-127.0.0.7" and seen.events[1]["action"] == "restore_cpus"
    calls.clear()
    injector.inject("flap")
    assert calls[1:] == [("cut",), ("heal",)] * 3 + [("heal",)]
    assert [e.get("fault") or e.get("action") for e in seen.events[2:]] == ["flap", "stop_flapping"]
