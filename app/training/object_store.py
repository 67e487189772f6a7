"""A second home for snapshots: an S3-compatible object store (--snapshot-url s3://BUCKET/PREFIX). No torch here.

Each node keeps its snapshots on its own disk (app/training/snapshot_files.py); a job whose hosts all
lose their disks would lose its run. So the snapshot saver (app/training/saver.py) also uploads every
snapshot it commits, from its own process, and a start that finds a newer snapshot in the store than
on any disk downloads it first (app/training/snapshot.py). Under the run's prefix:

    PREFIX/step-00000300/commit.json                 written last, only if absent (If-None-Match: *)
    PREFIX/step-00000300/<upload>/manifest.json      the files of one upload: the local step-N folder
    PREFIX/step-00000300/<upload>/model.safetensors  ...

A snapshot exists in the store once its commit.json does: it names the upload that won and the size
and sha256 of each of its files. An upload killed halfway has no commit and is never chosen; two
nodes uploading one step both put their files, one commit wins (the put is conditional), and the
other removes its files. Every file is sent with its MD5 (Content-MD5), so the server refuses bytes
that did not arrive as sent, and every download is checked against the commit's sha256.

The client is boto3, which reads the AWS tools' settings itself: AWS_ENDPOINT_URL (or
AWS_ENDPOINT_URL_S3), AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, AWS_REGION. With an
endpoint set (a server other than AWS's), addressing is path-style. Credentials never go in the URL.
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import socket
import uuid
from pathlib import Path
from typing import Any, Iterator, Mapping

from app.core.config import parse_snapshot_url
from app.core.errors import UserError
from app.training.snapshot_files import build_folder, name_of, step_of_name

COMMIT = "commit.json"
PIECE = 1 << 20


class StoreDown(Exception):
    """The object store cannot be reached now (the job goes on with its local snapshots)."""


class StoreInvalid(Exception):
    """A snapshot in the store that cannot be used (a file missing, truncated or changed)."""


def endpoint(environ: Mapping[str, str] = os.environ) -> str | None:
    """The server the AWS tools would use for S3, when it is not AWS's own."""
    return environ.get("AWS_ENDPOINT_URL_S3") or environ.get("AWS_ENDPOINT_URL") or None


class ObjectStore:
    """One run's snapshots in an S3 bucket: check, upload, list, download, prune."""

    def __init__(self, url: str, attempts: int = 3, environ: Mapping[str, str] | None = None) -> None:
        """environ: the AWS tools' variables to use instead of this process's (the chaos runner reads a
        job's store without taking its identity into its own environment)."""
        self.location = parse_snapshot_url(url)
        self._attempts = attempts
        self._environ = os.environ if environ is None else environ
        self._client: Any = None

    # ------------------------------------------------------------ the client

    def client(self) -> Any:
        if self._client is None:
            self._client = _make_client(self._attempts, self._environ)
        return self._client

    def _call(self, method: str, **kwargs: Any) -> Any:
        """One S3 call; StoreDown when the server cannot be reached, UserError when it refuses us."""
        from botocore.exceptions import BotoCoreError, ClientError, ConnectionError, HTTPClientError, NoCredentialsError

        try:
            return getattr(self.client(), method)(Bucket=self.location.bucket, **kwargs)
        except NoCredentialsError:
            raise UserError("--snapshot-url: no credentials for the object store; set AWS_ACCESS_KEY_ID and "
                            "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)") from None
        except ClientError as exc:
            raise _refusal(exc, self.location, endpoint(self._environ) or "S3") from None
        except (ConnectionError, HTTPClientError) as exc:
            raise StoreDown(f"{endpoint(self._environ) or 'S3'}: {type(exc).__name__}") from None
        except BotoCoreError as exc:
            raise UserError(f"--snapshot-url: {exc}") from None

    def check(self) -> None:
        """At start: the bucket is there and takes our credentials (UserError), or StoreDown."""
        self._call("head_bucket")

    # ------------------------------------------------------------ what is there

    def _keys(self, prefix: str) -> Iterator[str]:
        token: dict[str, str] = {}
        while True:
            page = self._call("list_objects_v2", Prefix=prefix, **token)
            yield from (item["Key"] for item in page.get("Contents", []))
            if not page.get("IsTruncated"):
                return
            token = {"ContinuationToken": page["NextContinuationToken"]}

    def steps(self) -> dict[int, bool]:
        """Every step with files under the prefix: True where committed."""
        found: dict[int, bool] = {}
        for key in self._keys(f"{self.location.prefix}/"):
            folder, _, rest = key[len(self.location.prefix) + 1:].partition("/")
            step = step_of_name(folder)
            if step is not None:
                found[step] = found.get(step, False) or rest == COMMIT
        return found

    def committed(self) -> list[int]:
        """Committed steps, newest first."""
        return sorted((step for step, done in self.steps().items() if done), reverse=True)

    def _key(self, step: int, *names: str) -> str:
        return "/".join([self.location.prefix, name_of(step), *names])

    # ------------------------------------------------------------ upload

    def upload(self, folder: Path, step: int) -> bool:
        """Put one local step-N folder; True if its commit is the one that stands, False where another
        writer's already did (its files are then removed). StoreDown or OSError midway leaves no commit."""
        if self._exists(self._key(step, COMMIT)):
            return False
        upload = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        files = {}
        for path in sorted(p for p in folder.iterdir() if p.is_file()):
            files[path.name] = self._put_file(path, self._key(step, upload, path.name))
        commit = json.dumps({"step": step, "upload": upload, "files": files}, indent=1).encode()
        try:
            self._call("put_object", Key=self._key(step, COMMIT), Body=commit, IfNoneMatch="*",
                       ContentMD5=_md5(commit))
        except _Conflict:
            self._delete(list(self._keys(self._key(step, upload) + "/")))
            return False
        return True

    def _put_file(self, path: Path, key: str) -> dict[str, Any]:
        md5, sha, size = hashlib.md5(), hashlib.sha256(), 0
        with open(path, "rb") as f:
            while piece := f.read(PIECE):
                md5.update(piece)
                sha.update(piece)
                size += len(piece)
            f.seek(0)
            self._call("put_object", Key=key, Body=f, ContentLength=size,
                       ContentMD5=base64.b64encode(md5.digest()).decode())
        return {"bytes": size, "sha256": sha.hexdigest()}

    def _exists(self, key: str) -> bool:
        try:
            self._call("head_object", Key=key)
        except _Missing:
            return False
        return True

    # ------------------------------------------------------------ download

    def download(self, step: int, directory: Path) -> Path:
        """The committed snapshot of `step` as a local step-N folder in `directory`, every file checked
        against the commit; StoreInvalid if one is missing or does not match, StoreDown."""
        try:
            commit = json.loads(self._call("get_object", Key=self._key(step, COMMIT))["Body"].read())
            upload, files = str(commit["upload"]), dict(commit["files"])
        except (_Missing, ValueError, KeyError, TypeError) as exc:
            raise StoreInvalid(f"its {COMMIT} is unreadable ({type(exc).__name__})") from None
        return build_folder(directory, step, lambda tmp: self._fetch_files(step, upload, files, tmp))

    def _fetch_files(self, step: int, upload: str, files: dict[str, Any], into: Path) -> None:
        for name, expected in files.items():
            if "/" in name or name.startswith("."):
                raise StoreInvalid(f"its {COMMIT} names a file {name!r}")
            try:
                body = self._call("get_object", Key=self._key(step, upload, name))["Body"]
            except _Missing:
                raise StoreInvalid(f"{name} is missing") from None
            sha, size = hashlib.sha256(), 0
            with open(into / name, "wb") as f:
                for piece in body.iter_chunks(PIECE):
                    f.write(piece)
                    sha.update(piece)
                    size += len(piece)
                os.fsync(f.fileno())
            if size != expected.get("bytes") or sha.hexdigest() != expected.get("sha256"):
                raise StoreInvalid(f"{name} does not match its commit (truncated or changed)")

    # ------------------------------------------------------------ prune

    def prune(self, keep: int) -> None:
        """Keep the newest `keep` committed snapshots; remove older ones, and the files of uploads that
        never committed once a newer snapshot is kept (an upload in flight is always newer)."""
        steps = self.steps()
        kept = sorted((s for s, done in steps.items() if done), reverse=True)[:keep]
        if not kept:
            return
        for step in sorted(s for s in steps if s < kept[-1]):
            keys = list(self._keys(self._key(step) + "/"))
            commit = self._key(step, COMMIT)
            self._delete([commit] if commit in keys else [])      # the commit first: never a commit without files
            self._delete([k for k in keys if k != commit])

    def _delete(self, keys: list[str]) -> None:
        for start in range(0, len(keys), 1000):
            batch = keys[start:start + 1000]
            if batch:
                self._call("delete_objects", Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True})


class _Missing(Exception):
    """A key or bucket that is not there (404)."""


class _Conflict(Exception):
    """A conditional put that lost: the key exists (412)."""


def _refusal(exc: Any, location: Any, where: str) -> Exception:
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    code = exc.response.get("Error", {}).get("Code", "")
    operation = exc.operation_name
    if status == 412 or code == "PreconditionFailed":
        return _Conflict(code)
    if status == 404 and operation == "HeadBucket" or code == "NoSuchBucket":
        return UserError(f"--snapshot-url: bucket {location.bucket!r} does not exist at "
                         f"{where} (create it, or name another)")
    if status == 404 or code == "NoSuchKey":
        return _Missing(code or "404")
    if status in (401, 403):
        return UserError(f"--snapshot-url: the object store at {where} refused the credentials "
                         f"(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or AWS_PROFILE) for bucket {location.bucket!r}")
    return UserError(f"--snapshot-url: {operation} refused by the object store ({code or status})")


def _md5(payload: bytes) -> str:
    return base64.b64encode(hashlib.md5(payload).digest()).decode()


def _make_client(attempts: int, environ: Mapping[str, str]) -> Any:
    import boto3
    from botocore.config import Config as BotoConfig
    from botocore.exceptions import BotoCoreError

    config = BotoConfig(
        connect_timeout=3, read_timeout=60, retries={"max_attempts": attempts, "mode": "standard"},
        # Only what a request needs: the newer default checksums are not taken by every S3 server, and
        # each file already travels with its MD5.
        request_checksum_calculation="when_required", response_checksum_validation="when_required",
        s3={"addressing_style": "path"} if endpoint(environ) else {})
    try:
        if environ is os.environ:       # boto3's own search: variables, profiles, instance roles
            session, given = boto3.session.Session(), {}
        else:
            session = boto3.session.Session(aws_access_key_id=environ.get("AWS_ACCESS_KEY_ID"),
                                            aws_secret_access_key=environ.get("AWS_SECRET_ACCESS_KEY"))
            given = {"endpoint_url": endpoint(environ)}
        return session.client("s3", region_name=session.region_name or "us-east-1", config=config, **given)
    except BotoCoreError as exc:     # a profile that does not exist, an endpoint that is not a URL
        raise UserError(f"--snapshot-url: {exc}") from None
    except ValueError as exc:
        raise UserError(f"--snapshot-url: AWS_ENDPOINT_URL: {exc}") from None
