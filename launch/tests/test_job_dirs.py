"""One job dir, one job, and a sweep's start that fails closed (issue 65, items 1 and 3), through
ddp_launcher/lifecycle.py's run_jobs with a backend whose attempts end at once (no process):
two jobs that would share a dir are refused before any starts; a subdir that does not resolve
is one line; a job whose start fails inside its guard (ENOSPC at its launch.json) is undone
and fails alone while the others run; the sweep's lock file is a lock file and nothing else;
and a sweep refused before any job ran leaves multirun.yaml and .launcher.lock as they were.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from ddp_launcher.core.errors import UserError
from ddp_launcher.core.gate import remember_sweep_start
from ddp_launcher.jobs import Job, compose_jobs
from ddp_launcher.lifecycle import run_jobs, undone_if_refused
from ddp_launcher.ranks.job_spec import job_return
from ddp_launcher.resume import LOCK_FILE, hold_sweep_lock, release_sweep_lock
from hydra.core.utils import JobStatus

from tests.os_faults import failing
from tests.test_gate_faults import tree


class EndsAtOnce:
    """A Backend whose attempts complete as soon as they start, each worth its job number."""

    poll_s = 0.0
    holds_job_dirs = True

    def __init__(self) -> None:
        self.started: list[int] = []

    def place(self, job: Job) -> None:
        job.nproc, job.nnodes, job.uses_gpus = 1, 1, False

    def reserve(self, job: Job) -> bool:
        return True

    def release(self, job: Job, slot: bool) -> None:
        pass

    def start(self, batch: list[tuple[Job, bool]]) -> list[Job]:
        self.started += [job.num for job, _ in batch]
        return [job for job, _ in batch]

    def record(self, handle: Any) -> None:
        return None

    def ended(self, handles: list[Job]) -> list[Job]:
        return handles

    def outcome(self, job: Job, handle: Any) -> Any:
        return job_return(job, JobStatus.COMPLETED, float(job.num))

    def stop(self, running: list, why: str) -> None:
        pass

    def earlier_return(self, job: Job, attempt: Any) -> None:
        return None

    def reattach(self, job: Job, attempt: Any) -> None:
        return None


def sweep_jobs(train_config, sweep_dir: Path, batch: list[list[str]], *overrides: str):
    master = train_config.multirun(
        f"hydra.sweep.dir={sweep_dir}", "wandb.mode=disabled", *overrides
    )
    launcher = SimpleNamespace(
        config=master, hydra_context=train_config.context, task_function=lambda cfg: None
    )
    return compose_jobs(launcher, batch, 0)


def test_two_jobs_sharing_a_dir_are_refused_before_any_starts(train_config, tmp_path) -> None:
    sweep_dir = tmp_path / "sweep"
    batch = [["optim.lr=0.05"], ["optim.lr=0.1"]]
    jobs = sweep_jobs(train_config, sweep_dir, batch, "hydra.sweep.subdir=s${seed}")
    backend = EndsAtOnce()
    with pytest.raises(UserError, match=r"jobs #0 \(optim.lr=0.05\) and #1 \(optim.lr=0.1\)"):
        run_jobs(jobs, backend)
    assert backend.started == [] and not sweep_dir.exists()
    with pytest.raises(UserError, match="would write into the sweep dir"):
        run_jobs(sweep_jobs(train_config, sweep_dir, batch[:1], "hydra.sweep.subdir=."), backend)
    # across batches too: a later batch's job meets the dirs of the earlier ones
    claimed: dict = {}
    run_jobs(
        sweep_jobs(train_config, sweep_dir, batch[:1], "hydra.sweep.subdir=s${seed}"),
        backend,
        claimed=claimed,
    )
    later = sweep_jobs(train_config, sweep_dir, [["optim.lr=0.2"]], "hydra.sweep.subdir=s${seed}")
    later[0].num = 1
    with pytest.raises(UserError, match="would share the job dir"):
        run_jobs(later, backend, claimed=claimed)


def test_a_subdir_resolves_as_hydra_resolves_it_or_is_one_line(train_config, tmp_path) -> None:
    batch = [["model=small_cnn"], ["model=resnet18"]]
    jobs = sweep_jobs(
        train_config, tmp_path, batch, "hydra.sweep.subdir=${hydra:runtime.choices.model}"
    )
    assert [job.job_dir.name for job in jobs] == ["small_cnn", "resnet18"]
    with pytest.raises(UserError, match=r"hydra.sweep.subdir=\$\{model\} does not resolve") as e:
        sweep_jobs(train_config, tmp_path, batch, "hydra.sweep.subdir=${model}")
    assert "\n" not in str(e.value)


def test_a_job_whose_start_fails_is_undone_and_fails_alone(train_config, tmp_path) -> None:
    """ENOSPC at job #0's launch.json: #0 fails with one line naming the step and the cause,
    its dir not there (nothing written for it: no result.json); #1 runs."""
    sweep_dir = tmp_path / "sweep"
    jobs = sweep_jobs(train_config, sweep_dir, [["seed=1"], ["seed=2"]])
    backend = EndsAtOnce()
    with failing(f"ENOSPC@open@{sweep_dir}/0/*launch.json*"):
        results = run_jobs(jobs, backend)
    assert backend.started == [1]
    assert results[1].status == JobStatus.COMPLETED
    assert results[0].status == JobStatus.FAILED
    reason = str(results[0]._return_value)
    assert "recording the attempt (launch.json)" in reason and os.strerror(errno.ENOSPC) in reason
    assert "\n" not in reason
    assert not (sweep_dir / "0").exists()
    assert (sweep_dir / "1" / "launch.json").is_file()


def test_the_sweep_lock_is_only_a_lock(tmp_path) -> None:
    """.launcher.lock as a symlink (to a user's file) or a directory is refused in one line,
    the user's file unchanged; without flock, one line naming the opt-out."""
    users = tmp_path / "users.txt"
    users.write_text("precious\n")
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / LOCK_FILE).symlink_to(users)
    with pytest.raises(UserError, match="is a symlink"):
        hold_sweep_lock(linked)
    assert users.read_text() == "precious\n"
    a_dir = tmp_path / "a_dir"
    (a_dir / LOCK_FILE).mkdir(parents=True)
    with pytest.raises(UserError, match="is a directory"):
        hold_sweep_lock(a_dir)
    nfs = tmp_path / "nfs"
    with failing(f"ENOLCK@flock@{nfs}/{LOCK_FILE}"), pytest.raises(UserError, match="KEY=false"):
        hold_sweep_lock(nfs, opt_out="KEY=false")
    assert list(nfs.iterdir()) == []


def test_a_sweep_refused_before_any_job_ran_is_undone(tmp_path) -> None:
    """What the sweeper and the launcher wrote before the refusal (multirun.yaml rewritten,
    .launcher.lock naming this launcher, a summary) is as on_multirun_start found it; a
    refusal of another type is one line; once a job started, nothing is undone."""
    sweep_dir = tmp_path / "sweep"
    (sweep_dir / "0").mkdir(parents=True)
    (sweep_dir / "multirun.yaml").write_text("the first sweep's\n")
    (sweep_dir / LOCK_FILE).write_text("4242\n")
    before = tree(tmp_path)
    remember_sweep_start(sweep_dir)
    with pytest.raises(UserError, match="on_drift"), undone_if_refused(sweep_dir):
        (sweep_dir / "multirun.yaml").write_text("this sweep's\n")
        hold_sweep_lock(sweep_dir)
        (sweep_dir / "summary.csv").write_text("job\n")
        raise UserError("#0: changed since its first attempt: on_drift=refuse")
    assert tree(tmp_path) == before
    fresh = tmp_path / "fresh" / "sweep"
    remember_sweep_start(fresh)
    failed = r"sweep's start failed: .*Permission denied"
    with pytest.raises(UserError, match=failed) as e, undone_if_refused(fresh):
        fresh.mkdir(parents=True)
        hold_sweep_lock(fresh)
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(fresh / "x"))
    assert "the sweep dir is as it was" in str(e.value) and not (tmp_path / "fresh").exists()
    release_sweep_lock(sweep_dir)
    release_sweep_lock(fresh)
