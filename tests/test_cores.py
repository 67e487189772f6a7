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
