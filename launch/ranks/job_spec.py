"""What a launcher hands the ranks of a job (:class:`JobSpec`, pickled: launch/jobs.py composes
it, bootstrap.py runs it), and what comes back when no rank returned one (:class:`Stopped`,
:func:`job_return`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hydra.errors import CompactHydraException
from omegaconf import DictConfig


@dataclass
class JobSpec:
    """What every rank of one job needs to run it (pickled to the ranks)."""

    task_function: Any
    config: DictConfig  # the job's composed config, hydra node included, output dirs resolved
    singleton_state: Any
    hydra_context: Any = None  # None: the job dir and .hydra/ already exist (`python train.py`)
    job_dir_key: str = "hydra.sweep.dir"
    job_subdir_key: str | None = "hydra.sweep.subdir"


class Stopped(CompactHydraException):
    """A rank stopped from outside (a signal) before it could finish: not its own error; the
    cause is in the record of the ranks that died, when there is one."""


def job_return(job: Any, status: Any, value: Any) -> Any:
    """A JobReturn made by the launcher, or by a SLURM task stopped before its task ran (rank 0
    returned none). `job`: a launch.jobs.Job (its overrides, spec.config and job_dir)."""
    from hydra.core.utils import JobReturn

    ret = JobReturn(overrides=job.overrides, cfg=job.spec.config, hydra_cfg=job.spec.config)
    ret.working_dir = str(job.job_dir)
    ret.return_value, ret.status = value, status
    return ret
