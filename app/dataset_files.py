"""Where the datasets live on disk, and the one dataset made here rather than downloaded.

Shared by `scripts/prepare.py`, which writes these files outside the training processes, and
the trainer, which reads them. This module imports no other `app` module: the image's prefetch
layer (docker/Dockerfile) copies only this file and `scripts/prepare.py`, so that editing the
trainer does not re-run the prefetch. tests/test_data.py enforces it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

CIFAR10_FOLDER = "cifar-10-batches-py"            # torchvision's folder names
SYNTHETIC_FOLDER = "synthetic-cifar-batches-py"   # generated, in CIFAR-10's on-disk format
SYNTHETIC_MANIFEST = "manifest.json"              # md5 of every generated file
DIGITS_FILE = "digits.pt"                         # scikit-learn's digits as a tensor file


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
