"""CIFAR-10/100 and the generated CIFAR-format data set, read by torchvision's own loaders."""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torchvision

from app.dataset_files import SYNTHETIC_FOLDER, SYNTHETIC_MANIFEST

Split = tuple[torch.Tensor, torch.Tensor]   # uint8 images [N, H, W, C], int64 labels [N]


class SyntheticCIFAR(torchvision.datasets.CIFAR10):
    """Generated files in CIFAR-10's on-disk format, read by torchvision's own loader.

    torchvision checks every file against the official CIFAR md5 sums, which generated files
    can never match. Instead of switching the check off, this class checks the files against
    the md5 sums the generator recorded in manifest.json next to them.
    """

    base_folder = SYNTHETIC_FOLDER

    def __init__(self, root: str | Path, train: bool = True) -> None:
        manifest = json.loads((Path(root) / SYNTHETIC_FOLDER / SYNTHETIC_MANIFEST).read_text())
        md5 = manifest["md5"]
        self.train_list = [[name, md5[name]] for name in manifest["train_files"]]
        self.test_list = [[name, md5[name]] for name in manifest["test_files"]]
        self.meta = {"filename": manifest["meta_file"], "key": "label_names", "md5": md5[manifest["meta_file"]]}
        super().__init__(str(root), train=train, download=False)


def _split(ds: torchvision.datasets.CIFAR10) -> Split:
    return torch.from_numpy(ds.data).contiguous(), torch.tensor(ds.targets, dtype=torch.int64)


def load(name: str, root: Path) -> tuple[Split, Split, int]:
    """(train, test, number of classes); raises RuntimeError when files are missing or corrupted."""
    if name == "synthetic":
        train, test = SyntheticCIFAR(root, train=True), SyntheticCIFAR(root, train=False)
        return _split(train), _split(test), len(train.classes)
    cls = {"cifar10": torchvision.datasets.CIFAR10, "cifar100": torchvision.datasets.CIFAR100}[name]
    train, test = cls(str(root), train=True, download=False), cls(str(root), train=False, download=False)
    return _split(train), _split(test), len(train.classes)
