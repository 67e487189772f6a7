"""A second home for snapshots: an S3-compatible object store (--snapshot-url s3://BUCKET/PREFIX). No torch here.

Each node keeps its snapshots on its own disk (app/training/snapshot_files.py); a job whose hosts all
lose their disks would lose its run. So the snapshot saver (app/training/saver.py) also uploads every
snapshot it commits, from its own process, and a start that finds a newer snapshot in the store than
on any disk downloads it first (app/training/snapshot.py). Under the run's prefix:

    PREFIX/step-00000300/commit.json                 written last, only if absent (If-None-Match: *)
    PREFIX/step-00000300/<upload>/manifest.json      the files of one upload: the local step-N folder
    PREFIX/step-00000300/<upload>/model.safetensors  ...
    PREFIX/job.json                                  the job that began here (--no-resume's first start)

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
import shutil
import socket
import uuid
from pathlib import Path
from typing import Any, Iterator, Mapping

from app.core.config import parse_snapshot_url
from app.core.errors import UserError
from app.training.snapshot_files import (MANIFEST, commit_folder, fsync_dir, locked_folder, manifest_files, name_of,
                                         remove_stale, step_of_name)

COMMIT = "commit.json"
JOB_MARK = "job.json"               # PREFIX/job.json: the job whose snapshots these are (Snapshots, --no-resume)
DOWNLOAD_PREFIX = ".download-"      # a download's folder until it is complete (ObjectStore.download)
PIECE = 1 << 20
# Tries of each request (botocore's standard retry mode; AWS_MAX_ATTEMPTS, the AWS tools' own setting,
# overrides it): a request that failed on the store's side (a 5xx, throttling, a reset connection, a
# timeout) is sent again after a jittered backoff, rand(0, 1) x 2^i seconds after the i-th failure
# (x 0.05 but for throttling) and 20 s at most, so 5 tries wait at most 1 + 2 + 4 + 8 = 15 s. Then it
# is StoreDown: the start goes on from the disks, the saver tries again every Uploader.RETRY_S.
ATTEMPTS = 5
CONNECT_TIMEOUT_S = 3.0     # a store that does not accept the connection within this: that try failed
READ_TIMEOUT_S = 60.0       # a store that sends nothing for this long within one answer: that try failed
# Answers that say the store cannot serve now, not that it refuses us: S3's throttling and timeout codes
# (botocore's standard mode retries on the same), besides every 5xx, 408 and 429.
BUSY_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestThrottled", "RequestLimitExceeded",
              "TooManyRequestsException", "RequestTimeout", "RequestTimeoutException", "PriorRequestNotComplete",
              "ServiceUnavailable", "InternalError"}


class StoreDown(Exception):
    """The object store cannot be reached now (the job goes on with its local snapshots)."""


class StoreInvalid(Exception):
    """A snapshot in the store that cannot be used (a file missing, truncated or changed)."""


def endpoint(environ: Mapping[str, str] = os.environ) -> str | None:
    """The server the AWS tools would use for S3, when it is not AWS's own."""
    return environ.get("AWS_ENDPOINT_URL_S3") or environ.get("AWS_ENDPOINT_URL") or None


class ObjectStore:
    """One run's snapshots in an S3 bucket: check, upload, list, download, prune."""

    def __init__(self, url: str, attempts: int | None = None, environ: Mapping[str, str] | None = None) -> None:
        """attempts: tries of each request (None: AWS_MAX_ATTEMPTS, else ATTEMPTS). environ: the AWS tools'
        variables to use instead of this process's (the chaos runner reads a job's store without taking
        its identity into its own environment)."""
        self.location = parse_snapshot_url(url)
        self._environ = os.environ if environ is None else environ
        self._given_attempts = attempts
        self._client: Any = None

    # ------------------------------------------------------------ the client

    @property
    def _attempts(self) -> int:
        """Read at each use, not when made: the saver makes its store before any request, and a bad
        AWS_MAX_ATTEMPTS is the start's one error line, not a traceback of the saver's."""
        return self._given_attempts or tries(self._environ)

    def client(self) -> Any:
        if self._client is None:
            self._client = _make_client(self._attempts, self._environ)
        return self._client

    def _call(self, method: str, **kwargs: Any) -> Any:
        """One S3 call, tried up to `attempts` times; StoreDown when the server cannot be reached or cannot
        serve now (a 5xx, throttling, a reset, a timeout), UserError when it refuses us."""
        from botocore.exceptions import BotoCoreError, ClientError, ConnectionError, HTTPClientError, NoCredentialsError

        try:
            return getattr(self.client(), method)(Bucket=self.location.bucket, **kwargs)
        except NoCredentialsError:
            raise UserError("--snapshot-url: no credentials for the object store; set AWS_ACCESS_KEY_ID and "
                            "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)") from None
        except ClientError as exc:
            raise _answer(exc, self.location, endpoint(self._environ) or "S3") from None
        except (ConnectionError, HTTPClientError) as exc:     # refused, reset, timed out: every try
            raise StoreDown(f"{endpoint(self._environ) or 'S3'}: {type(exc).__name__}, {self._attempts} tries") from None
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

    # ------------------------------------------------------------ whose prefix it is

    def job_mark(self) -> dict[str, Any] | None:
        """The mark of the job that began under this prefix (JOB_MARK: its name and when), or None."""
        try:
            mark = json.loads(self._call("get_object", Key=f"{self.location.prefix}/{JOB_MARK}")["Body"].read())
        except (_Missing, ValueError):
            return None
        return mark if isinstance(mark, dict) else None

    def mark_job(self, mark: dict[str, Any]) -> None:
        """Say under the prefix which job it is (a start that began the job, with no snapshot there)."""
        body = json.dumps(mark).encode()
        self._call("put_object", Key=f"{self.location.prefix}/{JOB_MARK}", Body=body, ContentMD5=_md5(body))

    # ------------------------------------------------------------ upload

    def upload(self, folder: Path, step: int) -> bool:
        """Put one local step-N folder; True if its commit is the one that stands, False where another
        writer's already did (its files are then removed). Each part is checked against the folder's
        manifest as it is read: a snapshot damaged on this disk is StoreInvalid and never committed.
        StoreDown, StoreInvalid or OSError midway leave no commit."""
        if self._exists(self._key(step, COMMIT)):
            return False
        try:
            parts = manifest_files(folder)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise StoreInvalid(f"its {MANIFEST} is unreadable ({type(exc).__name__})") from None
        upload = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            files = {name: self._put_file(folder / name, self._key(step, upload, name), expected)
                     for name, expected in [*parts.items(), (MANIFEST, None)]}
            commit = json.dumps({"step": step, "upload": upload, "files": files}, indent=1).encode()
            self._call("put_object", Key=self._key(step, COMMIT), Body=commit, IfNoneMatch="*",
                       ContentMD5=_md5(commit))
        except (_Conflict, StoreInvalid) as exc:
            self._delete(list(self._keys(self._key(step, upload) + "/")))
            if isinstance(exc, StoreInvalid):
                raise
            return False
        return True

    def _put_file(self, path: Path, key: str, expected: dict[str, Any] | None) -> dict[str, Any]:
        """Put one file, hashed first; StoreInvalid, before anything is sent, if it is not `expected`."""
        md5, sha, size = hashlib.md5(), hashlib.sha256(), 0
        with open(path, "rb") as f:
            while piece := f.read(PIECE):
                md5.update(piece)
                sha.update(piece)
                size += len(piece)
            found = {"bytes": size, "sha256": sha.hexdigest()}
            if expected is not None and found != expected:
                raise StoreInvalid(f"{path.name} does not match its {MANIFEST} (damaged on this disk)")
            f.seek(0)
            self._call("put_object", Key=key, Body=f, ContentLength=size,
                       ContentMD5=base64.b64encode(md5.digest()).decode())
        return found

    def _exists(self, key: str) -> bool:
        try:
            self._call("head_object", Key=key)
        except _Missing:
            return False
        return True

    # ------------------------------------------------------------ download

    def download(self, step: int, directory: Path) -> Path:
        """The committed snapshot of `step` as a local step-N folder in `directory`, every file checked
        against the commit; StoreInvalid if one is missing or does not match, StoreDown.

        The files arrive in a folder of their own (DOWNLOAD_PREFIX, held with flock), renamed to step-N
        once all are there and checked. A connection dropped mid-file goes on from the byte it reached
        (a ranged GET), and a download that gives up keeps what it has: the next start (an elastic
        restart, say) fetches only the rest. Other steps' leftover downloads are removed."""
        try:
            commit = json.loads(self._call("get_object", Key=self._key(step, COMMIT))["Body"].read())
            upload, files = str(commit["upload"]), dict(commit["files"])
        except (_Missing, ValueError, KeyError, TypeError) as exc:
            raise StoreInvalid(f"its {COMMIT} is unreadable ({type(exc).__name__})") from None
        if (directory / name_of(step)).exists():
            return directory / name_of(step)
        partial = directory / f"{DOWNLOAD_PREFIX}{name_of(step)}-{upload}"
        remove_stale(directory, (DOWNLOAD_PREFIX,), keep=partial)
        held = locked_folder(partial)
        try:
            if (directory / name_of(step)).exists():    # another process of this directory downloaded it meanwhile
                shutil.rmtree(partial, ignore_errors=True)
                return directory / name_of(step)
            for name, expected in files.items():
                self._fetch_file(step, upload, name, expected, partial)
            fsync_dir(partial)
            return commit_folder(partial, directory / name_of(step), directory)
        except StoreInvalid:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        finally:
            os.close(held)

    def _fetch_file(self, step: int, upload: str, name: str, expected: dict[str, Any], into: Path) -> None:
        """One file of the commit into `into`, going on from what an earlier try left there."""
        from botocore.exceptions import BotoCoreError

        if "/" in name or name.startswith("."):
            raise StoreInvalid(f"its {COMMIT} names a file {name!r}")
        path, size, sha = into / name, expected.get("bytes"), hashlib.sha256()
        have = _hash_into(sha, path) if path.exists() else 0
        if not isinstance(size, int) or have > size:
            have, sha = 0, hashlib.sha256()
        for attempt in range(1, self._attempts + 1):
            if have == size:
                break
            try:
                have = self._fetch_from(step, upload, name, path, have, sha)
                break                           # the body ended: what it held is the file
            except BotoCoreError as exc:        # the connection dropped mid-body (ResponseStreamingError, ...)
                if attempt == self._attempts:
                    raise StoreDown(f"the download of {name} broke off {attempt} times ({type(exc).__name__}); "
                                    "what arrived is kept for the next try") from None
                have = path.stat().st_size      # every piece written was hashed: go on from there
        if have != size or sha.hexdigest() != expected.get("sha256"):
            raise StoreInvalid(f"{name} does not match its commit (truncated or changed)")

    def _fetch_from(self, step: int, upload: str, name: str, path: Path, have: int, sha: Any) -> int:
        """Append the file's bytes from `have` on (all of them when 0) to `path`; its size after."""
        ranged = {"Range": f"bytes={have}-"} if have else {}
        try:
            body = self._call("get_object", Key=self._key(step, upload, name), **ranged)["Body"]
        except _Missing:
            raise StoreInvalid(f"{name} is missing") from None
        with open(path, "ab" if have else "wb") as f:
            for piece in body.iter_chunks(PIECE):
                f.write(piece)
                f.flush()               # what arrived is on the file if the next piece never does
                sha.update(piece)
                have += len(piece)
            os.fsync(f.fileno())
        return have

    def retire(self, step: int) -> None:
        """Take back the commit of a snapshot found unusable, so that no later start downloads it again
        (and a writer that holds a good copy of the step may commit it); its files go with a later prune."""
        self._delete([self._key(step, COMMIT)])

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


def _answer(exc: Any, location: Any, where: str) -> Exception:
    """What an error answer means: the store down for now, a refusal (UserError), a key missing or a lost put."""
    meta = exc.response.get("ResponseMetadata", {})
    status, code = meta.get("HTTPStatusCode"), exc.response.get("Error", {}).get("Code", "")
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
    if status in (408, 429) or (status or 0) >= 500 or code in BUSY_CODES:
        said = " ".join(dict.fromkeys(str(part) for part in (status, code) if part))     # "503 SlowDown"; "502"
        return StoreDown(f"{where}: {operation} answered {said}, {meta.get('RetryAttempts', 0) + 1} tries")
    return UserError(f"--snapshot-url: {operation} refused by the object store ({code or status})")


def _hash_into(sha: Any, path: Path) -> int:
    """Feed a file's bytes to `sha`; its size."""
    size = 0
    with open(path, "rb") as f:
        while piece := f.read(PIECE):
            sha.update(piece)
            size += len(piece)
    return size


def _md5(payload: bytes) -> str:
    return base64.b64encode(hashlib.md5(payload).digest()).decode()


def tries(environ: Mapping[str, str]) -> int:
    """The tries of each request: AWS_MAX_ATTEMPTS if set (UserError if it is no whole number above 0), else ATTEMPTS."""
    raw = environ.get("AWS_MAX_ATTEMPTS", "").strip()
    if not raw:
        return ATTEMPTS
    if not raw.isdigit() or int(raw) < 1:
        raise UserError(f"AWS_MAX_ATTEMPTS must be a whole number of tries, 1 or more, got {raw!r}")
    return int(raw)


def _make_client(attempts: int, environ: Mapping[str, str]) -> Any:
    """botocore's standard retry mode, not adaptive: adaptive adds a client-side rate limiter for many
    requests in flight at once, where this client sends one at a time (and AWS calls it experimental)."""
    import boto3
    from botocore.config import Config as BotoConfig
    from botocore.exceptions import BotoCoreError

    config = BotoConfig(
        connect_timeout=CONNECT_TIMEOUT_S, read_timeout=READ_TIMEOUT_S,
        retries={"total_max_attempts": attempts, "mode": "standard"},
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
