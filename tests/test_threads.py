"""No background thread of a training process dies silently (app/recovery/threads.py): each thread
either handles what it meets and goes on, or ends its node with one error line. One test per
thread and per outcome; `failures.leave` (which ends the process) is replaced by a recorder."""
from __future__ import annotations

import dataclasses
import threading
import time
import urllib.error
import urllib.request
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from app.cluster.distributed import World
from app.recovery import failures
from app.core.policy import DEFAULT

pytestmark = pytest.mark.unit


@pytest.fixture
def left(monkeypatch) -> list[str]:
    """The lines `failures.leave` would have ended the process with."""
    lines: list[str] = []
    monkeypatch.setattr(failures, "leave", lambda line, status=failures.EXIT_PEER_LOST: lines.append(line))
    return lines


@pytest.fixture
def server():
    return dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False, timeout=timedelta(seconds=10))


def _eventually(condition, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


# ---------------------------------------------------------------- the inplace watch

def _member(server, monkeypatch):
    from app.ft.inplace import InPlaceGroup

    monkeypatch.setenv("JOB_SECRET", "s")
    world = World(0, 0, 1, 1, torch.device("cpu"), 0)
    return InPlaceGroup(world, DEFAULT, f"127.0.0.1:{server.port}", "t", lambda: {}, lambda state: None)


def test_the_inplace_watch_ignores_a_value_no_member_signed_and_goes_on(server, monkeypatch, left):
    """The attack of issue 29: `latest` set to `abc` killed the watch with a ValueError."""
    member = _member(server, monkeypatch)
    try:
        member.watch.follow(1, [member.member], ["a/0"], [member.listener.address])
        for forged in (b"abc", b"999999", b"7|0000", "\xff".encode("latin-1")):
            server.set(member.keys.latest(), forged)
            beat = server.get(member.keys.beat(member.member))
            assert _eventually(lambda: server.get(member.keys.beat(member.member)) != beat), "the watch stopped"
        assert not member.watch.ended.is_set() and not member.watch.wanted.is_set(), member.watch.reason
        assert left == [] and member.watch._thread.is_alive()
        assert "latest (" in member.rejects.line()
    finally:
        member.shutdown()


def test_the_inplace_watch_ends_the_node_in_one_line_on_what_it_cannot_handle(server, monkeypatch, left):
    from app.ft.inplace import Watch

    monkeypatch.setattr(Watch, "_round", lambda self, store: 1 / 0)
    member = _member(server, monkeypatch)
    try:
        assert _eventually(lambda: bool(left))
        assert left == ["error: the inplace-watch thread of this training process failed (ZeroDivisionError: "
                        "division by zero); this node leaves so that the job recovers without it"]
    finally:
        member.shutdown()


# ---------------------------------------------------------------- the heartbeat and its watch

def _heartbeat(store, fired: list[str]):
    from app.recovery.heartbeat import Heartbeat

    policy = dataclasses.replace(DEFAULT, heartbeat_timeout_s=1.0, heartbeat_interval_s=0.05)
    return Heartbeat(store, 0, 2, "t", fired.append, policy)


def test_the_heartbeat_goes_on_through_store_errors(server, left):
    class Flaky:
        """A store that fails every other call, as one that restarts would."""
        calls = 0

        def add(self, key, value):
            Flaky.calls += 1
            if Flaky.calls % 2:
                raise dist.DistNetworkError("connection reset")
            return server.add(key, value)

        def set(self, key, value):
            server.set(key, value)

        def check(self, keys):
            return server.check(keys)

    fired: list[str] = []
    hb = _heartbeat(Flaky(), fired)
    hb.start()
    try:
        assert _eventually(lambda: Flaky.calls > 20)
        assert all(t.is_alive() for t in hb._threads) and left == []
    finally:
        hb.stop()


@pytest.mark.parametrize("thread, broken", [("heartbeat", "_round"), ("heartbeat-watch", "progress_bound_s")])
def test_a_heartbeat_thread_ends_the_node_in_one_line_on_what_it_cannot_handle(server, monkeypatch, left, thread, broken):
    from app.recovery.heartbeat import Heartbeat

    monkeypatch.setattr(Heartbeat, broken, lambda self, *args: [][0])
    hb = _heartbeat(server, [])
    hb.stepped()        # warm: the watch looks at the progress bound
    hb.start()
    try:
        assert _eventually(lambda: bool(left))
        assert left == [f"error: the {thread} thread of this training process failed (IndexError: list index out "
                        "of range); this node leaves so that the job recovers without it"]
    finally:
        hb.stop()


# ---------------------------------------------------------------- the just-in-time snapshot

@pytest.mark.parametrize("keep, said", [(lambda why: "snapshot at step 7 written by rank 0", "snapshot at step 7"),
                                        (lambda why: open("/nonexistent/x", "w"), "no snapshot written ([Errno 2]")])
def test_the_just_in_time_snapshot_is_said_in_the_one_line_also_when_it_fails(left, keep, said, tmp_path):
    from app.training.guard import FaultGuard

    world = World(0, 0, 2, 1, torch.device("cpu"), 0)
    guard = FaultGuard(world, DEFAULT, keep, tmp_path, lambda final: None)
    guard._on_peer_hung("rank 1 has not sent a heartbeat for 3 s")
    assert len(left) == 1 and left[0].startswith("error: lost contact with another rank (rank 1 has not sent")
    assert said in left[0], left


def test_a_stuck_nccl_call_keeps_the_last_step_before_the_process_leaves(left, tmp_path):
    """The H200 run: the survivor's abort of a killed peer's group never returned, the bound ended the
    process, and its node came back from a snapshot 19 steps old, though this process held the only
    live state. The bound's line now comes after the last completed step is written."""
    from app.training.guard import FaultGuard

    kept: list[str] = []
    world = World(0, 0, 1, 1, torch.device("cpu"), 0)
    guard = FaultGuard(world, DEFAULT, lambda why: kept.append(why) or "snapshot at step 7 written by rank 0",
                       tmp_path, lambda final: None)
    guard.leave_keeping("error: aborting an NCCL group did not return within 20 s (INPLACE_GROUP_BOUND)")
    assert kept == ["an NCCL call did not return"]
    assert left == ["error: aborting an NCCL group did not return within 20 s (INPLACE_GROUP_BOUND); "
                    "snapshot at step 7 written by rank 0"]


def test_the_just_in_time_snapshot_thread_ends_the_node_on_what_it_cannot_handle(left, tmp_path):
    """A BaseException the writer does not handle (not an Exception): the thread's own line."""
    from app.training.guard import FaultGuard

    def keep(why: str) -> str:
        raise KeyboardInterrupt

    world = World(0, 0, 2, 1, torch.device("cpu"), 0)
    FaultGuard(world, DEFAULT, keep, tmp_path, lambda final: None)._on_peer_hung("rank 1 hung")
    assert left[0].startswith("error: the just-in-time snapshot thread of this training process failed "
                              "(KeyboardInterrupt"), left


# ---------------------------------------------------------------- torchft mode's state server

def test_the_state_server_survives_a_request_that_breaks_its_handler(monkeypatch, capfd, left):
    from app.ft import transport
    from app.ft.transport import SecretTransport

    served = SecretTransport("127.0.0.1", secret="s")
    try:
        broken = threading.Event()

        def proves(*args):
            if not broken.is_set():
                broken.set()
                raise ValueError("a bug met by one request")
            return False

        monkeypatch.setattr(transport, "proves", proves)
        for _ in range(2):
            try:
                urllib.request.urlopen(f"{served.metadata()}/state/1?nonce=x", timeout=5)
            except (urllib.error.HTTPError, urllib.error.URLError, ConnectionError) as exc:
                last = exc
        assert isinstance(last, urllib.error.HTTPError) and last.code == 403, "the next request was answered"
        assert "Traceback" not in capfd.readouterr().err and left == []
    finally:
        served.shutdown()


def test_the_state_server_thread_ends_the_node_on_what_it_cannot_handle(monkeypatch, left):
    from app.ft import transport

    monkeypatch.setattr(transport._Server, "serve_forever", lambda self: {}["gone"])
    transport.SecretTransport("127.0.0.1", secret="s")
    assert _eventually(lambda: bool(left))
    assert left[0].startswith("error: the state-server thread of this training process failed (KeyError"), left


# ---------------------------------------------------------------- inplace mode's probe listener and forming

def test_the_probe_listener_goes_on_through_a_failed_accept_and_ends_when_closed(monkeypatch, left):
    """Out of descriptors for a moment (EMFILE): the next probe is still answered."""
    import socket

    from app.ft.reach import Listener, unreachable

    real, failed = socket.socket.accept, threading.Event()

    def accept(self):
        if not failed.is_set():
            failed.set()
            raise OSError(24, "Too many open files")
        return real(self)

    monkeypatch.setattr(socket.socket, "accept", accept)
    listener = Listener("127.0.0.1")
    assert unreachable([listener.address], 2.0) == set() and failed.is_set() and left == []
    listener.close()
    assert unreachable([listener.address], 2.0) == {listener.address}


def test_a_forming_thread_ends_the_node_in_one_line_on_what_it_cannot_handle(server, monkeypatch, left):
    """What gloo's forming raises besides a store or connection failure (a failed round) is a bug."""
    from app.ft.groups import GlooGroups

    monkeypatch.setattr(dist, "ProcessGroupGloo", lambda *args: {}["gone"])
    with pytest.raises(RuntimeError, match="did not connect within"):
        GlooGroups(dataclasses.replace(DEFAULT, inplace_form_bound_s=0.5)).form(dist.PrefixStore("p/", server), 0, 1, 3)
    assert _eventually(lambda: bool(left))
    assert left[0].startswith("error: the inplace-form-3 thread of this training process failed (KeyError"), left


def test_an_ending_thread_goes_on_past_a_failed_abort_and_ends_the_node_on_what_it_cannot_handle(left):
    """An NCCL abort that raises (a communicator torch could not abort) is dropped all the same; anything
    else escaping the end of a generation's group is a bug, said in one line."""
    import types

    from app.ft.groups import NcclGroups

    class Group:
        def __init__(self, raising: type[BaseException]) -> None:
            self.options, self.raising = types.SimpleNamespace(group_name="inplace-3"), raising

        def abort(self) -> None:
            raise self.raising("NCCL error: remote process exited")

    groups = NcclGroups(DEFAULT, torch.device("cpu"))
    groups.end(Group(RuntimeError), None)
    assert groups.ends.settle(timeout=5) and groups.ends.ended == 1 and left == []
    groups.end(Group(KeyError), None)
    assert _eventually(lambda: bool(left))
    assert left[0].startswith("error: the end-inplace-3 thread of this training process failed (KeyError"), left
