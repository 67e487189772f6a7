"""One validated Config, built once from command-line flags and environment variables.

Every flag `--foo-bar` can also be set as the environment variable `TRAIN_FOO_BAR`
(how containers pass settings); a flag on the command line wins over the environment.
Settings in DATASET_DEFAULTS that neither gives stay None until resolve() fills them in
with the defaults of the dataset actually loaded.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from app.core.errors import UserError
from app.core.policy import DEFAULT as DEFAULT_POLICY, FaultPolicy, check_port

DATASETS = ("auto", "cifar10", "cifar100", "digits", "synthetic")
MODELS = ("tiny", "resnet18", "resnet34", "resnet50", "resnet101", "resnet152")
OPTIMIZERS = ("sgd", "adamw")
# How the job survives a fault (docs/fault-tolerance.md): elastic restarts every worker from the
# last step (torchrun, app/launch.py); torchft and inplace keep the survivors training (app/ft/):
# torchft on its Manager's quorum at every step, inplace by re-forming their c10d group when a
# member comes or goes.
FT_MODES = ("elastic", "torchft", "inplace")
SURVIVOR_MODES = ("torchft", "inplace")     # their survivors keep their processes through a fault
ENV_PREFIX = "TRAIN_"
SNAPSHOT_FOLDER = "snapshots"    # under the run directory unless --snapshot-dir says otherwise
# Who touches the snapshot directories since every node keeps its own (app/training/snapshot.py does it).
SNAPSHOT_RULE = ("local rank 0 of each node reads its own directory; one rank per distinct directory writes; "
                 "the newest snapshot anywhere wins and is broadcast")

# Defaults that depend on the dataset, for the settings left unset (None). CIFAR-shaped data
# gets a CIFAR ResNet recipe. The 8x8 digits (1437 training images) get the tiny CNN at 32
# images per process: a ResNet-18 there, at 128 per process, takes 5 steps an epoch on two
# processes, and the running statistics of its 20 batch-norm layers trail the fast-moving
# weights so far that it scores at chance in eval mode for epochs (docs/training.md, "The default job").
_CIFAR_RECIPE = {"model": "resnet18", "batch_size": 128}
DATASET_DEFAULTS: dict[str, dict[str, Any]] = {
    "cifar10": _CIFAR_RECIPE,
    "cifar100": _CIFAR_RECIPE,
    "synthetic": _CIFAR_RECIPE,
    "digits": {"model": "tiny", "batch_size": 32},
}

# When snapshots are taken (besides the end of the run and a fault), by the device the job computes
# on, for the settings left unset. On a GPU a CIFAR epoch takes about a second and 100 steps two
# (docs/gpu.md): cadences in epochs or steps would snapshot every second or two, so there the clock
# alone decides, and what a job risks when every node dies at once is its interval: a minute. On
# CPU an epoch of the default digits job takes seconds, a snapshot each epoch and every 100 steps
# costs the loop nothing measurable now that a process of its own writes it (docs/benchmark.md, the
# overhead bench), and the clock is only the backstop of a long epoch.
SNAPSHOT_DEFAULTS: dict[str, dict[str, float]] = {
    "cuda": {"save_every_seconds": 60.0, "save_every_steps": 0, "save_every_epochs": 0},
    "cpu": {"save_every_seconds": 300.0, "save_every_steps": 100, "save_every_epochs": 1},
}


@dataclass(frozen=True)
class Config:
    # data
    dataset: str = "auto"
    data_dir: Path = Path("data")
    augment: bool = True
    # model
    model: str | None = None         # None: the dataset's default (DATASET_DEFAULTS)
    sync_bn: bool = False
    # optimisation
    epochs: int = 15
    batch_size: int | None = None    # images per process per micro-batch; None: the dataset's default
    grad_accum: int = 1              # micro-batches per optimizer step
    optimizer: str = "sgd"
    lr: float = 0.1                  # peak learning rate, reached after warmup
    momentum: float = 0.9
    nesterov: bool | None = None     # None: on for sgd; not allowed with adamw
    weight_decay: float = 5e-4
    warmup_epochs: float = 1.0       # linear warmup length, in epochs
    label_smoothing: float = 0.1
    max_steps: int = 0               # stop after this many optimizer steps in total (0: no limit)
    # numerics
    seed: int = 0
    deterministic: bool = False
    amp: bool | None = None          # None (auto): bf16 autocast on GPUs that support it, off on CPU
    compile: bool = False            # torch.compile the model (its warm-up is left out of images/s)
    # run directory and snapshots
    run_dir: Path = Path("runs/latest")
    snapshot_dir: Path | None = None     # None: <run_dir>/snapshots (resolved on construction)
    resume: bool | None = None       # None: resume when a snapshot exists
    # When snapshots are taken; 0: off; None: the device's default (SNAPSHOT_DEFAULTS)
    save_every_seconds: float | None = None  # the most training lost when every node dies at once
    save_every_steps: int | None = None
    save_every_epochs: int | None = None
    keep: int = 3                    # complete snapshots kept on disk (and in the object store)
    snapshot_url: str | None = None  # s3://BUCKET/PREFIX: every snapshot also goes up there (app/training/object_store.py)
    upload_every_seconds: float = 10.0   # the least time between two uploads' starts (the newest waiting one goes)
    # logging and evaluation
    log_every_steps: int = 10
    eval_every_epochs: int = 1
    progress: str = "auto"           # auto: a bar on a terminal, plain lines otherwise
    # distributed: the fault policy's two trainer-side timings (app/core/policy.py owns them)
    collective_timeout: float = DEFAULT_POLICY.collective_timeout_s
    heartbeat_timeout: float = DEFAULT_POLICY.heartbeat_timeout_s
    # DDP's gradient bucket size in MiB: each bucket is one all-reduce, overlapped with the backward
    # of the layers before it (docs/gpu.md). torch's default; at 25 a ResNet-18 is 2 fp32 buckets.
    bucket_mb: float = 25.0
    threads: int = 0                 # intra-op threads per process on CPU; 0: its share of the host (app/cluster/cores.py)
    ft: str = "elastic"
    lighthouse: str | None = None    # torchft mode's Lighthouse; None: this host's, at LIGHTHOUSE_PORT
    group_store: str | None = None   # inplace mode's store, HOST:PORT; None: this host's, at RDZV_PORT
    full_size: int = 0               # inplace: nodes at full size, more wait as spares; 0: every node trains

    def __post_init__(self) -> None:
        if self.snapshot_dir is None:
            object.__setattr__(self, "snapshot_dir", self.run_dir / SNAPSHOT_FOLDER)

    def fault_policy(self) -> FaultPolicy:
        """The fault timings this run works with: the policy's, with this config's two flags (the
        policy checks them). Built once, from the environment the config was parsed from (os.environ
        for one made otherwise), and the same object after: every part of the process that asks is
        handed the same timings (the config is what is passed down)."""
        if "_policy" not in self.__dict__:
            self._build_policy(os.environ)
        return self.__dict__["_policy"]

    def _build_policy(self, environ: Mapping[str, str]) -> None:
        policy = FaultPolicy.from_env(environ, heartbeat_timeout_s=self.heartbeat_timeout,
                                      collective_timeout_s=self.collective_timeout)
        object.__setattr__(self, "_policy", policy)     # frozen: a cache, not a field

    def lighthouse_url(self) -> str:
        return self.lighthouse or f"http://127.0.0.1:{self.fault_policy().lighthouse_port}"

    def group_store_endpoint(self) -> str:
        return self.group_store or f"127.0.0.1:{self.fault_policy().store_port}"

    @staticmethod
    def job_id() -> str:
        """The job's name in a shared store: the rendezvous id every node of the job is given."""
        return os.environ.get("RDZV_ID", "ftt")

    def to_dict(self) -> dict[str, Any]:
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(self).items()}


def resolve(cfg: Config, dataset: str, device: str = "cpu") -> Config:
    """cfg with every setting left unset filled in from the defaults of `dataset`, the dataset
    actually loaded (`auto` is decided only then), and of the `device` type the job computes on;
    values given by flag or environment stay."""
    defaults = {**DATASET_DEFAULTS[dataset], **SNAPSHOT_DEFAULTS["cuda" if device == "cuda" else "cpu"]}
    unset = {k: v for k, v in defaults.items() if getattr(cfg, k) is None}
    resolved = dataclasses.replace(cfg, **unset)
    if "_policy" in cfg.__dict__:   # the same timings: none of them depends on the dataset
        object.__setattr__(resolved, "_policy", cfg.__dict__["_policy"])
    return resolved


def _per_dataset(field: str) -> str:
    """`resnet18 for cifar10, cifar100, synthetic; tiny for digits`: the help text's default."""
    by_value: dict[Any, list[str]] = {}
    for name, defaults in DATASET_DEFAULTS.items():
        by_value.setdefault(defaults[field], []).append(name)
    return "; ".join(f"{value} for {', '.join(names)}" for value, names in by_value.items())


def _per_device(field: str) -> str:
    """`0 on GPUs, 100 on CPU`: the help text's default."""
    return f"{SNAPSHOT_DEFAULTS['cuda'][field]:g} on GPUs, {SNAPSHOT_DEFAULTS['cpu'][field]:g} on CPU"


# ---------------------------------------------------------------- parsing

def _policy_meaning(name: str) -> str:
    return next(f.metadata["meaning"] for f in dataclasses.fields(FaultPolicy) if f.name == name)


def boolean(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {text!r}")


def boolean_or_auto(text: str) -> bool | None:
    """true/false, or auto (None): the device decides."""
    return None if text.strip().lower() == "auto" else boolean(text)


def _optional_path(text: str) -> Path | None:
    return Path(text) if text else None


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each default, except None: those options say in their help what unset means."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default is None else super()._get_help_string(action)


class _OneLineParser(argparse.ArgumentParser):
    """argparse, but errors come out as the project's single `error:` line, and the parser keeps the
    list of its settings (argparse's own list is private), which the TRAIN_* variables come from."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.settings: list[argparse.Action] = []

    def error(self, message: str):  # type: ignore[override]
        raise UserError(message)


def _parser() -> _OneLineParser:
    d = Config()
    p = _OneLineParser(
        prog="python -m app.train",
        description="Train a ResNet on CIFAR with DDP; resumes from the newest valid snapshot. "
        f"Every --foo-bar flag may also be given as the environment variable {ENV_PREFIX}FOO_BAR.",
        formatter_class=_HelpFormatter,
    )

    def add(group: Any, *flags: str, **kwargs: Any) -> None:
        p.settings.append(group.add_argument(*flags, **kwargs))
    data = p.add_argument_group("data")
    add(data, "--dataset", choices=DATASETS, default=d.dataset,
                      help="auto: cifar10 when prepared under --data-dir, else sklearn digits")
    add(data, "--data-dir", type=Path, default=d.data_dir, help="prepared dataset root (see scripts/prepare.py)")
    add(data, "--augment", type=boolean, default=d.augment, help="random crop and flip on training images")
    model = p.add_argument_group("model")
    add(model, "--model", choices=MODELS, default=d.model,
                       help=f"default per dataset: {_per_dataset('model')}")
    add(model, "--sync-bn", type=boolean, default=d.sync_bn, help="batch-norm statistics over all processes")
    opt = p.add_argument_group("optimisation")
    add(opt, "--epochs", type=int, default=d.epochs)
    add(opt, "--batch-size", type=int, default=d.batch_size,
                     help=f"images per process per micro-batch; default per dataset: {_per_dataset('batch_size')}")
    add(opt, "--grad-accum", type=int, default=d.grad_accum, help="micro-batches per optimizer step")
    add(opt, "--optimizer", choices=OPTIMIZERS, default=d.optimizer)
    add(opt, "--lr", type=float, default=d.lr, help="peak learning rate after warmup")
    add(opt, "--momentum", type=float, default=d.momentum, help="SGD momentum")
    add(opt, "--nesterov", type=boolean, default=d.nesterov, help="Nesterov momentum (default: on for sgd)")
    add(opt, "--weight-decay", type=float, default=d.weight_decay)
    add(opt, "--warmup-epochs", type=float, default=d.warmup_epochs, help="linear warmup, then cosine decay")
    add(opt, "--label-smoothing", type=float, default=d.label_smoothing)
    add(opt, "--max-steps", type=int, default=d.max_steps, help="stop after this many optimizer steps (0: off)")
    num = p.add_argument_group("numerics")
    add(num, "--seed", type=int, default=d.seed)
    add(num, "--deterministic", type=boolean, nargs="?", const=True, default=d.deterministic,
                     help="deterministic kernels: bit-exact reruns and resumes")
    add(num, "--amp", type=boolean_or_auto, nargs="?", const=True, default=d.amp,
                     help="mixed precision: bf16 where supported, else fp16 with loss scaling "
                     "(default auto: on for GPUs with bf16, off on CPU)")
    add(num, "--compile", type=boolean, nargs="?", const=True, default=d.compile,
                     help="torch.compile the model; the first steps (compilation) are not counted in images/s")
    snap = p.add_argument_group("run directory and snapshots")
    add(snap, "--run-dir", type=Path, default=d.run_dir, help="metrics.jsonl, config.json, plots")
    add(snap, "--snapshot-dir", "--checkpoint-dir", type=_optional_path, default=None,
                      help=f"snapshots (default: RUN_DIR/{SNAPSHOT_FOLDER}); {SNAPSHOT_RULE}")
    resume = snap.add_mutually_exclusive_group()
    add(resume, "--resume", dest="resume", action="store_const", const=True, default=d.resume,
                        help="require a snapshot and continue from it (default: resume when one exists)")
    add(resume, "--no-resume", dest="resume", action="store_const", const=False,
                        help="start fresh even if snapshots exist (they are kept until rotated out)")
    add(snap, "--save-every-seconds", type=float, default=d.save_every_seconds,
        help=f"the most training lost if every node dies at once; 0: off (default: {_per_device('save_every_seconds')})")
    add(snap, "--save-every-steps", type=int, default=d.save_every_steps,
        help=f"0: off (default: {_per_device('save_every_steps')})")
    add(snap, "--save-every-epochs", type=int, default=d.save_every_epochs,
        help=f"0: off (default: {_per_device('save_every_epochs')})")
    add(snap, "--keep", type=int, default=d.keep, help="complete snapshots to keep, on each disk and in the object store")
    add(snap, "--snapshot-url", default=d.snapshot_url,
        help="s3://BUCKET/PREFIX: every snapshot also goes up to this S3-compatible object store, and a start "
             "resumes from it when it holds a newer one than any disk (the endpoint and credentials: AWS_ENDPOINT_URL, "
             "AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY or AWS_PROFILE; the prefix names the run)")
    add(snap, "--upload-every-seconds", type=float, default=d.upload_every_seconds,
        help="with --snapshot-url: the least time between the starts of two uploads, the newest snapshot going "
             "up each time (the end's goes at once); 0: every snapshot, one after another")
    log = p.add_argument_group("logging and evaluation")
    add(log, "--log-every-steps", type=int, default=d.log_every_steps)
    add(log, "--eval-every-epochs", type=int, default=d.eval_every_epochs)
    add(log, "--progress", choices=("auto", "bar", "lines"), default=d.progress)
    dist = p.add_argument_group("distributed")
    add(dist, "--collective-timeout", type=float, default=d.collective_timeout,
                      help=f"seconds: {_policy_meaning('collective_timeout_s')}")
    add(dist, "--heartbeat-timeout", type=float, default=d.heartbeat_timeout,
                      help=f"seconds: {_policy_meaning('heartbeat_timeout_s')}")
    add(dist, "--bucket-mb", type=float, default=d.bucket_mb,
                      help="DDP gradient bucket size in MiB: one all-reduce per bucket, overlapped with the backward")
    add(dist, "--threads", type=int, default=d.threads,
        help="compute threads per training process on CPU (0: its share of the host's cores, each core split "
             "evenly among the training processes that may run on it; OMP_NUM_THREADS, when set, gives it too)")
    add(dist, "--ft", choices=FT_MODES, default=d.ft,
        help="on a fault, elastic: every process restarts from the last step (torchrun); torchft, inplace: the "
             "surviving nodes keep training and a node that comes back copies the state from a live one "
             "(torchft: a quorum at every step; inplace: the group re-formed only when a node goes or comes)")
    add(dist, "--lighthouse", default=d.lighthouse,
        help="--ft torchft: the Lighthouse's http://HOST:PORT (python -m app.ft.lighthouse; "
             "default: this host's, at LIGHTHOUSE_PORT)")
    add(dist, "--group-store", default=d.group_store,
        help="--ft inplace: HOST:PORT of the TCPStore where the nodes meet (the compose store service, "
             "python -m app.node store; default: this host's, at RDZV_PORT)")
    add(dist, "--full-size", type=int, default=d.full_size,
        help="--ft inplace: the nodes the job trains on at full size; a node that comes while that many train "
             "waits as a spare, using no core, and takes the place of the next one lost (0: every node that comes trains)")
    return p


def _apply_env_defaults(parser: _OneLineParser, environ: dict[str, str]) -> None:
    """Environment variables become parser defaults, so flags still win."""
    for action in parser.settings:
        names = [n for n in env_names(action) if n in environ]
        if not names:
            continue
        name = names[0]
        raw = environ[name]
        try:
            if action.dest == "resume":
                value: Any = None if raw.strip().lower() in ("", "auto") else boolean(raw)
            else:
                value = action.type(raw) if action.type else raw
        except (ValueError, TypeError) as exc:
            raise UserError(f"environment variable {name}={raw!r}: {exc}") from None
        if action.choices is not None and value not in action.choices:
            raise UserError(f"environment variable {name}={raw!r}: choose from {', '.join(map(str, action.choices))}")
        parser.set_defaults(**{action.dest: value})


def env_names(action: argparse.Action) -> list[str]:
    """TRAIN_FOO_BAR for every long option --foo-bar of a setting (aliases included)."""
    if action.dest == "help":
        return []
    return [ENV_PREFIX + o[2:].replace("-", "_").upper() for o in action.option_strings if o.startswith("--")
            and o != "--no-resume"]


def all_env_names() -> list[str]:
    """Every TRAIN_* variable the trainer reads (compose.yaml must pass each one on: tested)."""
    return [n for action in _parser().settings for n in env_names(action)]


def parse(argv: Sequence[str] | None = None, environ: dict[str, str] | None = None) -> Config:
    """The config of these flags and TRAIN_* variables, with its fault policy from the same
    environment (app.launch and make check a job's timings before it starts); checked."""
    environ = dict(os.environ if environ is None else environ)
    parser = _parser()
    _apply_env_defaults(parser, environ)
    cfg = Config(**vars(parser.parse_args(argv)))
    cfg._build_policy(environ)
    validate(cfg)
    return cfg


def help_text() -> str:
    return _parser().format_help()


# ---------------------------------------------------------------- validation

# HOST:PORT, a host name or address (IPv6 in brackets) and a port number (optional where a default exists).
_ENDPOINT = re.compile(r"(\[[0-9a-fA-F:]+\]|[^/\s:\[\]]+)(?::(\d+))?")
_URL = re.compile(r"https?://(.*?)/?")


def endpoint(text: str, setting: str, url: str | None = None, default_port: int | None = None) -> tuple[str, int]:
    """(host, port) of a HOST:PORT setting (the group store, a rendezvous endpoint, the Lighthouse's
    address): the one check of them all, a UserError naming `setting` when it cannot be one.
    `url`: the http://HOST:PORT that `text` came from, which the error then shows; `default_port`:
    the port of a HOST given alone (torchrun's --rdzv-endpoint), else a port is required."""
    match = _ENDPOINT.fullmatch(text)
    shown = url or text
    if match is None or (match[2] is None and default_port is None):
        raise UserError(f"{setting} must look like {'http://' if url else ''}HOST:PORT, got {shown!r}")
    port = default_port if match[2] is None else int(match[2])
    return match[1].strip("[]"), check_port(port, f"{setting} {shown}")


def lighthouse_endpoint(url: str) -> tuple[str, int]:
    """(host, port) of a Lighthouse's http://HOST:PORT."""
    match = _URL.fullmatch(url)
    return endpoint(match[1] if match else "", "--lighthouse", url)


_S3_URL = re.compile(r"s3://(?P<bucket>[a-z0-9][a-z0-9.-]{1,61}[a-z0-9])/(?P<prefix>[^?#]*[^/?#])/?")


@dataclass(frozen=True)
class SnapshotLocation:
    """Where --snapshot-url puts a run's snapshots (app/training/object_store.py)."""
    bucket: str
    prefix: str         # the run's: no two runs share one

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"


def parse_snapshot_url(url: str) -> SnapshotLocation:
    """s3://BUCKET/PREFIX, or one error line naming --snapshot-url (and never echoing credentials)."""
    if "@" in url.partition("://")[2].partition("/")[0]:
        raise UserError("--snapshot-url must not hold credentials: give them as AWS_ACCESS_KEY_ID and "
                        "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)")
    match = _S3_URL.fullmatch(url)
    if match is None:
        raise UserError(f"--snapshot-url must look like s3://BUCKET/PREFIX (a bucket name and a prefix that names "
                        f"this run), got {url!r}")
    return SnapshotLocation(match["bucket"], match["prefix"])


def validate(cfg: Config) -> None:
    """Raise UserError naming the first setting that cannot work."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if isinstance(value, float) and not math.isfinite(value):   # float() takes inf and nan from a flag
            raise UserError(f"--{f.name.replace('_', '-')} must be a finite number, got {value}")
    positive = {"epochs": cfg.epochs, "batch-size": cfg.batch_size, "lr": cfg.lr, "grad-accum": cfg.grad_accum,
                "keep": cfg.keep, "log-every-steps": cfg.log_every_steps,
                "eval-every-epochs": cfg.eval_every_epochs, "bucket-mb": cfg.bucket_mb}
    for name, value in positive.items():
        if value is not None and not value > 0:     # None: the dataset's default, filled in later
            raise UserError(f"--{name} must be positive, got {value}")
    non_negative = {"save-every-steps": cfg.save_every_steps, "save-every-seconds": cfg.save_every_seconds,
                    "save-every-epochs": cfg.save_every_epochs, "upload-every-seconds": cfg.upload_every_seconds,
                    "threads": cfg.threads, "max-steps": cfg.max_steps, "warmup-epochs": cfg.warmup_epochs,
                    "weight-decay": cfg.weight_decay, "momentum": cfg.momentum, "full-size": cfg.full_size}
    for name, value in non_negative.items():
        if value is not None and value < 0:     # None: the device's default, filled in later
            raise UserError(f"--{name} must be zero or more, got {value}")
    if not 0.0 <= cfg.label_smoothing < 1.0:
        raise UserError(f"--label-smoothing must be in [0, 1), got {cfg.label_smoothing}")
    if cfg.optimizer == "adamw" and cfg.nesterov:
        raise UserError("--nesterov applies to --optimizer sgd only, not adamw")
    if cfg.optimizer == "sgd" and cfg.nesterov is not False and cfg.momentum == 0:
        raise UserError("Nesterov SGD needs --momentum > 0 (or pass --nesterov false)")
    if cfg.full_size and cfg.ft != "inplace":
        raise UserError(f"--full-size (spares) works in --ft inplace only, not {cfg.ft} (docs/spares.md)")
    if cfg.lighthouse is not None:
        lighthouse_endpoint(cfg.lighthouse)
    if cfg.group_store is not None:
        endpoint(cfg.group_store, "--group-store")
    if cfg.snapshot_url is not None:
        parse_snapshot_url(cfg.snapshot_url)
    cfg.fault_policy().check()       # the timings, the two flags among them: each in range, in the order recovery needs
