"""A bench's lines as it goes, on stderr: a run stopped at its limit (bench/gpu_report.py) still shows
how far it got and when."""
from __future__ import annotations

import sys
import time


def say(began: float, what: str) -> None:
    """One line: seconds since `began` (time.monotonic()), then what happened."""
    print(f"[{time.monotonic() - began:5.0f} s] {what}", file=sys.stderr, flush=True)
