"""The job model both launchers share: every job's config is composed in the launching process
(:func:`compose_jobs`, as Hydra's own launchers do); one line per finished job (:func:`job_done`);
a failed job's one reason (:func:`failure_reason`) and result.json (:func:`record_failure`).
"""

from __future__ import annotations

import copy
import logging
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.errors import CompactHydraException
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from ddp_launcher.core import run_lock
from ddp_launcher.core.errors import UserError, describe, find_user_error, job_value, one_line
from ddp_launcher.core.naming import (
    SWEPT_KEYS_ENV,
    fmt_duration,
    fmt_value,
    label,
    swept_keys,
    swept_values,
)
from ddp_launcher.core.run_dir import RESULT_FILE, RunResult, read_result, write_result
from ddp_launcher.ranks.job_spec import JobSpec, Stopped, job_return

log = logging.getLogger(__name__)

STOPPED = ("preempted", "interrupted")  # result.json states of a run stopped from outside


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
    swept: list[str] = field(default_factory=list)  # the sweep's keys (ddp_launcher/core/naming.py)
    # False: `python app.py dist.nproc_per_node=N` (no per-job line, no attempts record).
    in_sweep: bool = True
    # whether this launcher keeps the job's records (its dir's lock, launch.json, a failure's
    # result.json): of a job every node's launcher runs, one node's (core/world.keeps_records)
    records: bool = True
    # ddp_launcher/resume.py: a sweep job's attempts are recorded in <job dir>/launch.json.
    attempt: int = 0  # attempts so far, earlier launches of the sweep included
    retries_left: int = 0  # hydra.launcher.retries, counted down in this launch
    continues: bool = False  # its next attempt continues from the job dir's checkpoints
    # core/gate.py's Plan for its first attempt in this launch (resume.py)
    plan: Any = None
    # hydra.launcher.fail_fast: <sweep dir>/.failed_fast, made when a job fails for good; a job
    # that finds it at its start runs nothing (ddp_launcher/ranks/slurm_task.py)
    fence: Path | None = None
    # its start was refused and undone (resume.py's StartRefused): nothing is written for it
    refused: bool = False


class JobFailed(CompactHydraException):
    """A job ended without a result: an exception, a crash or a killed rank. The ranks have
    printed their own errors; this is the one-line verdict (Hydra prints it as is). Its cause
    is rank 0's exception when there is one, so a user error behind it stays findable."""

    reason: str = ""  # the verdict without the job's name

    @property
    def exit_code(self) -> int:
        """The status a sweep ends with when Hydra's sweeper raises this (its first failed
        job): 2 when the job's error is the user's, else 1."""
        return UserError.exit_code if find_user_error(self.__cause__) is not None else 1


class SweepStopped(CompactHydraException):
    """The launcher was asked to stop (SIGINT, SIGTERM): its running jobs were stopped the way
    preemption stops them and recorded; a resumed sweep continues them. Or fail_fast stopped it.
    `exit_code`: the launcher's (128 + the signal's number; 2 when a user error stopped it)."""

    exit_code = 1


class FailedFast(Exception):  # noqa: N818 - it is how the sweep ended, not an error of ours
    """hydra.launcher.fail_fast: `job` failed for good (after its retries) with `ret`; the
    launcher stops the sweep (ddp_launcher/lifecycle.py)."""

    def __init__(self, job: Job, ret: Any) -> None:
        self.job, self.ret = job, ret
        error = verdict_of(ret)
        self.reason = getattr(error, "reason", "") or describe(error)
        super().__init__(f"job #{job.num} failed")


class Interrupted(KeyboardInterrupt):
    """A stop signal the launcher received (:func:`stop_signals`), raised like Ctrl-C."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.signal_name = signal.Signals(signum).name
        super().__init__(self.signal_name)


def stop_reason(error: BaseException) -> str:
    """What stopped the launcher: the signal's name, or the error's type."""
    if isinstance(error, Interrupted):
        return error.signal_name
    if isinstance(error, FailedFast):
        return f"fail_fast: job #{error.job.num} failed"
    return "SIGINT" if isinstance(error, KeyboardInterrupt) else type(error).__name__


_stops: list[int] = []  # the stop signals stop_signals turned into Interrupted


def pending_stop() -> BaseException | None:
    """The stop (a signal stop_signals raised for, or a Ctrl-C) behind an error raised in its
    place: a KeyboardInterrupt inside Hydra's composition can come out as another error
    (OmegaConf's flag contexts restore flags on a half-built node)."""
    from ddp_launcher.ranks.interrupt import ctrl_c_received

    if _stops:
        return Interrupted(_stops[-1])
    return KeyboardInterrupt() if ctrl_c_received() else None


@contextmanager
def stop_signals(signums: Sequence[int]) -> Iterator[None]:
    """While launching, each of `signums` raises Interrupted in the main thread, as Ctrl-C does,
    so the launcher stops its jobs on its way out instead of dying with them running. A signal
    this process ignores stays ignored (`nohup` ignores SIGHUP: the sweep outlives the shell)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, _frame: Any) -> None:
        _stops.append(signum)
        raise Interrupted(signum)

    previous = {
        s: signal.signal(s, interrupt) for s in signums if signal.getsignal(s) is not signal.SIG_IGN
    }
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


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


def refuse_unknown_keys(schema: type, launcher_cfg: Any, group: str) -> None:
    """`+hydra.launcher.<key>=...` adds a key the launcher's schema does not have (Hydra lets
    `+` append to any node): one line naming it and the keys there are, not silently ignored."""
    keys = launcher_cfg.keys() if launcher_cfg is not None else ()
    unknown = sorted(str(k) for k in keys if k not in schema.__dataclass_fields__)
    if unknown:
        known = ", ".join(k for k in schema.__dataclass_fields__ if not k.startswith("_"))
        raise UserError(
            f"hydra.launcher.{unknown[0]}: not a key of {group}, which would ignore it: drop it "
            f"(its keys: {known})"
        )


def resolve_output_dirs(config: DictConfig, keys: Sequence[str]) -> None:
    """Resolve the output dir keys here, once: ranks are other processes, and `${now:}` resolved
    there would name another directory. Resolved as Hydra's run_job does, with the job's config
    as HydraConfig (`${hydra:runtime.choices.model}` resolves); one that does not resolve to a
    dir name (`${model}`: a node) is a UserError naming the key."""
    from hydra.core.hydra_config import HydraConfig

    before, readonly = HydraConfig.instance().cfg, config.hydra._get_node_flag("readonly")
    try:
        HydraConfig.instance().set_config(config)  # (it makes the hydra node read-only)
        with read_write(config.hydra), open_dict(config):
            for key in keys:
                try:
                    value = OmegaConf.select(config, key)
                except Exception as e:  # noqa: BLE001 - OmegaConf's many resolution errors
                    node = OmegaConf.select(config, key.rpartition(".")[0])
                    raw = OmegaConf.to_container(node, resolve=False)[key.rpartition(".")[2]]
                    cause = one_line(str(e).split("\n")[0]).replace("While dereferencing ", "")
                    raise UserError(
                        f"{key}={raw} does not resolve to a dir name here ({cause[:200]}): use "
                        "values each job has, e.g. hydra.sweep.subdir=${hydra.job.num} (the "
                        "default), or lr${optim.lr} naming a swept key"
                    ) from None
                OmegaConf.update(config, key, str(value), merge=False)
    finally:
        HydraConfig.instance().cfg = before
        OmegaConf.set_readonly(config.hydra, readonly)


def check_own_dirs(jobs: Sequence[Job], claimed: dict[Path, Job] | None = None) -> None:
    """One job dir, one job: before any of `jobs` starts, a UserError naming two jobs that
    share a dir (`claimed`: the dirs of this sweep's jobs so far, updated), or a job whose dir
    is the sweep dir itself."""
    claimed = {} if claimed is None else claimed
    for job in jobs:
        if not job.in_sweep:  # (a single run's dir: the gate's)
            continue
        where = Path(job.job_dir).absolute()
        sweep_dir = OmegaConf.select(job.spec.config, "hydra.sweep.dir", default=None)
        if sweep_dir is not None and where.resolve() == Path(str(sweep_dir)).resolve():
            raise UserError(
                f"job #{job.num} ({' '.join(job.overrides) or 'no overrides'}) would write into "
                f"the sweep dir {sweep_dir} itself: give hydra.sweep.subdir a name per job, e.g. "
                "${hydra.job.num} (the default)"
            )
        other = claimed.setdefault(where.resolve(), job)
        if other is not job and other.num != job.num:
            raise UserError(
                f"jobs #{other.num} ({' '.join(other.overrides) or 'no overrides'}) and "
                f"#{job.num} ({' '.join(job.overrides) or 'no overrides'}) would share the job "
                f"dir {where}: one job dir holds one job: make hydra.sweep.subdir name what "
                "tells them apart, e.g. ${hydra.job.num} (the default) or a swept key"
            )


def compose_jobs(
    launcher: Any, job_overrides: Sequence[Sequence[str]], initial_idx: int
) -> list[Job]:
    """Each sweep job's config, composed here (hydra.job.num and .id set, output dirs resolved,
    the sweep's keys in hydra.job.env_set). A job whose config does not compose fails alone
    (job.error), with a config good enough to name its job dir."""
    from hydra.core.singleton import Singleton

    swept = swept_keys(launcher.config, job_overrides)
    jobs = []
    for idx, overrides in enumerate(job_overrides):
        num, error = initial_idx + idx, None
        try:
            config = launcher.hydra_context.config_loader.load_sweep_config(
                launcher.config, list(overrides)
            )
        except Exception as e:  # noqa: BLE001 - Hydra's composition errors have many types
            if (stop := pending_stop()) is not None:
                raise stop from None  # (a stop, not this job's error)
            config, error = copy.deepcopy(launcher.config), describe(e)
            with read_write(config), open_dict(config):
                config.hydra.overrides.task = list(overrides)
        with read_write(config), open_dict(config):
            config.hydra.job.id = f"{config.hydra.job.name}_{num}"
            config.hydra.job.num = num
            config.hydra.job.env_set[SWEPT_KEYS_ENV] = ",".join(swept)
        try:
            resolve_output_dirs(config, ("hydra.sweep.dir", "hydra.sweep.subdir"))
        except Exception:  # noqa: BLE001 - a config that did not compose may not resolve either
            if error is None:
                raise
            with read_write(config), open_dict(config):
                config.hydra.sweep.subdir = str(num)
            resolve_output_dirs(config, ("hydra.sweep.dir",))
        job_dir = Path(str(config.hydra.sweep.dir)) / str(config.hydra.sweep.subdir)
        spec = JobSpec(
            launcher.task_function,
            config,
            Singleton.get_state(),
            hydra_context=launcher.hydra_context,
        )
        jobs.append(
            Job(num, list(overrides), job_dir, spec, label=f"#{num} ", error=error, swept=swept)
        )
    return jobs


def failure_reason(
    rank0_error: BaseException | str | None, dead_ranks: Sequence[str], otherwise: str
) -> str:
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


def failed_job_return(
    job: Job,
    reason: str,
    ret: Any = None,
    cause: BaseException | None = None,
    task_error: BaseException | None = None,
) -> Any:
    """Record a failed job in its run dir; its failed JobReturn. Where the job failed of its
    task's own exception (`task_error`: rank 0's, the value of rank 0's JobReturn `ret`), that
    JobReturn as rank 0 sent it, as Hydra's launchers hand a failed job back (Hydra 1.4 keeps the
    rank's traceback in it): the exception, with the launcher's verdict attached
    (:func:`attach_verdict`). Otherwise (a rank killed, another rank's error first, a job that
    never started) a JobReturn whose value is the verdict, JobFailed, caused by `cause` when
    given (e.g. the user error another rank hit first), else by rank 0's error."""
    from hydra.core.utils import JobReturn, JobStatus

    error = cause if cause is not None else job_value(ret) if isinstance(ret, JobReturn) else None
    record_failure(job, reason, user_error=find_user_error(error) is not None)
    verdict = JobFailed(f"job #{job.num} ({' '.join(job.overrides)}): {reason}")
    verdict.reason = reason
    verdict.__cause__ = error if isinstance(error, BaseException) else None
    if task_error is not None and isinstance(ret, JobReturn) and job_value(ret) is task_error:
        attach_verdict(task_error, verdict)
        ret.status = JobStatus.FAILED
        return ret
    if not isinstance(ret, JobReturn):
        return job_return(job, JobStatus.FAILED, verdict)
    # A new JobReturn with rank 0's fields, not rank 0's own with its value swapped: Hydra 1.4's
    # carries the rank's traceback, which Hydra would then print with the verdict.
    return JobReturn(
        overrides=ret.overrides,
        cfg=ret.cfg,
        hydra_cfg=ret.hydra_cfg,
        working_dir=ret.working_dir,
        task_name=ret.task_name,
        status=JobStatus.FAILED,
        _return_value=verdict,
    )


VERDICT_ATTR = "launcher_verdict"  # the JobFailed attached to a failed job's own exception


def attach_verdict(error: BaseException, verdict: JobFailed) -> None:
    """The launcher's word on a job that failed of `error`: `error.launcher_verdict` (the
    JobFailed, its `.reason` the one line), and a note Python prints under the traceback."""
    setattr(error, VERDICT_ATTR, verdict)
    note = f"hydra-ddp-launcher: {verdict}"
    notes = getattr(error, "__notes__", None)
    if not isinstance(notes, list):
        notes = []
        error.__notes__ = notes  # (BaseException.add_note from Python 3.11 does the same)
    if note not in notes:
        notes.append(note)


def verdict_of(ret: Any) -> Any:
    """A failed JobReturn's verdict (JobFailed: the job's one line) whether its value is the
    verdict or the task's own exception carrying it; else its value as is."""
    value = job_value(ret)
    return getattr(value, VERDICT_ATTR, None) or value


def record_failure(job: Job, reason: str, *, user_error: bool = False) -> None:
    """Give a failed job a result.json (the sweep summary reads it) unless this attempt wrote its
    own: that one gets the job's verdict as its error (rank 0's can be a consequence of another
    rank's), and an earlier run's stays as it is when a user error refused this attempt."""
    if not job.records or job.refused:
        return  # another node's launcher keeps them; a refused start leaves its dir as it was
    if run_lock.holder(job.job_dir) is not None and not run_lock.held_for_me(job.job_dir):
        return  # another process's run: not ours to write in
    own = read_result(job.job_dir, since=job.started or time.time())
    if own is not None:
        if own.status == "failed" and own.error != reason:
            own.error = reason
            write_result(job.job_dir, own)
        return
    if user_error and (job.job_dir / RESULT_FILE).exists():
        return
    write_launcher_result(job, "failed", reason)


def write_launcher_result(job: Job, status: str, error: str) -> RunResult:
    """Write the result.json of a job whose run left none of its own (the launcher's word: its
    launcher part; the app's part is empty): its attempt's times, overrides and number."""
    ended = time.time()
    result = RunResult(
        status=status,
        error=error,
        started=job.started or None,
        ended=ended,
        wall_time_s=round(ended - job.started, 3) if job.started else None,
        overrides=list(job.overrides),
        job_num=job.num,
    )
    write_result(job.job_dir, result)
    return result


def job_done(job: Job, ret: Any) -> Any:
    """Say in one line how a sweep job ended: `#3 completed  val/loss=0.0123 (min, epoch 5)
    41.2s  lr=0.05 hidden=128`, or `#4 failed  3.1s  lr=0.5: <why>`; return `ret`. The value is
    the job's from its result.json (`value`, `metric`, `direction`, `value_epoch`)."""
    if not job.in_sweep:
        return ret
    completed = ret.status.name == "COMPLETED"
    result = read_result(job.job_dir, since=job.started or None)
    status = "completed" if completed else "failed"
    if result is not None and result.status in (("pruned",) if completed else STOPPED):
        status = result.status
    parts = [f"#{job.num} {status}"]
    if result is not None and isinstance(result.value, int | float):
        at = f", epoch {result.value_epoch}" if result.value_epoch is not None else ""
        name = result.metric or "value"
        parts.append(f"{name}={fmt_value(float(result.value))} ({result.direction}{at})")
    if job.started:
        parts.append(fmt_duration(time.time() - job.started))
    values = label(swept_values(job.overrides, job.swept), " ")
    if values:
        parts.append(values)
    line = "  ".join(parts)
    if completed:
        log.info("%s", line)
    else:
        error = verdict_of(ret)
        log.error("%s: %s", line, getattr(error, "reason", "") or describe(error))
    return ret


def configure_sweep_logging(config: DictConfig) -> None:
    """Apply the sweep's `hydra.hydra_logging` again once the sweeper is set up: libraries it
    imported meanwhile set their own log levels (optuna's study banner)."""
    from hydra.core.utils import configure_log

    configure_log(config.hydra.hydra_logging, config.hydra.verbose)


@contextmanager
def launcher_errors() -> Iterator[None]:
    """A user error found by the launcher itself (SLURM not reachable, a sweep started inside a
    rank): one line and exit status 2, before Hydra would print it between lines of its own."""
    try:
        yield
    except UserError as e:
        log.error("%s", describe(e))
        raise SystemExit(e.exit_code) from None
