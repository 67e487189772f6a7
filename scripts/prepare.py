"""Prepare datasets and run directories OUTSIDE the training processes.

Training ranks never download and never create data directories (neither is safe with many
processes starting at once). Run this once per host, or let `make up` / the image build run it:

    python -m scripts.prepare --data-dir data --dataset cifar10           # download CIFAR-10
    python -m scripts.prepare --data-dir data --dataset synthetic --synthetic-train 50000

Every CIFAR-format dataset also gets its decoded copy (decoded.pt in its folder), which training
starts memory-map instead of unpickling and hashing the source files; run it again after changing them.
    python -m scripts.prepare --run-dir runs/job1 --owner 1000:1000       # a run directory for containers
    python -m scripts.prepare --data-dir /data --dataset cifar10 --optional   # the image build: offline is fine
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import pickle
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

# numpy, torch and torchvision are imported where they are needed, so that preparing a run
# directory (`make up`) works with a bare python3 on the host.
TRAIN_FILES = [f"data_batch_{i}" for i in range(1, 6)]


def download_cifar(name: str, data_dir: Path) -> None:
    """torchvision's own download with its md5 checks; a no-op when the files are already there."""
    import torchvision

    cls = {"cifar10": torchvision.datasets.CIFAR10, "cifar100": torchvision.datasets.CIFAR100}[name]
    data_dir.mkdir(parents=True, exist_ok=True)
    for train in (True, False):
        cls(str(data_dir), train=train, download=True)


def _class_images(rng: np.random.Generator, labels: np.ndarray, templates: np.ndarray) -> np.ndarray:
    """Each class is a smooth random colour pattern; images are that pattern, shifted and noisy."""
    import numpy as np

    base = templates[labels].astype(np.float32)                        # [n, 3, 32, 32]
    shifts = rng.integers(-3, 4, size=(len(labels), 2))
    for i, (dy, dx) in enumerate(shifts):
        base[i] = np.roll(base[i], (int(dy), int(dx)), axis=(1, 2))
    noisy = base + rng.normal(0.0, 90.0, size=base.shape)
    return np.clip(noisy, 0, 255).astype(np.uint8).reshape(len(labels), -1)


def write_synthetic(data_dir: Path, n_train: int, n_test: int, num_classes: int = 10, seed: int = 0) -> Path:
    """CIFAR-10-format pickles (5 train batches, a test batch, meta) plus a manifest of their md5 sums."""
    import numpy as np

    from app.datasets.files import SYNTHETIC_FOLDER, SYNTHETIC_MANIFEST

    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 256, size=(num_classes, 3, 4, 4)).astype(np.float32)
    templates = coarse.repeat(8, axis=2).repeat(8, axis=3)            # 4x4 blocks -> 32x32
    out = data_dir / SYNTHETIC_FOLDER
    out.mkdir(parents=True, exist_ok=True)
    md5: dict[str, str] = {}

    def dump(name: str, obj: dict) -> None:
        payload = pickle.dumps(obj, protocol=2)
        (out / name).write_bytes(payload)
        md5[name] = hashlib.md5(payload).hexdigest()

    train_labels = rng.integers(0, num_classes, size=n_train)
    for i, part in enumerate(np.array_split(np.arange(n_train), len(TRAIN_FILES))):
        labels = train_labels[part]
        dump(TRAIN_FILES[i], {"data": _class_images(rng, labels, templates), "labels": labels.tolist(),
                              "batch_label": f"synthetic training batch {i + 1} of 5"})
    test_labels = rng.integers(0, num_classes, size=n_test)
    dump("test_batch", {"data": _class_images(rng, test_labels, templates), "labels": test_labels.tolist(),
                        "batch_label": "synthetic testing batch"})
    dump("batches.meta", {"label_names": [f"class_{c}" for c in range(num_classes)]})
    manifest = {"generator": "scripts/prepare.py", "seed": seed, "train": n_train, "test": n_test,
                "train_files": TRAIN_FILES, "test_files": ["test_batch"], "meta_file": "batches.meta", "md5": md5}
    (out / SYNTHETIC_MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return out


def write_digits(data_dir: Path) -> Path:
    """scikit-learn's bundled digits (nothing to fetch), saved where the trainer loads it fastest."""
    from app.datasets.files import DIGITS_FILE, digits_tensors, save_whole

    data_dir.mkdir(parents=True, exist_ok=True)
    save_whole(digits_tensors(), data_dir / DIGITS_FILE)
    return data_dir / DIGITS_FILE


def write_decoded(name: str, data_dir: Path) -> Path:
    """The decoded copy a training start memory-maps (app/datasets/files.py, DECODED_FILE), written
    under a temporary name and renamed: a start never sees half of it."""
    from app.datasets.files import DECODED_FILE, FOLDERS, decode, save_whole

    final = data_dir / FOLDERS[name] / DECODED_FILE
    save_whole(decode(name, data_dir), final)
    return final


def prepare_run_dir(run_dir: Path, owner: str | None) -> None:
    """The run directory, owned by the user the trainer runs as (who then creates what is inside)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if owner:
        uid, _, gid = owner.partition(":")
        os.chown(run_dir, int(uid), int(gid or uid))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", type=Path, default=Path("data"))
    p.add_argument("--dataset", action="append", default=[],
                   choices=("cifar10", "cifar100", "digits", "synthetic"), help="repeat for several")
    p.add_argument("--synthetic-train", type=int, default=5000, help="training images to generate")
    p.add_argument("--synthetic-test", type=int, default=1000, help="test images to generate")
    p.add_argument("--synthetic-classes", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run-dir", type=Path, help="create this run directory")
    p.add_argument("--owner", help="UID:GID to own the run directory (containers run as uid 1000)")
    p.add_argument("--optional", action="store_true",
                   help="a dataset that cannot be prepared (offline) is a warning and exit 0, not an error")
    args = p.parse_args(argv)
    for name in args.dataset:
        try:
            if name in ("cifar10", "cifar100"):
                download_cifar(name, args.data_dir)
            elif name == "synthetic":
                write_synthetic(args.data_dir, args.synthetic_train, args.synthetic_test,
                                args.synthetic_classes, args.seed)
            else:
                write_digits(args.data_dir)
            if name != "digits":    # digits.pt is already decoded
                write_decoded(name, args.data_dir)
        except Exception as exc:   # network, disk: say which dataset failed, in one line
            why = f"could not prepare {name} under {args.data_dir}: {type(exc).__name__}: {exc}"
            if args.optional:
                print(f"warning: {why}; continuing without it", file=sys.stderr)
                continue
            print(f"error: {why}", file=sys.stderr)
            return 1
        print(f"prepared {name} under {args.data_dir}")
    if args.run_dir:
        prepare_run_dir(args.run_dir, args.owner)
        print(f"prepared run directory {args.run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
