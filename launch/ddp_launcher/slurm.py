"""`hydra/launcher=slurm`: every sweep job is a SLURM job whose tasks are its ranks.

The launcher (:class:`DDPSlurmLauncherBase`, options :class:`DDPSlurmQueueConf`) runs the sweep
through ddp_launcher/lifecycle.py with :class:`SlurmBackend`: each job's world size (`dist.nnodes` x
`dist.nproc_per_node`) becomes its SLURM nodes, tasks per node and GPUs; jobs asking for the
same resources go out as one submitit job array, then rank 0's JobReturn of each is collected
(or why it ended without one). launch.json keeps each attempt's SLURM job, so a resumed sweep
waits for the jobs a dead launcher left instead of submitting them twice. SIGINT/SIGTERM cancel
the sweep's jobs (their ranks checkpoint on SLURM's SIGTERM) and record them; SIGHUP (a dropped
SSH session) leaves them running. Each task runs ddp_launcher/ranks/slurm_task.py. Hydra
instantiates hydra_plugins/hydra_ddp_launcher/slurm_launcher.py's class, which makes a
:class:`DDPSlurmLauncherBase`; its config is served from there (searchpath.py).
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.plugins.launcher import Launcher
from omegaconf import DictConfig, OmegaConf

from ddp_launcher.core.app_command import APP_COMMAND_ENV, app_command
from ddp_launcher.core.errors import UserError, job_value
from ddp_launcher.core.host import require_extra
from ddp_launcher.core.repro import CODE_DIR_ENV, task_code_dir
from ddp_launcher.core.requeue import MAX_NUM_TIMEOUT_ENV
from ddp_launcher.core.run_dir import read_result
from ddp_launcher.core.world import check_gpus, job_world, parse_count
from ddp_launcher.jobs import (
    Job,
    configure_sweep_logging,
    failed_job_return,
    failure_reason,
    launcher_errors,
    refuse_unknown_keys,
    settings_from,
)
from ddp_launcher.lifecycle import LifecycleLauncher
from ddp_launcher.ranks.job_spec import NotStarted, Stopped
from ddp_launcher.ranks.slurm_task import in_slurm_task, number_range, run_task
from ddp_launcher.slurm_queue import (
    ACTIVE_STATES,
    partition_resources,
    require_slurm,
    sbatch_errors,
    slurm_states,
    submission_env,
)

log = logging.getLogger(__name__)

# How long cancelled jobs get to checkpoint and end (SLURM's KillWait, then SIGKILL) before
# the launcher records them and exits.
STOP_GRACE_S = 120.0
# hydra-submitit-launcher's options passed on to submitit as slurm_<key> when set.
SLURM_KEYS = (
    "partition qos comment constraint exclude gres cpus_per_gpu mem_per_gpu mem_per_cpu account"
)


@dataclass
class DDPSlurmQueueConf:
    """`hydra.launcher` of `hydra/launcher=slurm` (also `ddp_slurm`): every job of a sweep is
    one SLURM job, one task per rank, e.g.

        python my_app.py -m hydra/launcher=slurm dist.nproc_per_node=8 dist.nnodes=2 lr=0.05,0.1
        python my_app.py -m hydra/launcher=slurm hydra.launcher.partition=gpu ...

    Each job's own dist.nnodes x dist.nproc_per_node becomes its nodes x tasks per node (GPU
    jobs: one GPU per task), so jobs of one sweep may differ in size; jobs asking for the same
    resources are submitted together as one job array. Every key can be overridden per sweep
    (hydra.launcher.<key>=...) and may interpolate the job's config, e.g. timeout_min:
    ${oc.select:epochs,10}. hydra-submitit-launcher's SLURM keys keep their meanings
    (its SlurmQueueConf, 1.2): submitit_folder (submitit's files per job, on a file system every
    node sees; %j is the SLURM job id), name, timeout_min (the job's time limit, sbatch --time;
    a requeue starts a fresh one), cpus_per_task (CPUs per task, e.g. dataset.num_workers + 1;
    null: GPU jobs get their GPU's share of the node from sinfo, 4 where sinfo cannot tell, CPU
    jobs the cluster's default), mem_gb (per node), partition, account, qos, constraint,
    exclude, comment (null: the cluster's default), additional_parameters (extra sbatch
    options, {mail-type: END}), setup (shell lines run in the batch script before srun: module
    load ..., source venv/bin/...) and array_parallelism (jobs of one array running at once).
    A key this launcher does not use is refused in one line."""

    _target_: str = "hydra_plugins.hydra_ddp_launcher.slurm_launcher.DDPSlurmLauncher"
    # -- hydra-submitit-launcher's keys, as it passes them to submitit --
    submitit_folder: str = "${hydra.sweep.dir}/.submitit/%j"
    timeout_min: int = 60
    cpus_per_task: int | None = None
    # GPUs each node's job requests (sbatch --gpus-per-node), as with submitit; auto (or
    # null): one per rank of a GPU job, as many ranks as sinfo says a node has for nproc auto
    gpus_per_node: Any = "auto"
    # auto: each job's dist.nnodes / dist.nproc_per_node; an integer fixes it for every job
    tasks_per_node: Any = "auto"
    mem_gb: int | None = None
    nodes: Any = "auto"
    name: str = "${hydra.job.name}"
    stderr_to_stdout: bool = False
    partition: str | None = None
    qos: str | None = None
    comment: str | None = None
    constraint: str | None = None
    exclude: str | None = None
    gres: str | None = None
    cpus_per_gpu: int | None = None
    gpus_per_task: int | None = None  # refused: ranks pick GPU LOCAL_RANK among the node's
    mem_per_gpu: str | None = None
    mem_per_cpu: str | None = None
    account: str | None = None
    signal_delay_s: int = 120
    # requeues of a job that reached its time limit (submitit's meaning: a preempted job is
    # requeued whatever the count)
    max_num_timeout: int = 3
    additional_parameters: dict[str, Any] = field(default_factory=dict)
    array_parallelism: int = 256
    setup: list[str] | None = None
    # -- a DDP job's --
    # sent signal_delay_s before the time limit: the ranks checkpoint and requeue the job
    signal: str = "USR1"
    requeue: bool = True
    # one rank failing ends the job instead of a collective timeout
    srun_args: list[str] = field(default_factory=lambda: ["--kill-on-bad-exit=1"])
    poll_interval_s: float = 5.0  # how often to ask SLURM (squeue, else sacct) about the jobs
    resume: bool = False  # continue the sweep in hydra.sweep.dir (ddp_launcher/resume.py)
    resume_key: str | None = None  # the app's key a job run again gets `auto` in
    retries: int = 0  # submit a failed job again up to N times (user errors: never)
    # the first job that fails (after its retries) ends the sweep: nothing more is submitted,
    # the running jobs are cancelled (they checkpoint: `interrupted`); resume continues
    fail_fast: bool = False
    on_drift: str = "warn"  # a resumed job's code or config changed: warn | refuse (exit 2)
    dry_run: bool = False  # print each job's row (its sbatch resources), submit none

    @classmethod
    def from_config(cls, launcher_cfg: Any) -> DDPSlurmQueueConf:
        known = settings_from(cls, launcher_cfg)
        if "additional_parameters" in known:
            known["additional_parameters"] = dict(known["additional_parameters"] or {})
        if "srun_args" in known:
            known["srun_args"] = list(known["srun_args"] or [])
        return cls(**known)


class DDPSlurmLauncherBase(LifecycleLauncher, Launcher):
    """One SLURM job per sweep job, one SLURM task per rank, submitted with submitit (the
    `slurm` extra): launch() and launch_stream() run the sweep on :class:`SlurmBackend`;
    __call__ runs in every task (ddp_launcher/ranks/slurm_task.py)."""

    launcher_name = "SLURM launcher"

    def __init__(self, **params: Any) -> None:
        with launcher_errors():  # before Hydra goes on with a launcher that cannot submit
            require_extra("slurm", "hydra/launcher=slurm")
            refuse_unknown_keys(DDPSlurmQueueConf, params, "hydra/launcher=slurm")
        # hydra.launcher as plain values (submitit pickles the launcher with its jobs)
        self.params = {
            k: OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v
            for k, v in params.items()
        }
        self.config: DictConfig | None = None
        self.task_function: Any = None
        self.hydra_context: Any = None

    def setup(self, *, hydra_context: Any, task_function: Any, config: DictConfig) -> None:
        self.config, self.task_function, self.hydra_context = config, task_function, hydra_context
        configure_sweep_logging(config)
        self.check_setup(config, hydra_context)  # before the sweeper writes (a dry run: preview)

    def __call__(self, job: Job) -> Any:
        return run_task(job)

    def options(self) -> dict[str, Any]:
        # SIGHUP is not a stop signal here: the SLURM jobs outlive a dropped SSH session.
        return {
            "backend": SlurmBackend(self),
            "resume": bool(self.params.get("resume")),
            "retries": int(self.params.get("retries") or 0),
            "fail_fast": bool(self.params.get("fail_fast")),
            "on_drift": str(self.params.get("on_drift") or "warn"),
        }

    def check(self) -> None:
        if in_slurm_task() and int(os.environ.get("SLURM_STEP_NUM_TASKS") or 1) > 1:
            raise UserError(
                "a sweep cannot start in every task of an srun step: run "
                f"`{app_command()} -m ...` once"
            )
        require_slurm()


def launcher_count(settings: DDPSlurmQueueConf, key: str, minimum: int = 1) -> int | None:
    """hydra.launcher.<key>: None for auto (or null), else its count."""
    value = getattr(settings, key)
    return parse_count("auto" if value is None else value, f"hydra.launcher.{key}", minimum)


# CPUs per task of a GPU job when hydra.launcher.cpus_per_task is null and sinfo cannot tell
# the partition's CPUs per GPU: enough for a DataLoader of 3 workers beside the rank.
GPU_TASK_CPUS = 4


def job_resources(
    config: DictConfig,
    settings: DDPSlurmQueueConf,
    cluster_gpus: int,
    cpus_per_gpu: int | None = None,
    app_path: Sequence[str] = (),
) -> dict:
    """This job's submitit parameters, from its own `dist` config: one task per rank.

    GPUs: hydra.launcher.gpus_per_node=N requests N per node, as submitit does; nproc `auto` is
    then N for a GPU job, and more ranks than N GPUs is an error (a rank takes GPU LOCAL_RANK).
    gpus_per_node auto (or null): a GPU job requests one GPU per rank, nproc `auto` being the
    GPUs of a node (`cluster_gpus`, from sinfo); 1 rank on CPU or with gloo, as with torchrun.
    GPU jobs get `cpus_per_task` CPUs per task; null: the node's CPUs per GPU (`cpus_per_gpu`,
    from sinfo), GPU_TASK_CPUS where unknown (SLURM's default, 1, leaves no DataLoader workers).
    `app_path`: the app's folders, on the tasks' import path (:func:`python_path_setup`).
    """
    requested = launcher_count(settings, "gpus_per_node", minimum=0)  # None: auto
    n_gpus = cluster_gpus if requested is None else requested
    nproc, nnodes, gpu_job = job_world(config, n_gpus)
    world = {"tasks_per_node": nproc, "nodes": nnodes}
    for key, dist_key in (("tasks_per_node", "dist.nproc_per_node"), ("nodes", "dist.nnodes")):
        fixed = launcher_count(settings, key)
        if fixed is None or fixed == world[key]:
            continue
        if str(OmegaConf.select(config, dist_key, default="auto")) != "auto":
            raise UserError(
                f"{dist_key}={OmegaConf.select(config, dist_key)} but hydra.launcher.{key}="
                f"{fixed}: drop one of them (hydra.launcher.{key}=auto takes each job's {dist_key})"
            )
        world[key] = fixed
    nproc, nnodes = world["tasks_per_node"], world["nodes"]
    if settings.gpus_per_task:
        raise UserError(
            "hydra.launcher.gpus_per_task binds each task to its own GPU, but ranks pick GPU "
            "LOCAL_RANK among the node's: use hydra.launcher.gpus_per_node"
        )
    if requested is None:
        check_gpus(nproc, gpu_job, n_gpus, f"a node has {n_gpus} (sinfo)")
    else:
        check_gpus(
            nproc,
            gpu_job,
            n_gpus,
            f"hydra.launcher.gpus_per_node={requested} requests {requested} (one per rank: "
            "or raise it)",
        )
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
        "slurm_setup": [
            *python_path_setup(app_path),
            SRUN_CPUS_SETUP,
            f"export {MAX_NUM_TIMEOUT_ENV}={int(settings.max_num_timeout)}",
            *(settings.setup or []),
        ],
    }
    if requested is not None:  # submitit's meaning: the request, whatever the ranks use
        if requested > 0:
            params["gpus_per_node"] = requested
    elif gpu_job:
        params["gpus_per_node"] = nproc
    if gpu_job and settings.cpus_per_task is None and settings.cpus_per_gpu is None:
        params["cpus_per_task"] = cpus_per_gpu or GPU_TASK_CPUS
    for key in ("cpus_per_task", "mem_gb"):
        if getattr(settings, key) is not None:
            params[key] = getattr(settings, key)
    for key in SLURM_KEYS.split():
        if getattr(settings, key) is not None:
            params[f"slurm_{key}"] = getattr(settings, key)
    return params


# The batch script's line before srun: each task gets the CPUs sbatch allocated per task. Since
# SLURM 22.05 srun does not inherit sbatch's --cpus-per-task: "must be requested again with the
# call to srun or set with the SRUN_CPUS_PER_TASK environment variable" (`man srun`); a cluster
# that binds tasks to cores would bind each to 1 CPU. The variable rather than an srun
# argument: it follows whatever set sbatch's count (cpus_per_task, the GPU default,
# additional_parameters, the user's setup) and yields to a --cpus-per-task in srun_args.
SRUN_CPUS_SETUP = (
    'if [ -n "${SLURM_CPUS_PER_TASK:-}" ]; then '
    'export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"; fi'
)


def python_path_setup(app_path: Sequence[str]) -> list[str]:
    """Tasks unpickle the job by reference to the app's modules: put the app's folders on their
    import path (this package is installed, or on the PYTHONPATH the tasks inherit)."""
    import shlex

    if not app_path:
        return []
    joined = shlex.quote(os.pathsep.join(app_path))
    return [f"export PYTHONPATH={joined}${{PYTHONPATH:+:$PYTHONPATH}}"]


def app_dirs(task_function: Any) -> list[str]:
    """The folders the app's task is imported from: its module's (the entry point's
    "module:function", or the function's own module, the script's for `__main__`), and the
    script's (sys.path[0]); never an installed package's (site-packages)."""
    from ddp_launcher.core.app_command import installed
    from ddp_launcher.core.repro import module_dir
    from ddp_launcher.warm import task_modules

    found = [module_dir(m) for m in [*task_modules(task_function), "__main__"]]
    found.append(Path(sys.path[0]).resolve() if sys.path and sys.path[0] else None)
    return list(
        dict.fromkeys(str(d) for d in found if d is not None and d.is_dir() and not installed(d))
    )


@dataclass
class Submitted:
    """One SLURM job of a sweep job (the backend's handle of an attempt)."""

    job: Job
    params: dict = field(default_factory=dict)  # submitit's executor parameters
    folder: str = ""
    max_num_timeout: int = 0
    slurm: Any = None  # submitit's SlurmJob (None: not submitted)
    state: str = ""
    ended_since: float | None = None  # first seen in a final (or no) state without a result
    ran: bool = False  # seen running since it was (re)queued
    restarts: int = 0

    @property
    def label(self) -> str:
        slurm = f" (SLURM job {self.slurm.job_id})" if self.slurm is not None else ""
        return f"#{self.job.num}{slurm}"


class SlurmBackend:
    """ddp_launcher/lifecycle.py's Backend on a SLURM cluster: an attempt is a SLURM job (a requeue
    is the same attempt); its handle is a :class:`Submitted`. SLURM queues what it cannot run
    yet, so every job has room at once and the jobs started together go out as arrays."""

    holds_job_dirs = False  # a SLURM job outlives its launcher: its rank 0 holds its dir

    def __init__(self, launcher: Any) -> None:
        self.launcher = launcher
        self.poll_s = float(launcher.params.get("poll_interval_s") or 5.0)
        self.partition = functools.cache(partition_resources)  # sinfo, once per partition
        self.plans: dict[int, Submitted] = {}  # job num -> its submission's parameters

    def place(self, job: Job) -> None:
        """The job's submission, from its own config (its launcher values may interpolate it);
        UserError when SLURM cannot give it its world size."""
        settings = DDPSlurmQueueConf.from_config(job.spec.config.hydra.launcher)
        requested = launcher_count(settings, "gpus_per_node", minimum=0)
        cpus = None  # per GPU: job_resources reads it only where cpus_per_task is null
        gpus = requested or 0  # a node's GPUs matter only where none are requested
        if requested is None or settings.cpus_per_task is None:
            found, cpus = self.partition(settings.partition)
            gpus = found if requested is None else gpus
        task = self.launcher.task_function
        app_path = app_dirs(task)
        params = job_resources(job.spec.config, settings, gpus, cpus, app_path=app_path)
        # the app's repository for the tasks' records (repro.py: git runs there)
        code = shlex.quote(str(task_code_dir(task, job.spec.config)))
        params["slurm_setup"].insert(0, f"export {CODE_DIR_ENV}={code}")
        # how the app is started, for the lines its tasks say (the gate's, a bad fork's)
        command = shlex.quote(app_command(job.spec.config))
        params["slurm_setup"].insert(1, f"export {APP_COMMAND_ENV}={command}")
        job.nproc, job.nnodes = params["tasks_per_node"], params["nodes"]
        job.uses_gpus = "gpus_per_node" in params
        self.plans[job.num] = Submitted(
            job, params, settings.submitit_folder, settings.max_num_timeout
        )

    def preview_resources(self, job: Job, _slot: bool) -> str:
        """A dry run's word for the job's submission: the resource options of the sbatch script
        submitit would write for it (ddp_launcher/preview.py)."""
        return " ".join(sbatch_resources(self.plans[job.num]))

    @staticmethod
    def preview_attempt(s: Submitted) -> str:
        return f"SLURM job {s.slurm.job_id}"

    @staticmethod
    def reserve(_job: Job) -> bool:
        return True  # SLURM queues it

    @staticmethod
    def release(_job: Job, _slot: bool) -> None:
        pass

    def start(self, batch: list[tuple[Job, bool]]) -> list[Submitted]:
        """One submitit array per run of jobs asking for the same resources, in job order."""
        import submitit

        def key(s: Submitted) -> str:
            return json.dumps([s.folder, s.max_num_timeout, s.params], sort_keys=True, default=str)

        todo = [replace(self.plans[job.num]) for job, _ in batch]  # a fresh one per attempt
        submitted: list[Submitted] = []
        for _, group in itertools.groupby(sorted(todo, key=key), key=key):
            group = sorted(group, key=lambda s: s.job.num)
            first = group[0]
            executor = submitit.AutoExecutor(
                folder=first.folder, cluster="slurm", slurm_max_num_timeout=first.max_num_timeout
            )
            executor.update_parameters(**first.params)
            try:
                with submission_env(), sbatch_errors():
                    slurm_jobs = executor.map_array(self.launcher, [s.job for s in group])
            except BaseException:  # SLURM did not take them: take down what it took before
                self.stop([(s.job, s) for s in submitted], "not submitted", grace_s=0)
                raise
            for s, slurm_job in zip(group, slurm_jobs, strict=True):
                s.slurm = slurm_job
                submitted.append(s)
                log.debug(
                    "#%d %s: SLURM job %s, %d node(s) x %d task(s)%s",
                    s.job.num,
                    " ".join(s.job.overrides) or "(no overrides)",
                    slurm_job.job_id,
                    s.job.nnodes,
                    s.job.nproc,
                    f", {s.job.nproc} GPU(s) per node" if s.job.uses_gpus else "",
                )
            if len(group) == 1:  # one line per submission: its SLURM id, for squeue and scancel
                log.info("#%d: SLURM job %s", group[0].job.num, slurm_jobs[0].job_id)
            else:
                nums = [s.job.num for s in group]
                contiguous = nums == list(range(nums[0], nums[-1] + 1))
                which = f"#{nums[0]}-#{nums[-1]}" if contiguous else ",".join(f"#{n}" for n in nums)
                log.info("%s: SLURM job array %s", which, str(slurm_jobs[0].job_id).split("_")[0])
        return todo

    @staticmethod
    def record(s: Submitted) -> dict:
        return {"slurm_job_id": s.slurm.job_id, "slurm_folder": str(s.folder)}

    def ended(self, running: list[Submitted]) -> list[Submitted]:
        """Those with rank 0's result, or ended (or forgotten by SLURM) without one."""
        states = slurm_states([s.slurm.job_id for s in running])
        now, grace, done = time.time(), max(15.0, 2 * self.poll_s), []
        for s in running:
            state = states.get(s.slurm.job_id, "UNKNOWN")
            if state != s.state:
                note_state(s, state)
            has_result = result_path(s).exists()
            if not has_result and state in ACTIVE_STATES:
                s.ended_since = None
            elif not has_result and s.ended_since is None:
                s.ended_since = now
            elif has_result or now - s.ended_since > grace:
                done.append(s)
        return done

    @staticmethod
    def outcome(job: Job, s: Submitted) -> Any:
        """The JobReturn of one job: rank 0's own, or a failed one saying what went wrong."""
        outcome = load_outcome(result_path(s))
        ret = rank0_return(outcome)
        if ret is not None and (
            ret.status == JobStatus.COMPLETED or isinstance(job_value(ret), NotStarted)
        ):
            return ret  # a NotStarted one ran nothing: nothing to record (lifecycle.py)
        rank0: BaseException | str | None = None
        if ret is not None:  # rank 0's failed JobReturn
            rank0 = job_value(ret)
        elif outcome is not None and outcome[0] == "error":  # the task raised outside the job
            lines = [line for line in str(outcome[1]).strip().splitlines() if line.strip()]
            rank0 = lines[-1] if lines else str(outcome[1])
        reason = failure_reason(rank0, other_task_failures(s), ended_without_result(s))
        # rank 0's own exception is the job's failure (Hydra's JobReturn gets it), unless rank 0
        # was stopped from outside
        own = rank0 if isinstance(rank0, BaseException) and not isinstance(rank0, Stopped) else None
        return failed_job_return(s.job, reason, ret, task_error=own)

    @staticmethod
    def earlier_return(_job: Job, attempt: Any) -> JobReturn | None:
        """Rank 0's JobReturn of an attempt, from its SLURM job's submitit result pickle."""
        from submitit.core.utils import JobPaths

        found = (attempt.backend or {}) if attempt is not None else {}
        if not found.get("slurm_job_id") or not found.get("slurm_folder"):
            return None
        path = JobPaths(
            found["slurm_folder"], job_id=found["slurm_job_id"], task_id=0
        ).result_pickle
        return rank0_return(load_outcome(path))

    def reattach(self, job: Job, attempt: Any) -> Submitted | None:
        """The SLURM job of an earlier launch's attempt, if SLURM still has it queued or
        running: it is waited for instead of submitted again."""
        import submitit

        found = attempt.backend or {}
        job_id = found.get("slurm_job_id")
        if not job_id or slurm_states([job_id]).get(job_id) not in ACTIVE_STATES:
            return None
        s = Submitted(job, slurm=submitit.SlurmJob(folder=found["slurm_folder"], job_id=job_id))
        log.info("%s: re-attached to the SLURM job of attempt %d", s.label, attempt.attempt)
        return s

    @staticmethod
    def stop(running: list[tuple[Job, Submitted]], why: str, grace_s: float = STOP_GRACE_S) -> None:
        """Cancel the SLURM jobs (SLURM sends their tasks SIGTERM: the ranks agree on a step,
        checkpoint, exit 75; a cancelled job is not requeued), and wait until SLURM says they
        ended (at most `grace_s`; a second Ctrl-C stops waiting)."""
        live = [s for _, s in running if s.slurm is not None]
        ids = [s.slurm.job_id for s in live]
        if ids and shutil.which("scancel"):
            log.warning("%s: cancelling SLURM job(s) %s", why, " ".join(ids))
            subprocess.run(["scancel", *ids], check=False, timeout=60)
        deadline = time.time() + grace_s
        try:
            while ids and time.time() < deadline:
                states = slurm_states(ids)
                if not any(states.get(j) in ACTIVE_STATES for j in ids):
                    break
                time.sleep(1.0)
        except KeyboardInterrupt:
            log.warning("not waiting for the cancelled jobs to end")


# sbatch options of the batch script that are not resources: files, names, signals.
NOT_RESOURCES = ("output", "error", "job-name", "open-mode", "wckey", "signal", "requeue")


def sbatch_resources(s: Submitted) -> list[str]:
    """The resource options (`--nodes=1`, `--ntasks-per-node=2`, `--time=60` ...) of the batch
    script submitit writes for `s`: its own text (SlurmExecutor's, as it submits), read back,
    so a dry run says what sbatch would get. Nothing is written or submitted."""
    import submitit

    executor = submitit.AutoExecutor(
        folder=s.folder, cluster="slurm", slurm_max_num_timeout=s.max_num_timeout
    )
    executor.update_parameters(**s.params)
    # submitit has no public way to the script's text without submitting it
    text = executor._executor._make_submission_file_text("", "preview")  # noqa: SLF001
    options = [line.split(None, 1)[1] for line in text.splitlines() if line.startswith("#SBATCH ")]
    return [o for o in options if o.lstrip("-").split("=")[0] not in NOT_RESOURCES]


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


def rank0_return(outcome: tuple[str, Any] | None) -> JobReturn | None:
    """Rank 0's JobReturn in a submitit outcome, if it sent one."""
    ret = outcome[1] if outcome and outcome[0] == "success" else None
    return ret if isinstance(ret, JobReturn) else None


def ended_without_result(s: Submitted) -> str:
    logs = f"see {s.slurm.task(0).paths.stderr}"
    state = s.state or "UNKNOWN"
    result = read_result(s.job.job_dir, since=s.job.started)
    if result is not None and result.status == "preempted":
        return (
            f"stopped and checkpointed but not requeued (SLURM job {s.slurm.job_id} {state}; "
            f"requeue=false, or max_num_timeout reached?): a resumed sweep continues it in "
            f"{s.job.job_dir}; {logs}"
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
        ranks = [r for part in tasks.split(",") for r in number_range(part) if r != 0]
        if ranks and "exit code 75" not in what:  # 75: preempted, not a failure
            found.append(f"rank {','.join(map(str, ranks))} on {host}: {what.strip().lower()}")
    return found
