"""SLURM: each SLURM task is one rank. The engine behind `hydra/launcher=slurm`.

* **SLURM -> torch**: :func:`torch_env` maps a task's SLURM variables to what
  `init_process_group("env://")` and components/distributed.py read: RANK = SLURM_PROCID,
  LOCAL_RANK = SLURM_LOCALID, WORLD_SIZE = tasks of the step, LOCAL_WORLD_SIZE = tasks on this
  node, MASTER_ADDR = the step's first node, MASTER_PORT = a port derived from the job id and
  restart count (the same in every task, a different one for every job and every requeue).
  No torchrun runs inside a task. `python -m launch.slurm env` prints the mapping of the task it
  runs in; launch/sbatch_example.sh does the same mapping in bash for `srun python train.py`.
* **The launcher** (:func:`launch_sweep_batch`, called by
  hydra_plugins/hydra_ddp_slurm_launcher): composes each sweep job's config here, reads its
  world size (`dist.nnodes` x `dist.nproc_per_node`, `auto` resolved as by the torchrun
  launcher) and turns it into that job's SLURM resources (nodes, tasks per node, GPUs). Jobs
  that ask for the same resources go out as one submitit job array; the launcher then waits for
  rank 0's JobReturn of each (the sweeper's value), or says why a job ended without one.
* **In each task** (:func:`run_task`): the job runs as a Hydra job on rank 0 only (`.hydra/`,
  log, callbacks); other ranks run it with `hydra.output_subdir=null`, errors-only logging and no
  callbacks, as launch/job_rank.py does for torchrun jobs.
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
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from components.errors import UserError
from hydra_plugins.hydra_ddp_slurm_launcher.config import DDPSlurmQueueConf

log = logging.getLogger(__name__)

PORT_RANGE = (20000, 60000)
# SLURM job states after which a job will not run again (squeue/sacct spellings).
ACTIVE_STATES = {
    "PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "REQUEUE_FED",
    "REQUEUE_HOLD", "RESIZING", "SUSPENDED", "STOPPED", "SIGNALING", "STAGE_OUT",
    "RESV_DEL_HOLD", "PREEMPTED", "SPECIAL_EXIT",
}  # fmt: skip


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
# launcher settings and per-job resources


class SlurmSettings(DDPSlurmQueueConf):
    """The `hydra.launcher` options; their schema and docs are the plugin's config
    (hydra_plugins/hydra_ddp_slurm_launcher/config.py, conf/hydra/launcher/slurm.yaml)."""

    @classmethod
    def from_config(cls, launcher_cfg: Any) -> SlurmSettings:
        if OmegaConf.is_config(launcher_cfg):
            launcher_cfg = OmegaConf.to_container(launcher_cfg, resolve=True)
        known = {k: v for k, v in dict(launcher_cfg or {}).items() if k in cls.__dataclass_fields__}
        if "additional_parameters" in known:
            known["additional_parameters"] = dict(known["additional_parameters"] or {})
        if "srun_args" in known:
            known["srun_args"] = list(known["srun_args"] or [])
        return cls(**known)


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


def _count(value: Any, key: str, auto: int | None = None) -> int | None:
    text = str(value).strip()
    if text == "auto" or value is None:
        return auto
    if text.isdigit() and int(text) >= 0:
        return int(text)
    raise UserError(f"{key}={text} is not valid: use {key}=auto or a non-negative integer")


def job_resources(config: DictConfig, settings: SlurmSettings, cluster_gpus: int) -> dict:
    """This job's SLURM resources, from its own `dist` config: one task per rank.

    nproc `auto` = the GPUs of a node for GPU jobs (`hydra.launcher.gpus_per_node`), 1 on CPU
    (or with dist.backend=gloo), as with the torchrun launcher; GPU jobs ask for one GPU per
    task (`--gpus-per-node=<tasks per node>`), each rank taking GPU LOCAL_RANK.
    """
    from launch.torchrun import LauncherSettings, job_world

    keys = LauncherSettings(nproc_key=settings.nproc_key, nnodes_key=settings.nnodes_key,
                            backend_key=settings.backend_key)  # fmt: skip
    backend = OmegaConf.select(config, settings.backend_key, default="auto")
    uses_gpus = cluster_gpus > 0 and backend != "gloo"
    nproc, nnodes = job_world(config, keys, cluster_gpus)
    for launcher_key, dist_key, value in (
        ("tasks_per_node", settings.nproc_key, nproc),
        ("nodes", settings.nnodes_key, nnodes),
    ):
        fixed = _count(getattr(settings, launcher_key), f"hydra.launcher.{launcher_key}")
        if fixed is None or fixed == value:
            continue
        if str(OmegaConf.select(config, dist_key, default="auto")) != "auto":
            raise UserError(
                f"{dist_key}={value} but hydra.launcher.{launcher_key}={fixed}: drop one of them "
                f"(hydra.launcher.{launcher_key}=auto takes each job's {dist_key})"
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
    if uses_gpus and nproc > cluster_gpus:
        raise UserError(
            f"{settings.nproc_key}={nproc} asks for {nproc} GPUs per node but "
            f"hydra.launcher.gpus_per_node={cluster_gpus}: lower {settings.nproc_key}"
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
        "slurm_setup": [*python_path_setup(), *(settings.setup or [])],
    }
    if uses_gpus:
        params["gpus_per_node"] = nproc
    for key in ("cpus_per_task", "mem_gb"):
        if getattr(settings, key) is not None:
            params[key] = getattr(settings, key)
    for key in ("partition", "qos", "comment", "constraint", "exclude", "gres", "cpus_per_gpu",
                "mem_per_gpu", "mem_per_cpu", "account"):  # fmt: skip
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
# the launcher: submit, wait, collect


@dataclass
class Submitted:
    job: Any  # launch.torchrun.Job: num, overrides, job dir, config, world size
    resources: dict
    slurm: Any = None  # submitit's SlurmJob (None: failed before submission)
    state: str = ""
    ended_since: float | None = None  # first seen in a final (or no) state without a result
    ran: bool = False  # seen running since it was (re)queued
    restarts: int = 0

    @property
    def label(self) -> str:
        slurm = f" (SLURM job {self.slurm.job_id})" if self.slurm is not None else ""
        return f"#{self.job.num}{slurm}"


def plan_jobs(launcher, job_overrides, initial_job_idx: int) -> list[Submitted]:
    """Compose every job's config here (as the torchrun launcher does) to read its world size."""
    from hydra.core.singleton import Singleton

    from launch.torchrun import Job, JobSpec, resolve_output_dirs

    planned, gpus_by_partition = [], {}
    for idx, overrides in enumerate(job_overrides):
        num = initial_job_idx + idx
        config = launcher.hydra_context.config_loader.load_sweep_config(
            launcher.config, list(overrides)
        )
        with open_dict(config):
            config.hydra.job.num = num
        resolve_output_dirs(config, ("hydra.sweep.dir", "hydra.sweep.subdir"))
        job_dir = Path(str(config.hydra.sweep.dir)) / str(config.hydra.sweep.subdir)
        spec = JobSpec(launcher.task_function, config, Singleton.get_state())
        job = Job(num, list(overrides), job_dir, spec, nproc=1, nnodes=1, label=f"#{num} ")
        try:
            settings = SlurmSettings.from_config(config.hydra.launcher)  # this job's own values
            gpus = _count(settings.gpus_per_node, "hydra.launcher.gpus_per_node")
            if gpus is None:
                if settings.partition not in gpus_by_partition:
                    gpus_by_partition[settings.partition] = cluster_gpus_per_node(
                        settings.partition
                    )
                gpus = gpus_by_partition[settings.partition]
            resources = job_resources(config, settings, gpus)
            job.nproc, job.nnodes = resources["tasks_per_node"], resources["nodes"]
            resources["folder"] = settings.submitit_folder
            resources["max_num_timeout"] = settings.max_num_timeout
            resources["poll_interval_s"] = settings.poll_interval_s
        except UserError as e:
            resources = {"error": str(e)}
        planned.append(Submitted(job, resources))
    return planned


def submit(launcher, planned: list[Submitted]) -> None:
    """One submitit array per run of jobs asking for the same resources, in job order."""
    import submitit

    def key(s: Submitted) -> str:
        return json.dumps({k: v for k, v in s.resources.items() if k != "poll_interval_s"},
                          sort_keys=True, default=str)  # fmt: skip

    todo = [s for s in planned if "error" not in s.resources]
    for _, group in itertools.groupby(sorted(todo, key=key), key=key):
        group = sorted(group, key=lambda s: s.job.num)
        params = dict(group[0].resources)
        folder, max_timeout = params.pop("folder"), params.pop("max_num_timeout")
        params.pop("poll_interval_s")
        executor = submitit.AutoExecutor(folder=folder, cluster="slurm",
                                         slurm_max_num_timeout=max_timeout)  # fmt: skip
        executor.update_parameters(**params)
        args = [(s.job.overrides, "hydra.sweep.dir", s.job.num, f"job_id_for_{s.job.num}",
                 s.job.spec.singleton_state) for s in group]  # fmt: skip
        started = time.time()
        with submission_env():
            jobs = executor.map_array(launcher, *zip(*args, strict=True))
        for s, slurm_job in zip(group, jobs, strict=True):
            s.slurm, s.job.started = slurm_job, started
            where = f"{s.resources['nodes']} node(s) x {s.resources['tasks_per_node']} task(s)"
            gpus = s.resources.get("gpus_per_node")
            log.info("#%d %s: SLURM job %s, %s%s", s.job.num,
                     " ".join(s.job.overrides) or "(no overrides)", slurm_job.job_id, where,
                     f", {gpus} GPU(s) per node" if gpus else "")  # fmt: skip


@contextmanager
def submission_env() -> Iterator[None]:
    """Submitting from inside a SLURM job (salloc, a batch script): hide that job's own
    variables from sbatch and the new job (its SLURM_* but SLURM_CONF; SLURMD_*, SRUN_*,
    SUBMITIT_*, torch's rank variables), as submitit.helpers.clean_env does; SBATCH_* (the
    user's sbatch defaults) are kept."""
    torch_names = {"MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                   "LOCAL_WORLD_SIZE", "GROUP_RANK"}  # fmt: skip
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
        ["sacct", "--noheader", "--parsable2", "--allocations", "--format=JobID,State",
         f"--jobs={base}"],
    ):  # fmt: skip
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


def wait_for_results(planned: list[Submitted]) -> None:
    """Poll until every submitted job has rank 0's result or has ended without one."""
    waiting = [s for s in planned if s.slurm is not None]
    poll = min((s.resources.get("poll_interval_s", 5.0) for s in waiting), default=5.0)
    grace = max(15.0, 2 * poll)
    while waiting:
        states = slurm_states([s.slurm.job_id for s in waiting])
        now = time.time()
        for s in list(waiting):
            state = states.get(s.slurm.job_id, "UNKNOWN")
            if state != s.state:
                note_state(s, state)
            if result_path(s).exists():
                waiting.remove(s)
            elif state in ACTIVE_STATES:
                s.ended_since = None
            elif s.ended_since is None:
                s.ended_since = now
            elif now - s.ended_since > grace:  # ended (or forgotten) with no result from rank 0
                waiting.remove(s)
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
        log.info("%s running%s", s.label, f" (restart {s.restarts})" if s.restarts else "")
    elif state not in ACTIVE_STATES and state != "UNKNOWN":
        log.info("%s %s", s.label, state)


def result_path(s: Submitted) -> Path:
    """submitit's result pickle of task 0 (rank 0): ("success", JobReturn) or ("error", tb)."""
    return s.slurm.task(0).paths.result_pickle


def read_outcome(s: Submitted) -> tuple[str, Any] | None:
    path = result_path(s)
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
    from hydra.core.utils import JobReturn, JobStatus

    from launch.torchrun import JobFailed, failed_before_start, record_failure

    if "error" in s.resources:
        return failed_before_start(s.job, s.resources["error"])
    outcome = read_outcome(s)
    ret = outcome[1] if outcome and outcome[0] == "success" else None
    if isinstance(ret, JobReturn) and ret.status == JobStatus.COMPLETED:
        return ret
    error = failure_reason(s, outcome)
    log.error("#%d %s failed: %s", s.job.num, " ".join(s.job.overrides), error)
    record_failure(s.job, error)
    if not isinstance(ret, JobReturn):
        config = s.job.spec.config
        ret = JobReturn(overrides=s.job.overrides, cfg=config, hydra_cfg=config)
        ret.working_dir = str(s.job.job_dir)
    ret.return_value = JobFailed(f"job #{s.job.num} ({' '.join(s.job.overrides)}): {error}")
    ret.status = JobStatus.FAILED
    return ret


def failure_reason(s: Submitted, outcome: tuple[str, Any] | None) -> str:
    """The best one-line account of why a job failed, most specific first: another rank that
    srun saw fail (rank 0's own error is then often only the consequence), then rank 0's."""
    others = other_task_failures(s)
    rank0 = rank0_failure(s, outcome)
    if others:
        return f"{others[0]}" + (f" (rank 0: {rank0})" if rank0 else "")
    if rank0:
        return rank0
    logs = f"see {s.slurm.task(0).paths.stderr}"
    state = s.state or "UNKNOWN"
    if job_result_of(s).get("status") == "preempted":
        return (
            f"stopped and checkpointed but not requeued (SLURM job {s.slurm.job_id} {state}; "
            f"requeue=false?): resume=auto continues it in {s.job.job_dir}; {logs}"
        )
    return f"SLURM job {s.slurm.job_id} ended ({state}) without rank 0's result: {logs}"


def job_result_of(s: Submitted) -> dict:
    from launch.torchrun import job_result

    return job_result(s.job)  # train.py's result.json, if this run of the job wrote it


def rank0_failure(s: Submitted, outcome: tuple[str, Any] | None) -> str:
    from launch.torchrun import describe_task_error, one_line

    result = job_result_of(s)
    if result.get("error"):
        return one_line(result["error"])
    if outcome is not None and outcome[0] == "success":  # rank 0's failed JobReturn
        text = describe_task_error(getattr(outcome[1], "_return_value", None))
        if text is not None:
            return text
    if outcome is not None and outcome[0] == "error":  # the task raised outside the job
        lines = [line for line in str(outcome[1]).strip().splitlines() if line.strip()]
        return one_line(lines[-1] if lines else outcome[1])
    return ""


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


def cancel(planned: list[Submitted]) -> None:
    ids = [s.slurm.job_id for s in planned if s.slurm is not None]
    if ids and shutil.which("scancel"):
        log.warning("cancelling SLURM job(s) %s", " ".join(ids))
        subprocess.run(["scancel", *ids], check=False, timeout=60)


def launch_sweep_batch(launcher, job_overrides, initial_job_idx: int) -> list[Any]:
    """Hydra Launcher.launch: run one batch of sweep jobs on SLURM, return their JobReturns."""
    from hydra.core.utils import filter_overrides, setup_globals

    if in_slurm_task() and int(os.environ.get("SLURM_STEP_NUM_TASKS") or 1) > 1:
        raise UserError(
            "a sweep cannot start in every task of an srun step: run `python train.py -m ...` once"
        )
    setup_globals()
    sweep_dir = Path(str(launcher.config.hydra.sweep.dir))
    sweep_dir.mkdir(parents=True, exist_ok=True)
    log.info("SLURM launcher: %d job(s), sweep dir %s", len(job_overrides), sweep_dir)
    for idx, overrides in enumerate(job_overrides):
        log.info("\t#%d : %s", initial_job_idx + idx, " ".join(filter_overrides(overrides)))
    planned = plan_jobs(launcher, job_overrides, initial_job_idx)
    try:
        submit(launcher, planned)
        wait_for_results(planned)
    except BaseException:  # Ctrl-C, or a failed submission: take the submitted jobs down
        cancel(planned)
        raise
    results = [finish(s) for s in planned]
    failed = [f"#{s.job.num}" for s, r in zip(planned, results, strict=True)
              if r.status.name == "FAILED"]  # fmt: skip
    if failed:
        log.error("%d of %d job(s) failed in this batch: %s", len(failed), len(results),
                  ", ".join(failed))  # fmt: skip
    return results


# ---------------------------------------------------------------------------------------------
# in each SLURM task


def run_task(launcher, overrides, job_dir_key: str, job_num: int, singleton_state) -> Any:
    """One task of a sweep job: one rank. Rank 0 runs the Hydra job and returns its JobReturn
    (submitit pickles it for the launcher); other ranks write nothing and return None."""
    import submitit
    from hydra.core.singleton import Singleton
    from hydra.core.utils import run_job, setup_globals

    from components.preemption import REQUEUE_EXIT_CODE
    from launch.job_rank import OTHER_RANKS_LOGGING, exits_as_errors, without_callbacks

    env = export_torch_env()
    rank = int(env["RANK"])
    install_stop_handlers(rank)
    Singleton.set_state(singleton_state)
    setup_globals()
    config = launcher.hydra_context.config_loader.load_sweep_config(
        launcher.config, list(overrides)
    )
    with open_dict(config.hydra.job):
        config.hydra.job.id = submitit.JobEnvironment().job_id
        config.hydra.job.num = job_num
    if rank != 0:
        with read_write(config.hydra), open_dict(config):
            config.hydra.output_subdir = None
            config.hydra.job_logging = OmegaConf.load(OTHER_RANKS_LOGGING)
    context = launcher.hydra_context if rank == 0 else without_callbacks(launcher.hydra_context)
    try:
        ret = run_job(
            hydra_context=context,
            task_function=exits_as_errors(launcher.task_function),
            config=config,
            job_dir_key=job_dir_key,
            job_subdir_key="hydra.sweep.subdir",
        )
    except SystemExit as e:
        # Preempted (exit 75): no result, the job is requeued. Rank 0 requeues it once W&B and
        # the checkpoint are done; the others end quietly so that srun --kill-on-bad-exit does
        # not cut rank 0 short.
        if rank != 0 and e.code == REQUEUE_EXIT_CODE:
            return None
        raise
    if rank != 0:
        if ret.status.name == "FAILED":
            logging.getLogger("train").error("rank %d failed: %s", rank, ret._return_value)
        return None
    return ret


def install_stop_handlers(rank: int) -> None:
    """Replace submitit's signal handlers (USR2: its own checkpoint-and-requeue; TERM: ignored)
    until train.py installs components/preemption.py's. Before training has started there is
    nothing new to save: USR1 (our time-limit signal) requeues the job at once and ends the
    task with exit 75; TERM ends the task (it is also how srun stops the other tasks when one
    fails, and how scancel cancels: no requeue; SLURM's own preemption requeues by itself).
    submitit's USR2 (`job._interrupt()`) is forwarded as USR1, so it always takes our path."""
    from components.preemption import REQUEUE_EXIT_CODE, requeue_on_slurm

    stopping = []

    def stop_before_training(signum, _frame) -> None:
        if stopping:  # e.g. the TERM that follows our own requeue: we are on our way out
            return
        stopping.append(signum)
        name = signal.Signals(signum).name
        if signum == signal.SIGTERM:
            raise SystemExit(
                "stopped by SIGTERM (another rank failed, the job was cancelled or preempted)"
            )
        logging.getLogger("train").warning("%s before training started: requeueing", name)
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
        print("usage: srun python -m launch.slurm env   (prints this task's torch variables)",
              file=sys.stderr)  # fmt: skip
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
