"""One holder per run dir: `<run dir>/.run.lock`, an flock held for the run's whole life by the
process that starts it (the gate, ddp_launcher/core/gate.py), naming its holder (pid, host, since
when).

The kernel drops an flock however its holder ends, so a lock file whose flock is free but that
still names a holder was left by a process that died (SIGKILL, a lost node): the next start
takes it over and says so. Processes the holder starts for the same run (its ranks) learn from
HELD_ENV that the dir is held for them. A refused start never creates or changes the file:
:func:`holder` only reads it, and :func:`acquire` runs once every check has passed.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import logging
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from ddp_launcher.core.errors import UserError

log = logging.getLogger(__name__)

LOCK_FILE = ".run.lock"
# The run dir (absolute) its holder started these processes for: they need not lock it again.
HELD_ENV = "HYDRA_DDP_RUN_DIR_HELD"


@dataclass
class Held:
    path: Path
    fd: int
    pid: int  # the holder (a process forked from it holds nothing)


_HELD: dict[str, Held] = {}


def _key(run_dir: Path) -> str:
    return str(Path(run_dir).resolve())


def held_for_me(run_dir: Path) -> bool:
    """True where this process (or the process that started it for this run) holds the dir."""
    return _key(run_dir) in _HELD or os.environ.get(HELD_ENV) == _key(run_dir)


def holder(run_dir: Path) -> str | None:
    """Who holds `run_dir` now ("pid 123 on host, since 12:00:01"), or None when nobody does;
    changes nothing. A file left by a dead holder counts as free."""
    path = Path(run_dir) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _read(fd) or "another process"
    except OSError:  # a file system without flock: nothing to tell
        return None
    finally:
        os.close(fd)
    return None


def _read(fd: int) -> str:
    with contextlib.suppress(OSError):
        return os.pread(fd, 512, 0).decode(errors="replace").strip()
    return ""


def acquire(run_dir: Path, what: str) -> None:
    """Hold `run_dir` for the rest of this process's life (or until :func:`release`): a second
    holder is a UserError naming the first; a lock left by a dead holder is taken over with a
    warning. File systems without flock: a warning, no lock."""
    run_dir = Path(run_dir)
    if held_for_me(run_dir):
        return
    path = run_dir / LOCK_FILE
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            who = _read(fd) or "another process"
            os.close(fd)
            raise UserError(
                f"{run_dir} is in use by {who}: wait for it to end (or stop it), or choose "
                "another output dir"
            ) from None
        except OSError as e:
            os.close(fd)
            log.warning("cannot lock %s (%s): make sure nothing else writes this run dir", path, e)
            return
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:  # else its last holder removed it as we opened it: open the new one
            break
        os.close(fd)
    stale = _read(fd)
    if stale:
        log.warning(
            "%s: took over the lock of %s, which ended without releasing it", run_dir, stale
        )
    since = time.strftime("%Y-%m-%d %H:%M:%S")
    text = f"pid {os.getpid()} on {socket.gethostname()} ({what}, since {since})\n"
    os.ftruncate(fd, 0)
    os.pwrite(fd, text.encode(), 0)
    if not _HELD:
        atexit.register(release_all)
    _HELD[_key(run_dir)] = Held(path, fd, os.getpid())


def release(run_dir: Path) -> None:
    """Give `run_dir` up: the lock file goes (a run that ended leaves none behind)."""
    held = _HELD.pop(_key(run_dir), None)
    if held is None or held.pid != os.getpid():
        return
    with contextlib.suppress(OSError):
        held.path.unlink()
    os.close(held.fd)


def release_all() -> None:
    for key in list(_HELD):
        release(Path(key))


def child_env(run_dir: Path) -> dict[str, str]:
    """The environment entry that tells processes started for this run that it is held."""
    return {HELD_ENV: _key(run_dir)}
