"""Snapshots in an S3-compatible object store (app/training/object_store.py), against a real server
(SeaweedFS, the `object_store` fixture): upload, commit, download, prune, what goes wrong, and that
no port of the server lets a stranger in."""
from __future__ import annotations

import json
import os
import socket
import ssl
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest

from app.core.errors import UserError
from app.training import object_store, saver
from app.core.config import parse_snapshot_url as parse_url
from app.training.object_store import COMMIT, ObjectStore, StoreDown, StoreInvalid
from app.training.snapshot import read_snapshot, write_snapshot
from app.cluster.object_server import CERT, GRPC_OFFSET, KEY, SERVERS, LocalServer, certificate, ports
from tests.helpers import free_port
from tests.test_snapshot import make_parts

pytestmark = pytest.mark.unit


@pytest.fixture
def store(object_store: LocalServer, monkeypatch: pytest.MonkeyPatch) -> ObjectStore:
    """A client on a prefix of this test's own."""
    for key, value in object_store.env().items():
        monkeypatch.setenv(key, value)
    return ObjectStore(object_store.url(f"run-{uuid.uuid4().hex[:8]}"))


def snapshot_folder(directory: Path, step: int, size: int = 1000) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    return write_snapshot(directory, step, make_parts(step, size))


# ---------------------------------------------------------------- the URL

@pytest.mark.parametrize("url", ["s3://snapshots", "s3://snapshots/", "snapshots/run", "http://host/bucket/run",
                                 "s3://Bad_Bucket/run", "s3:///run"])
def test_a_malformed_url_is_one_error_naming_the_setting(url):
    with pytest.raises(UserError, match="--snapshot-url must look like s3://BUCKET/PREFIX"):
        parse_url(url)


def test_credentials_in_the_url_are_refused_without_being_repeated():
    with pytest.raises(UserError) as caught:
        parse_url("s3://AKIAKEY:hunter2secret@snapshots/run")
    assert "hunter2secret" not in str(caught.value) and "AWS_ACCESS_KEY_ID" in str(caught.value)


def test_the_prefix_names_the_run():
    assert parse_url("s3://snapshots/team/run-7/").prefix == "team/run-7"


# ---------------------------------------------------------------- upload, commit, download

def test_a_snapshot_goes_up_and_comes_back_identical(store, tmp_path):
    folder = snapshot_folder(tmp_path / "here", 30)
    assert store.upload(folder, 30) is True
    assert store.committed() == [30]
    (tmp_path / "there").mkdir()
    back = store.download(30, tmp_path / "there")
    assert back.name == folder.name
    assert {p.name: p.read_bytes() for p in back.iterdir()} == {p.name: p.read_bytes() for p in folder.iterdir()}
    assert read_snapshot(back)["train_state"]["step"] == 30


def test_an_upload_without_its_commit_is_never_chosen(store, tmp_path):
    """An upload killed halfway: its files are there, its commit is not."""
    store.upload(snapshot_folder(tmp_path, 10), 10)
    newer = snapshot_folder(tmp_path, 20)
    store._put_file(newer / "model.safetensors", store._key(20, "killed-upload", "model.safetensors"), None)
    assert store.steps() == {10: True, 20: False}
    assert store.committed() == [10]


def test_two_writers_of_one_step_one_commit_stands_and_the_other_leaves_no_file(store, tmp_path, monkeypatch):
    folder = snapshot_folder(tmp_path, 40)
    assert store.upload(folder, 40) is True
    monkeypatch.setattr(store, "_exists", lambda key: False)   # the second writer looked before the first committed
    assert store.upload(folder, 40) is False
    keys = list(store._keys(store._key(40) + "/"))
    uploads = {key.split("/")[-2] for key in keys if not key.endswith(COMMIT)}
    assert len(uploads) == 1
    assert json.loads(store.client().get_object(Bucket=store.location.bucket, Key=store._key(40, COMMIT))["Body"]
                      .read())["upload"] in uploads


def test_a_changed_object_is_refused_at_download_and_leaves_no_folder(store, tmp_path):
    folder = snapshot_folder(tmp_path / "here", 50)
    store.upload(folder, 50)
    upload = json.loads(store.client().get_object(Bucket=store.location.bucket, Key=store._key(50, COMMIT))["Body"].read())["upload"]
    store.client().put_object(Bucket=store.location.bucket, Key=store._key(50, upload, "model.safetensors"), Body=b"x" * 100)
    (tmp_path / "there").mkdir()
    with pytest.raises(StoreInvalid, match="model.safetensors does not match"):
        store.download(50, tmp_path / "there")
    assert not any((tmp_path / "there").iterdir())


def test_a_snapshot_damaged_on_the_disk_before_its_upload_is_never_committed(store, tmp_path):
    """Its files, hashed as they were, once got a valid commit: a start that had lost every disk took it,
    found it unusable, and never looked at the store's older snapshots."""
    from tests.test_snapshot import corrupt

    folder = snapshot_folder(tmp_path, 60)
    corrupt(folder / "optimizer.safetensors", "flip")
    with pytest.raises(StoreInvalid, match=r"optimizer.safetensors does not match its manifest.json \(damaged on this disk\)"):
        store.upload(folder, 60)
    assert store.steps() == {}      # no commit, and no file of it left behind


class DropsMidBody:
    """get_object as the client gives it, whose body breaks off after its first piece `drops` times."""

    def __init__(self, store: ObjectStore, monkeypatch: pytest.MonkeyPatch, drops: int) -> None:
        from botocore.exceptions import ResponseStreamingError

        self.drops, self.ranges, self.sent = drops, [], 0
        real = store.client().get_object

        def get_object(**kwargs):
            response = real(**kwargs)
            self.ranges.append(kwargs.get("Range"))
            if kwargs["Key"].endswith(COMMIT):
                return response
            pieces, body = response["Body"], None

            def iter_chunks(size):
                for i, piece in enumerate(pieces.iter_chunks(4096)):
                    if i == 1 and self.drops:
                        self.drops -= 1
                        raise ResponseStreamingError(error="Connection broken: IncompleteRead")
                    self.sent += len(piece)
                    yield piece

            response["Body"] = type("Body", (), {"iter_chunks": staticmethod(iter_chunks)})()
            return response

        monkeypatch.setattr(store.client(), "get_object", get_object)


def test_a_connection_dropped_mid_download_goes_on_from_where_it_stopped(store, tmp_path, monkeypatch):
    """botocore's ResponseStreamingError once escaped the start as a traceback."""
    folder = snapshot_folder(tmp_path / "here", 70, size=10_000)      # weights of 40 KB: pieces of 4 KB
    store.upload(folder, 70)
    dropping = DropsMidBody(store, monkeypatch, drops=2)
    (tmp_path / "there").mkdir()
    back = store.download(70, tmp_path / "there")
    assert {p.name: p.read_bytes() for p in back.iterdir()} == {p.name: p.read_bytes() for p in folder.iterdir()}
    assert [r for r in dropping.ranges if r] == ["bytes=4096-", "bytes=8192-"]     # on from the byte reached
    assert [p.name for p in (tmp_path / "there").iterdir()] == ["step-00000070"]


def test_a_download_that_gives_up_keeps_what_arrived_for_the_next_start(store, tmp_path, monkeypatch):
    """An elastic restart once downloaded the whole snapshot again from its first byte."""
    folder = snapshot_folder(tmp_path / "here", 80, size=10_000)
    store.upload(folder, 80)
    total = sum(p.stat().st_size for p in folder.iterdir())
    tries = object_store.ATTEMPTS
    dropping = DropsMidBody(store, monkeypatch, drops=tries)       # every try of the first file breaks off
    (tmp_path / "there").mkdir()
    with pytest.raises(StoreDown, match=f"broke off {tries} times"):
        store.download(80, tmp_path / "there")
    before = dropping.sent
    back = store.download(80, tmp_path / "there")
    assert read_snapshot(back)["train_state"]["step"] == 80
    assert dropping.sent - before == total - tries * 4096 == total - before


def test_two_nodes_downloading_one_step_into_one_directory_both_get_it(store, tmp_path, monkeypatch):
    """The survivor modes' nodes each read the store at a start, into one shared snapshot directory: the
    second waited for the first's lock on the download's folder, found it renamed to step-N, and wrote
    into a folder that was gone ("cannot download into"): that node started from step 0."""
    import fcntl

    from app.training import snapshot_files

    store.upload(snapshot_folder(tmp_path / "gone", 10), 10)
    shared = tmp_path / "shared"
    shared.mkdir()
    real_flock, first, began = fcntl.flock, [], []

    def flock(fd: int, how: int) -> None:
        if how == fcntl.LOCK_EX and not began:     # the other node's download runs whole before this lock
            began.append(True)
            first.append(store.download(10, shared))
        real_flock(fd, how)

    monkeypatch.setattr(fcntl, "flock", flock)
    second = store.download(10, shared)
    assert first == [second] == [shared / "step-00000010"] and read_snapshot(second)["train_state"]["step"] == 10
    assert [p.name for p in shared.iterdir()] == ["step-00000010"]


def test_a_download_holds_against_a_clean_up_at_any_point(store, tmp_path, monkeypatch):
    """Another node's start (remove_stale) between the download's mkdir of its folder and its lock: the
    FileNotFoundError was not caught, and the start fell back to the disks without the store's snapshot."""
    from tests.test_snapshot import interleaved

    store.upload(snapshot_folder(tmp_path / "uploaded", 10), 10)

    def download(directory: Path) -> None:
        assert read_snapshot(store.download(10, directory))["train_state"]["step"] == 10
        assert [p.name for p in directory.iterdir()] == ["step-00000010"]

    (tmp_path / "here").mkdir()
    interleaved(download, monkeypatch, tmp_path / "here")


def test_prune_keeps_the_newest_and_removes_older_and_abandoned_uploads(store, tmp_path):
    for step in (10, 20, 30, 40):
        store.upload(snapshot_folder(tmp_path, step), step)
    store._put_file(tmp_path / "step-00000010" / "manifest.json", store._key(15, "killed", "manifest.json"), None)
    store._put_file(tmp_path / "step-00000010" / "manifest.json", store._key(45, "in-flight", "manifest.json"), None)
    store.prune(2)
    assert store.steps() == {30: True, 40: True, 45: False}


# ---------------------------------------------------------------- refusals and a server that is away

def test_wrong_credentials_are_one_error_naming_the_settings(object_store, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", object_store.endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", object_store.KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret-at-all")
    with pytest.raises(UserError, match="refused the credentials .*AWS_ACCESS_KEY_ID") as caught:
        ObjectStore(object_store.url("run")).check()
    assert "not-the-secret-at-all" not in str(caught.value)


def test_a_missing_bucket_is_one_error_naming_it(object_store, monkeypatch):
    for key, value in object_store.env().items():
        monkeypatch.setenv(key, value)
    with pytest.raises(UserError, match="bucket 'no-such-bucket' does not exist"):
        ObjectStore("s3://no-such-bucket/run").check()


def test_no_credentials_is_one_error(monkeypatch, tmp_path):
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    with pytest.raises(UserError, match="no credentials .*AWS_ACCESS_KEY_ID"):
        ObjectStore("s3://snapshots/run").check()


def test_a_server_that_does_not_answer_is_store_down(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    with pytest.raises(StoreDown):
        ObjectStore("s3://snapshots/run", attempts=1).check()


class FailingServer:
    """An S3 endpoint on 127.0.0.1 that fails every request one way: an HTTP status with S3's error body
    (503 SlowDown, S3's answer under load; 500 InternalError), a proxy's 502 page, a connection reset
    before any answer, or no answer at all (a read that times out). Counts the requests it got."""

    HOW = {"503-slowdown": (503, "<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"),
           "500-internal": (500, "<Error><Code>InternalError</Code><Message>We encountered an internal error.</Message></Error>"),
           "502-proxy": (502, "<html><body><h1>502 Bad Gateway</h1></body></html>"),
           "reset": (None, ""), "no-answer": (None, "")}

    def __init__(self, how: str) -> None:
        import http.server

        self.how, self.requests = how, 0
        self.silence = threading.Event()        # set at stop(): a request left without an answer ends
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def handle_one_request(self) -> None:
                self.raw_requestline = self.rfile.readline(65537)
                if not self.raw_requestline or not self.parse_request():
                    self.close_connection = True
                    return
                server.requests += 1
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                status, body = FailingServer.HOW[server.how]
                if server.how == "reset":           # RST, not FIN: SO_LINGER of 0, then close
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\0\0\0\0\0\0\0")
                    self.close_connection = True
                    return
                if server.how == "no-answer":
                    server.silence.wait(30)
                    self.close_connection = True
                    return
                self.send_response(status)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body.encode())

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"

    def env(self) -> dict[str, str]:
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": "key", "AWS_SECRET_ACCESS_KEY": "secret"}

    def stop(self) -> None:
        self.silence.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def failing(request, monkeypatch) -> Iterator[FailingServer]:
    """A FailingServer (its way: the test's parameter, else 503 SlowDown) whose variables this process has."""
    server = FailingServer(getattr(request, "param", "503-slowdown"))
    for key, value in server.env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(object_store, "READ_TIMEOUT_S", 0.5)      # no-answer: the read times out at once
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.parametrize("failing", list(FailingServer.HOW), indirect=True)
def test_a_server_error_a_reset_or_a_timeout_is_the_store_down_after_its_tries(failing):
    """Any answer but 404, 412, 401 and 403 was a UserError: the start ended with exit 2 (in elastic mode
    every rank), where 503 SlowDown is S3's ordinary answer under load and 500 and 502 come from any proxy."""
    with pytest.raises(StoreDown, match=f"^{failing.endpoint}: "):
        ObjectStore("s3://snapshots/run", attempts=2).committed()
    assert failing.requests == 2        # botocore's standard retries: the request tried again after a backoff


@pytest.mark.parametrize("raw", ["0", "many", "-1"])
def test_a_number_of_tries_that_is_none_is_one_error(failing, monkeypatch, raw):
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", raw)
    store = ObjectStore("s3://snapshots/run")       # made without a word: the saver makes its own at once
    with pytest.raises(UserError, match=f"^AWS_MAX_ATTEMPTS must be a whole number of tries, 1 or more, got '{raw}'$"):
        store.committed()
    assert failing.requests == 0


def test_an_upload_to_a_store_that_answers_503_is_the_store_down(failing, tmp_path):
    with pytest.raises(StoreDown, match=r"ListObjectsV2|HeadObject"):
        ObjectStore("s3://snapshots/run", attempts=2).upload(snapshot_folder(tmp_path, 10), 10)
    assert failing.requests == 2


def test_a_start_against_a_store_that_answers_503_resumes_from_the_disk_with_one_warning(failing, tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    snapshot_folder(tmp_path, 30)
    step, said = restored(tmp_path, "s3://snapshots/run")
    assert step == 30
    assert said.warnings == [f"warning: the object store cannot be reached ({failing.endpoint}: ListObjectsV2 "
                             "answered 503 SlowDown, 2 tries): resuming from the snapshots on the nodes' disks only"]
    assert failing.requests == 2


# ---------------------------------------------------------------- the saver's uploader

class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FlakyStore:
    """A store that is down for its first `down` uploads; records what went up."""

    def __init__(self, down: int) -> None:
        self.down, self.uploaded, self.pruned = down, [], []
        self.release = threading.Event()

    def upload(self, folder: Path, step: int) -> bool:
        self.release.wait(10)
        if self.down:
            self.down -= 1
            raise StoreDown("127.0.0.1:9: ConnectionRefused")
        self.uploaded.append(step)
        return True

    def prune(self, keep: int) -> None:
        self.pruned.append(keep)


def wait_until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_the_uploader_says_once_that_the_store_is_down_then_catches_up_with_the_newest(tmp_path, monkeypatch):
    monkeypatch.setattr(saver.Uploader, "RETRY_S", 0.05)
    fake, said, clock = FlakyStore(down=3), [], Clock()
    uploader = saver.Uploader(fake, said.append, clock=clock)
    for step in (10, 20, 30):
        (tmp_path / f"s{step}").mkdir()
    uploader.offer(tmp_path / "s10", 10, 3)
    uploader.offer(tmp_path / "s20", 20, 3)     # replaces 10 while it waits
    fake.release.set()
    wait_until(lambda: fake.down == 1)
    clock.now += 40
    uploader.offer(tmp_path / "s30", 30, 3)     # the store still down: 30 takes 20's place
    wait_until(lambda: fake.uploaded)
    uploader.finish(5)
    assert fake.uploaded == [30] and fake.pruned == [3]
    assert [line for line in said if line.startswith("warning:")] == [
        "warning: the object store cannot be reached (127.0.0.1:9: ConnectionRefused); snapshots stay on this disk "
        "and go up when it is back"]
    assert said[-1] == ("the object store is back: step 30 uploaded; it had been 40 s behind this disk (its newest "
                        "snapshot: none yet; this disk's: step 30)")


def test_at_the_end_the_uploader_tries_once_and_does_not_wait_for_a_store_that_is_down(tmp_path):
    fake, said = FlakyStore(down=100), []
    fake.release.set()
    uploader = saver.Uploader(fake, said.append)
    (tmp_path / "s10").mkdir()
    uploader.offer(tmp_path / "s10", 10, 3)
    start = time.monotonic()
    uploader.finish(5)
    assert not uploader._thread.is_alive() and time.monotonic() - start < 5
    assert fake.uploaded == [] and len(said) == 1


def test_a_snapshot_pruned_from_the_disk_while_it_waited_is_skipped(tmp_path):
    fake = FlakyStore(down=0)
    fake.release.set()
    uploader = saver.Uploader(fake, [].append)
    uploader.offer(tmp_path / "pruned-meanwhile", 10, 3)
    uploader.finish(5)
    assert fake.uploaded == []


def test_uploads_begin_every_interval_at_most_and_the_newest_waiting_goes(tmp_path):
    """A job that snapshots several times a second uploaded without a pause, its CPU taken from
    training (the chaos runner's quick job: 45 steps/s with the store against 57 without)."""
    fake = FlakyStore(down=0)
    fake.release.set()
    uploader = saver.Uploader(fake, [].append, every_s=2.0)
    for step in (10, 20, 30, 40):
        (tmp_path / f"s{step}").mkdir()
    began = time.monotonic()
    uploader.offer(tmp_path / "s10", 10, 3)
    wait_until(lambda: fake.uploaded == [10])
    uploader.offer(tmp_path / "s20", 20, 3)
    uploader.offer(tmp_path / "s30", 30, 3)     # 20 never goes: 30 is the newest when the pause ends
    time.sleep(0.5)
    assert fake.uploaded == [10], "the second upload waits for the interval"
    wait_until(lambda: fake.uploaded == [10, 30])
    assert time.monotonic() - began >= 2.0
    uploader.offer(tmp_path / "s40", 40, 3)     # the last one, at the end: it goes at once
    closing = time.monotonic()
    uploader.finish(5)
    assert fake.uploaded == [10, 30, 40] and time.monotonic() - closing < 1.5     # not the 2 s interval


class RefusingStore(FlakyStore):
    """A store whose first upload raises `error`."""

    def __init__(self, error: Exception) -> None:
        super().__init__(down=0)
        self.error = error
        self.release.set()

    def upload(self, folder: Path, step: int) -> bool:
        if self.error is not None:
            error, self.error = self.error, None
            raise error
        return super().upload(folder, step)


@pytest.mark.parametrize("error", [StoreInvalid("model.safetensors does not match its manifest.json (damaged on this disk)"),
                                   KeyError("Contents")], ids=["damaged", "unforeseen"])
def test_an_upload_that_fails_in_any_way_is_one_warning_and_the_next_one_goes(tmp_path, error):
    """The upload thread caught three exception types: anything else ended it without a word, and no
    snapshot went up for the rest of the run."""
    fake, said = RefusingStore(error), []
    uploader = saver.Uploader(fake, said.append)
    for step in (10, 20):
        (tmp_path / f"s{step}").mkdir()
    uploader.offer(tmp_path / "s10", 10, 3)
    wait_until(lambda: said)
    uploader.offer(tmp_path / "s20", 20, 3)
    uploader.finish(5)
    assert fake.uploaded == [20] and said == [f"warning: snapshot at step 10 was not uploaded: {error}"]


def test_an_upload_goes_through_while_its_folder_is_pruned(store, tmp_path, monkeypatch):
    """The uploader read the live step-N folder that the same saver pruned: with --keep times the snapshot
    interval shorter than one upload, every upload died midway ("No such file") and the store fell behind."""
    from app.training.snapshot_files import prune

    folder = snapshot_folder(tmp_path, 90)
    real, pruned = store._put_file, []

    def put_then_prune(path, key, expected):
        if not pruned:
            pruned.append(True)
            prune(tmp_path, 0)              # newer snapshots came meanwhile: this one is rotated out
        return real(path, key, expected)

    monkeypatch.setattr(store, "_put_file", put_then_prune)
    said: list[str] = []
    uploader = saver.Uploader(store, said.append)
    uploader.offer(folder, 90, 1)
    uploader.finish(30)
    assert pruned and not folder.exists() and said == [] and store.committed() == [90]
    assert [p.name for p in tmp_path.iterdir()] == []       # the held copy is gone too


def test_a_store_more_than_two_intervals_behind_the_disk_is_said_once(tmp_path):
    fake, said, clock = FlakyStore(down=0), [], Clock()
    uploader = saver.Uploader(fake, said.append, clock=clock)
    for step in range(10, 70, 10):        # a snapshot every 10 s; the first upload never ends meanwhile
        (tmp_path / f"s{step}").mkdir()
        uploader.offer(tmp_path / f"s{step}", step, 3)
        clock.now += 10
    fake.release.set()
    uploader.finish(5)
    assert said == ["warning: the object store is 30 s behind this disk (its newest snapshot: none yet; this "
                    "disk's: step 40): its uploads take longer than snapshots come, or keep failing; losing "
                    "every disk would cost that much more"]


def test_a_store_that_keeps_up_is_never_said_to_be_behind(tmp_path):
    fake, said, clock = FlakyStore(down=0), [], Clock()
    fake.release.set()
    uploader = saver.Uploader(fake, said.append, clock=clock)
    for step in range(10, 70, 10):
        (tmp_path / f"s{step}").mkdir()
        uploader.offer(tmp_path / f"s{step}", step, 3)
        wait_until(lambda: fake.uploaded[-1:] == [step])
        clock.now += 10
    uploader.offer(tmp_path / "s60", 61, 3)   # the stop's snapshot, a moment after an interval's
    uploader.finish(5)
    assert said == []


# ---------------------------------------------------------------- a start: the store beside the disks

def restored(directory: Path, url: str, mode: bool | None = None, job: str | None = None) -> tuple[int | None, list[str]]:
    from tests.test_snapshot import snapshots

    keeper, said = snapshots(directory, snapshot_url=url, job=job)
    try:
        state = keeper.restore(mode=mode, fresh_start_allowed=True)
    finally:
        keeper.close()
    return (None if state is None else state["train_state"]["step"]), said


def test_a_start_with_an_empty_disk_resumes_from_the_store(store, tmp_path):
    store.upload(snapshot_folder(tmp_path / "gone", 20), 20)
    step, said = restored(tmp_path / "new-disk", str(store.location))
    assert step == 20
    assert f"downloaded step-00000020 from {store.location}" in said
    assert (tmp_path / "new-disk" / "step-00000020").is_dir()


def test_the_newest_anywhere_wins_the_disk_when_newer(store, tmp_path):
    store.upload(snapshot_folder(tmp_path / "other", 20), 20)
    snapshot_folder(tmp_path / "here", 30)
    step, said = restored(tmp_path / "here", str(store.location))
    assert step == 30 and not any(line.startswith("downloaded") for line in said)


def test_a_corrupt_snapshot_in_the_store_falls_back_to_the_one_before_with_one_warning(store, tmp_path):
    for step in (10, 20):
        store.upload(snapshot_folder(tmp_path / "gone", step), step)
    upload = json.loads(store.client().get_object(Bucket=store.location.bucket, Key=store._key(20, COMMIT))["Body"].read())["upload"]
    store.client().delete_object(Bucket=store.location.bucket, Key=store._key(20, upload, "optimizer.safetensors"))
    step, said = restored(tmp_path / "new-disk", str(store.location))
    assert step == 10
    warnings = [line for line in said if line.startswith("warning:")]
    assert warnings == [f"warning: snapshot at step 20 in {store.location} is unusable (optimizer.safetensors is "
                        "missing); its commit removed from the store; trying the previous one"]
    assert store.committed() == [10]        # no later start downloads it again


def commit_as_it_is(store: ObjectStore, folder: Path, step: int) -> None:
    """Commit a folder's files as they are, unchecked, as uploads did before they were checked against
    their manifest: a snapshot damaged on its disk went up with a valid commit."""
    from app.training.snapshot_files import MANIFEST

    files = {}
    for path in folder.iterdir():
        files[path.name] = store._put_file(path, store._key(step, "unchecked", path.name), None)
    commit = {"step": step, "upload": "unchecked", "files": files}
    store.client().put_object(Bucket=store.location.bucket, Key=store._key(step, COMMIT), Body=json.dumps(commit))
    assert MANIFEST in files


def test_every_disk_lost_and_a_bad_newest_upload_resume_from_the_stores_older_good_one(store, tmp_path):
    """The start once took the first download that matched its commit, found it unusable, and fell back to
    the disks alone: a start from step 0 while good snapshots sat in the store."""
    from tests.test_snapshot import corrupt

    store.upload(snapshot_folder(tmp_path / "gone", 10), 10)
    damaged = snapshot_folder(tmp_path / "gone", 20)
    corrupt(damaged / "model.safetensors", "flip")
    commit_as_it_is(store, damaged, 20)
    step, said = restored(tmp_path / "new-disk", str(store.location))
    assert step == 10
    assert [line for line in said if line.startswith("warning:")] == [
        f"warning: snapshot at step 20 in {store.location} is unusable (model.safetensors does not match its "
        "manifest (truncated or corrupted)); set aside as unusable-step-00000020; its commit removed from the "
        "store; trying the previous one"]
    assert store.committed() == [10]


def test_a_corrupt_snapshot_on_the_disk_does_not_hide_the_stores_good_copy_of_the_same_step(store, tmp_path):
    """The store's listing was compared with the disk's unchecked: the store's good step 20 was passed over
    for the disk's damaged one, and the job resumed from step 10."""
    from tests.test_snapshot import corrupt

    store.upload(snapshot_folder(tmp_path / "other", 20), 20)
    snapshot_folder(tmp_path / "here", 10)
    corrupt(snapshot_folder(tmp_path / "here", 20) / "model.safetensors", "truncate")
    step, said = restored(tmp_path / "here", str(store.location))
    assert step == 20
    assert said.warnings == [f"warning: snapshot {tmp_path / 'here' / 'step-00000020'} is unusable (model.safetensors "
                             "does not match its manifest (truncated or corrupted)); set aside as "
                             "unusable-step-00000020; trying the previous one"]
    assert f"downloaded step-00000020 from {store.location}" in said


def test_the_newest_good_snapshot_wins_walking_back_over_bad_ones_in_both_places(store, tmp_path):
    from tests.test_snapshot import corrupt

    for step in (10, 30):
        store.upload(snapshot_folder(tmp_path / "other", step), step)
    store.client().put_object(Bucket=store.location.bucket, Key=store._key(30, COMMIT), Body=b"{not json")
    for step in (20, 40):
        snapshot_folder(tmp_path / "here", step)
    corrupt(tmp_path / "here" / "step-00000040" / "manifest.json", "empty")
    step, said = restored(tmp_path / "here", str(store.location))
    assert step == 20 and len(said.warnings) == 2       # the disk's 40, then the store's 30


class ReaderFault:
    """An error of the process reading a snapshot, not of the snapshot's bytes: safetensors cannot be
    imported, memory runs out, or the disk answers EIO as a part is read."""

    KINDS = ("import", "memory", "eio")

    def __init__(self, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
        import errno
        import sys

        self.kind = kind
        if kind == "import":
            monkeypatch.setitem(sys.modules, "safetensors.torch", None)
            self.named = "ModuleNotFoundError: import of safetensors.torch halted; None in sys.modules"
            return
        error = MemoryError() if kind == "memory" else OSError(errno.EIO, "Input/output error")
        self.named = "MemoryError" if kind == "memory" else "OSError: [Errno 5] Input/output error"
        real = Path.read_bytes

        def read_bytes(path: Path) -> bytes:
            if path.suffix == ".safetensors":
                raise error
            return real(path)

        monkeypatch.setattr(Path, "read_bytes", read_bytes)


@pytest.mark.parametrize("where", ["disk", "store"])
@pytest.mark.parametrize("kind", ReaderFault.KINDS)
def test_an_error_of_the_reader_is_one_error_and_costs_no_snapshot_here_or_in_the_store(store, tmp_path, monkeypatch,
                                                                                      kind, where):
    """read_snapshot took any exception for a damaged snapshot: a reader that could not read (safetensors
    missing, memory short, a failing disk) set every local snapshot aside, and each download failing the
    same way retired its commit: the walk went down every step, every commit gone, the job from step 0."""
    for step in (10, 20, 30):
        store.upload(snapshot_folder(tmp_path / "uploaded", step), step)
    disk = tmp_path / "disk"
    if where == "disk":
        for step in (10, 20, 30):
            snapshot_folder(disk, step)
    fault = ReaderFault(kind, monkeypatch)
    with pytest.raises(UserError) as caught:
        restored(disk, str(store.location))
    monkeypatch.undo()
    assert str(caught.value) == (f"cannot read snapshot {disk / 'step-00000030'} ({fault.named}): a fault of this "
                                 "process or its disk, not of the snapshot's bytes; no snapshot was set aside or "
                                 "removed, here or in the store")
    assert store.committed() == [30, 20, 10]
    expected = ["step-00000010", "step-00000020", "step-00000030"] if where == "disk" else ["step-00000030"]
    assert sorted(p.name for p in disk.iterdir() if not p.name.startswith(".")) == expected
    assert read_snapshot(disk / "step-00000030")["train_state"]["step"] == 30


def test_a_refusal_in_the_middle_of_a_download_is_its_own_error_not_the_readers(store, tmp_path, monkeypatch):
    store.upload(snapshot_folder(tmp_path / "uploaded", 10), 10)

    def refused(step: int, directory: Path) -> Path:
        raise UserError("--snapshot-url: GetObject refused by the object store (AccessDenied)")

    monkeypatch.setattr(ObjectStore, "download", lambda self, step, directory: refused(step, directory))
    with pytest.raises(UserError, match=r"^--snapshot-url: GetObject refused by the object store \(AccessDenied\)$"):
        restored(tmp_path / "disk", str(store.location))
    assert store.committed() == [10]


def test_a_fresh_start_into_a_prefix_that_holds_an_earlier_job_is_refused(store, tmp_path):
    store.upload(snapshot_folder(tmp_path / "earlier", 20), 20)
    snapshot_folder(tmp_path / "new", 10)
    with pytest.raises(UserError, match=r"--no-resume: s3://snapshots/run-\w+ holds an earlier job's snapshots "
                                        r"\(newest step 20\); give this job a --snapshot-url prefix of its own"):
        restored(tmp_path / "new", str(store.location), mode=False, job="job-b")
    assert [p.name for p in (tmp_path / "new").iterdir() if not p.name.startswith(".")] == ["step-00000010"]
    assert restored(tmp_path / "other", f"{store.location}-2", mode=False) == (None, ["starting fresh (--no-resume)"])


def test_no_resume_begins_a_job_once_and_its_node_on_a_new_disk_resumes_from_the_store(store, tmp_path):
    """A survivor mode's node is a launch of its own (restart count 0): one started again with --no-resume,
    or a spare, was refused ("holds an earlier run's snapshots", exit 2) by the prefix its own job filled."""
    assert restored(tmp_path / "first", str(store.location), mode=False, job="job-a") == (
        None, ["starting fresh (--no-resume)"])
    assert json.loads(store.client().get_object(Bucket=store.location.bucket, Key=f"{store.location.prefix}/job.json")
                      ["Body"].read())["job"] == "job-a"
    store.upload(snapshot_folder(tmp_path / "first", 20), 20)
    (tmp_path / "new-host").mkdir()
    snapshot_folder(tmp_path / "new-host" / "earlier", 5).rename(tmp_path / "new-host" / "step-00000005")
    step, said = restored(tmp_path / "new-host", str(store.location), mode=False, job="job-a")
    assert step == 20
    assert said[0].startswith("moved 1 earlier snapshots to ")       # this disk's were another job's
    assert said[1].startswith(f"--no-resume: job job-a began 20") and said[1].endswith(
        f"(its mark in {store.location}); this start of one of its nodes resumes it")
    assert store.committed() == [20]


def test_a_store_that_is_down_at_start_is_one_warning_and_the_disk_is_used(tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    snapshot_folder(tmp_path, 30)
    step, said = restored(tmp_path, "s3://snapshots/run")
    assert step == 30
    assert [line for line in said if line.startswith("warning:")] == [
        "warning: the object store cannot be reached (http://127.0.0.1:%s: EndpointConnectionError, %d tries): resuming "
        "from the snapshots on the nodes' disks only" % (os.environ["AWS_ENDPOINT_URL"].rsplit(":", 1)[1],
                                                         object_store.ATTEMPTS)]


def test_wrong_credentials_at_start_are_an_error(object_store, tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", object_store.endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", object_store.KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    with pytest.raises(UserError, match="refused the credentials"):
        restored(tmp_path, object_store.url("run"))


# ---------------------------------------------------------------- the trainer, end to end

FAST = ["--dataset", "digits", "--model", "tiny", "--progress", "lines", "--batch-size", "64"]


def test_a_run_whose_disk_is_lost_resumes_from_the_store_and_no_credential_is_written(object_store, tmp_path,
                                                                                      monkeypatch):
    from tests.helpers import clean_env, read_metrics, run_trainer

    url = object_store.url(f"run-{uuid.uuid4().hex[:8]}")
    env = clean_env(**object_store.env())
    first = run_trainer([*FAST, "--epochs", "2", "--run-dir", tmp_path / "a", "--snapshot-url", url], nproc=0, env=env)
    trained_to = read_metrics(tmp_path / "a", "snapshot")[-1]["step"]
    for key, value in object_store.env().items():
        monkeypatch.setenv(key, value)
    assert ObjectStore(url).committed()[0] == trained_to     # the last snapshot went up before the trainer left

    second = run_trainer([*FAST, "--epochs", "3", "--resume", "--run-dir", tmp_path / "b", "--snapshot-url", url],
                         nproc=0, env=env)
    assert f"downloaded step-{trained_to:08d} from {url}" in second.stdout
    assert read_metrics(tmp_path / "b", "start")[-1]["step"] == trained_to
    written = [first.stdout, first.stderr, second.stdout, second.stderr,
               *(p.read_text() for run in ("a", "b") for p in (tmp_path / run).glob("*.json*"))]
    assert not any(object_store.SECRET in text or object_store.KEY in text for text in written)


def test_the_trainer_refuses_wrong_credentials_at_start_with_one_line(object_store, tmp_path):
    from tests.helpers import clean_env, run_trainer

    env = clean_env(**object_store.env(AWS_SECRET_ACCESS_KEY="wrong-secret"))
    result = run_trainer([*FAST, "--epochs", "1", "--run-dir", tmp_path, "--snapshot-url", object_store.url("run")],
                         nproc=0, env=env, check=False)
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("error: --snapshot-url: the object store at ") and "wrong-secret" not in errors[0]


def test_a_store_that_is_down_costs_the_run_one_warning_at_start_and_one_from_the_saver(tmp_path):
    from tests.helpers import clean_env, read_metrics, run_trainer

    env = clean_env(AWS_ENDPOINT_URL=f"http://127.0.0.1:{free_port()}", AWS_ACCESS_KEY_ID="key",
                    AWS_SECRET_ACCESS_KEY="secret")
    result = run_trainer([*FAST, "--epochs", "2", "--run-dir", tmp_path, "--snapshot-url", "s3://snapshots/run"],
                         nproc=0, env=env)
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 2, result.stderr
    assert "resuming from the snapshots on the nodes' disks only" in warnings[0]
    assert "snapshots stay on this disk and go up when it is back" in warnings[1]
    newest_on_disk = max(int(p.name[len("step-"):]) for p in (tmp_path / "snapshots").glob("step-*"))
    assert read_metrics(tmp_path, "snapshot")[-1]["step"] == newest_on_disk


def test_a_store_that_answers_every_request_503_costs_a_resumed_run_warnings_only(failing, tmp_path):
    """503 SlowDown at the start's listing was `error: ... refused by the object store (SlowDown)`, exit 2."""
    from tests.helpers import clean_env, read_metrics, run_trainer

    run_trainer([*FAST, "--epochs", "1", "--run-dir", tmp_path], nproc=0)
    trained_to = read_metrics(tmp_path, "snapshot")[-1]["step"]
    env = clean_env(**failing.env(), AWS_MAX_ATTEMPTS="2")
    result = run_trainer([*FAST, "--epochs", "2", "--run-dir", tmp_path, "--snapshot-url", "s3://snapshots/run"],
                         nproc=0, env=env)
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert warnings[:2] == [
        f"warning: the object store cannot be reached ({failing.endpoint}: ListObjectsV2 answered 503 SlowDown, "
        "2 tries): resuming from the snapshots on the nodes' disks only",
        f"warning: the object store cannot be reached ({failing.endpoint}: HeadObject answered 503, 2 tries); "
        "snapshots stay on this disk and go up when it is back"], result.stderr
    assert "Traceback" not in result.stderr and "error:" not in result.stderr
    assert f"resuming from {tmp_path / 'snapshots' / f'step-{trained_to:08d}'}" in result.stdout
    assert read_metrics(tmp_path, "start")[-1]["step"] == trained_to
    assert read_metrics(tmp_path, "eval")[-1]["epoch"] == 2


def test_a_client_given_the_variables_of_another_environment_uses_them_and_not_its_own(object_store, monkeypatch, tmp_path):
    for key in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(key, raising=False)
    url = object_store.url(f"run-{uuid.uuid4().hex[:8]}")
    store = ObjectStore(url, environ=object_store.env())
    assert store.upload(snapshot_folder(tmp_path, 5), 5) and store.committed() == [5]


# ---------------------------------------------------------------- no stranger gets in

# What a client sends first: an HTTP request (the master's /dir/assign hands out a signed write
# token), and HTTP/2's opening with an empty SETTINGS frame (every gRPC client's, `weed shell`'s too).
S3_ANONYMOUS = (b"GET /snapshots/ HTTP/1.1\r\nHost: store\r\n\r\n",
                b"PUT /snapshots/stranger HTTP/1.1\r\nHost: store\r\nContent-Length: 5\r\n\r\nbytes")
HTTP_REQUEST = {"master": b"GET /dir/assign HTTP/1.1\r\nHost: store\r\n\r\n",
                "volume": b"GET /status HTTP/1.1\r\nHost: store\r\n\r\n",
                "filer": b"GET /buckets/snapshots/ HTTP/1.1\r\nHost: store\r\n\r\n",
                "admin": b"GET / HTTP/1.1\r\nHost: store\r\n\r\n"}
GRPC_OPENING = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes.fromhex("000000040000000000")


def first_reply(port: int, request: bytes, identity: tuple[Path, Path] | None, tls: bool = True) -> bytes:
    """The first bytes the server on `port` answers `request` with, in plain TCP or over TLS presenting
    `identity` (certificate, key) or no certificate; b"" when it closes the connection or refuses the
    handshake."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as connection:
            if tls:
                context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
                context.check_hostname, context.verify_mode = False, ssl.CERT_NONE   # a client that trusts any server
                context.set_alpn_protocols(["h2"] if request == GRPC_OPENING else ["http/1.1"])
                if identity:
                    context.load_cert_chain(*identity)
                connection = context.wrap_socket(connection)
            connection.sendall(request)
            return connection.recv(64)
    except (ssl.SSLError, ConnectionError):
        return b""


def answered(reply: bytes, request: bytes) -> bool:
    """`reply` is the server's answer to `request`: an HTTP/1.1 response (an HTTPS server's refusal of
    plain HTTP is an HTTP/1.0 400), or HTTP/2's SETTINGS frame."""
    return reply[3:4] == b"\x04" if request == GRPC_OPENING else reply.startswith(b"HTTP/1.1 ")


@pytest.mark.parametrize("server", SERVERS)
def test_no_port_of_the_store_answers_a_client_without_the_jobs_credentials(server, object_store, tmp_path):
    """A stranger's `weed shell` listed and deleted snapshots through the filer's gRPC port, and the
    master handed a stranger a signed write token (/dir/assign) over plain HTTP. Now every port but
    S3's speaks only TLS to a client presenting this start's certificate (app/cluster/object_server.py):
    plain TCP, no certificate, and a certificate made the same way but not the job's are refused; the
    job's own gets an answer. S3 refuses a request that does not carry the job's identity."""
    http = ports(object_store.port)[server]
    stranger = tmp_path / "stranger.crt", tmp_path / "stranger.key"
    key, cert = certificate("127.0.0.1")
    stranger[0].write_text(cert)
    stranger[1].write_text(key)
    if server == "s3":      # S3's HTTP port: its identity is the check
        for request in S3_ANONYMOUS:
            assert first_reply(http, request, None, tls=False).startswith(b"HTTP/1.1 403 ")
        probes = {}
    else:
        probes = {f"{server}'s HTTP port {http}": (http, HTTP_REQUEST[server])}
    probes[f"{server}'s gRPC port {http + GRPC_OFFSET}"] = (http + GRPC_OFFSET, GRPC_OPENING)
    job = object_store.directory / CERT, object_store.directory / KEY
    for name, (port, request) in probes.items():
        assert not answered(first_reply(port, request, None, tls=False), request), f"{name} answers in plain TCP"
        assert not answered(first_reply(port, request, None), request), f"{name} answers TLS without a certificate"
        assert not answered(first_reply(port, request, stranger), request), f"{name} answers a stranger's certificate"
        assert answered(first_reply(port, request, job), request), f"{name} does not answer the job's certificate"


def listening(pid: int) -> set[int]:
    """The TCP ports process `pid` listens on, from Linux's /proc."""
    sockets = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            sockets.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:     # closed meanwhile
            continue
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and f"socket:[{fields[9]}]" in sockets:     # 0A: LISTEN
                found.add(int(fields[1].rsplit(":", 1)[1], 16))
    return found


def test_the_store_listens_on_its_ten_ports_and_no_other(object_store):
    """What the test above probes is all there is: no port of a service left on or added by a new
    version of weed (metrics, debug, WebDAV, a catalogue) escapes it."""
    expected = {port + offset for port in ports(object_store.port).values() for offset in (0, GRPC_OFFSET)}
    assert listening(object_store.process.pid) == expected
