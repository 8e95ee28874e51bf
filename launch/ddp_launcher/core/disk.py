"""A disk that fills (ENOSPC, or a quota: EDQUOT) is the user's to fix, in one line naming the
dir, the bytes needed and the bytes free there (core/errors.py's DiskFull): before a start
writes anything (:func:`check_room`, with the bytes the start writes), and wherever a write
fails later (:func:`on_full_disk`; errors.py's find_user_error reads any such OSError as one).
What was written before stays whole: every record is replaced atomically (core/run_dir.py's
atomic_path) or, appended, cut back to its last whole line. Torch-free.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ddp_launcher.core.errors import DiskFull, disk_full, fmt_bytes, free_bytes, is_full

__all__ = ["START_MARGIN", "DiskFull", "check_room", "fmt_bytes", "free_bytes", "on_full_disk"]

# What a start writes besides its config files (Hydra's .hydra/, the log's first lines, the
# launcher's launch.json and lock, result.json): a margin over their few KiB.
START_MARGIN = 64 * 1024


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
