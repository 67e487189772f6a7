"""A snapshot on disk: the step-N folder, its safetensors parts and its manifest. No torch here.

    <snapshot-dir>/step-00000300/{model,optimizer,scheduler,scaler,train_state}.safetensors
    <snapshot-dir>/step-00000300/manifest.json     # written last: size and sha256 of every part

Each part is a safetensors file (a little-endian u64 header length, a JSON header, the raw tensor
bytes): its tensors, named by their path in the part (a model's are its state_dict keys, so
`safetensors.torch.load_file("step-N/model.safetensors")` is a state_dict), and, in the header's
`__metadata__["tree"]`, the part's other values as JSON with each tensor's place marked. Loading one
reads bytes and JSON: nothing in a snapshot can run code.

The snapshot saver (app/training/saver.py) writes them from the shared memory the trainer copied its
state into, without torch: the format is written here by hand (the safetensors library serialises
only tensors held in the writing process, with a copy). A folder is written under a temporary name
(`.tmp-step-...`), held with flock while it is, every file and the folder fsynced, and only then
renamed to `step-N`: a kill at any moment leaves the complete snapshot or a temporary folder that
the next start removes (remove_stale), never a partial file under a final name.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
import struct
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

MANIFEST = "manifest.json"
FORMAT = "safetensors"          # the manifest's "format"; snapshots without one hold torch.save parts (.pt)
SUFFIX = ".safetensors"
PREFIX, TMP_PREFIX = "step-", ".tmp-step-"
HELD_PREFIX = ".held-"          # an upload's held copy of a snapshot folder (held_copy)
TENSOR, TUPLE, PAIRS = "$tensor", "$tuple", "$pairs"     # the tree's markers (app/training/snapshot.py writes them)

# A part as the trainer lays it out for a write: its tree (JSON, tensors marked) and its tensors,
# each [name, safetensors dtype, shape, offset in the arena, bytes], in the order they are written.
Part = dict[str, Any]


def name_of(step: int) -> str:
    return f"{PREFIX}{step:08d}"


def step_of_name(name: str) -> int | None:
    digits = name[len(PREFIX):]
    # ASCII only: str.isdigit also takes '²', on which int() raises (at every start's listing)
    return int(digits) if name.startswith(PREFIX) and digits.isascii() and digits.isdigit() else None


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


PIECE = 1 << 20     # written and hashed piece by piece while it is in this core's cache: one pass over memory


def write_file(path: Path, *chunks: bytes | memoryview) -> tuple[int, str]:
    """Write and fsync a file; returns its size and sha256, hashed as it is written."""
    digest, size = hashlib.sha256(), 0
    with open(path, "wb", buffering=0) as f:
        for chunk in map(memoryview, chunks):
            for start in range(0, len(chunk), PIECE):
                piece = chunk[start:start + PIECE]
                f.write(piece)
                digest.update(piece)
            size += len(chunk)
        os.fsync(f.fileno())
    return size, digest.hexdigest()


def write_folder(directory: Path, step: int, parts: dict[str, Part], arena: memoryview, torch_version: str) -> Path:
    """Write one complete snapshot atomically; returns its final path. A step already there is kept."""
    return build_folder(directory, step, lambda tmp: _write_parts(tmp, step, parts, arena, torch_version))


def build_folder(directory: Path, step: int, fill: Callable[[Path], None]) -> Path:
    """Make the folder of `step` atomically: `fill` writes (and fsyncs) its files into a temporary folder,
    held with flock, which is then renamed; any failure removes it. A step already there is kept."""
    final = directory / name_of(step)
    if final.exists():
        return final
    tmp = directory / f"{TMP_PREFIX}{step:08d}-{os.getpid()}-{threading.get_native_id()}"
    shutil.rmtree(tmp, ignore_errors=True)
    held = locked_folder(tmp)
    try:
        fill(tmp)
        fsync_dir(tmp)
        return commit_folder(tmp, final, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)   # a full disk gets its space back at once
        raise
    finally:
        os.close(held)


def locked_folder(path: Path) -> int:
    """Make the folder `path` and hold it with flock (remove_stale leaves a held folder alone); the fd.
    Another process can remove the folder (a clean-up) or rename it (a download it finished) at any
    point between its mkdir and the lock: before the open (which then finds nothing), or after it (the
    lock then holds a folder that is no longer `path`). Either way it is made again."""
    while True:
        path.mkdir(exist_ok=True)
        try:
            held = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue
        fcntl.flock(held, fcntl.LOCK_EX)
        try:
            if os.path.samestat(os.fstat(held), os.stat(path)):     # nobody removed or renamed it before the lock
                return held
        except FileNotFoundError:
            pass
        os.close(held)


def _write_parts(folder: Path, step: int, parts: dict[str, Part], arena: memoryview, torch_version: str) -> None:
    manifest: dict[str, Any] = {"format": FORMAT, "step": step, "created": time.time(), "torch": torch_version,
                                "parts": {}}
    for name, part in parts.items():
        size, sha = write_file(folder / f"{name}{SUFFIX}", *_safetensors_chunks(part, arena))
        manifest["parts"][name] = {"bytes": size, "sha256": sha}
    write_file(folder / MANIFEST, json.dumps(manifest, indent=1).encode())


def _safetensors_chunks(part: Part, arena: memoryview) -> list[bytes | memoryview]:
    header: dict[str, Any] = {"__metadata__": {"tree": json.dumps(part["tree"])}}
    data, end = [], 0
    for name, dtype, shape, offset, nbytes in part["tensors"]:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [end, end + nbytes]}
        data.append(arena[offset:offset + nbytes])
        end += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)        # the format pads the header so the data is 8-aligned
    return [struct.pack("<Q", len(encoded)), encoded, *data]


def commit_folder(tmp: Path, final: Path, directory: Path) -> Path:
    """Rename a complete folder to its final name (a step already there is kept); the final path."""
    try:
        os.rename(tmp, final)
    except OSError:
        if not final.is_dir():
            raise
        shutil.rmtree(tmp, ignore_errors=True)   # another node wrote this step first: one writer wins
        return final
    fsync_dir(directory)
    return final


def manifest_files(folder: Path) -> dict[str, dict[str, Any]]:
    """The files a snapshot folder must hold besides its manifest, each with the size and sha256 its
    manifest gives; ValueError (or OSError) when the manifest is missing or unreadable."""
    manifest = json.loads((folder / MANIFEST).read_text())
    suffix = SUFFIX if manifest.get("format") == FORMAT else ".pt"     # .pt: written before the saver
    files = {f"{name}{suffix}": dict(part) for name, part in manifest["parts"].items()}
    if not all(isinstance(part.get("bytes"), int) and isinstance(part.get("sha256"), str) for part in files.values()):
        raise ValueError(f"{MANIFEST} gives no size or sha256 for a part")
    return files


def read_tree(payload: bytes) -> Any:
    """The JSON tree in a safetensors file's header (its tensors are read by the safetensors library)."""
    (length,) = struct.unpack("<Q", payload[:8])
    return json.loads(json.loads(payload[8:8 + length])["__metadata__"]["tree"])


def complete_snapshots(directory: Path) -> list[Path]:
    """Complete snapshots, newest first. Only renamed (finished) folders count."""
    found = [p for p in directory.glob(f"{PREFIX}*") if p.is_dir() and step_of_name(p.name) is not None]
    return sorted(found, key=lambda p: step_of_name(p.name), reverse=True)


def prune(directory: Path, keep: int) -> None:
    for old in complete_snapshots(directory)[keep:]:
        # Rename first so that a kill during the removal never leaves a half-deleted `step-N`.
        doomed = old.with_name(f"{TMP_PREFIX}{old.name}-deleting-{os.getpid()}-{threading.get_native_id()}")
        try:
            old.rename(doomed)
        except FileNotFoundError:
            continue                # another writer of this directory pruned it first
        shutil.rmtree(doomed, ignore_errors=True)


@contextmanager
def held_copy(folder: Path) -> Iterator[Path | None]:
    """The files of a committed snapshot folder, linked into a temporary folder of their own (held with
    flock, as a write is) that no prune touches: what an upload reads while the saver, or another
    writer of the directory, prunes the folder itself. None if the folder was pruned first."""
    tmp = folder.with_name(f"{HELD_PREFIX}{folder.name}-{os.getpid()}-{threading.get_native_id()}")
    held = locked_folder(tmp)
    try:
        try:
            for path in folder.iterdir():
                _link_or_copy(path, tmp / path.name)
        except FileNotFoundError:
            yield None
        else:
            yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        os.close(held)


def _link_or_copy(source: Path, target: Path) -> None:
    """A hard link (no byte copied), or a copy on a filesystem that has none."""
    try:
        os.link(source, target)
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.EXDEV, errno.ENOTSUP, errno.EMLINK):
            raise
        shutil.copyfile(source, target)


def remove_stale(directory: Path, prefixes: tuple[str, ...] = (TMP_PREFIX, HELD_PREFIX),
                 keep: Path | None = None) -> None:
    """Remove the temporary folders of writes (and uploads) that were killed; one a saver still writes (a
    trainer's last write, finishing after its trainer left) is held with flock and left to it."""
    for stale in (p for prefix in prefixes for p in directory.glob(f"{prefix}*")):
        if stale == keep:
            continue
        try:
            fd = os.open(stale, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            # Removed while the lock is held: a writer that made the folder and waits for its lock finds
            # it gone once it has the lock (locked_folder), and never writes into a folder being removed.
            shutil.rmtree(stale, ignore_errors=True)
        except BlockingIOError:
            continue
        finally:
            os.close(fd)
