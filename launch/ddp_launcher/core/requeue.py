"""`scontrol requeue` of this SLURM job: what a preempted run (the public `requeue_on_slurm`,
which an app calls once it saved) and a SLURM task stopped before training
(ddp_launcher/ranks/slurm_task.py) ask SLURM. Torch-free."""

from __future__ import annotations

import logging
import os
import re
import subprocess

log = logging.getLogger(__name__)


def requeue_on_slurm() -> bool:
    """`scontrol requeue` this SLURM job if it was submitted with requeue allowed."""
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
        subprocess.run(["scontrol", "requeue", job], check=True, timeout=30)
        log.info("SLURM job %s requeued", job)
        return True
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("could not requeue SLURM job %s: %s", job, e)
        return False
