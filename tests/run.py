"""`make test`: the suite in two passes, so that it fits CI's time on two cores.

    python -m tests.run                  # every tier
    python -m tests.run -m unit          # the tests a pytest marker expression selects

First pass: every test not marked `serial`, one per core at a time (pytest-xdist). Most of such a
test's wall time here is a process waiting on another (an import, a rendezvous, a timeout it
provokes), so two of them share the cores well. Second pass: the tests marked `serial`, one at a
time with the machine to themselves: those that bound a time tightly or listen on a fixed port, and
every test of the docker and slurm tiers (tests/conftest.py marks them), which hold the engine or the
cluster and bound recoveries in seconds.

The exit status is the first pass's failure, else the second's; a pass that selects no test is not
a failure (pytest's status 5), unless neither selects one.
"""
from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from collections.abc import Sequence

NO_TESTS = 5            # pytest's exit status when nothing was selected


def passes(expression: str | None, workers: int) -> list[list[str]]:
    """The two pytest command lines: the parallel pass, then the serial one."""
    def only(part: str) -> str:
        return f"({expression}) and {part}" if expression else part

    parallel = ["-n", str(workers)] if workers > 1 else []
    return [["-m", only("not serial"), *parallel], ["-m", only("serial")]]


def combined(statuses: Sequence[int]) -> int:
    """The first failure's status; NO_TESTS only when no pass selected a test."""
    failed = [s for s in statuses if s not in (0, NO_TESTS)]
    if failed:
        return failed[0]
    return NO_TESTS if all(s == NO_TESTS for s in statuses) else 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-m", dest="expression", help="a pytest marker expression (make test's TESTS=)")
    p.add_argument("-n", dest="workers", type=int, default=os.cpu_count() or 1,
                   help="processes of the first pass (default: one per core)")
    args, extra = p.parse_known_args(argv)
    statuses = []
    for selection in passes(args.expression, args.workers):
        command = [sys.executable, "-m", "pytest", *selection, *extra]
        print("$ " + shlex.join(["python", *command[1:]]), flush=True)
        statuses.append(subprocess.run(command, check=False).returncode)
    return combined(statuses)


if __name__ == "__main__":
    sys.exit(main())
