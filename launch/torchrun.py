"""Run Hydra jobs as torchrun jobs: the engine behind `hydra/launcher=torchrun`.

Each job is one torchrun process (torch's elastic agent, torch.distributed.run: it starts,
supervises and restarts the ranks; we write no process manager), run as
`python -m launch.torchrun <failures.json> <torchrun args>` so that when ranks fail, which ones
and how (exit code, signal, error) is written down for the launcher rather than only printed.
Its ranks run `python -m launch.job_rank <job.pkl>`, which unpickles the job (task function,
composed config, Hydra's singleton state: cloudpickle, as Hydra's submitit launcher does) and
runs it; rank 0 runs it as the Hydra job (`.hydra/`, log, callbacks) and writes the return value
to result.pkl.

A scheduler starts jobs as resources allow: on a GPU node each job gets a disjoint set of GPUs
through CUDA_VISIBLE_DEVICES; on CPU at most `max_parallel` jobs run at once. Every single-node
job gets its own rendezvous port (torchrun --standalone binds port 0), so jobs never collide.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cloudpickle
from hydra.errors import CompactHydraException
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from components.errors import UserError, find_user_error
from hydra_plugins.hydra_ddp_torchrun_launcher.config import TorchrunLauncherConf

log = logging.getLogger(__name__)

JOB_FILES = ".torchrun"  # per-job launcher files inside the job dir: job.pkl, result.pkl, ...
RESULT_PKL = "result.pkl"  # rank 0's JobReturn
JOB_JSON = "job.json"  # rank 0's record: pid, rendezvous address, start and end times
FAILURES_JSON = "failures.json"  # the agent's record of the ranks that failed, first first
RESULT_JSON = "result.json"  # in the job dir: train.py's result, the launcher's if it failed
POLL_S = 0.2


class LauncherSettings(TorchrunLauncherConf):
    """The `hydra.launcher` options; their schema and docs are the plugin's config."""

    @classmethod
    def from_config(cls, launcher_cfg: Any) -> LauncherSettings:
        known = {k: v for k, v in dict(launcher_cfg or {}).items() if k in cls.__dataclass_fields__}
        if known.get("gpus") is not None:
            known["gpus"] = list(known["gpus"])
        return cls(**known)


@dataclass
class JobSpec:
    """What every rank of one job needs; pickled into <job dir>/.torchrun/job.pkl."""

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
    nproc: int
    nnodes: int
    gpus: list[int] = field(default_factory=list)
    process: subprocess.Popen | None = None
    started: float = 0.0
    label: str = ""  # prefixed to every line its ranks print: "#3 " in a sweep
    node: str = ""  # multi-node jobs: this node's name for its own launcher files (node_name)

    @property
    def files(self) -> Path:
        return self.job_dir / JOB_FILES / self.node if self.node else self.job_dir / JOB_FILES


def node_name(settings: LauncherSettings, nnodes: int) -> str:
    """A multi-node job runs in the same (shared) job dir on every node: each node's launcher
    keeps its files (payload, failures, rank logs) apart, under node<node_rank> or its host
    name. Global rank 0 writes result.pkl and job.json into its own node's files."""
    if nnodes == 1:
        return ""
    if settings.node_rank is not None:
        return f"node{settings.node_rank}"
    import socket

    return socket.gethostname()


# ---------------------------------------------------------------------------------------------
# world size and devices


def visible_gpus(settings: LauncherSettings) -> list[int]:
    if settings.gpus is not None:
        return list(settings.gpus)
    if sys.platform.startswith("linux") and "torch" not in sys.modules and not gpu_device_nodes():
        return []  # no GPU driver here: don't import torch (seconds) to count no GPUs
    import torch

    return list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []


def gpu_device_nodes() -> bool:
    """Whether Linux shows a GPU driver's device nodes: NVIDIA, WSL's or AMD ROCm's."""
    import glob

    return bool(glob.glob("/dev/nvidia[0-9]*")) or any(
        os.path.exists(p) for p in ("/dev/dxg", "/dev/kfd")
    )


def job_world(config: DictConfig, settings: LauncherSettings, n_gpus: int) -> tuple[int, int]:
    """(nproc_per_node, nnodes) from the job's own config; `auto` = every usable GPU, 1 on CPU."""
    uses_gpus = (
        n_gpus > 0 and OmegaConf.select(config, settings.backend_key, default="auto") != "gloo"
    )

    def value(key: str, auto: int) -> int:
        raw = str(OmegaConf.select(config, key, default=1))
        if raw == "auto":
            return auto
        if not raw.isdigit() or int(raw) < 1:
            raise UserError(f"{key}={raw} is not valid: use {key}=auto or a positive integer")
        return int(raw)

    return value(settings.nproc_key, n_gpus if uses_gpus else 1), value(settings.nnodes_key, 1)


def torchrun_command(job: Job, settings: LauncherSettings, payload: Path) -> list[str]:
    cmd = [sys.executable, "-m", "launch.torchrun", str(job.files / FAILURES_JSON),
           f"--nproc-per-node={job.nproc}", f"--nnodes={job.nnodes}",
           f"--max-restarts={settings.max_restarts}",
           f"--monitor-interval={settings.monitor_interval}",
           f"--log-dir={job.job_dir / settings.log_dir / job.node}", f"--tee={settings.tee}",
           f"--log-line-prefix-template=[{job.label}rank${{rank}}]: "]  # fmt: skip
    if job.nnodes == 1 and settings.rdzv_endpoint is None:
        cmd.append("--standalone")  # c10d store on port 0: the OS picks a free port per job
    else:
        if not settings.rdzv_endpoint:
            raise UserError(
                f"dist.nnodes={job.nnodes} needs a rendezvous point every node can reach: set "
                "hydra.launcher.rdzv_endpoint=HOST:PORT and start the same job on each node"
            )
        cmd += [f"--rdzv-backend={settings.rdzv_backend}",
                f"--rdzv-endpoint={settings.rdzv_endpoint}",
                f"--rdzv-id={settings.rdzv_id or job.job_dir.name}"]  # fmt: skip
        if settings.node_rank is not None:
            cmd.append(f"--node-rank={settings.node_rank}")
    return [*cmd, "-m", "launch.job_rank", str(payload)]


def job_environment(job: Job) -> dict[str, str]:
    env = dict(os.environ)
    # Ranks import the task function's modules by reference: give them our import path.
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
    if job.gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in job.gpus)
    # One OpenMP thread per rank unless the user chose: N ranks on N cores is the sane default.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(1, job.nproc))))
    return env


# ---------------------------------------------------------------------------------------------
# one job


def start(job: Job, settings: LauncherSettings) -> None:
    files = job.files
    files.mkdir(parents=True, exist_ok=True)
    for stale in (RESULT_PKL, JOB_JSON, FAILURES_JSON):  # from an earlier run into this dir
        (files / stale).unlink(missing_ok=True)
    payload = files / "job.pkl"
    with open(payload, "wb") as f:
        cloudpickle.dump(job.spec, f)
    cmd = torchrun_command(job, settings, payload)
    log.info("#%d %s: %d rank(s)%s", job.num, " ".join(job.overrides) or "(no overrides)",
             job.nproc * job.nnodes, f" on GPUs {job.gpus}" if job.gpus else "")  # fmt: skip
    job.started = time.time()
    # Its own session: the agent and its ranks can be signalled as one group.
    job.process = subprocess.Popen(cmd, env=job_environment(job), start_new_session=True)


def finish(job: Job) -> Any:
    """The JobReturn of a finished job: rank 0's own, or a failed one saying what went wrong."""
    from hydra.core.utils import JobReturn, JobStatus

    assert job.process is not None
    code = job.process.returncode
    ret = None
    result_file = job.files / RESULT_PKL
    if result_file.exists():
        try:
            with open(result_file, "rb") as f:
                ret = cloudpickle.load(f)
        except Exception as e:  # noqa: BLE001 - e.g. a class the launcher cannot import
            log.warning("#%d: unreadable %s (%s: %s)", job.num, result_file, type(e).__name__, e)
    if code == 0 and ret is not None and ret.status == JobStatus.COMPLETED:
        return ret
    if code == 0 and ret is None and job.nnodes > 1:
        # Every rank here succeeded and global rank 0 ran on another node: the job's value
        # and files are that node's (its launcher returns them to its sweeper).
        log.info("#%d: done on this node; rank 0 ran on another node", job.num)
        ret = JobReturn(overrides=job.overrides, cfg=job.spec.config, hydra_cfg=job.spec.config)
        ret.working_dir = str(job.job_dir)
        ret.return_value = None
        ret.status = JobStatus.COMPLETED
        return ret
    error = failure_reason(job, code, ret)
    log.error("#%d %s failed: %s", job.num, " ".join(job.overrides), error)
    record_failure(job, error)
    if ret is None:  # no word from rank 0: a failed JobReturn from what the launcher knows
        ret = JobReturn(overrides=job.overrides, cfg=job.spec.config, hydra_cfg=job.spec.config)
        ret.working_dir = str(job.job_dir)
    ret.return_value = JobFailed(f"job #{job.num} ({' '.join(job.overrides)}): {error}")
    ret.status = JobStatus.FAILED
    return ret


class JobFailed(UserError, CompactHydraException):
    """A torchrun job ended without a result: an exception, a crash or a killed rank. The
    ranks have printed their own errors; this is the one-line verdict (Hydra prints it as is,
    with no traceback, when the sweep stops on it)."""

    exit_code = 1


class TaskExit(Exception):
    """A rank's task function called sys.exit() with a failure code (train.py does, after
    logging a UserError): launch/job_rank.py records it as the job's error, with the message
    of the exception being handled at the exit."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message, exit_code)
        self.exit_code = exit_code

    def __str__(self) -> str:
        return str(self.args[0])

    @classmethod
    def from_exit(cls, e: SystemExit) -> TaskExit:
        code, context = e.code, find_user_error(e.__context__) or e.__context__
        if isinstance(code, str):
            message = code
        elif context is not None and str(context).strip():
            message = str(context).strip()
        else:
            message = f"the task exited with code {code}"
        return cls(message, code if isinstance(code, int) else 1)


def one_line(text: object) -> str:
    lines = str(text).strip().splitlines()
    return lines[0].strip() if lines else ""


def describe_task_error(error: object) -> str | None:
    """One line for the exception in rank 0's failed JobReturn (None if it holds none)."""
    if not isinstance(error, BaseException):
        return None
    user_error = find_user_error(error)
    text = one_line(user_error or error)
    if user_error is None and not isinstance(error, TaskExit):
        text = f"{type(error).__name__}: {text}" if text else type(error).__name__
    return text


def failure_reason(job: Job, code: int | None, ret: Any = None) -> str:
    """The best one-line account of why a job failed, most specific first."""
    # Rank 0 of a train.py job records its own error in result.json; other apps leave none.
    error = job_result(job).get("error")
    if error:
        return one_line(error)
    # Rank 0's JobReturn: the task's exception.
    if ret is not None and ret.status.name == "FAILED":
        text = describe_task_error(ret._return_value)
        if text is not None:
            return text
    # The agent's record of the first rank that failed: a signal, an exit code, an error.
    failures = read_failures(job.files / FAILURES_JSON)
    if failures:
        return f"{describe_failure(failures[0])}; rank logs in {job.job_dir / 'rank_logs'}"
    if code is not None and code < 0:
        return f"torchrun was killed by {signal.Signals(-code).name}"
    if code == 0:
        return "torchrun exited with code 0 but rank 0 left no result"
    return (
        f"torchrun exited with code {code}: see {job.job_dir / 'rank_logs'} for each rank's output"
    )


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


def job_result(job: Job) -> dict:
    """The job's result.json (train.py's rank 0 writes it) if this run of the job wrote it, not
    an earlier run into the same dir."""
    path = job.job_dir / RESULT_JSON
    try:
        if not job.started or path.stat().st_mtime < job.started - 2.0:  # coarse mtimes
            return {}
        result = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return result if isinstance(result, dict) else {}


def record_failure(job: Job, error: str) -> None:
    """Make sure the job dir says it failed (the sweep summary reads result.json)."""
    result_json = job.job_dir / RESULT_JSON
    result = job_result(job)
    result.update(status="failed", overrides=job.overrides, job_num=job.num)
    result.setdefault("error", error)
    result["error"] = result["error"] or error
    if job.started:
        result.setdefault("wall_time_s", round(time.time() - job.started, 3))
    job.job_dir.mkdir(parents=True, exist_ok=True)
    result_json.write_text(json.dumps(result, indent=2))


# ---------------------------------------------------------------------------------------------
# the scheduler


def run_jobs(jobs: list[Job], settings: LauncherSettings) -> list[Any]:
    """Run every job, as many at once as resources allow; return their JobReturns in order."""
    gpus = visible_gpus(settings)
    free_gpus = list(gpus)
    limit = settings.max_parallel or (len(gpus) if gpus else 1)
    for job in jobs:
        if job.nproc > len(gpus) and job.spec.config and gpus and uses_gpu(job, settings):
            raise UserError(
                f"job #{job.num} asks for {job.nproc} GPUs per node but the launcher has "
                f"{len(gpus)} ({gpus}): lower dist.nproc_per_node"
            )
    pending, running, results = deque(jobs), [], {}
    try:
        while pending or running:
            # Start jobs in order while the next one fits (strict FIFO: no job is starved).
            while pending and len(running) < limit:
                job = pending[0]
                if gpus and uses_gpu(job, settings):
                    if len(free_gpus) < job.nproc:
                        break
                    job.gpus, free_gpus = free_gpus[: job.nproc], free_gpus[job.nproc :]
                pending.popleft()
                try:
                    start(job, settings)
                except UserError as e:
                    results[job.num] = failed_before_start(job, str(e))
                    free_gpus = sorted(free_gpus + job.gpus)
                    continue
                running.append(job)
            time.sleep(POLL_S)
            for job in [j for j in running if j.process.poll() is not None]:
                running.remove(job)
                free_gpus = sorted(free_gpus + job.gpus)
                results[job.num] = finish(job)
    except BaseException:
        for job in running:  # Ctrl-C or an error here: take every started job down with us
            terminate(job)
        raise
    return [results[job.num] for job in jobs]


def uses_gpu(job: Job, settings: LauncherSettings) -> bool:
    return OmegaConf.select(job.spec.config, settings.backend_key, default="auto") != "gloo"


def failed_before_start(job: Job, error: str) -> Any:
    from hydra.core.utils import JobReturn, JobStatus

    log.error("#%d %s failed: %s", job.num, " ".join(job.overrides), error)
    record_failure(job, error)
    ret = JobReturn(overrides=job.overrides, cfg=job.spec.config, hydra_cfg=job.spec.config)
    ret.working_dir = str(job.job_dir)
    ret.return_value = JobFailed(f"job #{job.num} ({' '.join(job.overrides)}): {error}")
    ret.status = JobStatus.FAILED
    return ret


def terminate(job: Job, grace_s: float = 30.0) -> None:
    """SIGTERM the agent's process group (it forwards to its ranks), then SIGKILL if needed."""
    if job.process is None or job.process.poll() is not None:
        return
    try:
        os.killpg(job.process.pid, signal.SIGTERM)
        job.process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(job.process.pid, signal.SIGKILL)
        job.process.wait()
    except ProcessLookupError:
        pass


# ---------------------------------------------------------------------------------------------
# entry points


def resolve_output_dirs(config: DictConfig, keys: tuple[str, ...]) -> None:
    """Resolve the output dir keys here, once: ranks are new processes, and `${now:}` resolved
    there would name a different directory."""
    with read_write(config.hydra), open_dict(config):
        for key in keys:
            OmegaConf.update(config, key, str(OmegaConf.select(config, key)), merge=False)


def run_in_torchrun(cfg: DictConfig, task_function: Any) -> Any:
    """`python train.py dist.nproc_per_node=N`: run this very job's N ranks under torchrun.

    Hydra has already made the run dir and written `.hydra/` here; the ranks reuse both.
    """
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.singleton import Singleton

    hydra_cfg = HydraConfig.get()
    settings = LauncherSettings.from_config(hydra_cfg.launcher)
    config = copy.deepcopy(hydra_cfg._get_parent())  # the job's whole config, hydra node too
    resolve_output_dirs(config, ("hydra.run.dir", "hydra.runtime.output_dir"))
    job_dir = Path(hydra_cfg.runtime.output_dir)
    spec = JobSpec(task_function, config, Singleton.get_state(), job_dir_key="hydra.run.dir",
                   job_subdir_key=None)  # fmt: skip
    nproc, nnodes = job_world(config, settings, len(visible_gpus(settings)))
    job = Job(0, list(hydra_cfg.overrides.task), job_dir, spec, nproc, nnodes,
              node=node_name(settings, nnodes))  # fmt: skip
    (ret,) = run_jobs([job], settings)
    return ret.return_value  # raises JobFailed when the job failed


def job_overrides_to_jobs(launcher, job_overrides, initial_job_idx: int) -> list[Job]:
    """Compose each sweep job's config in this process (as Hydra's own launchers do)."""
    from hydra.core.singleton import Singleton

    settings = launcher.settings
    n_gpus = len(visible_gpus(settings))
    jobs = []
    for idx, overrides in enumerate(job_overrides):
        num = initial_job_idx + idx
        config = launcher.hydra_context.config_loader.load_sweep_config(
            launcher.config, list(overrides)
        )
        with open_dict(config):
            config.hydra.job.id = f"{config.hydra.job.name}_{num}"
            config.hydra.job.num = num
        resolve_output_dirs(config, ("hydra.sweep.dir", "hydra.sweep.subdir"))
        job_dir = Path(config.hydra.sweep.dir) / str(config.hydra.sweep.subdir)
        spec = JobSpec(launcher.task_function, config, Singleton.get_state(),
                       hydra_context=launcher.hydra_context)  # fmt: skip
        nproc, nnodes = job_world(config, settings, n_gpus)
        jobs.append(Job(num, list(overrides), job_dir, spec, nproc, nnodes, label=f"#{num} ",
                        node=node_name(settings, nnodes)))  # fmt: skip
    return jobs


def launch_sweep_batch(launcher, job_overrides, initial_job_idx: int) -> list[Any]:
    """Hydra Launcher.launch: run one batch of sweep jobs, return their JobReturns."""
    from hydra.core.utils import configure_log, filter_overrides, setup_globals

    if os.environ.get("RANK") is not None:
        raise UserError("a sweep cannot start inside a torchrun rank: run `python train.py -m ...`")
    setup_globals()
    configure_log(launcher.config.hydra.hydra_logging, launcher.config.hydra.verbose)
    sweep_dir = Path(str(launcher.config.hydra.sweep.dir))
    sweep_dir.mkdir(parents=True, exist_ok=True)
    log.info("torchrun launcher: %d job(s), sweep dir %s", len(job_overrides), sweep_dir)
    for idx, overrides in enumerate(job_overrides):
        log.info("\t#%d : %s", initial_job_idx + idx, " ".join(filter_overrides(overrides)))
    results = run_jobs(job_overrides_to_jobs(launcher, job_overrides, initial_job_idx),
                       launcher.settings)  # fmt: skip
    failed = [f"#{initial_job_idx + i}" for i, r in enumerate(results) if r.status.name == "FAILED"]
    if failed:
        log.error("%d of %d job(s) failed in this batch: %s", len(failed), len(results),
                  ", ".join(failed))  # fmt: skip
    return results


# ---------------------------------------------------------------------------------------------
# the agent: `python -m launch.torchrun FAILURES_JSON [torchrun args]`


def agent_main(argv: list[str]) -> int:
    """Run torchrun (torch.distributed.run) with the given arguments. When ranks
    fail, write who failed and how to FAILURES_JSON, earliest first, and print one line per
    failed rank instead of torchrun's 40-line traceback; the ranks' own errors are above it."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    failures_path, args = Path(argv[0]), argv[1:]
    try:
        run(parse_args(args))  # torchrun's main() minus @record, which would only log noise
    except ChildFailedError as e:
        # In the order torch observed them (ranks it stopped itself come last); the earliest
        # first, as torch picks its root cause (timestamps have 1 s resolution: ties keep order).
        failures = sorted(
            (rank_failure(rank, failure) for rank, failure in e.failures.items()),
            key=lambda f: f["timestamp"],
        )
        tmp = failures_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(failures, indent=2))
        os.replace(tmp, failures_path)
        for i, failure in enumerate(failures):
            what = "first failure" if i == 0 else "then"
            print(f"torchrun: {what}: {describe_failure(failure)}", file=sys.stderr, flush=True)
        return 1
    return 0


def rank_failure(rank: int, failure: Any) -> dict:
    """A JSON view of torch's ProcessFailure; `error` only when the rank recorded one."""
    message = failure.message
    if isinstance(message, dict):  # torch's ErrorHandler format: {"message": ..., "extraInfo"}
        message = message.get("message")
    has_error_file = bool(failure.error_file) and os.path.isfile(failure.error_file)
    return {
        "rank": rank,
        "local_rank": failure.local_rank,
        "pid": failure.pid,
        "exitcode": failure.exitcode,
        "signal": failure.signal_name() if failure.exitcode < 0 else None,
        "error": str(message) if has_error_file and message else None,
        "timestamp": failure.timestamp,
    }


if __name__ == "__main__":
    sys.exit(agent_main(sys.argv[1:]))
