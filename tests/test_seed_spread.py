"""Workload V of the benchmark (docs/bench/seed_spread.py): its arithmetic (mean, sample std, worst
seed, the loss rise after the warm-up), its checks, its generated data and its sweep command."""

from __future__ import annotations

import dataclasses
import json
import math
import signal
import struct
from pathlib import Path

import pytest
from PIL import Image

from docs.bench import bench, seed_spread


def test_spread_is_mean_sample_std_and_worst():
    s = seed_spread.spread([0.97, 0.98, 0.99])
    assert s["mean"] == pytest.approx(0.98) and s["std"] == pytest.approx(0.01)
    assert s["worst"] == 0.97 and s["gap"] == pytest.approx(0.01)
    one = seed_spread.spread([0.9])
    assert (one["mean"], one["std"], one["worst"], one["gap"]) == (0.9, None, 0.9, 0.0)
    assert seed_spread.spread([])["mean"] is None


def test_loss_rise_counts_only_windows_after_the_lr_peak():
    rows = [
        {"train/loss": 2.0, "lr": 0.05},
        {"train/loss": 2.6, "lr": 0.1},  # at the peak: still the warm-up's
        {"train/loss": 1.0, "lr": 0.09},
        {"train/loss": 2.2, "lr": 0.05},
        {"val/acc": 0.5},  # not a train row
    ]
    assert seed_spread.loss_rise(rows) == pytest.approx(1.1)
    assert seed_spread.loss_rise(rows[:2]) is None  # nothing after the warm-up
    assert seed_spread.loss_rise([]) is None


def seed(value, status="completed", rise=0.5, diverged=None, nonfinite=False):
    return {
        "seed": 0,
        "status": status,
        "value": value,
        "diverged": diverged,
        "nonfinite": nonfinite,
        "rise": rise,
        "error": None,
    }


def test_checks_of_a_row():
    good = seed_spread.summarize("digits", 2, [seed(0.98), seed(0.97), seed(0.99)], 10.0, [])
    assert good["passed"] and good["worst"] == 0.97
    assert set(good["checks"]) >= {"worst within 2 points of the mean", "mean >= 0.975"}
    # One seed 3 points below the others: worse than 2 points below the mean
    low = seed_spread.summarize("folder96", 2, [seed(0.99), seed(0.99), seed(0.95)], 1.0, [])
    assert not low["checks"]["worst within 2 points of the mean"] and not low["passed"]
    climbed = seed_spread.summarize("folder96", 2, [seed(0.99, rise=1.2)], 1.0, [])
    assert not climbed["checks"]["loss never above its first window after the warm-up"]
    warned = seed_spread.summarize("folder96", 2, [seed(0.99, diverged={"step": 3})], 1.0, [])
    assert not warned["checks"]["no divergence warning"]
    stopped = seed_spread.summarize(
        "folder96", 2, [seed(0.99), seed(None, "failed", None, None, True)], 1.0, []
    )
    assert not stopped["checks"]["all completed"] and not stopped["checks"]["no non-finite loss"]
    assert stopped["mean"] == 0.99  # over the finished seeds
    text = seed_spread.table([good, stopped])
    assert "97.00 / 99.00" in text and "98.00 ± 1.00" in text and "MISS: all completed" in text
    assert "failed" in text


def test_seed_result_reads_a_job_dir(tmp_path: Path):
    job = tmp_path / "3"
    job.mkdir()
    (job / "launch.json").write_text(json.dumps({"overrides": ["seed=4", "dist.nproc_per_node=2"]}))
    result = {"status": "completed", "final": {"val/acc": 0.9}, "test": None, "diverged": None}
    (job / "result.json").write_text(json.dumps(result))
    rows = [{"train/loss": 2.0, "lr": 0.1}, {"train/loss": 1.0, "lr": 0.05}, {"val/acc": 0.9}]
    (job / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = seed_spread.seed_result(job, "val/acc")
    assert (got["seed"], got["value"], got["rise"], got["nonfinite"]) == (4, 0.9, 0.5, False)


def test_generated_data(tmp_path: Path):
    folder = seed_spread.make_digit_folder(tmp_path / "f", 32)
    pngs = sorted((folder / "train").glob("*/*.png"))
    assert len(pngs) == 1797 and len({p.parent.name for p in pngs}) == 10
    assert Image.open(pngs[0]).size == (32, 32)
    raw = seed_spread.make_digit_mnist(tmp_path / "m", copies=2) / "MNIST" / "raw"
    header = (raw / "train-images-idx3-ubyte").read_bytes()[:16]
    assert struct.unpack(">HBB3I", header) == (0, 8, 3, 2 * 1797, 28, 28)
    labels = (raw / "t10k-labels-idx1-ubyte").read_bytes()[8:]
    assert len(labels) == 1797 and set(labels) == set(range(10))


def test_sweep_command_and_bench_arguments(tmp_path: Path):
    cmd = seed_spread.sweep_command("mnist", 2, tmp_path / "data", tmp_path / "sweep")
    assert cmd[1:5] == ["train.py", "-m", "seed=0,1,2,3,4", "dist.nproc_per_node=2"]
    assert "dataset=mnist" in cmd and f"dataset.root={tmp_path / 'data'}" in cmd
    assert "dataset.root" not in " ".join(seed_spread.sweep_command("digits", 1, None, tmp_path))
    args = bench.parse_args(["--workloads", "V", "--v-defaults", "digits,folder32"])
    assert args.workloads == ["V"] and args.v_defaults == ["digits", "folder32"]
    with pytest.raises(SystemExit):
        bench.parse_args(["--workloads", "V", "--v-defaults", "cifar10"])
    assert math.isclose(seed_spread.WORST_GAP, 0.02)


@pytest.mark.slow
def test_workload_v_end_to_end_on_generated_scans(tmp_path: Path, monkeypatch, capsys):
    """`python -m docs.bench --workloads V` as the command runs it (in this process: the sweep
    is a real train.py -m sweep of its own processes), on the generated 32-px folder, the run
    shortened to 1 epoch per seed so that the test times the code, not the training."""
    short = dataclasses.replace(
        seed_spread.DEFAULTS["folder32"],
        overrides=(*seed_spread.DEFAULTS["folder32"].overrides, "trainer.max_epochs=1"),
    )
    monkeypatch.setitem(seed_spread.DEFAULTS, "folder32", short)
    out = tmp_path / "r.json"
    argv = ["--workloads", "V", "--v-defaults", "folder32", "--world-sizes", "1"]
    sigterm = signal.getsignal(signal.SIGTERM)  # main() turns SIGTERM into an exit
    try:
        status = bench.main([*argv, "--out", str(out), "--work-dir", str(tmp_path / "work")])
    finally:
        signal.signal(signal.SIGTERM, sigterm)
    printed = capsys.readouterr().out
    assert status == 0, printed[-3000:]
    (row,) = json.loads(out.read_text())["seed_spread"]
    assert (row["default"], row["world_size"], row["metric"]) == ("folder32", 1, "val/acc")
    assert [s["seed"] for s in row["seeds"]] == list(seed_spread.SEEDS)
    assert all(s["status"] == "completed" and 0 < s["value"] <= 1 for s in row["seeds"])
    assert row["mean"] == pytest.approx(
        sum(s["value"] for s in row["seeds"]) / len(seed_spread.SEEDS)
    )
    assert row["checks"]["all completed"] and row["checks"]["no non-finite loss"]
    assert (tmp_path / "work" / "data" / "folder32").is_dir()  # generated, kept in --work-dir
    assert "[V folder32 world 1]" in printed
    (line,) = [x for x in printed.splitlines() if x.startswith("| folder32")]
    assert [c.strip() for c in line.split("|")[2:4]] == ["1", "val/acc"]
