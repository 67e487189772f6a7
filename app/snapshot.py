"""Complete, atomic, rotating snapshots; only global rank 0 touches the snapshot directory.

Layout (one folder per snapshot, named parts as in torchtitan):

    <snapshot-dir>/step-00000300/{model,optimizer,scheduler,scaler,train_state}.pt
    <snapshot-dir>/step-00000300/manifest.json     # written last: size and sha256 of every part

A snapshot is written under a temporary name (`.tmp-step-...`), every file and the folder are
fsynced, and only then is it renamed to `step-N`: a kill at any moment leaves either the
complete snapshot or a temporary folder that the next start removes, never a partial file under
a final name. On load, rank 0 takes the newest snapshot whose parts match their manifest and
load with `weights_only=True`, falls back to older ones with one line each, and broadcasts the
state to every rank, so nodes that cannot see this directory resume too. `Snapshots.due` is the one
place that decides when a snapshot is taken.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch

from app.distributed import World
from app.config import Config
from app.errors import UserError

PARTS = ("model", "optimizer", "scheduler", "scaler", "train_state")
MANIFEST = "manifest.json"
PREFIX, TMP_PREFIX = "step-", ".tmp-step-"

State = dict[str, Any]


class SnapshotInvalid(Exception):
    """A snapshot on disk that cannot be used (truncated, corrupt, incomplete)."""


def to_cpu(obj: Any) -> Any:
    """A deep CPU copy of a state tree, so a background write never sees tensors change under it."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: Path, payload: bytes) -> None:
    with open(path, "wb") as f:
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())


def write_snapshot(directory: Path, step: int, parts: State) -> Path:
    """Write one complete snapshot atomically; returns its final path."""
    final = directory / f"{PREFIX}{step:08d}"
    if final.exists():
        return final
    tmp = directory / f"{TMP_PREFIX}{step:08d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    manifest: dict[str, Any] = {"step": step, "created": time.time(), "torch": torch.__version__, "parts": {}}
    for name in PARTS:
        buf = io.BytesIO()
        torch.save(parts[name], buf)
        payload = buf.getvalue()
        _write_file(tmp / f"{name}.pt", payload)
        manifest["parts"][name] = {"bytes": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}
    _write_file(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
    _fsync_dir(tmp)
    os.rename(tmp, final)
    _fsync_dir(directory)
    return final


def read_snapshot(path: Path) -> State:
    """All parts of one snapshot, checked against its manifest; raises SnapshotInvalid."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        parts = {}
        for name in PARTS:
            payload = (path / f"{name}.pt").read_bytes()
            expected = manifest["parts"][name]
            if len(payload) != expected["bytes"] or hashlib.sha256(payload).hexdigest() != expected["sha256"]:
                raise SnapshotInvalid(f"{name}.pt does not match its manifest (truncated or corrupted)")
            parts[name] = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
        return parts
    except SnapshotInvalid:
        raise
    except Exception as exc:  # any unreadable file, bad JSON, missing key or unpickling refusal
        raise SnapshotInvalid(f"{type(exc).__name__}: {exc}") from None


def complete_snapshots(directory: Path) -> list[Path]:
    """Complete snapshots, newest first. Only renamed (finished) folders count."""
    found = [p for p in directory.glob(f"{PREFIX}*") if p.is_dir() and p.name[len(PREFIX):].isdigit()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX):]), reverse=True)


class Snapshots:
    """The snapshots of one run: when one is due, writing them (rank 0, in a background thread),
    and restoring the newest valid one on every rank (read by rank 0, broadcast)."""

    def __init__(self, cfg: Config, world: World, say: Callable[[str], None]) -> None:
        self.directory, self.keep, self.world, self.say = cfg.snapshot_dir, cfg.keep, world, say
        self.every_steps, self.every_seconds = cfg.save_every_steps, cfg.save_every_seconds
        self.timer_check_every = cfg.log_every_steps
        self._writer: threading.Thread | None = None
        self._failure: str | None = None
        self._last_save = time.monotonic()
        self.last_write_s = 0.0

    # ------------------------------------------------------------ when

    def due(self, step: int, *, epoch_end: bool = False, stopping: bool = False) -> str | None:
        """Why a snapshot is due at this step boundary, or None.

        Every rank calls this at the same boundaries and gets the same answer (the timer is rank 0's
        clock, shared by one small all-reduce every --log-every-steps).
        """
        if stopping:
            return "stop"
        if epoch_end:
            return "epoch"
        if self.every_steps and step % self.every_steps == 0:
            return "interval"
        if self.every_seconds and step % self.timer_check_every == 0 and self._timer_expired():
            return "timer"
        return None

    def _timer_expired(self) -> bool:
        expired = self.world.is_main and self.every_seconds <= time.monotonic() - self._last_save
        return self.world.all_reduce_sum([float(expired)])[0] > 0

    # ------------------------------------------------------------ restore

    def restore(self, mode: bool | None, fresh_start_allowed: bool) -> State | None:
        """The newest valid snapshot's parts on every rank, or None for a fresh start.

        mode: True requires a snapshot, False starts fresh, None resumes when one exists.
        Rank 0 decides; errors are broadcast so that every rank fails with the same line.
        """
        payload: dict[str, Any] = {}
        if self.world.is_main:
            try:
                payload["state"] = self._restore_on_master(mode, fresh_start_allowed)
            except UserError as exc:
                payload["error"] = str(exc)
        payload = self.world.broadcast_object(payload)
        if "error" in payload:
            raise UserError(payload["error"])
        return payload["state"]

    def _restore_on_master(self, mode: bool | None, fresh_start_allowed: bool) -> State | None:
        self._prepare_directory()
        if mode is False and fresh_start_allowed:
            self._archive_existing()
            self.say("starting fresh (--no-resume)")
            return None
        for path in complete_snapshots(self.directory):
            try:
                state = read_snapshot(path)
            except SnapshotInvalid as exc:
                self.say(f"warning: snapshot {path} is unusable ({exc}); trying the previous one")
                continue
            self.say(f"resuming from {path}")
            return state
        if mode is True:
            raise UserError(f"--resume given but no valid snapshot in {self.directory}")
        self.say(f"no snapshot in {self.directory}: starting fresh")
        return None

    def _prepare_directory(self) -> None:
        d = self.directory
        if d.exists() and not d.is_dir():
            raise UserError(f"snapshot directory {d} is not a directory")
        try:
            d.mkdir(parents=True, exist_ok=True)   # rank 0 alone: no race with other processes
        except OSError as exc:
            raise UserError(f"cannot create snapshot directory {d}: {exc.strerror}") from None
        if not os.access(d, os.R_OK | os.W_OK | os.X_OK):
            raise UserError(f"snapshot directory {d} is not readable and writable by this user (uid {os.getuid()})")
        for stale in d.glob(f"{TMP_PREFIX}*"):   # left by a save that was killed midway
            shutil.rmtree(stale, ignore_errors=True)

    def _archive_existing(self) -> None:
        """--no-resume never deletes: old snapshots move to a dated folder out of rotation."""
        existing = complete_snapshots(self.directory)
        if existing:
            archive = self.directory / time.strftime("archive-%Y%m%d-%H%M%S")
            archive.mkdir()
            for path in existing:
                path.rename(archive / path.name)
            self.say(f"moved {len(existing)} earlier snapshots to {archive}")

    # ------------------------------------------------------------ save

    def save(self, step: int, parts: State, background: bool = True) -> float:
        """Hand a snapshot to the writer (rank 0 only); returns seconds the caller was held up."""
        start = time.perf_counter()
        self.wait()                       # one write in flight at a time
        parts = to_cpu(parts)
        self._last_save = time.monotonic()
        if background:
            self._writer = threading.Thread(target=self._write, args=(step, parts), name="snapshot-writer")
            self._writer.start()
        else:
            self._write(step, parts)
        return time.perf_counter() - start

    def wait(self) -> None:
        """Block until the write in flight (if any) is on disk."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None

    def raise_if_failed(self) -> None:
        if self._failure:
            raise UserError(f"the last snapshot could not be written: {self._failure}")

    def _write(self, step: int, parts: State) -> None:
        if threading.current_thread() is not threading.main_thread():
            # Serialising, hashing and fsyncing compete with the training threads for the cores (on a
            # 2-core host the bench lost ~8% to it): run below them. Linux applies this per thread.
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        start = time.perf_counter()
        try:
            write_snapshot(self.directory, step, parts)
            self._prune()
            self._failure = None
        except OSError as exc:
            # Keep training: the older snapshots are intact, and the next save tries again.
            self._failure = f"{self.directory}: {exc.strerror or exc}"
            self.say(f"warning: snapshot at step {step} failed ({self._failure}); earlier snapshots are kept")
        self.last_write_s = time.perf_counter() - start

    def _prune(self) -> None:
        for old in complete_snapshots(self.directory)[self.keep:]:
            # Rename first so that a kill during the removal never leaves a half-deleted `step-N`.
            doomed = old.with_name(f"{TMP_PREFIX}{old.name}-deleting")
            old.rename(doomed)
            shutil.rmtree(doomed, ignore_errors=True)
