"""A disk that fills (ENOSPC, or a quota: EDQUOT) is the user's to fix, in one line naming the
dir, the bytes needed and the bytes free there: before a start writes anything
(:func:`check_room`, with the bytes the start writes), and wherever a write fails later
(:func:`on_full_disk`, and core/errors.py's find_user_error, which reads any such OSError as a
:class:`DiskFull`). What was written before stays whole: every record is replaced atomically
(core/run_dir.py's atomic_path) or, appended, cut back to its last whole line. Torch-free.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ddp_launcher.core.errors import UserError

FULL = (errno.ENOSPC, errno.EDQUOT)
# What a start writes besides its config files (Hydra's .hydra/, the log's first lines, the
# launcher's launch.json and lock, result.json): a margin over their few KiB.
START_MARGIN = 64 * 1024


class DiskFull(UserError):
    """No space (or quota) left where a run writes."""


def is_full(error: BaseException | None) -> bool:
    return isinstance(error, OSError) and error.errno in FULL


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


def disk_full(where: Path, what: str, needed: int | None = None, fix: str = "") -> DiskFull:
    """The one line: what could not be written, in which dir, the bytes it needs and those
    free there, and the fix."""
    where = Path(where)
    free = free_bytes(where)
    need = f"needs {fmt_bytes(needed)}" if needed else "needs more"
    have = f", {fmt_bytes(free)} free there" if free is not None else ""
    return DiskFull(
        f"no space left on the disk of {where} for {what} ({need}{have}): free space there"
        + (f", {fix}" if fix else "")
    )


def check_room(path: Path, needed: int, what: str, fix: str = "") -> None:
    """Before anything is written under `path`: a DiskFull when its disk has less than
    `needed` bytes free."""
    free = free_bytes(path)
    if free is not None and free < needed:
        raise disk_full(path, what, needed, fix)


@contextmanager
def on_full_disk(path: Path, what: str, needed: int | None = None, fix: str = "") -> Iterator[None]:
    """A write under `path` that fills the disk is a DiskFull naming it (`needed`: the bytes it
    writes, when known); any other error goes on as it is."""
    try:
        yield
    except OSError as e:
        if not is_full(e):
            raise
        raise disk_full(Path(path), what, needed, fix) from None


def from_os_error(error: OSError) -> DiskFull:
    """A DiskFull for a full-disk OSError raised anywhere (its file named where it says one)."""
    target = Path(str(error.filename)) if error.filename else Path.cwd()
    what = f"{target.name}" if error.filename else "a file"
    return disk_full(target.parent if error.filename else target, what)
