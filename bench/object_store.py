"""What uploading snapshots to an object store costs the training loop: the trainer with --snapshot-url
against the same trainer without it.

    python -m bench.object_store                       # CPU: tiny CNN, a snapshot every 10 steps
    python -m bench.object_store --model resnet18 --batch-size 32 --save-every 10 --repeats 3

Runs alternate (without, with, without, with, ...) in this one invocation on the same synthetic data
under torchrun, against a SeaweedFS server started here on loopback (app/cluster/object_server.py);
each run's pace is images over the seconds of its timed steps (bench/overhead.py's trainer), and the
ratio is the median of the pairs' ratios. Snapshots come far more often than any default so that the
uploads overlap training: the figure says what they cost when they do. Results go to
bench/object_store.json with the machine and configuration.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import uuid
from pathlib import Path

import torch

from app.cluster.object_server import LocalServer
from bench.overhead import ROOT, machine, median_interval, trainer
from scripts.prepare import write_decoded, write_synthetic


def main(argv: list[str] | None = None) -> int:
    gpus = torch.cuda.device_count()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="resnet18" if gpus else "tiny")
    p.add_argument("--nproc", type=int, default=gpus or 2, help="processes: one per GPU, 2 on CPU")
    p.add_argument("--batch-size", type=int, default=512 if gpus else 64, help="images per process")
    p.add_argument("--train-images", type=int, default=50000 if gpus else 20000)
    p.add_argument("--steps", type=int, default=100, help="timed steps per run")
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--save-every", default="10", help="steps between snapshots (each one uploaded)")
    p.add_argument("--repeats", type=int, default=4, help="alternating without/with pairs")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "object_store.json")
    args = p.parse_args(argv)
    args.amp, args.compile, args.bucket_mb = bool(gpus), False, 25.0     # bench/overhead.py's trainer reads them
    with tempfile.TemporaryDirectory() as data_dir, tempfile.TemporaryDirectory() as objects:
        write_synthetic(Path(data_dir), n_train=args.train_images, n_test=1000)
        write_decoded("synthetic", Path(data_dir))
        server = LocalServer(Path(objects))
        try:
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **server.env()}
            without, with_store = [], []
            for i in range(args.repeats):
                without.append(trainer(args, Path(data_dir), env)["images_per_s"])
                url = server.url(f"bench-{i}-{uuid.uuid4().hex[:6]}")
                with_store.append(trainer(args, Path(data_dir), env, ["--snapshot-url", url])["images_per_s"])
        finally:
            server.stop()
    ratios = [w / wo for w, wo in zip(with_store, without)]
    low, high = median_interval(ratios)
    result = {"ratio": statistics.median(ratios), "ratio_interval_90": [low, high],
              "images_per_s": {"without": without, "with_store": with_store},
              "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "machine": machine()}
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"with the object store: {statistics.median(with_store):.0f} img/s, without: "
          f"{statistics.median(without):.0f} img/s; ratio {result['ratio']:.3f} (90% interval {low:.3f}-{high:.3f}, "
          f"{args.repeats} pairs)")
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
