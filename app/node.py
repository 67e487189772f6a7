"""What a node container does besides training, as small subcommands of `python -m app.node`.

docker/entrypoint.sh builds the torchrun command and supervises it; everything it needs to
compute or check is here, where it can be imported and tested:

    python -m app.node store                  # the rendezvous TCPStore on RDZV_BIND:RDZV_PORT, alone
    python -m app.node objects                # the object store (S3) on OBJECTS_BIND:OBJECTS_PORT, data in OBJECTS_DIR
    python -m app.node objects-health         # exit 0 once that store answers (the compose service's healthcheck)
    python -m app.node check-config ARGS...   # the trainer's flags and TRAIN_* variables, once
    python -m app.node gpus                   # GPUs per node and the host GPUs this job may use
    python -m app.node cpus                   # cores per node and the cores this node may claim
    python -m app.node iface ADDR             # the network interface that holds ADDR
    python -m app.node COMMAND --help         # this text (check-config: the trainer's flags)

torchrun itself is started through app/launch.py (the fault policy's timings, node names, stopped workers).

Every failure the user can fix is one `error: ...` line and exit status 2.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
from datetime import timedelta
from typing import Sequence

from app.core.errors import UserError, one_line_errors
from app.core.policy import FaultPolicy

_SIOCGIFADDR = 0x8915       # ioctl: the IPv4 address of a network interface


# ---------------------------------------------------------------- GPUs

def host_gpus() -> list[str]:
    """Indices of the GPUs nvidia-smi sees here (none on a host or container without NVIDIA's driver)."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return done.stdout.split() if done.returncode == 0 else []


def gpu_plan(spec: str, present: Sequence[str], nodes: int) -> tuple[int, list[str]]:
    """(GPUs per node, the host GPUs the job may use) for `nodes` node containers on this host.

    spec: GPUS as the user gave it: "" or "all" for every GPU present, else a comma-separated list.
    Without GPUs (none present, none named) it is (0, []): the nodes train on CPU. Named GPUs that
    are not present are allowed only on a host without any (how the assignment is tested on CPU).
    """
    if nodes < 1:
        raise UserError(f"NODES must be a positive integer, got {nodes}")
    named = [g.strip() for g in spec.split(",") if g.strip()] if spec.strip() not in ("", "all") else list(present)
    if not named:
        return 0, []
    if not all(g.isdigit() for g in named) or len(set(named)) != len(named):
        raise UserError(f"GPUS must be distinct GPU indices separated by commas, got {spec!r}")
    missing = [g for g in named if present and g not in present]
    if missing:
        raise UserError(f"GPUS names GPU {', '.join(missing)}, but this host has GPUs {', '.join(present)}")
    if nodes > len(named):
        raise UserError(f"{nodes} nodes on this host need at least one GPU each, GPUS has {len(named)}")
    if len(named) % nodes:
        raise UserError(f"{len(named)} GPUs do not split evenly over {nodes} nodes: choose NODES or GPUS to fit")
    return len(named) // nodes, named


# ---------------------------------------------------------------- CPUs

def cpu_plan(cores: Sequence[int], nodes: int) -> int:
    """Cores each of `nodes` node containers on this host claims for its own, out of `cores`: an equal
    share, or 0 (no claim) for a node alone, which runs on every core anyway, or when there are more
    nodes than cores. Unclaimed, a node runs on every core, and its processes still take only their
    share of each (app/cluster/cores.py counts every training process of the host)."""
    if nodes < 1:
        raise UserError(f"NODES must be a positive integer, got {nodes}")
    return len(cores) // nodes if 1 < nodes <= len(cores) else 0


# ---------------------------------------------------------------- network

def interface_of(address: str) -> str | None:
    """The name of the network interface that holds this IPv4 address (or host name), if any."""
    want = socket.gethostbyname(address)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue        # no IPv4 address on this interface
            if socket.inet_ntoa(raw[20:24]) == want:
                return name
    return None


# ---------------------------------------------------------------- rendezvous

def serve_store(address: str, port: int) -> None:
    """A TCPStore server, and the torchft Lighthouse. Nodes connect as clients (is_host=false), so
    killing or restarting any node never takes the rendezvous state down.

    TCPStore listens on every interface of its host; anything that reaches the port could join the
    job. So the socket is made here, bound to `address` alone (the endpoint the nodes are given),
    and handed to the store.
    """
    import torch.distributed as dist

    listener = socket.create_server((address, port), backlog=128)
    store = dist.TCPStore(address, port, is_master=True, wait_for_workers=False, multi_tenant=True,
                          timeout=timedelta(seconds=60), master_listen_fd=listener.detach(), use_libuv=False)
    # os._exit: the store's thread still polls the socket; an orderly interpreter exit would abort it.
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    print(f"[rdzv-store] TCPStore listening on {address}:{store.port}", flush=True)
    lighthouse = _lighthouse(address)   # held here: the server stops when it is collected
    while True:
        signal.pause()


def _lighthouse(address: str) -> object | None:
    """The torchft mode's Lighthouse, where torchft is installed (idle in the other modes): like the
    store, it holds what the nodes meet through, so it must not sit on a node that may be killed. A
    host without torchft (a GPU machine's own Python) still serves the store the other modes need."""
    try:
        import torchft.coordination  # noqa: F401 (what serve() needs, asked before anything listens)
    except ImportError:
        print("[rdzv-store] no torchft Lighthouse: torchft is not installed (--ft torchft needs it)", flush=True)
        return None
    from app.ft.lighthouse import serve

    policy = FaultPolicy.from_env().check()
    server = serve(policy, address)
    print(f"[rdzv-store] torchft Lighthouse listening on {address}:{policy.lighthouse_port}", flush=True)
    return server


def _objects_settings() -> tuple[str, int, str]:
    """(bind address, S3 port, bucket) of the object store, from OBJECTS_BIND, OBJECTS_PORT, OBJECTS_BUCKET."""
    from app.cluster.object_server import DEFAULT_PORT

    port = os.environ.get("OBJECTS_PORT", str(DEFAULT_PORT))
    if not port.isdigit() or not 0 < int(port) < 65536 - 10005:
        raise UserError(f"OBJECTS_PORT must be a port number below {65536 - 10005}, got {port!r}")
    return os.environ.get("OBJECTS_BIND", "127.0.0.1"), int(port), os.environ.get("OBJECTS_BUCKET", "snapshots")


def serve_objects() -> None:
    """The snapshots' object store (app/cluster/object_server.py), in place of this process: its
    settings from OBJECTS_DIR, OBJECTS_BIND, OBJECTS_PORT and OBJECTS_BUCKET, its one identity
    from AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY."""
    from pathlib import Path

    from app.cluster.object_server import command, write_security

    bind, port, bucket = _objects_settings()
    if not (os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SECRET_ACCESS_KEY")):
        raise UserError("the object store needs AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY: the one identity it lets in")
    directory = Path(os.environ.get("OBJECTS_DIR", "/objects"))
    try:
        write_security(directory, bind)
    except OSError as exc:
        raise UserError(f"cannot write to OBJECTS_DIR {directory}: {exc.strerror}") from None
    os.chdir(directory)         # where weed reads its security.toml
    os.umask(0o077)     # weed's Unix sockets (in /tmp) and files: its user's alone, whatever umask it inherits
    argv = command(directory, bind, port, bucket)
    os.execv(argv[0], argv)


OBJECTS_ANSWERED = "/tmp/ftt-objects-answered"     # in the container's own /tmp: gone with the container


def objects_health(answered: str = OBJECTS_ANSWERED) -> int:
    """The objects service's healthcheck (compose.yaml): 0 once its bucket answers to its identity, as a
    trainer's start asks it first, else 1 and one line saying why (docker keeps it in the health log).

    The store makes its bucket a moment after its port opens, so the port alone would let a trainer
    start too early. Once the bucket has answered, the port is enough: boto3's import at every check
    (every 2 s) would take a sixth of a core from the training beside it, and the bucket and the
    identity stay as they are while the container lives (the store is its process)."""
    bind, port, bucket = _objects_settings()
    if os.path.exists(answered):
        try:
            socket.create_connection((bind, port), timeout=2).close()
            return 0
        except OSError as exc:
            print(f"the object store does not answer on {bind}:{port}: {exc.strerror or exc}")
            return 1
    import boto3
    from botocore.config import Config

    try:
        boto3.session.Session().client("s3", region_name="us-east-1", endpoint_url=f"http://{bind}:{port}",
                                       config=Config(connect_timeout=2, read_timeout=3, retries={"max_attempts": 1})
                                       ).head_bucket(Bucket=bucket)
    except Exception as exc:   # not listening yet, the bucket not made yet, the identity missing or refused
        print(f"bucket {bucket!r} on {bind}:{port} does not answer yet: {type(exc).__name__}: {exc}")
        return 1
    open(answered, "w").close()
    return 0


# ---------------------------------------------------------------- entry point

def _nodes() -> int:
    nodes = os.environ.get("NODES", "1")
    if not nodes.isdigit():
        raise UserError(f"NODES must be a positive integer, got {nodes!r}")
    return int(nodes)


def _gpus() -> None:
    """Print "K ID ID ...": GPUs per node, then the host GPUs this node may claim (K is 0 on CPU)."""
    per_node, gpus = gpu_plan(os.environ.get("GPUS", ""), host_gpus(), _nodes())
    print(" ".join([str(per_node), *gpus]))


def _cpus() -> None:
    """Print "K ID ID ...": cores per node (0: no claim), then the cores this node may claim."""
    cores = sorted(os.sched_getaffinity(0))
    print(" ".join(map(str, [cpu_plan(cores, _nodes()), *cores])))


def main(argv: Sequence[str]) -> int:
    return one_line_errors(lambda: _command(argv))


HELP = ("-h", "--help")
USAGE = "usage: python -m app.node store|objects|objects-health|check-config|gpus|cpus|iface ADDR"


def _command(argv: Sequence[str]) -> int | None:
    command, args = (argv[0], list(argv[1:])) if argv else ("", [])
    # check-config's --help is the trainer's, which lists the flags it checks.
    if command in HELP or (command != "check-config" and any(a in HELP for a in args)):
        print(f"{USAGE}\n\n{__doc__.strip()}")
    elif command == "store":
        serve_store(os.environ.get("RDZV_BIND", "0.0.0.0"), FaultPolicy.from_env().check().store_port)
    elif command == "objects":
        serve_objects()
    elif command == "objects-health":
        return objects_health()
    elif command == "check-config":
        from app.core.config import parse

        parse(args)
    elif command == "gpus":
        _gpus()
    elif command == "cpus":
        _cpus()
    elif command == "iface" and len(args) == 1:
        name = interface_of(args[0])
        if name is None:
            return 1
        print(name)
    else:
        raise UserError(f"{USAGE}; got {' '.join(argv) or 'nothing'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
