"""What a launcher hands a job's ranks (:class:`JobSpec`) and the torchrun launcher a job's agent
(:class:`AgentSpec`), and what comes back when no rank returned one (:func:`job_return`)."""

from __future__ import annotations

from dataclasses import dataclass, field
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


@dataclass
class AgentSpec:
    """One job's torchrun agent (agent.py): torch's LaunchConfig in plain values, and the process
    the agent becomes (its environment, working dir, output, CPUs)."""

    payload: str  # the pickled JobSpec each rank runs (<job dir>/.torchrun/job.pkl)
    failures: str  # where the agent writes which ranks failed and how (failures.json)
    nproc: int
    nnodes: int
    max_restarts: int
    monitor_interval: float
    log_dir: str  # per-rank stdout/stderr files (torchrun --log-dir, --redirects=3)
    tee: str  # ranks whose output also reaches the agent's own (torchrun --tee)
    line_prefix: str  # before each line a rank prints (torchrun --log-line-prefix-template)
    rdzv_backend: str = "c10d"
    rdzv_endpoint: str = "localhost:0"  # single node: the OS picks a free port per job
    rdzv_id: str | None = None  # None: a new id per job (torchrun --standalone)
    node_rank: int | None = None  # this node's rank, for the static rendezvous only
    env: dict[str, str] = field(default_factory=dict)  # the agent's whole environment
    cwd: str = "."
    log: str | None = None  # the agent's own output file (None: the launcher's stdout/stderr)
    cpus: list[int] | None = None  # the CPUs the job may use (None: the launcher's)


class Stopped(CompactHydraException):
    """A rank stopped from outside (a signal) before it could finish: not its own error; the
    cause is in the record of the ranks that died, when there is one."""


class NotStarted(Stopped):
    """A SLURM job that SLURM started after a job of its sweep failed for good under
    hydra.launcher.fail_fast (SLURM starts a queued job the moment a CPU frees, before the
    launcher's next poll): it ran nothing; the launcher stops and records it with the running
    ones (ddp_launcher/lifecycle.py)."""


FENCE_FILE = ".failed_fast"  # in the sweep dir: Job.fence (ddp_launcher/jobs.py)


def fails_for_good(job: Any, ret: Any) -> bool:
    """Whether `job`'s failed attempt (JobReturn `ret`) is its last in this launch: no
    hydra.launcher.retries left, or a user error, which fails the same way every time."""
    from ddp_launcher.core.errors import find_user_error, job_value

    return job.retries_left <= 0 or find_user_error(job_value(ret)) is not None


def job_return(job: Any, status: Any, value: Any) -> Any:
    """A JobReturn made by the launcher, or by a SLURM task stopped before its task ran (rank 0
    returned none), for `job`, a ddp_launcher.jobs.Job."""
    from hydra.core.utils import JobReturn

    ret = JobReturn(overrides=job.overrides, cfg=job.spec.config, hydra_cfg=job.spec.config)
    ret.working_dir = str(job.job_dir)
    ret.return_value, ret.status = value, status
    return ret
