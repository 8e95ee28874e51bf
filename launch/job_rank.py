"""One rank of a torchrun job started by launch/torchrun.py: `python -m launch.job_rank job.pkl`.

Rank 0 runs the task as the Hydra job (job dir, `.hydra/`, log file, callbacks) and writes its
JobReturn to result.pkl, and a small job.json (when and where the job ran: pid, rendezvous
address and port, world size); the other ranks run the same task with no output subdir and
errors-only console logging, so they write nothing but their own rank logs (kept by torchrun).
A rank whose task fails also leaves its error in torchrun's error file for that rank, so the
launcher can say which rank failed and why.
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import os
import sys
import time
import traceback
from pathlib import Path

import cloudpickle
from hydra.core.hydra_config import HydraConfig
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, configure_log, env_override, run_job
from omegaconf import OmegaConf, open_dict, read_write

from components.errors import UserError, find_user_error
from launch.torchrun import JOB_JSON, RESULT_PKL, TaskExit

OTHER_RANKS_LOGGING = (
    Path(__file__).resolve().parent.parent / "conf/hydra/job_logging/other_ranks.yaml"
)

log = logging.getLogger(__name__)


def main(payload: Path) -> int:
    with open(payload, "rb") as f:
        spec = cloudpickle.load(f)
    Singleton.set_state(spec.singleton_state)
    config, rank = spec.config, int(os.environ["RANK"])
    record = JobRecord(payload.parent / JOB_JSON) if rank == 0 else None
    if rank != 0:
        with read_write(config.hydra), open_dict(config):
            config.hydra.output_subdir = None
            config.hydra.job_logging = OmegaConf.load(OTHER_RANKS_LOGGING)

    task_function = exits_as_errors(spec.task_function)
    if spec.hydra_context is not None:  # a sweep job: Hydra's run_job makes it a Hydra job
        context = spec.hydra_context if rank == 0 else without_callbacks(spec.hydra_context)
        ret = run_job(
            hydra_context=context,
            config=config,
            task_function=task_function,
            job_dir_key=spec.job_dir_key,
            job_subdir_key=spec.job_subdir_key,
        )
    else:  # `python train.py dist.nproc_per_node=N`: the run dir and .hydra/ already exist
        ret = run_in_existing_dir(task_function, config)

    if record is not None:
        write_result(ret, payload.parent / RESULT_PKL)
        record.finish(ret.status.name.lower())
    if ret.status == JobStatus.COMPLETED:
        return 0
    error = ret._return_value
    record_rank_error(error)
    if isinstance(error, TaskExit):  # the task has reported its error itself
        return error.exit_code
    user_error = find_user_error(error)
    if user_error is not None:  # the user's to fix: one line, no traceback
        logging.getLogger("train").error("%s", user_error)
        return user_error.exit_code
    logging.getLogger("train").error("job failed", exc_info=error)
    return 1


def exits_as_errors(task_function):
    """Hydra's run_job records a task's exceptions in its JobReturn, but SystemExit passes
    through it (no result.pkl, no on_job_end callbacks): make a failing exit an exception.
    The preemption exit (75, "requeue me") stays an exit: the task ends without a result."""
    from components.preemption import REQUEUE_EXIT_CODE

    @functools.wraps(task_function)
    def task(cfg):
        try:
            return task_function(cfg)
        except SystemExit as e:
            if e.code in (0, None):
                return None
            if e.code == REQUEUE_EXIT_CODE:
                raise
            raise TaskExit.from_exit(e) from e

    return task


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
        self.write()

    def finish(self, status: str) -> None:
        self.data.update(finished=time.time(), status=status)
        self.write()

    def write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=2))
        os.replace(tmp, self.path)


def record_rank_error(error: object) -> None:
    """Leave this rank's error where torchrun looks for it (TORCHELASTIC_ERROR_FILE, in the
    format of torch's ErrorHandler): the launcher's failure report then names it."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or not isinstance(error, BaseException):
        return
    user_error = find_user_error(error)
    if user_error is not None or isinstance(error, TaskExit):
        message = str(user_error or error).strip()
    else:
        message = f"{type(error).__name__}: {error}".strip()
    data = {
        "message": {
            "message": message or type(error).__name__,
            "extraInfo": {
                "py_callstack": "".join(traceback.format_exception(error)),
                "timestamp": str(int(time.time())),
            },
        }
    }
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data))
    except OSError:
        pass


def without_callbacks(hydra_context):
    from hydra._internal.callbacks import Callbacks
    from hydra.types import HydraContext

    return HydraContext(config_loader=hydra_context.config_loader, callbacks=Callbacks())


def run_in_existing_dir(task_function, config) -> JobReturn:
    HydraConfig.instance().set_config(config)
    configure_log(config.hydra.job_logging, config.hydra.verbose)
    task_cfg = copy.deepcopy(config)
    with read_write(task_cfg), open_dict(task_cfg):
        del task_cfg["hydra"]
    ret = JobReturn(cfg=task_cfg, hydra_cfg=config, overrides=list(config.hydra.overrides.task))
    ret.working_dir = os.getcwd()
    with env_override(dict(config.hydra.job.env_set)):
        try:
            ret.return_value = task_function(task_cfg)
            ret.status = JobStatus.COMPLETED
        except Exception as e:  # noqa: BLE001 - recorded in the JobReturn, reported below
            ret.return_value = e
            ret.status = JobStatus.FAILED
    return ret


def write_result(ret: JobReturn, path: Path) -> None:
    try:
        data = cloudpickle.dumps(ret)
    except Exception:  # noqa: BLE001 - an unpicklable return value still reports its status
        value = ret._return_value
        failed = ret.status == JobStatus.FAILED
        ret._return_value = RuntimeError(repr(value)) if failed else repr(value)
        data = cloudpickle.dumps(ret)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


if __name__ == "__main__":
    try:
        code = main(Path(sys.argv[1]))
    except UserError as e:
        logging.getLogger("train").error("%s", e)
        record_rank_error(e)
        code = e.exit_code
    except Exception as e:  # e.g. the job cannot be unpickled: an import fails in this rank
        traceback.print_exc()
        record_rank_error(e)
        code = 1
    sys.exit(code)
