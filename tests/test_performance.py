"""Speed features on CPU: precision modes, gradient accumulation, channels_last, compile, and
the per-step speed metrics. (Speed itself is shown by `python -m docs.bench`, not asserted.)

Runs are in this process (world size 1) where no second rank is needed; the 2-rank
accumulation check (in tests/rank_pool.py's two ranks) and compilation are marked slow.
"""

import json
from pathlib import Path

import pytest
import torch

from components.checkpoint import load_checkpoint
from tests.helpers import output, run, train_cmd, train_in_process, train_rows

QUICK = ["trainer.max_epochs=1", "wandb.mode=disabled", "trainer.progress_bar=false"]


def result(run_dir: Path) -> dict:
    return json.loads((run_dir / "result.json").read_text())


# fp16 on a CPU is emulated: 3 epochs take 10+ s. 64: float64 weights and inputs (numerics checks)
@pytest.mark.parametrize("precision", ["bf16", "64", pytest.param("fp16", marks=pytest.mark.slow)])
def test_mixed_precision_and_channels_last_train(tmp_path, precision):
    run_dir = tmp_path / precision
    train_in_process(
        run_dir,
        *QUICK,
        "trainer.max_epochs=3",
        f"trainer.precision={precision}",
        "trainer.channels_last=true",
        "trainer.grad_clip=1.0",
    )
    assert result(run_dir)["best_val_acc"] > 0.5  # it learns (chance is 0.1)
    state = load_checkpoint(run_dir / "checkpoints" / "last.pt")
    # fp16 carries a GradScaler (scale state saved for exact resume); bf16 needs none
    assert bool(state["scaler"]) == (precision == "fp16")
    dtypes = {w.dtype for w in state["model"].values() if w.is_floating_point()}
    assert dtypes == {torch.float64 if precision == "64" else torch.float32}


def final_weights(run_dir: Path, accumulate: int, two_ranks=None) -> dict:
    overrides = [*QUICK, "trainer.batch_size=128", f"trainer.accumulate_grad_batches={accumulate}"]
    if two_ranks is None:
        train_in_process(run_dir, *overrides)
    else:
        two_ranks.train(run_dir, *overrides)
    return load_checkpoint(run_dir / "checkpoints" / "last.pt")


@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_accumulation_equals_the_bigger_batch(request, tmp_path, nproc):
    """batch 128 in 2 micro-batches (no_sync on the first) == batch 128 in one go."""
    ranks = request.getfixturevalue("two_ranks") if nproc == 2 else None  # tests/rank_pool.py
    one, two = (final_weights(tmp_path / f"acc{a}", a, ranks) for a in (1, 2))
    # 1437 samples // 128: the same optimizer steps
    assert one["progress"]["step"] == two["progress"]["step"] == 11
    for key in one["model"]:
        torch.testing.assert_close(one["model"][key], two["model"][key], rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_compile_path_runs(tmp_path):
    run_dir = tmp_path / "compiled"
    proc = run(
        train_cmd(
            *QUICK, "trainer.compile=true", "trainer.batch_size=256", f"hydra.run.dir={run_dir}"
        ),
        timeout=900,
    )
    assert proc.returncode == 0, output(proc)
    # the checkpoint holds the plain module's weights (no torch.compile prefix)
    state = load_checkpoint(run_dir / "checkpoints" / "last.pt")
    assert not any(k.startswith("_orig_mod.") for k in state["model"])


# Compiled and eager 2-rank runs of the same seed: the compiled kernels sum in another order, so
# they may differ in the last bits; after an epoch of 11 steps on digits the val loss agrees
# to within 1e-4 (measured: 6e-9) and every weight to within 1e-4.
COMPILE_TOLERANCE = 1e-4


@pytest.mark.slow
def test_compiled_ddp_trains_like_eager_on_two_ranks(tmp_path):
    """trainer.compile=true on 2 ranks (`python train.py dist.nproc_per_node=2`, gloo): dynamo's
    DDPOptimizer splits the graph at DDP's buckets (its log line, on both ranks), it trains as
    eager does, and the checkpoints keep the plain model's keys."""
    common = [*QUICK, "dist.nproc_per_node=2", "trainer.batch_size=128"]
    common += ["trainer.accumulate_grad_batches=2"]  # no_sync through the compiled module
    runs = {}
    # Every rank's output on the console (one run shows local rank 0's), to see both ranks' line
    common += ["hydra.launcher.tee=3"]
    for name, extra in (("eager", []), ("compiled", ["trainer.compile=true"])):
        runs[name] = tmp_path / name
        proc = run(
            train_cmd(*common, *extra, f"hydra.run.dir={runs[name]}"),
            timeout=900,
            TORCH_LOGS="+torch._dynamo.backends.distributed",
        )
        assert proc.returncode == 0, output(proc)
        if name == "compiled":
            used = [line for line in output(proc).splitlines() if "DDPOptimizer used" in line]
            assert {line[:7] for line in used} == {"[rank0]", "[rank1]"}, output(proc)
    eager, compiled = (result(runs[n])["final"] for n in ("eager", "compiled"))
    assert compiled["val/loss"] == pytest.approx(eager["val/loss"], abs=COMPILE_TOLERANCE)
    assert compiled["val/acc"] == pytest.approx(eager["val/acc"], abs=1 / eager["val/count"])
    plain, fast = (load_checkpoint(runs[n] / "checkpoints" / "last.pt") for n in runs)
    assert list(fast["model"]) == list(plain["model"])  # no _orig_mod. / module. prefix
    assert fast["progress"]["step"] == plain["progress"]["step"] > 0
    for key, weight in plain["model"].items():
        torch.testing.assert_close(fast["model"][key], weight, rtol=0, atol=COMPILE_TOLERANCE)


def compiled_types(rank: int, run_dir: str, overrides: list[str]) -> list[str]:
    """train.py's train(cfg) on this rank, recording what torch.compile is handed."""
    from tests.rank_pool import train_rank

    handed, real = [], torch.compile

    def spy(model, *args, **kwargs):
        handed.append(type(model).__name__)
        return real(model, *args, **kwargs)

    torch.compile = spy
    try:
        train_rank(rank, run_dir, overrides)
    finally:
        torch.compile = real
    return handed


@pytest.mark.slow
def test_compile_takes_the_ddp_wrapped_module(two_ranks, tmp_path):
    """What torch.compile compiles is the DDP wrapper (timm's and torch's order), not the
    model DDP then wraps."""
    overrides = [*QUICK, "trainer.compile=true", "trainer.limit_train_batches=2"]
    handed = two_ranks.run(compiled_types, str(tmp_path / "r"), overrides, timeout=600)
    assert handed == [["DistributedDataParallel"]] * 2


def test_speed_metrics_are_logged(tmp_path):
    run_dir = tmp_path / "r"
    train_in_process(run_dir, *QUICK, "trainer.log_every_n_steps=5")
    rows = train_rows(run_dir)
    assert rows
    for row in rows:
        assert row["samples_per_s"] > 0 and row["step_time_ms"] > 0 and row["peak_mem_mb"] > 0
        assert 0 <= row["data_wait_pct"] <= 100
        assert "mfu" not in row  # MFU needs a GPU's peak FLOP/s
    res = result(run_dir)
    assert res["time_to_first_step_s"] > 0 and len(res["peak_memory_mb_per_rank"]) == 1
