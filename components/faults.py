"""Fault injection for the fault-tolerance tests: HYDRA_DDP_FAULT="<kind>@<step>[:<rank>]".

kinds: `raise` (an exception), `kill` (SIGKILL this rank), `nan` (this rank's loss becomes NaN).
Read once at start; with the variable unset (always, outside tests) every call is a no-op. The
fault is the first attempt's: restarted ranks (torchrun) and later attempts of a sweep job (a
launcher retry or a resumed sweep) run clean.
"""

from __future__ import annotations

import os
import signal

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
    return loss
