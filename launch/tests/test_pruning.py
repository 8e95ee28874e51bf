"""Pruning across DDP jobs, end to end: the Optuna sweeper (ddp_launcher/sweeper/) on a search
config shaped as lightning-hydra-template writes them, trials of 2 ranks each, 2 at a time, a
median pruner. The pruned trial stops at the same epoch in both ranks, after its checkpoint, and
says so in result.json, launch.json, the sweep report, its W&B run and the study; a resumed
sweep keeps it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ddp_launcher.resume import read_launch_record

from tests.helpers import offline_runs, output, run, train_cmd

# lightning-hydra-template's configs/hparams_search/mnist_optuna.yaml, its sweeper `_target_`
# line removed and its params ours. With TPESampler(seed=1234)'s random start, the trials' lr
# are 0.5, 0.5, 0.00001, 0.5: trial #2 starts once #0 or #1 ended and learns nothing.
LHT_SEARCH = """# @package _global_
defaults:
  - override /hydra/sweeper: optuna

hydra:
  mode: "MULTIRUN"
  sweeper:
    storage: null
    study_name: null
    n_jobs: 2
    direction: maximize
    n_trials: 4
    sampler:
      _target_: optuna.samplers.TPESampler
      seed: 1234
      n_startup_trials: 10
    params:
      optim.lr: choice(0.00001, 0.5)
"""

PRUNED_SWEEP = [
    "hparams_search=lht_optuna",
    "hydra.sweeper.pruner={type: median, n_startup_trials: 2}",
    "dist.nproc_per_node=2",
    "trainer.max_epochs=3",
    "trainer.batch_size=64",
    "trainer.progress_bar=false",
    "wandb.mode=offline",
]


def study_trials(sweep_dir: Path, storage: str) -> list:
    """The study of the sweep, from its file in the sweep dir (optuna.db or optuna.journal)."""
    import optuna
    from ddp_launcher.core.trials import open_storage

    path = sweep_dir / storage
    assert path.exists(), f"no {path}"
    spec = f"sqlite:///{path}" if storage.endswith(".db") else f"journal:{path}"
    return optuna.load_study(study_name=sweep_dir.name, storage=open_storage(spec)).trials


def val_epochs(job_dir: Path) -> list[int]:
    rows = [json.loads(line) for line in (job_dir / "metrics.jsonl").read_text().splitlines()]
    return [row["epoch"] for row in rows if "val/acc" in row]


def write_search(tmp_path: Path) -> Path:
    """The config dir (for --config-dir) holding hparams_search=lht_optuna."""
    conf = tmp_path / "conf"
    (conf / "hparams_search").mkdir(parents=True)
    (conf / "hparams_search" / "lht_optuna.yaml").write_text(LHT_SEARCH)
    return conf


def pruned_sweep(tmp_path: Path, *extra: str, **env: str) -> tuple[list[str], Path, str]:
    """Run the search; (its command, its sweep dir, its output), checked as
    :func:`check_pruned` says."""
    sweep_dir = tmp_path / "search"
    conf = write_search(tmp_path)
    cmd = train_cmd(
        "--config-dir", str(conf), f"hydra.sweep.dir={sweep_dir}", *PRUNED_SWEEP, *extra
    )
    proc = run(cmd, timeout=900, **env)
    out = output(proc)
    assert proc.returncode == 0, out[-5000:]
    return cmd, sweep_dir, out


def check_pruned(sweep_dir: Path, out: str, storage: str) -> None:
    """Trial #2 (lr 0.00001) pruned after epoch 1 in every record; the others ran 3 epochs."""
    trials = study_trials(sweep_dir, storage)
    assert [t.params["optim.lr"] for t in trials] == [0.5, 0.5, 0.00001, 0.5]
    assert [t.state.name for t in trials] == ["COMPLETE", "COMPLETE", "PRUNED", "COMPLETE"]
    assert list(trials[2].intermediate_values) == [1]  # reported once, then stopped
    assert list(trials[0].intermediate_values) == [1, 2, 3]
    pruned = sweep_dir / "2"
    assert val_epochs(pruned) == [1] and val_epochs(sweep_dir / "3") == [1, 2, 3]
    result = json.loads((pruned / "result.json").read_text())
    assert result["status"] == "pruned" and result["app"]["epochs"] == 1
    assert "pruned by the sweeper after epoch 1" in result["error"]
    assert (pruned / "checkpoints" / "last.pt").exists()  # saved before it stopped
    assert read_launch_record(pruned).last.status == "pruned"
    (wandb_run,) = offline_runs(pruned)
    assert "pruned" in wandb_run.tags and wandb_run.exit_code == 0
    assert wandb_run.summary["status"] == "pruned"
    rows = (sweep_dir / "summary.csv").read_text().splitlines()
    assert any(line.startswith("2,") and ",pruned," in line for line in rows)
    assert "#2 pruned" in out and "4 jobs, 3 completed, 1 pruned" in out
    closing = [line for line in out.splitlines() if "Optuna study" in line][-1]
    assert "4 trial(s) this run (3 complete, 1 pruned); slot utilisation" in closing


@pytest.mark.slow
@pytest.mark.timeout(1800)  # two sweeps of 4 trials of 2 ranks
def test_a_pruned_trial_stops_every_rank_and_says_so(tmp_path: Path) -> None:
    """Under hydra/launcher=torchrun (the study in <sweep dir>/optuna.db). Both ranks stop at
    the same epoch (else the job would hang or fail in a collective: it ends cleanly); a
    resumed sweep keeps the pruned trial and runs nothing."""
    cmd, sweep_dir, out = pruned_sweep(tmp_path, "hydra.launcher.max_parallel=2")
    check_pruned(sweep_dir, out, "optuna.db")
    for log in sorted((sweep_dir / "2").glob("rank_logs/**/stderr.log")):
        assert "Traceback" not in log.read_text()

    again = run([*cmd, "hydra.launcher.resume=true"], timeout=600)
    assert again.returncode == 0, output(again)[-5000:]
    assert "4 trial(s) finished, 0 to run again, 0 to ask" in output(again)
    assert len(read_launch_record(sweep_dir / "2").attempts) == 1
    assert study_trials(sweep_dir, "optuna.db")[2].state.name == "PRUNED"
