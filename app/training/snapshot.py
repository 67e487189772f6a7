"""Complete, atomic, rotating snapshots; who reads and writes them is config.SNAPSHOT_RULE.

A snapshot is a `step-N` folder of safetensors parts, one per part of app/training/state.py's
TrainingState, and a manifest written last (app/training/snapshot_files.py has the layout, the
format, and how a write stays atomic through any kill). The training process only copies its
state into shared memory (an Arena, pinned on CUDA, the device copy made on a side stream); the
snapshot saver, a process of its own (app/training/saver.py), serialises, hashes, writes, fsyncs,
renames and prunes, so the training thread never waits for a write nor shares its interpreter
lock with one. On load, each node takes its newest snapshot whose parts match their manifest,
falling back to older ones with one warning each; nothing read runs code (safetensors and JSON;
the .pt parts of snapshots written before are unpickled with `weights_only=True`). The newest of
all nodes is broadcast to every rank, so nodes that lack it resume too (Snapshots.restore).
`Snapshots.due` is the one place that decides when a snapshot is taken.
"""
from __future__ import annotations

import fcntl
import hashlib
import io
import itertools
import json
import mmap
import os
import pickle
import struct
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol

import torch

from app.cluster.distributed import World
from app.core.config import Config
from app.core.errors import UserError
from app.training.saver import Saver, SaverDied
# PREFIX and TMP_PREFIX are read from here too (the chaos runner, the tests): a snapshot's names.
from app.training.snapshot_files import (FORMAT, MANIFEST, PAIRS, PREFIX, SUFFIX, TENSOR, TMP_PREFIX, TUPLE,
                                         complete_snapshots, name_of, read_tree, remove_stale, step_of_name,
                                         write_folder)
from app.training.state import PARTS, State

DIRECTORY_ID = ".directory-id"
JOB_MARK = ".job-begun"         # the job whose snapshots these are: written by its start with --no-resume
UNUSABLE_PREFIX = "unusable-"     # a snapshot that failed its check at restore, kept out of rotation
CLAIM_PREFIX = ".claim-step-"     # who writes a just-in-time snapshot (Snapshots.claim)
_ARENA_SERIALS = itertools.count(1)     # Arena.serial
# The most the ranks wait for one another's look at the snapshots at a start (a read on every node;
# on rank 0, the object store: a download of any size, a store that answers slowly, its retries).
# A rank that died meanwhile is its launcher's to notice; this bounds only a look that hangs.
LOOK_BOUND_S = 1800.0
DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


class SnapshotInvalid(Exception):
    """A snapshot on disk that cannot be used (truncated, corrupt, incomplete)."""


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """The same tree with fn applied to every tensor in it."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(v, fn) for v in obj)
    return obj


# ------------------------------------------------------------------ a state as trees and tensors

def flatten(parts: State) -> tuple[dict[str, Any], list[tuple[str, str, torch.Tensor]]]:
    """Each part's tree as JSON, every tensor in it replaced by {"$tensor": its name}, and the tensors
    as (part, name, tensor). A tuple and a dict with keys other than plain strings (the optimizer's
    state is keyed by parameter index) are marked, so they come back as they were."""
    tensors: list[tuple[str, str, torch.Tensor]] = []
    trees = {}
    for part, tree in parts.items():
        names: set[str] = set()

        def encode(obj: Any, path: str) -> Any:
            if isinstance(obj, torch.Tensor):
                name = path if path not in names else f"{path}#{len(names)}"
                names.add(name)
                tensors.append((part, name, obj))
                return {TENSOR: name}
            if isinstance(obj, dict):
                if all(isinstance(k, str) and not k.startswith("$") for k in obj):
                    return {k: encode(v, f"{path}.{k}" if path else k) for k, v in obj.items()}
                return {PAIRS: [[k, encode(v, f"{path}.{k}" if path else str(k))] for k, v in obj.items()]}
            if isinstance(obj, tuple):
                return {TUPLE: [encode(v, f"{path}.{i}") for i, v in enumerate(obj)]}
            if isinstance(obj, list):
                return [encode(v, f"{path}.{i}") for i, v in enumerate(obj)]
            if obj is None or isinstance(obj, (bool, int, float, str)):
                return obj
            raise TypeError(f"a snapshot holds tensors and JSON values; {part}:{path} is a {type(obj).__name__}")

        trees[part] = encode(tree, "")
    return trees, tensors


def unflatten(tree: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """flatten's inverse for one part."""
    if isinstance(tree, list):
        return [unflatten(v, tensors) for v in tree]
    if not isinstance(tree, dict):
        return tree
    if TENSOR in tree:
        return tensors[tree[TENSOR]]
    if TUPLE in tree:
        return tuple(unflatten(v, tensors) for v in tree[TUPLE])
    if PAIRS in tree:
        return {k: unflatten(v, tensors) for k, v in tree[PAIRS]}
    return {k: unflatten(v, tensors) for k, v in tree.items()}


# ------------------------------------------------------------------ the arena

class Arena:
    """The host copy of a state's tensors, in shared memory (a memfd) that the saver maps too.

    Laid out once for the state's tensors (shapes and dtypes) and reused for every save while they
    stay the same; the next save begins only after the saver has written the previous one
    (Snapshots.save waits for it). On CUDA the memory is pinned, and a copy never stalls the
    training: every GPU tensor is first cloned on the device in the training stream (device
    bandwidth: well under a millisecond for a ResNet's state); a side stream then copies the clones
    into the arena, and the returned event says when it is complete.
    """

    ALIGN = 64

    def __init__(self, layout: list[tuple[torch.dtype, tuple[int, ...]]]) -> None:
        self.layout = layout
        self.offsets, end = [], 0
        for dtype, shape in layout:
            self.offsets.append(end)
            end += -(-_nbytes(dtype, shape) // self.ALIGN) * self.ALIGN
        self.nbytes = max(end, self.ALIGN)
        self.serial = next(_ARENA_SERIALS)
        self.fd = os.memfd_create("snapshot-arena")
        os.ftruncate(self.fd, self.nbytes)
        # Its pages are made now (MAP_POPULATE), not by the first copy into it: that took 40 ms of a
        # ResNet-18's 85 MB state on this project's CPU machine (8 ms once made), in the first save's stall.
        self._map = mmap.mmap(self.fd, self.nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        self._flat = torch.frombuffer(self._map, dtype=torch.uint8)
        self.slots = [self._flat[o:o + _nbytes(d, s)].view(d).view(s) for o, (d, s) in zip(self.offsets, layout)]
        self._pinned = torch.cuda.is_available() and _register(self._flat)
        self._stream: Any = None

    def fill(self, tensors: list[torch.Tensor]) -> torch.cuda.Event | None:
        """Copy the tensors into their slots; the CUDA event at which the copy is complete, or None."""
        on_gpu = [(slot, t) for slot, t in zip(self.slots, tensors) if t.is_cuda]
        for slot, t in zip(self.slots, tensors):
            if not t.is_cuda:
                slot.copy_(t.detach())
        if not on_gpu:
            return None
        with torch.cuda.device(on_gpu[0][1].device):    # the caller's thread may have another current device
            clones = [(slot, t.detach().clone()) for slot, t in on_gpu]
            self._stream = self._stream or torch.cuda.Stream()
            self._stream.wait_stream(torch.cuda.current_stream())      # the clones are made first
            with torch.cuda.stream(self._stream):
                for slot, clone in clones:
                    slot.copy_(clone, non_blocking=self._pinned)
                    clone.record_stream(self._stream)   # the allocator keeps the clone until the copy is done
            return self._stream.record_event()

    def view(self) -> memoryview:
        """The whole arena as bytes, as the saver maps it."""
        return memoryview(self._map)

    def close(self) -> None:
        if self._pinned:
            torch.cuda.cudart().cudaHostUnregister(self._flat.data_ptr())
        self.slots, self._flat = [], None
        os.close(self.fd)


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return torch.Size(shape).numel() * dtype.itemsize


def _register(flat: torch.Tensor) -> bool:
    """Pin the arena (cudaHostRegister) so device copies into it are asynchronous; False if CUDA refuses."""
    return int(torch.cuda.cudart().cudaHostRegister(flat.data_ptr(), flat.numel(), 0)) == 0


def arena_for(tensors: list[torch.Tensor], arena: Arena | None) -> Arena:
    """This arena if its layout still fits the tensors, else a new one (this one closed)."""
    layout = [(t.dtype, tuple(t.shape)) for t in tensors]
    if arena is not None and arena.layout == layout:
        return arena
    if arena is not None:
        arena.close()
    return Arena(layout)


def stage(parts: State, arena: Arena | None) -> tuple[dict[str, Any], Arena, Any]:
    """Lay `parts` out in an arena (this one if the layout still fits, else a new one) and start the copy:
    (the saver's parts, the arena, the CUDA event at which the copy is complete or None)."""
    trees, tensors = flatten(parts)
    values = [t for _, _, t in tensors]
    arena = arena_for(values, arena)
    copied = arena.fill(values)
    spec: dict[str, Any] = {part: {"tree": tree, "tensors": []} for part, tree in trees.items()}
    for (part, name, t), offset in zip(tensors, arena.offsets):
        if t.dtype not in DTYPES:
            raise TypeError(f"a snapshot cannot hold {t.dtype} tensors ({part}:{name})")
        spec[part]["tensors"].append([name, DTYPES[t.dtype], list(t.shape), offset, _nbytes(t.dtype, tuple(t.shape))])
    return spec, arena, copied


def write_snapshot(directory: Path, step: int, parts: State) -> Path:
    """Write one complete snapshot from this process (tests and tools; a trainer's go through its saver)."""
    spec, arena, copied = stage(parts, None)
    if copied is not None:
        copied.synchronize()
    try:
        return write_folder(directory, step, spec, arena.view(), torch.__version__)
    finally:
        arena.close()


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


def read_snapshot(path: Path, names: tuple[str, ...] = PARTS) -> State:
    """The parts `names` (all by default) of one snapshot, checked against its manifest.

    SnapshotInvalid only where its bytes fail their own checks: the manifest (missing, not JSON, a part
    without a size and sha256), a part missing or not the size and sha256 its manifest gives, a part
    whose format does not parse (the safetensors header, the tree in it; a .pt part's unpickling refused).
    Any other error is the reader's (safetensors not importable, memory short, EIO or EACCES from its
    disk) and is raised as it is: the snapshot may be good, and nothing may be done to it for that."""
    manifest = _manifest(path)
    legacy = manifest.get("format") != FORMAT       # written before the saver: torch.save parts
    parts = {}
    for name in names:
        file = f"{name}{'.pt' if legacy else SUFFIX}"
        payload, expected = _bytes_of(path / file), manifest["parts"][name]
        if len(payload) != expected["bytes"] or hashlib.sha256(payload).hexdigest() != expected["sha256"]:
            raise SnapshotInvalid(f"{file} does not match its manifest (truncated or corrupted)")
        parts[name] = _load_legacy(payload) if legacy else _load(payload)
    return parts


# What a file that is not where its manifest says raises on open: the snapshot is incomplete.
_MISSING = (FileNotFoundError, IsADirectoryError, NotADirectoryError)


def _manifest(path: Path) -> dict[str, Any]:
    """The manifest, with a size and sha256 for every part; SnapshotInvalid if it has not."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        if all(isinstance(manifest["parts"][name]["bytes"], int) and isinstance(manifest["parts"][name]["sha256"], str)
               for name in PARTS):
            return manifest
        raise SnapshotInvalid(f"{MANIFEST} gives no size or sha256 for a part")
    except (*_MISSING, ValueError, KeyError, TypeError, AttributeError) as exc:     # ValueError: JSON, UTF-8
        raise SnapshotInvalid(f"{type(exc).__name__}: {exc}") from None


def _bytes_of(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except _MISSING as exc:
        raise SnapshotInvalid(f"{type(exc).__name__}: {exc}") from None


def _load(payload: bytes) -> Any:
    """One safetensors part, already checked against its manifest; SnapshotInvalid if it does not parse."""
    from safetensors import SafetensorError         # read only at a restore: not worth every start's import
    from safetensors.torch import load

    try:
        return unflatten(read_tree(payload), load(payload))
    except (SafetensorError, struct.error, ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
        raise SnapshotInvalid(f"{type(exc).__name__}: {exc}") from None


def _load_legacy(payload: bytes) -> Any:
    """One .pt part: unpickled with weights_only, so a pickle that would run code is refused (SnapshotInvalid)."""
    try:
        return torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, EOFError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise SnapshotInvalid(f"{type(exc).__name__}: {exc}") from None
    except RuntimeError as exc:     # torch's word for a zip archive that does not parse
        if "PytorchStreamReader" not in str(exc):
            raise
        raise SnapshotInvalid(f"{type(exc).__name__}: {exc}") from None


def reader_error(path: Path, exc: BaseException) -> UserError:
    """The one line for a snapshot that this process could not read for a reason of its own."""
    named = type(exc).__name__ + (f": {exc}" if str(exc) else "")
    return UserError(f"cannot read snapshot {path} ({named}): a fault of this process or its disk, not of the "
                     "snapshot's bytes; no snapshot was set aside or removed, here or in the store")


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


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


@contextmanager
def _held(directory: Path) -> Iterator[None]:
    """The directory held with flock: its nodes' starts take their turns (the kernel lets go of a dead one's)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _read_mark(path: Path) -> dict[str, Any]:
    """A job's mark ({} where there is none, or a torn one); UserError where the disk cannot say."""
    try:
        mark = json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return {}
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror}") from None
    return mark if isinstance(mark, dict) else {}


def _write_mark(path: Path, mark: dict[str, Any]) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(mark))
    os.replace(tmp, path)


@dataclass
class _Found:
    """What one node has in its snapshot directory."""
    step: int = -1
    state: State | None = None
    directory_id: str | None = None
    path: str | None = None
    lines: list[tuple[bool, str]] = field(default_factory=list)    # (a warning?, the line) for rank 0 to say
    error: str | None = None


class _Sources:
    """Where a node's start looks for its snapshot: its own disk, and the object store on the node of
    global rank 0. The newest step that reads completely wins, wherever it is: a snapshot that does not
    is passed with one warning (set aside on the disk; its commit removed in the store, which a later
    start would otherwise download again) and the walk goes on to the next older one, in either place.
    Only a snapshot whose bytes fail their own checks is passed so (read_snapshot): an error of the
    reader (memory, an import, its disk) would fail every step alike, so it is one error and touches
    nothing. A store that cannot be reached is one warning, and the walk goes on over the disk alone."""

    def __init__(self, directory: Path, url: str | None, lines: list[tuple[bool, str]]) -> None:
        from app.training.object_store import ObjectStore, StoreDown

        self.directory, self.lines = directory, lines
        self.local = {step_of_name(p.name): p for p in complete_snapshots(directory)}
        self.store, self.remote = (ObjectStore(url) if url else None), set()
        try:
            # Listing asks what check() would: unreachable, wrong credentials or no bucket surface here.
            self.remote = set(self.store.committed()) if self.store else set()
        except StoreDown as exc:
            self._store_down(exc)

    def newest_first(self) -> list[int]:
        return sorted(set(self.local) | self.remote, reverse=True)

    def read(self, step: int) -> State | None:
        """The state of `step` from the disk, else from the store; None (with its warnings) if neither reads."""
        if step in self.local:
            path = self.local[step]
            if (state := self._read(path, f"snapshot {path}")) is not None:
                return state
        return self._download(step) if step in self.remote else None

    def _read(self, path: Path, what: str, retire: int | None = None) -> State | None:
        """The snapshot at `path`; None once it is passed as unusable (its bytes failed their checks).
        An error of the reader is UserError, and nothing is done to any snapshot."""
        try:
            return read_snapshot(path)
        except SnapshotInvalid as exc:
            self._unusable(path, exc, what, retire)
        except Exception as exc:      # the reader's: every other snapshot would fail the same way
            raise reader_error(path, exc) from None
        return None

    def _download(self, step: int) -> State | None:
        from app.training.object_store import StoreDown, StoreInvalid

        where = f"snapshot at step {step} in {self.store.location}"
        try:
            path = self.store.download(step, self.directory)
        except StoreDown as exc:
            self._store_down(exc)
        except OSError as exc:
            self.lines.append((True, f"cannot download into {self.directory}: {exc.strerror or exc}; "
                                     "resuming from the snapshots on the nodes' disks only"))
            self.remote = set()
        except StoreInvalid as exc:
            self._unusable(None, exc, where, step)
        except UserError:             # refused by the store: its one line
            raise
        except Exception as exc:      # this process's (memory short, say): the store's copy may be good
            raise reader_error(self.directory / name_of(step), exc) from None
        else:
            self.lines.append((False, f"downloaded {path.name} from {self.store.location}"))
            return self._read(path, where, retire=step)
        return None

    def _unusable(self, path: Path | None, exc: Exception, what: str, retire: int | None = None) -> None:
        done = [set_aside(path)] if path is not None else []
        if retire is not None:
            done.append(self._retire(retire))
        self.lines.append((True, f"{what} is unusable ({exc}); {'; '.join(done + ['trying the previous one'])}"))

    def _retire(self, step: int) -> str:
        from app.training.object_store import StoreDown

        try:
            self.store.retire(step)
        except StoreDown:
            return "its commit stays (the store went away)"
        return "its commit removed from the store"

    def _store_down(self, exc: Exception) -> None:
        self.lines.append((True, f"the object store cannot be reached ({exc}): resuming from the snapshots on "
                                 "the nodes' disks only"))
        self.remote = set()


class Snapshots:
    """The snapshots of one run: when one is due, handing them to the saver process, and restoring
    the newest valid one on every rank; which rank does what is config.SNAPSHOT_RULE."""

    def __init__(self, cfg: Config, world: World, say: Callable[[str], None], warn: Callable[[str], None]) -> None:
        self.directory, self.keep, self.world, self.say, self.warn = cfg.snapshot_dir, cfg.keep, world, say, warn
        self.every_steps, self.every_seconds = cfg.save_every_steps, cfg.save_every_seconds
        self.every_epochs, self.last_epoch = cfg.save_every_epochs, cfg.epochs
        self._write_thread: threading.Thread | None = None     # waits for the saver's answer
        self._saver = Saver(warn, cfg.snapshot_url, cfg.upload_every_seconds)
        self.snapshot_url, self.upload_every_s = cfg.snapshot_url, cfg.upload_every_seconds
        self._saving = threading.Lock()
        self._arena: Arena | None = None
        self._failure: str | None = None
        self._last_save = time.monotonic()
        self._due_step: int | None = None      # the last step due() took a snapshot at
        self.last_write_s = 0.0
        self.first_in_directory = world.is_main     # settled by restore(): the first rank of this directory
        self.shares_with_main = False    # settled by restore(): this rank's directory is rank 0's

    # ------------------------------------------------------------ when

    def due(self, step: int, *, timer: bool = False, epoch: int | None = None, stopping: bool = False) -> str | None:
        """Why a snapshot is due at this step boundary, or None. `epoch`: the epoch that has just ended
        (the last one always takes a snapshot: the trained model, and what --resume finds).

        Every rank calls this at the same boundaries with the same arguments and gets the same answer:
        `timer` is the agreed timer_vote() (rank 0's clock), which rides on the log row's all-reduce.
        """
        reason = self._reason(step, timer, epoch, stopping)
        if reason is None or step == self._due_step:
            # A second reason at one step (its interval, then its epoch's end or the stop) would only copy
            # and hand over the same state again, which the saver then drops: a step keeps its first snapshot.
            return None
        self._due_step = step
        return reason

    def _reason(self, step: int, timer: bool, epoch: int | None, stopping: bool) -> str | None:
        if stopping:
            return "stop"
        if epoch is not None and (epoch >= self.last_epoch or (self.every_epochs and epoch % self.every_epochs == 0)):
            return "epoch"
        if self.every_steps and step % self.every_steps == 0:
            return "interval"
        return "timer" if timer else None

    def cadence(self) -> str:
        """When snapshots are taken, and so what a job risks when every node dies at once (the start's line)."""
        extra = "".join([f", every {self.every_epochs} epochs" if (self.every_epochs or 0) > 1 else "",
                         ", every epoch" if self.every_epochs == 1 else "",
                         f", every {self.every_steps} steps" if self.every_steps else ""])
        uploads = f"; the newest goes up to the object store every {self.upload_every_s:g} s at most" \
            if self.snapshot_url else ""
        if self.every_seconds:
            return (f"snapshots every {self.every_seconds:g} s{extra} and at the end: at most {self.every_seconds:g} s "
                    f"of training lost if every node dies at once{uploads}")
        when = f"{extra.lstrip(',')} and" if extra else " only"
        return (f"snapshots{when} at the end (--save-every-seconds 0): what is lost if every node dies at once "
                f"has no bound in time{uploads}")

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
        self.start()
        mine = self._look(mode, fresh_start_allowed) if self.world.local_rank == 0 else _Found()
        if mine.directory_id is None and mine.error is None:   # the node's other ranks see the same one
            mine.directory_id = _directory_id(self.directory, create=False)
        self.world.wait_for_all("snapshots-looked", LOOK_BOUND_S)
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
        if self.first_in_directory and mine.step < best and not (self.directory / name_of(best)).exists():
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
        try:
            if mode is False and fresh_start_allowed and not self._continues_the_job(found.lines):
                return found
            sources = _Sources(self.directory, self.snapshot_url if self.world.is_main else None, found.lines)
            for step in sources.newest_first():
                if (state := sources.read(step)) is not None:
                    found.state, found.step, found.path = state, step, str(self.directory / name_of(step))
                    break
        except UserError as exc:
            found.error = str(exc)
        return found

    def newest_here(self) -> tuple[Path, dict[str, Any]] | None:
        """The newest complete snapshot on this node's disk and its train_state part, read by this process
        alone and nothing else of it (inplace's members look before a round whether the job went further
        than their state: app/ft/protocol.py's Refresh). None where there is none, or it does not read:
        a start's restore walks past such a one."""
        for path in complete_snapshots(self.directory)[:1]:
            try:
                return path, read_snapshot(path, ("train_state",))["train_state"]
            except SnapshotInvalid:
                return None
        return None

    def _continues_the_job(self, lines: list[tuple[bool, str]]) -> bool:
        """--no-resume, at a start that is no restart: whether the job has begun, so this start (a node
        started again, a spare, a restarted container) resumes it as without the flag; else it begins it.

        The job has begun where its mark names it (World.job): JOB_MARK in this snapshot directory, or
        the store's under the prefix. The start that begins it moves this directory's earlier snapshots to
        an archive, checks that the prefix holds no earlier job's snapshots, and leaves both marks. The
        nodes that share the directory decide one after another (it is held with flock meanwhile). A start
        of a plain process (no job name) always begins a job: nothing starts one again."""
        job = self.world.job
        with _held(self.directory):
            mark, where = _read_mark(self.directory / JOB_MARK), str(self.directory)
            if not (job is not None and mark.get("job") == job):
                mark, where = self._store_mark(job), self.snapshot_url
                lines += self._archive_existing()       # whatever this directory holds is an earlier job's
                if job is not None:
                    _write_mark(self.directory / JOB_MARK, {"job": job, "began": _now()})
        if mark is None:
            return False
        lines.append((False, f"--no-resume: job {job} began {mark.get('began', '?')} (its mark in {where}); "
                             "this start of one of its nodes resumes it"))
        return True

    def _store_mark(self, job: str | None) -> dict[str, Any] | None:
        """The store's mark of this job (main rank with --snapshot-url), None where the job begins now: then
        the prefix must hold no earlier job's snapshots, which a later start would take for its own (the
        disks' move to an archive; an S3 prefix cannot), and it is marked as this job's."""
        if not (self.snapshot_url and self.world.is_main):
            return None
        from app.training.object_store import ObjectStore, StoreDown

        store = ObjectStore(self.snapshot_url)
        try:
            mark = store.job_mark()
            if job is not None and mark is not None and mark.get("job") == job:
                return mark
            if committed := store.committed():
                raise UserError(f"--no-resume: {store.location} holds an earlier job's snapshots (newest step "
                                f"{committed[0]}); give this job a --snapshot-url prefix of its own")
            if job is not None:
                store.mark_job({"job": job, "began": _now()})
        except StoreDown as exc:
            raise UserError(f"--no-resume with --snapshot-url {store.location}: the object store cannot be reached "
                            f"to check that the prefix holds no earlier job ({exc})") from None
        return None

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
        remove_stale(d)                          # left by a save that was killed midway
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
        """Copy a snapshot into the arena and hand it to the saver (the directory's Writer only);
        returns the seconds the caller was held up. background=False (the just-in-time snapshot on
        a fault, a restored snapshot's copy) returns once it is on disk."""
        start = time.perf_counter()
        with self._saving:                # the heartbeat thread's just-in-time snapshot and the loop's
            self.wait()                   # one write in flight at a time: it reads the arena
            spec, self._arena, copied = stage(parts, self._arena)
            self._last_save = time.monotonic()
            request = {"step": step, "directory": str(self.directory), "keep": self.keep,
                       "torch": torch.__version__, "parts": spec}
            if background:
                self._write_thread = threading.Thread(target=self._write, args=(request, copied),
                                                      name="snapshot-handover")
                self._write_thread.start()
            else:
                self._write(request, copied)
        return time.perf_counter() - start

    def prepare(self, parts: State) -> None:
        """Make the arena for states like `parts` now, so that the first save's stall holds only its copy
        (making and pinning the arena's memory: 20-60 ms of a ResNet-18's state on CPU)."""
        with self._saving:
            self.wait()                   # a write in flight reads the arena this may replace
            self._arena = arena_for([t for _, _, t in flatten(parts)[1]], self._arena)

    def claim(self, step: int, rank0_first_s: float, taken_over_after_s: float) -> bool:
        """Be the one rank that writes a just-in-time snapshot of `step` into this directory.

        Survivors cannot agree through collectives (a peer is gone), so they agree through the
        directory itself: creating the claim file is atomic, and only its creator writes. Rank 0's
        copy is the exact one (batch-norm statistics are each rank's own until DDP's next broadcast),
        so in rank 0's directory the others give it rank0_first_s (the fault policy's RANK0_FIRST) to
        claim first. A claim whose snapshot has not appeared after taken_over_after_s is taken over:
        its claimant died writing it (a `docker restart` SIGKILLs the rank its SIGTERM set writing),
        and the step would otherwise be lost. Two writers of a step are harmless: each write lands
        under the final name whole, and a step already there is kept.
        """
        claim = self.directory / f"{CLAIM_PREFIX}{step:08d}"
        if self.shares_with_main and not self.world.is_main:
            deadline = time.monotonic() + rank0_first_s
            while time.monotonic() < deadline and not claim.exists():
                time.sleep(0.02)
        if (self.directory / name_of(step)).exists():
            return False
        try:
            os.close(os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return not self._written_by_its_claimant(step, taken_over_after_s)
        except OSError:
            return True     # no claim possible here (read-only, gone): try the write, which says why
        return True

    def _written_by_its_claimant(self, step: int, within_s: float) -> bool:
        """Whether the claimed step's snapshot lands under its final name within `within_s`."""
        deadline = time.monotonic() + within_s
        while not (self.directory / name_of(step)).exists():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
        return True

    def wait(self) -> None:
        """Block until the write in flight (if any) is on disk."""
        if self._write_thread is not None:
            self._write_thread.join()
            self._write_thread = None

    def raise_if_failed(self) -> None:
        if self._failure:
            raise UserError(f"the last snapshot could not be written: {self._failure}")

    def start(self) -> None:
        """Start the saver process now, at start-up, not on the first save's path."""
        self._saver.start()

    def close(self) -> None:
        """The write in flight finished, then the saver gone: no process outlives the trainer."""
        self.wait()
        self._saver.close()

    def _write(self, request: dict[str, Any], copied: Any) -> None:
        if copied is not None:
            copied.synchronize()          # the side stream's copy into the arena is complete
        try:
            reply = self._saver.write(request, self._arena)
        except (SaverDied, OSError) as exc:     # died again at once, or could not be started
            reply = {"error": str(exc), "seconds": 0.0}
        self.last_write_s = reply["seconds"]
        self._failure = reply["error"]
        if self._failure:
            # Keep training: the older snapshots are intact, and the next save tries again.
            self.warn(f"snapshot at step {request['step']} failed ({self._failure}); earlier snapshots are kept")


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
