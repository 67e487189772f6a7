"""The inplace mode's store traffic at scale: N simulated members, each running the real watch
(app/ft/inplace.py's Watch, its thread and its rounds) against one TCPStore on this host.

    python -m bench.store_scale                          # N = 2, 8, 64, 256; -> bench/store_scale.json
    python -m bench.store_scale --members 2,8 --seconds 5 --design old

Each member is an InPlaceGroup of its own (its own store connections, secret, beats) following one
generation of all N, as it does between two faults; the members are spread over a few processes
so that one interpreter's lock does not pace them all. For `--seconds` the bench counts every
store operation each member's watch makes; then it freezes one member's watch (its beats stop, as
a SIGSTOPped node's do) and times how long each other member takes to end the generation.

`--design old` replays the round of the watch before issue 28 (its store operations: the beat,
`latest` checked and read, `reform`, and every peer's beat checked and read, 2N+2 a round) with
the same members, to show where one store stops keeping up with it.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "store_scale.json"
JOB, SECRET, GEN = "bench", "bench-secret", 1
PROJECTED = (512, 4096)


class Counted:
    """A store connection that counts the operations made through it."""

    def __init__(self, store: dist.TCPStore) -> None:
        self._store, self.ops = store, 0

    def __getattr__(self, name: str) -> Any:
        call = getattr(self._store, name)

        def counted(*args: Any) -> Any:
            self.ops += 1
            return call(*args)
        return counted


def _members(port: int, ids: range, n: int, design: str) -> list[Any]:
    """Members ids of n: InPlaceGroups without a store round of their own (the generation is given)."""
    from app.cluster.distributed import World
    from app.ft import inplace, records
    from app.ft.protocol import Member
    from app.core.policy import DEFAULT

    os.environ["JOB_SECRET"] = SECRET
    world = World(0, 0, 1, 1, torch.device("cpu"), 0)
    members = []
    for i in ids:
        group = inplace.InPlaceGroup.__new__(inplace.InPlaceGroup)
        group.world, group.policy, group.member = world, DEFAULT, f"{i:012x}"
        group.endpoint, group.keys = f"127.0.0.1:{port}", records.Keys(JOB)
        group._secret, group.rejects = SECRET.encode(), records.Rejects(DEFAULT.store_warning_interval_s)
        group.pending_since = None      # no step pending: the watch never probes the data path here
        group._store_at = None          # resolved by the first connect
        group.me = Member(group.member, f"sim{i}/0", "", DEFAULT)
        group.counted = []
        connect = group.connect
        group.connect = lambda *args, connect=connect, group=group, **kwargs: (
            group.counted.append(Counted(connect(*args, **kwargs))) or group.counted[-1])
        group.watch = inplace.Watch(group) if design == "new" else OldWatch(group, n)
        members.append(group)
    return members


class OldWatch(threading.Thread):
    """The store operations of the watch round before issue 28, replayed: beat, check and get
    `latest`, get `reform`, check and get every peer's beat."""

    def __init__(self, group: Any, n: int) -> None:
        super().__init__(daemon=True)
        self.group, self.ended, self._stop, self._beat = group, threading.Event(), threading.Event(), 0
        self.others = [f"{j:012x}" for j in range(n) if f"{j:012x}" != group.member]

        self.following = False

    def follow(self, *args: Any) -> None:
        self.following = True

    def run(self) -> None:
        store, keys = self.group.connect(), self.group.keys.namespace
        seen: dict[str, tuple[bytes, float]] = {}
        while not self._stop.wait(self.group.policy.ft_heartbeat_interval_s):
            self._beat += 1
            store.set(f"{keys}beat/{self.group.member}", f"{self._beat}:{time.time():.3f}")
            if not self.following:
                continue
            store.check([f"{keys}latest"])
            store.get(f"{keys}latest")
            store.get(f"{keys}{GEN}/reform")
            now = time.monotonic()
            for m in self.others:
                key = f"{keys}beat/{m}"
                beat = store.get(key) if store.check([key]) else b""
                if seen.get(m, (None,))[0] != beat:
                    seen[m] = (beat, now)
                elif now - seen[m][1] >= self.group.policy.ft_heartbeat_timeout_s:
                    self.ended.set()


def _worker(port: int, ids: range, n: int, design: str, seconds: float, ready: Any,
            results: "mp.Queue[dict]") -> None:
    """One process's members: connect and beat; then, all processes together, follow one generation
    of all n, count for `seconds`, freeze member 0 (if it is here) and time the others' ends.

    Connecting comes first and apart: the store's server looks up each new client's host name
    (here a DNS query that times out, with no network), and its other clients wait meanwhile."""
    members = _members(port, ids, n, design)
    for m in members:
        m.watch.start()
    while not all(m.counted and m.watch._beat for m in members):
        time.sleep(0.1)
    ready.wait()
    all_members, names = [f"{j:012x}" for j in range(n)], [f"sim{j}/0" for j in range(n)]
    for m in members:
        m.watch.follow(GEN, all_members, names, [""] * n)     # addresses: only probed while a step waits
    time.sleep(1.5)                                 # every watch following, past its first looks
    before = [(sum(c.ops for c in m.counted), m.watch._beat) for m in members]
    began = time.monotonic()
    time.sleep(seconds)
    took = time.monotonic() - began
    after = [(sum(c.ops for c in m.counted), m.watch._beat) for m in members]
    ops = [a[0] - b[0] for a, b in zip(after, before)]
    rounds = [a[1] - b[1] for a, b in zip(after, before)]
    early = sum(m.watch.ended.is_set() for m in members)    # a generation ended before the freeze: overload
    ready.wait()
    frozen_at = time.time()
    if 0 in ids:
        members[0].watch._stop.set()
    ended: list[float] = []
    waiting = [m for m in members if m.member != f"{0:012x}"]
    deadline = frozen_at + 15.0
    while waiting and time.time() < deadline:
        ended += [time.time() - frozen_at for m in waiting if m.watch.ended.is_set()]
        waiting = [m for m in waiting if not m.watch.ended.is_set()]
        time.sleep(0.01)
    results.put({"ops": ops, "rounds": rounds, "seconds": took, "ended_s": ended, "never": len(waiting),
                 "ended_early": early})
    results.close()
    results.join_thread()
    os._exit(0)     # watch threads inside store calls: no interpreter finalization (app/recovery/failures.py)


def measure(n: int, design: str, seconds: float, procs: int) -> dict[str, Any]:
    server = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False, timeout=timedelta(seconds=30))
    from app.cluster.secret import proof
    from app.ft.records import NAMESPACE

    keys = f"{NAMESPACE}/{JOB}/"
    server.set(keys + "latest", f"{GEN}|{proof(SECRET.encode(), keys + 'latest', str(GEN))}")
    server.set(f"{keys}{GEN}/reform", b"0")
    ctx = mp.get_context("spawn")
    results: mp.Queue = ctx.Queue()
    procs = min(procs, n)
    ready = ctx.Barrier(procs)
    workers = [ctx.Process(target=_worker, args=(server.port, range(p, n, procs), n, design, seconds, ready, results))
               for p in range(procs)]
    for w in workers:
        w.start()
    parts = [results.get(timeout=120 + seconds) for _ in workers]
    for w in workers:
        w.join()
    ops = [o for p in parts for o in p["ops"]]
    rounds = [r for p in parts for r in p["rounds"]]
    span = max(p["seconds"] for p in parts)
    ended = sorted(e for p in parts for e in p["ended_s"])
    return {"members": n, "design": design, "processes": procs, "seconds": round(span, 2),
            "ops_per_member_s": round(sum(ops) / len(ops) / span, 1),
            "ops_total_s": round(sum(ops) / span),
            "rounds_per_member_s": round(sum(rounds) / len(rounds) / span, 2),
            "slowest_member_rounds_s": round(min(rounds) / span, 2),
            "hung_member_seen_by_all_s": round(ended[-1], 2) if ended and not sum(p["never"] for p in parts) else None,
            "hung_member_seen_median_s": round(ended[len(ended) // 2], 2) if ended else None,
            "generation_ended_before_the_freeze": sum(p["ended_early"] for p in parts)}


def projection(design: str, rounds_s: float = 10.0) -> dict[int, dict[str, float]]:
    """Store operations a second beyond what was measured: 4 a round (new) or 2N+2 (old), 10 rounds a second."""
    per_round = {n: 4 if design == "new" else 2 * n + 2 for n in PROJECTED}
    return {n: {"ops_per_member_s": rounds_s * r, "ops_total_s": rounds_s * r * n} for n, r in per_round.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--members", default="2,8,64,256", help="comma-separated member counts")
    parser.add_argument("--seconds", type=float, default=10.0, help="how long the traffic is counted at each N")
    parser.add_argument("--processes", type=int, default=4, help="processes the members are spread over")
    parser.add_argument("--design", choices=("new", "old"), default="new")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    rows = []
    for n in [int(x) for x in args.members.split(",")]:
        row = measure(n, args.design, args.seconds, args.processes)
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {"command": "python -m bench.store_scale " + " ".join(f"--{k} {v}" for k, v in
                                                                   (("members", args.members), ("seconds", args.seconds),
                                                                    ("processes", args.processes), ("design", args.design))),
              "machine": f"{platform.node()}: {os.cpu_count()} cores, {platform.processor() or platform.machine()}",
              "date": time.strftime("%Y-%m-%d"), "measured": rows, "projected": projection(args.design)}
    previous = json.loads(args.out.read_text()) if args.out.exists() else {}
    previous[args.design] = result
    args.out.write_text(json.dumps(previous, indent=1) + "\n")
    print(json.dumps(result["projected"]))


if __name__ == "__main__":
    main()
