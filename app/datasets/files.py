"""Where the datasets live on disk, and the one dataset made here rather than downloaded.

Shared by `scripts/prepare.py`, which writes these files outside the training processes, and
the trainer, which reads them. This module imports no other `app` module: the image's prefetch
layer (docker/Dockerfile) copies only this file and `scripts/prepare.py`, so that editing the
trainer does not re-run the prefetch. tests/test_data.py enforces it.
"""
from __future__ import annotations

import hashlib
import json
import pickle
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

CIFAR10_FOLDER = "cifar-10-batches-py"            # torchvision's folder names
CIFAR100_FOLDER = "cifar-100-python"
SYNTHETIC_FOLDER = "synthetic-cifar-batches-py"   # generated, in CIFAR-10's on-disk format
SYNTHETIC_MANIFEST = "manifest.json"              # md5 of every generated file
DIGITS_FILE = "digits.pt"                         # scikit-learn's digits as a tensor file
FOLDERS = {"cifar10": CIFAR10_FOLDER, "cifar100": CIFAR100_FOLDER, "synthetic": SYNTHETIC_FOLDER}
# The decoded copy of a CIFAR-format folder, written into it by scripts/prepare.py: uint8 images,
# labels, per-channel mean and std, and each source file's size, mtime and md5, so that a start
# memory-maps it and checks it with a few stat() calls instead of unpickling and hashing 180 MB.
DECODED_FILE = "decoded.pt"
DECODED_FORMAT = 1                                # bumped whenever the decoded file's layout changes

Tensors = dict[str, Any]     # tensors, plus the few ints and lists that describe them


def digits_tensors() -> dict[str, torch.Tensor]:
    """scikit-learn's bundled 8x8 handwritten digits as uint8 RGB, with a fixed stratified split."""
    import torch
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = torch.from_numpy(digits.images * (255.0 / 16.0)).round().to(torch.uint8)
    images = images[..., None].expand(-1, -1, -1, 3).contiguous()      # grey -> 3 channels
    labels = torch.from_numpy(digits.target).to(torch.int64)
    idx_train, idx_test = train_test_split(range(len(labels)), test_size=0.2, random_state=0, stratify=labels)
    return {"train_x": images[idx_train], "train_y": labels[idx_train],
            "test_x": images[idx_test], "test_y": labels[idx_test]}


def save_whole(tensors: Tensors, final: Path) -> None:
    """torch.save under a temporary name, then renamed: a reader (a start, another rank writing the same
    file) never sees half of it."""
    import os

    import torch

    tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
    try:
        torch.save(tensors, tmp)
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)


def channel_stats(images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and standard deviation of uint8 images [N, H, W, C], scaled to [0, 1].

    From a 256-bin histogram per channel: exact, and without the float copy of every pixel
    (1.2 GB for CIFAR-10 in float64) that a plain mean/std would make.
    """
    import torch

    channels = images.shape[-1]
    flat = images.reshape(-1, channels)
    hist = torch.stack([torch.bincount(flat[:, c].contiguous(), minlength=256) for c in range(channels)]).double()
    levels = torch.arange(256, dtype=torch.float64) / 255.0
    n = hist.sum(1)
    mean = (hist * levels).sum(1) / n
    var = (hist * (levels - mean[:, None]) ** 2).sum(1) / (n - 1)
    return mean.float(), var.sqrt().float()


def file_stamp(path: Path) -> list[int]:
    """[size, mtime in ns]: what a start compares, cheaply, to tell a decoded file is still current."""
    st = path.stat()
    return [st.st_size, st.st_mtime_ns]


def _expected_md5(name: str, folder: Path) -> tuple[list[str], list[str], str, dict[str, str]]:
    """(train files, test files, meta file, md5 of each): the generator's manifest for synthetic
    data, torchvision's published sums for CIFAR."""
    if name == "synthetic":
        manifest = json.loads((folder / SYNTHETIC_MANIFEST).read_text())
        return manifest["train_files"], manifest["test_files"], manifest["meta_file"], manifest["md5"]
    import torchvision

    cls = {"cifar10": torchvision.datasets.CIFAR10, "cifar100": torchvision.datasets.CIFAR100}[name]
    md5 = {file: digest for file, digest in cls.train_list + cls.test_list}
    md5[cls.meta["filename"]] = cls.meta["md5"]
    return [f for f, _ in cls.train_list], [f for f, _ in cls.test_list], cls.meta["filename"], md5


def _unpickle(path: Path, md5: str) -> dict[str, Any]:
    payload = path.read_bytes()
    if hashlib.md5(payload).hexdigest() != md5:
        raise ValueError(f"{path.name} does not match its md5 sum")
    return pickle.loads(payload, encoding="latin1")


def _split(folder: Path, files: list[str], md5: dict[str, str]) -> tuple[torch.Tensor, torch.Tensor]:
    import numpy as np
    import torch

    batches = [_unpickle(folder / f, md5[f]) for f in files]
    images = np.concatenate([b["data"] for b in batches]).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    labels = [label for b in batches for label in b.get("labels", b.get("fine_labels", []))]
    return torch.from_numpy(np.ascontiguousarray(images)), torch.tensor(labels, dtype=torch.int64)


def decode(name: str, data_dir: Path) -> Tensors:
    """A CIFAR-format folder (cifar10, cifar100, synthetic) decoded, every file checked against its md5.

    Raises OSError, KeyError or ValueError when files are missing or corrupted.
    """
    folder = data_dir / FOLDERS[name]
    train_files, test_files, meta_file, md5 = _expected_md5(name, folder)
    train_x, train_y = _split(folder, train_files, md5)
    test_x, test_y = _split(folder, test_files, md5)
    meta = _unpickle(folder / meta_file, md5[meta_file])
    mean, std = channel_stats(train_x)
    sources = [*train_files, *test_files, meta_file] + ([SYNTHETIC_MANIFEST] if name == "synthetic" else [])
    return {"format": DECODED_FORMAT, "train_x": train_x, "train_y": train_y, "test_x": test_x, "test_y": test_y,
            "mean": mean, "std": std, "num_classes": len(meta.get("label_names", meta.get("fine_label_names", []))),
            "sources": {f: [*file_stamp(folder / f), md5.get(f, "")] for f in sources}}
