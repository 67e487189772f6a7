"""Datasets, the resumable sampler, and per-epoch augmentation."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from torch.utils.data.distributed import DistributedSampler

from app.core.errors import UserError
from app.datasets import data, files as dataset_files
from app.datasets.data import Batches, Data, ImageSet, ResumableSampler
from tests.helpers import SYNTHETIC_TEST, SYNTHETIC_TRAIN

pytestmark = pytest.mark.unit

N = 103          # not a multiple of any world size used below: trimming is exercised


def rank_orders(size: int, world: int, seed: int, epoch: int, consumed: int = 0) -> list[list[int]]:
    out = []
    for rank in range(world):
        s = ResumableSampler(size, world, rank, seed)
        s.set_position(epoch, consumed)
        out.append(list(s))
        assert len(s) == len(out[-1])
    return out


def global_order(size: int, seed: int, epoch: int) -> list[int]:
    g = torch.Generator().manual_seed(seed + epoch)
    return torch.randperm(size, generator=g).tolist()


# ---------------------------------------------------------------- sampler

@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_fresh_epoch_is_distributed_samplers_order(world):
    ours = rank_orders(N, world, seed=5, epoch=2)
    for rank in range(world):
        ref = DistributedSampler(range(N), num_replicas=world, rank=rank, shuffle=True, seed=5, drop_last=True)
        ref.set_epoch(2)
        assert ours[rank] == list(ref)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("steps_done", [0, 1, 5, 8])
def test_resume_at_same_world_size_is_the_tail_of_the_uninterrupted_order(world, steps_done):
    per_rank_batch = 4
    consumed = steps_done * per_rank_batch * world       # how the trainer counts: all ranks together
    full = rank_orders(N, world, seed=0, epoch=3)
    resumed = rank_orders(N, world, seed=0, epoch=3, consumed=consumed)
    for rank in range(world):
        assert resumed[rank] == full[rank][steps_done * per_rank_batch:]


@pytest.mark.parametrize("old_world, new_world", [(2, 1), (1, 2), (2, 3), (4, 3), (3, 2)])
def test_resume_at_another_world_size_covers_the_global_remainder_once(old_world, new_world):
    seed, epoch = 11, 1
    consumed = 6 * 2 * old_world                         # six steps of batch 2 at the old world size
    remainder = global_order(N, seed, epoch)[consumed:]
    usable = len(remainder) - len(remainder) % new_world  # at most new_world - 1 samples are left out
    per_rank = rank_orders(N, new_world, seed, epoch, consumed)
    dealt = [i for rank in per_rank for i in rank]
    assert len(dealt) == len(set(dealt)) == usable >= len(remainder) - (new_world - 1)
    assert set(dealt) == set(remainder[:usable])
    # Round-robin in the global order: interleaving the ranks gives the global remainder back.
    interleaved = [per_rank[r][i] for i in range(usable // new_world) for r in range(new_world)]
    assert interleaved == remainder[:usable]
    # And nothing already trained on in this epoch comes back.
    assert not set(dealt) & set(global_order(N, seed, epoch)[:consumed])


def test_order_depends_on_seed_and_epoch_only():
    a = rank_orders(N, 2, seed=0, epoch=0)
    assert a == rank_orders(N, 2, seed=0, epoch=0)
    assert a != rank_orders(N, 2, seed=0, epoch=1)
    assert a != rank_orders(N, 2, seed=1, epoch=0)
    s = ResumableSampler(N, 1, 0, seed=0)
    s.set_position(0, 0)
    assert sorted(s) == list(range(N - N % 1))


def test_consumed_past_the_end_gives_nothing():
    s = ResumableSampler(N, 2, 1, seed=0)
    s.set_position(0, N + 5)
    assert list(s) == [] and len(s) == 0


# ---------------------------------------------------------------- augmentation

def toy_data(n: int = 40, flip: bool = True, side: int = 6) -> Data:
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (n, side, side, 3), generator=g, dtype=torch.uint8)
    labels = torch.randint(0, 4, (n,), generator=g)
    return Data("toy", ImageSet(images, labels), ImageSet(images[:8], labels[:8]), 4, crop_pad=2, flip=flip)


def test_augmentation_is_a_function_of_seed_and_epoch():
    d = toy_data()
    a = Batches(d, torch.device("cpu"), seed=3, augment=True)
    b = Batches(d, torch.device("cpu"), seed=3, augment=True)      # another process, same (seed, epoch)
    torch.manual_seed(123)                                           # the global RNG plays no part
    for epoch in (0, 1, 7):
        for x, y in zip(a.epoch_augmentation(epoch), b.epoch_augmentation(epoch)):
            assert torch.equal(x, y)
    e0, e1 = a.epoch_augmentation(0), a.epoch_augmentation(1)
    assert any(not torch.equal(x, y) for x, y in zip(e0, e1))
    other_seed = Batches(d, torch.device("cpu"), seed=4, augment=True).epoch_augmentation(0)
    assert any(not torch.equal(x, y) for x, y in zip(e0, other_seed))


def test_augmented_batches_match_across_instances_and_differ_across_epochs():
    d = toy_data()
    a = Batches(d, torch.device("cpu"), seed=0, augment=True)
    b = Batches(d, torch.device("cpu"), seed=0, augment=True)
    idx = [5, 0, 17, 33]
    xa, ya = a.train_batch(idx, a.epoch_augmentation(2))
    xb, yb = b.train_batch(idx, b.epoch_augmentation(2))
    assert torch.equal(xa, xb) and torch.equal(ya, yb) and torch.equal(ya, d.train.labels[idx])
    assert xa.shape == (4, 3, 6, 6) and xa.dtype == torch.float32
    x3, _ = a.train_batch(idx, a.epoch_augmentation(3))
    assert not torch.equal(xa, x3)


def test_a_sample_is_augmented_the_same_whatever_batch_it_is_in():
    # What lets a different world size (other batch composition) see the same augmented images.
    d = toy_data()
    bt = Batches(d, torch.device("cpu"), seed=0, augment=True)
    aug = bt.epoch_augmentation(1)
    together, _ = bt.train_batch([3, 9, 21], aug)
    alone, _ = bt.train_batch([9], aug)
    assert torch.equal(together[1], alone[0])


def test_crop_and_flip_are_what_the_offsets_say():
    d = toy_data(n=4, flip=True)
    bt = Batches(d, torch.device("cpu"), seed=0, augment=True)
    dy, dx, flip = torch.tensor([0, 2, 4, 2]), torch.tensor([0, 2, 1, 2]), torch.tensor([False, False, False, True])
    x, _ = bt.train_batch([0, 1, 2, 3], (dy, dx, flip))
    raw = d.train.images.permute(0, 3, 1, 2).float() / 255.0
    expect = (raw - bt.mean) / bt.std
    assert torch.allclose(x[1], expect[1])                    # offset (pad, pad): the image itself
    assert torch.allclose(x[3], expect[3].flip(2))            # centred and flipped
    zero = ((0.0 - bt.mean) / bt.std)[0]                      # a padding pixel, normalised
    assert torch.allclose(x[0][:, 2:, 2:], expect[0][:, :4, :4])  # offset (0, 0): shifted down-right
    assert torch.allclose(x[0][:, :2, :], zero.expand(3, 2, 6))
    assert torch.allclose(x[2][:, :4, 1:], expect[2][:, 2:, :5])  # offset (4, 1)
    assert torch.allclose(x[2][:, 4:, :], zero.expand(3, 2, 6))


def test_no_flips_for_digits_and_no_augmentation_when_off():
    d = toy_data(flip=False)
    bt = Batches(d, torch.device("cpu"), seed=0, augment=True)
    _, _, flip = bt.epoch_augmentation(0)
    assert not flip.any()
    plain = Batches(d, torch.device("cpu"), seed=0, augment=False)
    x, _ = plain.train_batch([1, 2], plain.epoch_augmentation(0))
    assert torch.allclose(x, (d.train.images[[1, 2]].permute(0, 3, 1, 2).float() / 255.0 - plain.mean) / plain.std)


def test_test_batches_shard_the_test_set_exactly_once():
    d = toy_data()
    bt = Batches(d, torch.device("cpu"), seed=0, augment=True)
    seen = []
    for rank in range(3):
        for _, y in bt.test_batches(rank, 3, batch_size=2):
            seen.extend(y.tolist())
    assert sorted(seen) == sorted(d.test.labels.tolist())


# ---------------------------------------------------------------- loading

def test_digits_load(tmp_path):
    d = data.load("digits", Path("/nonexistent"))
    assert d.name == "digits" and d.num_classes == 10 and (d.crop_pad, d.flip) == (1, False)
    assert (len(d.train), len(d.test)) == (1437, 360)
    assert d.train.images.shape == (1437, 8, 8, 3) and d.train.images.dtype == torch.uint8
    assert d.train.labels.dtype == torch.int64 and set(d.test.labels.tolist()) == set(range(10))
    assert torch.equal(d.train.labels, data.load("digits", tmp_path).train.labels)    # a fixed split
    assert (tmp_path / "digits.pt").is_file(), "kept for the next start (in a directory, never the checkout's)"


def test_auto_is_cifar10_when_prepared_else_digits(tmp_path):
    assert data.resolve("auto", tmp_path) == "digits"
    (tmp_path / dataset_files.CIFAR10_FOLDER).mkdir()
    assert data.resolve("auto", tmp_path) == "cifar10"
    assert data.resolve("synthetic", tmp_path) == "synthetic"


def test_synthetic_loads(synthetic_data):
    d = data.load("synthetic", synthetic_data)
    assert (len(d.train), len(d.test)) == (SYNTHETIC_TRAIN, SYNTHETIC_TEST)
    assert d.train.images.shape == (SYNTHETIC_TRAIN, 32, 32, 3) and d.num_classes == 10
    assert d.flip and d.crop_pad == 4


@pytest.fixture
def synthetic_copy(synthetic_data, tmp_path) -> Path:
    shutil.copytree(synthetic_data, tmp_path / "data")
    return tmp_path / "data"


def test_synthetic_with_changed_bytes_is_rejected(synthetic_copy):
    target = synthetic_copy / dataset_files.SYNTHETIC_FOLDER / "data_batch_3"
    payload = bytearray(target.read_bytes())
    payload[len(payload) // 2] ^= 0x01                   # one bit, same size: only a checksum notices
    target.write_bytes(bytes(payload))
    with pytest.raises(UserError) as err:
        data.load("synthetic", synthetic_copy)
    message = str(err.value)
    assert f"synthetic under {synthetic_copy} is missing or corrupted" in message
    assert f"python -m scripts.prepare --dataset synthetic --data-dir {synthetic_copy}" in message
    assert "\n" not in message


def test_synthetic_with_changed_test_batch_is_rejected(synthetic_copy):
    target = synthetic_copy / dataset_files.SYNTHETIC_FOLDER / "test_batch"
    target.write_bytes(target.read_bytes()[:-10])        # truncated
    with pytest.raises(UserError, match="missing or corrupted"):
        data.load("synthetic", synthetic_copy)


def test_synthetic_without_manifest_is_rejected(synthetic_copy):
    (synthetic_copy / dataset_files.SYNTHETIC_FOLDER / dataset_files.SYNTHETIC_MANIFEST).unlink()
    with pytest.raises(UserError, match="missing or corrupted.*scripts.prepare"):
        data.load("synthetic", synthetic_copy)


def test_synthetic_with_a_manifest_naming_a_missing_file_is_rejected(synthetic_copy):
    manifest_path = synthetic_copy / dataset_files.SYNTHETIC_FOLDER / dataset_files.SYNTHETIC_MANIFEST
    manifest = json.loads(manifest_path.read_text())
    (synthetic_copy / dataset_files.SYNTHETIC_FOLDER / manifest["train_files"][0]).unlink()
    with pytest.raises(UserError, match="missing or corrupted"):
        data.load("synthetic", synthetic_copy)


@pytest.mark.parametrize("content", ["42", "[]"])
def test_synthetic_with_a_manifest_of_another_shape_is_rejected(synthetic_copy, content):
    (synthetic_copy / dataset_files.SYNTHETIC_FOLDER / dataset_files.SYNTHETIC_MANIFEST).write_text(content)
    with pytest.raises(UserError, match="missing or corrupted.*scripts.prepare"):
        data.load("synthetic", synthetic_copy)


def test_a_corrupt_digits_copy_is_one_error(tmp_path):
    (tmp_path / dataset_files.DIGITS_FILE).write_bytes(b"not a tensor file")
    with pytest.raises(UserError) as err:
        data.load("digits", tmp_path)
    cached, hint = tmp_path / dataset_files.DIGITS_FILE, f"`python -m scripts.prepare --dataset digits --data-dir {tmp_path}`"
    assert str(err.value).startswith(f"{cached} is unreadable or corrupted (")     # the type: mmap's or pickle's
    assert str(err.value).endswith(f"); prepare it with {hint}")


def test_a_data_directory_that_is_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(UserError, match=r"data directory .*f is not a directory; prepare it with"):
        data.load("synthetic", tmp_path / "f")


def load_saying(name: str, data_dir: Path) -> tuple[Data, list[str]]:
    said: list[str] = []
    return data.load(name, data_dir, said.append), said


def assert_same_data(a: Data, b: Data) -> None:
    for x, y in [(a.train.images, b.train.images), (a.train.labels, b.train.labels),
                 (a.test.images, b.test.images), (a.test.labels, b.test.labels), *zip(a.stats, b.stats)]:
        assert torch.equal(x, y)
    assert a.num_classes == b.num_classes


def test_prepare_writes_a_decoded_file_that_loads_silently_and_equals_the_sources(synthetic_copy):
    decoded = synthetic_copy / dataset_files.SYNTHETIC_FOLDER / dataset_files.DECODED_FILE
    fast, said = load_saying("synthetic", synthetic_copy)
    assert decoded.is_file() and said == []
    decoded.unlink()
    slow, said = load_saying("synthetic", synthetic_copy)
    assert len(said) == 1 and f"{decoded} is missing" in said[0]
    assert "python -m scripts.prepare --dataset synthetic" in said[0]
    assert_same_data(fast, slow)
    torch.testing.assert_close(fast.stats, dataset_files.channel_stats(slow.train.images))


def test_a_source_file_changed_after_decoding_makes_the_decoded_file_stale(synthetic_copy):
    folder = synthetic_copy / dataset_files.SYNTHETIC_FOLDER
    before, _ = load_saying("synthetic", synthetic_copy)
    stamp = (folder / "test_batch").stat()
    os.utime(folder / "test_batch", ns=(stamp.st_atime_ns, stamp.st_mtime_ns + 1))   # same bytes, new mtime
    after, said = load_saying("synthetic", synthetic_copy)
    assert len(said) == 1 and "is stale (test_batch changed" in said[0]
    assert_same_data(before, after)


@pytest.mark.parametrize("damage", ["truncate", "relabel"])
def test_a_damaged_decoded_file_is_not_used(synthetic_copy, damage):
    decoded = synthetic_copy / dataset_files.SYNTHETIC_FOLDER / dataset_files.DECODED_FILE
    if damage == "truncate":
        decoded.write_bytes(decoded.read_bytes()[:1000])
    else:                       # a file of another layout: labels that do not match the images
        t = torch.load(decoded, weights_only=True)
        torch.save({**t, "train_y": t["train_y"][:-1]}, decoded)
    d, said = load_saying("synthetic", synthetic_copy)
    assert len(said) == 1 and ("is unreadable" in said[0] or "another layout" in said[0])
    assert len(d.train.images) == len(d.train.labels) == SYNTHETIC_TRAIN


def test_prepared_digits_load_without_scikit_learn_and_unprepared_ones_say_how(tmp_path):
    from scripts import prepare

    prepare.write_digits(tmp_path / "prepared")
    prepared, said = load_saying("digits", tmp_path / "prepared")
    assert said == []
    (tmp_path / "a-file").write_text("")        # nowhere to keep them (as root, a read-only folder is no bar)
    d, said = load_saying("digits", tmp_path / "a-file" / "data")
    assert len(said) == 1 and f"{tmp_path / 'a-file' / 'data' / dataset_files.DIGITS_FILE} is missing" in said[0]
    assert "cannot keep them there" in said[0] and "scripts.prepare --dataset digits" in said[0]
    assert torch.equal(prepared.train.images, d.train.images)


def test_the_first_start_without_digits_keeps_them_for_the_next(tmp_path, monkeypatch):
    """A GPU host with no prepared data paid scikit-learn's import at every start (5.7 s of 11.9 s on the
    H200's host, docs/gpu.md): the first start keeps what it made, the next loads it without scikit-learn."""
    nowhere, said = load_saying("digits", tmp_path / "data")     # no such directory: none made, nothing kept
    assert len(said) == 1 and "cannot keep them there" in said[0] and not (tmp_path / "data").exists(), said
    (tmp_path / "data").mkdir()
    made, said = load_saying("digits", tmp_path / "data")
    assert len(said) == 1 and said[0].endswith("kept there for the next start"), said
    monkeypatch.setattr(dataset_files, "digits_tensors", lambda: pytest.fail("made again"))
    monkeypatch.setattr(data, "digits_tensors", lambda: pytest.fail("made again"))
    again, said = load_saying("digits", tmp_path / "data")
    assert said == [] and torch.equal(again.train.images, made.train.images)
    assert not [p.name for p in (tmp_path / "data").iterdir() if p.name.startswith(".")], "a temporary file was left"


def test_missing_data_directory(tmp_path):
    with pytest.raises(UserError, match=r"data directory .*nope does not exist; prepare it with"):
        data.load("synthetic", tmp_path / "nope")


def test_channel_stats_match_a_plain_float64_mean_and_std():
    images = torch.randint(0, 256, (50, 6, 5, 3), dtype=torch.uint8)
    pixels = images.reshape(-1, 3).double() / 255.0
    mean, std = dataset_files.channel_stats(images)
    torch.testing.assert_close(mean, pixels.mean(0).float())
    torch.testing.assert_close(std, pixels.std(0).float())


def test_dataset_files_imports_no_other_app_module():
    """The image's prefetch layer copies app/datasets/files.py alone (docker/Dockerfile)."""
    import ast

    tree = ast.parse(Path(dataset_files.__file__).read_text())
    imported = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in imported if m == "app" or m.startswith("app.")], imported
