"""Run Hydra jobs as torchrun jobs: `hydra/launcher=torchrun`, and `python app.py
dist.nproc_per_node=N` (:func:`run_in_torchrun`).

A job is one torchrun agent (ddp_launcher/ranks/agent.py: torch's `elastic_launch` starts,
supervises and restarts the ranks), forked by this process's warm start (ddp_launcher/warm.py); its
ranks run ddp_launcher/ranks/bootstrap.py's rank_main on the pickled JobSpec, and rank 0 hands back
its JobReturn in result.pkl. :class:`TorchrunBackend` gives each job its GPUs, CPU slice and (single
node) its own rendezvous port, so jobs that run at once never collide. Nothing outlives the launcher
(ddp_launcher/ranks/lifeline.py); its SIGINT, SIGTERM or SIGHUP stop the running jobs as preemption
does. Hydra instantiates hydra_plugins/hydra_ddp_launcher/torchrun_launcher.py's class, which
imports this module and makes a :class:`TorchrunLauncherBase` (Hydra only instantiates launchers
defined under hydra_plugins); its config, TorchrunLauncherConf, is served from there too
(hydra_plugins/hydra_ddp_launcher/searchpath.py), so nothing here runs for an app that does not
select it.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import math
import os
import re
import signal
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from hydra.plugins.launcher import Launcher
from omegaconf import DictConfig, OmegaConf

from ddp_launcher.core import run_lock
from ddp_launcher.core.app_command import APP_COMMAND_ENV, app_command
from ddp_launcher.core.errors import (
    RunStopped,
    UserError,
    describe,
    find_user_error,
    job_value,
    one_line,
)
from ddp_launcher.core.fault_points import LAUNCHER_PID_ENV
from ddp_launcher.core.host import check_host
from ddp_launcher.core.hydra_compat import active_whitelist
from ddp_launcher.core.repro import CODE_DIR_ENV, task_code_dir
from ddp_launcher.core.run_dir import ATTEMPT_ENV, LAUNCHER_DIR, REQUEUE_EXIT_CODE, read_result
from ddp_launcher.core.wandb_service import wandb_wanted
from ddp_launcher.core.world import (
    check_gpus,
    endpoint_parts,
    job_device,
    job_world,
    keeps_records,
    parse_count,
    started_as_rank,
    usable_cores,
    visible_gpu_ids,
    visible_gpus,
)
from ddp_launcher.jobs import (
    Interrupted,
    Job,
    configure_sweep_logging,
    failed_job_return,
    failure_reason,
    launcher_errors,
    refuse_unknown_keys,
    resolve_output_dirs,
    settings_from,
    stop_signals,
    verdict_of,
)
from ddp_launcher.lifecycle import LifecycleLauncher, run_jobs
from ddp_launcher.ranks.bootstrap import run_task
from ddp_launcher.ranks.handoff import (
    FAILURES_JSON,
    JOB_JSON,
    JOB_PKL,
    RESULT_PKL,
    describe_failure,
    dump_job,
    read_failures,
    read_job_return,
)
from ddp_launcher.ranks.job_spec import AgentSpec, JobSpec, Stopped, by_reference, job_return
from ddp_launcher.warm import WarmStart, import_path, task_modules

log = logging.getLogger(__name__)

POLL_S = 0.2
AGENT_LOG = "agent.log"  # in <job dir>/.torchrun/: the torchrun agent's own output in a sweep
# How long stopped jobs get to checkpoint and exit (torchrun gives its ranks 30 s) before SIGKILL.
STOP_GRACE_S = 60.0


@dataclass
class TorchrunLauncherConf:
    """`hydra.launcher` of `hydra/launcher=torchrun`. The world size keys are torchrun's own
    names, the weaker side: a job's own `dist.nproc_per_node` / `dist.nnodes` set for it wins
    (a sweep over dist.nproc_per_node=1,2), its `auto` or absent key takes these."""

    _target_: str = "hydra_plugins.hydra_ddp_launcher.torchrun_launcher.TorchrunLauncher"
    # Ranks per node of every job (torchrun --nproc-per-node): a positive integer, or auto:
    # one rank per GPU the job may use (`gpus`), 1 on the CPU or with dist.backend=gloo.
    nproc_per_node: Any = "auto"
    # Nodes of every job (torchrun --nnodes): N, or N:N (no elastic range), or auto (1). More
    # than 1 needs rdzv_endpoint and the same sweep started on each node.
    nnodes: Any = "auto"
    # Jobs running at once. null: on a GPU node as many as fit on disjoint GPU sets; 1 on CPU.
    max_parallel: int | None = None
    # Passed to the elastic agent: restarts of a job's ranks after a rank fails.
    max_restarts: int = 0
    monitor_interval: float = 0.1
    # Single-node jobs get a free port each (torchrun --standalone). Multi-node jobs
    # (dist.nnodes > 1) need an endpoint every node reaches, and the same job on each node.
    # HOST:PORT is job 0's; job n of the sweep meets at HOST:PORT+n (its own store: jobs run at
    # once, and each node's launcher computes the same), so ports PORT to PORT + jobs - 1 must
    # be free on HOST. No port: torch's c10d default, 29400.
    rdzv_backend: str = "c10d"
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    node_rank: int | None = None
    # torchrun --rdzv-conf: the rendezvous backend's options, {join_timeout: 900} or torchrun's
    # KEY=VALUE,... string (quoted on a command line: "join_timeout=900,read_timeout=120")
    rdzv_conf: Any = None
    # GPUs jobs may use, as positions in this process's visible GPUs (CUDA_VISIBLE_DEVICES'
    # entries when set: gpus=[1,3] with CUDA_VISIBLE_DEVICES=4,5,6,7 means GPUs 5 and 7);
    # null: every visible GPU. Each job gets a disjoint set of them.
    gpus: list[int] | None = None
    # Per-rank stdout/stderr files, relative to the job dir (torchrun --log-dir, --redirects=3).
    log_dir: str = "rank_logs"
    # Ranks whose output also goes to the console (torchrun --tee: 0 none, 3 stdout+stderr,
    # 0:3 local rank 0's). null: none in a sweep (one line per finished job, then the summary),
    # local rank 0's for `python app.py dist.nproc_per_node=N`.
    tee: str | None = None
    # Rerun with the same command and hydra.sweep.dir: completed jobs are not run again, the
    # others run again in their dirs (ddp_launcher/resume.py).
    resume: bool = False
    # The app's config key a job run again (resume=true, retries) gets `auto` in, so that it
    # continues from its checkpoints, e.g. `resume`. null: the app's config is left as it is.
    resume_key: str | None = None
    # Start a failed job again (from its checkpoints) up to this many times; user errors are
    # not retried.
    retries: int = 0
    # The first job that fails (after its retries) ends the sweep: no job starts after it, the
    # running ones stop at a checkpoint (`interrupted`); resume=true continues the sweep.
    fail_fast: bool = False
    # A resumed job whose commit, uncommitted diff or config differs from its first attempt's:
    # warn (one line per job, it runs) or refuse (one line, exit 2, nothing runs).
    on_drift: str = "warn"
    # Compose and check every job, print one row each (ddp_launcher/preview.py), and start none.
    dry_run: bool = False
    # A job with more ranks than the cores it gets is said in one warning line (its ranks
    # share cores: each runs slower than it would alone); true: intended, no warning.
    oversubscribe: bool = False

    @classmethod
    def from_config(cls, launcher_cfg: Any) -> TorchrunLauncherConf:
        return cls(**settings_from(cls, launcher_cfg))


class TorchrunLauncherBase(LifecycleLauncher, Launcher):
    """Hydra's Launcher for `hydra/launcher=torchrun` (launch and launch_stream: lifecycle)."""

    launcher_name = "torchrun launcher"

    def __init__(self, **settings: Any) -> None:
        with launcher_errors():
            refuse_unknown_keys(TorchrunLauncherConf, settings, "hydra/launcher=torchrun")
        self.settings = TorchrunLauncherConf.from_config(settings)
        self.config: DictConfig | None = None
        self.task_function: Any = None
        self.hydra_context: Any = None
        self.warm = WarmStart()  # one for the whole sweep: torch is imported once

    def setup(self, *, hydra_context: Any, task_function: Any, config: DictConfig) -> None:
        self.config = config
        self.task_function = task_function
        self.hydra_context = hydra_context
        configure_sweep_logging(config)
        with launcher_errors():  # before the warm start forks on a machine it cannot run on
            check_host()
        self.check_setup(config, hydra_context)  # before the sweeper writes (a dry run: preview)
        if os.environ.get("RANK") is None and not self.settings.dry_run:  # (a rank: check())
            self.start_warm()

    def start_warm(self) -> None:
        """The warm start's server imports torch (on another core) while this process has the
        sweeper validate the batch (Hydra composes every job) and composes the jobs itself;
        later batches (Optuna's) find it running."""
        self.warm.ensure_running(task_modules(self.task_function), wandb=wandb_wanted(self.config))

    def options(self) -> dict[str, Any]:
        s = self.settings
        if not s.dry_run:  # a dry run imports no torch
            self.start_warm()
        return {
            "backend": TorchrunBackend(s, warm=self.warm),
            "resume": s.resume,
            "retries": s.retries,
            "fail_fast": s.fail_fast,
            "on_drift": s.on_drift,
            "stop_on": (signal.SIGINT, signal.SIGTERM, signal.SIGHUP),
            "lock": s.rdzv_endpoint is None,
        }

    def check(self) -> None:
        if os.environ.get("RANK") is not None:
            raise UserError(
                f"a sweep cannot start inside a torchrun rank: run `{app_command()} -m ...`"
            )


def run_task_or_hand_off(task: str, cfg: DictConfig) -> Any:
    """The task function of an app run through the entry point ("module:function",
    ddp_launcher/ranks/bootstrap.py's run_task runs it). `python app.py dist.nproc_per_node=N`
    (not itself a rank): this process only hands the job to N ranks, which run the same task,
    so it imports neither torch nor the task's module (seconds). Everywhere else the task runs
    here. A dist.device=cpu job sees no GPU, here and in its ranks (hide_gpus_from_cpu_job)."""
    if not started_as_rank():
        hide_gpus_from_cpu_job(cfg)
        if single_run_world(cfg) != (1, 1):
            return run_in_torchrun(cfg, functools.partial(run_task, task))
    return run_task(task, cfg)


def hide_gpus_from_cpu_job(cfg: DictConfig, environ=os.environ) -> None:
    """dist.device=cpu: its ranks run on the CPU, so `auto` asks for 1 of them and they
    reserve no GPU; with CUDA_VISIBLE_DEVICES empty (before torch is imported here) nothing of
    the job (the ranks' CUDA probes, a pinned-memory thread, a stray .cuda()) can take memory
    on a GPU another job was given."""
    if job_device(cfg) == "cpu":
        environ["CUDA_VISIBLE_DEVICES"] = ""


def single_run_world(cfg: DictConfig) -> tuple[int, int]:
    """(ranks per node, nodes) of `python app.py ...` without -m: its dist's, and where its
    configured launcher is this one (an app's default may be), under the launcher's keys as a
    sweep job is (`python app.py hydra.launcher.nproc_per_node=2` runs 2 ranks too)."""
    from hydra.core.hydra_config import HydraConfig

    launcher = HydraConfig.get().launcher
    if OmegaConf.select(launcher, "_target_") != TorchrunLauncherConf._target_:
        return job_world(cfg, visible_gpus())[:2]  # (its dist's keys, missing ones 1)
    world = launcher_world(TorchrunLauncherConf.from_config(launcher))
    return job_world(cfg, visible_gpus(), world)[:2]


def run_in_torchrun(cfg: DictConfig, task_function: Any) -> Any:
    """`python app.py dist.nproc_per_node=N`: run this very job's N ranks under torchrun.

    Hydra has already made the run dir and written `.hydra/` here; the ranks reuse both.
    Returns rank 0's return value; raises ddp_launcher.jobs.JobFailed when the job failed.
    """
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.singleton import Singleton

    hydra_cfg = HydraConfig.get()
    # The job's whole config, hydra node too: HydraConfig keeps it only as the hydra node's
    # parent (no public getter).
    config = copy.deepcopy(hydra_cfg._get_parent())
    resolve_output_dirs(config, ("hydra.run.dir", "hydra.runtime.output_dir"))
    spec = JobSpec(
        task_function,
        config,
        Singleton.get_state(),
        job_dir_key="hydra.run.dir",
        job_subdir_key=None,
        execution_whitelist=active_whitelist(),  # the app's, which this job runs under here
    )
    job = Job(
        0, list(hydra_cfg.overrides.task), Path(hydra_cfg.runtime.output_dir), spec, in_sweep=False
    )
    settings = single_run_settings(hydra_cfg.launcher)
    try:
        # SIGTERM (a scheduler's preemption) and SIGHUP (a dropped session) stop the ranks as
        # preemption does, as a 1-rank run's own handler and a sweep's launcher do; without
        # this the launcher died of them, its ranks with it, unrecorded (Ctrl-C: run_jobs).
        with stop_signals((signal.SIGTERM, signal.SIGHUP)):
            (ret,) = run_jobs([job], TorchrunBackend(settings), retries=settings.retries).values()
    except Interrupted as e:
        if e.signum == signal.SIGINT:
            raise
        raise run_stopped(job.job_dir, e) from None
    if ret.status.name == "FAILED":  # (JobReturn.return_value would log it first: no)
        raise verdict_of(ret)  # one line: rank 0 printed its own error where the user watches
    return ret.return_value


def run_stopped(run_dir: Path, stop: Interrupted) -> RunStopped:
    """The closing line and exit status of a single run of N ranks stopped by `stop`."""
    from ddp_launcher.ranks.interrupt import RESUMABLE

    result = read_result(run_dir)
    status = result.status if result is not None else "interrupted"
    fix = (
        f"rerun with resume=auto and hydra.run.dir={run_dir} to continue from the last checkpoint"
        if RESUMABLE[0]
        else "rerun the same command to run it again"
    )
    stopped = RunStopped(f"{status} ({stop.signal_name}): {fix}")
    stopped.exit_code = REQUEUE_EXIT_CODE if status == "preempted" else 128 + stop.signum
    return stopped


def single_run_settings(launcher_cfg: Any) -> TorchrunLauncherConf:
    """The launcher settings of `python app.py dist.nproc_per_node=N`: one run, the only job
    this process starts, so it gets every core it may use whatever share of the GPUs it takes
    (max_parallel 1); rank 0's output is what the user watches, as in a 1-rank run (the other
    ranks' only output is errors, in their files under rank_logs/; the launcher names a rank
    that failed first)."""
    settings = TorchrunLauncherConf.from_config(launcher_cfg)
    settings.max_parallel = 1
    if settings.tee is None:
        settings.tee = "0:3"
    return settings


class TorchrunBackend:
    """ddp_launcher/lifecycle.py's Backend on this machine: a job's attempt is a torchrun agent; a
    GPU
    job takes one GPU per rank, a set disjoint from every running job's (CUDA_VISIBLE_DEVICES);
    at most `max_parallel` jobs at once (null: one per GPU, 1 on CPU), each on its share of the
    launcher's CPU cores (:meth:`cpu_slice`)."""

    poll_s = POLL_S
    holds_job_dirs = True  # its agents die with it: it holds each running job's dir for it

    def __init__(
        self,
        settings: TorchrunLauncherConf,
        gpu_ids: list[str] | None = None,
        cores: list[int] | None = None,
        warm: WarmStart | None = None,
    ) -> None:
        self.settings = settings
        self.tee = settings.tee if settings.tee is not None else "0"
        self.warm = warm if warm is not None else WarmStart()
        # CUDA_VISIBLE_DEVICES entries as written (a job's are a subset of them); the launcher's
        # `gpus` are positions in this list.
        self.gpu_ids = visible_gpu_ids() if gpu_ids is None else list(gpu_ids)
        positions = range(len(self.gpu_ids))
        gpus = list(settings.gpus) if settings.gpus is not None else list(positions)
        given = f"hydra.launcher.gpus={gpus}"
        if gpus and not self.gpu_ids:
            raise UserError(
                f"{given}: no GPU is visible here (CUDA_VISIBLE_DEVICES="
                f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}): jobs run on the CPU; "
                "drop it, or pass hydra.launcher.gpus=null"
            )
        if any(g not in positions for g in gpus):
            within = sorted({g for g in gpus if g in positions}) or list(positions)
            raise UserError(
                f"{given}: positions in the {len(self.gpu_ids)} visible GPUs "
                f"({','.join(self.gpu_ids)}): use numbers from 0 to {len(self.gpu_ids) - 1}, "
                f"e.g. hydra.launcher.gpus={gpu_list(within)}, or hydra.launcher.gpus=null for all"
            )
        if len(set(gpus)) < len(gpus):  # one GPU would go to two jobs (or ranks) at once
            raise UserError(
                f"{given} names a GPU twice: list each GPU once, e.g. "
                f"hydra.launcher.gpus={gpu_list(sorted(set(gpus)))}, or hydra.launcher.gpus=null "
                "for all"
            )
        if settings.max_parallel is not None and settings.max_parallel < 1:
            raise UserError(
                f"hydra.launcher.max_parallel={settings.max_parallel}: use a number of jobs >= 1, "
                "or null for one per GPU set (1 on CPU)"
            )
        check_agent_settings(settings)
        self.gpus, self.free = list(gpus), list(gpus)
        self.limit = settings.max_parallel or max(len(gpus), 1)
        self.cores = usable_cores() if cores is None else list(cores)
        self.holders = dict.fromkeys(self.cores, 0)  # running jobs on each core
        self.running = 0
        self.warned: set[tuple[int, int]] = set()  # (ranks, cores) said to oversubscribe

    def place(self, job: Job) -> None:
        gpus, s = self.gpus, self.settings
        world = launcher_world(s)
        job.nproc, job.nnodes, job.uses_gpus = job_world(job.spec.config, len(gpus), world)
        # the same job runs on every node: one node's launcher keeps its records
        job.records = job.nnodes == 1 or keeps_records(s.node_rank, s.rdzv_endpoint)
        nproc_key, nnodes_key = (world_key(job.spec.config, k, world) for k in WORLD_KEYS)
        check_gpus(
            job.nproc, job.uses_gpus, len(gpus), f"the launcher has {len(gpus)} ({gpus})", nproc_key
        )
        if job.nnodes > 1 and not s.rdzv_endpoint:
            raise UserError(
                f"{nnodes_key}={job.nnodes} needs a rendezvous point every node can reach: set "
                "hydra.launcher.rdzv_endpoint=HOST:PORT and start the same job on each node"
            )
        if s.rdzv_endpoint:
            job_endpoint(s.rdzv_endpoint, job.num)  # a UserError when it cannot be had
        rdzv_conf(s.rdzv_conf)  # (a UserError now, not in the agent)

    def reserve(self, job: Job) -> tuple[list[int], list[int] | None] | None:
        """The job's GPUs (positions) and CPU slice, or None while there is no room."""
        need = job.nproc if job.uses_gpus else 0
        if self.running >= self.limit or need > len(self.free):
            return None
        mine, self.free = self.free[:need], self.free[need:]
        self.running += 1
        cpus = self.cpu_slice(need)
        for core in cpus or self.cores:
            self.holders[core] += 1
        return mine, cpus

    def cpu_slice(self, gpus: int) -> list[int] | None:
        """The cores of a job taking `gpus` GPUs: its share of the node, the larger of its GPUs'
        share and one running job's (1/limit), so that a job with every GPU, or the only job
        that may run, gets every core, two 4-GPU jobs of 8 GPUs half each, and `max_parallel`
        CPU jobs 1/max_parallel each. They come from the cores no running job holds (threads
        and DataLoader workers of the running jobs stay within the cores, disjoint); where
        none is free (more jobs at once than cores), from those held by the fewest jobs.
        None: every core (the launcher's own affinity: nothing to narrow)."""
        total = len(self.cores)
        count = max(1, total // self.limit, total * gpus // len(self.gpus) if gpus else 0)
        fewest = min(self.holders.values())
        cpus = [core for core in self.cores if self.holders[core] == fewest][:count]
        return None if len(cpus) == total else cpus

    def preview_resources(self, job: Job, slot: tuple[list[int], list[int] | None]) -> str:
        """A dry run's word for the slot `reserve` gave the job (ddp_launcher/preview.py)."""
        from ddp_launcher.preview import cores_text

        gpus, cpus = slot
        where = f"GPUs {','.join(self.gpu_ids[g] for g in gpus)}" if gpus else "CPU"
        cores = cpus or self.cores  # (None: every core of the launcher's)
        more = f" ({job.nproc} ranks > {len(cores)} cores)" * (job.nproc > len(cores))
        return f"{where}, cores {cores_text(cores)}{more}"

    def warn_oversubscribed(self, job: Job, cpus: list[int] | None) -> None:
        """One warning line when the job's ranks outnumber its cores (once per kind of job),
        unless hydra.launcher.oversubscribe=true says it is intended."""
        from ddp_launcher.preview import cores_text

        cores = cpus or self.cores
        if self.settings.oversubscribe or job.nproc <= len(cores):
            return
        if (job.nproc, len(cores)) in self.warned:
            return
        self.warned.add((job.nproc, len(cores)))
        log.warning(
            "%s%d ranks on %d core(s) (%s): the ranks share cores, each slower than alone; "
            "dist.nproc_per_node=%d or fewer fits here (hydra.launcher.oversubscribe=true "
            "silences this)",
            f"#{job.num}: " if job.in_sweep else "",
            job.nproc,
            len(cores),
            cores_text(cores),
            len(cores),
        )

    @staticmethod
    def preview_attempt(_handle: Any) -> str:
        return "its attempt"  # (reattach never finds one: agents die with their launcher)

    def release(self, job: Job, slot: tuple[list[int], list[int] | None]) -> None:
        gpus, cpus = slot
        self.free = sorted(self.free + gpus)
        for core in cpus or self.cores:
            self.holders[core] -= 1
        self.running -= 1

    def node(self, job: Job) -> str:
        """A multi-node job runs in the same (shared) job dir on every node: each node's
        launcher keeps its files (payload, failures, rank logs) apart, under node<node_rank>
        or its host name. Global rank 0 writes result.pkl and job.json into its node's."""
        if job.nnodes == 1:
            return ""
        if self.settings.node_rank is not None:
            return f"node{self.settings.node_rank}"
        import socket

        return socket.gethostname()

    def files(self, job: Job) -> Path:
        return job.job_dir / LAUNCHER_DIR / self.node(job)

    def job_env(self, job: Job, gpus: list[int], cpus: list[int] | None) -> dict[str, str]:
        """The environment of a job's agent and ranks: this process's, plus its GPUs (the
        launcher's CUDA_VISIBLE_DEVICES entries at those positions, as written) and threads."""
        env = dict(os.environ)
        env["PYTHONPATH"] = import_path()
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self.gpu_ids[g] for g in gpus)
        elif job.spec is not None:
            hide_gpus_from_cpu_job(job.spec.config, env)
        # The job's cores shared among its ranks, unless the user chose: one OpenMP pool each.
        cores = len(cpus) if cpus else len(self.cores)
        if not env.get("OMP_NUM_THREADS"):
            env["OMP_NUM_THREADS"] = str(max(1, cores // max(1, job.nproc)))
        env[ATTEMPT_ENV] = str(job.attempt)
        env[LAUNCHER_PID_ENV] = str(os.getpid())
        # the app's repository for the ranks' records (repro.py: git runs there)
        if job.spec is not None:
            code_dir = task_code_dir(job.spec.task_function, job.spec.config)
            env.setdefault(CODE_DIR_ENV, str(code_dir))
            # how the app is started, for the lines its ranks say (a bad fork's, the gate's)
            env.setdefault(APP_COMMAND_ENV, app_command(job.spec.config))
        if job.in_sweep:  # this launcher holds the job dir for its ranks (ddp_launcher/resume.py)
            env.update(run_lock.child_env(job.job_dir))
        return env

    def agent_spec(self, job: Job, env: dict[str, str], cpus: list[int] | None) -> AgentSpec:
        s, files = self.settings, self.files(job)
        spec = AgentSpec(
            payload=str(files / JOB_PKL),
            failures=str(files / FAILURES_JSON),
            nproc=job.nproc,
            nnodes=job.nnodes,
            max_restarts=s.max_restarts,
            monitor_interval=s.monitor_interval,
            log_dir=str(job.job_dir / s.log_dir / self.node(job)),
            tee=self.tee,
            line_prefix=f"[{job.label}rank${{rank}}]: ",
            env=env,
            cwd=os.getcwd(),
            # Nothing of a job reaches a quiet sweep's console (the launcher says how it
            # ended): the agent's own lines go to agent.log beside the ranks' files.
            log=None if self.tee != "0" else str(files / AGENT_LOG),
            cpus=cpus,
            rdzv_conf=rdzv_conf(s.rdzv_conf),
        )
        if s.rdzv_endpoint:  # (place() refused a multi-node job without one)
            spec.rdzv_backend = s.rdzv_backend
            spec.rdzv_endpoint = job_endpoint(s.rdzv_endpoint, job.num)
            spec.rdzv_id, spec.node_rank = s.rdzv_id or job.job_dir.name, s.node_rank
        return spec

    def start(self, batch: list[tuple[Job, Any]]) -> list[Any]:
        return [self.start_one(job, *slot) for job, slot in batch]

    def start_one(self, job: Job, gpus: list[int], cpus: list[int] | None = None) -> Any:

        files = self.files(job)
        files.mkdir(parents=True, exist_ok=True)
        for stale in (RESULT_PKL, JOB_JSON, FAILURES_JSON):  # from an earlier run into this dir
            (files / stale).unlink(missing_ok=True)
        with open(files / JOB_PKL, "wb") as f:
            task = by_reference(job.spec.task_function)  # the app's script's: by name
            dump_job(replace(job.spec, task_function=task), f)
        env = self.job_env(job, gpus, cpus)
        self.warn_oversubscribed(job, cpus)
        log.log(
            logging.DEBUG if job.in_sweep else logging.INFO,
            "#%d %s: %d rank(s)%s",
            job.num,
            " ".join(job.overrides) or "(no overrides)",
            job.nproc * job.nnodes,
            f" on GPUs {env['CUDA_VISIBLE_DEVICES']}" if gpus else "",
        )
        job.started = time.time()
        # Started by a sweep's first job, kept for every later one (it has imported torch).
        self.warm.ensure_running(
            task_modules(job.spec.task_function), wandb=wandb_wanted(job.spec.config)
        )
        return self.warm.start(self.agent_spec(job, env, cpus))

    @staticmethod
    def record(_process: Any) -> None:
        return None  # an agent does not outlive its launcher: nothing to find again

    @staticmethod
    def ended(processes: list[Any]) -> list[Any]:
        return [p for p in processes if p.exitcode is not None]

    def earlier_return(self, job: Job, _attempt: Any) -> Any:
        """Rank 0's JobReturn of the job's last attempt (a resumed sweep asks)."""
        return read_job_return(self.files(job) / RESULT_PKL, job)

    @staticmethod
    def reattach(_job: Job, _attempt: Any) -> None:
        return None  # its agent died with the launcher that started it

    def outcome(self, job: Job, process: Any) -> Any:
        """The JobReturn of a finished job: rank 0's own, or a failed one saying why."""
        from hydra.core.utils import JobStatus

        code, files = process.exitcode, self.files(job)
        ret = read_job_return(files / RESULT_PKL, job)
        if code == 0 and ret is not None and ret.status == JobStatus.COMPLETED:
            return ret
        if code == 0 and ret is None and job.nnodes > 1:
            # Every rank here succeeded and global rank 0 ran on another node: the job's value
            # and files are that node's (its launcher returns them to its sweeper).
            log.info("#%d: done on this node; rank 0 ran on another node", job.num)
            return job_return(job, JobStatus.COMPLETED, None)
        rank_logs = job.job_dir / self.settings.log_dir
        rank0 = job_value(ret) if ret is not None and ret.status == JobStatus.FAILED else None
        failures = read_failures(files / FAILURES_JSON)
        if rank0 is None:  # stopped before it sent its JobReturn: its error file still says
            said = [f["error"] for f in failures if f.get("rank") == 0 and f.get("error")]
            rank0 = Stopped(one_line(said[0])) if said else None
        dead = [f"{describe_failure(f)}; rank logs in {rank_logs}" for f in failures]
        if code is not None and code < 0:
            otherwise = f"torchrun was killed by {signal.Signals(-code).name}"
        elif code == 0:
            otherwise = "torchrun exited with code 0 but rank 0 left no result"
        else:
            otherwise = f"torchrun exited with code {code}: see {rank_logs} for each rank's output"
            agent_log = files / AGENT_LOG
            if not any(p.is_file() for p in rank_logs.rglob("*")) and agent_log.is_file():
                # no rank wrote a line (the agent failed first, e.g. its rendezvous): its log says
                otherwise = (
                    f"torchrun's agent failed before any rank ran: {last_error(agent_log)} "
                    f"(its log: {agent_log})"
                )
        # Another rank failed first (the agent orders the failures: a rank that only lost a
        # peer comes last): rank 0's own error is a consequence, in brackets after the cause.
        first = failures[0] if failures else {}
        another = first.get("rank", 0) != 0 and not first.get("lost_a_peer")
        if rank0 is not None and another and find_user_error(rank0) is None:
            rank0 = Stopped(describe(rank0))
        elif rank0 is not None and all(f.get("lost_a_peer") for f in failures) and failures:
            # Every error known is a lost peer: the rank that went first left none (killed)
            rank0 = Stopped(describe(rank0))
            dead = [f"a rank ended without an error of its own (killed?); rank logs in {rank_logs}"]
        # A rank that failed first with a user error (exit 2, its error file says which) can
        # get rank 0 stopped before rank 0 reports the same error: the job's failure is still
        # the user's to fix (the sweep exits 2), and reads as rank 0 would have put it.
        stopped = rank0 is None or isinstance(rank0, Stopped)
        user = (
            UserError(first["error"])
            if stopped and first.get("exitcode") == UserError.exit_code and first.get("error")
            else None
        )
        reason = failure_reason(user or rank0, dead, otherwise)
        # rank 0's own exception is the job's failure (Hydra's JobReturn gets it) unless it was
        # only a consequence (Stopped) of another rank's failure
        task_error = None if stopped or user is not None else rank0
        failed = failed_job_return(job, reason, ret, cause=user, task_error=task_error)
        # Rank 0 printed its own error where the user watches (`python app.py
        # dist.nproc_per_node=N` shows rank 0's output): the launcher need not say it again.
        verdict_of(failed).already_said = not stopped and self.tee != "0"
        return failed

    @staticmethod
    def stop(running: list[tuple[Job, Any]], why: str, grace_s: float = STOP_GRACE_S) -> None:
        """Stop running jobs as preemption does, all at once: SIGTERM to each agent (torchrun
        forwards it to its ranks: they agree on a step, checkpoint, exit 75), then wait up to
        `grace_s` for all of them; past it, or at a second Ctrl-C, SIGKILL (the ranks die with
        their agent)."""
        alive = [process for _, process in running if process.exitcode is None]
        if alive:
            log.warning("%s: stopping %d running job(s): they checkpoint and exit", why, len(alive))
        for process in alive:
            signal_group(process, signal.SIGTERM)
        deadline = time.time() + grace_s
        try:
            for process in alive:
                process.join(timeout=max(0.0, deadline - time.time()))
            if any(process.exitcode is None for process in alive):
                raise TimeoutError
        except (TimeoutError, KeyboardInterrupt):
            log.warning("killing the jobs that are still running")
            for process in alive:
                signal_group(process, signal.SIGKILL)
            for process in alive:
                process.join()


def last_error(log_file: Path) -> str:
    """The last line of `log_file` that names an error (a traceback's last line), else its
    last line."""
    lines = [line.strip() for line in log_file.read_text(errors="replace").splitlines()]
    lines = [line for line in lines if line]
    errors = [line for line in lines if re.match(r"^[\w.]+(Error|Exception)\b", line)]
    return (errors or lines or ["(empty)"])[-1]


def gpu_list(gpus: list[int]) -> str:
    """`[0,2]`: a list as an override takes it, pasted into a shell (no space)."""
    return f"[{','.join(str(g) for g in gpus)}]"


WORLD_KEYS = ("nproc_per_node", "nnodes")


# torchrun --tee's forms (torch's Std.from_str): 0-3 for every rank, or LOCAL_RANK:N,...
TEE_FORM = re.compile(r"^[0123]$|^(\d:[0123],)*(\d:[0123])$")


def check_agent_settings(settings: TorchrunLauncherConf) -> None:
    """The launcher's keys that torch's elastic agent takes as they are, checked before any job
    starts: each job's agent raised on them (a traceback in agent.log, `torchrun exited with
    code 1`), or took a negative restart count without a word."""
    nproc, nnodes = launcher_world(settings)
    parse_count(nproc, "hydra.launcher.nproc_per_node")
    parse_count(nnodes, "hydra.launcher.nnodes")
    if settings.max_restarts < 0:
        raise UserError(
            f"hydra.launcher.max_restarts={settings.max_restarts}: use 0 (no restart) or more"
        )
    interval = settings.monitor_interval
    if not (math.isfinite(interval) and interval > 0):
        raise UserError(
            f"hydra.launcher.monitor_interval={interval}: use a number of seconds > 0, e.g. 0.1"
        )
    if settings.tee is not None and not TEE_FORM.match(str(settings.tee)):
        raise UserError(
            f"hydra.launcher.tee={settings.tee}: use 0 (no rank), 1 (stdout), 2 (stderr), "
            "3 (both), or LOCAL_RANK:N for some ranks, e.g. hydra.launcher.tee=0:3"
        )


def launcher_world(settings: TorchrunLauncherConf) -> tuple[Any, Any]:
    """The launcher's (nproc_per_node, nnodes), what a job's `auto` or absent `dist` key takes:
    torchrun's forms, `auto` or a count; nnodes also MIN:MAX with MIN = MAX (the other torchrun
    launchers' default is 1:1), as jobs here have a fixed number of nodes."""
    nnodes = str(settings.nnodes).strip()
    if ":" in nnodes:
        low, _, high = nnodes.partition(":")
        if low.strip() != high.strip():
            raise UserError(
                f"hydra.launcher.nnodes={nnodes} is an elastic range: a job here runs on a fixed "
                "number of nodes: use one number, e.g. hydra.launcher.nnodes="
                f"{high.strip() or low.strip()}"
            )
        nnodes = low.strip()
    return settings.nproc_per_node, nnodes


def rdzv_conf(value: Any) -> dict[str, str]:
    """hydra.launcher.rdzv_conf as the rendezvous backend's options (torch reads each value as
    the type it needs): a mapping, or torchrun's --rdzv-conf string KEY=VALUE,..."""
    if isinstance(value, dict):
        return {str(key): str(item) for key, item in value.items()}
    options = {}
    for item in filter(None, (part.strip() for part in str(value or "").split(","))):
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise UserError(
                f"hydra.launcher.rdzv_conf={value}: write KEY=VALUE pairs separated by commas, "
                """e.g. 'hydra.launcher.rdzv_conf="join_timeout=900,read_timeout=120"', or """
                "hydra.launcher.rdzv_conf={join_timeout:900,read_timeout:120}"
            )
        options[key.strip()] = text.strip()
    return options


def world_key(config: DictConfig, key: str, world: tuple[Any, Any]) -> str:
    """Which key a job's `key` (nproc_per_node, nnodes) came from, for its errors: its own
    `dist.<key>` when set, else the launcher's (core/world.py's job_world)."""
    own = OmegaConf.select(config, f"dist.{key}", default=None)
    launcher = world[WORLD_KEYS.index(key)]
    if (own is None or str(own).strip() == "auto") and str(launcher).strip() != "auto":
        return f"hydra.launcher.{key}"
    return f"dist.{key}"


def job_endpoint(endpoint: str, num: int) -> str:
    """Job `num`'s rendezvous endpoint: hydra.launcher.rdzv_endpoint's port + num. Jobs that run
    at once on the same hosts would otherwise share one store: torch's c10d rendezvous makes an
    agent whose port is taken a client of the store already there, and when the job hosting it
    ends, the other job's agents lose their store. Every node's launcher numbers a sweep's jobs
    alike, a resumed sweep too, so each computes the same endpoint. HOST[:PORT] is read as
    torch's parse_rendezvous_endpoint reads it ([v6 address] in brackets)."""
    host, port = endpoint_parts(endpoint)
    where = f"hydra.launcher.rdzv_endpoint={endpoint}"
    if not host or not port.isdigit() or not 0 < int(port) < 2**16:
        raise UserError(f"{where} is not HOST:PORT: use e.g. node01:29400")
    if int(port) + num >= 2**16:
        raise UserError(
            f"{where}: job #{num} meets at port {port} + {num}, past 65535: use a lower port"
        )
    return f"{host}:{int(port) + num}"


def signal_group(process: Any, sig: int) -> None:
    """Signal the agent's process group: the agent and the ranks it forked (torchrun also
    forwards SIGTERM to them itself)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, sig)
