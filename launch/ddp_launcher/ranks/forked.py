"""A process forked from the warm start (an agent, or a rank of it) starts from the state a new
interpreter would have, and never from a parent that has called into the CUDA driver: torch
marks such a child a "bad fork" (its first CUDA call raises), with or without a GPU, so
tests/test_gpu_fork.py checks it on the CPU.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import signal
import sys
from typing import Any

from ddp_launcher.core.errors import UserError


class BadFork(UserError):
    """This process was forked after its parent had called into the CUDA driver."""


def check_not_a_bad_fork() -> None:
    """Stop with one line, before any CUDA call, in a process torch marks a CUDA bad fork (only
    a fork of a torch-importing parent can be one: this imports nothing)."""
    torch = sys.modules.get("torch")
    if torch is not None and in_bad_fork(torch):
        from ddp_launcher.core.app_command import app_command

        raise BadFork(
            f"rank {os.environ.get('RANK', '?')} (pid {os.getpid()}) was forked after its parent "
            f"(pid {os.getppid()}) called into the CUDA driver, so CUDA cannot work here: start "
            f"the ranks with torchrun or `{app_command()}`, and make no CUDA call (not even "
            "torch.cuda.is_available()) in a process before it forks ranks"
        )


def in_bad_fork(torch: Any) -> bool:
    """torch's bad-fork flag, read as torch reads it: torch.cuda._is_in_bad_fork is
    `getattr(torch._C, "_cuda_isInBadFork", lambda: False)` (torch/cuda/__init__.py), since
    torch's CPU-only builds do not compile the probe. torch.cuda comes with `import torch`,
    and the flag is a plain read: no CUDA call, no import."""
    return bool(torch.cuda._is_in_bad_fork())


def start_like_a_new_process() -> None:
    """Python's own signal handlers (the agent's SIGTERM handler would make its stop this rank's
    error), line-buffered output (torchrun runs `python -u`), the launcher's thread count
    (OpenMP read OMP_NUM_THREADS before this job's environment existed) and numpy's generator
    from fresh entropy (`random` reseeds itself after a fork; the task seeds torch's)."""
    for sig in signal.valid_signals() - {signal.SIGKILL, signal.SIGSTOP}:
        with contextlib.suppress(OSError, ValueError):
            signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGPIPE, signal.SIGXFSZ):
        signal.signal(sig, signal.SIG_IGN)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, ValueError):
            stream.reconfigure(line_buffering=True)
    threads = os.environ.get("OMP_NUM_THREADS", "")
    torch = sys.modules.get("torch")
    if torch is not None and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def freeze_imported() -> None:
    """gc.freeze() what is imported (it lives as long as the process): full collections no
    longer walk torch's ~360k objects (0.17 s each, 0.7 s at exit), nor copy their pages after
    a fork. Triton's nanobind bindings count what is frozen at exit as leaked (~30 lines,
    triton-lang/triton#11552): where they are loaded, it is unfrozen at exit."""
    gc.freeze()
    atexit.register(_unfreeze_for_nanobind)


def _unfreeze_for_nanobind() -> None:
    libtriton = sys.modules.get("triton._C.libtriton")
    if libtriton is not None and type(libtriton.ir.builder).__module__ == "nanobind":
        gc.unfreeze()
