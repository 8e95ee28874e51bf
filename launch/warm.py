"""The launcher's side of the warm start: multiprocessing's forkserver, whose server
launch/ranks/warm.py prepares, forks every job's torchrun agent and the sweep's report, so a job
pays no import and the launcher never imports torch. The server exits when this process does.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import sys
from collections.abc import Iterator
from multiprocessing import forkserver
from typing import Any

from launch.ranks.agent import run_agent
from launch.ranks.job_spec import AgentSpec
from launch.ranks.lifeline import PARENT_PID_ENV
from launch.ranks.warm import PRELOAD_ENV, REPORT_PRELOAD, WANDB_PRELOAD, run_call

SERVER_MODULE = "launch.ranks.warm"  # the server imports it, and it the rest (PRELOAD_ENV)
CONTEXT = multiprocessing.get_context("forkserver")


class WarmStart:
    """The forkserver of this process, prepared for one task's jobs (the first caller's)."""

    def __init__(self) -> None:
        self.modules: list[str] | None = None

    def ensure_running(
        self, modules: list[str] = (), wandb: bool = False, report: bool = False
    ) -> None:
        """Start the server unless it runs; it imports `modules` (the task's: train, eval),
        starts the sweep's W&B service when `wandb` and imports the sweep report's modules when
        `report`, while this process goes on."""
        if self.modules is None:
            extra = [WANDB_PRELOAD] * wandb + [REPORT_PRELOAD] * report
            self.modules = [*modules, *extra]
        # The server is a new interpreter started with this process's environment, which is
        # how it learns what to import: multiprocessing hands it module names only, and
        # (up to Python 3.13) not our sys.path.
        with environ(
            {
                PRELOAD_ENV: ",".join(self.modules),
                "PYTHONPATH": import_path(),
                PARENT_PID_ENV: str(os.getpid()),  # it dies with this process
            }
        ):
            CONTEXT.set_forkserver_preload([SERVER_MODULE])
            forkserver.ensure_running()

    def start(self, spec: AgentSpec) -> multiprocessing.Process:
        """Fork a job's torchrun agent (it becomes the process `spec` asks for)."""
        self.ensure_running()
        agent = CONTEXT.Process(target=run_agent, args=(spec,), name="torchrun agent")
        agent.start()
        return agent

    def call(self, target: Any, kwargs: dict[str, Any], logging: Any = None) -> bool:
        """Run `target(**kwargs)` in a child forked from the server (it has the imports, and
        the sweep's W&B service), output to this process's, and wait. False when no server was
        started or the call did not end well: the caller then runs it itself. `logging`:
        (hydra.hydra_logging as a dict, hydra.verbose), the child's logging as this one's."""
        if self.modules is None:
            return False
        self.ensure_running()
        child = CONTEXT.Process(target=run_call, args=(target, kwargs, logging, os.getcwd()))
        child.start()
        child.join()
        return child.exitcode == 0


@contextlib.contextmanager
def environ(values: dict[str, str]) -> Iterator[None]:
    """These environment variables in this process for the block, then as they were."""
    before = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def import_path() -> str:
    """This process's import path: ranks import the task function's modules by reference."""
    return os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))


def task_modules(task_function: Any) -> list[str]:
    """The module a task function runs ("train" for train.py's; launch/ranks/bootstrap.py's
    run_task names it), to import in the server; none for a task defined in a script."""
    args = getattr(task_function, "args", ())
    if args and isinstance(args[0], str) and ":" in args[0]:
        return [args[0].partition(":")[0]]
    module = getattr(task_function, "__module__", None)
    return [] if module in (None, "__main__") else [module]
