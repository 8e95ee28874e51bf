"""Resumable sweeps (ddp_launcher/resume.py, ddp_launcher/sweeper/) and the launcher's death.

First the logic without processes: what a resumed sweep does with each job dir, overrides that
do not match, attempts and retries, the sweep lock, stop signals, the Optuna trial plan. Then
real processes (slow; CPU, gloo, W&B off): a 4-job sweep, 2 jobs at a time, is the
uninterrupted reference; the same sweep is SIGKILLed at a random moment (the seed is printed;
`RESUME_SEED=<seed>` replays the kill point) or Ctrl-C'd, then resumed: no process of it
survives, only unfinished jobs start, and every job ends with the reference's weights and
metrics. Then retries, a foreign Hydra app, an Optuna study continued across a kill, and a
sweep dir the last release (b2beecb) wrote, killed mid-job: it reports and resumes.
SLURM re-attachment is in launch/tests/test_slurm.py (the one-node cluster).
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from ddp_launcher.core.errors import UserError
from ddp_launcher.core.run_dir import (
    Attempt,
    LaunchRecord,
    RunResult,
    read_launch_record,
    read_result,
    write_launch_record,
    write_result,
)
from ddp_launcher.jobs import Interrupted, Job, failed_job_return, stop_signals
from ddp_launcher.ranks.job_spec import JobSpec
from ddp_launcher.resume import (
    LOCK_FILE,
    check_job_dir,
    check_overrides,
    check_sweeper,
    close_attempt,
    continue_in_dir,
    decide,
    hold_sweep_lock,
    prepare_job,
    should_retry,
    start_attempt,
)
from ddp_launcher.sweeper.study import plan_trials
from hydra.core.utils import JobReturn, JobStatus
from omegaconf import OmegaConf

from tests.helpers import (
    REPO,
    assert_same_training,
    output,
    processes_with_env,
    rows,
    run,
    run_env,
    sigint_as_in_a_terminal,
    summary_rows,
    train_cmd,
    wait_for_no_processes,
    wait_for_rows,
)
from tests.launcher_apps.counting_task import counting_task

# ---------------------------------------------------------------------------------------------
# without processes


def job_at(
    job_dir: Path,
    num: int = 0,
    overrides: tuple[str, ...] = ("a=1",),
    resume: str | None = None,
    resume_key: str | None = "resume",
) -> Job:
    """A sweep job whose app has a `resume` key; the launcher's hook sets it (resume_key)."""
    config = OmegaConf.create(
        {"resume": resume, "a": 1, "hydra": {"launcher": {"resume_key": resume_key}}}
    )
    return Job(num, list(overrides), job_dir, JobSpec(None, config, None), in_sweep=True)


def returned(value: object) -> JobReturn:
    """Rank 0's JobReturn: completed with `value`, or failed with it when it is an error."""
    ret = JobReturn(overrides=["a=1"])
    ret.return_value = value
    ret.status = JobStatus.FAILED if isinstance(value, BaseException) else JobStatus.COMPLETED
    return ret


def checkpoint(job_dir: Path, step: int = 5) -> None:
    (job_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
    (job_dir / "checkpoints" / f"step-{step:08d}.pt").write_bytes(b"x")


def test_decide_from_a_job_dirs_records() -> None:
    """Completed (rank 0's JobReturn, or result.json for a run that left no JobReturn): done;
    an earlier attempt's SLURM job still queued or running: attach; anything else: run."""
    ran, on_slurm = Attempt(1, 1.0), Attempt(1, 1.0, backend={"slurm_job_id": "7_1"})

    def action(*, completed=False, status=None, last=ran, active=False) -> tuple[str, str]:
        result = RunResult(status=status, error="boom") if status else None
        d = decide(rank0_completed=completed, result=result, last=last, attachable=active)
        return d.action, d.why

    assert action(last=None) == ("run", "never started")
    assert action() == ("run", "stopped without a result (killed?)")
    assert action(completed=True) == ("done", "completed")  # a foreign app: no result.json
    assert action(status="completed") == ("done", "completed")
    assert action(status="failed") == ("run", "failed: boom")
    assert action(status="preempted") == ("run", "preempted")
    assert action(status="interrupted") == ("run", "interrupted")
    assert action(status="preempted", last=on_slurm, active=True)[0] == "attach"
    assert action(status="preempted", last=on_slurm, active=False)[0] == "run"
    assert action(completed=True, last=on_slurm, active=True)[0] == "done"


def test_overrides_that_do_not_match_name_both_jobs(tmp_path: Path) -> None:
    ours = ["trainer.max_epochs=2", "optim.lr=0.1", "seed=1"]
    check_overrides(3, ours, tmp_path, None)  # nothing recorded: a new dir
    check_overrides(3, ours, tmp_path, list(reversed(ours)))  # Optuna's order may differ
    with pytest.raises(UserError) as e:
        check_overrides(3, ours, tmp_path, ["trainer.max_epochs=2", "optim.lr=0.2", "seed=1"])
    assert str(e.value) == (
        f"{tmp_path} holds another job (optim.lr=0.2) than job #3 of this sweep (optim.lr=0.1): "
        "never mix two sweeps in one dir: repeat the first sweep's command line to resume it, "
        "or pass another hydra.sweep.dir"
    )
    assert "\n" not in str(e.value)


def test_prepare_decides_per_job_from_its_dir(tmp_path: Path, caplog) -> None:
    """A resumed sweep: a completed job's value comes from rank 0's JobReturn, else from
    result.json; a preempted job, one killed with its launcher and a never-started one run
    (again); attempts a dead launcher left open are settled; every job gets its attempt count
    and retries. Recorded overrides are checked first, for every job."""
    jobs = [job_at(tmp_path / str(n), n, (f"a={n}",)) for n in range(5)]
    done_ran = Attempt(1, 1.0, ended=2.0, status="completed")
    write_launch_record(jobs[0].job_dir, LaunchRecord(0, ["a=0"], [done_ran]))
    write_result(jobs[0].job_dir, RunResult(status="completed", value=0.7))
    write_launch_record(jobs[1].job_dir, LaunchRecord(1, ["a=1"], [Attempt(1, 1.0)]))
    write_result(jobs[1].job_dir, RunResult(status="preempted", error="preempted at step 5"))
    checkpoint(jobs[1].job_dir)
    (jobs[3].job_dir / ".hydra").mkdir(parents=True)  # a foreign app: Hydra's record only
    (jobs[3].job_dir / ".hydra" / "overrides.yaml").write_text("- a=3\n")
    write_launch_record(jobs[4].job_dir, LaunchRecord(4, ["a=4"], [Attempt(1, time.time())]))

    class Backend:  # what prepare asks a backend (ddp_launcher/lifecycle.py)
        @staticmethod
        def earlier_return(job: Job, _attempt: Attempt | None) -> JobReturn | None:
            return returned(33.0) if job.num == 3 else None

        @staticmethod
        def reattach(_job: Job, _attempt: Attempt) -> None:
            return None

    backend = Backend()

    def prepare(jobs: list[Job], backend: Backend, resume: bool, retries: int) -> dict:
        """What run_jobs does first: every job dir checked, then each job prepared."""
        for job in jobs:
            check_job_dir(job)
        done = {}
        for job in jobs:
            ret, _ = prepare_job(job, backend, resume=resume, retries=retries)
            if ret is not None:
                done[job.num] = ret
        return done

    caplog.set_level("INFO")
    done = prepare(jobs, resume=True, retries=2, backend=backend)
    assert {n: r.return_value for n, r in done.items()} == {0: 0.7, 3: 33.0}
    assert done[0].status == JobStatus.COMPLETED and done[0].overrides == ["a=0"]
    assert [j.attempt for j in jobs] == [1, 1, 0, 0, 1]
    assert all(j.retries_left == 2 for j in jobs)
    assert all(jobs[n].continues for n in (1, 2, 4)) and "waiting for it" not in caplog.text
    assert "#1 a=1: preempted: runs again from its checkpoints" in caplog.text
    assert "#4 a=4: stopped without a result (killed?): runs again" in caplog.text
    settled = [read_launch_record(jobs[n].job_dir).last for n in (0, 1, 4)]
    assert [(a.status, a.ended is not None) for a in settled] == [
        ("completed", True),
        ("preempted", True),
        ("interrupted", True),
    ]

    # Without resume every job runs again, with a warning for the dirs already used.
    fresh = [job_at(tmp_path / str(n), n, (f"a={n}",)) for n in range(5)]
    assert prepare(fresh, resume=False, retries=0, backend=backend) == {}
    assert not any(j.continues for j in fresh)
    assert "#0: " in caplog.text and "already holds a run of this job" in caplog.text

    # Another sweep's jobs: an error before anything runs.
    other = [job_at(tmp_path / str(n), n, (f"a={n + 1}",)) for n in range(5)]
    with pytest.raises(UserError, match="holds another job"):
        prepare(other, resume=True, retries=0, backend=backend)


def test_attempts_and_retries_are_recorded(tmp_path: Path) -> None:
    """Each attempt is a launch.json entry; a retry continues from the checkpoints
    (resume=auto); retries are counted down; a user error is never retried."""
    job = job_at(tmp_path / "0")
    job.retries_left = 1
    start_attempt(job)
    assert job.attempt == 1 and job.spec.config.resume is None  # a first attempt starts fresh
    checkpoint(job.job_dir)
    close_attempt(job, failed_job_return(job, "rank 0 (pid 9) was killed by SIGKILL"))
    assert should_retry(job, returned(RuntimeError("x")))
    assert job.retries_left == 0 and job.continues
    start_attempt(job)
    assert job.attempt == 2 and job.spec.config.resume == "auto"

    write_result(job.job_dir, RunResult(status="preempted", error="preempted at step 9"))
    close_attempt(job, returned(RuntimeError("rank 0 exited with code 75")))
    assert not should_retry(job, returned(RuntimeError("x")))  # none left

    record = read_launch_record(job.job_dir)
    assert record.job_num == 0 and record.overrides == ["a=1"]
    assert [(a.attempt, a.status, a.continued) for a in record.attempts] == [
        (1, "failed", False),
        (2, "preempted", True),
    ]
    assert record.attempts[0].error == "rank 0 (pid 9) was killed by SIGKILL"
    assert all(a.ended >= a.started for a in record.attempts)

    job.retries_left = 3
    user_error = failed_job_return(job, "bad", returned(UserError("trainer.batch_size=63 ...")))
    assert not should_retry(job, user_error) and job.retries_left == 3
    assert not should_retry(job, returned(0.9))  # completed


def test_the_resume_hook_is_opt_in_and_names_its_key(tmp_path: Path) -> None:
    """Without hydra.launcher.resume_key a job run again keeps the app's own `resume` (here a
    file it starts from, not a checkpoint of its run); with it, the named key says auto, a
    nested one too; a key the app lacks is one line."""
    pretrained = str(tmp_path / "pretrained.pt")
    job = job_at(tmp_path / "0", resume=pretrained, resume_key=None)
    continue_in_dir(job)
    assert job.continues and job.spec.config.resume == pretrained
    job = job_at(tmp_path / "1", resume=pretrained)  # resume_key: resume
    continue_in_dir(job)
    assert job.spec.config.resume == "auto"
    job = job_at(tmp_path / "2", resume_key="trainer.ckpt")
    job.spec.config.trainer = {"ckpt": None}
    continue_in_dir(job)
    assert job.spec.config.trainer.ckpt == "auto" and job.spec.config.resume is None
    job = job_at(tmp_path / "3", resume_key="resum")
    with pytest.raises(UserError, match="resume_key=resum: the app's config has no key resum"):
        continue_in_dir(job)


def test_one_launcher_per_sweep_dir(tmp_path: Path) -> None:
    """The sweep lock is an flock the kernel drops with the process; a second holder fails."""
    mine, theirs = tmp_path / "mine", tmp_path / "theirs"
    hold_sweep_lock(mine)
    hold_sweep_lock(mine)  # again in this process (another batch of the same sweep): fine
    with open(mine / LOCK_FILE) as other, pytest.raises(BlockingIOError):
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    theirs.mkdir()
    with open(theirs / LOCK_FILE, "w") as other:
        other.write("4242\n")
        other.flush()
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(UserError, match=r"in use by another launcher \(pid 4242\)"):
            hold_sweep_lock(theirs)


def test_stop_signals_interrupt_the_launcher_like_ctrl_c() -> None:
    """SIGTERM raises Interrupted (a KeyboardInterrupt) while launching; the handlers are
    restored afterwards; an ignored signal (SIGHUP under nohup) stays ignored."""
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Interrupted) as e, stop_signals([signal.SIGTERM]):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
    assert e.value.signal_name == "SIGTERM" and isinstance(e.value, KeyboardInterrupt)
    assert signal.getsignal(signal.SIGTERM) is before
    hup = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with stop_signals([signal.SIGHUP]):
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, hup)


def test_resuming_needs_the_resumable_optuna_sweeper() -> None:
    target = "hydra_plugins.hydra_optuna_sweeper.optuna_sweeper.OptunaSweeper"
    hydra_optuna = OmegaConf.create({"hydra": {"sweeper": {"_target_": target}}})
    check_sweeper(hydra_optuna, resume=False)
    with pytest.raises(UserError, match="resume with hydra/sweeper=ddp_optuna"):
        check_sweeper(hydra_optuna, resume=True)


def test_optuna_trial_plan() -> None:
    """n_trials counts every finished trial; the unfinished ones at the study's end are asked
    again first (job number = trial number); one elsewhere is marked failed."""
    done, running, waiting = "COMPLETE", "RUNNING", "WAITING"
    plan = plan_trials([(0, done), (1, done), (2, running), (3, running)], 6)
    assert (plan.rerun, plan.fail, plan.finished, plan.to_ask, plan.first_job) == (
        [2, 3],
        [],
        2,
        4,
        2,
    )
    plan = plan_trials([(0, done), (1, running), (2, done)], 3)
    assert (plan.rerun, plan.fail, plan.finished, plan.to_ask, plan.first_job) == ([], [1], 3, 0, 3)
    plan = plan_trials([(1, waiting), (0, done), (2, running)], 4)  # any order in
    assert (plan.rerun, plan.to_ask, plan.first_job) == ([1, 2], 3, 1)
    plan = plan_trials([(0, done), (1, "FAIL"), (2, "PRUNED")], 2)
    assert (plan.rerun, plan.finished, plan.to_ask, plan.first_job) == ([], 3, 0, 3)
    empty = plan_trials([], 5)
    assert (empty.rerun, empty.finished, empty.to_ask, empty.first_job) == ([], 0, 5, 0)


# A parent that starts a child which dies with it (the child touches argv[1] once set up),
# prints the child's pid, then waits.
PARENT = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import sys, time; "
                          "from ddp_launcher.ranks.lifeline import die_with_parent; "
                          "die_with_parent(); "
                          "open(sys.argv[1], 'w').close(); time.sleep(120)", sys.argv[1]],
                         env={**os.environ, "HYDRA_DDP_PARENT_PID": str(os.getpid())})
print(child.pid, flush=True)
time.sleep(120)
"""


@pytest.mark.slow
def test_a_process_dies_with_its_parent(tmp_path: Path) -> None:
    """die_with_parent (ddp_launcher/ranks/lifeline.py): a SIGKILLed parent takes the child with
    it; a
    child whose parent is already gone (it names another pid) ends itself at once."""
    tag, ready = f"pdeathsig-{os.getpid()}", tmp_path / "ready"
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(ready)],
        cwd=REPO,
        text=True,
        env=run_env(**{TAG: tag}),
        stdout=subprocess.PIPE,
    )
    child = int(parent.stdout.readline())
    deadline = time.time() + 60
    while not ready.exists():  # the child's prctl is done
        assert time.time() < deadline and parent.poll() is None
        time.sleep(0.05)
    assert os.path.exists(f"/proc/{child}") and len(processes_with_env(TAG, tag)) == 2
    parent.kill()
    parent.wait()
    assert not wait_for_no_processes(TAG, tag, timeout=10)

    orphan = subprocess.run(
        [
            sys.executable,
            "-c",
            "from ddp_launcher.ranks.lifeline import die_with_parent; "
            "die_with_parent(); print('still alive')",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env=run_env(HYDRA_DDP_PARENT_PID="1"),
    )
    assert orphan.returncode == -signal.SIGKILL and "still alive" not in orphan.stdout


def optuna_sweeper(tmp_path: Path, n_trials: int):
    """The resumable Optuna sweeper as Hydra would set it up with resume on (no launcher)."""
    import optuna
    from ddp_launcher.sweeper.sweeper import OptunaSweeperBase

    sweeper = OptunaSweeperBase(
        sampler=optuna.samplers.RandomSampler(seed=0),
        direction="maximize",
        storage=None,
        study_name="s",
        n_trials=n_trials,
        n_jobs=1,
        max_failure_rate=0.0,
        custom_search_space=None,
        params=None,
    )
    sweeper.resume, sweeper.sweep_dir = True, tmp_path
    tmp_path.mkdir(parents=True, exist_ok=True)
    sweeper.storage_spec = f"sqlite:///{tmp_path / 'optuna.db'}"
    return sweeper


def test_optuna_continues_a_stored_study(tmp_path: Path) -> None:
    """A study left with trial #0 complete and #1 running: #1 is asked again first, as job #1
    (its params kept), and n_trials=4 leaves 3 to ask; a sweep dir with jobs but no stored
    study is an error, before anything runs."""
    import optuna
    from ddp_launcher.sweeper.study import continue_study

    sweeper = optuna_sweeper(tmp_path, n_trials=4)
    impl = sweeper
    study = optuna.create_study(study_name="s", storage=impl.storage_spec, direction="maximize")
    first = study.ask()
    first.suggest_float("x", 0, 1)
    study.tell(first, 0.5)
    interrupted = study.ask()
    x = interrupted.suggest_float("x", 0, 1)
    assert continue_study(impl)
    assert (impl.n_trials, impl.job_idx) == (3, 1)
    again = optuna.load_study(study_name="s", storage=impl.storage_spec).ask()
    assert again.number == 1 and again.params == {"x": x}

    empty = optuna_sweeper(tmp_path / "empty", n_trials=4)
    assert not continue_study(empty)  # no study yet: this sweep creates it
    write_launch_record(tmp_path / "empty" / "0", LaunchRecord(0, ["x=0.1"]))
    with pytest.raises(UserError, match="holds jobs of an Optuna sweep but no study s in"):
        empty.sweep([])


# ---------------------------------------------------------------------------------------------
# real sweeps: 4 jobs, 2 at a time (22 steps an epoch, a checkpoint every 5 steps)

SWEEP = [
    "trainer.max_epochs=2",
    "trainer.batch_size=64",
    "trainer.log_every_n_steps=4",
    "trainer.checkpoint_every_n_steps=5",
    "trainer.preemption_check_every_n_steps=1",
    "model.dropout=0.1",
    "trainer.progress_bar=false",
    "wandb.mode=disabled",
    "hydra.launcher.max_parallel=2",
]
GRID = ["optim.lr=0.05,0.1", "seed=1,2"]
JOBS = range(4)
TAG = "HYDRA_DDP_TEST_SWEEP"  # every process of a test's sweep inherits it
RESUME = "hydra.launcher.resume=true"


def sweep_cmd(sweep_dir: Path, *extra: str, grid: tuple[str, ...] = tuple(GRID)) -> list[str]:
    return train_cmd("-m", f"hydra.sweep.dir={sweep_dir}", *SWEEP, *grid, *extra)


def start(cmd: list[str], log: Path, tag: str, **env: str) -> subprocess.Popen:
    """A launcher in the background, its console to `log`, tagged for the orphan check; it
    takes Ctrl-C as in a terminal, however the suite was started."""
    with open(log, "w") as f:
        return subprocess.Popen(
            cmd,
            cwd=REPO,
            env=run_env(**{TAG: tag}, **env),
            stdout=f,
            stderr=subprocess.STDOUT,
            preexec_fn=sigint_as_in_a_terminal,
        )


def logged_rows(sweep_dir: Path) -> int:
    return sum(len(rows(d)) for d in sweep_dir.glob("[0-9]*") if d.is_dir())


def status(job_dir: Path) -> str | None:
    result = read_result(job_dir)
    return result.status if result is not None else None


def attempts(job_dir: Path) -> list[Attempt]:
    record = read_launch_record(job_dir)
    return record.attempts if record is not None else []


def has_step_checkpoint(job_dir: Path) -> bool:
    return any((job_dir / "checkpoints").glob("step-*.pt"))


@pytest.fixture(scope="module")
def rng() -> random.Random:
    seed = int(os.environ.get("RESUME_SEED", random.SystemRandom().randrange(10**6)))
    print(f"\nsweep kill points drawn with RESUME_SEED={seed}")
    return random.Random(seed)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sweep, uninterrupted."""
    sweep_dir = tmp_path_factory.mktemp("reference") / "sweep"
    proc = run(sweep_cmd(sweep_dir))
    assert proc.returncode == 0, output(proc)[-5000:]
    assert all(status(sweep_dir / str(n)) == "completed" for n in JOBS)
    return sweep_dir


def assert_resumed_like_the_reference(
    sweep_dir: Path, reference: Path, checkpointed: set[int]
) -> None:
    """Every job ends as the uninterrupted sweep's did; the jobs that had checkpoints when
    they were stopped continued from one (in the same dir, as a new attempt)."""
    for n in JOBS:
        job = sweep_dir / str(n)
        assert status(job) == "completed", (n, read_result(job))
        assert_same_training(job, reference / str(n))
        if n in checkpointed:
            assert "resumed from" in (job / "train.log").read_text(), n
            assert attempts(job)[-1].continued, attempts(job)
    table = {r["job"]: r for r in summary_rows(sweep_dir)}
    assert sorted(table) == [str(n) for n in JOBS]
    assert all(r["status"] == "completed" for r in table.values()), table
    assert [int(table[str(n)]["attempts"]) for n in JOBS] == [
        len(attempts(sweep_dir / str(n))) for n in JOBS
    ]


@pytest.mark.slow
@pytest.mark.parametrize("kill_at", ["drawn", "first_row"])
def test_sigkill_of_the_launcher_then_resume(
    reference: Path, rng: random.Random, tmp_path: Path, kill_at: str
) -> None:
    """SIGKILL the launcher once the sweep has logged a random number of its metric rows: no
    process of the sweep survives; the resumed sweep starts exactly the jobs that had not
    completed, the killed ones continue from their checkpoints, and every job's weights and
    metrics equal the uninterrupted sweep's."""
    total = logged_rows(reference)
    # A row of the sweep with a whole job's rows still to come: at least one job unfinished
    # when the kill lands (a later target could let the last job end in the kill's latency).
    # Beside the drawn kill point, a fixed one: after the first row of both running jobs (step
    # 4), before any checkpoint (step 5, where their ranks stall until the kill): they start
    # over and must not append to the killed rows.
    target = rng.randrange(1, total - total // len(JOBS)) if kill_at == "drawn" else 2
    jitter = rng.uniform(0.0, 0.2) if kill_at == "drawn" else 0.0
    fault = {} if kill_at == "drawn" else {"HYDRA_DDP_FAULT": "stall@5"}
    sweep_dir, tag = tmp_path / "sweep", f"sigkill-{os.getpid()}-{target}"
    launcher = start(sweep_cmd(sweep_dir, RESUME), tmp_path / "killed.log", tag, **fault)
    try:
        deadline = time.time() + 300
        while logged_rows(sweep_dir) < target:
            assert launcher.poll() is None, (tmp_path / "killed.log").read_text()[-3000:]
            assert time.time() < deadline, f"the sweep never logged {target} rows"
            time.sleep(0.02)
        time.sleep(jitter)
        launcher.kill()
    finally:
        launcher.kill()
        launcher.wait()
    print(
        f"SIGKILL at {logged_rows(sweep_dir)} of the sweep's {total} rows "
        f"(target {target}, +{jitter:.2f} s)"
    )
    survivors = wait_for_no_processes(TAG, tag, timeout=30)
    assert not survivors, "processes of the killed sweep survive:\n" + "\n".join(survivors)

    before = {n: len(attempts(sweep_dir / str(n))) for n in JOBS}
    unfinished = {n for n in JOBS if status(sweep_dir / str(n)) != "completed"}
    checkpointed = {n for n in unfinished if has_step_checkpoint(sweep_dir / str(n))}
    print(f"unfinished jobs {sorted(unfinished)}, with checkpoints {sorted(checkpointed)}")
    assert unfinished, "every job had completed: the kill came too late"
    assert kill_at == "drawn" or not checkpointed, "the fixed kill point came after a checkpoint"

    resumed = run(sweep_cmd(sweep_dir, RESUME))
    assert resumed.returncode == 0, output(resumed)[-5000:]
    started = {n for n in JOBS if len(attempts(sweep_dir / str(n))) > before[n]}
    assert started == unfinished, (started, unfinished)
    assert all(len(attempts(sweep_dir / str(n))) == before[n] + 1 for n in started)
    for n in set(JOBS) - unfinished:
        assert f"#{n} " in output(resumed) and "completed earlier, not run again" in output(resumed)
    assert_resumed_like_the_reference(sweep_dir, reference, checkpointed)


@pytest.mark.slow
def test_ctrl_c_stops_the_jobs_at_a_checkpoint_then_resume(reference: Path, tmp_path: Path) -> None:
    """SIGINT (Ctrl-C) of a sweep started without resume: the launcher stops its running jobs
    as preemption does and exits non-zero within seconds, with one line; the job dirs say
    preempted (or interrupted, for a job still starting) and nothing survives; resuming ends
    with the uninterrupted sweep's weights and metrics."""
    sweep_dir, tag, log = tmp_path / "sweep", f"sigint-{os.getpid()}", tmp_path / "stopped.log"
    # The running jobs' ranks wait at step 13 until the stop reaches them (a job of 44 steps
    # takes about a second: on a loaded machine the sweep could end before the SIGINT lands).
    launcher = start(sweep_cmd(sweep_dir), log, tag, HYDRA_DDP_FAULT="stall@13")
    try:
        wait_for_rows(sweep_dir / "0" / "metrics.jsonl", 3, launcher)  # job #0 is at step 12
        stopped_at = time.time()
        launcher.send_signal(signal.SIGINT)
        code = launcher.wait(timeout=120)
        took = time.time() - stopped_at
    finally:
        launcher.kill()
        launcher.wait()
    out = log.read_text()
    print(f"the launcher exited {took:.1f} s after SIGINT")
    assert code != 0 and took < 60, out[-3000:]
    assert "the sweep was stopped (SIGINT)" in out and "hydra.launcher.resume=true" in out
    assert "Traceback" not in out, out[-5000:]
    survivors = wait_for_no_processes(TAG, tag, timeout=30)
    assert not survivors, "processes of the stopped sweep survive:\n" + "\n".join(survivors)

    stopped = {n for n in JOBS if attempts(sweep_dir / str(n))}
    assert 0 in stopped
    assert status(sweep_dir / "0") == "preempted", read_result(sweep_dir / "0")
    for n in stopped:
        last = attempts(sweep_dir / str(n))[-1]
        # the other job may finish its last steps in the moment the stop takes to reach it
        finished = ("completed",) if n != 0 else ()
        assert (
            last.status == status(sweep_dir / str(n)) in ("preempted", "interrupted", *finished)
        ), n
        assert last.ended is not None
    checkpointed = {
        n
        for n in stopped
        if status(sweep_dir / str(n)) != "completed" and has_step_checkpoint(sweep_dir / str(n))
    }
    assert 0 in checkpointed  # preempted: it saved its stop step

    resumed = run(sweep_cmd(sweep_dir, RESUME))
    assert resumed.returncode == 0, output(resumed)[-5000:]
    assert_resumed_like_the_reference(sweep_dir, reference, checkpointed)


@pytest.mark.slow
def test_retries_rerun_a_failed_job_from_its_checkpoints(reference: Path, tmp_path: Path) -> None:
    """hydra.launcher.retries=1, each job's rank SIGKILLed at step 7 of its first attempt
    (after the step-5 checkpoint): both jobs are started again, continue from step 5 and end
    as the uninterrupted sweep's jobs #0 and #1 (the same overrides); two attempts each, in
    launch.json and the summary."""
    sweep_dir = tmp_path / "sweep"
    proc = run(
        sweep_cmd(sweep_dir, "hydra.launcher.retries=1", grid=("optim.lr=0.05", "seed=1,2")),
        HYDRA_DDP_FAULT="kill@7",
    )
    out = output(proc)
    assert proc.returncode == 0, out[-5000:]
    for n in (0, 1):
        job = sweep_dir / str(n)
        assert read_launch_record(job).overrides == read_launch_record(reference / str(n)).overrides
        first, second = attempts(job)
        assert (first.status, second.status, second.continued) == ("failed", "completed", True)
        assert "was killed by SIGKILL" in first.error, first
        assert f"#{n}: attempt 1 did not complete; retrying from its checkpoints" in out
        assert "resumed from" in (job / "train.log").read_text()
        assert_same_training(job, reference / str(n))
    assert [r["attempts"] for r in summary_rows(sweep_dir)] == ["2", "2"]


@pytest.mark.slow
def test_a_foreign_app_resumes_with_its_recorded_values(
    hydra_sweep_runner, tmp_path: Path, monkeypatch
) -> None:
    """Hydra's test app (no result.json, no checkpoints) with our task function: the resumed
    sweep runs only the job that failed, and the sweeper gets every job's value, the earlier
    ones from rank 0's recorded JobReturn."""
    calls = tmp_path / "calls.log"
    monkeypatch.setenv("RESUME_TEST_CALLS", str(calls))

    def sweep():
        return hydra_sweep_runner(
            calling_file=None,
            calling_module="hydra.test_utils.a_module",
            task_function=counting_task,
            config_path="configs",
            config_name="compose.yaml",
            overrides=["hydra/launcher=torchrun", RESUME, "+a=0,1,2"],
            temp_dir=tmp_path / "sweep",
        )

    with pytest.raises(Exception, match="a transient failure"), sweep():
        pass
    assert calls.read_text().split() == ["0", "1", "2"]
    calls.with_suffix(".ok").touch()
    with sweep() as resumed:
        (returns,) = resumed.returns
        assert [r.return_value for r in returns] == [0, 10, 20]
        assert [r.overrides for r in returns] == [["+a=0"], ["+a=1"], ["+a=2"]]
        assert all(r.status == JobStatus.COMPLETED for r in returns)
    assert calls.read_text().split() == ["0", "1", "2", "1"]


def study_trials(sweep_dir: Path) -> list:
    import optuna

    storage = f"sqlite:///{sweep_dir / 'optuna.db'}"
    return optuna.load_study(study_name="digits", storage=storage).trials


@pytest.mark.slow
def test_optuna_resume_keeps_the_trial_count(tmp_path: Path) -> None:
    """An Optuna sweep (3 trials, one at a time, resumable: its study in <sweep dir>/optuna.db)
    SIGKILLed during trial #1: the rerun keeps trial #0, runs the interrupted trial again in
    its own job dir, from its checkpoint, and asks one new trial: 3 in all; another rerun
    runs nothing and the count stays 3."""
    sweep_dir, tag = tmp_path / "optuna", f"optuna-{os.getpid()}"
    cmd = train_cmd(
        f"hydra.sweep.dir={sweep_dir}",
        "hparams_search=digits_optuna",
        RESUME,
        "hydra.sweeper.n_trials=3",
        "hydra.sweeper.n_jobs=1",
        "trainer.max_epochs=1",
        "trainer.log_every_n_steps=1",
        "trainer.checkpoint_every_n_steps=3",
        "trainer.progress_bar=false",
        "wandb.mode=disabled",
    )
    launcher = start(cmd, tmp_path / "killed.log", tag)
    try:
        # step 4: checkpoint 3 (trial #0 runs first: up to minutes on a busy machine)
        wait_for_rows(sweep_dir / "1" / "metrics.jsonl", 4, launcher, timeout=900)
        launcher.kill()
    finally:
        launcher.kill()
        launcher.wait()
    assert not wait_for_no_processes(TAG, tag, timeout=30)
    assert read_result(sweep_dir / "1") is None, "trial #1 ended before the kill"
    assert [t.state.name for t in study_trials(sweep_dir)] == ["COMPLETE", "RUNNING"]

    resumed = run(cmd)
    out = output(resumed)
    assert resumed.returncode == 0, out[-5000:]
    assert "1 trial(s) finished, 1 to run again, 2 to ask" in out
    trials = study_trials(sweep_dir)
    assert [(t.number, t.state.name) for t in trials] == [(n, "COMPLETE") for n in range(3)]
    assert sorted(p.name for p in sweep_dir.glob("[0-9]*")) == ["0", "1", "2"]
    assert [len(attempts(sweep_dir / str(n))) for n in range(3)] == [1, 2, 1]
    assert attempts(sweep_dir / "1")[-1].continued
    assert "resumed from" in (sweep_dir / "1" / "train.log").read_text()
    for trial in trials:  # each trial in its own job dir, with its value
        overrides = read_launch_record(sweep_dir / str(trial.number)).overrides
        assert {f"{k}={v}" for k, v in trial.params.items()} <= set(overrides), trial.number
        assert trial.value == pytest.approx(read_result(sweep_dir / str(trial.number)).value)

    # the sweeper got each job's return value (rank 0's best val/acc) and reports the best
    best_accs = [read_result(sweep_dir / str(n)).app["best_val_acc"] for n in range(3)]
    optimization = yaml.safe_load((sweep_dir / "optimization_results.yaml").read_text())
    assert optimization["best_value"] == pytest.approx(max(best_accs))
    best = read_launch_record(sweep_dir / str(best_accs.index(max(best_accs)))).overrides
    for key, value in optimization["best_params"].items():
        (given,) = [o.split("=", 1)[1] for o in best if o.split("=", 1)[0] == key]
        assert float(given) == pytest.approx(float(value)), key
    assert len(summary_rows(sweep_dir)) == 3

    again = run(cmd)
    assert again.returncode == 0, output(again)[-5000:]
    assert "3 trial(s) finished, 0 to run again, 0 to ask" in output(again)
    assert len(study_trials(sweep_dir)) == 3
    assert [len(attempts(sweep_dir / str(n))) for n in range(3)] == [1, 2, 1]


# ---------------------------------------------------------------------------------------------
# a sweep dir the last release wrote
#
# tests/data/sweep_b2beecb: a 3-job sweep run by b2beecb (the release before the records,
# result.json, launch.json and Hydra/torch changes that followed), its launcher SIGKILLed once
# job 2 held a step checkpoint; jobs 0 and 1 had completed. Made with
#   git worktree add --detach /tmp/b2beecb-tree b2beecb && cd /tmp/b2beecb-tree
#   python train.py -m <OLD_SWEEP_ARGS below> hydra.sweep.dir=multirun/sweep_b2beecb &
#   # SIGKILL that launcher once multirun/sweep_b2beecb/2/checkpoints/step-*.pt exists
# (OMP_NUM_THREADS=1, on CPU), then copied without what neither the report nor a resume reads
# (rank_logs/, repro/, .torchrun/job.pkl, the completed jobs' checkpoints). Its records name
# /tmp/b2beecb-tree, where it ran; the test runs it from another dir.
OLD_SWEEP = REPO / "tests" / "data" / "sweep_b2beecb"
OLD_SWEEP_ARGS = [
    "trainer.max_epochs=2",
    "trainer.batch_size=32",
    "model.channels=[8,16]",
    "model.hidden=32",
    "trainer.log_every_n_steps=4",
    "trainer.checkpoint_every_n_steps=5",
    "trainer.progress_bar=false",
    "wandb.mode=disabled",
    "optim.lr=0.05,0.1,0.2",
]


@pytest.mark.slow
def test_a_sweep_dir_of_the_last_release_reports_and_resumes(tmp_path: Path) -> None:
    """The old sweep dir reports (every job listed, the killed one not completed), and resumes
    with its command line: the completed jobs are not run again (result.json and metrics.jsonl
    keep their bytes, one attempt each), the killed job continues from its last checkpoint to
    completion, keeping its rows up to it, each step once; the summary lists every job
    completed."""
    sweep_dir = tmp_path / "sweep"
    shutil.copytree(OLD_SWEEP, sweep_dir)
    done, killed = (0, 1), sweep_dir / "2"
    kept = {
        (n, name): (sweep_dir / str(n) / name).read_bytes()
        for n in done
        for name in ("result.json", "metrics.jsonl", "launch.json")
    }
    assert status(killed) is None and attempts(killed)[-1].ended is None  # as it was left
    killed_rows = (killed / "metrics.jsonl").read_text().splitlines()

    report = run([sys.executable, "-m", "ddp_launcher.report", str(sweep_dir)])
    assert report.returncode == 0, output(report)[-5000:]
    table = {r["job"]: r["status"] for r in summary_rows(sweep_dir)}
    assert table.keys() == {"0", "1", "2"}, table
    assert [table["0"], table["1"]] == ["completed", "completed"] and table["2"] != "completed"
    printed = {line.split()[0] for line in report.stdout.splitlines() if line[:1].isdigit()}
    assert printed >= {"0", "1", "2"}, report.stdout

    resumed = run(train_cmd("-m", f"hydra.sweep.dir={sweep_dir}", *OLD_SWEEP_ARGS, RESUME))
    assert resumed.returncode == 0, output(resumed)[-5000:]
    for (n, name), before in kept.items():
        if name != "launch.json":
            assert (sweep_dir / str(n) / name).read_bytes() == before, (n, name)
        assert f"#{n} " in output(resumed), output(resumed)[-3000:]
        assert len(attempts(sweep_dir / str(n))) == 1, attempts(sweep_dir / str(n))
    assert output(resumed).count("completed earlier, not run again") == len(done)

    assert status(killed) == "completed", read_result(killed)
    assert [a.status for a in attempts(killed)] == ["interrupted", "completed"]
    assert attempts(killed)[-1].continued
    assert "resumed from" in (killed / "train.log").read_text()
    steps = [r["step"] for r in rows(killed) if "train/loss" in r]
    assert steps == [r["step"] for r in rows(sweep_dir / "0") if "train/loss" in r]  # each once
    lines = (killed / "metrics.jsonl").read_text().splitlines()
    before_ckpt = [line for line in killed_rows if json.loads(line)["step"] <= 15]
    assert lines[: len(before_ckpt)] == before_ckpt  # the rows up to step-00000015.pt kept

    table = {r["job"]: r for r in summary_rows(sweep_dir)}
    assert table.keys() == {"0", "1", "2"}, table
    assert all(r["status"] == "completed" for r in table.values()), table
    assert [table[n]["attempts"] for n in ("0", "1", "2")] == ["1", "1", "2"]
