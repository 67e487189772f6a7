"""A training job: its settings, and how it is started, changed and inspected, in one place.

The Makefile's job targets, the docker test tier and the chaos runner all go through this module;
nothing else assembles a compose command line or a job's environment. The same settings start a
job in containers (ComposeJob), as local processes (`run`, `run-ddp`) or under Slurm (`sbatch`):

    python -m scripts.job up NODES=2 LR=0.05 WARMUP_EPOCHS=2    # = make up NODES=2 LR=0.05 ...
    python -m scripts.job up NODES=2 OBJECT_STORE=1             # snapshots also in the compose service `objects`
    python -m scripts.job kill NODE=2                           # = make kill NODE=2
    python -m scripts.job restart|down|ps|logs|build [RUN=...]
    python -m scripts.job run|run-ddp NPROC=2 LR=0.05            # the same job without containers
    python -m scripts.job sbatch NODES=2 EPOCHS=3                # under Slurm (scripts/train.sbatch)
    python -m scripts.job check up NODES=2                       # only what `up` checks first (make: before the build)

Settings come as NAME=value words, one rule for all of them: NODES, NPROC, GPUS, RUN, NODE and
OBJECT_STORE are the job's own (JOB_VARIABLES); a trainer flag is FOO_BAR for --foo-bar and reaches every node as
TRAIN_FOO_BAR, exactly as `TRAIN_FOO_BAR=value docker compose up` would pass it; a fault-policy
timing (app/core/policy.py: FT_HEARTBEAT_TIMEOUT, ...) reaches every node under its own name,
as the shell's FT_HEARTBEAT_TIMEOUT would.
"""
from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import os
import re
import secrets
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from app.cluster.object_server import DEFAULT_PORT as DEFAULT_OBJECTS_PORT
from app.core import config
from app.core.errors import UserError
from app.node import gpu_plan, host_gpus
from app.core.policy import DEFAULT as DEFAULT_POLICY, FaultPolicy

REPO = Path(__file__).resolve().parent.parent
# IMAGE= in the environment names another tag (compose.yaml reads the same variable): two checkouts
# of this repository on one engine then build and test their own images side by side.
IMAGE = os.environ.get("IMAGE") or "ftt-trainer:latest"
# The job's own variables, with what they mean (`make help` shows the same words).
JOB_VARIABLES = {
    "NODES": "node containers on this host (one container = one torchrun node)",
    "NPROC": "training processes per node (default: one per GPU of the node, 1 without GPUs)",
    "GPUS": "host GPUs the job may use, e.g. 0,1,2,3 (default: all); each node gets GPUS/NODES",
    "RUN": "run name: snapshots and metrics.jsonl live in runs/RUN; also the rendezvous id",
    "NODE": "which node `kill` and `restart` act on (1..NODES)",
    "SPARES": "inplace mode: node containers more that wait as warm spares, using no core, and take the place "
              "of the next node lost within a round (service spare; default 0)",
    "OBJECT_STORE": "1: every snapshot also goes to an S3 store on this host (service objects); a job that lost "
                    "all its disks resumes from it (default 0)",
}
OBJECTS = "objects"                 # compose.yaml: the object store's service, its profile and its volume
NODE_SERVICES = ("trainer", "spare")   # compose.yaml's node containers: NODES nodes, and SPARES more
OBJECTS_BUCKET = "snapshots"        # the bucket that service makes; a run's snapshots go to s3://snapshots/RUN
# How long `up` waits for the first train row of its start (engine start-up, rendezvous, data loading).
START_TIMEOUT_S = 300
NODE_LINE = re.compile(r"\[entrypoint\] node (\S+) \(.*?gpus (\S+), net_if")   # docker/entrypoint.sh's first line


class JobError(RuntimeError):
    """A compose command failed, or the job did not get where it was waited for."""


def compose_files() -> str:
    """compose.yaml alone where NVIDIA GPUs are, with the CPU override (no GPU reservation) elsewhere."""
    return "compose.yaml" if host_gpus() else "compose.yaml:compose.cpu.yaml"


def remember_compose_files(env_file: Path = REPO / ".env") -> None:
    """Keep this host's compose file choice in .env, where plain `docker compose` commands in this
    checkout read COMPOSE_FILE: `docker compose run trainer --resume` after `make up` must not ask a
    host without GPUs for the nvidia driver. A COMPOSE_FILE the user chose otherwise stays."""
    ours = {"compose.yaml", "compose.yaml:compose.cpu.yaml"}
    lines = env_file.read_text().splitlines() if env_file.exists() else []
    given = [line for line in lines if line.startswith("COMPOSE_FILE=")]
    if any(line.partition("=")[2] not in ours for line in given):
        return
    kept = [line for line in lines if not line.startswith("COMPOSE_FILE=")]
    env_file.write_text("\n".join([*kept, f"COMPOSE_FILE={compose_files()}"]) + "\n")


def owner() -> str:
    """uid:gid the containers run as: the invoking user, so runs/ stays theirs; never root."""
    return "1000:1000" if os.getuid() == 0 else f"{os.getuid()}:{os.getgid()}"


def _compose_variables() -> set[str]:
    """Every variable compose.yaml and its CPU override read (`${NAME...}` or a passed-through key)."""
    names: set[str] = set()
    for name in ("compose.yaml", "compose.cpu.yaml"):
        text = (REPO / name).read_text()
        names |= set(re.findall(r"\$\{(\w+)", text)) | set(re.findall(r"^\s+([A-Z][A-Z0-9_]+):\s*(?:#.*)?$", text, re.M))
    return names


class ComposeJob:
    """One job: a compose project with its store and NODES trainer nodes, a run directory, settings.

    inherit_env=True (the Makefile) passes the caller's environment on, so TRAIN_* and NODE_ADDR
    set in the shell reach the nodes; inherit_env=False (tests, the chaos runner) drops every
    variable compose reads, so that nothing of the caller's shell can redirect the job.

    object_store=True (`make up OBJECT_STORE=1`) adds the service `objects`, an S3 store on
    objects_port (and the next four ports, and each + 10000), and has every node upload its
    snapshots there, to snapshot_url(), and resume from there when no disk holds a newer one.
    """

    def __init__(self, run: str = "default", nodes: int = 2, *, nproc: int | None = None, gpus: str = "",
                 project: str = "ftt", rdzv_port: int = DEFAULT_POLICY.store_port, settings: dict[str, Any] | None = None,
                 inherit_env: bool = True, extra_env: dict[str, str] | None = None,
                 runs_dir: Path = REPO / "runs", compose_override: str | None = None,
                 object_store: bool = False, objects_port: int = DEFAULT_OBJECTS_PORT, spares: int = 0) -> None:
        self.run, self.nodes, self.nproc, self.gpus, self.spares = run, nodes, nproc, gpus, spares
        self.object_store, self.objects_port = object_store, objects_port
        self.project, self.rdzv_port, self.inherit_env = project, rdzv_port, inherit_env
        self.settings = dict(settings or {})
        self.extra_env = dict(extra_env or {})
        self.runs_dir = runs_dir
        self.run_dir = runs_dir / run
        self._compose_file = compose_files() + (f":{compose_override}" if compose_override else "")
        self._client: Any = None

    # ------------------------------------------------------------ environment

    def secret(self) -> str:
        """The job's secret: JOB_SECRET if given, else the one this run directory keeps (made once)."""
        if os.environ.get("JOB_SECRET") and self.inherit_env:
            return os.environ["JOB_SECRET"]
        path = self.run_dir / ".job-secret"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(16))
        return path.read_text().strip()

    def object_credentials(self) -> tuple[str, str]:
        """The object store's one identity for this run (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY),
        derived from the job secret: one secret per run, made and kept as that one is, never printed;
        every host given the job's JOB_SECRET reaches the store as the same identity; and the store,
        which holds the identity, learns nothing of the job secret (HMAC)."""
        secret = self.secret().encode()
        derive = lambda purpose: hmac.new(secret, f"ftt object store {purpose}".encode(), hashlib.sha256).hexdigest()
        return f"ftt{derive('access key id')[:17]}", derive("secret access key")

    def snapshot_url(self) -> str:
        """Where the nodes upload with the object store on: SNAPSHOT_URL if given, else the run's prefix."""
        return str(self.settings.get("snapshot_url") or f"s3://{OBJECTS_BUCKET}/{self.run}")

    def objects_endpoint(self) -> str:
        """The objects service's S3 endpoint as the nodes reach it: the store's address (compose.yaml)."""
        host = (os.environ.get("RDZV_HOST") if self.inherit_env else None) or "127.0.0.1"
        return f"http://{host}:{self.objects_port}"

    def env(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ)
        if not self.inherit_env:
            drop = _compose_variables()
            env = {k: v for k, v in env.items() if not k.startswith(config.ENV_PREFIX) and k not in drop}
        env.update(COMPOSE_PROJECT_NAME=self.project, COMPOSE_FILE=self._compose_file, RUN=self.run,
                   NODES=str(self.nodes), GPUS=self.gpus, OWNER=owner(), RDZV_PORT=str(self.rdzv_port),
                   RUNS_DIR=str(self.runs_dir), JOB_SECRET=self.secret(), IMAGE=IMAGE)
        if self.nproc is not None:
            env["NPROC"] = str(self.nproc)
        env.pop("SPARES", None)
        if self.spares:     # the trainers' --full-size too, as docker/entrypoint.sh would set it: `validate` checks it
            env.update(SPARES=str(self.spares), TRAIN_FULL_SIZE=str(self.nodes), TRAIN_FT=self.ft())
        # The object store: its profile turns the service on (and the trainer's wait for it), and the
        # nodes get the AWS tools' variables for it. Off, no profile of the shell's starts it either.
        env.pop("COMPOSE_PROFILES", None)
        if self.object_store:
            key, secret = self.object_credentials()
            env.update(COMPOSE_PROFILES=OBJECTS, OBJECTS_PORT=str(self.objects_port),
                       AWS_ENDPOINT_URL=self.objects_endpoint(), AWS_ACCESS_KEY_ID=key, AWS_SECRET_ACCESS_KEY=secret)
            env.setdefault(config.ENV_PREFIX + "SNAPSHOT_URL", self.snapshot_url())   # the shell's, if it has one
        env.update({config.ENV_PREFIX + k.upper(): str(v) for k, v in self.settings.items()})
        env.update(self.extra_env)
        env.update(extra)
        return env

    def validate(self) -> config.Config:
        """Everything that can be checked before a container starts: one UserError line each."""
        gpu_plan(self.gpus, host_gpus(), self.nodes)
        cfg = self.validate_settings()
        if self.object_store and cfg.snapshot_url and \
                config.parse_snapshot_url(cfg.snapshot_url).bucket != OBJECTS_BUCKET:
            raise UserError(f"OBJECT_STORE=1 keeps snapshots in the bucket {OBJECTS_BUCKET!r}: give SNAPSHOT_URL as "
                            f"s3://{OBJECTS_BUCKET}/PREFIX, or leave it out (s3://{OBJECTS_BUCKET}/{self.run})")
        return cfg

    def validate_settings(self) -> config.Config:
        """The trainer's own check of its settings and of the timings the nodes will be given (the
        nodes repeat it before joining): parsed from the environment they will have."""
        return config.parse([], environ=self.env())

    # ------------------------------------------------------------ compose

    def compose(self, *words: str, capture: bool = True, check: bool = True, timeout: float = 900,
                env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        cmd = ["docker", "compose", *words]
        try:
            done = subprocess.run(cmd, cwd=REPO, env=env or self.env(), capture_output=capture, text=True,
                                  timeout=timeout, check=False)
        except subprocess.TimeoutExpired as exc:
            raise JobError(f"`{' '.join(cmd)}` did not finish within {timeout:.0f} s\n{_text(exc.stderr)[-3000:]}")
        if check and done.returncode != 0:
            raise JobError(f"`{' '.join(cmd)}` exited with {done.returncode}\n--- stdout\n{_text(done.stdout)[-3000:]}"
                           f"\n--- stderr\n{_text(done.stderr)[-3000:]}")
        return done

    def build(self) -> None:
        self.compose("build", "trainer", capture=False)

    def up(self, *services: str, no_deps: bool = False) -> None:
        """The store (and the object store when on), the run directory and NODES trainer nodes (what
        `make up` does); on a host that joins a job whose store runs elsewhere: up("trainer", no_deps=True)."""
        from scripts.prepare import prepare_run_dir

        self.validate()
        prepare_run_dir(self.run_dir, owner() if os.getuid() == 0 else None)
        default = ("store", *([OBJECTS] if self.object_store else []), "trainer", *(["spare"] if self.spares else []))
        spares = ["--scale", f"spare={self.spares}"] if self.spares else []
        self.compose("up", "--detach", *(["--no-deps"] if no_deps else []), "--scale", f"trainer={self.nodes}",
                     *spares, *(services or default))

    def start(self, timeout: float = START_TIMEOUT_S) -> dict[str, Any]:
        """`make up`: the job started and seen training; returns the first train row of this start.

        A run with nothing left to train is refused (its nodes would only exit). An ended job's
        containers are removed first: its store has closed the run's rendezvous for good, and the
        nodes of a continuation would be refused by it.
        """
        self.startable()
        if self.trainers() and not self.trainers(running=True):
            self.down()
        since = time.time()
        self.up()
        return self.wait_started(since, timeout)

    def startable(self) -> None:
        """What `start` refuses, before anything starts: settings that cannot work, nothing left to train."""
        further = self.finished(self.validate())
        if further:
            raise UserError(further)

    def finished(self, cfg: config.Config) -> str | None:
        """What to do instead when this run has already trained everything cfg asks for, else None."""
        run = "" if self.run == "default" else f"RUN={self.run} "
        new_run = "or start a new run with `make up RUN=name`"
        epochs = max((r["epoch"] for r in self.rows("eval")), default=0)
        if epochs >= cfg.epochs:
            return (f"run '{self.run}' has finished its {epochs:g} epochs: train it further with `make up {run}EPOCHS=N` "
                    f"(N > {epochs:g}; it resumes from its last snapshot), {new_run}")
        steps = max((r["step"] for r in self.rows("train")), default=0)
        if cfg.max_steps and steps >= cfg.max_steps:
            return (f"run '{self.run}' has reached MAX_STEPS={cfg.max_steps}: train it further with "
                    f"`make up {run}MAX_STEPS=N` (N > {steps}), {new_run}")
        return None

    def scale(self, nodes: int) -> None:
        """Add nodes, or remove the newest ones cleanly (SIGTERM, then gone)."""
        self.nodes = nodes
        self.compose("up", "--detach", "--no-recreate", "--scale", f"trainer={nodes}", "trainer")

    def down(self, volumes: bool = False) -> None:
        """Stop and remove every container of the project (one-off `run` containers too), the object
        store's whether or not this job uses it; volumes=True also removes the store's data."""
        self.compose("--profile", OBJECTS, "down", "--remove-orphans", "--timeout", "5",
                     *(["--volumes"] if volumes else []), check=False, timeout=180)
        for c in self.containers():
            try:
                c.remove(force=True)
            except Exception:   # removed by compose in the meantime
                pass

    # ------------------------------------------------------------ containers

    @property
    def client(self) -> Any:
        if self._client is None:
            import docker   # the SDK only where containers are inspected

            self._client = docker.from_env(timeout=120)
        return self._client

    def containers(self, service: str | None = None) -> list[Any]:
        labels = [f"com.docker.compose.project={self.project}"]
        if service:
            labels.append(f"com.docker.compose.service={service}")
        return self.client.containers.list(all=True, filters={"label": labels})

    def trainers(self, running: bool = False) -> list[Any]:
        """The node containers of `compose up` (not one-off `compose run` ones), spares too, by name."""
        found = [c for c in self.containers() if c.labels.get("com.docker.compose.service") in NODE_SERVICES
                 and c.labels.get("com.docker.compose.oneoff") != "True"]
        return sorted((c for c in found if not running or c.status == "running"), key=lambda c: c.name)

    def node(self, number: int) -> Any:
        """Node container NUMBER (1..), as `make kill NODE=2` names it."""
        name = f"{self.project}-trainer-{number}"
        found = [c for c in self.trainers() if c.name == name]
        if not found:
            raise UserError(f"no node container {name}: the nodes are {', '.join(c.name for c in self.trainers()) or 'none'}")
        return found[0]

    def store(self) -> Any:
        return self.containers("store")[0]

    def objects(self) -> Any:
        """The object store's container (object_store=True)."""
        return self.containers(OBJECTS)[0]

    def objects_volume(self) -> str:
        """The docker volume that holds the object store's data: compose names it PROJECT_objects."""
        return f"{self.project}_{OBJECTS}"

    @staticmethod
    def node_line(container: Any) -> tuple[str, str] | None:
        """(address, GPUs) from the newest first line of a node start (docker/entrypoint.sh): in its log's
        last 500 lines, else in the whole log (a node that has trained long since it started)."""
        for tail in (500, "all"):
            found = NODE_LINE.findall(container.logs(tail=tail).decode(errors="replace"))
            if found:
                return found[-1]
        return None

    def node_addr(self, container: Any) -> str | None:
        line = self.node_line(container)
        return line[0] if line else None

    def rank0_container(self) -> Any | None:
        """The running node whose address is MASTER_ADDR of the newest start row (it holds rank 0)."""
        starts = self.rows("start")
        addr = starts[-1].get("master_addr") if starts else None
        return next((c for c in self.trainers(running=True) if addr and self.node_addr(c) == addr), None)

    def ft(self) -> str:
        """The nodes' fault-tolerance mode: FT as given (the shell's TRAIN_FT with inherit_env), else the
        compose files' default (compose.yaml's: inplace), else the trainer's."""
        given = self.settings.get("ft") or self.extra_env.get("TRAIN_FT") or \
            (os.environ.get("TRAIN_FT") if self.inherit_env else None)
        if given:
            return str(given)
        for name in reversed(self._compose_file.split(":")):     # the last file that sets it wins
            found = re.search(r"^\s+TRAIN_FT: \$\{TRAIN_FT:-(\w+)\}", (REPO / name).read_text(), re.M)
            if found:
                return found.group(1)
        return config.Config().ft

    def writer_container(self) -> Any | None:
        """The running node that writes the run's snapshots: rank 0's in elastic mode; in torchft and
        inplace modes the holder of the snapshot directory's lease (app/ft/writer.py), named node-ADDRESS by
        docker/entrypoint.sh."""
        from app.core.config import SURVIVOR_MODES

        if self.ft() not in SURVIVOR_MODES:
            return self.rank0_container()
        from app.ft.writer import LEASE_FILE, read_lease

        holder, _ = read_lease(self.run_dir / "snapshots" / LEASE_FILE)
        return next((c for c in self.trainers(running=True) if holder == f"node-{self.node_addr(c)}"), None)

    def logs(self, tail: int = 60) -> str:
        done = self.compose("logs", "--no-color", "--tail", str(tail), check=False, timeout=60)
        return (done.stdout + done.stderr)[-6000:]

    # ------------------------------------------------------------ metrics

    def rows(self, event: str | None = None) -> list[dict[str, Any]]:
        from app.reporting import metrics   # tqdm: only where metrics are read, so `help` runs on a bare python3

        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return []
        return [r for r in metrics.read(path) if event is None or r["event"] == event]

    def wait_row(self, what: str, predicate: Callable[[dict[str, Any]], bool], timeout: float,
                 event: str = "train") -> dict[str, Any]:
        """The first metrics row of this event that satisfies predicate; JobError with the logs on timeout."""
        deadline = time.monotonic() + timeout
        while True:
            found = next((r for r in self.rows(event) if predicate(r)), None)
            if found is not None:
                return found
            if time.monotonic() > deadline:
                raise JobError(f"timed out after {timeout:.0f} s waiting for {what}\n--- last rows\n"
                               + "\n".join(json.dumps(r) for r in self.rows()[-8:])
                               + f"\n--- docker compose logs\n{self.logs()}")
            time.sleep(0.2)

    def wait_started(self, since: float, timeout: float) -> dict[str, Any]:
        """The first train row written at or after `since` (wall clock): the world formed and trained (or
        the start row, when the nodes finished the job before a train row was due). JobError, naming how
        each node ended, when every node exits otherwise first or nothing trains in time."""
        deadline = time.monotonic() + timeout
        while True:
            row = next((r for r in self.rows("train") if r["time"] >= since), None)
            if row is not None:
                return row
            nodes = self.trainers()
            if _all_exited(nodes):
                # A job with little left to do may finish before its first log row: that is a start seen.
                started = [r for r in self.rows("start") if r["time"] >= since]
                if started and all(c.attrs["State"]["ExitCode"] == 0 for c in nodes):
                    return started[0]
                codes = ", ".join(f"{c.name} {c.attrs['State']['ExitCode']}" for c in nodes)
                raise JobError(f"the nodes exited before training (exit status: {codes})\n"
                               f"--- docker compose logs\n{self.logs()}")
            if time.monotonic() > deadline:
                raise JobError(f"no training within {timeout:.0f} s of the start: see `make logs`; "
                               f"the nodes: {[(c.name, c.status) for c in nodes]}")
            time.sleep(0.5)

    def wait_exited(self, timeout: float) -> list[Any]:
        """Wait until every node container has exited; returns them."""
        deadline = time.monotonic() + timeout
        while True:
            nodes = self.trainers()
            if _all_exited(nodes):
                return nodes
            if time.monotonic() > deadline:
                raise JobError(f"the nodes did not exit within {timeout:.0f} s: {[(c.name, c.status) for c in nodes]}"
                               f"\n--- docker compose logs\n{self.logs()}")
            time.sleep(1.0)


def _all_exited(nodes: list[Any]) -> bool:
    return bool(nodes) and all(c.status == "exited" for c in nodes)


def _text(value: Any) -> str:
    if value is None:
        return ""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


# ---------------------------------------------------------------- command line (the Makefile's)

def trainer_flag_names() -> set[str]:
    """FOO_BAR for every trainer flag --foo-bar."""
    return {name[len(config.ENV_PREFIX):] for name in config.all_env_names()}


def policy_setting_names() -> set[str]:
    """The fault policy's timings that are no trainer flag (FT_HEARTBEAT_TIMEOUT, ...): a node reads
    them under their own names. RDZV_PORT is the job's placement (compose_placement), not a word."""
    names = {f.metadata["env"] for f in dataclasses.fields(FaultPolicy)}
    return {n for n in names if not n.startswith(config.ENV_PREFIX)} - {"RDZV_PORT"}


def job_from_words(words: list[str]) -> tuple[ComposeJob, int | None]:
    """A job from NAME=value words (the Makefile's command-line variables), and NODE if given."""
    given: dict[str, str] = {}
    for word in words:
        name, sep, value = word.partition("=")
        if not sep or not name:
            raise UserError(f"settings are NAME=value words, got {word!r}")
        given[name] = value
    flags, timings = trainer_flag_names(), policy_setting_names()
    unknown = sorted(n for n in given if n not in JOB_VARIABLES and n not in flags and n not in timings)
    if unknown:
        raise UserError(f"unknown setting {', '.join(unknown)}: use {', '.join(JOB_VARIABLES)}, a trainer "
                        f"flag as FOO_BAR=value (python -m app.train --help lists them) or a fault-policy "
                        f"timing (python -m app.core.policy --help lists them)")
    for name in ("NODES", "NPROC", "NODE"):
        if name in given and not (given[name].isdigit() and int(given[name]) > 0):
            raise UserError(f"{name} must be a positive integer, got {given[name]!r}")
    if not given.get("SPARES", "0").isdigit():
        raise UserError(f"SPARES must be a number of nodes (0 or more), got {given['SPARES']!r}")
    if given.get("OBJECT_STORE", "0") not in ("0", "1"):
        raise UserError(f"OBJECT_STORE must be 0 or 1, got {given['OBJECT_STORE']!r}")
    gpu_plan(given.get("GPUS", ""), [], 1)   # its form only: which GPUS this host has, `up` checks
    job = ComposeJob(given.get("RUN", "default"), int(given.get("NODES", 2)),
                     nproc=int(given["NPROC"]) if given.get("NPROC") else None, gpus=given.get("GPUS", ""),
                     settings={n.lower(): v for n, v in given.items() if n in flags},
                     extra_env={n: v for n, v in given.items() if n in timings},
                     object_store=given.get("OBJECT_STORE", "0") == "1", spares=int(given.get("SPARES", 0)),
                     **compose_placement())
    return job, int(given["NODE"]) if given.get("NODE") else None


def compose_placement() -> dict[str, Any]:
    """Where the job lives, from compose's own variables when the shell sets them (as `docker compose up`
    takes them): another COMPOSE_PROJECT_NAME, RDZV_PORT, OBJECTS_PORT or RUNS_DIR runs a second job
    beside the first."""
    placement: dict[str, Any] = {}
    if os.environ.get("COMPOSE_PROJECT_NAME"):
        placement["project"] = os.environ["COMPOSE_PROJECT_NAME"]
    if env_port("RDZV_PORT") is not None:
        placement["rdzv_port"] = env_port("RDZV_PORT")
    if os.environ.get("OBJECTS_PORT"):
        # The store takes this port, the next four, and each + 10000 (app/cluster/object_server.py).
        port = os.environ["OBJECTS_PORT"]
        if not (port.isdigit() and 0 < int(port) < 65536 - 10005):
            raise UserError(f"OBJECTS_PORT must be a port number below {65536 - 10005}, got {port!r}")
        placement["objects_port"] = int(port)
    if os.environ.get("RUNS_DIR"):
        placement["runs_dir"] = Path(os.environ["RUNS_DIR"]).resolve()
    return placement


def env_port(name: str) -> int | None:
    """The port an environment variable names (None: unset or empty); UserError if it is no number."""
    value = os.environ.get(name)
    if value and not value.isdigit():
        raise UserError(f"{name} must be a port number, got {value!r}")
    return int(value) if value else None


def run_local(job: ComposeJob, processes: int | None) -> int:
    """The job's settings as a local run: one plain process (processes None) or torchrun (app.launch) on this host."""
    launcher = [sys.executable] if processes is None else \
        [sys.executable, "-m", "app.launch", "--standalone", f"--nproc-per-node={processes}"]
    env = {**os.environ, **{k: v for k, v in job.env().items() if k.startswith(config.ENV_PREFIX)}}
    return subprocess.run([*launcher, "-m", "app.train", "--run-dir", str(job.run_dir)], cwd=REPO, env=env).returncode


def submit_to_slurm(job: ComposeJob) -> int:
    """sbatch scripts/train.sbatch on NODES nodes, NPROC processes each (default: their GPUs)."""
    env = {**os.environ, **{k: v for k, v in job.env().items() if k.startswith(config.ENV_PREFIX)}}
    if job.nproc is not None:
        env["NPROC"] = str(job.nproc)
    return subprocess.run(["sbatch", f"--nodes={job.nodes}", "scripts/train.sbatch"], cwd=REPO, env=env).returncode


def print_help() -> None:
    print("Settings, as NAME=value (make up NODES=2 LR=0.05):")
    for name, meaning in JOB_VARIABLES.items():
        print(f"  {name:8} {meaning}")
    print("  FOO_BAR  any trainer flag --foo-bar (python -m app.train --help); reaches it as TRAIN_FOO_BAR")
    print("  FT_...   any fault-policy timing (python -m app.core.policy --help); reaches the nodes as itself")


COMMANDS = ("up", "kill", "restart", "build", "down", "ps", "logs", "run", "run-ddp", "sbatch")


def check(command: str, job: ComposeJob) -> None:
    """What COMMAND checks before it starts anything; `make` runs it before the engine and the image."""
    if command not in COMMANDS:
        raise UserError(f"unknown command {command!r}: {', '.join(COMMANDS)} (or check COMMAND)")
    if command == "up":
        job.startable()
    elif command in ("run", "run-ddp", "sbatch"):
        job.validate_settings()


def main(argv: list[str]) -> int:
    if any(word in ("-h", "--help") for word in argv):
        print(f"usage: python -m scripts.job COMMAND [NAME=value ...]\n\n{__doc__.strip()}\n")
        print_help()                # the commands, then the settings they take
        return 0
    if not argv or argv[0] == "help":
        print_help()
        return 0 if argv else 2
    command, words = argv[0], argv[1:]
    check_only = command == "check" and bool(words)
    if check_only:
        command, words = words[0], words[1:]
    try:
        job, node = job_from_words(words)
        check(command, job)
        if check_only:
            return 0
        if command in ("run", "run-ddp"):
            return run_local(job, None if command == "run" else job.nproc or 1)
        if command == "sbatch":
            return submit_to_slurm(job)
        if command == "up":
            remember_compose_files()
            row = job.start()
            run_dir = job.run_dir.relative_to(REPO) if job.run_dir.is_relative_to(REPO) else job.run_dir
            print(f"job started: {job.nodes} nodes, training at world size {row['world_size']}, "
                  f"run directory {run_dir}/\n"
                  f"  follow it: make logs    metrics: {run_dir}/metrics.jsonl    stop it: make down")
            if job.object_store:
                print(f"  snapshots also go to {job.snapshot_url()} (service {OBJECTS} at {job.objects_endpoint()}, "
                      f"its data in the volume {job.objects_volume()})")
        elif command in ("kill", "restart"):
            if node is None:
                raise UserError(f"say which node: make {command} NODE=1")
            container = job.node(node)
            container.kill() if command == "kill" else container.start()
            print(f"{command}: {container.name}")
        elif command == "build":
            job.build()
        elif command == "down":   # the object store too, whether this run used it or not; its volume stays
            job.compose("--profile", OBJECTS, "down", "--remove-orphans", capture=False)
        elif command == "ps":
            job.compose("--profile", OBJECTS, "ps", "--all", capture=False)
        else:   # logs: the nodes, spares too, not the store (it outlives the job), until every node has exited
            job.compose("logs", "--follow", "--tail=50", *NODE_SERVICES, capture=False, check=False, timeout=10**7)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except JobError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
