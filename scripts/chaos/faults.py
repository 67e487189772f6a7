"""The fault injections: each one picks its victim, records the fault, makes it happen, and undoes it
(a heal, also recorded) once the job has shown how it copes; scripts/chaos/host.py makes those
docker has no verb for."""
from __future__ import annotations

import argparse
import os
import random
import signal
import time
from typing import Any

from app.core.config import SURVIVOR_MODES
from app.training.object_store import ObjectStore
from app.training.snapshot import SUFFIX, TMP_PREFIX, complete_snapshots
from scripts.chaos.host import Partition, SnapshotVolume, worker_pids
from scripts.chaos.observe import Observer
from scripts.chaos.report import SAVE_FAILED_MARK, Event
from scripts.job import ComposeJob


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
        snapshots = self.job.run_dir / "snapshots"
        deadline, hit = time.time() + 120, False
        while time.time() < deadline and not hit:
            hit = any(p.name.startswith(TMP_PREFIX) for p in snapshots.iterdir())
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
        self.seen.wait_without(fault_event["time"], self._world(), self.args.pause)
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
            self.seen.wait_without(fault_event["time"], self._world(), self.args.fault_timeout)
            time.sleep(self.rng.uniform(*self.args.gap))
        finally:
            self.seen.record(kind="heal", action="reconnect", target=victim.name, world_size=self._world())
            cut.heal()
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
        part = snapshots[0] / f"model{SUFFIX}"
        with open(part, "r+b") as f:                # flip bytes in the middle of the weights
            f.seek(part.stat().st_size // 2)
            chunk = f.read(64)
            f.seek(-len(chunk), os.SEEK_CUR)
            f.write(bytes(b ^ 0xFF for b in chunk))
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
        uploaded = self.store.committed()
        fault_event = self.seen.record(kind="fault", fault="wipe_disks", target=f"{len(running)} nodes",
                                       survivor=False, uploaded_step=uploaded[0] if uploaded else 0)
        for node in running:
            node.kill()
        wiped = self.volume.wipe()
        time.sleep(self.rng.uniform(0.5, 2.0))
        self.seen.record(kind="heal", action="start_all", target=f"{len(running)} nodes, {wiped} entries wiped",
                         world_size=self._world())
        for node in running:
            node.start()
        self.seen.wait_training(self._world(), fault_event["time"], self.args.fault_timeout)

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
            self.seen.wait_without(fault_event["time"], self._world(), self.args.fault_timeout)
        time.sleep(self.rng.uniform(0.5, 2.0))
        self.seen.record(kind="heal", action="start", target=victim.name, world_size=self._world())
        t0 = time.time()
        victim.start()
        self.seen.wait_training(self._world(), t0, self.args.fault_timeout)

    def _world(self) -> int:
        return self.job.nodes * self.args.nproc
