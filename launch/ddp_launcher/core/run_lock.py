"""One holder per run dir: `<run dir>/.run.lock`, an flock held for the run's whole life by the
process that starts it (the gate, ddp_launcher/core/gate.py), naming its holder (pid, host, since
when).

The kernel drops an flock however its holder ends, so a lock file whose flock is free but that
still names a holder was left by a process that died (SIGKILL, a lost node): the next start
takes it over and says so. Processes the holder starts for the same run (its ranks) learn from
HELD_ENV that the dir is held for them: it names the holder's pid, host and run dir, and counts
only in a process that holder started, while it holds the lock. A refused start never creates
or changes the file: :func:`holder` only reads it, and :func:`acquire` runs once every check has
passed (:func:`give_back` undoes it when a later step of the start fails).

The lock is only a lock: it is opened without following a symlink and used only when it is a
regular file of its own (one link) inside the run dir, so no start ever writes through it into
another file. A file system without flock (NFS or Lustre mounted without it) is refused, unless
the start is told to run without a lock (the gate's `lock: false`, ddp_launcher/core/gate.py).
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import logging
import os
import socket
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from ddp_launcher.core.errors import UserError

log = logging.getLogger(__name__)

LOCK_FILE = ".run.lock"
# "<pid> <host> <run dir (absolute)>" of the process that holds that run dir and started these
# processes for it: they need not lock it again.
HELD_ENV = "HYDRA_DDP_RUN_DIR_HELD"
# Said when flock is unavailable and no opt-out key is known (an app without the gate).
NO_LOCK_FIX = "add ddp_launcher.RunGate to hydra.callbacks with lock: false"


@dataclass
class Held:
    path: Path
    fd: int
    pid: int  # the holder (a process forked from it holds nothing)
    created: bool  # this start made the file (undone: it goes)
    previous: bytes  # what the file said before (undone: it says that again)


_HELD: dict[str, Held] = {}


def _key(run_dir: Path) -> str:
    return str(Path(run_dir).resolve())


def held_for_me(run_dir: Path) -> bool:
    """True where this process (or the process that started it for this run) holds the dir."""
    return _key(run_dir) in _HELD or _inherited(run_dir)


def _inherited(run_dir: Path) -> bool:
    """HELD_ENV names this run dir, this host and a pid that is this process or one of its
    ancestors, and that pid holds the lock now: an environment copied elsewhere (another shell,
    a job started from inside a run) counts for nothing."""
    pid, host, path = (os.environ.get(HELD_ENV, "").split(" ", 2) + ["", ""])[:3]
    if not pid.isdigit() or host != socket.gethostname() or path != _key(run_dir):
        return False
    if int(pid) not in _ancestors():
        return False
    who = holder(run_dir)
    return who is not None and who.startswith(f"pid {pid} on {host} ")


def _ancestors() -> set[int]:
    """This process and its ancestors (Linux /proc; elsewhere this process and its parent)."""
    found, pid = {os.getpid(), os.getppid()}, os.getppid()
    for _ in range(64):
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])  # field 4: ppid
        except (OSError, ValueError, IndexError):
            break
        if pid <= 1:
            break
        found.add(pid)
    return found


def not_a_lock(path: Path, what: str) -> UserError:
    return UserError(
        f"{path} is {what}, not a run's lock file: a start never writes through it: move it "
        "away (or choose another output dir)"
    )


def _open(path: Path, flags: int) -> int:
    """`path` opened with `flags`, never through a symlink, and only as a regular file with one
    link (else a UserError naming what it is); a fifo does not block."""
    flags |= os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP or path.is_symlink():
            raise not_a_lock(path, "a symlink") from None
        if e.errno == errno.EISDIR:
            raise not_a_lock(path, "a directory") from None
        raise
    info = os.fstat(fd)
    what = None
    if not stat.S_ISREG(info.st_mode):
        what = "a directory" if stat.S_ISDIR(info.st_mode) else "not a regular file"
    elif info.st_nlink != 1:
        what = f"a hard link ({info.st_nlink} names of one file)"
    if what is not None:
        os.close(fd)
        raise not_a_lock(path, what)
    return fd


def holder(run_dir: Path) -> str | None:
    """Who holds `run_dir` now ("pid 123 on host, since 12:00:01"), or None when nobody does;
    changes nothing. A file left by a dead holder counts as free; so does anything that is not
    a lock file (acquire refuses it)."""
    path = Path(run_dir) / LOCK_FILE
    try:
        fd = _open(path, os.O_RDONLY)
    except (OSError, UserError):
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


def _read_bytes(fd: int) -> bytes:
    with contextlib.suppress(OSError):
        return os.pread(fd, 4096, 0)
    return b""


def acquire(run_dir: Path, what: str, *, opt_out: str = NO_LOCK_FIX) -> None:
    """Hold `run_dir` for the rest of this process's life (or until :func:`release`): a second
    holder is a UserError naming the first; a lock left by a dead holder is taken over with a
    warning. A file system without flock is a UserError naming `opt_out` (how to start without
    a lock); the file this call made is gone again then."""
    run_dir = Path(run_dir)
    if held_for_me(run_dir):
        return
    path = run_dir / LOCK_FILE
    while True:
        created = False
        try:
            fd = _open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL)
            created = True
        except FileExistsError:
            fd = _open(path, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            who = _read(fd) or "another process"
            _drop(fd, path, created)
            raise UserError(
                f"{run_dir} is in use by {who}: wait for it to end (or stop it), or choose "
                "another output dir"
            ) from None
        except OSError as e:
            _drop(fd, path, created)
            raise UserError(
                f"cannot lock {path} ({e.strerror or e}): its file system has no flock (NFS or "
                f"Lustre mounted without it?): {opt_out} starts without a lock (then make sure "
                "nothing else writes this run dir), or choose an output dir on a file system "
                "with flock"
            ) from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path, follow_symlinks=False).st_ino
        except FileNotFoundError:
            same = False
        if same:  # else its last holder removed it as we opened it: open the new one
            break
        os.close(fd)
    previous = b"" if created else _read_bytes(fd)
    if previous.strip():
        log.warning(
            "%s: took over the lock of %s, which ended without releasing it",
            run_dir,
            previous.decode(errors="replace").strip(),
        )
    since = time.strftime("%Y-%m-%d %H:%M:%S")
    text = f"pid {os.getpid()} on {socket.gethostname()} ({what}, since {since})\n"
    held = Held(path, fd, os.getpid(), created, previous)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, text.encode(), 0)
    except BaseException:
        _undo(held)
        raise
    if not _HELD:
        atexit.register(release_all)
    _HELD[_key(run_dir)] = held


def _drop(fd: int, path: Path, created: bool) -> None:
    """Close a lock file this start opened but does not hold; the one it made goes."""
    if created:
        with contextlib.suppress(OSError):
            path.unlink()
    os.close(fd)


def _undo(held: Held) -> None:
    """The lock file as it was before this start: made by it, removed; taken over, its earlier
    words written back."""
    try:
        if held.created:
            held.path.unlink(missing_ok=True)
        else:
            os.ftruncate(held.fd, 0)
            os.pwrite(held.fd, held.previous, 0)
    finally:
        os.close(held.fd)


def give_back(run_dir: Path) -> None:
    """Undo :func:`acquire` for a start that was refused after it: the lock file is as it was
    (gone when the start made it)."""
    held = _HELD.pop(_key(run_dir), None)
    if held is not None and held.pid == os.getpid():
        _undo(held)


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
    """The environment entry that tells processes this one starts for the run that it holds
    the run dir for them (:func:`held_for_me`)."""
    held = _HELD.get(_key(run_dir))
    pid = held.pid if held is not None else os.getpid()
    return {HELD_ENV: f"{pid} {socket.gethostname()} {_key(run_dir)}"}


def hold_file(path: Path, *, opt_out: str = NO_LOCK_FIX) -> tuple[int, bool, bytes] | None:
    """An flock on the lock file `path` (another launcher's: BlockingIOError), opened as
    :func:`acquire` opens one: (fd, whether this call made it, what it said before); a file
    system without flock is a UserError naming `opt_out`."""
    created = False
    try:
        fd = _open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL)
        created = True
    except FileExistsError:
        fd = _open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)  # (another's: never removed)
        raise
    except OSError as e:
        _drop(fd, path, created)
        raise UserError(
            f"cannot lock {path} ({e.strerror or e}): its file system has no flock (NFS or "
            f"Lustre mounted without it?): {opt_out} starts without a lock (then make sure no "
            "other launcher uses this sweep dir), or choose a sweep dir on a file system with "
            "flock"
        ) from None
    return fd, created, b"" if created else _read_bytes(fd)
