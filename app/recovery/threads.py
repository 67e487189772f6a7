"""The background threads of a training process, none of which may die silently.

A thread that dies takes what it does with it (the inplace watch: every hung peer goes unnoticed;
a heartbeat: the same in elastic mode) while the main thread trains on as if nothing happened.
So every such thread is started here, and here it is decided what a failure in it means:
- what a thread meets in its work and can handle (a store that restarted or went away, a value
  no member signed) it handles itself, in its own loop, and goes on;
- anything else that escapes it (a bug, a case nobody foresaw) ends the node with one `error:`
  line (app/recovery/failures.py `leave`): the job then recovers without this node, as from any
  other lost node, instead of training on unprotected.
"""
from __future__ import annotations

import threading
from typing import Callable

from app.recovery import failures


def start(name: str, target: Callable[[], None]) -> threading.Thread:
    """Run `target` in a daemon thread named `name`; what escapes it ends the node."""
    thread = threading.Thread(target=guarded, args=(name, target), name=name, daemon=True)
    thread.start()
    return thread


def guarded(name: str, target: Callable[[], None]) -> None:
    """`target`, and one error line and the node's end if it raises."""
    try:
        target()
    except BaseException as exc:    # SystemExit too: a thread's sys.exit would end only itself
        failures.leave(f"error: the {name} thread of this training process failed ({type(exc).__name__}: "
                       f"{failures.first_line(exc)}); this node leaves so that the job recovers without it")
