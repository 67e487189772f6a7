"""Datasets held in memory as uint8 tensors, a resumable distributed sampler, and batched augmentation.

Everything random about an epoch (its order, every crop and flip) is a pure function of
(seed, epoch), independent of the world size. A resumed run therefore jumps straight to its
position inside the epoch, without replaying a data loader, and sees exactly the batches
an uninterrupted run would have seen.
"""
from __future__ import annotations

import os
import pickle
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch.utils.data.distributed import DistributedSampler

from app.datasets.files import (CIFAR10_FOLDER, DECODED_FILE, DECODED_FORMAT, DIGITS_FILE, FOLDERS, Tensors,
                               channel_stats, decode, digits_tensors, file_stamp, save_whole)
from app.core.errors import UserError


@dataclass(frozen=True)
class ImageSet:
    images: torch.Tensor  # uint8 [N, H, W, C]
    labels: torch.Tensor  # int64 [N]

    def __len__(self) -> int:
        return len(self.labels)


@dataclass(frozen=True)
class Data:
    name: str
    train: ImageSet
    test: ImageSet
    num_classes: int
    crop_pad: int       # pixels of zero padding for random crops
    flip: bool          # random horizontal flips (not for digits: a flipped 2 is no 2)
    stats: tuple[torch.Tensor, torch.Tensor] | None = None   # train mean, std per channel; None: computed


# ---------------------------------------------------------------- loading

def _cifar_like(name: str, data_dir: Path, say: Callable[[str], None]) -> Data:
    hint = _prepare_hint(name, data_dir)
    if not data_dir.is_dir():
        raise UserError(f"data directory {data_dir} {'is not a directory' if data_dir.exists() else 'does not exist'}"
                        f"; {hint}")
    path = data_dir / FOLDERS[name] / DECODED_FILE
    try:
        t, why = _read_decoded(path)
        if t is None:           # the slow path: unpickle and hash every source file
            start = time.perf_counter()
            t = decode(name, data_dir)
            say(f"{path} {why}: decoded the source files instead ({time.perf_counter() - start:.1f} s); "
                f"`python -m scripts.prepare --dataset {name} --data-dir {data_dir}` writes it once")
    except PermissionError as exc:      # preparing it again would not help
        raise UserError(f"cannot read {exc.filename}: {exc.strerror} (uid {os.getuid()})") from None
    # TypeError: a manifest.json of another shape (valid JSON, but not the generator's object)
    except (OSError, KeyError, ValueError, TypeError) as exc:
        raise UserError(f"{name} under {data_dir} is missing or corrupted ({exc}); {hint}") from None
    return Data(name, ImageSet(t["train_x"], t["train_y"]), ImageSet(t["test_x"], t["test_y"]), t["num_classes"],
                crop_pad=4, flip=True, stats=(t["mean"], t["std"]))


def _read_decoded(path: Path) -> tuple[Tensors | None, str]:
    """The decoded file, memory-mapped, if it is still the decoding of its source files (checked by
    their sizes and mtimes, and the tensors' shapes: no hashing); else None and why not."""
    if not path.is_file():
        return None, "is missing"
    try:
        t = torch.load(path, mmap=True, weights_only=True)
        changed = [f for f, (size, mtime, _) in t["sources"].items() if file_stamp(path.parent / f) != [size, mtime]]
    except (OSError, RuntimeError, KeyError, ValueError, TypeError, pickle.UnpicklingError) as exc:
        return None, f"is unreadable ({type(exc).__name__})"
    if t.get("format") != DECODED_FORMAT or not _consistent(t):
        return None, "has another layout than this version writes"
    if changed:
        return None, f"is stale ({', '.join(changed)} changed since it was written)"
    return t, ""


def _consistent(t: Tensors) -> bool:
    x, y, tx, ty = t["train_x"], t["train_y"], t["test_x"], t["test_y"]
    return (x.dtype == tx.dtype == torch.uint8 and x.ndim == tx.ndim == 4 and x.shape[1:] == tx.shape[1:]
            and len(x) == len(y) and len(tx) == len(ty) and t["mean"].shape == t["std"].shape == (x.shape[-1],))


def _digits(data_dir: Path, say: Callable[[str], None]) -> Data:
    """Small, real and always available offline. A copy under the data directory spares every (re)start
    the import of scikit-learn (5.7 s of a 11.9 s start on the H200's host): `scripts.prepare --dataset
    digits` writes it, and so does the first start that finds none in an existing data directory."""
    cached = data_dir / DIGITS_FILE
    if not cached.is_file():
        start = time.perf_counter()
        t = digits_tensors()
        made = f"{cached} is missing: made the digits with scikit-learn instead ({time.perf_counter() - start:.1f} s)"
        try:
            if not data_dir.is_dir():       # a directory the user did not make is not made here
                raise FileNotFoundError(f"{data_dir} is no directory")
            save_whole(t, cached)
            say(f"{made}; kept there for the next start")
        except OSError as exc:
            say(f"{made}; cannot keep them there ({exc.strerror or exc}): "
                f"`python -m scripts.prepare --dataset digits --data-dir {data_dir}` writes it once")
    else:
        try:
            t = torch.load(cached, mmap=True, weights_only=True)
        except Exception as exc:    # unpickling raises many kinds, with advice (weights_only=False) not to take
            raise UserError(f"{cached} is unreadable or corrupted ({type(exc).__name__}); "
                            f"{_prepare_hint('digits', data_dir)}") from None
    return Data("digits", ImageSet(t["train_x"], t["train_y"]), ImageSet(t["test_x"], t["test_y"]), 10,
                crop_pad=1, flip=False)


def _prepare_hint(name: str, data_dir: Path) -> str:
    return f"prepare it with `python -m scripts.prepare --dataset {name} --data-dir {data_dir}`"


def resolve(name: str, data_dir: Path) -> str:
    """The dataset `--dataset auto` stands for: CIFAR-10 when it is prepared under data_dir, else digits."""
    if name != "auto":
        return name
    return "cifar10" if (data_dir / CIFAR10_FOLDER).is_dir() else "digits"


def load(name: str, data_dir: Path, say: Callable[[str], None] = print) -> Data:
    """A resolved dataset name (see resolve) in memory; `say` gets one line when the slow path was taken."""
    return _digits(data_dir, say) if name == "digits" else _cifar_like(name, data_dir, say)


# ---------------------------------------------------------------- sampling

class ResumableSampler(DistributedSampler):
    """DistributedSampler that can start part-way through an epoch.

    The epoch's global order is DistributedSampler's (a permutation seeded by seed + epoch,
    the same for every world size). `consumed` samples of it were already trained on, by all
    ranks together; the rest is trimmed to a multiple of the world size and dealt out round-robin.
    With the world size unchanged this is exactly the remainder of the uninterrupted epoch;
    with another world size, every remaining sample is still seen once, in the same global order.
    """

    def __init__(self, size: int, num_replicas: int, rank: int, seed: int) -> None:
        super().__init__(range(size), num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=True)
        self.consumed = 0

    def set_position(self, epoch: int, consumed: int) -> None:
        self.set_epoch(epoch)
        self.consumed = consumed

    def indices(self, device: torch.device) -> torch.Tensor:
        """This rank's remaining indices of the epoch, made where they are used: on a GPU the
        permutation comes from a CUDA generator, with no host copy (a sync) per epoch. CUDA's
        randperm draws another permutation from the same seed than the CPU's: still a function of
        (seed, epoch) on every rank of a job (all on one kind of device), but a job moved between
        CPU and GPU mid-epoch would see another order for the rest of that epoch."""
        order = self.order(device)[self.consumed:]
        return order[: len(order) - len(order) % self.num_replicas][self.rank :: self.num_replicas]

    def order(self, device: torch.device) -> torch.Tensor:
        """The epoch's global order: every sample once, a function of (seed, epoch) only."""
        g = torch.Generator(device).manual_seed(self.seed + self.epoch)
        return torch.randperm(len(self.dataset), generator=g, device=device)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices(torch.device("cpu")).tolist())

    def __len__(self) -> int:
        remaining = max(0, len(self.dataset) - self.consumed)
        return (remaining - remaining % self.num_replicas) // self.num_replicas


# ---------------------------------------------------------------- batches

class Batches:
    """Turns sample indices into normalised, augmented float batches on the training device."""

    def __init__(self, data: Data, device: torch.device, seed: int, augment: bool) -> None:
        self.data, self.device, self.seed, self.augment = data, device, seed, augment
        self.train_images = data.train.images.to(device)
        self.train_labels = data.train.labels.to(device)
        self.test_images = data.test.images.to(device)
        self.test_labels = data.test.labels.to(device)
        mean, std = data.stats or channel_stats(data.train.images)
        self.mean = mean.to(device).view(1, -1, 1, 1)
        self.std = std.clamp_min(1e-3).to(device).view(1, -1, 1, 1)
        self.channels_last = device.type == "cuda"

    def relocate(self, device: torch.device) -> None:
        """The data onto another GPU (a spare that claimed it when named, app/cluster/gpus.py)."""
        self.device = device
        for name in ("train_images", "train_labels", "test_images", "test_labels", "mean", "std"):
            setattr(self, name, getattr(self, name).to(device))

    def epoch_augmentation(self, epoch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Crop offsets and flips for every training image in this epoch: a function of (seed, epoch) only."""
        n, pad = len(self.data.train), self.data.crop_pad
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        dy = torch.randint(0, 2 * pad + 1, (n,), generator=g)
        dx = torch.randint(0, 2 * pad + 1, (n,), generator=g)
        flip = torch.rand(n, generator=g) < 0.5 if self.data.flip else torch.zeros(n, dtype=torch.bool)
        return dy.to(self.device), dx.to(self.device), flip.to(self.device)

    def train_batch(self, idx: torch.Tensor | list[int],
                    aug: tuple[torch.Tensor, ...] | None) -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.as_tensor(idx, device=self.device)     # already there when the trainer calls
        images = self.train_images[index].permute(0, 3, 1, 2)          # NHWC -> NCHW, still uint8
        if self.augment and aug is not None:
            images = self._crop_and_flip(images, *(a[index] for a in aug))
        return self._normalise(images), self.train_labels[index]

    def test_batches(self, rank: int, world: int, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's shard of the test set, unpadded so that summed counts are exact."""
        shard = torch.arange(rank, len(self.test_labels), world, device=self.device)
        for chunk in shard.split(batch_size):
            yield self._normalise(self.test_images[chunk].permute(0, 3, 1, 2)), self.test_labels[chunk]

    def _crop_and_flip(self, images: torch.Tensor, dy: torch.Tensor, dx: torch.Tensor,
                       flip: torch.Tensor) -> torch.Tensor:
        b, c, h, w = images.shape
        pad = self.data.crop_pad
        padded = F.pad(images, (pad, pad, pad, pad))
        rows = (dy[:, None] + torch.arange(h, device=self.device))[:, None, :, None]
        cols = (dx[:, None] + torch.arange(w, device=self.device))[:, None, None, :]
        batch = torch.arange(b, device=self.device)[:, None, None, None]
        chans = torch.arange(c, device=self.device)[None, :, None, None]
        cropped = padded[batch, chans, rows, cols]
        return torch.where(flip[:, None, None, None], cropped.flip(3), cropped)

    def _normalise(self, images: torch.Tensor) -> torch.Tensor:
        x = (images.float() / 255.0 - self.mean) / self.std
        return x.contiguous(memory_format=torch.channels_last) if self.channels_last else x
