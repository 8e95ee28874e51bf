"""Speed features on CPU: precision modes, gradient accumulation, channels_last, compile, and
the per-step speed metrics. (Speed itself is shown by `python -m bench.bench`, not asserted.)"""

import json
from pathlib import Path

import pytest
import torch

from components.checkpoint import load_checkpoint
from tests.helpers import output, run, train_cmd

pytestmark = pytest.mark.slow

QUICK = ["trainer.max_epochs=1", "wandb.mode=disabled", "trainer.progress_bar=false"]


def result(run_dir: Path) -> dict:
    return json.loads((run_dir / "result.json").read_text())


def train_rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "train/loss" in r]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_and_channels_last_train(tmp_path, precision):
    run_dir = tmp_path / precision
    proc = run(train_cmd(*QUICK, "trainer.max_epochs=2", f"trainer.precision={precision}",
                         "trainer.channels_last=true", "trainer.grad_clip=1.0",
                         f"hydra.run.dir={run_dir}"))  # fmt: skip
    assert proc.returncode == 0, output(proc)
    assert result(run_dir)["best_val_acc"] > 0.6  # it learns (chance is 0.1)
    state = load_checkpoint(run_dir / "checkpoints" / "last.pt")
    # fp16 carries a GradScaler (scale state saved for exact resume); bf16 needs none
    assert bool(state["scaler"]) == (precision == "fp16")


@pytest.mark.parametrize("nproc", [1, 2])
def test_accumulation_equals_the_bigger_batch(tmp_path, nproc):
    """batch 128 in 2 micro-batches (no_sync on the first) == batch 128 in one go."""
    finals = []
    for accumulate in (1, 2):
        run_dir = tmp_path / f"acc{accumulate}"
        launch = None if nproc == 1 else nproc
        proc = run(train_cmd(*QUICK, "trainer.batch_size=128",
                             f"trainer.accumulate_grad_batches={accumulate}",
                             f"hydra.run.dir={run_dir}", nproc=launch))  # fmt: skip
        assert proc.returncode == 0, output(proc)
        finals.append(load_checkpoint(run_dir / "checkpoints" / "last.pt"))
    one, two = finals
    # 1437 samples // 128: the same optimizer steps
    assert one["progress"]["step"] == two["progress"]["step"] == 11
    for key in one["model"]:
        torch.testing.assert_close(one["model"][key], two["model"][key], rtol=1e-4, atol=1e-5)


def test_indivisible_accumulation_is_a_clear_error(tmp_path):
    proc = run(train_cmd(*QUICK, "trainer.batch_size=64", "trainer.accumulate_grad_batches=3",
                         f"hydra.run.dir={tmp_path / 'r'}"), timeout=120)  # fmt: skip
    assert proc.returncode == 2
    assert "trainer.batch_size=64 (the global batch) is not divisible by the world size 1 x " \
        "trainer.accumulate_grad_batches=3" in output(proc)


def test_compile_path_runs(tmp_path):
    run_dir = tmp_path / "compiled"
    proc = run(train_cmd(*QUICK, "trainer.compile=true", "trainer.batch_size=256",
                         f"hydra.run.dir={run_dir}"), timeout=900)  # fmt: skip
    assert proc.returncode == 0, output(proc)
    # the checkpoint holds the plain module's weights (no torch.compile prefix)
    state = load_checkpoint(run_dir / "checkpoints" / "last.pt")
    assert not any(k.startswith("_orig_mod.") for k in state["model"])


def test_speed_metrics_are_logged(tmp_path):
    run_dir = tmp_path / "r"
    proc = run(train_cmd(*QUICK, "trainer.log_every_n_steps=5", f"hydra.run.dir={run_dir}"))
    assert proc.returncode == 0, output(proc)
    rows = train_rows(run_dir)
    assert rows
    for row in rows:
        assert row["samples_per_s"] > 0 and row["step_time_ms"] > 0 and row["peak_mem_mb"] > 0
        assert 0 <= row["data_wait_pct"] <= 100
        assert "mfu" not in row  # MFU needs a GPU's peak FLOP/s
    res = result(run_dir)
    assert res["time_to_first_step_s"] > 0 and len(res["peak_memory_mb_per_rank"]) == 1
