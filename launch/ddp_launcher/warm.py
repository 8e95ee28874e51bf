"""The launcher's side of the warm start: multiprocessing's forkserver, whose server
ddp_launcher/ranks/warm.py prepares, forks every job's torchrun agent, so a job pays no import and
the launcher never imports torch. The server exits when this process does. Neither the server nor
an agent imports the app's script (:func:`without_main_script`).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing import forkserver, resource_tracker, spawn
from typing import Any

from ddp_launcher.ranks.agent import run_agent
from ddp_launcher.ranks.job_spec import AgentSpec
from ddp_launcher.ranks.lifeline import PARENT_PID_ENV
from ddp_launcher.ranks.warm import PRELOAD_ENV, WANDB_PRELOAD

SERVER_MODULE = "ddp_launcher.ranks.warm"  # the server imports it, and it the rest (PRELOAD_ENV)
CONTEXT = multiprocessing.get_context("forkserver")


class WarmStart:
    """The forkserver of this process, prepared for one task's jobs (the first caller's)."""

    def __init__(self) -> None:
        self.modules: list[str] | None = None

    def ensure_running(self, modules: list[str] = (), wandb: bool = False) -> None:
        """Start the server unless it runs; it imports `modules` (the task's: train, eval) and
        starts the sweep's W&B service when `wandb`, while this process goes on."""
        if self.modules is None:
            self.modules = [*modules, *[WANDB_PRELOAD] * wandb]
        # The server is a new interpreter started with this process's environment, which is
        # how it learns what to import: multiprocessing hands it module names only, and
        # (up to Python 3.13) not our sys.path.
        values = {
            PRELOAD_ENV: ",".join(self.modules),
            "PYTHONPATH": import_path(),
            PARENT_PID_ENV: str(os.getpid()),  # it dies with this process
        }
        before = {key: os.environ.get(key) for key in values}
        os.environ.update(values)
        try:
            CONTEXT.set_forkserver_preload([SERVER_MODULE])
            with sigint_blocked():
                forkserver.ensure_running()
        finally:
            for key, value in before.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value

    def start(self, spec: AgentSpec) -> multiprocessing.Process:
        """Fork a job's torchrun agent (it becomes the process `spec` asks for)."""
        self.ensure_running()
        agent = CONTEXT.Process(target=run_agent, args=(spec,), name="torchrun agent")
        with without_main_script():
            agent.start()
        return agent


@contextmanager
def sigint_blocked() -> Iterator[None]:
    """SIGINT held back (blocked) while the server is started: the server inherits the mask
    (a new interpreter keeps it across exec) and holds a Ctrl-C until it ignores SIGINT, its
    imports done (ranks/warm.py); without it, a Ctrl-C of the terminal's process group during
    its interpreter's start or its `import torch` printed a 30-47-line KeyboardInterrupt
    traceback after the launcher's one line. A Ctrl-C this process gets meanwhile is
    delivered when the block ends (as multiprocessing's resource tracker starts its process)."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    # forkserver.ensure_running starts the resource tracker first, if it is not running, and
    # then unblocks SIGINT in this thread: started here, before the block, it is left alone
    resource_tracker.ensure_running()
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


@contextmanager
def without_main_script() -> Iterator[None]:
    """multiprocessing hands every process it starts the parent's `__main__` to import as
    `__mp_main__` (spawn.get_preparation_data's init_main_from_path or _name; a forkserver's
    child imports it in spawn.prepare): in an agent that is the app's top-level code, and a
    CUDA call there (torch.cuda.is_available() at an app's top) makes every rank the agent forks
    a CUDA bad fork. An agent's target and its AgentSpec are the package's, pickled by
    reference, so the data leaves `__main__` out; the ranks import the script themselves once
    forked (ddp_launcher/ranks/job_spec.py's ScriptTask). multiprocessing has no switch for it:
    its function is wrapped while an agent starts (from the launcher's main thread)."""
    preparation_data = spawn.get_preparation_data

    def without_main(name: str) -> dict[str, Any]:
        data = preparation_data(name)
        data.pop("init_main_from_path", None)
        data.pop("init_main_from_name", None)
        return data

    spawn.get_preparation_data = without_main
    try:
        yield
    finally:
        spawn.get_preparation_data = preparation_data


def import_path() -> str:
    """This process's import path: ranks import the task function's modules by reference."""
    return os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))


def task_modules(task_function: Any) -> list[str]:
    """The module a task function runs ("my_app" for my_app.py's; ddp_launcher/ranks/bootstrap.py's
    run_task names it), to import in the server; none for a task defined in a script."""
    args = getattr(task_function, "args", ())
    if args and isinstance(args[0], str) and ":" in args[0]:
        return [args[0].partition(":")[0]]
    module = getattr(task_function, "__module__", None)
    return [] if module in (None, "__main__") else [module]
