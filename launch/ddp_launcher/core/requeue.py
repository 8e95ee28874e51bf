"""`scontrol requeue` of this SLURM job: what a preempted run (the public `requeue_on_slurm`,
which an app calls once it saved) and a SLURM task stopped before training
(ddp_launcher/ranks/slurm_task.py) ask SLURM. A job that reached its time limit is requeued at
most hydra.launcher.max_num_timeout times, as submitit counts (a preempted one whatever the
count). Torch-free."""

from __future__ import annotations

import logging
import os
import re
import subprocess
from pathlib import Path

log = logging.getLogger(__name__)

# hydra.launcher.max_num_timeout, exported by the SLURM job's batch script (ddp_launcher/slurm.py)
MAX_NUM_TIMEOUT_ENV = "HYDRA_DDP_MAX_NUM_TIMEOUT"
# the job dir's file counting the requeues after a time limit, set by each task (slurm_task.py)
TIMEOUTS_FILE_ENV = "HYDRA_DDP_TIMEOUTS_FILE"
TIMEOUTS_FILE = ".slurm_timeouts"


def slurm_seconds(text: str) -> int | None:
    """SLURM's [days-]hours:minutes:seconds (also minutes:seconds) in seconds; None for
    UNLIMITED or anything else."""
    match = re.fullmatch(r"(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)", text.strip())
    if not match:
        return None
    days, hours, minutes, seconds = (int(g or 0) for g in match.groups())
    return ((days * 24 + hours) * 60 + minutes) * 60 + seconds


def timed_out(job_info: str) -> bool:
    """Whether the job (`scontrol show job`'s text) is at its time limit rather than preempted,
    by submitit's rule: it ran at least min(80 % of its limit, its limit - 10 min)."""
    run = re.search(r"\bRunTime=(\S+)", job_info)
    limit = re.search(r"\bTimeLimit=(\S+)", job_info)
    ran = slurm_seconds(run.group(1)) if run else None
    allowed = slurm_seconds(limit.group(1)) if limit else None
    if ran is None or allowed is None:
        return False
    return ran >= min(0.8 * allowed, allowed - 600)


def timeout_requeue_allowed(job: str) -> bool:
    """One more requeue after a time limit, counted in the job dir, unless the job has had
    hydra.launcher.max_num_timeout of them (no limit known: allowed)."""
    limit, where = os.environ.get(MAX_NUM_TIMEOUT_ENV), os.environ.get(TIMEOUTS_FILE_ENV)
    if not limit or not limit.isdigit() or not where:
        return True
    counter = Path(where)
    try:
        done = int(counter.read_text().strip() or 0)
    except (OSError, ValueError):
        done = 0
    if done >= int(limit):
        log.warning(
            "SLURM job %s reached its time limit again after %d requeue(s) "
            "(hydra.launcher.max_num_timeout=%s): not requeued; a resumed sweep continues it",
            job,
            done,
            limit,
        )
        return False
    temporary = counter.with_name(counter.name + ".tmp")
    temporary.write_text(f"{done + 1}\n")
    temporary.replace(counter)
    return True


def requeue_on_slurm() -> bool:
    """`scontrol requeue` this SLURM job if it was submitted with requeue allowed (and, at its
    time limit, has requeues left: hydra.launcher.max_num_timeout)."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return False
    try:
        info = subprocess.run(
            ["scontrol", "show", "job", job], capture_output=True, text=True, timeout=30
        ).stdout
        if "Requeue=1" not in info:
            log.warning("SLURM job %s does not allow requeue (sbatch --requeue): not requeued", job)
            return False
        state = re.search(r"\bJobState=(\S+)", info)
        if state and state.group(1) != "RUNNING":  # scancel'd (or already requeued): leave it
            log.warning("SLURM job %s is %s: not requeued", job, state.group(1))
            return False
        if timed_out(info) and not timeout_requeue_allowed(job):
            return False
        subprocess.run(["scontrol", "requeue", job], check=True, timeout=30)
        log.info("SLURM job %s requeued", job)
        return True
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("could not requeue SLURM job %s: %s", job, e)
        return False
