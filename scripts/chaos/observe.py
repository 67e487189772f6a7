"""What the runner sees of the job: one time-ordered event list fed by its metrics rows, the nodes'
step lines and the log lines by which a node shows it noticed a fault, plus the runner's own fault
and heal records, and waits on that list. The report is computed from the same list (scripts/chaos/report.py)."""
from __future__ import annotations

import json
import threading
import time
from typing import Any, Callable

import docker

from app.reporting.metrics import STEP_LINE
from scripts.chaos.report import LOG_MARKS, Event
from scripts.job import ComposeJob


class Observer:
    """Follows a ComposeJob's metrics.jsonl and its node containers' logs in background threads."""

    def __init__(self, job: ComposeJob, epochs: float = float("inf")) -> None:
        self.job, self.epochs = job, epochs
        self._events: list[Event] = []
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
        event.setdefault("time", time.time())
        with self._lock:
            self._events.append(event)
        return event

    def events(self) -> list[Event]:
        with self._lock:
            return list(self._events)

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
                    self.record(kind="step", container=container.name, step=int(step[1]), world=int(step[2]))
                elif any(mark in line for mark in LOG_MARKS):
                    self.record(kind="log", container=container.name, line=line[:300])
        except docker.errors.APIError:
            pass

    # ------------------------------------------------------------ waiting

    def wait_for(self, predicate: Callable[[list[Event]], bool], timeout: float) -> bool:
        """Whether `predicate` came true within `timeout`; a job that has finished its epochs ends the
        wait at once (nothing more will come: a heal after the end is not waited out). At the end the
        predicate is asked once more: the last row may have come between the two checks (a wait for
        the end itself then said the job had not finished)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            events = self.events()
            if predicate(events):
                return True
            if self.finished(self.epochs):
                return predicate(self.events())
            time.sleep(0.2)
        return False

    def wait_training(self, world: int, since: float, timeout: float) -> bool:
        """A train row newer than `since` at this world size (steps advancing with everybody in)."""
        return self.wait_for(lambda ev: any(e["kind"] == "metric" and e["event"] == "train" and e["time"] > since
                                            and e["world_size"] == world for e in ev), timeout)

    def wait_without(self, since: float, world: int, timeout: float) -> bool:
        """A train row newer than `since` below this world size: the job went on without a node
        (after a restart in elastic mode, in the same processes in torchft mode)."""
        return self.wait_for(lambda ev: _went_on_without(ev, since, world), timeout)

    def wait_recovered(self, since: float, world: int, timeout: float) -> bool:
        """The job trains again after a fault at `since`: without a node (below this world size), or
        through a restart that brought every node back at once (elastic mode, when the lost worker's
        own agent restarts it before the others' next round closes: no row below full size ever comes)."""
        return self.wait_for(lambda ev: _went_on_without(ev, since, world) or _restarted(ev, since), timeout)

    def wait_restarted(self, since: float, timeout: float) -> bool:
        """A start row, then a train row, newer than `since`: the job went through a restart and trains."""
        return self.wait_for(lambda ev: _restarted(ev, since), timeout)

    def epoch(self) -> float:
        """How far the job has trained, in epochs (its newest train row)."""
        return max((e["epoch"] for e in self.events() if e["kind"] == "metric" and e["event"] == "train"), default=0.0)

    def finished(self, epochs: int) -> bool:
        """An eval row of the last epoch: the job is done."""
        return any(e["kind"] == "metric" and e["event"] == "eval" and e["epoch"] >= epochs for e in self.events())


def _went_on_without(events: list[Event], since: float, world: int) -> bool:
    """A train row newer than `since` below this world size."""
    return any(e["kind"] == "metric" and e["event"] == "train" and e["time"] > since and e["world_size"] < world
               for e in events)


def _restarted(events: list[Event], since: float) -> bool:
    """A start row newer than `since`, then a train row."""
    starts = [e["time"] for e in events if e["kind"] == "metric" and e["event"] == "start" and e["time"] > since]
    return bool(starts) and any(e["kind"] == "metric" and e["event"] == "train" and e["time"] > starts[0]
                                for e in events)
