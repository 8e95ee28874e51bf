"""OS errors injected where a path is written, for the tests of the gate's guard (the product has
no hook for it): `HYDRA_DDP_OS_FAULT="<ERRNO>@<op>@<glob>[;<another>...]"`, e.g.
`ENOSPC@replace@*/replaced/*`, makes every `<op>` on a path matching `<glob>` (absolute paths,
fnmatch) raise OSError(<ERRNO>), as a full disk, a read-only mount or a file system without flock
would. Torch-free; a test process installs it with :func:`failing` (undone when the block ends),
a process a test starts through tests/fault_injection/sitecustomize.py (tests/helpers.py's
run_env adds it when the variable is set).

ops: `open` (opening for writing: os.open with a write or create flag, open() and io.open in a
writing mode), `mkdir`, `replace` (os.replace and os.rename, either path), `flock`
(fcntl.flock on a file whose path matches), `any` (all of them).
"""

from __future__ import annotations

import builtins
import errno
import fcntl
import fnmatch
import io
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

ENV = "HYDRA_DDP_OS_FAULT"
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
OPS = ("open", "mkdir", "replace", "flock", "any")


@dataclass(frozen=True)
class Fault:
    code: int
    op: str
    glob: str

    def hits(self, op: str, path: object) -> bool:
        if self.op not in (op, "any") or not isinstance(path, str | bytes | os.PathLike):
            return False
        text = os.fsdecode(os.fspath(path))
        return fnmatch.fnmatch(os.path.abspath(text), self.glob)


def parse(spec: str) -> list[Fault]:
    """`ENOSPC@replace@*/replaced/*;EACCES@open@*/.run.lock` -> its faults."""
    faults = []
    for part in filter(None, spec.split(";")):
        name, op, glob = part.split("@", 2)
        if op not in OPS:
            raise ValueError(f"{ENV}: op {op!r} is not one of {OPS}")
        faults.append(Fault(getattr(errno, name), op, glob))
    return faults


def _patches(faults: list[Fault]) -> dict[tuple[object, str], object]:
    """{(module, name): the wrapper} for every function an injected fault can come from."""
    real_open, real_mkdir = os.open, os.mkdir
    real_replace, real_rename = os.replace, os.rename
    real_builtin_open, real_flock = builtins.open, fcntl.flock

    def check(op: str, *paths: object) -> None:
        for fault in faults:
            for path in paths:
                if fault.hits(op, path):
                    raise OSError(fault.code, os.strerror(fault.code), os.fsdecode(path))

    def os_open(path, flags, mode=0o777, *, dir_fd=None):
        if flags & WRITE_FLAGS:
            check("open", path)
        return real_open(path, flags, mode, dir_fd=dir_fd)

    def open_(file, mode="r", *args, **kwargs):
        if any(c in mode for c in "wax+"):
            check("open", file)
        return real_builtin_open(file, mode, *args, **kwargs)

    def mkdir(path, mode=0o777, *, dir_fd=None):
        check("mkdir", path)
        return real_mkdir(path, mode, dir_fd=dir_fd)

    def replace(src, dst, *, src_dir_fd=None, dst_dir_fd=None):
        check("replace", src, dst)
        return real_replace(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)

    def rename(src, dst, *, src_dir_fd=None, dst_dir_fd=None):
        check("replace", src, dst)
        return real_rename(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)

    def flock(fd, operation):
        number = fd if isinstance(fd, int) else fd.fileno()
        try:
            path = os.readlink(f"/proc/self/fd/{number}")
        except OSError:
            path = ""
        check("flock", path)
        return real_flock(fd, operation)

    return {
        (os, "open"): os_open,
        (os, "mkdir"): mkdir,
        (os, "replace"): replace,
        (os, "rename"): rename,
        (builtins, "open"): open_,
        (io, "open"): open_,
        (fcntl, "flock"): flock,
    }


@contextmanager
def failing(spec: str) -> Iterator[None]:
    """In this process, while the block runs: `spec`'s faults (see the module docstring)."""
    patches = _patches(parse(spec))
    saved = {key: getattr(*key) for key in patches}
    for (module, name), wrapper in patches.items():
        setattr(module, name, wrapper)
    try:
        yield
    finally:
        for (module, name), original in saved.items():
            setattr(module, name, original)


def install() -> None:
    """In a process started with HYDRA_DDP_OS_FAULT (tests/fault_injection/sitecustomize.py)."""
    spec = os.environ.get(ENV)
    if spec:
        for (module, name), wrapper in _patches(parse(spec)).items():
            setattr(module, name, wrapper)
