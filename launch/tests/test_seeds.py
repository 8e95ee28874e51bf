"""Seeds aggregated in the sweep report (ddp_launcher/report/seeds.py, groups.py): mean ± sample
std,
n and the 95 % Student-t interval per configuration, on real job dirs in tmp_path."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
from ddp_launcher.report.seeds import describe, group_jobs, rank_groups
from ddp_launcher.report.sweep import write_summary
from ddp_launcher.report.wandb_run import log_to_wandb
from test_summary import _completed, _write_job

from tests.helpers import offline_runs

# Student's t 0.975 quantiles from the published table (2 and 1 degrees of freedom).
T975 = {1: 12.706204736174698, 2: 4.302652729749464}


def test_describe_mean_sample_std_and_t_interval() -> None:
    stat = describe([1.0, 2.0, 3.0])
    assert (stat.n, stat.mean, stat.std) == (3, 2.0, 1.0)  # sample std: n - 1
    half = T975[2] * 1.0 / math.sqrt(3)
    assert stat.ci_low == pytest.approx(2.0 - half) and stat.ci_high == pytest.approx(2.0 + half)
    pair = describe([0.5, 0.7])
    assert pair.std == pytest.approx(math.sqrt(0.02))
    assert pair.ci_high - pair.mean == pytest.approx(T975[1] * math.sqrt(0.02) / math.sqrt(2))
    one = describe([0.9])
    assert (one.n, one.mean, one.std, one.ci_low, one.ci_high) == (1, 0.9, None, None, None)
    with pytest.raises(ValueError):
        describe([])


def test_groups_differ_only_in_the_aggregated_keys() -> None:
    jobs = [
        ("0", {"optim.lr": 0.05, "seed": 1}, {"acc": 0.5}),
        ("1", {"optim.lr": 0.1, "seed": 1}, {"acc": 0.8}),
        ("2", {"optim.lr": 0.05, "seed": 2}, {"acc": 0.7}),
        ("3", {"optim.lr": 0.1, "seed": 2}, {"acc": 0.9}),
        ("4", {"optim.lr": 0.3, "seed": 1}, {"acc": 0.95}),
    ]
    groups = group_jobs(jobs, over=["seed"])
    assert [(g.config, g.jobs, g.over) for g in groups] == [
        ({"optim.lr": 0.05}, ["0", "2"], {"seed": [1, 2]}),
        ({"optim.lr": 0.1}, ["1", "3"], {"seed": [1, 2]}),
        ({"optim.lr": 0.3}, ["4"], {"seed": [1]}),
    ]
    ranked = rank_groups(groups, "acc", "max")
    assert [g.jobs for g in ranked] == [["4"], ["1", "3"], ["0", "2"]]
    assert [g.jobs for g in rank_groups(groups, "acc", "min")][0] == ["0", "2"]
    # Other keys to aggregate over: every job one group per seed.
    by_lr = group_jobs(jobs, over=["optim.lr"])
    assert [g.jobs for g in by_lr] == [["0", "1", "4"], ["2", "3"]]


@pytest.fixture
def seeds_sweep(tmp_path: Path) -> Path:
    """`optim.lr=0.05,0.1 seed=1,2,3`, plus one job of lr=0.3 (n = 1) and a failed one."""
    d = tmp_path / "seeds"
    d.mkdir()
    (d / "multirun.yaml").write_text(
        "hydra:\n  overrides:\n    task: [optim.lr=0.05,0.1,0.3, seed=1,2,3]\n"
    )
    accs = {("0.05", 1): 0.80, ("0.05", 2): 0.82, ("0.05", 3): 0.84}
    accs |= {("0.1", 1): 0.90, ("0.1", 2): 0.91, ("0.1", 3): 0.95, ("0.3", 1): 0.7}
    for num, ((lr, seed), acc) in enumerate(accs.items()):
        overrides = [f"optim.lr={lr}", f"seed={seed}"]
        _write_job(d / str(num), overrides, [acc - 0.1, acc], _completed([acc - 0.1, acc]))
    failed = {"status": "failed", "error": "boom", "wall_time_s": 1.0}
    _write_job(d / "7", ["optim.lr=0.1", "seed=4"], [], failed)
    return d


def test_report_aggregates_seeds(seeds_sweep: Path) -> None:
    """Two groups of n = 3 with their intervals, best mean first, and the lr=0.3 group of one
    job without an interval; the failed job is left out; summary_groups.csv and summary.md
    have the same numbers; the W&B summary run has them as a table."""
    import wandb

    summary = write_summary(seeds_sweep)
    assert [g.config for g in summary.groups] == [
        {"optim.lr": 0.1},
        {"optim.lr": 0.05},
        {"optim.lr": 0.3},
    ]
    best = summary.groups[0].stats["best val/acc"]
    expected = describe([0.90, 0.91, 0.95])
    assert (best.n, best.mean, best.std) == (3, pytest.approx(0.92), pytest.approx(expected.std))
    assert best.ci_low == pytest.approx(0.92 - T975[2] * expected.std / math.sqrt(3))
    assert summary.groups[2].stats["best val/acc"].ci_low is None

    with open(seeds_sweep / "summary_groups.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["optim.lr"] for r in rows] == ["0.1", "0.05", "0.3"]
    assert float(rows[0]["best val/acc mean"]) == pytest.approx(0.92)
    assert float(rows[0]["best val/acc ci95_high"]) == pytest.approx(best.ci_high)
    assert rows[0]["best val/acc n"] == "3" and rows[2]["best val/acc ci95_low"] == ""
    md = (seeds_sweep / "summary.md").read_text()
    assert "## Aggregated over seed" in md and "0.92 ± 0.02646" in md

    try:
        log_to_wandb(summary, {"mode": "offline", "project": "p"})
    finally:
        wandb.teardown()
    (run,) = offline_runs(seeds_sweep)
    table = run.table("sweep/groups")
    first = dict(zip(table["columns"], table["data"][0], strict=True))
    assert first["optim.lr"] == 0.1 and first["best val/acc n"] == 3
    assert first["best val/acc mean"] == pytest.approx(0.92)
    assert first["best val/acc ci95_low"] == pytest.approx(best.ci_low)


def test_no_groups_without_repeated_configurations(seeds_sweep: Path) -> None:
    """Aggregated over a key nobody shares (or none): no groups, no groups file."""
    write_summary(seeds_sweep)
    assert (seeds_sweep / "summary_groups.csv").exists()
    summary = write_summary(seeds_sweep, aggregate=[])
    assert summary.groups == [] and not (seeds_sweep / "summary_groups.csv").exists()
    assert "Aggregated" not in (seeds_sweep / "summary.md").read_text()
