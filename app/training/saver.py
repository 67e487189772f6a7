"""The snapshot saver: a process of its own beside each trainer, which writes its snapshots.

Writing a snapshot inside the training process held its interpreter lock while `torch.save` pickled
the state, and the steps beside it ran a third slower (docs/gpu.md). So the trainer only copies its
state into an arena, shared memory it allocated once (a memfd; pinned on CUDA), and hands this
process a request: where each tensor lies in the arena and where to write. The request travels in a
memfd of its own, passed with a one-word message: it names every tensor (a ResNet-152 with AdamW has
2,300, a transformer tens of thousands), and one socket message is capped by the socket's send buffer
(about 200 KB), where a state of a couple of thousand tensors never fit. The saver writes the
step-N folder (app/training/snapshot_files.py: safetensors parts, hashes, fsync, rename), prunes to
--keep, and answers one message. It imports no torch, so it starts in a tenth of a second, and it
runs below the training threads (nice 10).

Its lifetime is its trainer's, with a bound. It runs in a session of its own, so a launcher's group
kill (torchrun stops a worker with os.killpg: SIGTERM, then SIGKILL) or a terminal's Ctrl-C never
cuts a write short. It leaves when its socket reaches end of file (the trainer closed it), or once
its watchdog thread finds the trainer gone (its parent pid changes, looked at every PARENT_POLL_S;
a forked child of the trainer, a DataLoader worker, may hold the socket open long after) or finds
SIGTERM or SIGINT sent to the saver itself. Then it takes no new write, finishes the one it holds
if that takes at most WRITE_AT_END_S more (else it says so in one line and leaves it: the next
start removes its `.tmp-step-*` folder, whose flock dies with it), tries the last upload for at
most UPLOAD_AT_END_S, and exits: gone at most PARENT_POLL_S + WRITE_AT_END_S + UPLOAD_AT_END_S =
50.5 s after its trainer or the signal (a process stuck in the kernel, in D state on a dead mount,
leaves only when the kernel lets it). SIGTERM and SIGINT sent to the trainer are the trainer's to
handle: its last snapshot goes through here. If the saver dies (killed), the trainer notices at
once, says one line, starts a new one and hands it the same write again (Saver.write); Saver.close
waits a bounded time, then kills, then gives up with one line.

With --snapshot-url, the newest snapshot it has committed also goes up to the object store, from a
thread of this process (Uploader; app/training/object_store.py has the store's layout), so neither
the training thread nor the next write waits for it; at most one upload begins every
--upload-every-seconds. At the trainer's end the saver tries the snapshot still waiting to go up
once more, then leaves.
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Protocol

from app.core.errors import UserError, warning
from app.training.snapshot_files import TMP_PREFIX, held_copy, name_of, prune, remove_stale, write_folder

MAX_REPLY = 1 << 16         # a reply: the step, the folder, an error line
WRITE = b"write"            # the message that hands over a request (in the first fd) and, once, an arena (the second)
PARENT_POLL_S = 0.5         # how often the watchdog asks whether the trainer lives: one getppid call
# Once the saver is told to leave (its trainer gone, SIGTERM or SIGINT), the most the write it holds may
# still take: a healthy write of this project's snapshots takes seconds, and one stuck on a dead mount
# would otherwise keep the saver, and the run's processes, alive without a bound.
WRITE_AT_END_S = 30.0
UPLOAD_AT_END_S = 20.0      # the most the last upload holds a leaving saver
LEAVE_ON = {signal.SIGTERM, signal.SIGINT}      # sent to the saver itself: it leaves as when its trainer is gone
# A write not answered within write_bound_s(its bytes) is a saver that hangs (stopped, or stuck on a dead
# mount): it is killed and replaced like one that died. The bound is HUNG_AFTER_S, for what any write does
# besides its bytes (start, fsyncs, renames, the prune), plus its bytes at WRITE_FLOOR_MB_S, the slowest
# disk a write is waited for: this project's machine wrote, hashed and fsynced 400-1100 MB/s (write_file,
# 1 and 4 GB, 2026-11-28), a network disk 100 or more; at 10 MB/s a 668 MB ResNet-152 with AdamW gets
# 367 s, 5 GB 800 s. A fixed bound killed every write of a state too large for it, and it was never written.
HUNG_AFTER_S = 300.0
WRITE_FLOOR_MB_S = 10.0     # megabytes (10^6 bytes) per second
LEAVES_WITHIN_S = UPLOAD_AT_END_S + 10.0    # Saver.close: a saver told to leave uploads, then exits; else killed
KILLED_WITHIN_S = 5.0       # a saver that SIGKILL has not ended by then is stuck in the kernel: left behind


# ------------------------------------------------------------------ the process

def serve(sock: socket.socket, uploader: Uploader | None = None) -> None:
    """Write each request's snapshot into its directory and answer it, until the trainer is gone."""
    arena: mmap.mmap | None = None
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(sock, len(WRITE), 2)
        except ConnectionResetError:
            return
        if not message:
            return                      # the trainer closed its end, or exited
        request = json.loads(_read_and_close(fds[0]))
        if len(fds) > 1:                # a new arena: the state's layout changed, or this saver is new
            arena = mmap.mmap(fds[1], 0, prot=mmap.PROT_READ)
            os.close(fds[1])
        reply = _write(request, memoryview(arena) if arena is not None else memoryview(b""))
        if uploader is not None and reply["error"] is None:
            uploader.offer(Path(reply["folder"]), request["step"], request["keep"])
        try:
            sock.send(json.dumps(reply).encode())
        except (BrokenPipeError, ConnectionResetError):
            return


def _read_and_close(fd: int) -> bytes:
    with open(fd, "rb") as f:
        return f.read()


def _write(request: dict[str, Any], arena: memoryview) -> dict[str, Any]:
    start = time.perf_counter()
    directory = Path(request["directory"])
    try:
        remove_stale(directory)     # a killed saver's folder: its space back at once, not at the next start
        folder = str(write_folder(directory, request["step"], request["parts"], arena, request["torch"]))
        prune(directory, request["keep"])
        error = None
    except OSError as exc:      # a full disk, a read-only or vanished directory: the trainer warns
        folder, error = None, f"{directory}: {exc.strerror or exc}"
    return {"step": request["step"], "error": error, "folder": folder, "seconds": time.perf_counter() - start}


# ------------------------------------------------------------------ uploads

class Uploader:
    """Puts the newest committed snapshot into the object store, on a thread of its own.

    Only the newest waits: a snapshot committed while another goes up takes the place of any that
    waited, so what waits is one folder on the local disk (nothing is copied, and an upload never
    holds a write back). An upload reads a held copy of its folder (snapshot_files.held_copy: hard
    links in a locked temporary folder), so a prune of the folder meanwhile, by this saver or another
    writer of the directory, costs the upload nothing. After an upload the next one waits until
    `every_s` have passed since it began: an upload is some ten requests, and a job that snapshots
    every second would otherwise upload without a pause, its CPU taken from training (docs/snapshots.md
    has the figures). The last snapshot, at the end, goes up without waiting. While the store cannot
    be reached it says so once, tries again every RETRY_S seconds and says when it is back; a snapshot
    pruned from the disk before its upload began is skipped; how far behind the disk the store had
    fallen is said with its return. A store that answers 5xx, throttles or times out is down
    (ObjectStore retries each request first). When the store's newest snapshot falls
    more than two intervals (the upload interval or the snapshot interval, the longer) behind the
    disk's, it says so once. Nothing an upload raises ends the thread.
    """

    RETRY_S = 5.0

    def __init__(self, store: Any, say: Callable[[str], None] = print, every_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store, self.say, self.every_s, self.clock = store, say, every_s, clock
        self._pending: tuple[Path, int, int, float] | None = None
        self._closing = False
        self._down = False
        self._lag = _Lag(every_s)
        self._wake = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="snapshot-upload", daemon=True)
        self._thread.start()

    def offer(self, folder: Path, step: int, keep: int) -> None:
        now = self.clock()
        with self._wake:
            self._pending = (folder, step, keep, now)
            if self._lag.offered(step, now) and not self._down:
                self.say(warning(self._lag.describe(now)))
            self._wake.notify()

    def finish(self, timeout: float) -> None:
        """Try what still waits once more (not again if the store is down), then stop."""
        with self._wake:
            self._closing = True
            self._wake.notify()
        self._thread.join(timeout)

    def _run(self) -> None:
        while (job := self._next()) is not None:
            began = time.monotonic()
            if self._upload(*job):
                self._rest_until(began + self.every_s)
                continue
            with self._wake:
                self._pending = self._pending or job      # again, unless a newer one came meanwhile
                if self._closing:
                    return
                self._wake.wait(self.RETRY_S)

    def _rest_until(self, moment: float) -> None:
        """No upload begins before `moment` (time.monotonic), unless the saver is closing."""
        with self._wake:
            while not self._closing and (left := moment - time.monotonic()) > 0:
                self._wake.wait(left)

    def _next(self) -> tuple[Path, int, int, float] | None:
        with self._wake:
            while self._pending is None and not self._closing:
                self._wake.wait()
            job, self._pending = self._pending, None
            return job

    def _upload(self, folder: Path, step: int, keep: int, offered: float) -> bool:
        """True when this snapshot is done with (up, or never to go up); False to try again."""
        from app.training.object_store import StoreDown

        try:
            with held_copy(folder) as held:
                if held is None:
                    return True         # pruned from the disk while it waited: a newer one goes up instead
                self.store.upload(held, step)
            self.store.prune(keep)
        except StoreDown as exc:
            if not self._down:
                self.say(warning(f"the object store cannot be reached ({exc}); snapshots stay on this disk "
                                 f"and go up when it is back"))
            self._down = True
            return False
        except Exception as exc:    # refused (credentials), damaged on this disk, or anything else: the next one goes
            self.say(warning(f"snapshot at step {step} was not uploaded: {exc}"))
            return True
        with self._wake:
            behind = self._lag.behind(self.clock())
            self._lag.uploaded(step, offered)
        if self._down:
            self.say(f"the object store is back: step {step} uploaded; it had been {behind}")
            self._down = False
        return True


class _Lag:
    """How far the store's newest snapshot is behind the disk's, in time: the Uploader's one warning.
    The interval is the longer of the upload interval and the mean time between snapshots (a mean: the
    stop's snapshot, a moment after an interval's, must not make it look short)."""

    def __init__(self, every_s: float) -> None:
        self.every_s = every_s
        self.first_offer: float | None = None
        self.offers, self.newest_step = 0, -1
        self.store_step: int | None = None
        self.store_since: float | None = None   # when the store's newest (before any: the first) was offered
        self.said = False

    def offered(self, step: int, now: float) -> bool:
        """Record an offer; True the first time the store is more than two intervals behind."""
        if self.first_offer is None:
            self.first_offer = self.store_since = now
        self.offers, self.newest_step = self.offers + 1, step
        if self.said or self.offers < 2:
            return False
        interval = max(self.every_s, (now - self.first_offer) / (self.offers - 1))
        self.said = now - self.store_since > 2 * interval
        return self.said

    def uploaded(self, step: int, offered: float) -> None:
        if self.store_step is None or step > self.store_step:
            self.store_step, self.store_since = step, offered

    def behind(self, now: float) -> str:
        """How far the store is behind this disk now, in words."""
        newest = f"step {self.store_step}" if self.store_step is not None else "none yet"
        since = self.store_since if self.store_since is not None else now
        return f"{now - since:.0f} s behind this disk (its newest snapshot: {newest}; this disk's: step {self.newest_step})"

    def describe(self, now: float) -> str:
        return (f"the object store is {self.behind(now)}: its uploads take longer than snapshots come, "
                "or keep failing; losing every disk would cost that much more")


def main(argv: list[str] | None = None) -> None:
    args = _arguments(argv)
    signal.pthread_sigmask(signal.SIG_BLOCK, LEAVE_ON)     # before any thread starts: only the watchdog takes them
    os.nice(10)
    uploader = _uploader(args.snapshot_url, args.upload_every_seconds) if args.snapshot_url else None
    sock, served = socket.socket(fileno=args.fd), threading.Event()
    threading.Thread(target=watch, args=(args.trainer_pid, sock, served, uploader), name="saver-watchdog",
                     daemon=True).start()
    serve(sock, uploader)
    served.set()
    if uploader is not None:
        uploader.finish(UPLOAD_AT_END_S)


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m app.training.saver",
                                description="The snapshot saver; a trainer starts it (app/training/saver.py).")
    p.add_argument("fd", type=int, help="the file descriptor of its socket to the trainer")
    # Given, not read with getppid at start: a trainer killed before this process got that far would go unnoticed.
    p.add_argument("--trainer-pid", type=int, required=True, help="the trainer's pid: the saver leaves once it is gone")
    p.add_argument("--snapshot-url", help="also upload each snapshot to this s3://BUCKET/PREFIX")
    p.add_argument("--upload-every-seconds", type=float, default=0.0, help="the least time between two uploads' starts")
    return p.parse_args(argv)


def _uploader(url: str, every_s: float) -> Uploader:
    from app.training.object_store import ObjectStore
    return Uploader(ObjectStore(url), say=_say, every_s=every_s)


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def watch(trainer: int, sock: socket.socket, served: threading.Event, uploader: Uploader | None) -> None:
    """The saver's watchdog: once the trainer is gone, or SIGTERM or SIGINT came, no new write is taken,
    and the saver leaves within WRITE_AT_END_S even if the write it holds has not finished."""
    why = _told_to_leave(trainer)
    sock.shutdown(socket.SHUT_RD)       # serve() answers the write it holds, if any, then finds the end of file
    if served.wait(WRITE_AT_END_S):
        return                          # main() tries the last upload and returns
    _say(warning(f"the snapshot saver (pid {os.getpid()}) gave up the write it held: it had not finished "
                 f"{WRITE_AT_END_S:g} s after {why}; earlier snapshots are kept"))
    if uploader is not None:
        uploader.finish(UPLOAD_AT_END_S)
    os._exit(1)                         # not an orderly exit: the main thread is stuck in the write


def _told_to_leave(trainer: int) -> str:
    """Wait until the trainer is gone or SIGTERM or SIGINT has come; which, in words.

    The trainer is gone when this process's parent pid is no longer its pid (it was reparented). Not
    PR_SET_PDEATHSIG: that fires when the *thread* that started the saver exits, and a trainer starts a
    replacement from its short-lived handover thread. Not a pidfd: pidfd_open is refused by the seccomp
    profiles of Docker before 20.10 (moby/moby#41665). A getppid call every PARENT_POLL_S costs nothing
    and needs neither.
    """
    while os.getppid() == trainer:
        if (got := signal.sigtimedwait(LEAVE_ON, PARENT_POLL_S)) is not None:
            return signal.Signals(got.si_signo).name
    return f"its trainer (pid {trainer}) ended"


# ------------------------------------------------------------------ the trainer's side

class SharedArena(Protocol):
    """What the saver is handed with a write: the memory it reads the state from
    (app/training/snapshot.py's Arena)."""
    fd: int         # a memfd
    serial: int     # which arena this is, never reused within the process


def _memfd(name: str, payload: bytes) -> int:
    """A memfd holding `payload`, read from its start."""
    fd = os.memfd_create(name)
    with open(fd, "wb", closefd=False) as f:
        f.write(payload)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


class SaverDied(Exception):
    """The saver process ended, or hung, while it held a write."""


class Saver:
    """The trainer's handle on its saver process: starts it, hands it writes (one at a time, from
    the thread that waits for each), and starts a new one when it has died."""

    def __init__(self, warn: Callable[[str], None], snapshot_url: str | None = None, upload_every_s: float = 0.0) -> None:
        self.warn, self.snapshot_url, self.upload_every_s = warn, snapshot_url, upload_every_s
        self.process: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        # The arena this process has been given, by its serial: an fd number alone names no arena, as
        # a closed arena's number is the next one's.
        self._arena_sent: int | None = None

    def start(self) -> None:
        if self.process is not None and self.process.poll() is None:
            return
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        root = str(Path(__file__).resolve().parents[2])     # the folder holding app/, whatever the cwd
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        upload = ["--snapshot-url", self.snapshot_url, "--upload-every-seconds", str(self.upload_every_s)] \
            if self.snapshot_url else []
        command = [sys.executable, "-m", "app.training.saver", str(theirs.fileno()), "--trainer-pid", str(os.getpid())]
        # A session of its own: a launcher's group kill (torchrun's os.killpg) or a terminal's Ctrl-C would cut
        # a write or an upload short; it leaves on its own once this process is gone (watch).
        self.process = subprocess.Popen([*command, *upload], pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                                        env=env, start_new_session=True)
        theirs.close()
        self._sock, self._arena_sent = ours, None

    def write(self, request: dict[str, Any], arena: SharedArena) -> dict[str, Any]:
        """Have the saver write one snapshot; its reply. A saver that died is replaced once, saying so."""
        try:
            return self._exchange(request, arena)
        except SaverDied as died:
            self.warn(f"{died}; a new saver writes step {request['step']}")
            self.close()
            return self._exchange(request, arena)

    def _exchange(self, request: dict[str, Any], arena: SharedArena) -> dict[str, Any]:
        self.start()
        assert self._sock is not None
        held = _memfd("snapshot-request", json.dumps(request).encode())
        fds = [held] if self._arena_sent == arena.serial else [held, arena.fd]
        nbytes = request_bytes(request)
        try:
            self._sock.settimeout(write_bound_s(nbytes))
            socket.send_fds(self._sock, [WRITE], fds)
            self._arena_sent = arena.serial
            reply = self._sock.recv(MAX_REPLY)
        except (BrokenPipeError, ConnectionResetError):
            reply = b""
        except TimeoutError:
            got_to = _how_far(request, self.process.pid, nbytes)     # before the kill: its folder as it left it
            self.process.kill()
            raise SaverDied(f"the snapshot saver (pid {self.process.pid}) did not finish step {request['step']} "
                            f"within {write_bound_s(nbytes):.0f} s ({HUNG_AFTER_S:g} s + {nbytes / 1e6:.0f} MB at "
                            f"{WRITE_FLOOR_MB_S:g} MB/s) and was killed: {got_to}") from None
        finally:
            os.close(held)              # the saver holds its own copy of the fd once it is sent
        if not reply:
            raise SaverDied(f"the snapshot saver (pid {self.process.pid}) ended {self._how_it_ended()} "
                            f"while writing step {request['step']}")
        return json.loads(reply)

    def _how_it_ended(self) -> str:
        try:
            code = self.process.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            return "its socket"
        if code < 0:
            return f"by {signal.Signals(-code).name}"
        return f"with status {code}"

    def close(self) -> None:
        """End the saver (after the write it holds, if any: call this once no write is in flight)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self.process is not None:
            self._end(self.process)
            self.process = None

    def _end(self, process: subprocess.Popen) -> None:
        """Wait for the saver to leave, kill it if it has not within LEAVES_WITHIN_S, and never wait without a
        bound: a process stuck in the kernel (a write on a dead mount) ends only when its write does."""
        if _ended_within(process, LEAVES_WITHIN_S):
            return
        process.kill()
        if not _ended_within(process, KILLED_WITHIN_S):
            self.warn(f"the snapshot saver (pid {process.pid}) did not end within {KILLED_WITHIN_S:g} s of SIGKILL "
                      "(stuck in the kernel: a dead mount?); it is left behind")


def request_bytes(request: dict[str, Any]) -> int:
    """The bytes of tensors a write request holds (its headers and manifest are a few KB more)."""
    return sum(tensor[4] for part in request["parts"].values() for tensor in part["tensors"])


def write_bound_s(nbytes: int) -> float:
    """How long a write of `nbytes` is waited for before its saver counts as hung."""
    return HUNG_AFTER_S + nbytes / (WRITE_FLOOR_MB_S * 1e6)


def _how_far(request: dict[str, Any], pid: int, nbytes: int) -> str:
    """How far the saver `pid` got with the write of `request`, in words, from its folders on disk."""
    directory, step = Path(request["directory"]), request["step"]
    try:
        folders = list(directory.glob(f"{TMP_PREFIX}{step:08d}-{pid}-*"))
        if folders:
            written = sum(f.stat().st_size for folder in folders for f in folder.iterdir() if f.is_file())
            return f"it had written {written / 1e6:.0f} MB of {nbytes / 1e6:.0f} MB"
        if (directory / name_of(step)).is_dir():
            return f"{name_of(step)} is complete: it hung after the write (the rename's fsync, or the prune)"
        return f"it had not begun its folder in {directory}"
    except OSError as exc:      # the directory itself on a dead mount, say
        return f"how far it got cannot be read ({exc.strerror})"


def _ended_within(process: subprocess.Popen, seconds: float) -> bool:
    try:
        process.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        return False
    return True


if __name__ == "__main__":
    main()
