"""The warm start's server, prepared: multiprocessing's forkserver (ddp_launcher/warm.py) imports
this
module, and only this one, before it forks anything: torch, the agent and the task's modules
once, the sweep's one W&B service, then a check that it is clean to fork (:func:`why_unclean`)
and gc.freeze(). Every job's agent, and through it every rank, is forked from it: a job pays
no import. What to import comes from PRELOAD_ENV (removed here): multiprocessing's preload
takes module names only.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
import threading

from ddp_launcher.ranks.forked import freeze_imported, in_bad_fork
from ddp_launcher.ranks.lifeline import die_with_parent

PRELOAD_ENV = "HYDRA_DDP_WARM_PRELOAD"  # the task's modules, comma-separated; WANDB_PRELOAD too
WANDB_PRELOAD = "+wandb"  # start the W&B service and import W&B's run modules
# Imported before the task's modules: torch, its elastic agent, and what every rank imports
# late (measured with py-spy on a sweep: each cost every job 0.1-0.3 s): numpy.ma (np.unique
# of floats, in the split of val from train), torch's flop counter. The task's own modules
# (its config schema with them) come from PRELOAD_ENV.
PRELOAD = (
    "torch",
    "torch._dynamo",
    "torch.distributed.launcher.api",
    "torch.distributed.elastic.multiprocessing",
    "torch.utils.flop_counter",
    "numpy.ma",
    "cloudpickle",
    "ddp_launcher.ranks.agent",
    "ddp_launcher.ranks.bootstrap",
)
UNCLEAN: str | None = None  # why this server must not be forked from (None: it may)


def prepare(modules: list[str]) -> None:
    """Import what every job needs, W&B first: its pydantic models read their docstrings by
    scanning sys.modules, which costs less before torch's thousands of modules are there."""
    global UNCLEAN
    if WANDB_PRELOAD in modules:
        from ddp_launcher.core.wandb_service import start_wandb_service

        start_wandb_service()
    for name in (*PRELOAD, *(m for m in modules if m != WANDB_PRELOAD)):
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the job's ranks import it again and report why
            print(f"warm start: could not preload {name}", file=sys.stderr, flush=True)
    repro = sys.modules.get("ddp_launcher.core.repro")
    if repro is not None:
        repro.requirements()  # cached: every job's repro/ lists the same installed packages
    UNCLEAN = why_unclean()
    die_with_parent(children_too=True)  # what it forks dies with it
    take_sigint_as_ignored()
    # What Python's docs advise before fork without exec: the preloaded objects move to a
    # permanent generation, so a job's garbage collections skip them (each full one walked
    # all of torch's, 0.5 s of every job, and touched their pages, copying them).
    freeze_imported()


def take_sigint_as_ignored() -> None:
    """The launcher started this server with SIGINT blocked (ddp_launcher/warm.py): ignored
    from now on, as multiprocessing's forkserver ignores it once it serves (a Ctrl-C of the
    terminal reaches this process too; the launcher stops the jobs itself), then unblocked, so
    that what it forks starts with no signal held back (the agent sets its own handlers)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (discards one held back meanwhile)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def why_unclean() -> str | None:
    """What would be copied half-alive into every forked job, if anything."""
    if threading.active_count() != 1:
        return f"{threading.active_count()} Python threads"
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    if torch.cuda.is_initialized():
        return "a CUDA context"
    wandb = sys.modules.get("wandb")
    if wandb is not None and getattr(wandb, "run", None) is not None:
        return "an open W&B run"
    pid = os.fork()
    if pid == 0:  # the probe child: torch's flag, as every forked job would have it
        code = 4  # whatever happens here, the child never returns into the server's code
        try:
            code = 3 if in_bad_fork(torch) else 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) == 3:
        return "a call into the CUDA driver (every process it forks is a CUDA bad fork)"
    return None


def refuse_if_unclean() -> None:
    """In a process forked from the server: stop with one line when the server was not clean."""
    if UNCLEAN is not None:
        print(f"warm start: the server holds {UNCLEAN}: not forking a job", file=sys.stderr)
        os._exit(1)


if (_preload := os.environ.pop(PRELOAD_ENV, None)) is not None:  # in the server only
    prepare([m for m in _preload.split(",") if m])
