"""The one exception type that reaches the user as a single line instead of a traceback, and the form of a warning."""
from __future__ import annotations

import sys
from typing import Callable


class UserError(Exception):
    """Bad input (config, dataset, checkpoint, environment) that the user can fix.

    The entry point prints it as one `error: ...` line and exits with status 2.
    """


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
