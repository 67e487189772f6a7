"""Who reaches whom over the data path, for inplace mode (app/ft/inplace.py).

A member whose data link to its peers is down (a bad NIC or switch port, a firewall rule) while it
still reaches the group store keeps beating: no watch sees it silent. Its peers learn it here:

- Every member listens on a TCP port of its own, on every interface, and names it at its node's
  data address (app/ft/replica.py's advertised_host: NODE_ADDR, which gloo's and NCCL's interface
  is set from, else the host name): the address its peers probe. Its thread accepts each
  connection and closes it; nothing is read or sent.
- A probe is one TCP connect to each address at once, with a short timeout; one that did not
  connect (timed out, refused, no route) counts as unreachable. Probes are made only once something
  has failed (an all-reduce pending past INPLACE_STALL, a round), never in a step that completes.
- A probe resolves no name: it connects to numeric addresses only (AI_NUMERICHOST). The prober
  resolves its peers' names beforehand, in its main thread (`numeric`: when its watch follows a new
  generation, and at a round), never in the thread that beats: a resolver that hangs during a
  network fault would stop the beats, and the peers would drop a member that is well. The name is
  resolved by the prober, never by its owner: a host name may resolve to 127.0.1.1 on its own host.
- From what each member of a round reports, the round's closer names the largest set whose every
  pair reaches each other (app/ft/protocol.py's `mutual`): one list, signed as every list is, so the
  store stays the arbiter and two sides of a cut never both train.
"""
from __future__ import annotations

import errno
import selectors
import socket
import time
from typing import Iterable

from app.recovery import threads


class Listener:
    """The address this member's peers probe: a TCP socket that accepts and closes every connection."""

    def __init__(self, host: str) -> None:
        if socket.has_dualstack_ipv6():
            self._socket = socket.create_server(("", 0), family=socket.AF_INET6, dualstack_ipv6=True,
                                                backlog=socket.SOMAXCONN)
        else:
            self._socket = socket.create_server(("", 0), backlog=socket.SOMAXCONN)
        self.address = f"{host}:{self._socket.getsockname()[1]}"
        self._closed = False
        # A backlog of SOMAXCONN: a whole job's members probing this one at once are all answered.
        threads.start("inplace-probes", self._accept)

    def _accept(self) -> None:
        while not self._closed:
            try:
                connection, _ = self._socket.accept()
            except OSError:     # shut down by close(), or out of descriptors for a moment: try again
                time.sleep(0.01)
                continue
            connection.close()

    def close(self) -> None:
        """Stop listening (shutdown wakes the thread blocked in accept; close alone would not)."""
        self._closed = True
        try:
            self._socket.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._socket.close()


class Probe:
    """TCP connects to every address at once, without blocking the caller: `result()` says which did
    not connect, once each has answered or the timeout has passed."""

    def __init__(self, addresses: Iterable[str], timeout_s: float) -> None:
        self.started = time.monotonic()
        self.deadline = self.started + timeout_s
        self.failed: set[str] = set()
        self._selector = selectors.DefaultSelector()    # epoll: no FD_SETSIZE limit on a large job
        for address in set(addresses):
            self._connect(address)

    def _connect(self, address: str) -> None:
        host, _, port = address.rpartition(":")
        try:
            family, kind, protocol, _, target = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM,
                                                                   flags=socket.AI_NUMERICHOST)[0]
            sock = socket.socket(family, kind, protocol)
        except (OSError, ValueError):
            self.failed.add(address)
            return
        sock.setblocking(False)
        if sock.connect_ex(target) in (0, errno.EINPROGRESS):
            self._selector.register(sock, selectors.EVENT_WRITE, address)
        else:
            sock.close()
            self.failed.add(address)

    def result(self, wait_s: float = 0.0) -> set[str] | None:
        """The addresses not reached; None while some connect is still pending (waits up to wait_s)."""
        if self._selector.get_map():
            for key, _ in self._selector.select(max(0.0, min(wait_s, self.deadline - time.monotonic()))):
                self._settle(key.fileobj, key.data)
            if self._selector.get_map() and time.monotonic() < self.deadline:
                return None
            for key in list(self._selector.get_map().values()):
                self._settle(key.fileobj, key.data, timed_out=True)
        return self.failed

    def _settle(self, sock: socket.socket, address: str, timed_out: bool = False) -> None:
        if timed_out or sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
            self.failed.add(address)
        self._selector.unregister(sock)
        sock.close()


def numeric(address: str) -> str:
    """`address` (host:port) with its host resolved to a numeric address (IPv6 in brackets), for a
    Probe; as it is where it does not resolve (a Probe then counts it unreachable). It may block for
    as long as the resolver does: never call it from the thread that beats."""
    host, _, port = address.rpartition(":")
    try:
        family, _, _, _, target = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)[0]
    except (OSError, ValueError):
        return address
    return f"[{target[0]}]:{target[1]}" if family == socket.AF_INET6 else f"{target[0]}:{target[1]}"


def unreachable(addresses: Iterable[str], timeout_s: float) -> set[str]:
    """The addresses (names or numeric) a TCP connect did not reach within timeout_s (all tried at once,
    once resolved here)."""
    resolved = {address: numeric(address) for address in set(addresses)}
    probe = Probe(resolved.values(), timeout_s)
    while (failed := probe.result(timeout_s)) is None:
        pass
    return {address for address, target in resolved.items() if target in failed}
