"""One rank of a torchrun job started by launch/torchrun.py: `python -m launch.job_rank job.pkl`.

Rank 0 runs the task as the Hydra job (job dir, `.hydra/`, log file, callbacks) and writes its
JobReturn to result.pkl; the other ranks run the same task with no output subdir and
errors-only console logging, so they write nothing but their own rank logs (kept by torchrun).
"""

from __future__ import annotations

import copy
import logging
import os
import sys
from pathlib import Path

import cloudpickle
from hydra.core.hydra_config import HydraConfig
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, configure_log, env_override, run_job
from omegaconf import OmegaConf, open_dict, read_write

from launch.errors import UserError
from launch.torchrun import RESULT_PKL

OTHER_RANKS_LOGGING = Path(__file__).resolve().parent.parent / "conf/hydra/job_logging/other_ranks.yaml"

log = logging.getLogger(__name__)


def main(payload: Path) -> int:
    with open(payload, "rb") as f:
        spec = cloudpickle.load(f)
    Singleton.set_state(spec.singleton_state)
    config, rank = spec.config, int(os.environ["RANK"])
    if rank != 0:
        with read_write(config.hydra), open_dict(config):
            config.hydra.output_subdir = None
            config.hydra.job_logging = OmegaConf.load(OTHER_RANKS_LOGGING)

    if spec.hydra_context is not None:  # a sweep job: Hydra's run_job makes it a Hydra job
        context = spec.hydra_context if rank == 0 else without_callbacks(spec.hydra_context)
        ret = run_job(
            hydra_context=context,
            config=config,
            task_function=spec.task_function,
            job_dir_key=spec.job_dir_key,
            job_subdir_key=spec.job_subdir_key,
        )
    else:  # `python train.py dist.nproc_per_node=N`: the run dir and .hydra/ already exist
        ret = run_in_existing_dir(spec.task_function, config)

    if rank == 0:
        write_result(ret, payload.parent / RESULT_PKL)
    if ret.status == JobStatus.COMPLETED:
        return 0
    error = ret._return_value
    if isinstance(error, UserError):  # the user's to fix: one line, no traceback
        logging.getLogger("train").error("%s", error)
        return error.exit_code
    logging.getLogger("train").error("job failed", exc_info=error)
    return 1


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
        ret._return_value = RuntimeError(repr(value)) if ret.status == JobStatus.FAILED else repr(value)
        data = cloudpickle.dumps(ret)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


if __name__ == "__main__":
    try:
        code = main(Path(sys.argv[1]))
    except UserError as e:
        logging.getLogger("train").error("%s", e)
        code = e.exit_code
    sys.exit(code)
