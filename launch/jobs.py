"""The job model both launchers share (launch/torchrun.py, launch/slurm.py).

A sweep batch goes the same way on either launcher (:func:`launch_batch`): every job's config is
composed here, in the launching process (:func:`compose_jobs`, as Hydra's own launchers do), its
world size read from its own `dist` node (:func:`job_world`, components/world.py's rules), then
the launcher runs the jobs its way and hands back one JobReturn per job: rank 0's own, or a
failed one (:func:`failed_job_return`) whose one-line reason (:func:`failure_reason`) comes from
one channel, most specific first: rank 0's exception, then the record of the ranks that died,
then what is left (exit codes, job states). A job that failed without a record of its own gets
one in its run dir (:func:`record_failure`, components/run_dir.py). A sweep job's attempts, and
what a resumed sweep does with it, are launch/resume.py's. SIGINT/SIGTERM (and for local jobs
SIGHUP) of the launcher stop its running jobs the way preemption does, and the sweep ends with
one line (:class:`SweepStopped`, :func:`stop_signals`).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from hydra.errors import CompactHydraException
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from components.errors import UserError, describe, one_line
from components.run_dir import RunResult, read_result, write_result
from components.world import requested_world, uses_gpus

log = logging.getLogger(__name__)


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
class Job:
    num: int
    overrides: list[str]
    job_dir: Path
    spec: JobSpec
    nproc: int = 1  # ranks per node
    nnodes: int = 1
    uses_gpus: bool = False  # one GPU per rank
    label: str = ""  # prefixed to every line its ranks print: "#3 " in a sweep
    started: float = 0.0  # when this attempt was started (unix time; 0: never)
    error: str | None = None  # why it cannot start (a user error found while planning it)
    # launch/resume.py: a sweep job's attempts are recorded in <job dir>/launch.json.
    in_sweep: bool = False
    attempt: int = 0  # attempts so far, earlier launches of the sweep included
    retries_left: int = 0  # hydra.launcher.retries, counted down in this launch
    continues: bool = False  # its next attempt continues from the job dir's checkpoints
    attach: Any = None  # SLURM: an earlier attempt (resume.Attempt) still queued or running


class JobFailed(CompactHydraException):
    """A job ended without a result: an exception, a crash or a killed rank. The ranks have
    printed their own errors; this is the one-line verdict (Hydra prints it as is). Its cause
    is rank 0's exception when there is one, so a user error behind it stays findable."""


class SweepStopped(CompactHydraException):
    """The launcher was asked to stop (SIGINT, SIGTERM): its running jobs were stopped the way
    preemption stops them and recorded; a resumed sweep continues them."""


class Interrupted(KeyboardInterrupt):
    """A stop signal the launcher received (:func:`stop_signals`), raised like Ctrl-C."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signal_name = signal.Signals(signum).name


def stop_reason(error: BaseException) -> str:
    """What stopped the launcher: the signal's name, or the error's type."""
    if isinstance(error, Interrupted):
        return error.signal_name
    return "SIGINT" if isinstance(error, KeyboardInterrupt) else type(error).__name__


@contextmanager
def stop_signals(signums: Sequence[int]) -> Iterator[None]:
    """While launching: each of `signums` raises Interrupted in the main thread, as Ctrl-C
    raises KeyboardInterrupt, so the launcher stops its jobs on its way out instead of dying
    with them running (SIGTERM's default) or leaving them to the parent-death signal. A signal
    this process ignores stays ignored (`nohup` ignores SIGHUP: the sweep outlives the shell)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, _frame: Any) -> None:
        raise Interrupted(signum)

    previous = {s: signal.signal(s, interrupt) for s in signums
                if signal.getsignal(s) is not signal.SIG_IGN}  # fmt: skip
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


class Stopped(CompactHydraException):
    """A rank stopped from outside (a signal) before it could finish: not its own error; the
    cause is in the record of the ranks that died, when there is one."""


def settings_from(schema: type, launcher_cfg: Any) -> dict[str, Any]:
    """The `hydra.launcher` values that `schema` (a launcher's dataclass) declares, as plain
    Python (Hydra hands them over as configs, or as a dict of them)."""
    if OmegaConf.is_config(launcher_cfg):
        launcher_cfg = OmegaConf.to_container(launcher_cfg, resolve=True)
    return {
        k: OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v
        for k, v in dict(launcher_cfg or {}).items()
        if k in schema.__dataclass_fields__
    }


# ---------------------------------------------------------------------------------------------
# composing jobs


def resolve_output_dirs(config: DictConfig, keys: Sequence[str]) -> None:
    """Resolve the output dir keys here, once: ranks are other processes, and `${now:}` resolved
    there would name another directory."""
    with read_write(config.hydra), open_dict(config):
        for key in keys:
            OmegaConf.update(config, key, str(OmegaConf.select(config, key)), merge=False)


def compose_jobs(launcher: Any, job_overrides: Sequence[Sequence[str]],
                 initial_idx: int) -> list[Job]:  # fmt: skip
    """Each sweep job's config, composed here (hydra.job.num and .id set, output dirs resolved)."""
    from hydra.core.singleton import Singleton

    jobs = []
    for idx, overrides in enumerate(job_overrides):
        num = initial_idx + idx
        config = launcher.hydra_context.config_loader.load_sweep_config(
            launcher.config, list(overrides)
        )
        with open_dict(config):
            config.hydra.job.id = f"{config.hydra.job.name}_{num}"
            config.hydra.job.num = num
        resolve_output_dirs(config, ("hydra.sweep.dir", "hydra.sweep.subdir"))
        job_dir = Path(str(config.hydra.sweep.dir)) / str(config.hydra.sweep.subdir)
        spec = JobSpec(launcher.task_function, config, Singleton.get_state(),
                       hydra_context=launcher.hydra_context)  # fmt: skip
        jobs.append(Job(num, list(overrides), job_dir, spec, label=f"#{num} ", in_sweep=True))
    return jobs


def job_world(config: DictConfig, n_gpus: int) -> tuple[int, int, bool]:
    """(ranks per node, nodes, whether its ranks use GPUs) a job asks for in its `dist` node,
    `auto` resolved against `n_gpus` usable GPUs per node. An app without a `dist` node (or
    without a key of it) runs 1 rank on 1 node."""
    dist = OmegaConf.select(config, "dist")
    if not isinstance(dist, DictConfig):
        return 1, 1, False
    request = SimpleNamespace(
        nproc_per_node=OmegaConf.select(dist, "nproc_per_node", default=1),
        nnodes=OmegaConf.select(dist, "nnodes", default=1),
        backend=OmegaConf.select(dist, "backend", default="auto"),
    )
    nproc, nnodes = requested_world(request, n_gpus)
    return nproc, nnodes, uses_gpus(request.backend, n_gpus)


def check_gpus(nproc: int, gpu_job: bool, n_gpus: int, what: str) -> None:
    """A GPU job takes one GPU per rank: it cannot ask for more than a node has (`what`)."""
    if gpu_job and nproc > n_gpus:
        raise UserError(
            f"dist.nproc_per_node={nproc} asks for {nproc} GPUs per node but {what}: "
            "lower dist.nproc_per_node"
        )


# ---------------------------------------------------------------------------------------------
# failures


def failure_reason(rank0_error: BaseException | str | None, dead_ranks: Sequence[str],
                   otherwise: str) -> str:  # fmt: skip
    """Why a job failed, in one line, most specific first: rank 0's own error (its JobReturn's
    exception), then the first of the ranks that died (with rank 0's word in brackets when
    rank 0 was only stopped because of it), then `otherwise` (exit codes, job states)."""

    def text(error: BaseException | str) -> str:
        return describe(error) if isinstance(error, BaseException) else one_line(error)

    if rank0_error is not None and not isinstance(rank0_error, Stopped):
        return text(rank0_error)
    if dead_ranks:
        return dead_ranks[0] + (f" (rank 0: {text(rank0_error)})" if rank0_error else "")
    return text(rank0_error) if rank0_error is not None else otherwise


def job_return(job: Job, status: Any, value: Any) -> Any:
    """A JobReturn made by the launcher (rank 0 returned none)."""
    from hydra.core.utils import JobReturn

    ret = JobReturn(overrides=job.overrides, cfg=job.spec.config, hydra_cfg=job.spec.config)
    ret.working_dir = str(job.job_dir)
    ret.return_value, ret.status = value, status
    return ret


def failed_job_return(job: Job, reason: str, ret: Any = None) -> Any:
    """Report a failed job (one line), record it in its run dir, and return its failed
    JobReturn: rank 0's own (`ret`) when it sent one, with the verdict as its value."""
    from hydra.core.utils import JobReturn, JobStatus

    log.error("#%d %s failed: %s", job.num, " ".join(job.overrides), reason)
    record_failure(job, reason)
    verdict = JobFailed(f"job #{job.num} ({' '.join(job.overrides)}): {reason}")
    if isinstance(ret, JobReturn) and isinstance(ret._return_value, BaseException):
        verdict.__cause__ = ret._return_value
    if not isinstance(ret, JobReturn):
        return job_return(job, JobStatus.FAILED, verdict)
    ret.return_value, ret.status = verdict, JobStatus.FAILED
    return ret


def record_failure(job: Job, reason: str) -> None:
    """Give a failed job a result.json (the sweep summary reads it) unless this attempt of the
    run wrote its own: that one stays as the run left it."""
    if read_result(job.job_dir, since=job.started or time.time()) is not None:
        return
    wall_time = round(time.time() - job.started, 3) if job.started else None
    write_result(job.job_dir, RunResult(status="failed", error=reason, overrides=job.overrides,
                                        job_num=job.num, wall_time_s=wall_time))  # fmt: skip


# ---------------------------------------------------------------------------------------------
# a sweep batch


def launch_batch(launcher: Any, job_overrides: Sequence[Sequence[str]], initial_idx: int,
                 name: str, run: Callable[[list[Job]], list[Any]], *, resume: bool = False,
                 stop_on: Sequence[int] = (signal.SIGINT, signal.SIGTERM),
                 lock: bool = True) -> list[Any]:  # fmt: skip
    """Hydra's Launcher.launch for both launchers: compose the batch's jobs, `run` them (the
    launcher's part: one JobReturn per job, in order), and say which failed. With `lock`, one
    launcher per sweep dir (launch/resume.py). A stop signal (`stop_on`) ends the sweep with
    SweepStopped once `run` has stopped and recorded its jobs."""
    from hydra.core.utils import configure_log, filter_overrides, setup_globals

    from launch.resume import check_sweeper, hold_sweep_lock

    setup_globals()
    configure_log(launcher.config.hydra.hydra_logging, launcher.config.hydra.verbose)
    check_sweeper(launcher.config, resume)
    sweep_dir = Path(str(launcher.config.hydra.sweep.dir))
    sweep_dir.mkdir(parents=True, exist_ok=True)
    if lock:
        hold_sweep_lock(sweep_dir)
    log.info("%s: %d job(s), sweep dir %s%s", name, len(job_overrides), sweep_dir,
             " (resuming)" if resume else "")  # fmt: skip
    for idx, overrides in enumerate(job_overrides):
        log.info("\t#%d : %s", initial_idx + idx, " ".join(filter_overrides(overrides)))
    try:
        with stop_signals(stop_on):
            results = run(compose_jobs(launcher, job_overrides, initial_idx))
    except KeyboardInterrupt as e:
        raise SweepStopped(
            f"the sweep was stopped ({stop_reason(e)}): its running jobs stopped and are "
            f"recorded in their job dirs; rerun the same command with hydra.sweep.dir="
            f"{sweep_dir} hydra.launcher.resume=true to continue it"
        ) from None
    failed = [f"#{initial_idx + i}" for i, r in enumerate(results) if r.status.name == "FAILED"]
    if failed:
        log.error("%d of %d job(s) failed in this batch: %s", len(failed), len(results),
                  ", ".join(failed))  # fmt: skip
    return results
