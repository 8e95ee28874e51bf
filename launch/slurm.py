"""SLURM: each SLURM task is one rank. The engine behind `hydra/launcher=slurm`.

* **SLURM -> torch**: :func:`torch_env` maps a task's SLURM variables to what
  `init_process_group("env://")` and components/distributed.py read: RANK = SLURM_PROCID,
  LOCAL_RANK = SLURM_LOCALID, WORLD_SIZE = tasks of the step, LOCAL_WORLD_SIZE = tasks on this
  node, MASTER_ADDR = the step's first node, MASTER_PORT = a port derived from the job id and
  restart count (the same in every task, a different one for every job and every requeue).
  No torchrun runs inside a task. `python -m launch.slurm env` prints the mapping of the task it
  runs in; launch/sbatch_example.sh does the same mapping in bash for `srun python train.py`.
* **The launcher** (:class:`DDPSlurmLauncherBase`, subclassed by
  hydra_plugins/hydra_ddp_slurm_launcher; options: :class:`DDPSlurmQueueConf`): composes each
  sweep job's config here (launch/jobs.py, as the torchrun launcher does), reads its world size
  (`dist.nnodes` x `dist.nproc_per_node`, components/world.py's rules) and turns it into that
  job's SLURM resources (nodes, tasks per node, GPUs). Jobs that ask for the same resources go
  out as one submitit job array; the launcher then waits for rank 0's JobReturn of each (the
  sweeper's value), or says why a job ended without one. Each job dir's launch.json records
  the SLURM job of every attempt: a failed job is submitted again (`retries`), and a resumed
  sweep (`resume`, launch/resume.py) waits for the SLURM jobs a dead launcher left queued or
  running instead of submitting them twice. SIGINT/SIGTERM of the launcher cancel the sweep's
  jobs (their ranks checkpoint on SLURM's SIGTERM) and record them; SIGHUP (a dropped SSH
  session) leaves them running, for a resumed sweep to collect.
* **In each task** (:func:`run_task`): launch/rank.py's rank bootstrap, as in a torchrun rank:
  rank 0 runs the job as the Hydra job (`.hydra/`, log, callbacks) and returns its JobReturn
  (submitit's result); the other ranks write nothing and return None.
* **Preemption and time limits**: sbatch `--signal=USR1@<signal_delay_s>` and `--requeue`.
  USR1/TERM reach train.py's components/preemption.py (agreed stop, checkpoint, rank 0 runs
  `scontrol requeue`, exit 75); the requeued job runs the same pickled job again: same job dir,
  SLURM_RESTART_COUNT > 0 makes train.py resume, the same W&B run continues. Ranks other than 0
  end a preempted task with exit 0 so that `srun --kill-on-bad-exit` leaves rank 0 the time to
  finish. submitit's own handlers (USR2: its checkpoint-and-requeue, TERM: ignored) are
  replaced in each task until train.py installs its own: USR1 before training has started
  requeues at once (nothing new to save yet), TERM ends the task (srun also sends it to stop
  the other tasks when one fails, and scancel to cancel), USR2 is forwarded as USR1.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn, JobStatus
from hydra_plugins.hydra_submitit_launcher.config import SlurmQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher
from omegaconf import DictConfig, OmegaConf, open_dict

from components.errors import UserError, describe
from components.run_dir import ATTEMPT_ENV, read_result
from components.world import parse_count
from launch.jobs import (
    Interrupted,
    Job,
    Stopped,
    check_batch_size,
    check_gpus,
    configure_sweep_logging,
    failed_job_return,
    failure_reason,
    job_done,
    job_return,
    job_world,
    launch_batch,
    launcher_errors,
    settings_from,
)
from launch.rank import report_failure, run_rank
from launch.resume import (
    Attempt,
    close_attempt,
    prepare,
    record_stopped,
    should_retry,
    start_attempt,
    update_attempt,
)

log = logging.getLogger(__name__)

PORT_RANGE = (20000, 60000)
# How long cancelled jobs get to checkpoint and end (SLURM's KillWait, then SIGKILL) before
# the launcher records them and exits.
STOP_GRACE_S = 120.0
# SLURM job states after which a job will not run again (squeue/sacct spellings).
ACTIVE_STATES = {
    "PENDING",
    "CONFIGURING",
    "RUNNING",
    "COMPLETING",
    "REQUEUED",
    "REQUEUE_FED",
    "REQUEUE_HOLD",
    "RESIZING",
    "SUSPENDED",
    "STOPPED",
    "SIGNALING",
    "STAGE_OUT",
    "RESV_DEL_HOLD",
    "PREEMPTED",
    "SPECIAL_EXIT",
}


# ---------------------------------------------------------------------------------------------
# SLURM environment -> torch.distributed environment


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compressed host list -> host names: `gpu[01-03,7],cpu1` -> gpu01 gpu02 gpu03 gpu7
    cpu1 (what `scontrol show hostnames` prints)."""
    hosts: list[str] = []
    for group in re.findall(r"[^,\[]+(?:\[[^\]]*\][^,\[]*)*", nodelist):
        parts = re.split(r"\[([^\]]*)\]", group)  # prefix, range, text, range, ...
        names = [""]
        for i, part in enumerate(parts):
            if i % 2 == 0:
                names = [n + part for n in names]
                continue
            suffixes = []
            for item in part.split(","):
                low, _, high = item.partition("-")
                if not high:
                    suffixes.append(low)
                else:
                    suffixes += [f"{n:0{len(low)}d}" for n in range(int(low), int(high) + 1)]
            names = [n + s for n in names for s in suffixes]
        hosts += [n for n in names if n]
    return hosts


def expand_tasks_per_node(spec: str) -> list[int]:
    """SLURM_STEP_TASKS_PER_NODE / SLURM_TASKS_PER_NODE: `2(x3),1` -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for item in spec.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if not match:
            raise ValueError(f"cannot read SLURM tasks per node {spec!r}")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def master_port(job_id: str, restart: int = 0) -> int:
    """The same port in every task of one job run; a different one per job and per requeue
    (a requeued job never meets the previous run's store). launch/sbatch_example.sh computes
    the same: 20000 + (SLURM_JOB_ID + 7919 x SLURM_RESTART_COUNT) mod 40000."""
    low, high = PORT_RANGE
    if not job_id.isdigit():  # not a SLURM job id: any stable choice
        return random.Random(f"hydra-ddp/{job_id}/{restart}").randrange(low, high)
    return low + (int(job_id) + 7919 * restart) % (high - low)


def in_slurm_task(environ: Mapping[str, str] = os.environ) -> bool:
    """True in a task started by srun (a job step), not in the batch script itself."""
    return "SLURM_PROCID" in environ and "SLURM_STEP_ID" in environ


def torch_env(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The torch.distributed variables of this SLURM task (see the module docstring)."""
    try:
        rank = int(environ["SLURM_PROCID"])
        local_rank = int(environ.get("SLURM_LOCALID", "0"))
        world = int(environ.get("SLURM_STEP_NUM_TASKS") or environ["SLURM_NTASKS"])
        nodes = expand_nodelist(
            environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST") or ""
        ) or [socket.gethostname()]
        per_node_spec = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get(
            "SLURM_TASKS_PER_NODE"
        )
        per_node = expand_tasks_per_node(per_node_spec) if per_node_spec else [world]
        node = int(environ.get("SLURM_NODEID", "0"))
        local_world = per_node[node] if node < len(per_node) else per_node[-1]
        job_id = environ.get("SLURM_JOB_ID", "0")
        restart = int(environ.get("SLURM_RESTART_COUNT") or 0)
    except (KeyError, ValueError) as e:
        raise UserError(f"not a SLURM task, or SLURM variables I cannot read ({e})") from None
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(local_world),
        "GROUP_RANK": str(node),  # the node's index, as torchrun names it
        "MASTER_ADDR": nodes[0],
        "MASTER_PORT": str(master_port(job_id, restart)),
    }


def export_torch_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """Set this task's torch variables (overwriting any the submitting shell passed on: the
    SLURM variables are the truth here) and a default OMP_NUM_THREADS. Returns them."""
    environ = os.environ if environ is None else environ
    values = torch_env(environ)
    environ.update(values)
    environ.setdefault("OMP_NUM_THREADS", environ.get("SLURM_CPUS_PER_TASK", "1"))
    return values


def export_torch_env_in_srun() -> bool:
    """For `srun python train.py` without any mapping: export the torch variables when this
    process is one of several tasks of an srun step and nothing set RANK yet."""
    if "RANK" in os.environ or not in_slurm_task():
        return False
    if int(os.environ.get("SLURM_STEP_NUM_TASKS") or os.environ.get("SLURM_NTASKS") or 1) < 2:
        return False
    export_torch_env()
    return True


# ---------------------------------------------------------------------------------------------
# the launcher's options, and the Launcher


@dataclass
class DDPSlurmQueueConf(SlurmQueueConf):
    """hydra-submitit-launcher's SLURM options, plus what a DDP job needs.

    A job's world size comes from its own config, not from here: each job gets
    nodes = dist.nnodes and tasks per node = dist.nproc_per_node (one task per rank), and
    GPU jobs one GPU per task. `auto` resolves as with the torchrun launcher: nproc = the GPUs
    of a node (gpus_per_node), 1 on CPU or with dist.backend=gloo; nnodes = 1. The project's
    ready-to-use config, with every key documented, is conf/hydra/launcher/slurm.yaml.
    """

    _target_: str = "hydra_plugins.hydra_ddp_slurm_launcher.slurm_launcher.DDPSlurmLauncher"
    # auto: each job's dist.nnodes / dist.nproc_per_node. An integer fixes the value for every
    # job of the sweep (then a job's explicit dist value must agree with it).
    nodes: Any = "auto"
    tasks_per_node: Any = "auto"
    # The GPUs a node offers to a job; GPU jobs ask for one per task (--gpus-per-node=<tasks>).
    # auto: what `sinfo` reports for the partition (gres gpu:N), 0 on a CPU cluster.
    gpus_per_node: Any = "auto"
    # Sent signal_delay_s seconds before the time limit (sbatch --signal): components/preemption.py
    # checkpoints, requeues the job (sbatch --requeue) and exits; the requeued job resumes.
    signal: str = "USR1"
    signal_delay_s: int = 120
    requeue: bool = True
    # Extra srun arguments (sbatch arguments: additional_parameters).
    srun_args: list[str] = field(default_factory=lambda: ["--kill-on-bad-exit=1"])
    # How often the launcher asks SLURM (squeue, else sacct) about its jobs.
    poll_interval_s: float = 5.0
    # Rerun with the same command and hydra.sweep.dir: completed jobs are not run again, jobs
    # still queued or running are waited for, the others continue from their checkpoints.
    resume: bool = False
    # Submit a failed job again (from its checkpoints) up to this many times; user errors are
    # not retried.
    retries: int = 0

    @classmethod
    def from_config(cls, launcher_cfg: Any) -> DDPSlurmQueueConf:
        known = settings_from(cls, launcher_cfg)
        if "additional_parameters" in known:
            known["additional_parameters"] = dict(known["additional_parameters"] or {})
        if "srun_args" in known:
            known["srun_args"] = list(known["srun_args"] or [])
        return cls(**known)


ConfigStore.instance().store(group="hydra/launcher", name="ddp_slurm", node=DDPSlurmQueueConf)


class DDPSlurmLauncherBase(SlurmLauncher):
    """hydra-submitit-launcher's SlurmLauncher with one SLURM task per rank.

    launch(): each job's resources from its own `dist` config (jobs asking for the same go out
    as one array), then rank 0's JobReturn per job. __call__ (in every task, with its Job):
    :func:`run_task`.
    """

    def setup(self, *, hydra_context: Any, task_function: Any, config: DictConfig) -> None:
        super().setup(hydra_context=hydra_context, task_function=task_function, config=config)
        configure_sweep_logging(config)

    def __call__(self, job: Job) -> Any:
        return run_task(job)

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> list[Any]:
        with launcher_errors():
            if in_slurm_task() and int(os.environ.get("SLURM_STEP_NUM_TASKS") or 1) > 1:
                raise UserError(
                    "a sweep cannot start in every task of an srun step: run "
                    "`python train.py -m ...` once"
                )
            require_slurm()
            return launch_batch(
                self,
                job_overrides,
                initial_job_idx,
                "SLURM launcher",
                lambda jobs: run_on_slurm(self, jobs),
                resume=bool(self.params.get("resume")),
            )


# ---------------------------------------------------------------------------------------------
# per-job resources


_GPU_GRES = re.compile(r"(?:^|,)gpu(?::[^:,(]+)?:(\d+)")


def gpus_in_gres(text: str) -> int:
    """The most GPUs of any node in `sinfo --format=%G` output: gpu:8, gpu:a100:8(S:0-1)."""
    counts = [int(m) for line in text.splitlines() for m in _GPU_GRES.findall(line.strip())]
    return max(counts, default=0)


def cluster_gpus_per_node(partition: str | None) -> int:
    """GPUs per node of `partition` (the default partition when None) as `sinfo` reports
    them in the nodes' generic resources; 0 when none or unknown (a CPU cluster)."""
    cmd = ["sinfo", "--noheader", "--format=%G"]
    if partition:
        cmd.append(f"--partition={partition}")
    try:
        return gpus_in_gres(subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout)
    except (OSError, subprocess.SubprocessError):
        return 0


def launcher_count(settings: DDPSlurmQueueConf, key: str, minimum: int = 1) -> int | None:
    """hydra.launcher.<key>: None for auto (or null), else its count."""
    value = getattr(settings, key)
    return parse_count("auto" if value is None else value, f"hydra.launcher.{key}", minimum)


def job_resources(config: DictConfig, settings: DDPSlurmQueueConf, cluster_gpus: int) -> dict:
    """This job's submitit parameters, from its own `dist` config: one task per rank.

    nproc `auto` = the GPUs of a node for GPU jobs (`hydra.launcher.gpus_per_node`), 1 on CPU
    (or with dist.backend=gloo), as with the torchrun launcher; GPU jobs ask for one GPU per
    task (`--gpus-per-node=<tasks per node>`), each rank taking GPU LOCAL_RANK.
    """
    nproc, nnodes, gpu_job = job_world(config, cluster_gpus)
    for launcher_key, dist_key in (
        ("tasks_per_node", "dist.nproc_per_node"),
        ("nodes", "dist.nnodes"),
    ):
        fixed = launcher_count(settings, launcher_key)
        if fixed is None or fixed == (nproc if launcher_key == "tasks_per_node" else nnodes):
            continue
        if str(OmegaConf.select(config, dist_key, default="auto")) != "auto":
            raise UserError(
                f"{dist_key}={OmegaConf.select(config, dist_key)} but hydra.launcher."
                f"{launcher_key}={fixed}: drop one of them (hydra.launcher.{launcher_key}=auto "
                f"takes each job's {dist_key})"
            )
        if launcher_key == "tasks_per_node":
            nproc = fixed
        else:
            nnodes = fixed
    if settings.gpus_per_task:
        raise UserError(
            "hydra.launcher.gpus_per_task binds each task to its own GPU, but ranks pick GPU "
            "LOCAL_RANK among the node's: use hydra.launcher.gpus_per_node"
        )
    check_gpus(nproc, gpu_job, cluster_gpus, f"hydra.launcher.gpus_per_node={cluster_gpus}")
    additional = {"signal": f"{settings.signal}@{settings.signal_delay_s}"}
    additional["requeue" if settings.requeue else "no-requeue"] = True
    additional.update(settings.additional_parameters)
    params: dict[str, Any] = {
        "timeout_min": settings.timeout_min,
        "nodes": nnodes,
        "tasks_per_node": nproc,
        "name": settings.name,
        "stderr_to_stdout": settings.stderr_to_stdout,
        "slurm_additional_parameters": additional,
        "slurm_srun_args": list(settings.srun_args),
        "slurm_array_parallelism": settings.array_parallelism,
        "slurm_signal_delay_s": settings.signal_delay_s,
        "slurm_setup": [*python_path_setup(), *(settings.setup or [])],
    }
    if gpu_job:
        params["gpus_per_node"] = nproc
    for key in ("cpus_per_task", "mem_gb"):
        if getattr(settings, key) is not None:
            params[key] = getattr(settings, key)
    for key in (
        "partition",
        "qos",
        "comment",
        "constraint",
        "exclude",
        "gres",
        "cpus_per_gpu",
        "mem_per_gpu",
        "mem_per_cpu",
        "account",
    ):
        if getattr(settings, key) is not None:
            params[f"slurm_{key}"] = getattr(settings, key)
    return params


def python_path_setup() -> list[str]:
    """Tasks unpickle the job by reference to this repo's modules (launch/, the plugin, the
    app): put the repo and the app's directory on their import path."""
    import shlex

    repo = str(Path(__file__).resolve().parent.parent)
    dirs = list(dict.fromkeys(d for d in (sys.path[0], repo) if d and os.path.isdir(d)))
    return [f"export PYTHONPATH={shlex.quote(os.pathsep.join(dirs))}${{PYTHONPATH:+:$PYTHONPATH}}"]


# ---------------------------------------------------------------------------------------------
# the launcher: plan, submit, wait, collect


@dataclass
class Submitted:
    job: Job
    params: dict = field(default_factory=dict)  # submitit's executor parameters
    folder: str = ""
    max_num_timeout: int = 0
    poll_s: float = 5.0
    slurm: Any = None  # submitit's SlurmJob (None: not submitted)
    state: str = ""
    ended_since: float | None = None  # first seen in a final (or no) state without a result
    ran: bool = False  # seen running since it was (re)queued
    restarts: int = 0

    def reset(self) -> None:
        """Before it is submitted again (a retry)."""
        self.slurm, self.state, self.ended_since, self.ran, self.restarts = None, "", None, False, 0

    @property
    def label(self) -> str:
        slurm = f" (SLURM job {self.slurm.job_id})" if self.slurm is not None else ""
        return f"#{self.job.num}{slurm}"


def require_slurm() -> None:
    """Before anything is composed or submitted: SLURM's sbatch must be here."""
    if shutil.which("sbatch") is None:
        raise UserError(
            "hydra/launcher=slurm needs SLURM, but `sbatch` is not on PATH here: run the sweep "
            "on a SLURM login node, or use hydra/launcher=torchrun"
        )


def run_on_slurm(launcher: Any, jobs: list[Job]) -> list[Any]:
    """Submit the jobs (a resumed sweep: only the unfinished ones, and it waits for those still
    queued or running), wait for them, submit failed ones again (`retries`); return their
    JobReturns in order."""
    params = launcher.params
    results = prepare(
        jobs,
        resume=bool(params.get("resume")),
        retries=int(params.get("retries") or 0),
        earlier_return=earlier_return,
        slurm_active=active_jobs,
    )
    gpus_by_partition: dict[str | None, int] = {}
    planned = [plan(job, gpus_by_partition) for job in jobs if job.num not in results]

    def ended(s: Submitted) -> bool:
        """Collect a job that ended; True when it was submitted again."""
        ret = finish(s)
        close_attempt(s.job, ret)
        if not should_retry(s.job, ret):
            results[s.job.num] = job_done(s.job, ret)
            return False
        s.reset()
        submit(launcher, [s])
        return True

    try:
        for s in planned:
            if s.job.attach is not None and not s.job.error:
                attach(s, s.job.attach)
        submit(launcher, [s for s in planned if not s.job.error and s.slurm is None])
        wait_for_results(planned, ended)
    except Interrupted as e:  # SIGINT/SIGTERM: cancel (the ranks checkpoint), record, end
        stop([s for s in planned if s.job.num not in results], e.signal_name)
        raise
    except BaseException:  # a failed submission, a bug: take the submitted jobs down
        cancel(planned)
        raise
    for s in planned:
        if s.job.num not in results:  # never submitted: its error
            results[s.job.num] = job_done(s.job, finish(s))
    return [results[job.num] for job in jobs]


def plan(job: Job, gpus_by_partition: dict[str | None, int]) -> Submitted:
    """The job's submission, from its own config (its launcher values may interpolate it);
    job.error when it cannot be submitted (its config did not compose, a world size SLURM
    cannot give it, a batch size its ranks cannot split)."""
    if job.error:
        return Submitted(job)
    try:
        settings = DDPSlurmQueueConf.from_config(job.spec.config.hydra.launcher)
        gpus = launcher_count(settings, "gpus_per_node", minimum=0)
        if gpus is None:
            if settings.partition not in gpus_by_partition:
                gpus_by_partition[settings.partition] = cluster_gpus_per_node(settings.partition)
            gpus = gpus_by_partition[settings.partition]
        params = job_resources(job.spec.config, settings, gpus)
        check_batch_size(job.spec.config, params["tasks_per_node"] * params["nodes"])
    except UserError as e:
        job.error = str(e)
        return Submitted(job)
    job.nproc, job.nnodes = params["tasks_per_node"], params["nodes"]
    job.uses_gpus = "gpus_per_node" in params
    return Submitted(
        job, params, settings.submitit_folder, settings.max_num_timeout, settings.poll_interval_s
    )


def submit(launcher: Any, planned: list[Submitted]) -> None:
    """One submitit array per run of jobs asking for the same resources, in job order; each
    job's attempt (and SLURM job id) recorded in its launch.json."""
    import submitit

    def key(s: Submitted) -> str:
        return json.dumps([s.folder, s.max_num_timeout, s.params], sort_keys=True, default=str)

    todo = [s for s in planned if not s.job.error]
    for _, group in itertools.groupby(sorted(todo, key=key), key=key):
        group = sorted(group, key=lambda s: s.job.num)
        first = group[0]
        executor = submitit.AutoExecutor(
            folder=first.folder, cluster="slurm", slurm_max_num_timeout=first.max_num_timeout
        )
        executor.update_parameters(**first.params)
        for s in group:
            start_attempt(s.job)  # resume=auto when it continues; before the job is pickled
        try:
            with submission_env(), sbatch_errors():
                slurm_jobs = executor.map_array(launcher, [s.job for s in group])
        except BaseException as e:  # SLURM did not take them: their records say so
            for s in group:
                update_attempt(
                    s.job, ended=time.time(), status="failed", error=f"not submitted: {describe(e)}"
                )
            raise
        for s, slurm_job in zip(group, slurm_jobs, strict=True):
            s.slurm = slurm_job
            update_attempt(s.job, slurm_job_id=slurm_job.job_id, slurm_folder=str(s.folder))
            where = f"{s.job.nnodes} node(s) x {s.job.nproc} task(s)"
            log.debug(
                "#%d %s: SLURM job %s, %s%s",
                s.job.num,
                " ".join(s.job.overrides) or "(no overrides)",
                slurm_job.job_id,
                where,
                f", {s.job.nproc} GPU(s) per node" if s.job.uses_gpus else "",
            )
        if len(group) == 1:  # one line per submission: its SLURM id, for squeue and scancel
            log.info("#%d: SLURM job %s", group[0].job.num, slurm_jobs[0].job_id)
        else:
            nums = [s.job.num for s in group]
            contiguous = nums == list(range(nums[0], nums[-1] + 1))
            which = f"#{nums[0]}-#{nums[-1]}" if contiguous else ",".join(f"#{n}" for n in nums)
            log.info("%s: SLURM job array %s", which, str(slurm_jobs[0].job_id).split("_")[0])


@contextmanager
def sbatch_errors() -> Iterator[None]:
    """sbatch refusing a submission (no controller, a bad partition or account) is the user's
    to fix: one line with sbatch's own words, instead of submitit's traceback and its copy of
    sbatch's stderr."""
    import io
    from contextlib import redirect_stderr

    from submitit.core.utils import FailedJobError, FailedSubmissionError

    with redirect_stderr(io.StringIO()) as printed:
        try:
            yield
        except (FailedJobError, FailedSubmissionError, OSError) as e:
            lines = [x.strip() for x in f"{printed.getvalue()}\n{e}".splitlines() if x.strip()]
            said = lines[-1] if lines else type(e).__name__  # sbatch's last word: fatal: ...
            raise UserError(
                f"SLURM did not take the jobs ({said}): check that `sinfo` and `sbatch` work "
                "here, or use hydra/launcher=torchrun"
            ) from None


def attach(s: Submitted, attempt: Attempt) -> None:
    """Wait for the SLURM job of an earlier launch's attempt (still queued or running) instead
    of submitting the job again."""
    import submitit

    s.slurm = submitit.SlurmJob(folder=attempt.slurm_folder, job_id=attempt.slurm_job_id)
    s.job.started = attempt.started
    log.info("%s: re-attached to the SLURM job of attempt %d", s.label, attempt.attempt)


def earlier_return(job: Job, attempt: Attempt | None) -> JobReturn | None:
    """Rank 0's JobReturn of an attempt, from its SLURM job's submitit result pickle."""
    from submitit.core.utils import JobPaths

    if attempt is None or not attempt.slurm_job_id or not attempt.slurm_folder:
        return None
    path = JobPaths(attempt.slurm_folder, job_id=attempt.slurm_job_id, task_id=0).result_pickle
    outcome = load_outcome(path)
    ret = outcome[1] if outcome and outcome[0] == "success" else None
    return ret if isinstance(ret, JobReturn) else None


def active_jobs(job_ids: Sequence[str]) -> set[str]:
    """Those of `job_ids` SLURM still has queued or running."""
    return {j for j, state in slurm_states(job_ids).items() if state in ACTIVE_STATES}


@contextmanager
def submission_env() -> Iterator[None]:
    """Submitting from inside a SLURM job (salloc, a batch script): hide that job's own
    variables from sbatch and the new job (its SLURM_* but SLURM_CONF; SLURMD_*, SRUN_*,
    SUBMITIT_*, torch's rank variables), as submitit.helpers.clean_env does; SBATCH_* (the
    user's sbatch defaults) are kept."""
    torch_names = {
        "MASTER_ADDR",
        "MASTER_PORT",
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
    }
    hidden = {
        k: os.environ.pop(k)
        for k in list(os.environ)
        if (k.startswith(("SLURM_", "SLURMD_", "SRUN_", "SUBMITIT_")) and k != "SLURM_CONF")
        or k in torch_names
    }
    try:
        yield
    finally:
        os.environ.update(hidden)


def slurm_states(job_ids: Sequence[str]) -> dict[str, str]:
    """Job id -> SLURM state, from squeue (jobs the controller still holds), else sacct (jobs
    accounting remembers). Ids neither knows are left out."""
    if not job_ids:
        return {}
    states: dict[str, str] = {}
    base = ",".join(sorted({j.split("_")[0] for j in job_ids}))
    for cmd in (
        ["squeue", "--noheader", "--array", "--states=all", "--format=%i|%T", f"--jobs={base}"],
        [
            "sacct",
            "--noheader",
            "--parsable2",
            "--allocations",
            "--format=JobID,State",
            f"--jobs={base}",
        ],
    ):
        if all(j in states for j in job_ids):
            break
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.SubprocessError):
            continue
        if proc.returncode != 0:
            continue
        for line in proc.stdout.splitlines():
            job_id, _, state = line.strip().partition("|")
            if job_id and state and job_id not in states:
                states[job_id] = state.split()[0].rstrip("+").upper()  # "CANCELLED by 0"
    return states


def wait_for_results(
    planned: list[Submitted], ended: Callable[[Submitted], bool] = lambda s: False
) -> None:
    """Poll until every submitted job has rank 0's result or has ended without one; `ended(s)`
    is called as each does (True: it was submitted again, keep waiting for it)."""
    waiting = [s for s in planned if s.slurm is not None]
    poll = min((s.poll_s for s in waiting), default=5.0)
    grace = max(15.0, 2 * poll)
    while waiting:
        states = slurm_states([s.slurm.job_id for s in waiting])
        now = time.time()
        for s in list(waiting):
            state = states.get(s.slurm.job_id, "UNKNOWN")
            if state != s.state:
                note_state(s, state)
            has_result = result_path(s).exists()
            if not has_result and state in ACTIVE_STATES:
                s.ended_since = None
            elif not has_result and s.ended_since is None:
                s.ended_since = now
            elif has_result or now - s.ended_since > grace:
                # rank 0's result, or ended (or forgotten) with none
                waiting.remove(s)
                if ended(s):
                    waiting.append(s)
        if waiting:
            time.sleep(poll)


def note_state(s: Submitted, state: str) -> None:
    s.state = state
    if s.ran and state in ("PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED"):
        s.ran = False
        s.restarts += 1
        log.info("%s requeued: it resumes from its last checkpoint in %s", s.label, s.job.job_dir)
    elif state == "RUNNING" and not s.ran:
        s.ran = True
        log.debug("%s running%s", s.label, f" (restart {s.restarts})" if s.restarts else "")
    elif state not in ACTIVE_STATES and state != "UNKNOWN":
        log.debug("%s %s", s.label, state)  # its line comes when it is collected


def result_path(s: Submitted) -> Path:
    """submitit's result pickle of task 0 (rank 0): ("success", JobReturn) or ("error", tb)."""
    return s.slurm.task(0).paths.result_pickle


def read_outcome(s: Submitted) -> tuple[str, Any] | None:
    return load_outcome(result_path(s))


def load_outcome(path: Path) -> tuple[str, Any] | None:
    for _ in range(3):
        if not path.exists():
            return None
        try:
            import cloudpickle

            with open(path, "rb") as f:
                return cloudpickle.load(f)
        except EOFError:  # still being written by a slow file system
            time.sleep(2)
        except Exception as e:  # noqa: BLE001 - e.g. a class this process cannot import
            return "error", f"unreadable {path} ({type(e).__name__}: {e})"
    return None


def finish(s: Submitted) -> Any:
    """The JobReturn of one job: rank 0's own, or a failed one saying what went wrong."""
    if s.job.error:
        return failed_job_return(s.job, s.job.error, cause=UserError(s.job.error))
    outcome = read_outcome(s)
    ret = outcome[1] if outcome and outcome[0] == "success" else None
    if not isinstance(ret, JobReturn):
        ret = None
    elif ret.status == JobStatus.COMPLETED:
        return ret
    rank0: BaseException | str | None = None
    if ret is not None:  # rank 0's failed JobReturn
        rank0 = ret._return_value
    elif outcome is not None and outcome[0] == "error":  # the task raised outside the job
        lines = [line for line in str(outcome[1]).strip().splitlines() if line.strip()]
        rank0 = lines[-1] if lines else str(outcome[1])
    reason = failure_reason(rank0, other_task_failures(s), ended_without_result(s))
    return failed_job_return(s.job, reason, ret)


def ended_without_result(s: Submitted) -> str:
    logs = f"see {s.slurm.task(0).paths.stderr}"
    state = s.state or "UNKNOWN"
    result = read_result(s.job.job_dir, since=s.job.started)
    if result is not None and result.status == "preempted":
        return (
            f"stopped and checkpointed but not requeued (SLURM job {s.slurm.job_id} {state}; "
            f"requeue=false?): resume=auto continues it in {s.job.job_dir}; {logs}"
        )
    return f"SLURM job {s.slurm.job_id} ended ({state}) without rank 0's result: {logs}"


_SRUN_TASK_ERROR = re.compile(r"^srun: error: (\S+): tasks? ([\d,\-]+): (.+)$", re.MULTILINE)


def other_task_failures(s: Submitted) -> list[str]:
    """srun's own lines about tasks other than 0 that ended badly (`task 1: Killed`), from the
    batch script's stderr (submitit's file of task 0)."""
    try:
        text = s.slurm.task(0).paths.stderr.read_text(errors="replace")
    except OSError:
        return []
    found = []
    for host, tasks, what in _SRUN_TASK_ERROR.findall(text):
        ranks = [int(t) for part in tasks.split(",") for t in _span(part)]
        ranks = [r for r in ranks if r != 0]
        if ranks and "exit code 75" not in what:  # 75: preempted, not a failure
            found.append(f"rank {','.join(map(str, ranks))} on {host}: {what.strip().lower()}")
    return found


def _span(part: str) -> list[int]:
    low, _, high = part.partition("-")
    return list(range(int(low), int(high or low) + 1))


def stop(planned: list[Submitted], why: str, grace_s: float = STOP_GRACE_S) -> None:
    """The launcher was asked to stop: cancel the sweep's SLURM jobs (SLURM sends their tasks
    SIGTERM: the ranks agree on a step, checkpoint, exit 75; a cancelled job is not requeued),
    wait until SLURM says they ended (at most `grace_s`; a second Ctrl-C stops waiting), then
    record each (result.json, launch.json)."""
    live = [s for s in planned if s.slurm is not None]
    cancel(live)
    deadline = time.time() + grace_s
    try:
        while live and time.time() < deadline:
            states = slurm_states([s.slurm.job_id for s in live])
            if not any(states.get(s.slurm.job_id) in ACTIVE_STATES for s in live):
                break
            time.sleep(1.0)
    except KeyboardInterrupt:
        log.warning("not waiting for the cancelled jobs to end")
    for s in live:
        record_stopped(s.job, why)


def cancel(planned: list[Submitted]) -> None:
    ids = [s.slurm.job_id for s in planned if s.slurm is not None]
    if ids and shutil.which("scancel"):
        log.warning("cancelling SLURM job(s) %s", " ".join(ids))
        subprocess.run(["scancel", *ids], check=False, timeout=60)


# ---------------------------------------------------------------------------------------------
# in each SLURM task


def run_task(job: Job) -> Any:
    """One task of a sweep job: one rank, through launch/rank.py's bootstrap. Rank 0 returns
    the job's JobReturn (submitit pickles it for the launcher); the other ranks return None."""
    rank = int(export_torch_env()["RANK"])
    install_stop_handlers(rank)
    os.environ[ATTEMPT_ENV] = str(job.attempt)
    try:
        import submitit

        with open_dict(job.spec.config):
            job.spec.config.hydra.job.id = submitit.JobEnvironment().job_id
        ret = run_rank(job.spec, rank)
    except Stopped as e:  # stopped before the job's task function ran: rank 0 still says so
        if rank != 0:
            raise SystemExit(str(e)) from None
        report_failure(e)
        return job_return(job, JobStatus.FAILED, e)
    except SystemExit as e:
        from components.run_dir import REQUEUE_EXIT_CODE

        # Preempted (exit 75): no result, the job is requeued. Rank 0 requeues it once W&B and
        # the checkpoint are done; the others end quietly so that srun --kill-on-bad-exit does
        # not cut rank 0 short.
        if rank != 0 and e.code == REQUEUE_EXIT_CODE:
            return None
        raise
    return ret if rank == 0 else None


def install_stop_handlers(rank: int) -> None:
    """Replace submitit's signal handlers (USR2: its own checkpoint-and-requeue; TERM: ignored)
    until train.py installs components/preemption.py's. Before training has started there is
    nothing new to save: USR1 (our time-limit signal) requeues the job at once and ends the
    task with exit 75; TERM ends the task (it is also how srun stops the other tasks when one
    fails, and how scancel cancels: no requeue; SLURM's own preemption requeues by itself).
    submitit's USR2 (`job._interrupt()`) is forwarded as USR1, so it always takes our path.
    Installed first thing in a task, before anything slow (torch is imported only on USR1):
    until then submitit ignores TERM, and a task stopped meanwhile is killed without a word."""
    stopping = []

    def stop_before_training(signum, _frame) -> None:
        if stopping:  # e.g. the TERM that follows our own requeue: we are on our way out
            return
        stopping.append(signum)
        name = signal.Signals(signum).name
        if signum == signal.SIGTERM:
            raise Stopped(
                "stopped by SIGTERM (another rank failed, the job was cancelled or preempted)"
            )
        from components.preemption import requeue_on_slurm
        from components.run_dir import REQUEUE_EXIT_CODE

        log.warning("%s before training started: requeueing", name)
        if rank == 0:
            requeue_on_slurm()
        raise SystemExit(REQUEUE_EXIT_CODE)

    def forward_as_usr1(_signum, _frame) -> None:
        os.kill(os.getpid(), signal.SIGUSR1)

    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, stop_before_training)
    submitit_signal = getattr(signal, "SIG" + os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2"))
    if submitit_signal not in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(submitit_signal, forward_as_usr1)


# ---------------------------------------------------------------------------------------------
# CLI: `python -m launch.slurm env` in a task prints its mapping


def main(argv: Sequence[str]) -> int:
    if list(argv) != ["env"]:
        print(
            "usage: srun python -m launch.slurm env   (prints this task's torch variables)",
            file=sys.stderr,
        )
        return 2
    try:
        values = torch_env()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(" ".join(f"{k}={v}" for k, v in values.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
