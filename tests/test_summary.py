"""launch/summary.py: sweep summary files, CLI and Hydra callback, on real files in tmp_path."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from launch.summary import (
    CSV_COLUMNS,
    SweepSummaryCallback,
    collect_jobs,
    format_table,
    write_summary,
)

REPO = Path(__file__).resolve().parents[1]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _write_job(
    job_dir: Path,
    overrides: list[str],
    accs: list[float],
    result: dict | None,
    truncate: bool = False,
) -> None:
    """A job dir as train.py + Hydra leave it: .hydra/overrides.yaml, metrics.jsonl, result.json."""
    (job_dir / ".hydra").mkdir(parents=True)
    (job_dir / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    lines = []
    for epoch, acc in enumerate(accs):
        for step in range(2):
            lines.append(
                {
                    "step": epoch * 2 + step,
                    "epoch": epoch,
                    "train/loss": 1.0 - acc,
                    "lr": 0.1,
                    "samples_per_s": 100.0 * (step + 1),
                }
            )
        lines.append({"step": epoch * 2 + 1, "epoch": epoch, "val/loss": 2.0 - acc, "val/acc": acc})
    text = "".join(json.dumps(row) + "\n" for row in lines)
    if truncate:
        text += '{"step": 99, "epoch": 9, "val/acc": 0.99, "val/lo'  # killed mid-write
    (job_dir / "metrics.jsonl").write_text(text)
    if result is not None:
        (job_dir / "result.json").write_text(json.dumps(result))


def _completed(best: float, final: float, **extra) -> dict:
    return {
        "status": "completed",
        "error": None,
        "best_val_acc": best,
        "final_val_acc": final,
        "final_val_loss": 2.0 - final,
        "wall_time_s": 12.5,
        "samples_per_s": 150.0,
        **extra,
    }


@pytest.fixture
def sweep(tmp_path: Path) -> Path:
    """3 completed jobs, 1 failed (result.json with an error), 1 killed (no result.json)."""
    d = tmp_path / "sweep"
    d.mkdir()
    (d / "multirun.yaml").write_text("hydra: {}\n")
    _write_job(d / "0", ["optim.lr=0.01"], [0.5, 0.8, 0.7], _completed(0.8, 0.7))
    _write_job(d / "1", ["optim.lr=0.1"], [0.6, 0.92, 0.9], _completed(0.92, 0.9))
    # result.json without the throughput and final loss: derived from metrics.jsonl
    res2 = _completed(0.85, 0.85)
    del res2["samples_per_s"], res2["final_val_loss"]
    _write_job(d / "2", ["optim.lr=0.3"], [0.7, 0.85], res2)
    _write_job(
        d / "3",
        ["optim.lr=3.0"],
        [],
        {
            "status": "failed",
            "error": "FloatingPointError: loss is nan at step 7",
            "best_val_acc": None,
            "final_val_acc": None,
            "final_val_loss": None,
            "wall_time_s": 3.0,
            "samples_per_s": None,
        },
    )
    _write_job(d / "4", ["optim.lr=0.2"], [0.83, 0.81], None, truncate=True)
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


def test_collect_jobs_reads_results_and_derives_from_metrics(sweep: Path) -> None:
    jobs = {j.job: j for j in collect_jobs(sweep)}
    assert sorted(jobs) == ["0", "1", "2", "3", "4"]
    assert jobs["1"].overrides == "optim.lr=0.1"
    assert jobs["1"].status == "completed" and jobs["1"].error is None
    assert jobs["1"].epochs == [(0, 0.6), (1, 0.92), (2, 0.9)]
    # result.json gaps filled from metrics.jsonl
    assert jobs["2"].final_val_loss == pytest.approx(2.0 - 0.85)
    assert jobs["2"].samples_per_s == pytest.approx(150.0)  # mean of 100, 200 train rows
    assert jobs["2"].wall_time_s == 12.5
    # failed: status and error from result.json
    assert jobs["3"].status == "failed"
    assert jobs["3"].error == "FloatingPointError: loss is nan at step 7"
    assert jobs["3"].best_val_acc is None and jobs["3"].epochs == []
    # killed: no result.json; truncated last line skipped (its 0.99 must not count)
    killed = jobs["4"]
    assert killed.status == "failed" and killed.error == "no result.json"
    assert killed.best_val_acc == pytest.approx(0.83)
    assert killed.final_val_acc == pytest.approx(0.81)
    assert killed.final_val_loss == pytest.approx(2.0 - 0.81)
    assert killed.samples_per_s == pytest.approx(150.0)
    assert killed.wall_time_s is None
    assert killed.epochs == [(0, 0.83), (1, 0.81)]


def test_write_summary_files(sweep: Path) -> None:
    summary = write_summary(sweep)
    assert [r.job for r in summary.rows] == ["1", "2", "4", "0", "3"]  # best first, None last

    header, rows = _read_csv(sweep / "summary.csv")
    assert summary.csv_path == sweep / "summary.csv"
    assert header == list(CSV_COLUMNS)
    assert [r["job"] for r in rows] == ["1", "2", "4", "0", "3"]
    assert [float(r["best_val_acc"]) for r in rows[:4]] == [0.92, 0.85, 0.83, 0.8]
    assert rows[4]["best_val_acc"] == ""
    assert rows[0]["overrides"] == "optim.lr=0.1" and rows[0]["status"] == "completed"
    assert rows[0]["error"] == ""
    assert rows[2]["status"] == "failed" and rows[2]["error"] == "no result.json"
    assert rows[4]["status"] == "failed"
    assert rows[4]["error"] == "FloatingPointError: loss is nan at step 7"
    assert float(rows[1]["samples_per_s"]) == pytest.approx(150.0)

    md = (sweep / "summary.md").read_text()
    table = [line for line in md.splitlines() if line.startswith("|")]
    assert len(table) == 2 + 5  # header, alignment row, one row per job
    assert "best_val_acc" in table[0] and "status" in table[0] and "error" in table[0]
    assert set(table[1].replace("|", "").replace(" ", "")) <= {"-", ":"}
    jobs_in_md = [line.split("|")[2].strip() for line in table[2:]]
    assert jobs_in_md == ["1", "2", "4", "0", "3"]
    assert "0.9200" in table[2] and "optim.lr=0.1" in table[2]
    assert "FloatingPointError: loss is nan at step 7" in table[6]

    _assert_png(sweep / "summary.png")


def test_format_table_lists_failures(sweep: Path) -> None:
    text = format_table(write_summary(sweep).rows)
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["job", "status", "best_val_acc"]
    assert [line.split()[0] for line in lines[2:7]] == ["1", "2", "4", "0", "3"]
    failed = lines[lines.index("Failed jobs:") + 1 :]
    assert len(failed) == 2
    assert "job 4" in failed[0] and "optim.lr=0.2" in failed[0] and "no result.json" in failed[0]
    assert "job 3" in failed[1] and "optim.lr=3.0" in failed[1]
    assert "loss is nan at step 7" in failed[1]


def test_attempts_come_from_launch_json(sweep: Path) -> None:
    """How often a launcher started each job (launch/resume.py's launch.json: retries,
    resumed sweeps) is a column; a job dir without the record has none."""
    from launch.resume import Attempt, LaunchRecord, write_launch_record

    tries = [Attempt(1, 1.0, 2.0, "failed"), Attempt(2, 3.0, 4.0, "failed", continued=True)]
    write_launch_record(sweep / "3", LaunchRecord(3, ["optim.lr=3.0"], tries))
    rows = {r.job: r for r in write_summary(sweep).rows}
    assert rows["3"].attempts == 2 and rows["0"].attempts is None
    _, table = _read_csv(sweep / "summary.csv")
    assert {r["job"]: r["attempts"] for r in table} == {"0": "", "1": "", "2": "", "3": "2",
                                                        "4": ""}  # fmt: skip
    assert "attempts" in format_table(list(rows.values())).splitlines()[0]


def test_format_table_without_failures(sweep: Path) -> None:
    rows = [r for r in collect_jobs(sweep) if r.status == "completed"]
    assert "Failed jobs" not in format_table(rows)


def test_sort_by_other_metric_and_mode(sweep: Path) -> None:
    rows = write_summary(sweep, metric="final_val_loss", mode="min").rows
    # final val loss = 2 - final acc: 1 (0.9), 2 (0.85), 4 (0.81), 0 (0.7); 3 has none
    assert [r.job for r in rows] == ["1", "2", "4", "0", "3"]
    rows = write_summary(sweep, metric="final_val_acc", mode="min").rows
    assert [r.job for r in rows] == ["0", "4", "2", "1", "3"]
    with pytest.raises(ValueError, match="unknown metric"):
        write_summary(sweep, metric="val_acc")


def test_job_dirs_with_any_name_and_natural_order(tmp_path: Path) -> None:
    for name in ["10", "2", "lr_big"]:
        _write_job(tmp_path / name, [f"name={name}"], [0.5], _completed(0.5, 0.5))
    (tmp_path / "only_metrics").mkdir()
    (tmp_path / "only_metrics" / "metrics.jsonl").write_text('{"epoch": 0, "val/acc": 0.1}\n')
    (tmp_path / ".submitit").mkdir()
    jobs = collect_jobs(tmp_path)
    assert [j.job for j in jobs] == ["2", "10", "lr_big", "only_metrics"]
    assert jobs[3].overrides == "" and jobs[3].best_val_acc == pytest.approx(0.1)
    # ties keep job order
    assert [r.job for r in write_summary(tmp_path).rows] == ["2", "10", "lr_big", "only_metrics"]


def test_write_summary_without_jobs_raises(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no job dirs"):
        write_summary(tmp_path)
    assert not (tmp_path / "summary.csv").exists()


# --------------------------------------------------------------------------------------------
# CLI


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "launch.summary", *args],
        cwd=REPO,
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
    assert "Failed jobs:" in proc.stdout and "no result.json" in proc.stdout


@pytest.mark.slow
def test_cli_empty_dir_fails_with_one_line(tmp_path: Path) -> None:
    proc = _cli(str(tmp_path))
    assert proc.returncode != 0
    assert len(proc.stderr.strip().splitlines()) == 1
    assert proc.stderr.startswith("error:") and "no job dirs" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "summary.csv").exists()


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
      _target_: launch.summary.SweepSummaryCallback
"""


def _run_app(tmp_path: Path, *overrides: str) -> tuple[subprocess.CompletedProcess, Path]:
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "config.yaml").write_text(APP_CONFIG)
    (tmp_path / "app.py").write_text(APP.format(repo=str(REPO)))
    sweep_dir = tmp_path / "multirun"
    proc = subprocess.run(
        [sys.executable, "app.py", "-m", "x=1,2,3", f"hydra.sweep.dir={sweep_dir}", *overrides],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
    )
    return proc, sweep_dir


@pytest.mark.slow
def test_callback_writes_summary_at_multirun_end(tmp_path: Path) -> None:
    proc, sweep_dir = _run_app(tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (sweep_dir / "multirun.yaml").exists()
    header, rows = _read_csv(sweep_dir / "summary.csv")
    assert header == list(CSV_COLUMNS)
    assert [(r["job"], r["overrides"], r["status"]) for r in rows] == [
        ("2", "x=3", "completed"),
        ("1", "x=2", "completed"),
        ("0", "x=1", "completed"),
    ]
    assert (sweep_dir / "summary.md").exists()
    _assert_png(sweep_dir / "summary.png")
    assert "Failed jobs" not in proc.stdout and "x=3" in proc.stdout


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
    fallback = cb._fallback
    assert callable(fallback)
    fallback()  # at exit with no sweep dir / no jobs: nothing written, nothing raised
    assert not (tmp_path / "sweep").exists()
    cb.on_multirun_end(cfg)  # no jobs: a warning, not an exception
    assert cb._fallback is None  # unregistered from atexit
    assert not (tmp_path / "sweep").exists()

    bad = SweepSummaryCallback(metric="no_such_metric")
    (tmp_path / "sweep").mkdir()
    _write_job(tmp_path / "sweep" / "0", ["x=1"], [0.5], _completed(0.5, 0.5))
    bad.on_multirun_end(cfg)  # unknown metric: a warning, not an exception
    assert not (tmp_path / "sweep" / "summary.csv").exists()
    SweepSummaryCallback().on_multirun_start(OmegaConf.create({}))  # no hydra.sweep.dir
