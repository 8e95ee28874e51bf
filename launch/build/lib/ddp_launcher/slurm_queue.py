"""What SLURM's own commands say, for ddp_launcher/slurm.py: the GPUs and CPUs of a partition
(sinfo), job
states (squeue, else sacct), sbatch's refusal as one line, and the environment sbatch gets."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from ddp_launcher.core.errors import UserError

# SLURM job states after which a job may still run (squeue/sacct spellings).
_ACTIVE = (
    "PENDING CONFIGURING RUNNING COMPLETING REQUEUED REQUEUE_FED REQUEUE_HOLD RESIZING SUSPENDED "
    "STOPPED SIGNALING STAGE_OUT RESV_DEL_HOLD PREEMPTED SPECIAL_EXIT"
)
ACTIVE_STATES = frozenset(_ACTIVE.split())


_GPU_GRES = re.compile(r"(?:^|[\s,])gpu(?::[^:,(\s]+)?:(\d+)")


def gpus_in_gres(text: str) -> int:
    """The most GPUs of any node in sinfo's gres (%G) output: gpu:8, gpu:a100:8(S:0-1)."""
    return max(map(int, _GPU_GRES.findall(text)), default=0)


_CPUS_GRES = re.compile(r"^\s*(\d+)\+?\s+(\S+)")


def cpus_per_gpu_in_sinfo(text: str) -> int | None:
    """The CPUs a node offers per GPU in `sinfo --format="%c %G"` output (one line per kind of
    node: CPUs, then gres), the smallest over the kinds of GPU node; None without GPU nodes."""
    shares = []
    for line in text.splitlines():
        found = _CPUS_GRES.match(line)
        gpus = gpus_in_gres(found.group(2)) if found else 0
        if gpus:
            shares.append(max(1, int(found.group(1)) // gpus))
    return min(shares, default=None)


def partition_resources(partition: str | None) -> tuple[int, int | None]:
    """GPUs per node of `partition` (the default one when None) and CPUs per GPU of its GPU
    nodes, from one `sinfo`: 0 and None when there are none or sinfo cannot be run."""
    cmd = ["sinfo", "--noheader", "--format=%c %G"]
    if partition:
        cmd.append(f"--partition={partition}")
    try:
        text = subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        text = ""
    return gpus_in_gres(text), cpus_per_gpu_in_sinfo(text)


def require_slurm() -> None:
    """Before anything is composed or submitted: the SLURM commands the launcher runs (sbatch
    submits, submitit looks for srun, sinfo tells the partition's GPUs) must be here."""
    missing = [cmd for cmd in ("sbatch", "srun", "sinfo") if shutil.which(cmd) is None]
    if missing:
        also = f" (nor {', '.join(f'`{cmd}`' for cmd in missing[1:])})" if missing[1:] else ""
        raise UserError(
            f"hydra/launcher=slurm needs SLURM, but `{missing[0]}` is not on PATH here{also}: "
            "run the sweep on a SLURM login node, or use hydra/launcher=torchrun"
        )


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
        "squeue --noheader --array --states=all --format=%i|%T",
        "sacct --noheader --parsable2 --allocations --format=JobID,State",
    ):
        if all(j in states for j in job_ids):
            break
        try:
            proc = subprocess.run(
                [*cmd.split(), f"--jobs={base}"], capture_output=True, text=True, timeout=60
            )
        except (OSError, subprocess.SubprocessError):
            continue
        if proc.returncode != 0:
            continue
        for line in proc.stdout.splitlines():
            job_id, _, state = line.strip().partition("|")
            if job_id and state and job_id not in states:
                states[job_id] = state.split()[0].rstrip("+").upper()  # "CANCELLED by 0"
    return states
