"""Who reaches whom over the data path (app/ft/reach.py): the probes."""
from __future__ import annotations

import time

import pytest

from app.ft.reach import Listener, Probe, numeric, unreachable

pytestmark = pytest.mark.unit


def test_a_listener_is_reached_and_a_closed_one_is_not():
    listener, gone = Listener("127.0.0.1"), Listener("127.0.0.1")
    gone.close()
    try:
        assert unreachable([listener.address, gone.address], 2.0) == {gone.address}
        assert unreachable(["no-such-host.invalid:1", "127.0.0.1:x"], 2.0) == {"no-such-host.invalid:1", "127.0.0.1:x"}
    finally:
        listener.close()


def test_many_probes_at_once_are_all_answered():
    """A whole job's members probing one member at the same moment (the listener's backlog)."""
    listener = Listener("127.0.0.1")
    try:
        assert unreachable([listener.address] * 300, 2.0) == set()
        probes = [Probe([listener.address], 2.0) for _ in range(300)]
        assert all(p.result(2.0) == set() for p in probes)
    finally:
        listener.close()


def test_a_probe_never_blocks_its_caller_and_ends_at_its_timeout():
    """A connect that is never answered (a full accept queue drops the SYN, as a cut link does): pending
    at first, unreachable at the timeout."""
    import socket

    with socket.create_server(("127.0.0.1", 0), backlog=0) as full, socket.create_connection(full.getsockname()):
        address = "127.0.0.1:%d" % full.getsockname()[1]
        started = time.monotonic()
        probe = Probe([address], 0.3)
        assert probe.result() is None and time.monotonic() - started < 0.25     # not the 0.3 s timeout
        while (failed := probe.result(0.05)) is None:
            pass
        assert failed == {address} and 0.3 <= time.monotonic() - started < 2.0


def test_a_probe_resolves_no_name_and_its_caller_resolves_them_beforehand(monkeypatch):
    """A probe runs in the thread that beats: it connects to numeric addresses only, and a name there is
    unreachable at once, the resolver never asked. The prober resolves the names in its main thread
    (`numeric`, and `unreachable` at a round), each as its own host's resolver answers."""
    import socket

    asked: list[str] = []
    real = socket.getaddrinfo

    def resolver(host, port, family=0, type=0, proto=0, flags=0):
        if not flags & socket.AI_NUMERICHOST:
            asked.append(host)
        return real(host, port, family, type, proto, flags)

    monkeypatch.setattr(socket, "getaddrinfo", resolver)
    listener = Listener("localhost")
    try:
        port = listener.address.rpartition(":")[2]
        assert Probe([listener.address], 2.0).result(2.0) == {listener.address} and asked == []
        assert numeric(listener.address) in (f"127.0.0.1:{port}", f"[::1]:{port}") and asked == ["localhost"]
        assert Probe([numeric(listener.address)], 2.0).result(2.0) == set()
        assert unreachable([listener.address], 2.0) == set()
        assert numeric("no-such-host.invalid:1") == "no-such-host.invalid:1"       # unreachable when probed
    finally:
        listener.close()
