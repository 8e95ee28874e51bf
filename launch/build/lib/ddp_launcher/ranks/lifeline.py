"""Nothing a launcher starts outlives it: the kernel SIGKILLs each process it starts (an agent, a
rank, the sweep's report) when its parent ends, however it ends (prctl(PR_SET_PDEATHSIG)).
A parent names itself in PARENT_PID_ENV, so a child whose parent ended before its prctl call
(it is reparented by then) ends itself. A SLURM task belongs to SLURM: nothing here applies.
"""

from __future__ import annotations

import os
import signal
import sys

PARENT_PID_ENV = "HYDRA_DDP_PARENT_PID"
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(children_too: bool = False) -> None:
    """Die with the parent named in PARENT_PID_ENV, if any; `children_too`: then name this
    process there, for what it starts."""
    parent = os.environ.get(PARENT_PID_ENV)
    if parent and sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        bound = libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
        if bound and os.getppid() != int(parent):  # reparented: the parent is gone already
            os.kill(os.getpid(), signal.SIGKILL)
    if children_too:
        os.environ[PARENT_PID_ENV] = str(os.getpid())
