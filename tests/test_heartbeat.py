"""app/heartbeat.py against a real TCPStore, with threads standing in for ranks."""
from __future__ import annotations

import dataclasses

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from app.recovery.heartbeat import Heartbeat
from app.core.policy import DEFAULT
from tests.helpers import free_port

# serial: a lost peer is asserted within 0.6 s of its heartbeat timeout, threads that a busy core would delay
pytestmark = [pytest.mark.unit, pytest.mark.serial]


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=5))


def beats(store, size: int, **kwargs) -> tuple[list[Heartbeat], list[tuple[int, str, float]]]:
    fired: list[tuple[int, str, float]] = []
    policy = dataclasses.replace(DEFAULT, **kwargs)
    hbs = [Heartbeat(store, r, size, "t", lambda why, r=r: fired.append((r, why, time.monotonic())), policy)
           for r in range(size)]
    return hbs, fired


def test_a_peer_that_stops_beating_is_lost_within_the_timeout(store):
    hbs, fired = beats(store, 3, heartbeat_timeout_s=1.0, heartbeat_interval_s=0.1)
    for hb in hbs:
        hb.start()
    time.sleep(1.5)
    assert fired == []                       # everyone beats: nobody is lost
    stopped = time.monotonic()
    hbs[2]._stop.set()                       # rank 2 hangs: its threads stop, without saying it is done
    time.sleep(2.0)
    for hb in hbs:
        hb.stop()
    lost = [(r, why, at) for r, why, at in fired if r != 2]
    assert {r for r, *_ in lost} == {0, 1}, fired
    assert all("rank 2 has not sent a heartbeat" in why and at - stopped < 1.6 for _, why, at in lost), fired


def test_no_progress_is_caught_but_slow_phases_and_the_first_step_are_not(store):
    hbs, fired = beats(store, 1, heartbeat_timeout_s=5.0, heartbeat_interval_s=0.05, progress_floor_s=0.5, progress_slack=2.0)
    hb = hbs[0]
    hb.start()
    time.sleep(0.8)                          # before the first step (compilation): never an alarm
    hb.stepped()
    with hb.slow_phase():                    # evaluation: no steps for a while, no alarm
        time.sleep(0.8)
    hb.stepped()
    for _ in range(5):
        time.sleep(0.1)
        hb.stepped()
    assert fired == []
    time.sleep(1.0)                          # now stuck: bound = max(0.5, 2 x 0.1) s
    hb.stop()
    assert len(fired) == 1 and "no training step for" in fired[0][1], fired


def test_a_store_that_stops_answering_is_caught(store):
    class Silent:
        def add(self, key, value):
            threading.Event().wait(10)       # a store on a paused host

        def check(self, keys):              # the beat thread's next call once add returns, 10 s on
            return False

    hbs, fired = beats(Silent(), 2, heartbeat_timeout_s=0.5, heartbeat_interval_s=0.05)
    hbs[0].start()
    time.sleep(1.0)
    hbs[0].stop()
    assert fired and "store has not answered" in fired[0][1]


def test_a_peer_that_finished_is_not_lost(store):
    hbs, fired = beats(store, 2, heartbeat_timeout_s=0.5, heartbeat_interval_s=0.05)
    for hb in hbs:
        hb.start()
    time.sleep(0.3)
    hbs[1].stop()                            # rank 1 is done; rank 0 still writes its last snapshot
    time.sleep(1.5)
    hbs[0].stop()
    assert fired == []


class _SlowStore:
    """A store whose calls take a while, as a store in another container does under load."""

    def __init__(self, store) -> None:
        self.store = store

    def add(self, key, value):
        time.sleep(0.3)
        return self.store.add(key, value)

    def __getattr__(self, name):
        return getattr(self.store, name)


def test_stop_returns_only_after_its_threads_have_left_the_store(store):
    """A beat thread still inside a store call when the interpreter exits aborts the process (exit -6);
    stop() waits for it."""
    hb = Heartbeat(_SlowStore(store), 0, 2, "t", lambda why: None,
                   dataclasses.replace(DEFAULT, heartbeat_timeout_s=1.0, heartbeat_interval_s=0.05))
    hb.start()
    time.sleep(0.4)
    hb.stop()
    assert [t.name for t in hb._threads if t.is_alive()] == []


PAUSED_RANK = """
import sys, time, dataclasses
from datetime import timedelta
import torch.distributed as dist
from app.recovery.heartbeat import Heartbeat
from app.core.policy import DEFAULT
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, timeout=timedelta(seconds=5))
policy = dataclasses.replace(DEFAULT, heartbeat_timeout_s=1.0, heartbeat_interval_s=0.1, progress_floor_s=1.0)
hb = Heartbeat(store, 0, 1, "paused", lambda why: print("lost:", why, flush=True), policy)
hb.start()
print("beating", flush=True)
while True:
    hb.stepped()
    time.sleep(0.01)
"""


def test_a_rank_that_was_itself_stopped_and_woke_again_blames_neither_the_store_nor_its_progress(store):
    """A paused container, a SIGSTOPped process: on waking, its own threads see a store round and a
    step older than the timeout. That is this process's pause, not the store's silence nor a stuck
    step: in the survivor modes the woken process comes back into the job in place, and the
    heartbeat restarting it there cost a whole start (seen in the chaos run and in test_inplace)."""
    import signal
    import subprocess
    import sys

    from tests.helpers import REPO

    rank = subprocess.Popen([sys.executable, "-c", PAUSED_RANK, str(store.port)], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        assert rank.stdout.readline().strip() == "beating"
        time.sleep(0.5)
        rank.send_signal(signal.SIGSTOP)
        time.sleep(3.0)                      # three heartbeat timeouts, three progress floors
        rank.send_signal(signal.SIGCONT)
        time.sleep(1.5)
    finally:
        rank.kill()
    out, _ = rank.communicate(timeout=10)
    assert "lost:" not in out, out


def test_a_slow_node_is_named_once_by_each_nodes_first_rank_from_the_times_published_with_the_beats(store):
    """Three nodes (the third of two ranks, one of them slow: a node is as slow as its slowest rank);
    only the first rank of each node judges, and each says it once. A rank whose steps were all left
    out this beat publishes no time and holds nobody up."""
    from app.recovery.slow import SlowWatch

    policy = dataclasses.replace(DEFAULT, heartbeat_interval_s=0.05, slow_window_s=1.0)
    nodes = ["a", "b", "c", "c"]
    paces = [lambda: (0.010, frozenset()), lambda: (None, frozenset({"snapshot"})) if time.monotonic() % 1 < 0.3
             else (0.011, frozenset()), lambda: (0.010, frozenset()), lambda: (0.050, frozenset())]
    said: list[tuple[int, str]] = []
    watches = [SlowWatch(policy.slow_factor, policy.slow_window_s, policy.heartbeat_interval_s,
                         lambda line, r=r: said.append((r, line))) for r in range(4)]
    hbs = [Heartbeat(store, r, 4, "pace", lambda why: None, policy, pace=paces[r], nodes=nodes,
                     watch=watches[r] if r != 3 else None) for r in range(4)]
    for hb in hbs:
        hb.start()
    time.sleep(2.5)
    for hb in hbs:
        hb.stop()
    assert sorted(r for r, _ in said) == [0, 1, 2], said
    assert {line for _, line in said} == {"node c is slow: its steps take 4.8x the others' for 1 s"}, said
    assert watches[0].lost_s == pytest.approx(0.040, abs=0.002)
