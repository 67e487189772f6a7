"""Faults the chaos runner makes from the host, below docker (root only): a snapshot volume of fixed
size that can be filled, a network partition of one node container, a cut of the data path between
node containers that leaves the store reachable, a frozen training process, a node stopped but for
its snapshot saver, a container's CPU quota cut.

Why by hand: docker has no verb for any of them but the quota (`docker update --cpus`, which its Python
SDK lacks: the CLI is called). Host-network containers cannot be disconnected
(`docker network disconnect` needs a network of their own), and `docker pause` freezes the whole
node, where a partition leaves it running, a frozen worker leaves its agent running and a node
stopped but for its saver leaves that one uploading.
"""
from __future__ import annotations

import errno
import os
import re
import socket
import struct
import shutil
import subprocess
from pathlib import Path
from typing import Any

FILLER = ".chaos-filler"
V4_MAPPED = "0000000000000000FFFF0000"      # ::ffff:a.b.c.d in /proc/net/tcp6's word order


def _run(*cmd: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed: {(done.stderr or done.stdout).strip()[:300]}")


# ---------------------------------------------------------------- the snapshot volume

class SnapshotVolume:
    """An ext4 file system of `size_mb` in an image file, loop-mounted where the job keeps its snapshots
    (before the containers start: their bind mount of the run directory then includes it). Real fsync,
    real ENOSPC: `fill()` takes every free block, as another tenant of a shared volume would."""

    def __init__(self, image: Path, mount_point: Path, size_mb: int) -> None:
        self.image, self.mount_point, self.size_mb = image, mount_point, size_mb

    def create(self, owner: str) -> None:
        self.image.parent.mkdir(parents=True, exist_ok=True)
        with open(self.image, "wb") as f:
            f.truncate(self.size_mb << 20)
        _run("mkfs.ext4", "-q", "-F", "-m", "0", str(self.image))     # -m 0: no blocks held back for root
        self.mount_point.mkdir(parents=True, exist_ok=True)
        _run("mount", "-o", "loop", str(self.image), str(self.mount_point))
        uid, _, gid = owner.partition(":")
        os.chown(self.mount_point, int(uid), int(gid or uid))
        (self.mount_point / "lost+found").rmdir()

    def fill(self) -> int:
        """Write a file until the volume is full (smaller and smaller writes for the last blocks);
        returns its size in bytes."""
        fd = os.open(self.mount_point / FILLER, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        written, size = 0, 1 << 20
        try:
            while size:
                try:
                    written += os.write(fd, bytes(size))
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    size //= 2
            os.fsync(fd)
        finally:
            os.close(fd)
        return written

    def free(self) -> None:
        (self.mount_point / FILLER).unlink(missing_ok=True)

    def wipe(self) -> int:
        """Remove everything on the volume, as a new disk would have nothing; returns how many entries went."""
        entries = list(self.mount_point.iterdir())
        for entry in entries:
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        return len(entries)

    def remove(self) -> None:
        subprocess.run(["umount", "--lazy", str(self.mount_point)], capture_output=True)
        self.image.unlink(missing_ok=True)


# ---------------------------------------------------------------- a network partition

def _cgroup2_root() -> Path:
    """Where the unified (v2) hierarchy is mounted: /sys/fs/cgroup on v2 hosts, .../unified on hybrid ones."""
    for line in Path("/proc/mounts").read_text().splitlines():
        fields = line.split()
        if fields[2] == "cgroup2":
            return Path(fields[1])
    raise RuntimeError("no cgroup2 hierarchy is mounted: a partition needs iptables' cgroup match")


def _cgroup2_of(pid: int) -> str:
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        if line.startswith("0::"):
            return line[3:]
    return "/"


class Partition:
    """Drop every packet a container's processes send, the container itself running on.

    Nodes share the host's network stack and its loopback addresses, so no address tells this
    node's packets apart. Two kinds of iptables rules do: one per TCP socket the node holds now
    (its local address and port: connections to the store and its peers, its listeners), and one for
    sockets it opens later, by cgroup (v2): its processes move into a cgroup of their own, which the
    processes they start (a rejoining agent) inherit. (A socket keeps the cgroup it was made in, so
    the second rule alone would miss every connection already open.) Dropping its output cuts its
    TCP both ways: its acknowledgements never arrive either. IPv4 only.
    """

    def __init__(self, container: Any) -> None:
        self.container = container
        self.root = _cgroup2_root()
        self.name = f"ftt-chaos-{container.name}"
        self.rules = [["OUTPUT", "-m", "cgroup", "--path", self.name, "-j", "DROP"]]
        self._home = "/"

    def cut(self) -> None:
        pids = container_pids(self.container)
        self._home = _cgroup2_of(pids[0])
        group = self.root / self.name
        group.mkdir(exist_ok=True)
        for pid in pids:
            _move(pid, group)
        self.rules += [["OUTPUT", "-p", "tcp", "-s", addr, "--sport", str(port), "-j", "DROP"]
                       for addr, port in sorted(_tcp_sockets(pids))]
        for rule in self.rules:
            _run("iptables", "-I", *rule)

    def heal(self) -> None:
        for rule in self.rules:
            subprocess.run(["iptables", "-D", *rule], capture_output=True)
        group = self.root / self.name
        if not group.is_dir():
            return
        home = self.root / self._home.lstrip("/")
        for pid in (group / "cgroup.procs").read_text().split():
            _move(int(pid), home)
        group.rmdir()


# ---------------------------------------------------------------- a cut between nodes, the store reached

# Where nft looks a cgroup path up (its SYSFS_CGROUPSV2_PATH); a hybrid host mounts v2 below it.
NFT_CGROUP_BASE = Path("/sys/fs/cgroup")
# A packet's side, set when it leaves its sender and read where it arrives ("FT" and the side's number).
SIDE_MARK = 0x46540000


def cut_ruleset(table: str, sides: list[list[str]], mount: str = "") -> str:
    """The nftables table that drops every packet between sockets of different sides, each side a
    list of cgroup v2 paths (/docker/ID), under `mount`: where the v2 hierarchy is mounted, relative
    to NFT_CGROUP_BASE (a hybrid host's "unified"). On output a packet is marked with its sender's
    side (its socket's cgroup); on input the receiving socket is looked up (a listener or a
    connection) and a packet marked with another side's mark is dropped. A socket of neither side
    (the store's) neither sends marked packets nor drops any."""
    def match(path: str) -> str:
        parts = Path(path).relative_to("/").parts
        return f'socket cgroupv2 level {len(parts)} "{Path(mount, *parts)}"'

    out = [f"{match(path)} meta mark set {SIDE_MARK + i:#x}" for i, side in enumerate(sides) for path in side]
    into = [f"meta mark {SIDE_MARK + i:#x} {match(path)} drop" for i in range(len(sides))
            for j, side in enumerate(sides) if j != i for path in side]
    body = lambda hook, rules: (f"  chain {hook} {{\n    type filter hook {hook} priority 0; policy accept;\n"
                                + "".join(f"    {r}\n" for r in rules) + "  }\n")
    return f"table inet {table} {{\n{body('output', out)}{body('input', into)}}}\n"


class PeerCut:
    """Cut the data path between sides of a job's node containers while every node still reaches the
    store, as a bad link or a firewall between racks would (`partition` drops all of a node's packets,
    the store's too).

    Nodes share the host's network stack, and their peer traffic runs between ports of 127.0.0.1
    (gloo binds lo's address) as their store traffic does: no address or port tells a peer's packets
    from the store's, and iptables names a packet's sender (its socket's cgroup) but never its
    receiver. nftables' `socket cgroupv2` names both (cut_ruleset). Every socket a container's
    processes make belongs to the container's cgroup from its start, so connections open before
    the cut are cut too: no SYN crosses, and a connection already open stalls (its data and
    acknowledgements dropped both ways) until TCP gives up or the cut heals. IPv4 and IPv6."""

    def __init__(self, sides: list[list[Any]]) -> None:
        self.sides = sides
        self.table = f"ftt-chaos-cut-{sides[0][0].name}"

    def cut(self) -> None:
        base = _cgroup2_root()
        if not base.is_relative_to(NFT_CGROUP_BASE):
            raise RuntimeError(f"cgroup v2 is mounted at {base}, outside {NFT_CGROUP_BASE} where nft looks paths up")
        paths = [[_cgroup2_of(container_pids(c)[0]) for c in side] for side in self.sides]
        rules = cut_ruleset(self.table, paths, str(base.relative_to(NFT_CGROUP_BASE)))
        done = subprocess.run(["nft", "-f", "-"], input=rules, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"`nft -f -` failed: {done.stderr.strip()[:300]}")

    def heal(self) -> None:
        subprocess.run(["nft", "delete", "table", "inet", self.table], capture_output=True)


def _tcp_sockets(pids: list[int]) -> set[tuple[str, int]]:
    """(local address, port) of every TCP socket these processes hold that speaks IPv4 (host network:
    the host's /proc/net lists them; torch's store client is an IPv6 socket on a v4-mapped address)."""
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(link[len("socket:["):-1])
        except OSError:
            continue                 # it exited meanwhile
    found = set()
    lines = [line for table in ("tcp", "tcp6") for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]]
    for fields in (line.split() for line in lines):
        addr_hex, port_hex = fields[1].split(":")
        if fields[9] in inodes and (len(addr_hex) == 8 or addr_hex.startswith(V4_MAPPED)):
            found.add((socket.inet_ntoa(struct.pack("<I", int(addr_hex[-8:], 16))), int(port_hex, 16)))
    return found


def _move(pid: int, group: Path) -> None:
    try:
        (group / "cgroup.procs").write_text(str(pid))
    except (ProcessLookupError, FileNotFoundError):
        pass                         # it exited meanwhile
    except OSError as exc:
        if exc.errno != errno.ESRCH:
            raise


# ---------------------------------------------------------------- a slow node

def set_cpus(container: Any, cpus: float | None) -> None:
    """The container's CPU quota (`docker update --cpus`): the kernel's CFS quota lets its processes run
    for that share of each period and stops them to the period's end. Its processes keep running and
    beating, only slowly, as on a node with a failing fan or a noisy neighbour. None lifts it: every
    core of the host, which is no limit (`--cpus 0` is no lift: docker takes a zero in an update for
    "unchanged", and the container stayed at 0.2: docker 20.10 on this machine, 2026-11-28). The docker
    SDK's update has no `--cpus` (NanoCpus); the CLI sets it."""
    _run("docker", "update", "--cpus", f"{cpus if cpus is not None else os.cpu_count() or 1:g}", container.name)


# ---------------------------------------------------------------- processes of a container

def _processes(container: Any) -> list[tuple[int, str]]:
    """(host pid, command line) of every process in the container, its init first (docker top
    reports host pids)."""
    return [(int(pid), args) for pid, args in container.top(ps_args="-eo pid,args")["Processes"]]


def container_pids(container: Any) -> list[int]:
    return [pid for pid, _ in _processes(container)]


def all_but_saver_pids(container: Any) -> list[int]:
    """Host pids of every process in the node but its snapshot saver (app/training/saver.py): stopped, they
    leave the saver uploading alone, with no trainer to hand it a newer snapshot and no launcher or agent
    to restart one."""
    return [pid for pid, args in _processes(container) if "-m app.training.saver" not in args]


def worker_pids(container: Any, module: str = "app.train") -> list[int]:
    """Host pids of the node's training processes (torchrun's workers, not its agent)."""
    runs = re.compile(rf"-m {re.escape(module)}(\s|$)")     # not app.training.saver, the trainer's saver process
    return [pid for pid, args in _processes(container)
            if runs.search(args) and "torchrun" not in args and "app.launch" not in args]

