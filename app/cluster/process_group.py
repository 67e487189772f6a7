"""Join the default process group in a key namespace no earlier worker group has used, within a deadline.

Why not plain `init_process_group()`: under torchrun's c10d rendezvous the agent starts one TCPStore
for its whole life (DynamicRendezvousHandler keeps `_shared_tcp_store_server`) and hands every
restart of the worker group the same MASTER_ADDR:MASTER_PORT with TORCHELASTIC_USE_AGENT_STORE=True;
`env://` then connects to it without a per-attempt prefix. The backend's bootstrap keys (gloo's
`default_pg/0//cpu//0/<rank>`: each rank's listening address) have the same names at every attempt,
so a restarted rank that asks for a peer's address before the restarted peer has written it gets
the address of the peer's dead predecessor: gloo's connect is refused ("Gloo connectFullMesh
failed ... Connection refused"), and each further restart meets the keys of the attempt that
just failed. When both ranks take gloo's listening side (it is picked by comparing the two
addresses, one of them stale), neither connects and both wait far past the timeout (gloo gives
the first connect 5x its timeout). NCCL's unique id is read the same way (pytorch#135712).

So rank 0 draws a random token, every other rank proves that the token it read is the live rank
0's (rank 0 echoes the nonce the rank posted under that token), and the process group is built
under the token's prefix, where only this worker group has written. It works the same whatever
launched the job: a store of its own per attempt (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, plain
srun) just makes the check trivially pass.
"""
from __future__ import annotations

import threading
import time
import uuid
from datetime import timedelta

import torch
import torch.distributed as dist

from app.cluster.secret import SECRET_ENV, job_key, proof, proves
from app.core.errors import UserError
from app.recovery import failures

TOKEN_KEY = "app/pg/token"
REFUSED = "refused"
# How often a rank looks for rank 0's echo and re-reads the token (a stale token is never
# answered, the live one as soon as every rank has posted): soon at first, then backing off so
# that many ranks waiting for a slow rank 0 do not flood the store.
POLL_FIRST_S, POLL_MAX_S = 0.01, 0.2
REFUSAL_READ_S = 5.0      # the longest rank 0 waits for refused ranks to read why (they poll every POLL_MAX_S)


class RefusedPeer(UserError):
    """Rank 0 refused a peer without the job's secret. This side's input is fine: its group restarts
    without the stranger (exit 1), while the stranger's own side stops for good (bad input, exit 2)."""


def join(backend: str, rank: int, world_size: int, timeout_s: float, device_id: torch.device | None) -> dist.Store:
    """`init_process_group` from the launcher's env://, in a fresh namespace; exit 1 if not done in timeout_s.
    Returns the group's store (under its fresh prefix): the heartbeats beat through it.

    gloo waits up to 5x the timeout for a peer that never connects; a worker group that cannot
    form must end instead, so that the launcher restarts it (or gives up) and says so.
    """
    timeout = timedelta(seconds=timeout_s)
    watchdog = threading.Timer(timeout_s, _give_up, args=(rank, timeout_s))
    watchdog.daemon = True
    watchdog.start()
    try:
        store, _, _ = next(dist.rendezvous("env://", rank, world_size, timeout=timeout))
        store = fresh_namespace(store, rank, world_size, time.monotonic() + timeout_s)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout,
                                device_id=device_id)
    finally:
        watchdog.cancel()
    return store


def fresh_namespace(store: dist.Store, rank: int, world_size: int, deadline: float,
                    secret: str | None = None) -> dist.Store:
    """A prefix of `store` agreed by every rank of this worker group and never used before.

    With a job secret (JOB_SECRET), the handshake also proves both ways that each rank holds it
    (an HMAC of the token and the rank's nonce): a node without it is refused here, before the
    process group exists and so before any state is sent, and both sides say so in one line.
    """
    key = job_key(secret)
    if rank == 0:
        token = uuid.uuid4().hex
        store.set(TOKEN_KEY, token)
        peers = range(1, world_size)
        hellos = [f"app/pg/{token}/hello/{peer}" for peer in peers]
        if hellos:
            store.wait(hellos, _left(deadline))
            answers, refused = _answers(key, token, peers, store.multi_get(hellos))
            store.multi_set([f"app/pg/{token}/echo/{peer}" for peer in peers], answers)
            if refused:
                _await_reads(store, [f"app/pg/{token}/read/{peer}" for peer in refused], deadline)
                raise RefusedPeer(f"refused rank {', '.join(map(str, refused))}: it does not share this node's job "
                                f"secret ({SECRET_ENV}); the group was not formed and nothing was sent to it")
        return dist.PrefixStore(f"app/pg/{token}/", store)
    nonce = uuid.uuid4().hex
    posted, pause = None, POLL_FIRST_S
    while True:
        token = store.get(TOKEN_KEY).decode()     # blocks until some rank 0 has ever written one
        if token != posted:
            store.set(f"app/pg/{token}/hello/{rank}", f"{nonce}:{proof(key, token, nonce, 'hello')}".encode())
            posted = token
        echo = f"app/pg/{token}/echo/{rank}"
        if store.check([echo]):
            answer = store.get(echo).decode()
            if answer == REFUSED:
                store.set(f"app/pg/{token}/read/{rank}", b"1")
                raise UserError(f"rank 0 refused this node: they do not share the job's secret ({SECRET_ENV}); "
                                "nothing was sent")
            if answer.split(":")[0] == nonce:
                if answer != f"{nonce}:{proof(key, token, nonce, 'echo')}":
                    raise UserError(f"rank 0 cannot prove it holds the job's secret ({SECRET_ENV}): not joining it")
                return dist.PrefixStore(f"app/pg/{token}/", store)
        if time.monotonic() >= deadline:
            raise dist.DistStoreError(f"Timed out: rank 0 never answered rank {rank} under token {token}")
        time.sleep(pause)     # polled, not store.wait(): each timed-out wait logs two warnings
        pause = min(POLL_MAX_S, pause * 1.5)


def _answers(key: bytes, token: str, peers: range, hellos: list[bytes]) -> tuple[list[bytes], list[int]]:
    """Rank 0's echo to each peer's hello: the nonce with rank 0's proof, or REFUSED."""
    answers, refused = [], []
    for peer, hello in zip(peers, hellos):
        nonce, _, said = hello.decode().partition(":")
        if proves(key, said, token, nonce, "hello"):
            answers.append(f"{nonce}:{proof(key, token, nonce, 'echo')}".encode())
        else:
            answers.append(REFUSED.encode())
            refused.append(peer)
    return answers, refused


def _await_reads(store: dist.Store, reads: list[str], deadline: float) -> None:
    """Let the refused ranks read their refusal (each sets its read key) before rank 0 ends: under a
    plain env:// launch the store lives in rank 0's process and goes with it, and a refused rank
    would then see only a lost connection instead of why. A refused rank that is gone is not waited
    for past REFUSAL_READ_S."""
    try:
        store.wait(reads, min(_left(deadline), timedelta(seconds=REFUSAL_READ_S)))
    except dist.DistError:
        pass


def _left(deadline: float) -> timedelta:
    return timedelta(seconds=max(0.001, deadline - time.monotonic()))


def _give_up(rank: int, timeout_s: float) -> None:
    failures.leave(f"error: rank {rank}: the process group did not form within {timeout_s:g}s (a peer never "
                   "arrived); exiting so that the launcher restarts the job")
