"""What the runner sees of the job: one time-ordered event list fed by its metrics rows, the nodes'
step lines and the log lines by which a node shows it noticed a fault, plus the runner's own fault
and heal records, and waits on that list. The report is computed from the same list (scripts/chaos/report.py).

The runner shares the host's cores with the nodes it measures, so a wait costs what the events since
its fault cost, never the whole list: a 20-fault run gathers some 45,000 events, and scanning them all
five times a second grew to 10% of a core by the end of a shorter run, taken from the nodes, whose
pace after the faults then looked lower than before them (issue 28)."""
from __future__ import annotations

import bisect
import json
import math
import threading
import time
from typing import Any, Callable

import docker

from app.reporting.metrics import STEP_LINE
from scripts.chaos.report import LOG_MARKS, Event, full_again
from scripts.job import ComposeJob


class Observer:
    """Follows a ComposeJob's metrics.jsonl and its node containers' logs in background threads."""

    def __init__(self, job: ComposeJob, epochs: float = float("inf")) -> None:
        self.job, self.epochs = job, epochs
        self._events: list[Event] = []
        self._arrived: list[float] = []     # when each event was recorded, never before its own time
        self._epoch, self._finished = 0.0, False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._watched: set[str] = set()

    def start(self) -> None:
        threading.Thread(target=self._follow_metrics, daemon=True).start()
        threading.Thread(target=self._follow_logs, daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    # ------------------------------------------------------------ recording

    def record(self, **event: Any) -> Event:
        now = time.time()
        event.setdefault("time", now)
        with self._lock:
            self._events.append(event)
            self._arrived.append(max(now, self._arrived[-1]) if self._arrived else now)
            if event["kind"] == "metric" and event.get("event") == "train":
                self._epoch = max(self._epoch, event.get("epoch", 0.0))
            if event["kind"] == "metric" and event.get("event") == "eval" and event.get("epoch", 0.0) >= self.epochs:
                self._finished = True
        return event

    def events(self, since: float = -math.inf) -> list[Event]:
        """Every event, or those recorded after `since`: a superset of those whose own time is later
        (a metric row's time is when the trainer wrote it, before the runner read it)."""
        with self._lock:
            return self._events[bisect.bisect_right(self._arrived, since):]

    def _follow_metrics(self) -> None:
        """Every complete row appended to metrics.jsonl (read on from where the last read ended)."""
        path, offset = self.job.run_dir / "metrics.jsonl", 0
        while not self._stop.is_set():
            if path.exists():
                with open(path) as f:
                    f.seek(offset)
                    chunk = f.read()
                complete = chunk[: chunk.rfind("\n") + 1]
                offset += len(complete.encode())
                for line in complete.splitlines():
                    try:
                        self.record(kind="metric", **json.loads(line))
                    except (json.JSONDecodeError, TypeError):
                        continue
            time.sleep(0.2)

    def _follow_logs(self) -> None:
        """A log follower per node container incarnation (a restarted container logs anew)."""
        while not self._stop.is_set():
            for c in self.job.trainers():
                key = f"{c.id}-{c.attrs['State'].get('StartedAt')}"
                if c.status == "running" and key not in self._watched:
                    self._watched.add(key)
                    threading.Thread(target=self._watch, args=(c,), daemon=True).start()
            time.sleep(0.5)

    def _watch(self, container: Any) -> None:
        try:
            for raw in container.logs(stream=True, follow=True, since=int(time.time()) - 1):
                line = raw.decode(errors="replace").rstrip()
                step = STEP_LINE.search(line)
                if step:
                    lineage = {"lineage": step[3]} if step[3] else {}      # inplace: the generation that trained it
                    self.record(kind="step", container=container.name, step=int(step[1]), world=int(step[2]), **lineage)
                elif any(mark in line for mark in LOG_MARKS):
                    self.record(kind="log", container=container.name, line=line[:300])
        except docker.errors.APIError:
            pass

    # ------------------------------------------------------------ waiting

    def wait_for(self, predicate: Callable[[list[Event]], bool], timeout: float, since: float = -math.inf) -> bool:
        """Whether `predicate`, asked of the events recorded after `since`, came true within `timeout`;
        a job that has finished its epochs ends the wait at once (nothing more will come: a heal after
        the end is not waited out). At the end the predicate is asked once more: the last row may have
        come between the two checks (a wait for the end itself then said the job had not finished)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if predicate(self.events(since)):
                return True
            if self.finished():
                return predicate(self.events(since))
            time.sleep(0.2)
        return False

    # These two ask no events (since=inf: none): the epoch and the end are kept as rows arrive.
    def wait_epoch(self, epoch: float, timeout: float) -> bool:
        """The job has trained to `epoch` (or finished)."""
        return self.wait_for(lambda _: self.epoch() >= epoch or self.finished(), timeout, since=math.inf)

    def wait_finished(self, timeout: float) -> bool:
        """The job has trained its epochs."""
        return self.wait_for(lambda _: self.finished(), timeout, since=math.inf)

    def wait_training(self, world: int, since: float, timeout: float) -> bool:
        """A train row newer than `since` at this world size (steps advancing with everybody in)."""
        return self.wait_for(lambda ev: any(e["kind"] == "metric" and e["event"] == "train" and e["time"] > since
                                            and e["world_size"] == world for e in ev), timeout, since)

    def wait_without(self, since: float, world: int, timeout: float) -> bool:
        """A train row newer than `since` below this world size: the job went on without a node
        (after a restart in elastic mode, in the same processes in torchft mode)."""
        return self.wait_for(lambda ev: _went_on_without(ev, since, world), timeout, since)

    def wait_recovered(self, since: float, world: int, timeout: float) -> bool:
        """The job trains again after a fault at `since`: without a node (below this world size), or
        through a restart that brought every node back at once (elastic mode, when the lost worker's
        own agent restarts it before the others' next round closes: no row below full size ever comes)."""
        return self.wait_for(lambda ev: _went_on_without(ev, since, world) or _restarted(ev, since), timeout, since)

    def wait_full_again(self, since: float, world: int, target: str, timeout: float) -> bool:
        """The job noticed the fault at `since` and trains at this world size again without `target`:
        a warm spare took its place (report.full_again)."""
        return self.wait_for(lambda ev: full_again(ev, since, math.inf, world, target) is not None, timeout, since)

    def training(self, within_s: float = 3.0) -> set[str]:
        """The containers that printed a step line within the last seconds: the nodes that train now, not
        a spare waiting (it prints none) nor a node starting."""
        return {e["container"] for e in self.events(time.time() - within_s) if e["kind"] == "step"}

    def wait_restarted(self, since: float, timeout: float) -> bool:
        """A start row, then a train row, newer than `since`: the job went through a restart and trains."""
        return self.wait_for(lambda ev: _restarted(ev, since), timeout, since)

    def epoch(self) -> float:
        """How far the job has trained, in epochs (its newest train row)."""
        return self._epoch

    def finished(self) -> bool:
        """An eval row of the last epoch: the job is done."""
        return self._finished


def _went_on_without(events: list[Event], since: float, world: int) -> bool:
    """A train row newer than `since` below this world size."""
    return any(e["kind"] == "metric" and e["event"] == "train" and e["time"] > since and e["world_size"] < world
               for e in events)


def _restarted(events: list[Event], since: float) -> bool:
    """A start row newer than `since`, then a train row."""
    starts = [e["time"] for e in events if e["kind"] == "metric" and e["event"] == "start" and e["time"] > since]
    return bool(starts) and any(e["kind"] == "metric" and e["event"] == "train" and e["time"] > starts[0]
                                for e in events)
