"""ddp_launcher/report/: sweep summary files, plot, W&B summary run, CLI and Hydra callback, on real
files in tmp_path; ddp_launcher/core/naming.py: swept keys, short names, values to 4 digits."""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from ddp_launcher.core.naming import (
    declared_sweep_keys,
    fmt_duration,
    fmt_value,
    label,
    short_keys,
    sweep_group,
    swept_keys,
    swept_values,
)
from ddp_launcher.report.callback import SweepSummaryCallback
from ddp_launcher.report.figure import summary_figure
from ddp_launcher.report.jobs import JOB_TYPE, read_sweep
from ddp_launcher.report.sweep import write_summary
from ddp_launcher.report.tables import format_table
from ddp_launcher.report.wandb_run import log_to_wandb
from omegaconf import OmegaConf

from tests.helpers import offline_runs, run_env

REPO = Path(__file__).resolve().parents[2]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
CONSTANT = "trainer.max_epochs=3"  # in every job's overrides: no column, not in the legend


def _write_job(
    job_dir: Path,
    overrides: list[str],
    accs: list[float],
    result: dict | None,
    truncate: bool = False,
) -> None:
    """A job dir as train.py + Hydra leave it: .hydra/overrides.yaml, metrics.jsonl (2 train rows
    per epoch, then its val row), result.json."""
    (job_dir / ".hydra").mkdir(parents=True)
    (job_dir / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    lines = []
    for epoch, acc in enumerate(accs, 1):
        for step in (1, 2):
            lines.append(
                {
                    "step": (epoch - 1) * 2 + step,
                    "epoch": epoch,
                    "train/loss": 1.0 - acc,
                    "lr": 0.1,
                    "samples_per_s": 100.0 * step,
                }
            )
        lines.append(
            {
                "step": epoch * 2,
                "epoch": epoch,
                "val/loss": 2.0 - acc,
                "val/acc": acc,
                "val/count": 50,
            }
        )
    text = "".join(json.dumps(row) + "\n" for row in lines)
    if truncate:
        text += '{"step": 99, "epoch": 9, "val/acc": 0.99, "val/lo'  # killed mid-write
    (job_dir / "metrics.jsonl").write_text(text)
    if result is not None:
        (job_dir / "result.json").write_text(json.dumps(result))


def _completed(accs: list[float], **extra) -> dict:
    """result.json as train.py writes it (ddp_launcher/core/run_dir.py's RunResult)."""
    best = max(accs)
    return {
        "status": "completed",
        "error": None,
        "monitor": "val/acc",
        "mode": "max",
        "best": best,
        "best_epoch": accs.index(best) + 1,
        "best_val_acc": best,
        "final": {
            "epoch": len(accs),
            "val/loss": 2.0 - accs[-1],
            "val/acc": accs[-1],
            "val/count": 50,
        },
        "test": {},
        "epochs": len(accs),
        "wall_time_s": 12.5,
        "samples_per_s": 150.0,
        "wandb_run_id": f"run{len(accs)}{int(best * 100)}",
        **extra,
    }


@pytest.fixture
def sweep(tmp_path: Path) -> Path:
    """`optim.lr=0.01,0.1,0.3,3.0,0.2 trainer.max_epochs=3`: 3 completed jobs, 1 failed
    (result.json with an error), 1 killed (no result.json)."""
    d = tmp_path / "sweep"
    d.mkdir()
    (d / "multirun.yaml").write_text(
        "hydra:\n  overrides:\n    task: [optim.lr=0.01,0.1,0.3,3.0,0.2, trainer.max_epochs=3]\n"
    )

    def job(num: int, lr: str, accs: list[float], result: dict | None, **kw) -> None:
        _write_job(d / str(num), [f"optim.lr={lr}", CONSTANT], accs, result, **kw)

    job(0, "0.01", [0.5, 0.8, 0.7], _completed([0.5, 0.8, 0.7]))
    job(1, "0.1", [0.6, 0.92, 0.9], _completed([0.6, 0.92, 0.9]))
    # an older result.json: no monitor/best/final; filled from metrics.jsonl
    job(2, "0.3", [0.7, 0.85], {"status": "completed", "best_val_acc": 0.85, "wall_time_s": 9.0})
    job(
        3,
        "3.0",
        [],
        {
            "status": "failed",
            "error": "FloatingPointError: loss is nan at step 7",
            "wall_time_s": 3.0,
        },
    )
    job(4, "0.2", [0.83, 0.81], None, truncate=True)
    (d / "not_a_job").mkdir()  # no .hydra/, result.json or metrics.jsonl: ignored
    return d


def _read_csv(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames or []), list(reader)


def _assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert len(data) > 1024


# --------------------------------------------------------------------------------------------
# ddp_launcher/core/naming.py


def test_swept_keys_from_the_sweep_config_and_the_jobs() -> None:
    """Sweep overrides of the command line and the sweeper's params are swept; constants are
    not; a key only the jobs vary (another sweeper) is added after them."""
    config = OmegaConf.create(
        {
            "hydra": {
                "overrides": {
                    "task": [
                        "optim.lr=0.05,0.1",
                        "trainer.max_epochs=1",
                        "model=small_cnn,resnet18",
                        "seed=range(3)",
                    ]
                },
                "sweeper": {
                    "params": {
                        "optim.momentum": "interval(0.5, 0.95)",
                        "trainer.batch_size": "choice(32, 64)",
                        "fixed": 3,
                    }
                },
            }
        }
    )
    declared = ["optim.lr", "model", "seed", "optim.momentum", "trainer.batch_size"]
    assert declared_sweep_keys(config) == declared
    jobs = [["optim.lr=0.05", "x=1", "same=2"], ["optim.lr=0.1", "x=2", "same=2"]]
    assert swept_keys(config, jobs) == [*declared, "x"]
    assert swept_keys(None, jobs) == ["optim.lr", "x"]


def test_names_use_short_keys_and_four_significant_digits() -> None:
    """An Optuna trial's name: swept keys only, the shortest unambiguous key suffix, floats to
    4 significant digits (long before: every override, every digit)."""
    keys = ["optim.lr", "optim.momentum", "trainer.batch_size", "model.hidden", "model.dropout"]
    overrides = [
        "optim.lr=0.012345678901234",
        "optim.momentum=0.8765432109876",
        "trainer.batch_size=64",
        "model.hidden=128",
        "model.dropout=0.30000000000000004",
        "dataset=digits",
        "trainer.max_epochs=5",
        "wandb.mode=offline",
    ]
    values = swept_values(overrides, keys)
    assert values == {
        "lr": 0.012345678901234,
        "momentum": 0.8765432109876,
        "batch_size": 64,
        "hidden": 128,
        "dropout": 0.30000000000000004,
    }
    name = label(values)
    assert name == "lr=0.01235,momentum=0.8765,batch_size=64,hidden=128,dropout=0.3"
    assert len(name) < len(",".join(overrides)) / 2
    assert short_keys(["optim.lr", "sched.lr", "model"]) == {
        "optim.lr": "optim.lr",
        "sched.lr": "sched.lr",
        "model": "model",
    }
    assert [fmt_value(v) for v in (1e-05, 123456.0, True, "resnet18", 3)] == [
        "1e-05",
        "1.235e+05",
        "true",
        "resnet18",
        "3",
    ]
    assert [fmt_duration(s) for s in (4.25, 125, 7530)] == ["4.2s", "2m05s", "2h05m"]
    assert sweep_group(None, "multirun/2026-11-29/21-30-00-1") == "sweep-2026-11-29_21-30-00-1"


# --------------------------------------------------------------------------------------------
# reading a sweep


def _epochs(job) -> list[tuple[float, float]]:
    """(epoch, val/acc) per validated epoch."""
    return job.curves.get("val/acc", [])


def test_read_sweep_reads_results_and_derives_from_metrics(sweep: Path) -> None:
    jobs = {j.job: j for j in read_sweep(sweep)[0]}
    assert sorted(jobs) == ["0", "1", "2", "3", "4"]
    assert jobs["1"].swept == {"optim.lr": 0.1}  # the constant override is not swept
    assert jobs["1"].status == "completed" and jobs["1"].error is None
    assert (jobs["1"].monitor, jobs["1"].mode, jobs["1"].best, jobs["1"].best_epoch) == (
        "val/acc",
        "max",
        0.92,
        2,
    )
    assert jobs["1"].final == {"val/loss": pytest.approx(1.1), "val/acc": 0.9, "val/count": 50}
    assert _epochs(jobs["1"]) == [(1, 0.6), (2, 0.92), (3, 0.9)]
    # train/loss over epochs: step / steps per epoch (2)
    assert [x for x, _ in jobs["1"].curves["train/loss"]] == [0.5, 1.0, 1.5, 2.0, 2.5, 3.0]
    # an older result.json: best, its epoch and the last epoch's metrics from metrics.jsonl
    assert (jobs["2"].best, jobs["2"].best_epoch) == (0.85, 2)
    assert jobs["2"].final["val/loss"] == pytest.approx(2.0 - 0.85)
    assert jobs["2"].samples_per_s == pytest.approx(150.0)  # mean of 100, 200 train rows
    # failed: status and error from result.json
    assert jobs["3"].status == "failed"
    assert jobs["3"].error == "FloatingPointError: loss is nan at step 7"
    assert jobs["3"].best is None and _epochs(jobs["3"]) == []
    # killed: no result.json; truncated last line skipped (its 0.99 must not count)
    killed = jobs["4"]
    assert killed.status == "failed" and killed.error == "no result.json"
    assert (killed.best, killed.best_epoch) == (0.83, 1)
    assert killed.final["val/acc"] == pytest.approx(0.81)
    assert killed.wall_time_s is None
    assert _epochs(killed) == [(1, 0.83), (2, 0.81)]


def test_write_summary_files(sweep: Path) -> None:
    """One column per swept key (the constant override has none), ranked by the monitored
    metric's best value; floats to 4 significant digits in the Markdown table."""
    summary = write_summary(sweep)
    assert [r.job for r in summary.rows] == ["1", "2", "4", "0", "3"]  # best first, None last
    assert summary.swept_keys == ["optim.lr"] and summary.ranked_by == "best val/acc"

    header, rows = _read_csv(sweep / "summary.csv")
    assert header == [
        "job",
        "optim.lr",
        "status",
        "best",
        "best_epoch",
        "last val/acc",
        "last val/loss",
        "wall_time_s",
        "samples_per_s",
        "monitor",
        "mode",
        "wandb_run_id",
        "overrides",
        "attempts",
        "error",
    ]
    assert [r["job"] for r in rows] == ["1", "2", "4", "0", "3"]
    assert [r["optim.lr"] for r in rows] == ["0.1", "0.3", "0.2", "0.01", "3.0"]
    assert [float(r["best"]) for r in rows[:4]] == [0.92, 0.85, 0.83, 0.8]
    assert rows[4]["best"] == "" and rows[0]["best_epoch"] == "2"
    assert rows[0]["monitor"] == "val/acc" and rows[0]["mode"] == "max"
    assert rows[0]["overrides"] == f"optim.lr=0.1 {CONSTANT}" and rows[0]["error"] == ""
    assert rows[2]["status"] == "failed" and rows[2]["error"] == "no result.json"
    assert rows[4]["error"] == "FloatingPointError: loss is nan at step 7"

    md = (sweep / "summary.md").read_text()
    table = [line for line in md.splitlines() if line.startswith("|")]
    assert len(table) == 2 + 5  # header, alignment row, one row per job
    cells = [c.strip() for c in table[0].split("|")[1:-1]]
    assert cells[:5] == ["rank", "job", "lr", "status", "best val/acc"] and "max_epochs" not in md
    assert set(table[1].replace("|", "").replace(" ", "")) <= {"-", ":"}
    assert [line.split("|")[2].strip() for line in table[2:]] == ["1", "2", "4", "0", "3"]
    assert "| 0.92 |" in table[2] and "| 1.1 |" in table[2]  # 4 significant digits
    assert "FloatingPointError: loss is nan at step 7" in table[6]
    _assert_png(sweep / "summary.png")


def test_jobs_are_ranked_by_their_monitored_metric_and_mode(tmp_path: Path) -> None:
    """result.json's monitor/mode/best (trainer.monitor) rank the sweep: val/loss, lowest first."""
    d = tmp_path / "sweep"
    for job, loss, acc in (("0", 0.40, 0.90), ("1", 0.20, 0.80), ("2", 0.30, 0.95)):
        _write_job(
            d / job,
            [f"seed={job}"],
            [acc],
            _completed([acc], monitor="val/loss", mode="min", best=loss),
        )
    summary = write_summary(d)
    assert [r.job for r in summary.rows] == ["1", "2", "0"]
    assert [(r.monitor, r.mode, r.best) for r in summary.rows][0] == ("val/loss", "min", 0.2)
    _, rows = _read_csv(d / "summary.csv")
    assert [(r["monitor"], r["mode"], float(r["best"])) for r in rows] == [
        ("val/loss", "min", 0.2),
        ("val/loss", "min", 0.3),
        ("val/loss", "min", 0.4),
    ]
    # an explicit column and mode still rank by that column
    assert [r.job for r in write_summary(d, "best_val_acc", "max").rows] == ["2", "0", "1"]


def test_format_table_lists_failures(sweep: Path) -> None:
    summary = write_summary(sweep)
    lines = format_table(summary.rows, summary.swept_keys).splitlines()
    assert lines[0].split()[:6] == ["job", "lr", "status", "best", "val/acc", "epoch"]
    assert [line.split()[:2] for line in lines[2:7]] == [
        ["1", "0.1"],
        ["2", "0.3"],
        ["4", "0.2"],
        ["0", "0.01"],
        ["3", "3"],
    ]
    failed = lines[lines.index("Failed jobs:") + 1 :]
    assert failed == [
        "  job 4 [failed] lr=0.2: no result.json",
        "  job 3 [failed] lr=3: FloatingPointError: loss is nan at step 7",
    ]
    assert "Failed jobs" not in format_table([r for r in summary.rows if r.status == "completed"])


def test_a_job_still_running_is_not_reported_failed(sweep: Path) -> None:
    """The report of a sweep that is still running listed its running job (no result.json
    yet) as `failed: no result.json`: a job dir its run still holds is `running`, named with
    its holder, apart from the failed ones."""
    from ddp_launcher.core import run_lock

    run_lock.acquire(sweep / "4", "job #4 of a sweep")
    try:
        summary = write_summary(sweep)
    finally:
        run_lock.release(sweep / "4")
    (job4,) = [r for r in summary.rows if r.job == "4"]
    assert job4.status == "running" and "pid" in job4.error, job4
    lines = format_table(summary.rows, summary.swept_keys).splitlines()
    running = lines[lines.index("Running jobs:") + 1]
    assert running.startswith("  job 4 [running] lr=0.2: running (pid "), running
    assert not any("job 4" in line for line in lines[lines.index("Failed jobs:") :])


def test_attempts_come_from_launch_json(sweep: Path) -> None:
    """How often a launcher started each job (ddp_launcher/resume.py's launch.json: retries,
    resumed sweeps) is a column; a job dir without the record has none."""
    from ddp_launcher.core.run_dir import Attempt, LaunchRecord, write_launch_record

    tries = [Attempt(1, 1.0, 2.0, "failed"), Attempt(2, 3.0, 4.0, "failed", continued=True)]
    write_launch_record(sweep / "3", LaunchRecord(3, ["optim.lr=3.0"], tries))
    rows = {r.job: r for r in write_summary(sweep).rows}
    assert rows["3"].attempts == 2 and rows["0"].attempts is None
    _, table = _read_csv(sweep / "summary.csv")
    assert {r["job"]: r["attempts"] for r in table} == {
        "0": "",
        "1": "",
        "2": "",
        "3": "2",
        "4": "",
    }
    assert "attempts" in format_table(list(rows.values())).splitlines()[0]


def test_ranked_by_each_jobs_monitor_and_mode(tmp_path: Path) -> None:
    """Jobs that monitor val/loss (min) are ranked lowest first; test/* metrics get columns."""
    for num, losses in enumerate([[0.9, 0.5], [0.8, 0.7], [0.3, 0.4]]):
        accs = [2.0 - x for x in losses]
        result = _completed(
            accs,
            monitor="val/loss",
            mode="min",
            best=min(losses),
            best_epoch=losses.index(min(losses)) + 1,
            test={"test/acc": 0.5 + num},
        )
        _write_job(tmp_path / str(num), [f"seed={num}"], accs, result)
    summary = write_summary(tmp_path)
    assert [r.job for r in summary.rows] == ["2", "0", "1"] and summary.mode == "min"
    assert summary.ranked_by == "best val/loss"
    header = format_table(summary.rows, summary.swept_keys).splitlines()[0]
    assert "best val/loss" in header and "test/acc" in header and "seed" in header
    rows = write_summary(tmp_path, metric="wall_time_s", mode="min").rows  # another column
    assert [r.job for r in rows] == ["0", "1", "2"]  # ties keep job order
    with pytest.raises(ValueError, match="unknown metric"):
        write_summary(tmp_path, metric="val_acc")


def test_sweep_keys_of_an_optuna_sweep(tmp_path: Path) -> None:
    """Optuna's search space (hydra.sweeper.params) names the columns, even a param that all
    jobs so far happened to get the same value of."""
    (tmp_path / "multirun.yaml").write_text(
        "hydra:\n  overrides:\n    task: [hparams_search=digits_optuna]\n  sweeper:\n    params:\n"
        "      optim.lr: tag(log, interval(0.005, 0.5))\n      model.hidden: choice(64, 128)\n"
    )
    for num, (lr, hidden) in enumerate([("0.0123456", 64), ("0.3", 64)]):
        _write_job(
            tmp_path / str(num),
            [f"optim.lr={lr}", f"model.hidden={hidden}"],
            [0.5],
            _completed([0.5 + num / 10]),
        )
    jobs, keys, _ = read_sweep(tmp_path)
    assert keys == ["optim.lr", "model.hidden"]
    text = format_table(jobs, keys)
    assert text.splitlines()[0].split()[:3] == ["job", "lr", "hidden"]
    assert "0.01235" in text and "0.0123456" not in text


def test_job_dirs_with_any_name_and_natural_order(tmp_path: Path) -> None:
    for name in ["10", "2", "lr_big"]:
        _write_job(tmp_path / name, [f"name={name}"], [0.5], _completed([0.5]))
    (tmp_path / "only_metrics").mkdir()
    (tmp_path / "only_metrics" / "metrics.jsonl").write_text('{"epoch": 1, "val/acc": 0.1}\n')
    (tmp_path / ".submitit").mkdir()
    (tmp_path / "wandb").mkdir()  # the sweep-summary run's dir
    jobs = read_sweep(tmp_path)[0]
    assert [j.job for j in jobs] == ["2", "10", "lr_big", "only_metrics"]
    assert jobs[3].overrides == "" and jobs[3].best == pytest.approx(0.1)
    # ties keep job order
    assert [r.job for r in write_summary(tmp_path).rows] == ["2", "10", "lr_big", "only_metrics"]


def test_write_summary_without_jobs_raises(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no job dirs"):
        write_summary(tmp_path)
    assert not (tmp_path / "summary.csv").exists()


# Damaged job dirs (issue 55): (what the job dir holds, what the report says is wrong).
DAMAGED = {
    "final_x": ({"final": "x"}, "result.json: 'final' is a string, not an object or null"),
    "test_list": ({"test": [1]}, "result.json: 'test' is an array, not an object or null"),
    "no_metric": (
        {"target": {"value": 0.5, "reached_at_s": None}},
        "result.json: 'target' has no 'metric' (a string)",
    ),
    "best_text": ({"best": "0.9"}, "result.json: 'best' is a string, not a number or null"),
    # (an app's result.json as written whole: an evaluation's, its summary the measured)
    "raw_list": ([1, 2], "result.json holds an array, not an object"),
    "raw_summary": (
        {"status": "completed", "value": 0.9, "metric": "test/acc", "summary": [0.9]},
        "result.json: 'summary' is an array, not an object or null",
    ),
    "not_json": ("{'status': 'completed'", "result.json cannot be read"),
}


def damaged_sweep(root: Path, *names: str) -> Path:
    """Two completed jobs (0, 1), then one job dir per damaged record of `names` (DAMAGED)."""
    root.mkdir()
    _write_job(root / "0", ["optim.lr=0.1"], [0.5, 0.8], _completed([0.5, 0.8]))
    _write_job(root / "1", ["optim.lr=0.2"], [0.6, 0.7], _completed([0.6, 0.7]))
    for name in names:
        record, _ = DAMAGED[name]
        if name.startswith("raw"):
            (root / name / ".hydra").mkdir(parents=True)
            (root / name / "result.json").write_text(json.dumps(record))
        elif name == "not_json":
            _write_job(root / name, ["optim.lr=0.3"], [0.5], None)
            (root / name / "result.json").write_text(record)
        else:
            result = _completed([0.5, 0.6], **record)
            _write_job(root / name, ["optim.lr=0.3"], [0.5, 0.6], result)
    return root


def test_damaged_records_are_left_out_one_line_each(tmp_path: Path) -> None:
    """A result.json that is not what its writer writes: the job is left out of
    the table with one line naming its dir and what is wrong (summary.md too); the rest is
    reported as ever."""
    from ddp_launcher.report.sweep import headline, tables_text

    sweep_dir = damaged_sweep(tmp_path / "sweep", *DAMAGED)
    summary = write_summary(sweep_dir)
    assert [r.job for r in summary.rows] == ["0", "1"]
    said = {job_dir.name: why for job_dir, why in summary.unreadable}
    assert set(said) == set(DAMAGED)
    for name, (_, why) in DAMAGED.items():
        assert said[name].startswith(why), (name, said[name])
    text = tables_text(summary, ["seed"])
    for name in DAMAGED:
        lines = [line for line in text.splitlines() if str(sweep_dir / name) in line]
        assert len(lines) == 1 and lines[0].strip().endswith(said[name]), text
    assert headline(summary).startswith(f"Sweep summary: 2 jobs ({len(DAMAGED)} more unreadable)")
    markdown = (sweep_dir / "summary.md").read_text()
    assert all(f"- `{name}`: {said[name]}" in markdown for name in DAMAGED)
    assert [r["job"] for r in _read_csv(sweep_dir / "summary.csv")[1]] == ["0", "1"]


def test_a_sweep_of_only_damaged_records_is_one_error(tmp_path: Path) -> None:
    from ddp_launcher.report.jobs import UnreadableRecord

    sweep_dir = tmp_path / "sweep"
    damaged_sweep(sweep_dir, "final_x", "raw_list")
    for job in ("0", "1"):
        shutil.rmtree(sweep_dir / job)
    with pytest.raises(UnreadableRecord) as caught:
        write_summary(sweep_dir)
    message = str(caught.value)
    assert message.startswith(f"none of the 2 job dir(s) in {sweep_dir} could be read (")
    assert DAMAGED["final_x"][1] in message and DAMAGED["raw_list"][1] in message
    assert not (sweep_dir / "summary.csv").exists()


# --------------------------------------------------------------------------------------------
# the plot


def test_plot_readable_for_one_epoch_jobs_with_equal_curves(tmp_path: Path) -> None:
    """1-epoch jobs, two of them with the very same curves: three panels (val/acc, val/loss,
    train/loss), a marker on every curve, integer epoch ticks, equal curves told apart (style
    and position), and a legend of swept values only."""
    (tmp_path / "multirun.yaml").write_text(
        "hydra:\n  overrides:\n    task: [optim.lr=0.05,0.1, dist.nproc_per_node=1,2, "
        "trainer.max_epochs=1]\n"
    )
    for num, (lr, nproc) in enumerate([("0.05", 1), ("0.05", 2), ("0.1", 1)]):
        acc = 0.8 if lr == "0.05" else 0.7  # world-size invariant: #0 and #1 are equal
        overrides = [f"optim.lr={lr}", f"dist.nproc_per_node={nproc}", "trainer.max_epochs=1"]
        _write_job(tmp_path / str(num), overrides, [acc], _completed([acc]))
    import matplotlib.pyplot as plt

    summary = write_summary(tmp_path)
    fig = summary_figure(summary)
    try:
        axes = fig.axes
        assert [ax.get_title() for ax in axes] == ["val/acc", "val/loss", "train/loss"]
        for ax in axes:
            assert len(ax.lines) == 3
            assert all(line.get_marker() not in (None, "", "None") for line in ax.lines)
            ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
            assert ticks and all(float(t).is_integer() for t in ticks), ticks
        styles = [
            (line.get_color(), line.get_marker(), line.get_linestyle()) for line in axes[0].lines
        ]
        assert len(set(styles)) == 3
        xs = [line.get_xdata()[0] for line in axes[0].lines]  # one epoch's points, spread apart
        assert len(set(xs)) == 3 and all(abs(x - 1) < 0.25 for x in xs)
        labels = [t.get_text() for t in fig.legends[0].get_texts()]
        assert labels == [
            "#0 lr=0.05 nproc_per_node=1",
            "#1 lr=0.05 nproc_per_node=2",
            "#2 lr=0.1 nproc_per_node=1",
        ]
    finally:
        plt.close(fig)


# --------------------------------------------------------------------------------------------
# W&B: the sweep-summary run


def test_wandb_sweep_summary_run(sweep: Path) -> None:
    """One offline run with job_type=sweep_summary in the sweep's group: the summary table as a
    W&B Table (swept keys, metrics, status, each job's run) and the plot as an image."""
    import wandb

    summary = write_summary(sweep)
    try:
        run_id = log_to_wandb(summary, {"mode": "offline", "project": "p", "tags": ["t"]})
    finally:
        wandb.teardown()
    (run,) = offline_runs(sweep)
    assert run.run_id == run_id and run.job_type == JOB_TYPE and run.exit_code == 0
    assert run.group == sweep_group(None, sweep) and run.name == "summary"
    assert run.config["swept_keys"] == ["optim.lr"] and run.config["monitor"] == "val/acc"
    table = run.table("sweep/table")
    assert table["columns"][:5] == ["job", "lr", "status", "best val/acc", "epoch"]
    assert table["columns"][-2:] == ["run", "error"] and "wall_time_s" in table["columns"]
    by_job = {row[0]: dict(zip(table["columns"], row, strict=True)) for row in table["data"]}
    assert list(by_job) == ["1", "2", "4", "0", "3"]
    assert by_job["1"]["lr"] == 0.1 and by_job["1"]["best val/acc"] == 0.92
    assert by_job["1"]["run"] == "run392"  # offline: the run id (online: its URL)
    assert by_job["3"]["status"] == "failed" and "loss is nan" in by_job["3"]["error"]
    image = run.summary["sweep/plot"]
    assert image["_type"] == "image-file" and (run.files_dir / image["path"]).is_file()
    assert run.summary["best/val/acc"] == 0.92 and run.summary["best/job"] == "1"


def test_wandb_failure_is_a_warning(sweep: Path, monkeypatch, caplog) -> None:
    import wandb

    def broken(**_):
        raise RuntimeError("W&B is down")

    monkeypatch.setattr(wandb, "init", broken)
    summary = write_summary(sweep)
    assert log_to_wandb(summary, {"mode": "offline"}) is None
    assert "W&B run failed (W&B is down)" in caplog.text
    assert log_to_wandb(summary, {"mode": "disabled"}) is None


def test_no_wandb_run_on_a_full_disk_is_one_warning(sweep: Path, monkeypatch, caplog) -> None:
    """`python -m ddp_launcher.report SWEEP --wandb` on a full disk printed W&B's own logging
    failures (727 lines of '--- Logging error ---' tracebacks): with too little room for the
    run it starts none, in one warning naming the disk."""
    import wandb
    from ddp_launcher.core import disk

    summary = write_summary(sweep)
    monkeypatch.setattr(disk, "free_bytes", lambda path: 0)
    started = []
    monkeypatch.setattr(wandb, "init", lambda **kw: started.append(kw))
    assert log_to_wandb(summary, {"mode": "offline"}) is None
    assert started == [] and "no space left on the disk of" in caplog.text, caplog.text


# --------------------------------------------------------------------------------------------
# CLI


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ddp_launcher.report", *args],
        cwd=REPO,
        env=run_env(),  # this checkout's package, whichever the editable install names
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.slow
def test_cli_writes_files_and_prints_table(sweep: Path) -> None:
    proc = _cli(str(sweep))
    assert proc.returncode == 0, proc.stderr
    for name in ["summary.csv", "summary.md"]:
        assert (sweep / name).stat().st_size > 0
    _assert_png(sweep / "summary.png")
    assert [r["job"] for r in _read_csv(sweep / "summary.csv")[1]] == ["1", "2", "4", "0", "3"]
    assert proc.stdout.startswith("Sweep summary: 5 jobs, 3 completed, ranked by best val/acc")
    assert "Failed jobs:" in proc.stdout and "no result.json" in proc.stdout


@pytest.mark.slow
def test_cli_empty_dir_fails_with_one_line(tmp_path: Path) -> None:
    proc = _cli(str(tmp_path))
    assert proc.returncode != 0
    assert len(proc.stderr.strip().splitlines()) == 1
    assert proc.stderr.startswith("error:") and "no job dirs" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "summary.csv").exists()


@pytest.mark.slow
def test_cli_reads_what_it_can(tmp_path: Path) -> None:
    """Issue 55: each damaged record was a 21-25-line traceback and exit 1. Now: the table of
    the jobs it could read, one line per damaged job dir naming it and what is wrong, exit 0."""
    sweep_dir = damaged_sweep(tmp_path / "sweep", *DAMAGED)
    proc = _cli(str(sweep_dir))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "Traceback" not in out, out
    assert proc.stdout.startswith(f"Sweep summary: 2 jobs ({len(DAMAGED)} more unreadable)")
    for name, (_, why) in DAMAGED.items():
        said = [line for line in out.splitlines() if str(sweep_dir / name) in line]
        assert len(said) == 1 and why in said[0], (name, out)
    assert [r["job"] for r in _read_csv(sweep_dir / "summary.csv")[1]] == ["0", "1"]


@pytest.mark.slow
def test_cli_with_no_readable_job_is_one_line(tmp_path: Path) -> None:
    sweep_dir = damaged_sweep(tmp_path / "sweep", "final_x", "test_list")
    for job in ("0", "1"):
        shutil.rmtree(sweep_dir / job)
    proc = _cli(str(sweep_dir))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith(f"error: none of the 2 job dir(s) in {sweep_dir} could be read")
    assert len(proc.stderr.strip().splitlines()) == 1 and not proc.stdout


@pytest.mark.slow
def test_cli_on_a_read_only_sweep_dir_prints_its_tables(tmp_path: Path, sweep: Path) -> None:
    """A sweep dir the report cannot write (a read-only mount; root ignores permissions, so
    root gets one): the tables are printed, and the headline says the files were not
    written and why."""
    cmd = [sys.executable, "-m", "ddp_launcher.report", str(sweep)]
    if os.geteuid() == 0:
        mount = 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && exec "$@"'
        cmd = ["unshare", "--mount", "sh", "-c", mount, str(sweep), *cmd]
        if subprocess.run(["unshare", "--mount", "true"], capture_output=True).returncode:
            pytest.skip("root without a mount namespace: no read-only dir to be had")
    else:
        sweep.chmod(0o555)
    try:
        proc = subprocess.run(
            cmd, cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=120
        )
    finally:
        sweep.chmod(0o755)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "Traceback" not in out, out
    headline, *table = proc.stdout.splitlines()
    assert headline.startswith("Sweep summary: 5 jobs, 3 completed"), out
    assert headline.endswith(f"summary files not written into {sweep} (Read-only file system)") or (
        headline.endswith("(Permission denied)")
    ), headline
    assert table[0].split()[:3] == ["job", "lr", "status"] and "Failed jobs:" in table
    assert not any(sweep.glob("summary*")) and not any(sweep.glob(".summary*"))


# --------------------------------------------------------------------------------------------
# Hydra callback


APP = """\
import json
import sys
from pathlib import Path

sys.path.insert(0, {repo!r})

import hydra
from hydra.core.hydra_config import HydraConfig


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg):
    out = Path(HydraConfig.get().runtime.output_dir)
    acc = 0.1 * cfg.x
    with open(out / "metrics.jsonl", "w") as f:
        f.write(json.dumps({{"step": 0, "epoch": 0, "train/loss": 1.0, "lr": 0.1,
                            "samples_per_s": 10.0}}) + "\\n")
        f.write(json.dumps({{"step": 0, "epoch": 0, "val/loss": 1.0, "val/acc": acc}}) + "\\n")
    if cfg.x == cfg.fail_on:
        raise RuntimeError("job blew up")
    (out / "result.json").write_text(json.dumps({{
        "status": "completed", "error": None, "best_val_acc": acc, "final_val_acc": acc,
        "final_val_loss": 1.0, "wall_time_s": 0.1, "samples_per_s": 10.0}}))


if __name__ == "__main__":
    main()
"""

APP_CONFIG = """\
x: 0
fail_on: -1
hydra:
  job:
    chdir: false
  callbacks:
    sweep_summary:
      _target_: ddp_launcher.report.callback.SweepSummaryCallback
"""


def _run_app(tmp_path: Path, *overrides: str) -> tuple[subprocess.CompletedProcess, Path]:
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "config.yaml").write_text(APP_CONFIG)
    (tmp_path / "app.py").write_text(APP.format(repo=str(REPO)))
    sweep_dir = tmp_path / "multirun"
    proc = subprocess.run(
        [sys.executable, "app.py", "-m", "x=1,2,3", f"hydra.sweep.dir={sweep_dir}", *overrides],
        cwd=tmp_path,
        env=run_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    return proc, sweep_dir


@pytest.mark.slow
def test_callback_writes_summary_at_multirun_end(tmp_path: Path) -> None:
    """Another app (no `trainer`, no `wandb` node): its table, ranked, one column for x."""
    proc, sweep_dir = _run_app(tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (sweep_dir / "multirun.yaml").exists()
    _, rows = _read_csv(sweep_dir / "summary.csv")
    assert [(r["job"], r["x"], r["status"]) for r in rows] == [
        ("2", "3", "completed"),
        ("1", "2", "completed"),
        ("0", "1", "completed"),
    ]
    assert (sweep_dir / "summary.md").exists()
    _assert_png(sweep_dir / "summary.png")
    assert "Failed jobs" not in proc.stdout and "Sweep summary: 3 jobs, 3 completed" in proc.stdout
    assert not (sweep_dir / "wandb").exists()  # the app has no wandb settings


@pytest.mark.slow
def test_callback_writes_summary_when_a_job_fails(tmp_path: Path) -> None:
    proc, sweep_dir = _run_app(tmp_path, "fail_on=2")
    assert proc.returncode != 0
    assert "job blew up" in proc.stderr  # Hydra's own report of the failure is untouched
    failed_dir = sweep_dir / "1"
    assert (failed_dir / ".hydra" / "overrides.yaml").exists()
    assert not (failed_dir / "result.json").exists()
    _, rows = _read_csv(sweep_dir / "summary.csv")
    by_job = {r["job"]: r for r in rows}
    assert set(by_job) == {"0", "1", "2"}
    assert by_job["1"]["status"] == "failed" and by_job["1"]["overrides"] == "x=2 fail_on=2"
    assert by_job["1"]["error"] == "no result.json"
    assert by_job["0"]["status"] == by_job["2"]["status"] == "completed"
    _assert_png(sweep_dir / "summary.png")
    assert "Failed jobs:" in proc.stdout


def test_callback_never_raises_and_skips_empty_sweeps(tmp_path: Path) -> None:
    cfg = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path / "sweep")}}})
    cb = SweepSummaryCallback()
    cb.on_multirun_start(cfg)
    cb.report(cfg, " (the multirun did not finish)")  # no sweep dir / no jobs: nothing written
    assert not (tmp_path / "sweep").exists()
    cb.on_multirun_end(cfg)  # no jobs: a warning, not an exception
    assert not (tmp_path / "sweep").exists()

    bad = SweepSummaryCallback(metric="no_such_metric")
    (tmp_path / "sweep").mkdir()
    _write_job(tmp_path / "sweep" / "0", ["x=1"], [0.5], _completed([0.5]))
    bad.on_multirun_end(cfg)  # unknown metric: a warning, not an exception
    assert not (tmp_path / "sweep" / "summary.csv").exists()
    SweepSummaryCallback().on_multirun_start(OmegaConf.create({}))  # no hydra.sweep.dir


# --------------------------------------------------------------------------------------------
# An app of its own metric, without metrics.jsonl: ranked by the value its task returned

SCORE_APP = """\
import sys

sys.path.insert(0, {repo!r})

import hydra
from hydra.core.hydra_config import HydraConfig

import ddp_launcher


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg):
    score = (cfg.x - 2) ** 2 + 0.5 * cfg.x  # lower is better: x=2 first, then x=1, then x=3
    result = ddp_launcher.RunResult("completed", value=score, metric="score", direction="min")
    result.summary = {{"width": 10 * cfg.x}}  # a column of its own
    result.app = {{"seen": [cfg.x], "cost": 3 - cfg.x}}  # its own part: not shown, rankable
    ddp_launcher.write_result(HydraConfig.get().runtime.output_dir, result)
    return score


if __name__ == "__main__":
    main()
"""

SCORE_CONFIG = """\
x: 0
hydra:
  job:
    chdir: false
  callbacks:
    sweep_summary:
      _target_: ddp_launcher.report.callback.SweepSummaryCallback
"""


def _scored_jobs(root: Path) -> Path:
    """Three job dirs as SCORE_APP leaves them: result.json only, `score` lower is better."""
    from ddp_launcher import RunResult, write_result

    for num, x in enumerate((1, 2, 3)):
        job = root / str(num)
        (job / ".hydra").mkdir(parents=True)
        (job / ".hydra" / "overrides.yaml").write_text(f"- x={x}\n")
        result = RunResult("completed", value=(x - 2) ** 2 + 0.5 * x, metric="score")
        result.direction, result.summary, result.app = "min", {"width": 10 * x}, {"cost": 3 - x}
        write_result(job, result)
    return root


def test_an_app_without_metrics_is_ranked_by_its_value(tmp_path: Path) -> None:
    """Jobs whose metric is not val/acc and that write no metrics.jsonl: ranked by their value
    in their direction (min), their metric named in the table; the app's summary a column,
    its own part not shown but rankable by name; no figure (no curves), none referenced."""
    sweep_dir = _scored_jobs(tmp_path / "sweep")
    summary = write_summary(sweep_dir)
    assert [r.job for r in summary.rows] == ["1", "0", "2"]
    assert (summary.monitor, summary.mode, summary.ranked_by) == ("score", "min", "best score")
    header, rows = _read_csv(sweep_dir / "summary.csv")
    assert header[:6] == ["job", "x", "status", "best", "width", "wall_time_s"]
    assert [float(r["best"]) for r in rows] == [1.0, 1.5, 2.5]
    assert [r["monitor"] for r in rows] == ["score"] * 3 and rows[0]["mode"] == "min"
    assert not (sweep_dir / "summary.png").exists() and summary.panels == []
    md = (sweep_dir / "summary.md").read_text()
    assert "summary.png" not in md and "ranked by `best score` (min)" in md
    table = format_table(summary.rows, summary.swept_keys)
    assert table.splitlines()[0].split()[:5] == ["job", "x", "status", "best", "score"]
    assert "val/" not in md + table and "cost" not in header
    # a number of the app's own part, named: highest first unless told min
    assert [r.job for r in write_summary(sweep_dir, "cost").rows] == ["0", "1", "2"]
    assert [r.job for r in write_summary(sweep_dir, "width", "min").rows] == ["0", "1", "2"]
    with pytest.raises(ValueError, match="unknown metric 'val_acc': choose one of best"):
        write_summary(sweep_dir, "val_acc")


@pytest.mark.slow
def test_a_hydra_app_of_its_own_metric_gets_its_report(tmp_path: Path) -> None:
    """A @hydra.main app that names its metric and writes its value, no metrics.jsonl: the
    sweep's report (its callback) is ranked by the value it returned; the CLI says the same."""
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "config.yaml").write_text(SCORE_CONFIG)
    (tmp_path / "app.py").write_text(SCORE_APP.format(repo=str(REPO)))
    sweep_dir = tmp_path / "multirun"
    proc = subprocess.run(
        [sys.executable, "app.py", "-m", "x=1,2,3", f"hydra.sweep.dir={sweep_dir}"],
        cwd=tmp_path,
        env=run_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Sweep summary: 3 jobs, 3 completed, ranked by best score (min)" in proc.stdout
    _, rows = _read_csv(sweep_dir / "summary.csv")
    assert [(r["job"], r["x"], float(r["best"])) for r in rows] == [
        ("1", "2", 1.0),
        ("0", "1", 1.5),
        ("2", "3", 2.5),
    ]
    assert not (sweep_dir / "summary.png").exists()
    cli = _cli(str(sweep_dir))
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout.startswith("Sweep summary: 3 jobs, 3 completed, ranked by best score (min)")
    assert "summary.png" not in cli.stdout.splitlines()[0]


def test_the_cli_reports_as_the_sweeps_callback_set_it(sweep: Path) -> None:
    """`python -m ddp_launcher.report` takes the metric, mode, panels and aggregate keys of the
    sweep's own SweepSummaryCallback (its multirun.yaml) unless told otherwise."""
    from ddp_launcher.report.__main__ import CALLBACK, main

    assert f"{SweepSummaryCallback.__module__}.{SweepSummaryCallback.__qualname__}" == CALLBACK
    (sweep / "multirun.yaml").write_text(
        "hydra:\n  overrides:\n    task: [optim.lr=0.01,0.1,0.3,3.0,0.2, trainer.max_epochs=3]\n"
        "  callbacks:\n    sweep_summary:\n"
        "      _target_: ddp_launcher.report.callback.SweepSummaryCallback\n"
        "      metric: wall_time_s\n      mode: min\n      panels: [val/loss]\n"
    )
    assert main([str(sweep)]) == 0
    _, rows = _read_csv(sweep / "summary.csv")
    assert [r["job"] for r in rows] == ["3", "2", "0", "1", "4"]  # wall time, lowest first
    assert "![val/loss per epoch](summary.png)" in (sweep / "summary.md").read_text()
    assert main([str(sweep), "--metric", "best", "--mode", "max", "--panels", "val/acc"]) == 0
    assert [r["job"] for r in _read_csv(sweep / "summary.csv")[1]] == ["1", "2", "4", "0", "3"]
    assert "![val/acc per epoch](summary.png)" in (sweep / "summary.md").read_text()
