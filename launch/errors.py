"""Errors that are the user's to fix: shown as one line naming the fix, never a traceback."""


class UserError(Exception):
    """Bad input (config, data, checkpoint, environment). The message names the fix."""

    exit_code = 2
