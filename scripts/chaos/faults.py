"""The fault injections: each one picks its victim, records the fault, makes it happen, and undoes it
(a heal, also recorded) once the job has shown how it copes; scripts/chaos/host.py makes those
docker has no verb for."""
from __future__ import annotations

import argparse
import os
import random
import signal
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from app.core.config import SURVIVOR_MODES, Config
from app.training.object_store import ObjectStore, StoreInvalid
from app.training.snapshot import SUFFIX, TMP_PREFIX, SnapshotInvalid, complete_snapshots, read_snapshot
from app.training.snapshot_files import step_of_name
from scripts.chaos.host import Partition, PeerCut, SnapshotVolume, all_but_saver_pids, set_cpus, worker_pids
from scripts.chaos.observe import Observer
from scripts.chaos.report import SAVE_FAILED_MARK, Event
from scripts.job import ComposeJob

# damage_then_wipe: how long the savers upload alone. An uploader begins one upload every
# --upload-every-seconds at most (the chaos jobs keep the trainer's default), the newest snapshot
# waiting; the damaged one goes up within that interval, plus the upload itself on a busy host.
UPLOAD_CHANCE_S = Config.upload_every_seconds + 10.0
# ... after the write a saver held when its trainer stopped is done: well under a second for these
# snapshots, and a folder left by a saver killed mid-write must not hold the fault up for long.
WRITE_DONE_S = 10.0


class Injector:
    """Injects one fault kind at a time into a running job (`inject(kind)`, kinds: schedule.FAULTS)."""

    def __init__(self, job: ComposeJob, observer: Observer, volume: SnapshotVolume, store: ObjectStore | None,
                 rng: random.Random, args: argparse.Namespace) -> None:
        self.job, self.seen, self.volume, self.store, self.rng, self.args = job, observer, volume, store, rng, args

    def inject(self, kind: str) -> None:
        getattr(self, f"_{kind}")()

    def _victim(self, writer: bool) -> Any:
        """A running node that writes the snapshots (rank 0's in elastic mode), or one that does not."""
        running = self.job.trainers(running=True)
        if not running:
            raise RuntimeError("no trainer container is running: the job is down")
        if self.job.spares:     # a node that trains, not a spare waiting (the fault would cost the job nothing)
            running = [c for c in running if c.name in self.seen.training()] or running
        holder = self.job.writer_container()
        pool = [c for c in running if (c == holder) == writer] if holder is not None else running
        return self.rng.choice(pool or running)

    def _kill(self, fault: str, writer: bool) -> None:
        victim = self._victim(writer)
        fault_event = self.seen.record(kind="fault", fault=fault, target=victim.name)
        victim.kill()
        self._recover_then_heal(fault_event, victim)

    def _kill_worker(self) -> None:
        self._kill("kill_worker", writer=False)

    def _kill_rank0(self) -> None:
        self._kill("kill_rank0", writer=True)

    def _kill_during_save(self) -> None:
        # These nodes share one snapshot directory (the run's bind mount) and one of them writes it
        # (rank 0 in elastic mode, the lease holder in torchft mode): only its kill can land mid-save.
        victim = self._victim(writer=True)
        deadline, hit = time.time() + 120, False
        while time.time() < deadline and not hit:
            hit = self._write_in_flight()
            if not hit:
                time.sleep(0.001)
        fault_event = self.seen.record(kind="fault", fault="kill_during_save", target=victim.name, mid_save=hit)
        victim.kill()
        self._recover_then_heal(fault_event, victim)

    def _restart_fast(self) -> None:
        victim = self._victim(writer=self.rng.random() < 0.5)
        self.seen.record(kind="fault", fault="restart_fast", target=victim.name)
        t0 = time.time()
        victim.restart(timeout=0)
        self.seen.record(kind="heal", action="back_from_restart", target=victim.name, world_size=self._world())
        self.seen.wait_training(self._world(), t0, self.args.fault_timeout)

    def _pause(self) -> None:
        victim = self._victim(writer=self.rng.random() < 0.5)
        fault_event = self.seen.record(kind="fault", fault="pause", target=victim.name, pause_s=self.args.pause)
        victim.pause()
        self._wait_on_without(fault_event, self.args.pause)
        time.sleep(max(0.0, fault_event["time"] + self.args.pause - time.time()))
        self.seen.record(kind="heal", action="unpause", target=victim.name, world_size=self._world())
        victim.unpause()
        self.seen.wait_training(self._world(), time.time(), self.args.fault_timeout)

    def _freeze_worker(self) -> None:
        """SIGSTOP one training process; its node's agent runs on and sees it alive. The other ranks
        (elastic mode) or the Lighthouse (torchft mode) miss its heartbeat and go on without it; its
        node's launcher kills it once it has been stopped past the heartbeat timeout (app/launch.py),
        torchrun starts it again, and the node rejoins by itself."""
        victim = self._victim(writer=self.rng.random() < 0.5)
        pid = self.rng.choice(worker_pids(victim))
        fault_event = self.seen.record(kind="fault", fault="freeze_worker", target=victim.name, pid=pid)
        os.kill(pid, signal.SIGSTOP)
        if self.job.spares:
            self._wait_on_without(fault_event, self.args.fault_timeout)
        else:
            self.seen.wait_recovered(fault_event["time"], self._world(), self.args.fault_timeout)
        self.seen.record(kind="heal", action="rejoin_by_itself", target=victim.name, world_size=self._world(),
                         since=fault_event["time"])
        self.seen.wait_training(self._world(), time.time(), self.args.fault_timeout)

    def _partition(self) -> None:
        """Cut one node off the network while it runs; reconnect it once the others train without it."""
        victim = self._victim(writer=self.rng.random() < 0.5)
        cut = Partition(victim)
        fault_event = self.seen.record(kind="fault", fault="partition", target=victim.name)
        cut.cut()
        try:
            self._wait_on_without(fault_event, self.args.fault_timeout)
            time.sleep(self.rng.uniform(*self.args.gap))
        finally:
            self.seen.record(kind="heal", action="reconnect", target=victim.name, world_size=self._world())
            cut.heal()
        self.seen.wait_training(self._world(), time.time(), self.args.fault_timeout)

    def _cut_peers(self) -> None:
        """One node's data path to its peers cut for --cut seconds, the store still reached by all: the
        others train on without it while it beats on."""
        victim = self._victim(writer=self.rng.random() < 0.5)
        self._cut("cut_peers", victim.name, [[victim], [c for c in self.job.trainers(running=True) if c != victim]])

    def _split_halves(self) -> None:
        """The nodes split into two halves (at random; the first the smaller when they are odd) that
        both reach the store, for --cut seconds: one side trains on, never both."""
        running = self.job.trainers(running=True)
        self.rng.shuffle(running)
        half = len(running) // 2
        self._cut("split_halves", f"{half}|{len(running) - half} nodes", [running[:half], running[half:]])

    def _cut(self, fault: str, target: str, sides: list[list[Any]]) -> None:
        cut = PeerCut(sides)
        fault_event = self.seen.record(kind="fault", fault=fault, target=target, cut_s=self.args.cut,
                                       sides=[[c.name for c in side] for side in sides])
        cut.cut()
        try:
            time.sleep(max(0.0, fault_event["time"] + self.args.cut - time.time()))
        finally:
            self.seen.record(kind="heal", action="reconnect", target=target, world_size=self._world())
            cut.heal()
        self.seen.wait_training(self._world(), time.time(), self.args.fault_timeout)

    def _slow_node(self) -> None:
        """One training node's CPU quota cut to --slow-cpus for --slow-for seconds (docker update --cpus), then
        lifted: the node alive and beating, only slow. The event names the node as its peers' lines do
        (node-ADDRESS), so that the report finds the line naming it."""
        victim = self._victim(writer=self.rng.random() < 0.5)
        fault_event = self.seen.record(kind="fault", fault="slow_node", target=victim.name,
                                       node=f"node-{self.job.node_addr(victim)}", cpus=self.args.slow_cpus,
                                       slow_s=self.args.slow_for, restart_expected=False)
        set_cpus(victim, self.args.slow_cpus)
        try:
            time.sleep(max(0.0, fault_event["time"] + self.args.slow_for - time.time()))
        finally:
            self.seen.record(kind="heal", action="restore_cpus", target=victim.name, world_size=self._world())
            set_cpus(victim, None)
        self.seen.wait_training(self._world(), time.time(), self.args.fault_timeout)

    def _flap(self) -> None:
        """One training node's data path to its peers cut for --flap-cut seconds and healed for --flap-up,
        --flaps times (every node still reaching the store): a flapping link."""
        victim = self._victim(writer=self.rng.random() < 0.5)
        cut = PeerCut([[victim], [c for c in self.job.trainers(running=True) if c != victim]])
        self.seen.record(kind="fault", fault="flap", target=victim.name, node=f"node-{self.job.node_addr(victim)}",
                         flaps=self.args.flaps, flap_cut_s=self.args.flap_cut, flap_up_s=self.args.flap_up)
        try:
            for _ in range(self.args.flaps):
                cut.cut()
                time.sleep(self.args.flap_cut)
                cut.heal()
                time.sleep(self.args.flap_up)
        finally:
            cut.heal()
            self.seen.record(kind="heal", action="stop_flapping", target=victim.name, world_size=self._world())
        self.seen.wait_training(self._world(), time.time(), self.args.fault_timeout)

    def _disk_full(self) -> None:
        """Fill the snapshot volume until a save fails, let the job train on, then free the space."""
        fault_event = self.seen.record(kind="fault", fault="disk_full", target="snapshot volume", restart_expected=False)
        filled = self.volume.fill()
        self.seen.wait_for(lambda ev: any(e["kind"] == "log" and SAVE_FAILED_MARK in e["line"]
                                          and e["time"] > fault_event["time"] for e in ev), self.args.fault_timeout,
                           since=fault_event["time"])
        time.sleep(self.rng.uniform(*self.args.gap))
        self.seen.record(kind="heal", action="free_space", target=f"{filled >> 20} MB", world_size=self._world())
        self.volume.free()

    def _corrupt_newest(self) -> None:
        """Corrupt the newest snapshot on disk, then kill every node at once (paused first, so that none
        can write a newer one) and start them: the job must skip it and resume from the one before."""
        running = self.job.trainers(running=True)
        for node in running:
            node.pause()
        snapshots = complete_snapshots(self.job.run_dir / "snapshots")
        if not snapshots:
            for node in running:
                node.unpause()
            return self._kill_worker()
        _flip_bytes(snapshots[0])
        fault_event = self.seen.record(kind="fault", fault="corrupt_newest", target=snapshots[0].name, survivor=False)
        for node in running:
            node.kill()
        time.sleep(self.rng.uniform(0.5, 2.0))
        self.seen.record(kind="heal", action="start_all", target=f"{len(running)} nodes", world_size=self._world())
        for node in running:
            node.start()
        self.seen.wait_training(self._world(), fault_event["time"], self.args.fault_timeout)

    def _wipe_disks(self) -> None:
        """Every node's snapshots lost at once, as when every host is replaced: the nodes paused (nothing
        is written or uploaded past this point), the newest snapshot in the object store noted, every
        node killed and the snapshot directory emptied, then the nodes started with nothing on disk.
        The job must resume from the object store at that snapshot: the steps since it are the most it
        may lose (report.py: steps_since_upload, lost_beyond_upload)."""
        running = self.job.trainers(running=True)
        for node in running:
            node.pause()
        fault_event = self.seen.record(kind="fault", fault="wipe_disks", target=f"{len(running)} nodes",
                                       survivor=False, uploaded_step=self._newest_uploaded())
        self._kill_wipe_start(running, fault_event)

    def _damage_then_wipe(self) -> None:
        """A snapshot damaged on disk before its upload, then every node's disk lost (issue 44). Once the
        disk holds a snapshot the store lacks, every process of every node is stopped but its snapshot
        saver, bytes of the newest snapshot are flipped (as corrupt_newest does) and the savers upload
        alone for one upload interval: with no trainer to hand them a newer snapshot, the damaged one is
        what the uploader sends next (it sends only the newest waiting, and the disk's rotation would
        soon prune it). The store must refuse it. Then as wipe_disks, against the newest committed
        snapshot in the store whose files match their manifest (uploaded_step): the job must resume
        there, not older and not at step 0. The event names the damaged step (None: every snapshot on
        disk was up already, and the fault is a plain wipe) and the newer commits that do not match
        their manifest (bad_uploads: the damaged step, where the store took it). Its stall includes
        the runner's stop."""
        self._wait_until(lambda: self._newest_on_disk()[1] > self._newest_uploaded(), self.args.fault_timeout)
        running = self.job.trainers(running=True)
        for pid in [pid for node in running for pid in all_but_saver_pids(node)]:
            os.kill(pid, signal.SIGSTOP)
        time.sleep(1.0)         # a request sent just before the stop reaches its saver, which begins its write
        self._wait_until(lambda: not self._write_in_flight(), WRITE_DONE_S)
        damaged = self._damage_not_uploaded()
        if damaged is not None:
            self._wait_until(lambda: damaged in self.store.committed(), UPLOAD_CHANCE_S)
        for node in running:
            node.pause()
        good, bad = uploads_checked(self.store)
        fault_event = self.seen.record(kind="fault", fault="damage_then_wipe", target=f"{len(running)} nodes",
                                       survivor=False, uploaded_step=good, damaged_step=damaged, bad_uploads=bad)
        self._kill_wipe_start(running, fault_event)

    def _damage_not_uploaded(self) -> int | None:
        """Flip bytes in the newest snapshot on disk if the store lacks it: its step, or None."""
        newest, step = self._newest_on_disk()
        if newest is None or step <= self._newest_uploaded():
            return None
        _flip_bytes(newest)
        return step

    def _kill_wipe_start(self, running: list[Any], fault_event: Event) -> None:
        """Every node killed and the snapshot volume emptied, as new machines would have nothing on disk,
        then the nodes started: until the job trains again."""
        for node in running:
            node.kill()
        wiped = self.volume.wipe()
        time.sleep(self.rng.uniform(0.5, 2.0))
        self.seen.record(kind="heal", action="start_all", target=f"{len(running)} nodes, {wiped} entries wiped",
                         world_size=self._world())
        for node in running:
            node.start()
        self.seen.wait_training(self._world(), fault_event["time"], self.args.fault_timeout)

    def _newest_on_disk(self) -> tuple[Path | None, int]:
        """The newest complete snapshot on the volume and its step (None, 0: none)."""
        snapshots = complete_snapshots(self.job.run_dir / "snapshots")
        return (snapshots[0], step_of_name(snapshots[0].name) or 0) if snapshots else (None, 0)

    def _newest_uploaded(self) -> int:
        return (self.store.committed() or [0])[0]

    def _write_in_flight(self) -> bool:
        """A saver is writing a snapshot (its temporary folder is there)."""
        return any(p.name.startswith(TMP_PREFIX) for p in (self.job.run_dir / "snapshots").iterdir())

    @staticmethod
    def _wait_until(done: Callable[[], bool], timeout: float) -> bool:
        """Whether `done` came true within `timeout` (asked twice a second)."""
        deadline = time.time() + timeout
        while not done():
            if time.time() >= deadline:
                return False
            time.sleep(0.5)
        return True

    def _scale_up(self) -> None:
        nodes = self.job.nodes + 1
        self.seen.record(kind="heal", action="scale_up", target=f"node {nodes}", world_size=nodes * self.args.nproc)
        t0 = time.time()
        self.job.scale(nodes)
        self.seen.wait_training(self._world(), t0, self.args.fault_timeout)
        time.sleep(self.rng.uniform(*self.args.gap))
        self.seen.record(kind="fault", fault="scale_down", target=f"node {nodes}")   # one leaves cleanly
        t0 = time.time()
        self.job.scale(nodes - 1)
        self.seen.wait_training(self._world(), t0, self.args.fault_timeout)

    def _store_restart(self) -> None:
        store = self.job.store()
        self.seen.record(kind="fault", fault="store_restart", target=store.name)
        t0 = time.time()
        store.restart(timeout=0)
        # Elastic mode: the agents lose the rendezvous state with the store: each one exits, its
        # entrypoint brings the node back under a new identity, and the job resumes from its snapshot.
        # torchft mode: the Lighthouse restarts with it, empty; the groups ask the new one. inplace
        # mode: the members find the store empty and form a new generation on it.
        if self.args.ft not in SURVIVOR_MODES:
            self.seen.wait_restarted(t0, self.args.fault_timeout)
        self.seen.wait_training(self._world(), t0, self.args.fault_timeout)

    def _back_to_back(self) -> None:
        """Two kills a moment apart: the second lands while the job is still recovering from the first."""
        running = self.job.trainers(running=True)
        if len(running) < 2:
            return self._kill_worker()
        first, second = running[:2]
        self.seen.record(kind="fault", fault="kill_back_to_back_1", target=first.name, back_to_back=True)
        first.kill()
        time.sleep(self.rng.uniform(1.0, 3.0))
        # With two nodes none survives the pair: a torchft or inplace survivor trains on after the first kill and
        # writes no snapshot of its own, so the periodic snapshot bounds what the second one loses.
        fault_event = self.seen.record(kind="fault", fault="kill_back_to_back_2", target=second.name, back_to_back=True,
                                       survivor=len(running) > 2)
        second.kill()
        for victim in (first, second):
            victim.start()
        self.seen.record(kind="heal", action="start", target=f"{first.name}+{second.name}", world_size=self._world())
        self.seen.wait_training(self._world(), fault_event["time"], self.args.fault_timeout)

    def _recover_then_heal(self, fault_event: Event, victim: Any) -> None:
        survivors = len(self.job.trainers(running=True))
        if survivors:
            self._wait_on_without(fault_event, self.args.fault_timeout)
        time.sleep(self.rng.uniform(0.5, 2.0))
        if self.seen.finished():    # the survivors trained to the end meanwhile: no job left to rejoin
            self.seen.record(kind="no_heal", target=victim.name, why="the job had finished")
            print(f"the job finished before {victim.name} was started again: no heal to measure", flush=True)
            return
        self.seen.record(kind="heal", action="start", target=victim.name, world_size=self._world())
        t0 = time.time()
        victim.start()
        self.seen.wait_training(self._world(), t0, self.args.fault_timeout)

    def _wait_on_without(self, fault_event: Event, timeout: float) -> bool:
        """The job goes on without the fault's target: smaller, or with a warm spare in its place."""
        if self.job.spares:
            return self.seen.wait_full_again(fault_event["time"], self._world(), fault_event["target"], timeout)
        return self.seen.wait_without(fault_event["time"], self._world(), timeout)

    def _world(self) -> int:
        return self.job.nodes * self.args.nproc


def _flip_bytes(snapshot: Path) -> None:
    """Flip 64 bytes in the middle of a snapshot's weights: its manifest's sha256 no longer matches."""
    part = snapshot / f"model{SUFFIX}"
    with open(part, "r+b") as f:
        f.seek(part.stat().st_size // 2)
        chunk = f.read(64)
        f.seek(-len(chunk), os.SEEK_CUR)
        f.write(bytes(b ^ 0xFF for b in chunk))


def uploads_checked(store: ObjectStore) -> tuple[int, list[int]]:
    """The newest committed step in the store whose files match their manifest (0: none), and the newer
    committed steps that do not: each downloaded and read back as a start would read it."""
    bad: list[int] = []
    with tempfile.TemporaryDirectory() as tmp:
        for step in store.committed():
            try:
                read_snapshot(store.download(step, Path(tmp)))
                return step, bad
            except (StoreInvalid, SnapshotInvalid):
                bad.append(step)
    return 0, bad
