"""In each SLURM task (one task = one rank, no torchrun): SLURM's variables -> torch's
(:func:`torch_env`, as docs/slurm.md lists them; ddp_launcher/sbatch_example.sh maps the same in
bash), then the rank (:func:`run_task`, through bootstrap.py; rank 0 returns the JobReturn submitit
pickles). A preempted task ends with exit 75 on rank 0 and 0 on the others, so that `srun
--kill-on-bad-exit` leaves rank 0 the time to requeue. `python -m ddp_launcher.ranks.slurm_task env`
prints the mapping of the task it runs in.
"""

from __future__ import annotations

import logging
import os
import random
import re
import signal
import socket
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from omegaconf import open_dict

from ddp_launcher.core import run_lock
from ddp_launcher.core.errors import UserError
from ddp_launcher.core.gate import gate_of
from ddp_launcher.core.requeue import TIMEOUTS_FILE, TIMEOUTS_FILE_ENV
from ddp_launcher.core.run_dir import ATTEMPT_ENV, REQUEUE_EXIT_CODE
from ddp_launcher.core.world import cores_per_rank
from ddp_launcher.ranks.bootstrap import report_failure, run_rank
from ddp_launcher.ranks.job_spec import NotStarted, Stopped, fails_for_good, job_return

log = logging.getLogger(__name__)

PORT_RANGE = (20000, 60000)


def number_range(item: str) -> range:
    """SLURM's `3` or `1-3` (in host lists and srun's task lists)."""
    low, _, high = item.partition("-")
    return range(int(low), int(high or low) + 1)


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
                width = len(item.partition("-")[0])  # zero-padded as the range's start is
                suffixes += [f"{n:0{width}d}" for n in number_range(item)]
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
    (a requeued job never meets the previous run's store). ddp_launcher/sbatch_example.sh computes
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


def run_task(job: Any) -> Any:
    """One task of a sweep job (a ddp_launcher.jobs.Job): one rank, through bootstrap.py. Rank 0
    returns the job's JobReturn (submitit pickles it for the launcher); the other ranks return
    None."""
    values = torch_env()
    os.environ.update(values)  # over any the submitting shell passed on: SLURM's are the truth
    if not os.environ.get("OMP_NUM_THREADS"):  # unless the user chose: this task's cores
        os.environ["OMP_NUM_THREADS"] = str(cores_per_rank(int(values["LOCAL_WORLD_SIZE"])))
    rank = int(values["RANK"])
    install_stop_handlers(rank)
    os.environ[ATTEMPT_ENV] = str(job.attempt)
    # requeues after a time limit are counted in the job dir (hydra.launcher.max_num_timeout)
    os.environ[TIMEOUTS_FILE_ENV] = str(job.job_dir / TIMEOUTS_FILE)
    try:
        import submitit

        job_id = submitit.JobEnvironment().job_id
        with open_dict(job.spec.config):
            job.spec.config.hydra.job.id = job_id
        if job.fence is not None and job.fence.exists():
            raise NotStarted(
                "not started: a job of this sweep failed for good (hydra.launcher.fail_fast)"
            )
        gate = gate_of(job.spec.config)
        if rank == 0 and (gate is None or gate.lock):
            # the writer holds the job dir while the SLURM job runs (ddp_launcher/core/gate.py);
            # held by another: this task fails, and srun --kill-on-bad-exit ends the others
            opt_out = gate.lock_opt_out if gate is not None else run_lock.NO_LOCK_FIX
            run_lock.acquire(job.job_dir, f"SLURM job {job_id}, rank 0", opt_out=opt_out)
        ret = run_rank(job.spec, rank)
        failed = rank == 0 and ret.status.name == "FAILED"
        if failed and job.fence is not None and fails_for_good(job, ret):
            job.fence.touch()  # before this job's CPUs free up for a queued one
    except Stopped as e:  # stopped before the job's task function ran: rank 0 still says so
        if rank != 0:
            raise SystemExit(str(e)) from None
        report_failure(e)
        from hydra.core.utils import JobStatus

        return job_return(job, JobStatus.FAILED, e)
    except SystemExit as e:
        # Preempted (exit 75): no result, the job is requeued. Rank 0 requeues it once W&B and
        # the checkpoint are done; the others end quietly so that srun --kill-on-bad-exit does
        # not cut rank 0 short.
        if rank != 0 and e.code == REQUEUE_EXIT_CODE:
            return None
        raise
    return ret if rank == 0 else None


def install_stop_handlers(rank: int) -> None:
    """Replace submitit's signal handlers until the app installs its own (its preemption).
    Before training there is nothing to save: USR1 (our time-limit signal) requeues the job and
    ends the task with exit 75; TERM (srun stopping the tasks when one fails, scancel) ends it
    without requeue; submitit's USR2 is forwarded as USR1. Installed first thing in a task:
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
        from ddp_launcher.core.requeue import requeue_on_slurm

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


def main(argv: Sequence[str]) -> int:
    if list(argv) != ["env"]:
        print(
            "usage: srun python -m ddp_launcher.ranks.slurm_task env  (prints the torch variables)",
            file=sys.stderr,
        )
        return 2
    try:
        values = torch_env()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    print(" ".join(f"{k}={v}" for k, v in values.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
