"""Two ranks kept alive for the whole pytest run: a test that needs a real gloo group of two
processes, but not a process boundary (signals, torchrun, exit codes), runs its function in
both of them instead of starting two fresh processes (each pays ~5 s of imports).

    results = two_ranks.run(fn, *args)        # fn(rank, *args) in ranks 0 and 1
    two_ranks.train(run_dir, *overrides)      # train.py's train(cfg) on 2 ranks
    two_ranks.train(run_dir, *overrides, world_size=1)  # on rank 0 alone, as `python train.py`

Each call gets torch's rank variables (RANK, WORLD_SIZE, MASTER_ADDR, a fresh MASTER_PORT...)
as torchrun would set them, so `init_process_group()` (env://) and train.py work unchanged; a
process group left open is destroyed after the call. A rank that raises fails the call with
every rank's traceback; a call that does not finish in time (a rank waiting in a collective)
kills the pool, which the next call starts again.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

# What torchrun sets for each rank; a call with world_size=1 runs without them, as a process
# started without torchrun (`python train.py`).
TORCHRUN_VARS = (
    "RANK",
    "LOCAL_RANK",
    "GROUP_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)


class RanksFailed(AssertionError):
    """A call raised on some rank: `errors` maps each failed rank to its traceback."""

    def __init__(self, errors: dict[int, str], log: str = "") -> None:
        self.errors = errors
        text = "\n".join(f"--- rank {r}:\n{tb}" for r, tb in sorted(errors.items()))
        super().__init__(f"{text}\n--- the ranks' output (tail):\n{log[-3000:]}")


class RankPool:
    def __init__(self, world_size: int = 2) -> None:
        self.world_size = world_size
        self.log = Path(tempfile.mkdtemp(prefix="rank_pool_")) / "ranks.log"
        self._procs: list = []

    # -- lifecycle

    def _start(self) -> None:
        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no fork of pytest
        self._inboxes = [ctx.Queue() for _ in range(self.world_size)]
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(
                target=_serve,
                args=(rank, self.world_size, self._inboxes[rank], self._results, str(self.log)),
                daemon=False,  # a rank may start DataLoader workers; it ends with pytest (_serve)
            )
            for rank in range(self.world_size)
        ]
        for proc in self._procs:
            proc.start()

    def close(self, wait: float = 0) -> None:
        """Stop the ranks: asked to end within `wait` seconds (their exit runs as any
        process's), then killed."""
        if wait and self._alive():
            for inbox in self._inboxes:
                inbox.put(None)
            for proc in self._procs:
                proc.join(wait)
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
            proc.join(10)
        self._procs = []

    def _alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    # -- calls

    def run(
        self,
        fn: Callable,
        *args: Any,
        timeout: float = 300,
        world_size: int | None = None,
        **env: str,
    ) -> list[Any]:
        """fn(rank, *args) on every rank (fn importable: a module-level function), with `env`
        added to the rank's environment for the call; each rank's return value, by rank.
        `world_size=1`: on rank 0 alone, without torchrun's variables."""
        from tests.helpers import free_port

        if not self._alive():
            self.close()
            self._start()
        world_size = world_size or self.world_size
        if world_size == 1:
            env = {**dict.fromkeys(TORCHRUN_VARS), **env}
        else:
            world = {"WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size)}
            env = {**world, **env, "MASTER_PORT": str(free_port())}
        task = (fn.__module__, fn.__qualname__, args, env)
        for inbox in self._inboxes[:world_size]:
            inbox.put(task)
        done: dict[int, tuple[bool, Any]] = {}
        deadline = time.time() + timeout
        while len(done) < world_size:
            try:
                rank, ok, value = self._results.get(timeout=1)
                done[rank] = (ok, value)
            except queue.Empty:
                if time.time() > deadline or not self._alive():
                    self.close()  # a rank is stuck (or gone): the next call starts afresh
                    break
        errors = {r: v for r, (ok, v) in done.items() if not ok}
        errors |= {
            r: "did not finish (killed the pool)" for r in range(world_size) if r not in done
        }
        if errors:
            raise RanksFailed(errors, self.output())
        return [done[r][1] for r in range(world_size)]

    def train(
        self,
        run_dir: Path,
        *overrides: str,
        timeout: float = 300,
        world_size: int | None = None,
        **env: str,
    ) -> list:
        """train.py's train(cfg) on every rank (or `world_size` of them), one run dir (rank 0
        writes it, train.log too); each rank's returned value."""
        return self.run(
            train_rank,
            str(run_dir),
            list(overrides),
            timeout=timeout,
            world_size=world_size,
            **env,
        )

    def log_size(self) -> int:
        """Where the next call's output starts in the ranks' log (for :meth:`output`)."""
        return self.log.stat().st_size if self.log.exists() else 0

    def output(self, since: int = 0) -> str:
        """The ranks' console output, from byte `since` on (:meth:`log_size` before a call)."""
        if not self.log.exists():
            return ""
        with open(self.log, "rb") as f:
            f.seek(since)
            return f.read().decode(errors="replace")


def train_rank(rank: int, run_dir: str, overrides: list[str]) -> Any:
    """One rank of train.py's train(cfg), configured as Hydra's run_job would: the run's config,
    and on rank 0 its job logging (console + <run dir>/train.log)."""
    from hydra.core.utils import configure_log

    import train
    from tests.helpers import _in_process

    def with_logging(cfg):
        if rank == 0:
            from hydra.core.hydra_config import HydraConfig

            configure_log(HydraConfig.get().job_logging, HydraConfig.get().verbose)
        return train.train(cfg)

    try:
        return _in_process(
            "train",
            Path(run_dir),
            with_logging,
            ["trainer.progress_bar=false", "hydra.job.name=train", *overrides],
        )
    finally:
        import logging

        for handler in logging.getLogger().handlers[:]:  # close train.log
            handler.close()
            logging.getLogger().removeHandler(handler)


def next_task(inbox, parent: int) -> tuple | None:
    """The next task; None to stop: asked to, or pytest is gone (a rank is no daemon process,
    so nothing else ends it)."""
    while True:
        try:
            return inbox.get(timeout=5)
        except queue.Empty:
            if os.getppid() != parent:
                return None


def _serve(rank: int, world_size: int, inbox, results, log: str) -> None:
    """A rank's loop: run each task with torch's rank variables set, report what it returned."""
    parent = os.getppid()  # pytest
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(out, 1)
    os.dup2(out, 2)
    from tests.helpers import run_env

    # A process's environment as tests/helpers.py's run() gives it (no W&B/Hydra variables a
    # test set in pytest's process, W&B off unless asked, one thread as under torchrun).
    environ = run_env()
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        GROUP_RANK="0",
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
    )
    import importlib

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    while (task := next_task(inbox, parent)) is not None:
        module, name, args, env = task
        saved = {k: os.environ.get(k) for k in env}
        for key, value in env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        try:
            fn = importlib.import_module(module)
            for part in name.split("."):
                fn = getattr(fn, part)
            results.put((rank, True, fn(rank, *args)))
        except BaseException:  # noqa: BLE001 - reported to the test, the rank serves on
            results.put((rank, False, traceback.format_exc()))
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            sys.stdout.flush()
            sys.stderr.flush()
