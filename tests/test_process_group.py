"""app.cluster.process_group.fresh_namespace on one store shared by successive worker groups (threads as ranks)."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch.distributed as dist

from app import job
from app.cluster.process_group import fresh_namespace
from app.core.config import parse
from app.core.errors import UserError
from app.recovery import failures
from app.training.guard import PeerLost

pytestmark = pytest.mark.unit

WORLD = 3


def form(store: dist.Store, pool: ThreadPoolExecutor, ranks=range(WORLD), delay_rank_0: float = 0.0) -> list:
    """Each rank's namespace; rank 0 arrives `delay_rank_0` seconds after the others."""
    def one(rank: int) -> dist.Store:
        if rank == 0:
            time.sleep(delay_rank_0)
        return fresh_namespace(store, rank, WORLD, time.monotonic() + 20)
    return [pool.submit(one, r) for r in ranks]


def test_a_restarted_group_never_sees_the_keys_of_the_one_before():
    shared = dist.HashStore()             # the agent's store: one for the agent's whole life
    shared.set_timeout(timedelta(seconds=20))
    with ThreadPoolExecutor(WORLD) as pool:
        first = [f.result(timeout=20) for f in form(shared, pool)]
        first[1].set("0", b"address of rank 0's first process")  # what gloo writes under the namespace
        assert all(ns.get("0") == b"address of rank 0's first process" for ns in first)

        # The restarted ranks 1 and 2 arrive first and find the first group's token: they must
        # wait for the new rank 0 rather than go on in the old namespace.
        second = form(shared, pool, delay_rank_0=1.0)
        time.sleep(0.5)
        assert not any(f.done() for f in second)
        stores = [f.result(timeout=20) for f in second]
    for ns in stores:
        assert not ns.check(["0"])
    stores[2].set("0", b"address of rank 0's second process")
    assert [ns.get("0") for ns in stores] == [b"address of rank 0's second process"] * WORLD
    assert first[0].get("0") == b"address of rank 0's first process"


def test_rank_0_gives_up_at_the_deadline_when_a_peer_never_comes():
    store = dist.HashStore()
    start = time.monotonic()
    with pytest.raises(dist.DistStoreError):
        fresh_namespace(store, 0, 2, time.monotonic() + 0.5)
    assert time.monotonic() - start < 5


@pytest.mark.parametrize("intruder", [2, 0], ids=["a-peer", "rank-0"])
def test_a_node_without_the_jobs_secret_is_refused_before_the_group_forms(intruder):
    """Both sides end with one clear line; the group never forms, so no state can reach the intruder."""
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=20))

    def one(rank: int):
        secret = "" if rank == intruder else "s3cret"
        try:
            return fresh_namespace(store, rank, WORLD, time.monotonic() + 20, secret=secret)
        except UserError as exc:
            return str(exc)

    with ThreadPoolExecutor(WORLD) as pool:
        said = [f.result(timeout=30) for f in [pool.submit(one, r) for r in range(WORLD)]]
    if intruder == 2:
        assert said[2] == "rank 0 refused this node: they do not share the job's secret (JOB_SECRET); nothing was sent"
        assert said[0].startswith("refused rank 2: it does not share this node's job secret (JOB_SECRET)")
        assert isinstance(said[1], dist.PrefixStore)      # a rightful peer was answered, but rank 0 stops
    else:
        assert said[0].startswith("refused rank 1, 2")    # rank 0 cannot tell who is wrong: it refuses both
        assert all(line.startswith("rank 0 refused this node") for line in said[1:])


def test_the_same_secret_everywhere_forms_the_group():
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=20))
    with ThreadPoolExecutor(WORLD) as pool:
        futures = [pool.submit(fresh_namespace, store, r, WORLD, time.monotonic() + 20, "s3cret") for r in range(WORLD)]
        assert all(isinstance(f.result(timeout=30), dist.PrefixStore) for f in futures)


@pytest.mark.parametrize("rank, local_rank, failure, prints", [
    ("0", "0", UserError("bad input"), True),
    ("2", "0", UserError("rank 0 refused this node"), True),    # another node's first rank: its node must hear why
    ("3", "1", UserError("rank 0 refused this node"), False),   # its node's local rank 0 says it
    ("3", "1", PeerLost("gloo: connection closed", "nothing new to save"), True),    # its own loss: every rank
], ids=["rank-0", "another-nodes-local-rank-0", "a-second-local-rank", "lost-peer-on-any-rank"])
def test_the_entry_point_prints_a_jobwide_error_once_per_node_and_an_own_error_on_every_rank(
        monkeypatch, capsys, rank, local_rank, failure, prints):
    def fail(cfg, loading):
        raise failure

    monkeypatch.setattr(job, "main", fail)
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    assert job.run(parse([])) == (1 if isinstance(failure, PeerLost) else 2)
    err = capsys.readouterr().err
    assert err.count("error: ") == int(prints) and err.count("\n") == int(prints), err


@pytest.mark.parametrize("environ, prints", [
    ({}, True),                                             # one plain process
    ({"SLURM_LOCALID": "1"}, False),                        # plain srun, before LOCAL_RANK is derived
    ({"LOCAL_RANK": "0", "SLURM_LOCALID": "3"}, True),      # srun torchrun: torchrun's local rank counts
])
def test_who_prints_a_jobwide_error_before_the_world_exists(environ, prints):
    assert failures.prints_errors(own=False, environ=environ) is prints
    assert failures.prints_errors(own=True, environ=environ) is True
