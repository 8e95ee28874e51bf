"""The warm interpreter of a sweep (one per node): `python -m launch.ranks.warm FD MODULE...`.

It imports torch, torchvision and the task's module (train, eval) once, starts the sweep's one
W&B service, then forks each job's torchrun agent on request (launch/warm.py is the client,
talking over the socket FD). The agent runs torch's elastic agent (launch/ranks/agent.py) with
`--start-method=fork`, so its ranks are forked too: a job pays no import at all, and elastic
restarts, error files and signals are torch's own as before.

Why fork: Python's forkserver would start a fresh interpreter per agent (the import again);
a process that has imported everything and forks is the warm interpreter torch cannot give.
Fork is safe only from a clean process, so this one never runs a job: before each fork it
checks that it has no thread, no CUDA context and no open W&B run (:func:`check_clean`), and a
forked agent starts from the launcher's environment for that job, not from this process's.

Lifetime: it dies with the launcher (PR_SET_PDEATHSIG, launch/ranks/bootstrap.py's die_with_parent),
its agents die with it, and it exits when the launcher closes the socket; the W&B service
(wandb-core, started with this process's pid) ends with it.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import select
import signal
import socket
import sys
import threading
import traceback

from launch.ranks.bootstrap import PARENT_PID_ENV, die_with_parent

POLL_S = 0.05
WANDB_PRELOAD = "+wandb"  # in MODULE...: start the W&B service and import W&B's run modules
# Imported before the task's modules: torch, its elastic agent, and what every rank imports
# late (measured with py-spy on a sweep: each cost every job 0.1-0.3 s): numpy.ma (np.unique
# of floats, in the split of val from train), the rank's config schema, torch's flop counter.
PRELOAD = (
    "torch",
    "torch._dynamo",
    "torch.distributed.run",
    "torch.utils.flop_counter",
    "numpy.ma",
    "launch.ranks.agent",
    "conf.schema",
)
# Imported while a job runs, one module whenever no request waits (serve): what the sweep's
# report needs (its figure, its t quantiles), so the report forked from here imports nothing.
LATE_PRELOAD = ("launch.report.sweep", "matplotlib.pyplot", "scipy.special")


def preload(modules: list[str]) -> None:
    """Import what every job needs, W&B first: its pydantic models read their docstrings by
    scanning sys.modules, which costs less before torch's thousands of modules are there."""
    if WANDB_PRELOAD in modules:
        from core.wandb_service import start_wandb_service

        start_wandb_service()
    for name in (*PRELOAD, *modules):
        if name == WANDB_PRELOAD:
            continue
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the job's ranks import it again and report why
            print(f"warm interpreter: could not preload {name}", file=sys.stderr, flush=True)
    repro = sys.modules.get("components.repro")
    if repro is not None:
        repro.requirements()  # cached: every job's repro/ lists the same installed packages


def check_clean() -> str | None:
    """Why this process must not fork now (None: it may): a thread, a CUDA context or an open
    W&B run would be copied half-alive into every job."""
    if threading.active_count() != 1:
        return f"{threading.active_count()} Python threads"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "a CUDA context"
    wandb = sys.modules.get("wandb")
    if wandb is not None and getattr(wandb, "run", None) is not None:
        return "an open W&B run"
    return None


def preload_late(name: str) -> None:
    """One of LATE_PRELOAD, at a moment nothing is asked of this process (serve)."""
    if name == "matplotlib.pyplot":
        import matplotlib

        matplotlib.use("Agg")  # files only; what launch/report/figure.py selects
    with contextlib.suppress(Exception):  # the report imports it again and says why
        importlib.import_module(name)


def run_call(request: dict) -> int:
    """In the forked child: `module:function(**kwargs)` (the sweep's report), in the launcher's
    working dir, dying with this interpreter."""
    os.environ[PARENT_PID_ENV] = str(os.getppid())
    die_with_parent()
    os.chdir(request["cwd"])
    if request.get("logging"):
        from hydra.core.utils import configure_log
        from omegaconf import OmegaConf

        logging_config, verbose = request["logging"]
        configure_log(OmegaConf.create(logging_config), verbose)
    module, _, name = request["call"].partition(":")
    getattr(importlib.import_module(module), name)(**request["kwargs"])
    return 0


def run_agent(request: dict) -> int:
    """In the forked child: become the job's torchrun agent, in its own session, with the
    environment, working dir and output the launcher asked for."""
    os.setsid()  # a process group of its own: the launcher signals the agent and its ranks
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    service = os.environ.get("WANDB_SERVICE")
    os.environ.clear()
    os.environ.update(request["env"])
    if service and "WANDB_SERVICE" not in os.environ:
        os.environ["WANDB_SERVICE"] = service  # the sweep's one W&B service
    os.environ[PARENT_PID_ENV] = str(os.getppid())  # the agent dies with this interpreter
    os.chdir(request["cwd"])
    if request.get("log"):
        fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    from launch.ranks.agent import agent_main

    return agent_main(request["argv"])


def fork_child(request: dict, conn: socket.socket) -> int:
    """Fork a job's agent, or a call (`request["call"]`)."""
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        conn.close()
        code = run_call(request) if "call" in request else run_agent(request)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 - the child must never return into the server loop
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # exiting either way
                stream.flush()
        os._exit(code)


def serve(conn: socket.socket) -> None:
    """Fork a child per request; report each one's pid, then its exit status (as Popen's
    returncode: negative for a signal). Ends when the launcher closes the socket."""
    children: set[int] = set()
    buffer = b""
    late = list(LATE_PRELOAD)

    def send(message: dict) -> None:
        conn.sendall(json.dumps(message).encode() + b"\n")

    while True:
        readable, _, _ = select.select([conn], [], [], POLL_S)
        if readable:
            data = conn.recv(1 << 16)
            if not data:
                return
            buffer += data
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                request = json.loads(line)
                unclean = check_clean()
                if unclean is not None:
                    send({"id": request["id"], "error": f"the warm interpreter holds {unclean}"})
                    continue
                pid = fork_child(request, conn)
                children.add(pid)
                send({"id": request["id"], "pid": pid})
        elif late and children:  # a job runs and no request waits: one module, then listen
            preload_late(late.pop(0))
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                send({"pid": pid, "exit": os.waitstatus_to_exitcode(status)})


def main(argv: list[str]) -> int:
    die_with_parent()
    conn = socket.socket(fileno=int(argv[0]))
    # Ctrl-C reaches the launcher only (this process has a session of its own); SIGTERM ends it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    preload(argv[1:])
    # What Python's docs advise before fork without exec: the preloaded objects move to a
    # permanent generation, so a job's garbage collections skip them (each full one walked
    # all of torch's, 0.5 s of every job, and touched their pages, copying them).
    gc.freeze()
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the launcher is gone
        serve(conn)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
