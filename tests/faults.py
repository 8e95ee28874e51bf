"""Fault injection for the fault-tolerance tests, the suite's own (the product has no hook for
it): HYDRA_DDP_FAULT="<kind>@<step>[:<rank>][/<job>][,<another>...]" (`/<job>`: in that sweep job
only). tests/helpers.py's run_env puts tests/fault_injection/ first on the PYTHONPATH of a
process started with the variable: its sitecustomize calls :func:`install`, which wraps
components/train_step.py's TrainStep as it is imported, so that every micro-batch's forward
of a training step passes its output through :func:`inject`.

kinds: `raise` (an exception), `kill` (SIGKILL this rank), `nan` (this rank's loss becomes NaN),
`stall` (at its step this rank waits, up to STALL_MAX_S, until a signal has reached it: a test
that stops a job knows the job is still running, however fast the job or slow the machine).
In a sweep, a `raise` in one job waits (up to STALL_MAX_S) until a `stall` of another job has
begun, so the failure stops the stalled job at its stall step, whichever job started first.
Read once at start; with the variable unset (always, outside tests) every call is a no-op. The
fault is the first attempt's: restarted ranks (torchrun) and later attempts of a sweep job (a
launcher retry or a resumed sweep) run clean.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.util
import os
import select
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (torch-free at import: it is installed before any module loads)
    import torch

# The attempt number a launcher gives a sweep job's processes (ddp_launcher's run_dir.py)
ATTEMPT_ENV = "HYDRA_DDP_ATTEMPT"
TRAIN_STEP = "components.train_step"


class InjectedFault(RuntimeError):
    pass


def _parse(specs: str | None) -> list[tuple[str, int, int | None, int | None]]:
    faults = []
    for spec in (specs or "").split(","):
        if not spec:
            continue
        kind, _, where = spec.partition("@")
        where, _, job = where.partition("/")
        step, _, rank = where.partition(":")
        faults.append((kind, int(step), int(rank) if rank else None, int(job) if job else None))
    return faults


FAULTS = _parse(os.environ.get("HYDRA_DDP_FAULT"))
STALL_MAX_S = 120.0


class Stall:
    """The `stall` fault: from the rank's first step on, every signal it gets is noted (Python's
    wakeup fd: a byte per signal, while the handler runs as usual and sets the preemption flag),
    and at the stall step it waits until one has come, at once if one came before. A sleep would
    resume after the handler and wait on; a wait armed only at the stall step would miss a stop
    that came a moment before it."""

    def __init__(self) -> None:
        self.pipe: tuple[int, int] | None = None
        self.previous = -1

    def arm(self) -> None:
        if self.pipe is None and threading.current_thread() is threading.main_thread():
            read, write = os.pipe()
            os.set_blocking(write, False)
            self.previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
            self.pipe = (read, write)

    def wait(self, max_s: float) -> None:
        self.arm()
        if self.pipe is None:
            return
        read, write = self.pipe
        try:
            select.select([read], [], [], max_s)
        finally:
            signal.set_wakeup_fd(self.previous)
            os.close(read)
            os.close(write)
            self.pipe = None


STALL = Stall()


def inject(step: int, rank: int, loss: torch.Tensor) -> torch.Tensor:
    """Called once per micro-batch with the step number about to complete; `loss`: what the
    step's forward made (a `nan` fault returns it as NaN)."""
    for fault in FAULTS:
        loss = _inject(fault, step, rank, loss)
    return loss


def _inject(
    fault: tuple[str, int, int | None, int | None], step: int, rank: int, loss: torch.Tensor
) -> torch.Tensor:
    kind, at, only_rank, job = fault
    if at < step or only_rank not in (None, rank) or not _in_job(job):
        return loss
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return loss  # a restarted worker runs clean: the fault was the first attempt's
    if int(os.environ.get(ATTEMPT_ENV) or 1) > 1:
        return loss  # so does a job the launcher started again
    if kind == "stall":
        if step < at:
            STALL.arm()  # a signal from now on ends the wait at the stall step
        else:
            if job is not None:
                _stall_marker().touch()
            STALL.wait(STALL_MAX_S)
        return loss
    if step != at:
        return loss
    if kind == "raise":
        if job is not None and any(k == "stall" and j not in (None, job) for k, _, _, j in FAULTS):
            _wait_for(_stall_marker(), STALL_MAX_S)
        raise InjectedFault(f"injected fault at step {step} on rank {rank}")
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "nan":
        return loss * float("nan")
    return loss


def _stall_marker() -> Path:
    """A file outside the sweep dir (the tests read that dir's entries) that a sweep's stalled
    job makes once it waits at its stall step: one per sweep dir."""
    from hydra.core.hydra_config import HydraConfig

    sweep = hashlib.sha1(str(Path(HydraConfig.get().sweep.dir).resolve()).encode()).hexdigest()
    return Path(tempfile.gettempdir()) / f"hydra-ddp-fault-stalled-{sweep[:16]}"


def _wait_for(path: Path, max_s: float) -> None:
    deadline = time.monotonic() + max_s
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def _in_job(job: int | None) -> bool:
    """Whether this rank runs sweep job `job` (None: any run)."""
    if job is None:
        return True
    from hydra.core.hydra_config import HydraConfig

    return HydraConfig.initialized() and int(HydraConfig.get().job.num) == job


class _WrapTrainStep(importlib.abc.MetaPathFinder):
    """Wraps TrainStep.__call__ once components/train_step.py is imported: during a training
    step, a forward hook on the model it trains passes the output through :func:`inject` with
    the step about to complete and the rank (evaluation runs outside the call: untouched)."""

    def find_spec(self, name, path, target=None):
        if name != TRAIN_STEP:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            wrap(module.TrainStep)

        spec.loader.exec_module = exec_module
        return spec


def wrap(train_step: type) -> None:
    call = train_step.__call__
    now: dict = {}

    def hook(_module, _inputs, output):
        return inject(now["step"], now["rank"], output) if now else output

    def __call__(self, batches, progress, *args, **kwargs):
        if not getattr(self, "faults_hooked", False):
            self.model.register_forward_hook(hook)
            self.faults_hooked = True
        now.update(step=progress.step + 1, rank=self.env.rank)
        try:
            return call(self, batches, progress, *args, **kwargs)
        finally:
            now.clear()

    train_step.__call__ = __call__


def install() -> None:
    """In a process started with HYDRA_DDP_FAULT (tests/fault_injection/sitecustomize.py)."""
    if FAULTS and TRAIN_STEP not in sys.modules:
        sys.meta_path.insert(0, _WrapTrainStep())
