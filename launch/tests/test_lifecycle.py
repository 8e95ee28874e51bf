"""A third backend, written against ddp_launcher/lifecycle.py's Backend protocol alone: a local
pool of
plain processes (one rank each, no torchrun). A 2-job sweep runs through the shared lifecycle:
composed, placed, recorded in launch.json, started at most `size` at a time, its outcome read,
reported, and a resumed sweep does not run it again."""

from __future__ import annotations

import multiprocessing
import os
import time
from types import SimpleNamespace
from typing import Any

import cloudpickle
import pytest
from ddp_launcher.core.run_dir import read_launch_record
from ddp_launcher.jobs import Job, compose_jobs, failed_job_return
from ddp_launcher.lifecycle import run_jobs
from ddp_launcher.ranks.bootstrap import rank_main
from ddp_launcher.ranks.handoff import RESULT_PKL, read_job_return
from hydra.core.utils import JobStatus

POOL_DIR = ".pool"  # in each job dir: the pickled job and rank 0's JobReturn


SPAWN = multiprocessing.get_context("spawn")


def pool_rank(payload: str) -> None:
    """One attempt's process: rank 0 of 1 runs the pickled job, as a torchrun rank does."""
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    rank_main(payload)


class PoolBackend:
    """Each attempt is one process running ddp_launcher/ranks/bootstrap.py's rank_main on the
    pickled
    job (rank 0 of 1) on this machine, at most `size` at once."""

    poll_s = 0.05
    holds_job_dirs = True

    def __init__(self, size: int = 2) -> None:
        self.size, self.busy, self.most_at_once = size, 0, 0

    def place(self, job: Job) -> None:
        job.nproc, job.nnodes, job.uses_gpus = 1, 1, False

    def reserve(self, job: Job) -> bool | None:
        if self.busy >= self.size:
            return None
        self.busy += 1
        self.most_at_once = max(self.most_at_once, self.busy)
        return True

    def release(self, job: Job, slot: bool) -> None:
        self.busy -= 1

    def start(self, batch: list[tuple[Job, bool]]) -> list[multiprocessing.Process]:
        processes = []
        for job, _ in batch:
            files = job.job_dir / POOL_DIR
            files.mkdir(parents=True, exist_ok=True)
            (files / "job.pkl").write_bytes(cloudpickle.dumps(job.spec))
            job.started = time.time()
            process = SPAWN.Process(target=pool_rank, args=(str(files / "job.pkl"),))
            process.start()
            processes.append(process)
        return processes

    def record(self, process: multiprocessing.Process) -> dict:
        return {"pid": process.pid}

    def ended(self, processes: list[multiprocessing.Process]) -> list[multiprocessing.Process]:
        return [p for p in processes if p.exitcode is not None]

    def outcome(self, job: Job, process: multiprocessing.Process) -> Any:
        ret = read_job_return(job.job_dir / POOL_DIR / RESULT_PKL, job)
        if process.exitcode == 0 and ret is not None:
            return ret
        return failed_job_return(job, f"exited with code {process.exitcode}", ret)

    def stop(self, running: list[tuple[Job, multiprocessing.Process]], why: str) -> None:
        for _, process in running:
            process.terminate()
            process.join()

    def earlier_return(self, job: Job, attempt: Any) -> Any:
        return read_job_return(job.job_dir / POOL_DIR / RESULT_PKL, job)

    def reattach(self, job: Job, attempt: Any) -> None:
        return None  # its process died with the launcher


def ten_lr(cfg: Any) -> float:
    """The sweep's task (imported by reference in each process): no training, a value."""
    return round(10 * cfg.optim.lr, 6)


@pytest.mark.slow
def test_a_third_backend_runs_a_sweep_through_the_shared_lifecycle(train_config, tmp_path):
    master = train_config.multirun(f"hydra.sweep.dir={tmp_path}", "wandb.mode=disabled")
    launcher = SimpleNamespace(
        config=master, hydra_context=train_config.context, task_function=ten_lr
    )
    batch = [["optim.lr=0.1"], ["optim.lr=0.2"]]
    jobs = compose_jobs(launcher, batch, 0)
    backend = PoolBackend(size=1)
    heard: list[int] = []  # each job as soon as it is done
    results = run_jobs(jobs, backend, on_done=lambda job, ret: heard.append(job.num))
    assert sorted(heard) == [0, 1]
    assert [results[job.num].status for job in jobs] == [JobStatus.COMPLETED] * 2
    assert [results[job.num].return_value for job in jobs] == [1.0, 2.0]
    assert backend.most_at_once == 1 and backend.busy == 0
    for job in jobs:
        record = read_launch_record(job.job_dir)
        assert record.overrides == batch[job.num]
        (attempt,) = record.attempts
        assert attempt.status == "completed" and attempt.ended >= attempt.started
        assert set(attempt.backend) == {"pid"}  # the backend's own data, kept as is
        assert (job.job_dir / ".hydra" / "overrides.yaml").exists()  # rank 0 ran the Hydra job

    # Resumed: both completed earlier, nothing starts again, the values come back.
    again = compose_jobs(launcher, batch, 0)
    backend = PoolBackend()
    results = run_jobs(again, backend, resume=True)
    assert [results[job.num].return_value for job in again] == [1.0, 2.0]
    assert backend.most_at_once == 0
