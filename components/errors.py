"""Errors that are the user's to fix: one line naming the fix, never a traceback.

A UserError is raised where the problem is found and reported once, by whoever runs the task:
Hydra itself in a single process (it prints a CompactHydraException as its message alone; the
entry point turns the exit status into UserError.exit_code), or the rank bootstrap
(launch/rank.py) in ranks that a launcher started. Nothing catches it in between.
"""

from __future__ import annotations

from hydra.errors import CompactHydraException


class UserError(CompactHydraException):
    """Bad input (config, data, checkpoint, environment). The message names the fix."""

    exit_code = 2


def find_user_error(error: BaseException | None) -> UserError | None:
    """The UserError behind `error`, if any: Hydra's instantiate wraps what a target raises."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, UserError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def one_line(text: object) -> str:
    """The first non-empty line of `text`, stripped ("" for none)."""
    for line in str(text).strip().splitlines():
        if line.strip():
            return line.strip()
    return ""


def describe(error: BaseException) -> str:
    """One line for an exception: a user error's message, or any CompactHydraException's (what
    Hydra prints alone), else `Type: first line`."""
    user_error = find_user_error(error)
    if user_error is not None:
        return one_line(user_error)
    text = one_line(error)
    if isinstance(error, CompactHydraException) and text:
        return text
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
