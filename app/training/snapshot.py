"""Complete, atomic, rotating snapshots; who reads and writes them is config.SNAPSHOT_RULE.

Layout (one folder per snapshot, one file per part of app/training/state.py's TrainingState, as in torchtitan):

    <snapshot-dir>/step-00000300/{model,optimizer,scheduler,scaler,train_state}.pt
    <snapshot-dir>/step-00000300/manifest.json     # written last: size and sha256 of every part

A snapshot is written under a temporary name (`.tmp-step-...`), every file and the folder are
fsynced, and only then is it renamed to `step-N`: a kill at any moment leaves either the
complete snapshot or a temporary folder that the next start removes, never a partial file under
a final name. On load, each node takes its newest snapshot whose parts match their manifest and
load with `weights_only=True`, falling back to older ones with one warning each; the newest of
all nodes is broadcast to every rank, so nodes that lack it resume too (Snapshots.restore).
`Snapshots.due` is the one place that decides when a snapshot is taken.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

import torch

from app.cluster.distributed import World
from app.core.config import Config
from app.core.errors import UserError
from app.training.state import PARTS, State

MANIFEST = "manifest.json"
DIRECTORY_ID = ".directory-id"
PREFIX, TMP_PREFIX = "step-", ".tmp-step-"
UNUSABLE_PREFIX = "unusable-"     # a snapshot that failed its check at restore, kept out of rotation
CLAIM_PREFIX = ".claim-step-"     # who writes a just-in-time snapshot (Snapshots.claim)


class SnapshotInvalid(Exception):
    """A snapshot on disk that cannot be used (truncated, corrupt, incomplete)."""


def to_cpu(obj: Any) -> Any:
    """A deep CPU copy of a state tree, so a background write never sees tensors change under it."""
    return map_tensors(obj, lambda t: t.detach().to("cpu", copy=True))


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """The same tree with fn applied to every tensor in it."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(v, fn) for v in obj)
    return obj


class HostCopier:
    """Copies a state tree to host memory without stalling the training for the PCIe transfer.

    On CUDA every GPU tensor is first cloned on the device, in the training stream (device bandwidth:
    well under a millisecond for a ResNet's state); a side stream then copies the clones into pinned
    host buffers, so neither the host thread nor the training stream waits for the transfer; the
    writer thread waits for the returned event before serialising. Pinned buffers are kept for the
    next save, which begins only after the previous write is done (Snapshots.save waits for it).
    Without CUDA it is to_cpu, as before.
    """

    def __init__(self) -> None:
        self._stream: Any = None
        self._pinned: dict[tuple, list[torch.Tensor]] = {}

    def copy(self, parts: State) -> tuple[State, Any]:
        """(the host tree, the CUDA event at which it is complete, or None when it already is)."""
        devices: set[torch.device] = set()
        map_tensors(parts, lambda t: devices.add(t.device) if t.is_cuda else None)
        if len(devices) != 1:           # CPU state (a restored snapshot), or none on this host
            return to_cpu(parts), None
        with torch.cuda.device(devices.pop()):      # the caller's thread may have another current device
            return self._copy(parts)

    def _copy(self, parts: State) -> tuple[State, Any]:
        clones = map_tensors(parts, lambda t: t.detach().clone() if t.is_cuda else t.detach().to("cpu", copy=True))
        self._stream = self._stream or torch.cuda.Stream()
        self._stream.wait_stream(torch.cuda.current_stream())       # the clones are made first
        used: dict[tuple, int] = {}

        def to_pinned(t: torch.Tensor) -> torch.Tensor:
            if not t.is_cuda:
                return t
            key = (tuple(t.shape), t.dtype)
            pool, n = self._pinned.setdefault(key, []), used.get(key, 0)
            if n == len(pool):
                pool.append(torch.empty(t.shape, dtype=t.dtype, pin_memory=True))
            used[key] = n + 1
            pool[n].copy_(t, non_blocking=True)
            t.record_stream(self._stream)       # the allocator keeps the clone until the copy is done
            return pool[n]

        with torch.cuda.stream(self._stream):
            host = map_tensors(clones, to_pinned)
        return host, self._stream.record_event()


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
    final = directory / _name(step)
    if final.exists():
        return final
    tmp = directory / f"{TMP_PREFIX}{step:08d}-{os.getpid()}-{threading.get_native_id()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        _write_parts(tmp, step, parts)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)   # a full disk gets its space back at once
        raise
    try:
        os.rename(tmp, final)
    except OSError:
        if not final.is_dir():
            raise
        shutil.rmtree(tmp, ignore_errors=True)   # another node wrote this step first: one writer wins
        return final
    _fsync_dir(directory)
    return final


def _write_parts(folder: Path, step: int, parts: State) -> None:
    manifest: dict[str, Any] = {"step": step, "created": time.time(), "torch": torch.__version__, "parts": {}}
    for name in PARTS:
        buf = io.BytesIO()
        torch.save(parts[name], buf)
        payload = buf.getvalue()
        _write_file(folder / f"{name}.pt", payload)
        manifest["parts"][name] = {"bytes": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}
    _write_file(folder / MANIFEST, json.dumps(manifest, indent=1).encode())
    _fsync_dir(folder)


def set_aside(path: Path) -> str:
    """Move an unusable snapshot out of rotation, keeping it for a look: a later save of the same
    step must not find its name taken, and no later start should read it again."""
    target = path.with_name(f"{UNUSABLE_PREFIX}{path.name}")
    if target.exists():     # an earlier start set aside the same step: keep both for the look
        target = target.with_name(f"{target.name}-{uuid.uuid4().hex[:8]}")
    try:
        path.rename(target)
    except FileNotFoundError:
        return "set aside by another node"
    except OSError as exc:
        return f"left in place ({exc.strerror})"
    return f"set aside as {target.name}"


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


def _name(step: int) -> str:
    return f"{PREFIX}{step:08d}"


def _directory_id(directory: Path, create: bool = True) -> str | None:
    """A name for this snapshot directory that is the same for every node that sees it (a shared
    disk) and different otherwise: a random id, created once, atomically, in the directory."""
    path = directory / DIRECTORY_ID
    if not create:
        return path.read_text().strip() if path.is_file() else None
    try:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return path.read_text().strip() or str(path)
        with os.fdopen(fd, "w") as f:
            f.write(uuid.uuid4().hex)
        return path.read_text().strip()
    except OSError as exc:     # e.g. /proc, /sys, a read-only mount: the check by mode bits passed
        raise UserError(f"cannot write to snapshot directory {directory}: {exc.strerror}") from None


@dataclass
class _Found:
    """What one node has in its snapshot directory."""
    step: int = -1
    state: State | None = None
    directory_id: str | None = None
    path: str | None = None
    lines: list[tuple[bool, str]] = field(default_factory=list)    # (a warning?, the line) for rank 0 to say
    error: str | None = None


def complete_snapshots(directory: Path) -> list[Path]:
    """Complete snapshots, newest first. Only renamed (finished) folders count."""
    found = [p for p in directory.glob(f"{PREFIX}*") if p.is_dir() and p.name[len(PREFIX):].isdigit()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX):]), reverse=True)


class Snapshots:
    """The snapshots of one run: when one is due, writing them (in a background thread), and
    restoring the newest valid one on every rank; which rank does what is config.SNAPSHOT_RULE."""

    def __init__(self, cfg: Config, world: World, say: Callable[[str], None], warn: Callable[[str], None]) -> None:
        self.directory, self.keep, self.world, self.say, self.warn = cfg.snapshot_dir, cfg.keep, world, say, warn
        self.every_steps, self.every_seconds = cfg.save_every_steps, cfg.save_every_seconds
        self._write_thread: threading.Thread | None = None
        self._host_copier = HostCopier()
        self._failure: str | None = None
        self._last_save = time.monotonic()
        self.last_write_s = 0.0
        self.first_in_directory = world.is_main     # settled by restore(): the first rank of this directory
        self.shares_with_main = False    # settled by restore(): this rank's directory is rank 0's

    # ------------------------------------------------------------ when

    def due(self, step: int, *, timer: bool = False, epoch_end: bool = False, stopping: bool = False) -> str | None:
        """Why a snapshot is due at this step boundary, or None.

        Every rank calls this at the same boundaries with the same arguments and gets the same answer:
        `timer` is the agreed timer_vote() (rank 0's clock), which rides on the log row's all-reduce.
        """
        if stopping:
            return "stop"
        if epoch_end:
            return "epoch"
        if self.every_steps and step % self.every_steps == 0:
            return "interval"
        return "timer" if timer else None

    def timer_vote(self) -> float:
        """1.0 on rank 0 when --save-every-seconds have passed since the last save, else 0.0: summed
        over the ranks with the loss at a log step, it is the timer's one decision for all of them."""
        return float(self.world.is_main and 0 < self.every_seconds <= time.monotonic() - self._last_save)

    # ------------------------------------------------------------ restore

    def restore(self, mode: bool | None, fresh_start_allowed: bool, trained_to: int | None = None) -> State | None:
        """The newest valid snapshot anywhere in the job, on every rank, or None for a fresh start.

        Nodes need not share a disk: every node's local rank 0 looks in its own snapshot directory,
        the newest step found anywhere wins, one node that has it reads it and broadcasts it, and
        directories that lacked it get a copy, so no node holds the only one. A node that was away
        can therefore never pull the job back to an older state.
        mode: True requires a snapshot, False starts fresh, None resumes when one exists.
        trained_to: the last step this run directory's metrics show, to say loudly what a fresh
        start would lose.
        """
        mine = self._look(mode, fresh_start_allowed) if self.world.local_rank == 0 else _Found()
        if mine.directory_id is None and mine.error is None:   # the node's other ranks see the same one
            mine.directory_id = _directory_id(self.directory, create=False)
        found = self.world.gather_object((mine.step, mine.directory_id, mine.lines, mine.error, mine.path))
        for rank, (_, _, lines, _, _) in enumerate(found):
            for is_warning, line in lines:
                (self.warn if is_warning else self.say)(line if rank == 0 else f"[rank {rank}] {line}")
        errors = [error for *_, error, _ in found if error]
        if errors:
            raise UserError(errors[0])
        first_rank_of = {}
        for rank, (_, directory_id, *_) in enumerate(found):
            first_rank_of.setdefault(directory_id, rank)
        self.first_in_directory = self.world.local_rank == 0 and first_rank_of.get(mine.directory_id) == self.world.rank
        self.shares_with_main = mine.directory_id is not None and mine.directory_id == found[0][1]
        best = max(step for step, *_ in found)
        if best < 0:
            return self._fresh_start(mode, fresh_start_allowed, trained_to)
        source = min(rank for rank, (step, *_) in enumerate(found) if step == best)
        state = self.world.broadcast_object(mine.state if self.world.rank == source else None, src=source)
        self.say(f"resuming from {found[source][4]}" + (f" (read on rank {source}'s node)" if source else ""))
        if self.first_in_directory and mine.step < best and not (self.directory / _name(best)).exists():
            self.save(best, state)      # a copy here too
        return state

    def _look(self, mode: bool | None, fresh_start_allowed: bool) -> _Found:
        """This node's newest valid snapshot (local rank 0 only)."""
        found = _Found()
        try:
            self._prepare_directory()
            found.directory_id = _directory_id(self.directory)
        except UserError as exc:
            found.error = str(exc)
            return found
        if mode is False and fresh_start_allowed:
            found.lines += self._archive_existing()
            return found
        for path in complete_snapshots(self.directory):
            try:
                found.state = read_snapshot(path)
            except SnapshotInvalid as exc:
                found.lines.append((True, f"snapshot {path} is unusable ({exc}); {set_aside(path)}; "
                                          "trying the previous one"))
                continue
            found.step, found.path = int(path.name[len(PREFIX):]), str(path)
            break
        return found

    def _fresh_start(self, mode: bool | None, fresh_start_allowed: bool, trained_to: int | None) -> None:
        if mode is True:
            raise UserError(f"--resume given but no valid snapshot in {self.directory} or on any other node")
        if mode is False and fresh_start_allowed:
            self.say("starting fresh (--no-resume)")
        elif trained_to or not fresh_start_allowed:
            self.warn(f"no valid snapshot on any node, but this job has trained before (to step "
                      f"{trained_to or '?'}): starting again from step 0, {trained_to or 'all'} steps lost")
        else:
            self.say(f"no snapshot in {self.directory} or on any other node: starting fresh")
        return None

    def _prepare_directory(self) -> None:
        d = self.directory
        if d.exists() and not d.is_dir():
            raise UserError(f"snapshot directory {d} is not a directory")
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UserError(f"cannot create snapshot directory {d}: {exc.strerror}") from None
        if not os.access(d, os.R_OK | os.W_OK | os.X_OK):
            raise UserError(f"snapshot directory {d} is not readable and writable by this user (uid {os.getuid()})")
        for stale in d.glob(f"{TMP_PREFIX}*"):   # left by a save that was killed midway
            shutil.rmtree(stale, ignore_errors=True)
        for claim in d.glob(f"{CLAIM_PREFIX}*"):  # the last incarnation's, all of whose ranks are gone
            claim.unlink(missing_ok=True)

    def _archive_existing(self) -> list[tuple[bool, str]]:
        """--no-resume never deletes: old snapshots move to a dated folder out of rotation."""
        existing = complete_snapshots(self.directory)
        if not existing:
            return []
        archive = self.directory / time.strftime("archive-%Y%m%d-%H%M%S")
        archive.mkdir(exist_ok=True)
        for path in existing:
            path.rename(archive / path.name)
        return [(False, f"moved {len(existing)} earlier snapshots to {archive}")]

    # ------------------------------------------------------------ save

    def save(self, step: int, parts: State, background: bool = True) -> float:
        """Hand a snapshot to the writer thread (the directory's Writer only); returns seconds the caller was held up."""
        start = time.perf_counter()
        self.wait()                       # one write in flight at a time
        # The just-in-time save on a fault copies the plain way: nothing is left in flight at exit.
        parts, copied = self._host_copier.copy(parts) if background else (to_cpu(parts), None)
        self._last_save = time.monotonic()
        if background:
            self._write_thread = threading.Thread(target=self._write, args=(step, parts, copied), name="snapshot-writer")
            self._write_thread.start()
        else:
            self._write(step, parts, copied)
        return time.perf_counter() - start

    def claim(self, step: int, rank0_first_s: float) -> bool:
        """Be the one rank that writes a just-in-time snapshot of `step` into this directory.

        Survivors cannot agree through collectives (a peer is gone), so they agree through the
        directory itself: creating the claim file is atomic, and only its creator writes. Rank 0's
        copy is the exact one (batch-norm statistics are each rank's own until DDP's next broadcast),
        so in rank 0's directory the others give it rank0_first_s (the fault policy's RANK0_FIRST) to
        claim first.
        """
        claim = self.directory / f"{CLAIM_PREFIX}{step:08d}"
        if self.shares_with_main and not self.world.is_main:
            deadline = time.monotonic() + rank0_first_s
            while time.monotonic() < deadline and not claim.exists():
                time.sleep(0.02)
        if (self.directory / _name(step)).exists():
            return False
        try:
            os.close(os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return False
        except OSError:
            return True     # no claim possible here (read-only, gone): try the write, which says why
        return True

    def wait(self) -> None:
        """Block until the write in flight (if any) is on disk."""
        if self._write_thread is not None:
            self._write_thread.join()
            self._write_thread = None

    def raise_if_failed(self) -> None:
        if self._failure:
            raise UserError(f"the last snapshot could not be written: {self._failure}")

    def _write(self, step: int, parts: State, copied: Any = None) -> None:
        if threading.current_thread() is not threading.main_thread():
            # Serialising, hashing and fsyncing compete with the training threads for the cores (on a
            # 2-core host the bench lost ~8% to it): run below them. Linux applies this per thread.
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        start = time.perf_counter()
        if copied is not None:
            copied.synchronize()          # the side stream's copy to host memory is complete
        try:
            write_snapshot(self.directory, step, parts)
            self._prune()
            self._failure = None
        except OSError as exc:
            # Keep training: the older snapshots are intact, and the next save tries again.
            self._failure = f"{self.directory}: {exc.strerror or exc}"
            self.warn(f"snapshot at step {step} failed ({self._failure}); earlier snapshots are kept")
        self.last_write_s = time.perf_counter() - start

    def _prune(self) -> None:
        for old in complete_snapshots(self.directory)[self.keep:]:
            # Rename first so that a kill during the removal never leaves a half-deleted `step-N`.
            doomed = old.with_name(f"{TMP_PREFIX}{old.name}-deleting")
            old.rename(doomed)
            shutil.rmtree(doomed, ignore_errors=True)


class Writer(Protocol):
    """Who writes a directory that several processes share (its snapshots, the run directory's metrics
    rows), chosen once, when the trainer is made: FirstRanks in elastic mode; in the survivor modes
    their membership, by a lease that a hung writer loses (app/ft/writer.py)."""

    def writes(self, directory: Path) -> bool: ...


class FirstRanks:
    """Elastic mode's Writer, config.SNAPSHOT_RULE: the first rank of each distinct snapshot directory
    writes its snapshots (Snapshots.restore finds out which), global rank 0 the metrics rows."""

    def __init__(self, snapshots: Snapshots) -> None:
        self.snapshots = snapshots

    def writes(self, directory: Path) -> bool:
        if directory == self.snapshots.directory:
            return self.snapshots.first_in_directory
        return self.snapshots.world.is_main
