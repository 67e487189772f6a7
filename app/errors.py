"""The one exception type that reaches the user as a single line instead of a traceback."""


class UserError(Exception):
    """Bad input (config, dataset, checkpoint, environment) that the user can fix.

    The entry point prints it as one `error: ...` line and exits with status 2.
    """
