"""Sweep control (issue 57): hydra.launcher.fail_fast, code and config drift across a resume,
and the sweep's status line.

Without processes: the status line's counts and ETA, and what a drift line names. Then real
sweeps (slow; CPU, gloo, W&B off), 4 jobs 2 at a time, job #0's ranks waiting at step 13 until
a stop reaches them and job #1 raising at step 15 (per-job faults, first attempts only): with
fail_fast the sweep ends there, jobs #2 and #3 never start, job #0 is recorded `interrupted`
with its checkpoint; the sweep runs in a git repository of its own (a copy of this one), a
commit lands before the resume, and the resumed sweep names the commit change once for each job
it runs again, completes, and its report shows each job's commit. The same under the Optuna
sweeper and on SLURM (tests/slurm_cluster.py's one-node cluster). The status line on a
terminal (a pty) and without one.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pty
import re
import select
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

import pytest
import test_resume
from ddp_launcher import drift as drift_module
from ddp_launcher.core.run_dir import read_launch_record, read_result
from ddp_launcher.drift import changes, drift_line, flat_config
from ddp_launcher.progress import ERASE_LINE, SweepProgress
from omegaconf import OmegaConf

from tests.helpers import REPO, output, run, run_env, summary_rows, train_cmd

if TYPE_CHECKING:
    from tests.slurm_cluster import SlurmCluster

pytest_plugins = ["tests.slurm_cluster"]

# ---------------------------------------------------------------------------------------------
# without processes


def test_status_line_counts_and_eta() -> None:
    """Counts move with starts and ends; the ETA is the finished jobs' mean wall time times the
    rounds of `parallel` jobs left (running ones half done); a pipe gets one log line per
    change, never a control character."""
    stream = io.StringIO()
    progress = SweepProgress(total=5, parallel=2, stream=stream)
    assert not progress.live
    assert progress.line() == "sweep: 0 done, 0 running, 0 failed, 5 pending"
    progress.started()
    progress.started()
    progress.ended(failed=False, wall_s=10.0)
    # 3 pending + 1 running / 2 = 3.5 jobs, 2 at a time: 1.75 rounds of 10 s
    assert progress.line() == "sweep: 1 done, 1 running, 0 failed, 3 pending, ETA 17.5s"
    progress.ended(failed=True, wall_s=30.0)
    assert progress.line() == "sweep: 1 done, 0 running, 1 failed, 3 pending, ETA 30.0s"
    progress.ended(failed=False, ran=False)  # completed earlier (a resumed sweep)
    assert progress.line().startswith("sweep: 2 done, 0 running, 1 failed, 2 pending")
    progress.draw()
    progress.close()
    assert stream.getvalue() == ""  # not a terminal: the lines went to the log


def test_status_line_on_a_terminal_is_redrawn_in_place() -> None:
    """On a pty the line is drawn after an erase-line, redrawn only when it changes, and left
    on a line of its own at the end."""
    master, slave = pty.openpty()
    with open(slave, "w") as terminal:
        progress = SweepProgress(total=2, parallel=1, stream=terminal)
        assert progress.live
        progress.started()
        progress.draw()  # unchanged: not drawn again
        progress.ended(failed=False, wall_s=4.0)
        progress.close()
    # (the pty hands its bytes over in pieces when the machine is busy: read until it is quiet)
    seen = b""
    while select.select([master], [], [], 1.0)[0]:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # EIO: the terminal's side is closed and everything was read
            break
        if not chunk:
            break
        seen += chunk
    os.close(master)
    assert seen.decode() == (
        f"{ERASE_LINE}sweep: 0 done, 1 running, 0 failed, 1 pending"
        f"{ERASE_LINE}sweep: 1 done, 0 running, 0 failed, 1 pending, ETA 4.0s\r\n"
    )


def test_a_drift_line_names_the_commit_the_diff_and_the_keys() -> None:
    before = {"commit": "a" * 40, "dirty": False, "diff_sha256": None, "config_sha256": "1"}
    now = {"commit": "b" * 40, "dirty": True, "diff_sha256": "d", "config_sha256": "2"}
    old = {"optim.lr": "0.1", "seed": "1"}
    new = {"optim.lr": "0.2", "seed": "1", "model.width": "8"}
    assert changes(before, now, old, new) == [
        "commit aaaaaaaa→bbbbbbbb",
        "uncommitted changes (clean→dirty)",
        "config model.width, optim.lr",
    ]
    assert changes(before, dict(before), old, dict(old)) == []
    # how a job starts is not what it runs: resume=auto on a resumed job is no drift
    config = OmegaConf.create({"resume": "auto", "start_over": False, "a": {"b": 1}, "hydra": {}})
    assert flat_config(config) == {"a.b": "1"}
    record = SimpleNamespace(attempts=[SimpleNamespace(code=None)], config=None)
    job = SimpleNamespace(num=0, overrides=[], spec=SimpleNamespace(config=config))
    assert drift_line(job, record) is None  # a record older than the code entries


def git_commit(repo: Path, message: str) -> str:
    ident = ["-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run(["git", "add", "."], cwd=repo, check=True)
    subprocess.run(["git", *ident, "commit", "-qm", message], cwd=repo, check=True)
    return subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, check=True
    ).stdout.strip()


def test_drift_reads_the_apps_repository_not_the_packages(tmp_path, monkeypatch) -> None:
    """The code an attempt records (launch.json's `code`) is the app's: git runs in the folder
    of the task's module, else in Hydra's runtime cwd; never in this package's folder, which,
    installed from a wheel, is no repository of the app's (launch/tests/fresh_venv.sh checks
    that install). A commit to the app between a sweep and its resume is a drift line."""
    from ddp_launcher.core import repro
    from ddp_launcher.jobs import Job
    from ddp_launcher.ranks.job_spec import JobSpec
    from ddp_launcher.resume import start_attempt
    from hydra.utils import instantiate  # a function of an installed package

    monkeypatch.delenv(repro.CODE_DIR_ENV, raising=False)
    app = tmp_path / "app"
    app.mkdir()
    (app / "drift_app_task.py").write_text("def main(cfg):\n    return 0\n")
    subprocess.run(["git", "init", "-q"], cwd=app, check=True)
    first = git_commit(app, "one")
    monkeypatch.syspath_prepend(str(app))
    import drift_app_task

    config = OmegaConf.create({"lr": 0.1, "hydra": {"runtime": {"cwd": str(app)}}})
    spec = JobSpec(drift_app_task.main, config, None)
    job = Job(0, ["lr=0.1"], tmp_path / "sweep" / "0", spec, in_sweep=True)
    drift_module.code_state.cache_clear()
    start_attempt(job)
    record = read_launch_record(job.job_dir)
    assert record.attempts[0].code["commit"] == first
    (app / "drift_app_task.py").write_text("def main(cfg):\n    return 1\n")
    second = git_commit(app, "two")
    drift_module.code_state.cache_clear()  # (a resumed sweep: another launcher process)
    line = drift_line(job, record)
    assert line is not None and f"commit {first[:8]}→{second[:8]}" in line, line
    # a task of an installed package: Hydra's runtime cwd, the app's repository too
    assert repro.task_code_dir(instantiate, config) == app
    assert repro.task_code_dir(drift_app_task.main) == app.resolve()


# ---------------------------------------------------------------------------------------------
# real sweeps

# launch/tests/test_resume.py's sweep (22 steps an epoch, a checkpoint every 5), parallelism its own
SWEEP = [o for o in test_resume.SWEEP if not o.startswith("hydra.launcher.max_parallel")]
GRID = test_resume.GRID
FAIL_FAST = "hydra.launcher.fail_fast=true"
RESUME = "hydra.launcher.resume=true"
# job #0 waits at step 13 until the launcher stops it; job #1 raises at step 15
FAULTS = {"HYDRA_DDP_FAULT": "stall@13/0,raise@15/1"}


def git(repo: Path, *args: str) -> str:
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@t",
        "GIT_COMMITTER_NAME": "t",
    }
    env["GIT_COMMITTER_EMAIL"] = "t@t"
    return subprocess.run(
        ["git", *args], cwd=repo, env=env, check=True, capture_output=True, text=True
    ).stdout.strip()


def repo_copy(root: Path) -> Path:
    """This repository's tracked files as they are now, committed into a git repo of its own."""
    files = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, check=True, capture_output=True, text=True
    ).stdout.split("\0")
    for name in filter(None, files):
        if (REPO / name).is_file():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, root / name)
    git(root, "init", "-q")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "base")
    return root


def in_copy(repo: Path, cmd: list[str], **env: str) -> subprocess.CompletedProcess:
    return run(
        cmd,
        cwd=repo,
        PYTHONPATH=os.pathsep.join([str(repo), str(repo / "launch")]),
        PYTHONDONTWRITEBYTECODE="1",
        **env,
    )


def tree_digest(path: Path) -> dict[str, str]:
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


def check_stopped_at_the_failure(sweep_dir: Path, out: str, code: int) -> None:
    """Job #1 failed, job #0 stopped at a checkpoint (`interrupted`), #2 and #3 never started;
    one line says so and how to continue; the summary names the failed job and why."""
    assert code != 0, out[-5000:]
    assert "Traceback" not in out, out[-5000:]
    assert re.search(r"hydra\.launcher\.fail_fast: job #1 \(.*\) failed: .*injected fault", out)
    assert "hydra.launcher.resume=true to continue the sweep" in out
    assert not (sweep_dir / "2").exists() and not (sweep_dir / "3").exists(), "started after #1"
    stopped = read_result(sweep_dir / "0")
    assert stopped.status == "interrupted", stopped
    assert stopped.error.startswith("interrupted (fail_fast: job #1 failed) at step 13"), stopped
    assert any((sweep_dir / "0" / "checkpoints").glob("step-*.pt"))
    assert read_launch_record(sweep_dir / "0").last.status == "interrupted"
    failed = read_result(sweep_dir / "1")
    assert failed.status == "failed" and "injected fault at step 15" in failed.error
    rows = {r["job"]: r for r in summary_rows(sweep_dir)}
    assert sorted(rows) == ["0", "1"] and rows["1"]["status"] == "failed"
    headline = next(line for line in out.splitlines() if line.startswith("Sweep summary:"))
    assert "fail_fast: job #1" in headline and "injected fault" in headline, headline


@pytest.mark.slow
def test_fail_fast_then_resume_after_a_commit(tmp_path: Path) -> None:
    """The sweep stops at job #1's failure (see check_stopped_at_the_failure), its console
    (a pipe) has a plain status line per change; a commit lands; on_drift=refuse then refuses
    in one line, exit 2, the sweep dir unchanged; the resume names the commit change once per
    job it runs again (#0, #1), completes every job, and result.json, summary.csv and
    `python -m ddp_launcher.report` show each job's commit, the sweep flagged as mixing two."""
    repo = repo_copy(tmp_path / "repo")
    first = git(repo, "rev-parse", "HEAD")
    sweep_dir = tmp_path / "sweep"
    cmd = train_cmd("-m", f"hydra.sweep.dir={sweep_dir}", *SWEEP, *GRID)
    cmd += ["hydra.launcher.max_parallel=2"]
    stopped = in_copy(repo, [*cmd, FAIL_FAST], **FAULTS)
    out = output(stopped)
    check_stopped_at_the_failure(sweep_dir, out, stopped.returncode)
    assert "sweep: 0 done, 2 running, 0 failed, 2 pending" in out
    assert "sweep: 0 done, 1 running, 1 failed, 2 pending" in out
    assert "\x1b" not in out  # not a terminal: no control characters
    assert read_launch_record(sweep_dir / "0").last.code["commit"] == first

    (repo / "README.md").write_text((repo / "README.md").read_text() + "\nA change.\n")
    git(repo, "commit", "-qam", "a change between the stop and the resume")
    second = git(repo, "rev-parse", "HEAD")

    before = tree_digest(sweep_dir)
    refused = in_copy(repo, [*cmd, RESUME, "hydra.launcher.on_drift=refuse"])
    said = [line for line in output(refused).splitlines() if line.strip()]
    assert refused.returncode == 2, output(refused)[-3000:]
    assert f"commit {first[:8]}→{second[:8]}" in said[-1] and "on_drift=refuse" in said[-1], said
    assert "Traceback" not in output(refused)
    assert tree_digest(sweep_dir) == before  # multirun.yaml and .launcher.lock included

    resumed = in_copy(repo, [*cmd, RESUME])
    out = output(resumed)
    assert resumed.returncode == 0, out[-5000:]
    drift = [line for line in out.splitlines() if "changed since its first attempt" in line]
    assert len(drift) == 2, drift
    for num, line in zip((0, 1), drift, strict=True):
        assert f"#{num} " in line and f"commit {first[:8]}→{second[:8]}" in line, line
        assert "config" not in line.split("attempt:")[1], line  # the same config
    for num in range(4):
        result = read_result(sweep_dir / str(num))
        assert result.status == "completed" and result.git_commit == second, (num, result)
    assert "resumed from" in (sweep_dir / "0" / "train.log").read_text()
    commits = {r["job"]: r["commit"] for r in summary_rows(sweep_dir)}
    both, new = f"{first[:8]}→{second[:8]}", second[:8]
    assert commits == {"0": both, "1": both, "2": new, "3": new}, commits
    report = in_copy(repo, [sys.executable, "-m", "ddp_launcher.report", str(sweep_dir)])
    assert report.returncode == 0, output(report)
    assert both in report.stdout and "mixed commits" in report.stdout, report.stdout


@pytest.mark.slow
def test_fail_fast_under_optuna(tmp_path: Path) -> None:
    """The project's Optuna sweeper, 4 trials 2 at a time: trial #1 raises, trial #0 is stopped
    at a checkpoint, no third trial is asked; the study keeps both open, and the resume runs
    them again in their job dirs, then asks the rest: 4 completed trials."""
    import optuna

    sweep_dir = tmp_path / "optuna"
    cmd = train_cmd(
        f"hydra.sweep.dir={sweep_dir}",
        "hparams_search=digits_optuna",
        "hydra.sweeper.n_trials=4",
        "hydra.sweeper.n_jobs=2",
        "hydra.launcher.max_parallel=2",
        *SWEEP,
    )
    stopped = run([*cmd, FAIL_FAST], **FAULTS)
    check_stopped_at_the_failure(sweep_dir, output(stopped), stopped.returncode)

    def trials() -> list:
        storage = f"sqlite:///{sweep_dir / 'optuna.db'}"
        return optuna.load_study(study_name="digits", storage=storage).trials

    assert [(t.number, t.state.name) for t in trials()] == [(0, "RUNNING"), (1, "RUNNING")]
    resumed = run([*cmd, RESUME])
    assert resumed.returncode == 0, output(resumed)[-5000:]
    assert [(t.number, t.state.name) for t in trials()] == [(n, "COMPLETE") for n in range(4)]
    assert [len(read_launch_record(sweep_dir / str(n)).attempts) for n in range(4)] == [2, 2, 1, 1]
    assert "resumed from" in (sweep_dir / "0" / "train.log").read_text()


@pytest.mark.slow
def test_fail_fast_on_slurm(idle_cluster: SlurmCluster, tmp_path: Path) -> None:
    """hydra/launcher=slurm: job #1 raises, the launcher cancels the other SLURM jobs (job #0
    checkpoints on SLURM's SIGTERM: `interrupted`; the queued ones never ran), exits non-zero
    with one line; the resume completes every job. The launcher polls every 6 s: SLURM starts
    the queued jobs on the CPU job #1 frees long before the launcher hears of its end, and
    they run nothing (the sweep's fence, ddp_launcher/lifecycle.py)."""
    sweep_dir = tmp_path / "sweep"
    cmd = train_cmd(
        "-m",
        "hydra/launcher=slurm",
        "hydra.launcher.cpus_per_task=1",
        f"hydra.sweep.dir={sweep_dir}",
        *SWEEP,
        *GRID,
    )
    polls = "hydra.launcher.poll_interval_s=6", "hydra.launcher.poll_interval_s=0.25"
    stopped = run([*cmd, polls[0], FAIL_FAST], timeout=400, **FAULTS, **idle_cluster.env)
    out = output(stopped)
    assert stopped.returncode != 0 and "Traceback" not in out, out[-5000:]
    assert re.search(r"hydra\.launcher\.fail_fast: job #1 \(.*\) failed: .*injected fault", out)
    assert "cancelling SLURM job(s)" in out
    assert read_result(sweep_dir / "0").status == "interrupted", read_result(sweep_dir / "0")
    assert any((sweep_dir / "0" / "checkpoints").glob("step-*.pt"))
    for num in (2, 3):  # submitted with the others (SLURM queues them) but never ran
        assert not (sweep_dir / str(num) / "metrics.jsonl").exists(), num
    resumed = run([*cmd, polls[1], RESUME], timeout=600, **idle_cluster.env)
    assert resumed.returncode == 0, output(resumed)[-5000:]
    assert all(read_result(sweep_dir / str(n)).status == "completed" for n in range(4))
    assert "resumed from" in (sweep_dir / "0" / "train.log").read_text()


@pytest.mark.slow
def test_status_line_of_a_real_sweep_on_a_terminal(tmp_path: Path) -> None:
    """A 2-job sweep, one at a time, its console a pty: the status line is redrawn in place
    (erase-line, never a log line of its own) through every change, and the last one is
    left on the console."""
    sweep_dir = tmp_path / "sweep"
    cmd = train_cmd(
        "-m",
        f"hydra.sweep.dir={sweep_dir}",
        "trainer.max_epochs=1",
        "trainer.progress_bar=false",
        "wandb.mode=disabled",
        "hydra.launcher.max_parallel=1",
        "seed=1,2",
    )
    master, slave = pty.openpty()
    proc = subprocess.Popen(cmd, cwd=REPO, env=run_env(), stdout=slave, stderr=slave)
    os.close(slave)
    seen = b""
    while True:
        ready, _, _ = select.select([master], [], [], 600)
        assert ready, "the sweep hung"
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the pty closed (Linux: EIO once the process exited)
            break
        if not chunk:
            break
        seen += chunk
    code = proc.wait(timeout=60)
    os.close(master)
    text = seen.decode(errors="replace")
    assert code == 0, text[-5000:]
    drawn = [part.split("\r\n")[0] for part in text.split(ERASE_LINE)[1:]]
    drawn = [line for line in drawn if line]
    # the line is erased before each log line (the job's own line follows an erase)
    assert any(re.search(r"\[HYDRA\] #0 completed", line) for line in drawn), drawn
    # (a job's end and the next one's start may come in one poll: one redraw for both)
    statuses = [line for line in drawn if line.startswith("sweep: ")]
    assert statuses[0] == "sweep: 0 done, 1 running, 0 failed, 1 pending", drawn
    assert any(
        line.startswith("sweep: 1 done, 1 running, 0 failed, 0 pending, ETA") for line in statuses
    ), drawn
    assert statuses[-1] == "sweep: 2 done, 0 running, 0 failed, 0 pending", drawn
    assert not re.search(r"\] sweep: ", text), "a status line was also logged"
    assert json.loads((sweep_dir / "1" / "result.json").read_text())["status"] == "completed"


# ---------------------------------------------------------------------------------------------
# single runs: the run gate (ddp_launcher/core/gate.py) records each attempt's code in the run dir's
# launch.json and says what changed when the run is resumed

SINGLE = [
    "wandb.mode=disabled",
    "trainer.progress_bar=false",
    "trainer.batch_size=64",
    "trainer.checkpoint_every_n_steps=5",
]
RUN_DRIFT = "changed since the run started"


def drift_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if RUN_DRIFT in line]


def commit_a_change(repo: Path) -> str:
    (repo / "README.md").write_text((repo / "README.md").read_text() + "\nA change.\n")
    git(repo, "commit", "-qam", "a change between two attempts")
    return git(repo, "rev-parse", "HEAD")


@pytest.mark.slow
def test_a_single_run_resumed_after_a_commit_says_what_changed_once(tmp_path: Path) -> None:
    """`python train.py`, killed at its second checkpoint, resumed unchanged: no drift line.
    After a commit, resume=auto with more epochs and hydra.launcher.on_drift=refuse: one line
    naming the commit change and the key, exit 2, the run dir byte for byte unchanged; without
    it: that line once (console and train.log), and the run completes; launch.json holds each
    attempt with its commit."""
    repo = repo_copy(tmp_path / "repo")
    first = git(repo, "rev-parse", "HEAD")
    run_dir = tmp_path / "run"
    cmd = train_cmd(f"hydra.run.dir={run_dir}", *SINGLE)
    killed = in_copy(repo, [*cmd, "trainer.max_epochs=2"], HYDRA_DDP_KILL_AT="save.committed#2")
    assert killed.returncode != 0, output(killed)[-3000:]
    assert any((run_dir / "checkpoints").glob("step-*.pt"))  # killed after its first one

    unchanged = in_copy(repo, [*cmd, "trainer.max_epochs=2", "resume=auto"])
    out = output(unchanged)
    assert unchanged.returncode == 0, out[-5000:]
    assert "resumed from" in out and drift_lines(out) == [], drift_lines(out)

    second = commit_a_change(repo)
    before = tree_digest(run_dir)
    more = [*cmd, "trainer.max_epochs=3", "resume=auto"]
    refused = in_copy(repo, [*more, "hydra.launcher.on_drift=refuse"])
    said = [line for line in output(refused).splitlines() if line.strip()]
    assert refused.returncode == 2, output(refused)[-3000:]
    assert len(said) == 1 and "Traceback" not in said[0], said
    assert f"commit {first[:8]}→{second[:8]}; config trainer.max_epochs:" in said[0], said
    assert "on_drift=refuse: nothing was started" in said[0], said
    assert tree_digest(run_dir) == before

    resumed = in_copy(repo, more)
    out = output(resumed)
    assert resumed.returncode == 0, out[-5000:]
    (line,) = drift_lines(out)
    assert f"{run_dir}: {RUN_DRIFT}: commit {first[:8]}→{second[:8]}" in line, line
    assert "; config trainer.max_epochs: it goes on" in line, line  # that key only
    assert len(drift_lines((run_dir / "train.log").read_text())) == 1
    result = read_result(run_dir)
    assert (
        result.status == "completed" and result.app["epochs"] == 3 and result.git_commit == second
    )
    attempts = read_launch_record(run_dir).attempts
    assert [a.status for a in attempts] == ["interrupted", "completed", "completed"], attempts
    assert [a.code["commit"] for a in attempts] == [first, first, second], attempts
    assert [a.continued for a in attempts] == [False, True, True], attempts


@pytest.mark.slow
def test_a_two_rank_single_run_says_what_changed_once(tmp_path: Path) -> None:
    """A 2-rank run (dist.nproc_per_node=2), then, after a commit, resumed with plain torchrun
    and again with dist.nproc_per_node=2, each with more epochs: each resume says what changed
    in one line (rank 0's gate; the launcher's ranks run no gate), not one per rank."""
    repo = repo_copy(tmp_path / "repo")
    first = git(repo, "rev-parse", "HEAD")
    run_dir = tmp_path / "run"
    base = [f"hydra.run.dir={run_dir}", *SINGLE]
    started = in_copy(repo, train_cmd(*base, "trainer.max_epochs=1", "dist.nproc_per_node=2"))
    assert started.returncode == 0, output(started)[-5000:]
    second = commit_a_change(repo)
    for cmd, epochs in (
        (train_cmd(*base, "trainer.max_epochs=2", "resume=auto", nproc=2), 2),
        (train_cmd(*base, "trainer.max_epochs=3", "resume=auto", "dist.nproc_per_node=2"), 3),
    ):
        resumed = in_copy(repo, cmd)
        out = output(resumed)
        assert resumed.returncode == 0, out[-5000:]
        (line,) = drift_lines(out)
        assert f"commit {first[:8]}→{second[:8]}" in line and "trainer.max_epochs" in line, line
        assert read_result(run_dir).app["epochs"] == epochs
    assert len(read_launch_record(run_dir).attempts) == 3
