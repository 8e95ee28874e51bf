"""Nothing a launcher starts outlives it: each process it starts (a job's agent, each rank of
the agent, the sweep's report) has the kernel SIGKILL it when its parent ends, however the
parent ends (SIGKILL included): Linux's parent-death signal, prctl(PR_SET_PDEATHSIG).

A parent names itself in PARENT_PID_ENV before it starts a child (the warm start's server for
its agents, an agent for its ranks: `die_with_parent(children_too=True)`), so a child can tell a
parent that ended before the prctl call (it is reparented by then) and ends itself. A SLURM task
belongs to SLURM, not to the launcher: nothing names its parent, and nothing here applies.
"""

from __future__ import annotations

import os
import signal
import sys

PARENT_PID_ENV = "HYDRA_DDP_PARENT_PID"
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(children_too: bool = False, environ=os.environ) -> bool:
    """Die with the parent named in PARENT_PID_ENV (nothing without one); `children_too`: then
    name this process there, so that what it starts dies with it. Returns whether this process
    is set to die with its parent."""
    parent = environ.get(PARENT_PID_ENV)
    bound = False
    if parent and sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        bound = libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
        if bound and os.getppid() != int(parent):  # reparented: the parent is gone already
            os.kill(os.getpid(), signal.SIGKILL)
    if children_too:
        environ[PARENT_PID_ENV] = str(os.getpid())
    return bound
