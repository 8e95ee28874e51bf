"""Preemption: SIGTERM or SIGUSR1 (what SLURM and cloud schedulers send) asks the run to stop.

The handler only sets a flag. Every `every` steps the ranks all-reduce their flags (MAX), so all
of them see the request at the same step boundary, checkpoint there together and exit with
REQUEUE_EXIT_CODE (the launcher's "requeue me"): `resume=auto` continues exactly. On SLURM, rank 0
also requeues the job itself when the job allows it (`ddp_launcher.requeue_on_slurm`).
"""

from __future__ import annotations

import logging
import signal
import threading

import torch
import torch.distributed as dist
from ddp_launcher import REQUEUE_EXIT_CODE

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preempted(Exception):
    """The run stopped at an agreed step after a stop signal; a checkpoint was written."""

    exit_code = REQUEUE_EXIT_CODE


class StopRequest:
    def __init__(self, every: int, group=None):
        self.every = max(1, every)
        self.group = group  # gloo (DistEnv.cpu_group): agreeing never syncs the GPU stream
        self.received: int | None = None
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                signal.signal(sig, self._handle)

    def _handle(self, signum, _frame) -> None:
        self.received = signum

    def agreed(self, step: int) -> bool:
        """True on every rank at the same step once any rank got a stop signal."""
        if step % self.every:
            return False
        flag = torch.tensor([0.0 if self.received is None else 1.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())

    def __enter__(self) -> StopRequest:
        return self

    def __exit__(self, *exc) -> bool:
        self.restore_default_handlers()
        return False

    def restore_default_handlers(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                signal.signal(sig, signal.SIG_DFL)
