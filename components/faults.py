"""Fault injection for the fault-tolerance tests: HYDRA_DDP_FAULT="<kind>@<step>[:<rank>]".

kinds: `raise` (an exception), `kill` (SIGKILL this rank), `nan` (this rank's loss becomes NaN),
`stall` (this rank waits, up to STALL_MAX_S, until a signal reaches it: a test that stops a job
knows the job is still running, however fast the job or slow the machine). Read once at start;
with the variable unset (always, outside tests) every call is a no-op. The fault is the first
attempt's: restarted ranks (torchrun) and later attempts of a sweep job (a launcher retry or a
resumed sweep) run clean.
"""

from __future__ import annotations

import os
import select
import signal
import threading

import torch

from core.run_dir import ATTEMPT_ENV


class InjectedFault(RuntimeError):
    pass


def _parse(spec: str | None) -> tuple[str, int, int | None] | None:
    if not spec:
        return None
    kind, _, where = spec.partition("@")
    step, _, rank = where.partition(":")
    return kind, int(step), int(rank) if rank else None


FAULT = _parse(os.environ.get("HYDRA_DDP_FAULT"))
STALL_MAX_S = 120.0


def stall(max_s: float) -> None:
    """Wait until a signal arrives (its handler runs as usual: the preemption flag is set) or
    `max_s` passed. Python's wakeup fd gets a byte per signal without taking it from the
    handler; a sleep would resume after the handler and wait on."""
    if threading.current_thread() is not threading.main_thread():
        return
    read, write = os.pipe()
    os.set_blocking(write, False)
    previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    try:
        select.select([read], [], [], max_s)
    finally:
        signal.set_wakeup_fd(previous)
        os.close(read)
        os.close(write)


def inject(step: int, rank: int, loss: torch.Tensor) -> torch.Tensor:
    """Called once per step with the step number about to complete."""
    if FAULT is None or FAULT[1] != step or FAULT[2] not in (None, rank):
        return loss
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return loss  # a restarted worker runs clean: the fault was the first attempt's
    if int(os.environ.get(ATTEMPT_ENV) or 1) > 1:
        return loss  # so does a job the launcher started again
    kind = FAULT[0]
    if kind == "raise":
        raise InjectedFault(f"injected fault at step {step} on rank {rank}")
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "nan":
        return loss * float("nan")
    if kind == "stall":
        stall(STALL_MAX_S)
    return loss
