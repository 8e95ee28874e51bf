"""Errors that are the user's to fix: shown as one line naming the fix, never a traceback."""


class UserError(Exception):
    """Bad input (config, data, checkpoint, environment). The message names the fix."""

    exit_code = 2


def find_user_error(error: BaseException | None) -> UserError | None:
    """The UserError behind `error`, if any: Hydra's instantiate wraps what a target raises."""
    while error is not None:
        if isinstance(error, UserError):
            return error
        error = error.__cause__
    return None
