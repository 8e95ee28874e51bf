"""The torchrun launcher's hand-off files, in <job dir>/.torchrun/ (ddp_launcher/core/run_dir.py's
LAUNCHER_DIR; one folder per node below it for a multi-node job), each in one place: the
launcher (ddp_launcher/torchrun.py) writes job.pkl and reads the others."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from ddp_launcher.core.errors import job_value, one_line
from ddp_launcher.core.run_dir import write_atomic, write_json_atomic

log = logging.getLogger(__name__)

JOB_PKL = "job.pkl"  # the JobSpec, written by the launcher
RESULT_PKL = "result.pkl"  # rank 0's JobReturn (bootstrap.py)
JOB_JSON = "job.json"  # rank 0's (bootstrap.py): pid, rendezvous address, start and end times
FAILURES_JSON = "failures.json"  # agent.py's record of the ranks that failed, first first


class JobRecord:
    """Rank 0's <job dir>/.torchrun/job.json: when the job ran, as which process, and the
    rendezvous address of its ranks (each single-node job has its own free port)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        env = os.environ
        self.data = {
            "pid": os.getpid(),
            "world_size": int(env.get("WORLD_SIZE", "1")),
            "local_world_size": int(env.get("LOCAL_WORLD_SIZE", env.get("WORLD_SIZE", "1"))),
            "master_addr": env.get("MASTER_ADDR"),
            "master_port": int(env["MASTER_PORT"]) if env.get("MASTER_PORT") else None,
            "run_id": env.get("TORCHELASTIC_RUN_ID"),
            "started": time.time(),
            "finished": None,
            "status": "running",
        }
        write_json_atomic(path, self.data)

    def finish(self, status: str) -> None:
        self.data.update(finished=time.time(), status=status)
        write_json_atomic(self.path, self.data)


def dump_job(spec: Any, file: Any) -> None:
    """Pickle a job (its JobSpec) for its ranks with cloudpickle, except that the code of a task
    function pickled by value (defined in a test, a notebook, a function) keeps its file's name
    where cloudpickle writes `<dynamic-code>`: a rank's traceback, which Hydra 1.4 hands back
    with a failed job's exception, then names the task's own file and lines."""
    import types
    from collections import ChainMap

    import cloudpickle

    code_reduce = getattr(cloudpickle.cloudpickle, "_code_reduce", None)  # (cloudpickle 3)

    def reduce_code(code: types.CodeType) -> Any:
        rebuild, args = code_reduce(code)
        return rebuild, tuple(code.co_filename if a == "<dynamic-code>" else a for a in args)

    class Pickler(cloudpickle.Pickler):
        if code_reduce is not None:
            dispatch_table = ChainMap(
                {types.CodeType: reduce_code}, cloudpickle.Pickler.dispatch_table
            )

    Pickler(file).dump(spec)


def write_job_return(ret: Any, path: Path) -> None:
    import cloudpickle
    from hydra.core.utils import JobStatus

    try:
        data = cloudpickle.dumps(ret)
    except Exception:  # noqa: BLE001 - an unpicklable return value still reports its status
        value = job_value(ret)
        failed = ret.status == JobStatus.FAILED
        ret.return_value = RuntimeError(repr(value)) if failed else repr(value)
        data = cloudpickle.dumps(ret)
    write_atomic(path, data)


def read_job_return(path: Path, job: Any) -> Any:
    """Rank 0's JobReturn (result.pkl), or None."""
    import cloudpickle

    if not path.exists():
        return None
    try:
        with open(path, "rb") as f:
            return cloudpickle.load(f)
    except Exception as e:  # noqa: BLE001 - e.g. a class the launcher cannot import
        log.warning("#%d: unreadable %s (%s: %s)", job.num, path, type(e).__name__, e)
        return None


def read_failures(path: Path) -> list[dict]:
    try:
        failures = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return []
    return failures if isinstance(failures, list) else []


def describe_failure(failure: dict) -> str:
    rank, pid = failure.get("rank"), failure.get("pid")
    if failure.get("signal"):
        return f"rank {rank} (pid {pid}) was killed by {failure['signal']}"
    if failure.get("error"):
        return f"rank {rank} failed: {one_line(failure['error'])}"
    return f"rank {rank} (pid {pid}) exited with code {failure.get('exitcode')}"
