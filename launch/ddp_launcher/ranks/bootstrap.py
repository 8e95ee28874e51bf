"""The bootstrap of a rank a launcher started (a torchrun rank: :func:`rank_main`; a SLURM task:
slurm_task.py) and of every run's training process (:func:`run_task`). A failure is reported
here, once (:func:`report_failure`), with the exit status UserError.exit_code (2) or 1.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hydra.errors import CompactHydraException

from ddp_launcher.core.errors import (
    PEER_FAILED_FIRST,
    UserError,
    describe,
    find_user_error,
    job_value,
    lost_a_peer,
    said_logger,
)
from ddp_launcher.core.hydra_compat import context_whitelist, hydra_context
from ddp_launcher.ranks.forked import (
    check_not_a_bad_fork,
    freeze_imported,
    start_like_a_new_process,
)
from ddp_launcher.ranks.handoff import JOB_JSON, RESULT_PKL, JobRecord, write_job_return
from ddp_launcher.ranks.interrupt import sigint_held, stop_if_ctrl_c
from ddp_launcher.ranks.lifeline import die_with_parent

log = logging.getLogger(__name__)

# The package's conf/ (hydra_plugins/hydra_ddp_launcher/conf/, on the search path of apps run
# through the entry point: searchpath.py): hydra/job_logging/other_ranks.yaml is the package's.
CONF = Path(__file__).resolve().parents[2] / "hydra_plugins" / "hydra_ddp_launcher" / "conf"
# Ranks other than 0 write nothing: no `.hydra/`, errors-only logging. Overrides where a rank
# composes its config (plain torchrun: entry.py), else applied by :func:`quiet_other_rank`.
OTHER_RANK_OVERRIDES = ("hydra.output_subdir=null", "hydra/job_logging=other_ranks")


def quiet_other_rank(config: Any) -> None:
    """OTHER_RANK_OVERRIDES on a composed config (a group's option: its conf/ file)."""
    from omegaconf import OmegaConf

    for override in OTHER_RANK_OVERRIDES:
        key, _, value = override.partition("=")
        if "/" in key:
            node = OmegaConf.load(CONF / key / f"{value}.yaml")
            OmegaConf.update(config, key.replace("/", "."), node, merge=False)
        else:
            OmegaConf.update(config, key, None if value == "null" else value, merge=False)


def run_task(task: str, cfg: Any) -> Any:
    """Run the task ("module:function") on the job's config; rank 0 starts the W&B service first,
    so that it starts while torch imports."""
    import importlib

    check_not_a_bad_fork()  # before the task's first CUDA call
    # A log file on a disk that fills: logging prints a traceback for every line it cannot
    # write ("--- Logging error ---"); the console still shows each line, and what writes the
    # run's records says the full disk once (core/disk.py). Python's advice for production.
    logging.raiseExceptions = False
    if int(os.environ.get("RANK", "0")) == 0:
        from ddp_launcher.core.wandb_service import start_wandb_service, wandb_wanted

        if wandb_wanted(cfg):
            start_wandb_service(background=True)
    module, _, name = task.partition(":")
    with sigint_held():  # the task's module imports torch: a Ctrl-C there would abort
        function = getattr(importlib.import_module(module), name)
    stop_if_ctrl_c()  # (one a finalizer dropped on the way here)
    freeze_imported()
    return function(cfg)


def run_rank(spec: Any, rank: int) -> Any:
    """Run one rank of a job (a JobSpec); return its JobReturn. A failure is reported here; a
    SystemExit of the task (75: requeue me) passes."""
    # Hydra's only way to an empty callback list for HydraContext (no public constructor).
    from hydra._internal.callbacks import Callbacks
    from hydra.core.singleton import Singleton
    from hydra.core.utils import JobStatus, run_job
    from omegaconf import open_dict, read_write

    Singleton.set_state(spec.singleton_state)
    config, context = spec.config, spec.hydra_context
    with read_write(config.hydra), open_dict(config):
        if context is None:  # `python app.py dist.nproc_per_node=N`: that process is the
            config.hydra.output_subdir = None  # Hydra job: it wrote .hydra/, ran the callbacks
        if rank != 0:
            quiet_other_rank(config)
    if context is None or rank != 0:
        # the app's `_target_` whitelist (Hydra 1.4), as Hydra gave it to the launcher, or as
        # the process that handed this job off ran under it
        if context is not None:
            loader, whitelist = context.config_loader, context_whitelist(context)
        else:
            loader, whitelist = None, spec.execution_whitelist
        context = hydra_context(whitelist, config_loader=loader, callbacks=Callbacks())
    ret = run_job(
        hydra_context=context,
        config=config,
        task_function=exits_as_errors(spec.task_function),
        job_dir_key=spec.job_dir_key,
        job_subdir_key=spec.job_subdir_key,
    )
    if ret.status == JobStatus.FAILED:
        report_failure(job_value(ret))
    return ret


def report_failure(error: BaseException) -> int:
    """Say once why this rank failed (also in torchrun's error file): one line for the user's to
    fix (a user error, a CompactHydraException), else a traceback. Returns the exit status."""
    record_rank_error(error)
    if find_user_error(error) is not None or isinstance(error, CompactHydraException):
        said_logger(__name__).error("%s", describe(error))
    elif lost_a_peer(error):  # the cause is another rank's, in its own report
        log.error("%s", PEER_FAILED_FIRST)
    else:
        log.error("job failed", exc_info=error)
    return exit_status(error)


def exit_status(error: BaseException | None) -> int:
    """A failed rank's exit status: a user error's own, else 1."""
    user_error = find_user_error(error)
    return user_error.exit_code if user_error is not None else 1


def record_rank_error(error: BaseException) -> None:
    """Leave this rank's error in TORCHELASTIC_ERROR_FILE (torch's ErrorHandler format), where
    the launcher's failure report finds it."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {
        "message": {
            "message": describe(error),
            "extraInfo": {
                "py_callstack": "".join(traceback.format_exception(error)),
                "timestamp": str(int(time.time())),
                # ours: when to the microsecond (torch's has 1 s), the exit status, and whether the
                # rank only lost a peer (ddp_launcher/ranks/agent.py orders the failures by them)
                "time": time.time(),
                "exitcode": exit_status(error),
                "lost_a_peer": lost_a_peer(error),
            },
        }
    }
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data))
    except OSError:
        pass


class TaskExit(UserError):
    """A task ended itself with sys.exit(n), n not 0 nor 75 (requeue me): it has said why, so
    the job fails with one line and the rank exits with n (2 for sys.exit("message"))."""

    def __init__(self, message: str, exit_code: int = UserError.exit_code) -> None:
        super().__init__(message)
        self.exit_code = exit_code

    def __reduce__(self):  # it travels in result.pkl and submitit's result
        return type(self), (str(self), self.exit_code)


def exits_as_errors(task_function: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """A failing exit as an exception (:class:`TaskExit`): Hydra's run_job lets SystemExit pass
    (no JobReturn, no on_job_end callbacks). 75 (requeue me) stays an exit: no result."""
    from ddp_launcher.core.run_dir import REQUEUE_EXIT_CODE

    @functools.wraps(task_function)
    def task(cfg):
        try:
            return task_function(cfg)
        except SystemExit as e:
            if e.code in (0, None):
                return None
            if e.code == REQUEUE_EXIT_CODE:
                raise
            if isinstance(e.code, int):
                raise TaskExit(f"the task exited with code {e.code}", e.code) from e
            raise TaskExit(str(e.code)) from e

    return task


def rank_main(payload: str) -> None:
    """One rank of a torchrun job, forked by torch's elastic agent and given the pickled JobSpec's
    path (<job dir>/.torchrun/job.pkl); exits with the rank's status when the job failed."""
    die_with_parent()
    start_like_a_new_process()
    try:
        code = run_payload(Path(payload))
    except Exception as e:  # noqa: BLE001 - e.g. the job cannot be unpickled: an import fails
        code = report_failure(e)
    if code:
        sys.exit(code)


def run_payload(payload: Path) -> int:
    import cloudpickle

    with open(payload, "rb") as f:
        spec = cloudpickle.load(f)
    rank = int(os.environ["RANK"])
    record = JobRecord(payload.parent / JOB_JSON) if rank == 0 else None
    ret = run_rank(spec, rank)
    if record is not None:
        write_job_return(ret, payload.parent / RESULT_PKL)
        record.finish(ret.status.name.lower())
    return 0 if ret.status.name == "COMPLETED" else exit_status(job_value(ret))
