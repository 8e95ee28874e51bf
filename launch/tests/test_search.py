"""The Optuna sweeper (ddp_launcher/sweeper/): the override grammar to Optuna 5 distributions, the
study's
storage and pruner, a trial reached from another process through the storage
(ddp_launcher/ranks/pruning.py), slot utilisation, and jobs started whenever a slot frees
(ddp_launcher/lifecycle.py's JobFeed)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import optuna
import pytest
from ddp_launcher.core.errors import UserError
from ddp_launcher.core.trials import (
    JOB_NUM_ATTR,
    PRUNER_ENV,
    STORAGE_ENV,
    STUDY_ENV,
    SWEEP_DIR_ATTR,
    build_pruner,
    open_storage,
)
from ddp_launcher.jobs import Job
from ddp_launcher.lifecycle import JobFeed, run_jobs
from ddp_launcher.ranks.job_spec import job_return
from ddp_launcher.ranks.pruning import TrialLink
from ddp_launcher.resume import Attempt, LaunchRecord, write_launch_record
from ddp_launcher.sweeper.space import search_space, trial_overrides
from ddp_launcher.sweeper.study import directions, shown, storage_spec
from ddp_launcher.sweeper.usage import SlotUsage
from hydra.core.utils import JobStatus
from omegaconf import OmegaConf
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

from tests.helpers import output, run

REPO = Path(__file__).resolve().parents[2]
IMPORT_PATH = os.pathsep.join([str(REPO), str(REPO / "launch")])


def test_the_grammar_of_hydras_optuna_sweeper() -> None:
    params = {
        "optim.lr": "tag(log, interval(0.001, 1.0))",
        "optim.momentum": "interval(0.5, 0.95)",
        "model.hidden": "int(interval(16, 256))",
        "trainer.batch_size": "choice(32, 64, 128)",
        "trainer.max_epochs": "range(2, 10, 2)",
        "model.width": "int(tag(log, interval(8, 512)))",
        "model.dropout": "0.1",
    }
    space, fixed = search_space(params, ["model.name=resnet18", "optim.wd=range(0.0, 0.5, 0.1)"])
    assert space == {
        "optim.lr": FloatDistribution(0.001, 1.0, log=True),
        "optim.momentum": FloatDistribution(0.5, 0.95),
        "model.hidden": IntDistribution(16, 256),
        "trainer.batch_size": CategoricalDistribution([32, 64, 128]),
        "trainer.max_epochs": IntDistribution(2, 10, step=2),
        "model.width": IntDistribution(8, 512, log=True),
        "optim.wd": FloatDistribution(0.0, 0.5, step=0.1),
    }
    assert fixed == {"model.dropout": "0.1", "model.name": "resnet18"}
    # A command-line argument wins over the config's params.
    space, fixed = search_space({"optim.lr": "interval(0.1, 1)"}, ["optim.lr=0.5"])
    assert (space, fixed) == ({}, {"optim.lr": "0.5"})
    assert trial_overrides({"optim.lr": 0.2}, {"seed": "3"}) == ["optim.lr=0.2", "seed=3"]


def test_storage_follows_the_launcher(tmp_path: Path) -> None:
    local = OmegaConf.create({"hydra": {"launcher": {"_target_": "x.TorchrunLauncher"}}})
    slurm = OmegaConf.create({"hydra": {"launcher": {"_target_": "x.DDPSlurmLauncher"}}})
    assert storage_spec(None, local, tmp_path) == f"sqlite:///{tmp_path}/optuna.db"
    assert storage_spec("auto", slurm, tmp_path) == f"journal:{tmp_path}/optuna.journal"
    assert storage_spec("journal", local, tmp_path) == f"journal:{tmp_path}/optuna.journal"
    assert storage_spec("sqlite", slurm, tmp_path) == f"sqlite:///{tmp_path}/optuna.db"
    url = "postgresql://me:secret@db.example/optuna"
    assert storage_spec(url, slurm, tmp_path) == url
    assert "secret" not in shown(url) and shown(url).endswith("@db.example/optuna")
    with pytest.raises(UserError, match="hydra.sweeper.storage=mysql"):
        storage_spec("mysql", local, tmp_path)


def test_pruners_by_name_with_their_arguments() -> None:
    assert isinstance(build_pruner(None), optuna.pruners.NopPruner)
    assert isinstance(build_pruner("none"), optuna.pruners.NopPruner)
    assert isinstance(build_pruner("hyperband"), optuna.pruners.HyperbandPruner)
    assert isinstance(build_pruner("successive_halving"), optuna.pruners.SuccessiveHalvingPruner)
    assert isinstance(build_pruner("percentile"), optuna.pruners.PercentilePruner)
    median = build_pruner(OmegaConf.create({"type": "median", "n_warmup_steps": 2}))
    assert isinstance(median, optuna.pruners.MedianPruner) and median._n_warmup_steps == 2
    target = {"_target_": "optuna.pruners.ThresholdPruner", "lower": 0.1}
    assert isinstance(build_pruner(target), optuna.pruners.ThresholdPruner)
    with pytest.raises(UserError, match="use one of median, percentile"):
        build_pruner("asha")
    with pytest.raises(UserError, match="median"):
        build_pruner({"type": "median", "warmup": 2})
    assert directions("maximize") == ["maximize"]
    assert directions(OmegaConf.create(["minimize", "maximize"])) == ["minimize", "maximize"]
    with pytest.raises(UserError, match="direction=up"):
        directions("up")


@pytest.mark.parametrize(
    "pruner",
    [
        {"type": "median", "n_warmup_steps": -1},
        {"type": "percentile", "percentile": 120.0},
        {"_target_": "optuna.pruners.MedianPruner", "n_warmup_steps": -1},
    ],
    ids=["median", "percentile", "target"],
)
def test_a_pruner_argument_out_of_its_range_is_one_line(pruner: dict) -> None:
    """Optuna's ValueError (Hydra's InstantiationException around it, for a `_target_`) was a
    traceback: now one line naming hydra.sweeper.pruner and what Optuna allows."""
    with pytest.raises(UserError) as caught:
        build_pruner(pruner)
    message = str(caught.value)
    assert message.startswith("hydra.sweeper.pruner: ") and "\n" not in message, message
    assert "cannot be negative" in message or "between 0 and 100" in message, message


def test_the_search_space_merges_from_the_command_line(train_config) -> None:
    """`hydra.sweeper.params={optim.lr: ...}` from the command line, also where the sweep's
    config has no params (the node was null, which OmegaConf cannot merge a dict into)."""
    for search in ([], ["hparams_search=digits_optuna"]):
        config = train_config.multirun(
            *search, "hydra/sweeper=optuna", "hydra.sweeper.params={optim.lr: 'interval(0.1, 1)'}"
        )
        space, fixed = search_space(config.hydra.sweeper.params, [])
        assert space["optim.lr"] == FloatDistribution(0.1, 1.0) and not fixed
        assert len(space) == (5 if search else 1)  # merged into the search config's own


# A rank's side of pruning, in a process of its own: find the trial of job #1 of SWEEP through
# the storage the environment names, report 3 epochs, print whether it was pruned (and when).
RANK = """
import sys
from ddp_launcher.ranks.pruning import TrialLink
link = TrialLink.from_env(sys.argv[1], 1)
for epoch, value in enumerate([0.1, 0.1, 0.1], 1):
    if link.should_prune(epoch, value):
        print("pruned", epoch)
        break
else:
    print("not pruned")
"""


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sqlite", "journal"])
def test_a_rank_reaches_its_trial_through_the_storage(tmp_path: Path, kind: str) -> None:
    """Two completed trials reported 0.8 and 0.9 per epoch; trial #1's job, in another process,
    reports 0.1: the median pruner stops it at epoch 1, and the study holds its report."""
    spec = storage_spec(kind, OmegaConf.create({}), tmp_path)
    sweep_dir = str(tmp_path.resolve())
    study = optuna.create_study(
        study_name="s",
        storage=open_storage(spec),
        direction="maximize",
        pruner=optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=0),
    )
    for value in (0.8, 0.9):
        done = study.ask()
        for epoch in (1, 2, 3):
            done.report(value, epoch)
        study.tell(done, value)
    other = study.ask()  # job #1 of another sweep dir: not this one's
    other.set_user_attr(SWEEP_DIR_ATTR, "/elsewhere")
    other.set_user_attr(JOB_NUM_ATTR, 1)
    mine = study.ask()
    mine.set_user_attr(SWEEP_DIR_ATTR, sweep_dir)
    mine.set_user_attr(JOB_NUM_ATTR, 1)
    env = {**os.environ, STORAGE_ENV: spec, STUDY_ENV: "s", "PYTHONPATH": IMPORT_PATH}
    env[PRUNER_ENV] = '{"type": "median", "n_startup_trials": 2}'  # the sweeper's, as JSON
    out = subprocess.run(
        [sys.executable, "-c", RANK, sweep_dir], env=env, capture_output=True, text=True
    )
    assert out.stdout.split() == ["pruned", "1"], out.stderr[-2000:]
    trial = study.trials[mine.number]
    assert (
        trial.intermediate_values == {1: 0.1} and not study.trials[other.number].intermediate_values
    )
    assert TrialLink.from_env(sweep_dir, 5) is None  # no env here: not a pruned trial


def test_slot_utilisation_from_the_launch_records(tmp_path: Path) -> None:
    """2 slots over 10 s: one job busy 0-10 s, another 2-6 s then 6-10 s (a retry): 18 of 20
    slot-seconds; an attempt of an earlier run does not count."""
    t0 = 1000.0
    write_launch_record(tmp_path / "0", LaunchRecord(0, ["a=0"], [Attempt(0, t0, t0 + 10)]))
    attempts = [Attempt(0, t0 - 50, t0 - 40), Attempt(1, t0 + 2, t0 + 6), Attempt(2, t0 + 6, None)]
    write_launch_record(tmp_path / "1", LaunchRecord(1, ["a=1"], attempts))
    usage = SlotUsage(2, started=t0)
    assert usage.measure([tmp_path / "0", tmp_path / "1"], now=t0 + 10) == pytest.approx(0.9)
    assert usage.line() == "slot utilisation 90% (18 busy slot-s / 2 slot(s) x 10 s)"


class SleepBackend:
    """Each attempt is a `sleep` process as long as the job's override's value says (a key the
    config has: the gate refuses one it does not); unlimited room (the feed limits how many
    run)."""

    poll_s = 0.02
    holds_job_dirs = True

    def __init__(self) -> None:
        self.started: dict[int, float] = {}
        self.ended_at: dict[int, float] = {}

    def place(self, job: Job) -> None:
        job.nproc, job.nnodes, job.uses_gpus = 1, 1, False

    def reserve(self, job: Job) -> bool:
        return True

    def release(self, job: Job, slot: bool) -> None:
        pass

    def start(self, batch: list[tuple[Job, bool]]) -> list[Any]:
        handles = []
        for job, _ in batch:
            seconds = job.overrides[0].split("=")[1]
            self.started[job.num] = job.started = time.time()
            handles.append((job.num, subprocess.Popen(["sleep", seconds])))
        return handles

    def record(self, handle: Any) -> None:
        return None

    def ended(self, handles: list[Any]) -> list[Any]:
        return [h for h in handles if h[1].poll() is not None]

    def outcome(self, job: Job, handle: Any) -> Any:
        self.ended_at[job.num] = time.time()
        return job_return(job, JobStatus.COMPLETED, float(job.num))

    def stop(self, running: list, why: str) -> None:
        for _, (_, process) in running:
            process.kill()
            process.wait()

    def earlier_return(self, job: Job, attempt: Any) -> None:
        return None

    def reattach(self, job: Job, attempt: Any) -> None:
        return None


@pytest.mark.slow
def test_a_job_starts_whenever_a_slot_frees(train_config, tmp_path: Path) -> None:
    """2 slots, jobs of 0.2, 10, 0.2, 0.2 s: jobs #2 and #3 start while #1 (the long one) still
    runs (batches of 2 would wait for it); each job after the first two is asked right after
    a job's result came in (the study knows it then); never more than 2 run."""
    master = train_config.multirun(f"hydra.sweep.dir={tmp_path}", "wandb.mode=disabled")
    launcher = SimpleNamespace(
        config=master, hydra_context=train_config.context, task_function=None
    )
    durations = ["0.2", "10", "0.2", "0.2"]
    events: list[str] = []

    def next_overrides() -> tuple[int, list[str]] | None:
        num = sum(e.startswith("ask") for e in events)
        if num == len(durations):
            return None
        events.append(f"ask {num}")
        return num, [f"trainer.progress_every_s={durations[num]}"]

    feed = JobFeed(launcher, next_overrides, slots=2)

    def on_result(job: Job, ret: Any) -> None:
        feed.ended()
        events.append(f"told {job.num}")

    backend = SleepBackend()
    results = run_jobs(feed, backend, on_done=on_result)
    assert sorted(results) == [0, 1, 2, 3]
    assert events[:4] == ["ask 0", "ask 1", "told 0", "ask 2"]  # once #0's result is known
    assert events[events.index("ask 3") - 1] in ("told 1", "told 2")
    start, end = backend.started, backend.ended_at
    assert start[2] < end[1] and start[3] < end[1]  # the long job did not hold the others up
    assert start[2] >= end[0] and start[3] >= end[2]
    for t in (start[2], start[3]):  # never more than 2 at once
        assert sum(start[n] <= t < end[n] for n in start) <= 2


@pytest.mark.parametrize(
    ("argv", "multirun"),
    [
        (["train.py", "hparams_search=digits_optuna"], True),
        (["train.py", "+hparams_search=mine", "optim.lr=0.1"], True),
        (["train.py", "-m", "hparams_search=digits_optuna"], False),  # -m there already
        (["train.py", "hparams_search=null"], False),
        (["train.py", "experiment=digits_quick"], False),
        (["train.py", "hydra.sweeper.params.hparams_search=x"], False),
    ],
)
def test_a_search_config_is_a_multirun_on_the_command_line(argv, multirun) -> None:
    """Hydra 1.4 reads hydra.mode only from the primary config and the command line: the entry
    point says on the command line what a search config's `hydra.mode: MULTIRUN` says."""
    from ddp_launcher.core.hydra_compat import search_as_multirun

    expected = [argv[0], "-m", *argv[1:]] if multirun else argv
    assert search_as_multirun(argv) == expected


def one_epoch_search(sweep_dir: Path, *args: str) -> str:
    """Run `train.py *args` (a search), its trials 1 epoch each, into `sweep_dir`; it must end
    well. Its console output."""
    from tests.helpers import train_cmd

    cmd = train_cmd(*args, "trainer.max_epochs=1", "trainer.progress_bar=false")
    proc = run([*cmd, f"hydra.sweep.dir={sweep_dir}"])
    out = output(proc)
    assert proc.returncode == 0, out[-4000:]
    return out


@pytest.mark.slow
def test_the_search_config_runs_without_m_and_without_warnings(tmp_path: Path) -> None:
    """`python train.py hparams_search=digits_optuna` as docs/sweeps.md writes it (no -m), one
    trial of 2 ranks, under the installed Hydra (requirements.txt's 1.3; .ci/run runs this file
    under 1.4 too). Under 1.4 it ended in "hydra.mode changed during config composition", its
    sampler reached Optuna uninstantiated, and every rank warned of `version_base` and of each
    `_target_` without an execution whitelist."""
    sweep_dir = tmp_path / "sweep"
    out = one_epoch_search(
        sweep_dir,
        "hparams_search=digits_optuna",
        "hydra.sweeper.n_trials=1",
        "dist.nproc_per_node=2",
    )
    assert "#0 completed" in out, out[-4000:]
    rank_logs = sorted((sweep_dir / "0" / "rank_logs").rglob("std*.log"))
    assert len(rank_logs) >= 2, rank_logs  # each rank's stdout/stderr
    for name, text in [("console", out)] + [(str(p), p.read_text()) for p in rank_logs]:
        for warning in ("version_base", "execution whitelist", "_execution_whitelist_"):
            assert warning not in text, f"{name}: {warning}\n{text[-3000:]}"


GRID_SEARCH = """# @package _global_
defaults:
  - override /hydra/sweeper: optuna
  - override /hydra/sweeper/sampler: grid
hydra:
  mode: MULTIRUN
  sweeper:
    n_jobs: 2
    direction: maximize
    n_trials: 5
    params:
      trainer.batch_size: choice(64, 128)
"""


@pytest.mark.slow
def test_a_grid_search_runs_its_grid_once_and_ends(tmp_path: Path) -> None:
    """hydra/sweeper/sampler=grid (docs/sweeps.md): n_trials is cut to the grid's 2 points, each
    run once, and the sweep ends well (Optuna's GridSampler stops the study when its grid is
    done, which raised outside study.optimize once the last trial was told)."""
    conf = tmp_path / "conf"
    (conf / "hparams_search").mkdir(parents=True)
    (conf / "hparams_search" / "grid.yaml").write_text(GRID_SEARCH)
    sweep_dir = tmp_path / "sweep"
    one_epoch_search(
        sweep_dir, "--config-dir", str(conf), "hparams_search=grid", "wandb.mode=disabled"
    )
    study = optuna.load_study(
        study_name=sweep_dir.name, storage=open_storage(f"sqlite:///{sweep_dir / 'optuna.db'}")
    )
    assert sorted(t.params["trainer.batch_size"] for t in study.trials) == [64, 128]
    assert [t.state.name for t in study.trials] == ["COMPLETE", "COMPLETE"]
    assert (sweep_dir / "optimization_results.yaml").exists()


@pytest.mark.slow
def test_a_grid_over_an_interval_is_one_line_before_anything_is_written(tmp_path: Path) -> None:
    """GridSampler can only enumerate choice(...) and range(...): the example app's search with
    hydra/sweeper/sampler=grid over its lr interval is refused in one line naming the key,
    exit 2, with no HYDRA_FULL_ERROR hint after it and no sweep dir made."""
    sweep_dir = tmp_path / "sweep"
    toy = Path(__file__).resolve().parents[1] / "examples" / "toy_ddp.py"
    proc = run(
        [
            sys.executable,
            str(toy),
            "hparams_search=lr",
            "hydra/sweeper/sampler=grid",
            f"hydra.sweep.dir={sweep_dir}",
        ],
        cwd=tmp_path,
        timeout=300,
    )
    said = output(proc)
    assert proc.returncode == 2, said
    assert said.strip() == (
        "hydra.sweeper.params.lr: GridSampler needs choice(...) or range(...)"
    ), said
    assert not sweep_dir.exists()
