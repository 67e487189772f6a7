"""The one exception type that reaches the user as a single line instead of a traceback, the end of a
process that came to a finished job, and the form of a warning."""
from __future__ import annotations

import sys
from typing import Callable


class UserError(Exception):
    """Bad input (config, dataset, checkpoint, environment) that the user can fix.

    The entry point prints it as one `error: ...` line and exits with status 2.
    """


class JobOver(Exception):
    """The job this process trains for has finished (a survivor mode's done mark): it leaves without
    training. No error: the entry point prints the line and exits with status 0."""


def one_line_errors(command: Callable[[], int | None]) -> int:
    """Run a command-line entry point: a UserError becomes its one `error:` line and exit status 2."""
    try:
        return command() or 0
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2


def warning(line: str) -> str:
    """The one form of a warning: a line on stderr that starts with `warning: `."""
    return f"warning: {line}"
