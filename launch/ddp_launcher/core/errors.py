"""Errors that are the user's to fix: one line naming the fix, never a traceback.

A UserError is raised where the problem is found and reported once, by whoever runs the task:
ReportUserError below (a Hydra callback) in a process that runs its own Hydra job, or the rank
bootstrap (ddp_launcher/ranks/bootstrap.py) in ranks a launcher started. Nothing catches it between.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hydra.errors import CompactHydraException
from hydra.experimental.callback import Callback


class UserError(CompactHydraException):
    """Bad input (config, data, checkpoint, environment). The message names the fix."""

    exit_code = 2


class RunStopped(CompactHydraException):
    """`python app.py dist.nproc_per_node=N` was asked to stop (SIGTERM, SIGHUP): its ranks
    stopped the way preemption stops them and the run is recorded (ddp_launcher/torchrun.py).
    `exit_code`: 75 when they saved a checkpoint (as a 1-rank run's preemption: "requeue
    me"), else 128 + the signal's number."""

    exit_code = 1


def find_user_error(error: BaseException | None) -> UserError | None:
    """The UserError behind `error`, if any: Hydra's instantiate wraps what a target raises. A
    full disk (or quota) is one too, wherever it was hit (core/disk.py's DiskFull)."""
    return find_cause(error, lambda e: isinstance(e, UserError))


def find_cause(error: BaseException | None, wanted: Callable[[BaseException], bool]) -> Any:
    """The first of `error` and its causes that is `wanted`, or a full disk (or quota) met on
    the way, as a UserError (from_os_error); None if neither."""
    seen = set()
    while error is not None and id(error) not in seen:
        if wanted(error):
            return error
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return from_os_error(error)
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def config_error_line(error: BaseException) -> str | None:
    """A config that does not compose (Hydra's ConfigCompositionException, MissingConfigException,
    OverrideParseException or SearchPathException: errors of the command line and the config
    files, never of a job's code) as one line naming the fix; None for any other error. Hydra
    prints their messages over several lines (OmegaConf's full_key/object_type block, the
    options one per line, the config search path) and exits 1; HYDRA_FULL_ERROR=1 still shows
    them whole."""
    import re

    from hydra.errors import (
        ConfigCompositionException,
        MissingConfigException,
        OverrideParseException,
        SearchPathException,
    )

    if isinstance(error, SearchPathException):  # --config-dir, hydra.searchpath
        return f"{one_line(error)}: give --config-dir (or hydra.searchpath) a folder that exists"
    if not isinstance(
        error, (ConfigCompositionException, MissingConfigException, OverrideParseException)
    ):
        return None
    text = str(error)
    found = re.search(r"Could not find '([^']+)'", text)
    options = re.search(r"Available options in '([^']+)':\n((?:\t.*\n?)+)", text)
    if found and options:  # a group's option that does not exist
        path = found.group(1)
        group, _, name = path.rpartition("/")
        names = ", ".join(line.strip() for line in options.group(2).splitlines() if line.strip())
        return f"{group}={name}: {group} has no option {name}: use one of {names}"
    typo = re.match(r"Could not override '([^']+)'\.", text)
    if typo:  # a key the config does not have (Hydra suggests +key, which adds it)
        key = typo.group(1)
        near = nearest_key(key, getattr(error.__cause__, "parent_node", None))
        if near:
            fix = f"did you mean {near}?"
        else:
            from ddp_launcher.core.app_command import app_command

            fix = f"`{app_command()} --cfg job` prints the keys it has"
        return f"{key}: the config has no such key: {fix}"
    merging = re.match(r"Error merging override (.+)", text)
    if merging:  # a value of the wrong type, or not one of an enum's (said by the cause)
        said = text.splitlines()[1:2] or str(error.__cause__ or "").splitlines()[:1]
        return f"{merging.group(1)}: {said[0].strip()}" if said else one_line(text)
    lines = [line.strip() for line in text.splitlines()]
    kept = [line for line in lines if line and not re.match(r"(full_key|\w+_type)[:=]", line)]
    return one_line("; ".join(kept)) if kept else None


def nearest_key(key: str, parent: Any) -> str | None:
    """The key of `parent` (the config node `key` was looked up in) closest to `key`'s last
    part, as a full key; None when none is close or `parent` is not a node with keys."""
    import difflib

    try:
        names = [str(k) for k in parent]
    except Exception:  # (not a DictConfig, or one that cannot list its keys)
        return None
    head, _, last = key.rpartition(".")
    close = difflib.get_close_matches(last, names, n=1, cutoff=0.6)
    return f"{head}.{close[0]}" if close and head else (close[0] if close else None)


# What a rank's collective raises when another rank of its job died (gloo, NCCL)
PEER_LOST = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "remote process exited",
    "NCCL communicator was aborted",
)
# what such a rank says instead of its traceback (the cause is in the other rank's report)
PEER_FAILED_FIRST = "stopped: another rank failed first (its error says why)"


def lost_a_peer(error: BaseException) -> bool:
    """Whether a rank failed only because another rank of its job did."""
    return find_user_error(error) is None and any(p in str(error) for p in PEER_LOST)


def job_value(ret: Any) -> Any:
    """A JobReturn's value, or a failed job's exception, without raising it. Hydra's public
    `JobReturn.return_value` raises a failed job's exception (after printing a line to stderr)
    and offers no other getter: this is the one place that reads the private field."""
    return ret._return_value


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


def instantiate(node, **kwargs):
    """Hydra's instantiate, re-raising a UserError its target raised as itself (Hydra wraps it
    in a multi-line InstantiationException); a missing mandatory value (`???`) is one too."""
    from hydra.utils import instantiate as hydra_instantiate
    from omegaconf.errors import MissingMandatoryValue

    try:
        return hydra_instantiate(node, **kwargs)
    except MissingMandatoryValue as e:  # a `???` the user had to fill in
        key = e.full_key or "a mandatory key"
        raise UserError(f"{key} is required: set {key}=<value>") from None
    except Exception as e:
        user_error = find_user_error(e)
        if user_error is None:
            raise
        raise user_error from None


def said_logger(name: str) -> logging.Logger:
    """The package's logger `name` (a module's) for a line the user must see: a refusal, a user
    error. An app's job logging with `disable_existing_loggers: true` (logging.config's default
    where the key is left out) disables every logger made before it, as the package's modules
    make theirs at import: this one speaks all the same, through the root's handlers."""
    logger = logging.getLogger(name)
    logger.disabled = False
    return logger


class ReportUserError(Callback):
    """Reports a user error of a plain Hydra run (`python app.py`, or each rank under plain
    torchrun) as one log line (console and the job's log) and exits with UserError.exit_code,
    before Hydra would print the error between lines of its own. Any other failure, and every
    job of a sweep (its launcher reports those), is left to Hydra."""

    def on_job_end(self, config: Any, job_return: Any, **kwargs: Any) -> None:
        from hydra.core.utils import JobStatus
        from hydra.types import RunMode

        if job_return.status != JobStatus.FAILED or config.hydra.mode != RunMode.RUN:
            return
        failure = job_value(job_return)
        error = failure if isinstance(failure, RunStopped) else find_user_error(failure)
        if error is not None:
            if not getattr(failure, "already_said", False):  # (by the rank that hit it)
                said_logger(__name__).error("%s", error)
            raise SystemExit(error.exit_code)
        # (plain torchrun: rank 0 said why; Hydra's traceback, no)
        if os.environ.get("RANK", "0") != "0" and lost_a_peer(failure):
            said_logger(__name__).error("%s", PEER_FAILED_FIRST)
            raise SystemExit(1)


# A full disk (or quota): the user's to fix, in one line (core/disk.py checks for room first)


class DiskFull(UserError):
    """No space (or quota) left where a run writes."""


def is_full(error: BaseException | None) -> bool:
    return isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT)


def fmt_bytes(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def nearest_dir(path: Path) -> Path:
    """`path`, or its nearest parent that exists."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path if path.is_dir() else path.parent


def free_bytes(path: Path) -> int | None:
    """The bytes an unprivileged writer may still use on the disk of `path` (None: unknown)."""
    try:
        stat = os.statvfs(nearest_dir(path))
    except OSError:
        return None
    return stat.f_bavail * stat.f_frsize


def free_inodes(path: Path) -> int | None:
    """The files an unprivileged writer may still make on the disk of `path` (None: unknown, or
    a file system that does not count them)."""
    try:
        stat = os.statvfs(nearest_dir(path))
    except OSError:
        return None
    return stat.f_favail if stat.f_files else None


def disk_full(where: Path, what: str, needed: int | None = None, fix: str = "") -> DiskFull:
    """The one line: what could not be written, in which dir, the bytes it needs and those
    free there, and the fix."""
    where = Path(where)
    free = free_bytes(where)
    if free_inodes(where) == 0:  # (ENOSPC too: bytes free, no file can be made)
        return DiskFull(
            f"no inode left on the disk of {where} for {what} (no new file can be made there, "
            f"{fmt_bytes(free or 0)} free): remove files there" + (f", {fix}" if fix else "")
        )
    need = f"needs {fmt_bytes(needed)}" if needed else "needs more"
    have = f", {fmt_bytes(free)} free there" if free is not None else ""
    return DiskFull(
        f"no space left on the disk of {where} for {what} ({need}{have}): free space there"
        + (f", {fix}" if fix else "")
    )


def from_os_error(error: OSError) -> DiskFull:
    """A DiskFull for a full-disk OSError raised anywhere (its file named where it says one)."""
    target = Path(str(error.filename)) if error.filename else Path.cwd()
    what = f"{target.name}" if error.filename else "a file"
    return disk_full(target.parent if error.filename else target, what)
