"""The launcher's side of the warm interpreter (launch/ranks/warm.py): one per launcher process,
started at its first job and kept for every job after it, so a sweep imports torch once.

:meth:`WarmInterpreter.start` asks it to fork a job's torchrun agent and returns a
:class:`WarmProcess`, which answers like the subprocess.Popen it replaces (pid, poll, wait,
returncode): the agent is the warm interpreter's child, which reports its exit status.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import subprocess
import sys
import time
from typing import Any

from launch.ranks.bootstrap import PARENT_PID_ENV
from launch.ranks.warm import WANDB_PRELOAD

# What a job's agent reads as its status when the warm interpreter died under it.
DIED = -9


class WarmProcess:
    """A job's torchrun agent, forked by the warm interpreter (Popen's interface)."""

    def __init__(self, warm: WarmInterpreter, pid: int) -> None:
        self.warm, self.pid, self.returncode = warm, pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.warm.pump()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"agent {self.pid}", timeout)
            time.sleep(0.02)
        return self.returncode


class WarmInterpreter:
    """The warm interpreter, started by :meth:`ensure_running` (with this process's
    environment and import path), kept until :meth:`close` or this process's exit."""

    def __init__(self) -> None:
        self.process: subprocess.Popen | None = None
        self.conn: socket.socket | None = None
        self.buffer = b""
        self.started: dict[int, WarmProcess] = {}  # request id -> its agent's handle
        self.agents: dict[int, WarmProcess] = {}  # pid -> the handle of an agent still running
        self.next_id = 0

    def ensure_running(self, modules: list[str] = (), wandb: bool = False) -> None:
        """Start it unless it runs: it imports `modules` (and starts a W&B service when
        `wandb`) while this process goes on."""
        if self.process is not None and self.process.poll() is None:
            return
        modules = [*modules, *([WANDB_PRELOAD] if wandb else [])]
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        env["PYTHONPATH"] = import_path()
        env[PARENT_PID_ENV] = str(os.getpid())  # it dies with this process
        self.process = subprocess.Popen(
            [sys.executable, "-m", "launch.ranks.warm", str(theirs.fileno()), *modules],
            env=env,
            pass_fds=(theirs.fileno(),),
            start_new_session=True,  # a Ctrl-C in the terminal reaches the launcher only
        )
        theirs.close()
        self.conn, self.buffer = ours, b""
        atexit.register(self.close)

    def start(self, argv: list[str], env: dict[str, str], log: str | None) -> WarmProcess:
        """Fork a torchrun agent with these arguments, environment and output file (None:
        this process's stdout/stderr)."""
        self.ensure_running()
        return self.request({"argv": argv, "env": env, "log": log})

    def call(self, target: str, kwargs: dict[str, Any], logging: Any = None) -> bool:
        """Run `module:function(**kwargs)` in a child forked from it (it has the function's
        imports), output to this process's stdout/stderr, and wait; False when it is not
        running or the call did not end well (the caller then runs it itself). `logging`:
        (hydra.hydra_logging as a dict, hydra.verbose), the child's logging as this process's."""
        if self.process is None or self.process.poll() is not None:
            return False
        try:
            request = {"call": target, "kwargs": kwargs, "logging": logging}
            return self.request(request).wait() == 0
        except (OSError, RuntimeError):
            return False

    def request(self, request: dict[str, Any]) -> WarmProcess:
        self.next_id += 1
        request = {"id": self.next_id, "cwd": os.getcwd(), **request}
        self.conn.sendall(json.dumps(request).encode() + b"\n")
        while self.next_id not in self.started:
            self.pump(block=True)
        return self.started.pop(self.next_id)

    def pump(self, block: bool = False) -> None:
        """Read what the warm interpreter said: agents started, agents ended."""
        if self.conn is None:
            return
        self.conn.setblocking(block)
        try:
            data = self.conn.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:  # it died: so did every agent it forked (they die with it)
            self.lost()
            if block:
                raise RuntimeError("the warm interpreter ended before it started the job")
            return
        self.buffer += data
        while b"\n" in self.buffer:
            line, self.buffer = self.buffer.split(b"\n", 1)
            message = json.loads(line)
            if "error" in message:
                raise RuntimeError(message["error"])
            if "id" in message:  # its handle exists before its exit can be read (same batch)
                agent = self.agents[message["pid"]] = WarmProcess(self, message["pid"])
                self.started[message["id"]] = agent
            elif message["pid"] in self.agents:
                self.agents.pop(message["pid"]).returncode = message["exit"]

    def lost(self) -> None:
        for agent in self.agents.values():
            agent.returncode = DIED
        self.agents.clear()
        self.close()

    def close(self) -> None:
        """End it (agents still running die with it; so does its W&B service, which every
        finished run has already flushed)."""
        if self.conn is not None:
            self.conn.close()
            self.conn = None
        if self.process is not None:
            self.process.terminate()
            self.process.wait()
            self.process = None


def import_path() -> str:
    """This process's import path: ranks import the task function's modules by reference."""
    return os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))


def task_modules(task_function: Any) -> list[str]:
    """The module a task function runs ("train" for train.py's; launch/ranks/bootstrap.py's run_task
    names it), to import in the warm interpreter; none for a task defined in a script."""
    args = getattr(task_function, "args", ())
    if args and isinstance(args[0], str) and ":" in args[0]:
        return [args[0].partition(":")[0]]
    module = getattr(task_function, "__module__", None)
    return [] if module in (None, "__main__") else [module]
