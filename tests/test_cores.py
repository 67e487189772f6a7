"""app/cluster/cores.py: each training process's share of its host's cores, on core counts given here
(never this machine's own)."""
from __future__ import annotations

import pytest
import torch

from app.cluster import cores
from app.core.errors import UserError

pytestmark = pytest.mark.unit


def node(first: int, count: int) -> set[int]:
    return set(range(first, first + count))


def test_an_explicit_setting_wins():
    everything = node(0, 8)
    assert cores.threads(everything, 3, [everything] * 4) == 3
    assert cores.explicit_threads(2, {"OMP_NUM_THREADS": "1"}) == 2        # --threads before OMP_NUM_THREADS
    assert cores.explicit_threads(0, {"OMP_NUM_THREADS": "1"}) == 1
    assert cores.explicit_threads(0, {"OMP_NUM_THREADS": " 4,2 "}) == 4     # OpenMP's nested form: the first level
    assert cores.explicit_threads(0, {"OMP_NUM_THREADS": ""}) is None
    assert cores.explicit_threads(0, {}) is None


@pytest.mark.parametrize("raw", ["0", "two", "-1", ","])
def test_a_bad_omp_num_threads_is_one_error(raw):
    with pytest.raises(UserError, match=rf"^environment variable OMP_NUM_THREADS={raw!r}: expected a positive number"):
        cores.explicit_threads(0, {"OMP_NUM_THREADS": raw})


@pytest.mark.parametrize("count", [1, 2, 3, 16, 96])
def test_one_process_alone_on_a_host_gets_every_core(count):
    assert cores.threads(node(0, count), None, [node(0, count)]) == count


@pytest.mark.parametrize("count", [2, 3, 4, 7, 16, 96])
@pytest.mark.parametrize("nproc", [1, 2, 3])
def test_two_nodes_of_one_host_never_sum_to_more_threads_than_its_cores(count, nproc):
    every = node(0, count)
    half = count // 2
    layouts = {
        "started by hand": [every] * (2 * nproc),
        "containers on disjoint cores": [node(0, half)] * nproc + [node(half, count - half)] * nproc,
    }
    for name, host in layouts.items():
        if len(host) > count:
            continue        # more processes than cores: each still gets one (next test)
        total = sum(cores.threads(own, None, host) for own in host)
        assert total <= count, name
        assert total >= count - len(host) + 1, f"{name}: {total} threads leave cores idle"


def test_processes_of_a_node_divide_its_cores_and_more_processes_than_cores_get_one_each():
    host = [node(0, 4)] * 2 + [node(4, 4)] * 2
    assert [cores.threads(own, None, host) for own in host] == [2, 2, 2, 2]
    assert cores.threads(node(0, 2), None, [node(0, 2)] * 3) == 1
    # a node without cores of its own (more nodes than the host has claims for) shares them with the others
    host = [node(0, 2), node(2, 2), node(0, 4)]
    assert [cores.threads(own, None, host) for own in host] == [1, 1, 2]


def test_the_registry_counts_live_processes_and_drops_dead_ones(tmp_path):
    registry = tmp_path / "share"
    first = cores.HostShare(None, registry, node(0, 4))
    second = cores.HostShare(None, registry, node(0, 4))
    assert sorted(map(sorted, first.host())) == [[0, 1, 2, 3]] * 2
    assert first.threads() == second.threads() == 2
    (registry / "a-dead-process").write_text("0,1,2,3")     # nobody holds its lock
    (registry / ".being-written").write_text("0")
    (registry / "not-an-entry").mkdir()
    assert first.threads() == 2
    assert not (registry / "a-dead-process").exists()
    second.close()
    assert first.threads() == 4 and first.host() == [frozenset(node(0, 4))]


def test_an_explicit_share_needs_no_count_and_apply_sets_torch(tmp_path):
    before = torch.get_num_threads()
    try:
        share, other = cores.HostShare(3, tmp_path, node(0, 8)), cores.HostShare(None, tmp_path, node(0, 8))
        assert other.threads() == 4 and share.apply() == 3 and torch.get_num_threads() == 3
        alone = cores.HostShare(None, tmp_path / "elsewhere", node(0, 2))
        assert alone.apply() == 2 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_a_registry_that_cannot_be_written_counts_the_process_alone_with_a_warning(tmp_path, capsys):
    (tmp_path / "a-file").write_text("")
    share = cores.HostShare(None, tmp_path / "a-file" / "share", node(0, 6))
    assert share.threads() == 6
    assert capsys.readouterr().err.startswith(f"warning: cannot enter this process in {tmp_path}/a-file/share")


def test_a_process_away_leaves_its_share_to_the_others_and_takes_its_own_back(tmp_path):
    """An inplace spare waits out of the count (app/ft/inplace.py): the trainers beside it take every core."""
    before = torch.get_num_threads()
    try:
        trainer, spare = cores.HostShare(None, tmp_path, node(0, 4)), cores.HostShare(None, tmp_path, node(0, 4))
        assert trainer.threads() == 2
        with spare.away():
            assert trainer.threads() == 4 and trainer.host() == [frozenset(node(0, 4))]
        assert trainer.threads() == 2 and torch.get_num_threads() == 2     # back in: its share applied
    finally:
        torch.set_num_threads(before)


def _claim(tmp_path, want: int, pinned: list) -> cores.CoreClaim:
    """A claim on a 16-core host's locks in tmp_path; its pinning recorded in `pinned`, not done."""
    return cores.CoreClaim(tmp_path / "locks", want, node(0, 16), pin=lambda on: pinned.append(sorted(on)))


def test_a_spare_that_joins_runs_on_the_cores_of_the_node_it_replaces(tmp_path):
    """Warm spares on a 16-core host, two nodes of 8 and a spare. Unpinned, the spare took 12 threads on
    every core after a swap and the survivor's count fell to 4 on its own 8: the survivor, whose pace
    the job's steps wait for, trained at half its threads."""
    before = torch.get_num_threads()
    pinned: dict[str, list] = {"a": [], "b": [], "spare": []}
    try:
        a, b, spare = (cores.HostShare(None, tmp_path / "share", node(0, 16), claim=_claim(tmp_path, 8, pinned[n]))
                       for n in ("a", "b", "spare"))
        with spare.away():                  # the job is full: it waits, holding no core
            assert a.named() == "running on cores 0,1,2,3,4,5,6,7 (claimed now)"
            assert b.named() == "running on cores 8,9,10,11,12,13,14,15 (claimed now)"
            assert a.threads() == b.threads() == 8 and not spare.claim.held
            assert a.named() is None        # named again (a new generation): it keeps what it holds
            b.claim.give_back()             # b is killed: the kernel drops its locks and its entry
            b.close()
        assert spare.named() == "running on cores 8,9,10,11,12,13,14,15 (claimed now)"
        assert pinned["spare"][-1] == sorted(node(8, 8)) and a.threads() == spare.threads() == 8
    finally:
        torch.set_num_threads(before)


def test_a_spare_that_finds_the_lost_nodes_cores_held_runs_on_every_core_and_gives_them_back_when_it_waits(tmp_path):
    """A frozen node keeps its locks: the spare named in its place runs on every core, its share of each,
    until a later generation finds cores free. Waiting again, a process holds none."""
    pinned: list = []
    a, frozen = _claim(tmp_path, 8, []), _claim(tmp_path, 8, [])
    assert a.take() and a.held == frozenset(node(0, 8))
    assert frozen.take() and frozen.held == frozenset(node(8, 8))
    spare = cores.HostShare(None, tmp_path / "share", node(0, 16), claim=_claim(tmp_path, 8, pinned))
    assert spare.named() == ("fewer than 8 cores free: running on every core (0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15) "
                             "until a generation finds them") and pinned[-1] == sorted(node(0, 16))
    frozen.give_back()                  # it woke and waits as the spare now
    assert spare.named() == "running on cores 8,9,10,11,12,13,14,15 (claimed now)"
    with spare.away():
        assert not spare.claim.held and pinned[-1] == sorted(node(0, 16)) and spare.cores == frozenset(node(0, 16))
        assert frozen.take() and frozen.held == frozenset(node(8, 8))


def test_the_claim_comes_from_the_entrypoint_and_is_split_among_the_nodes_processes(monkeypatch):
    environ = {cores.CLAIM_LOCKS_ENV: "/runs/.cpu-locks/host", cores.CLAIM_CORES_ENV: "8"}
    claim = cores.CoreClaim.from_env(environ, processes=2)
    assert claim is not None and claim.want == 4 and str(claim.locks) == "/runs/.cpu-locks/host"
    assert cores.CoreClaim.from_env({**environ, cores.CLAIM_CORES_ENV: "1"}, processes=4).want == 1
    assert cores.CoreClaim.from_env({}, processes=1) is None
    assert cores.CoreClaim.from_env({**environ, cores.CLAIM_CORES_ENV: "0"}, processes=1) is None
