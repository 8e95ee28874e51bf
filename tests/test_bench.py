"""The throughput benchmark (docs/bench/bench.py): end to end in its smoke size, no timing
assertions; and checks that its three modes really run the same workload as train.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from PIL import Image
from torchvision.datasets import MNIST

import conf.schema  # noqa: F401 - registers the schema for compose()
from core.hydra_compat import VERSION_BASE
from data import build_datasets
from data.transforms import NORMALIZATION, build_recipe
from docs.bench import bench, common, workloads
from docs.bench import reference as bench_reference
from tests.helpers import REPO, run_env


def composed(workload: str, data_root: Path | None = None, workers: int | None = 0):
    """train.py's config for a workload, composed from the benchmark's own overrides."""
    setup = workloads.Setup(
        workload,
        1,
        steps=4,
        log_every=2,
        data_root=data_root,
        threads=1,
        workers=None if workload == "B" else workers,
    )
    overrides = [
        o for o in bench.train_overrides(setup, Path("unused")) if not o.startswith("hydra.")
    ]
    with initialize_config_dir(config_dir=str(REPO / "conf"), **VERSION_BASE):
        return compose("train", overrides=overrides)


@pytest.mark.parametrize("workload", sorted(workloads.WORKLOADS))
def test_reference_matches_train_config(workload, tmp_path):
    """Same network, optimizer settings, batch, data size and per-sample work on both sides."""
    cfg = composed(workload, tmp_path)
    spec = workloads.WORKLOADS[workload]
    assert cfg.trainer.batch_size == spec.global_batch
    assert cfg.trainer.max_epochs == 1 and cfg.trainer.log_every_n_steps == 2
    assert cfg.wandb.mode.value == "disabled" and cfg.trainer.device == "cpu"
    assert cfg.optim._target_ == "torch.optim.SGD"
    assert (cfg.optim.lr, cfg.optim.momentum, cfg.optim.weight_decay) == (
        bench_reference.LR,
        bench_reference.MOMENTUM,
        bench_reference.WEIGHT_DECAY,
    )
    assert not cfg.optim.nesterov and cfg.optim.lr_scaling == "none"
    assert cfg.optim.decay_norm_and_bias  # one parameter group, as the reference's
    for key, plain in (
        ("precision", "32"),
        ("accumulate_grad_batches", 1),
        ("channels_last", False),
        ("compile", False),
        ("grad_clip", None),
    ):
        assert cfg.trainer.get(key, plain) == plain, key

    channels, size = spec.shape[0], spec.shape[1]
    theirs = instantiate(cfg.model, num_classes=10, in_channels=channels, image_size=size)
    ours = bench_reference.build_model(workload)
    assert [(n, p.shape) for n, p in theirs.named_parameters()] == [
        (n, p.shape) for n, p in ours.named_parameters()
    ]
    assert str(theirs) == str(ours)

    name = cfg.dataset._target_.rsplit(".", 1)[-1]
    assert cfg.dataset._target_ == f"data.catalog.{name}"
    assert name == {"A": "fake", "B": "mnist", "C": "fake", "D": "imagefolder"}[workload]
    norm = {
        "fake": bench_reference.FAKE_NORM,
        "mnist": bench_reference.MNIST_NORM,
        "imagefolder": bench_reference.IMAGENET_NORM,
    }[name]
    assert NORMALIZATION[name] == norm
    recipe = build_recipe(cfg.augment)
    assert cfg.trainer.mixup.mixup_alpha == cfg.trainer.mixup.cutmix_alpha == 0
    assert cfg.dataset.get("num_workers") == ("auto" if workload == "B" else "0")
    if workload in ("A", "C"):
        assert recipe.crop == "none" and not recipe.flip  # no augmentation on either side
        assert cfg.dataset.size == 4 * spec.global_batch and cfg.dataset.image_size == size
        assert cfg.model.small_input_stem == (workload == "A")
    elif workload == "B":
        assert recipe.fast(size).padding == bench_reference.MNIST_PADDING and not recipe.flip
        assert cfg.dataset.root == str(tmp_path)
    else:  # RandomResizedCrop(size, torchvision's default scale and ratio) + flip, both sides
        common.make_jpegs(tmp_path, per_class=1, val_per_class=1)
        reference = bench_reference.build_dataset(workload, 4 * spec.global_batch, str(tmp_path))
        crop, flip = reference.transform.transforms[:2]
        assert type(flip).__name__ == "RandomHorizontalFlip" and flip.p == 0.5
        assert recipe.crop == "resized" and recipe.flip and cfg.dataset.image_size == size
        assert (tuple(recipe.scale), tuple(recipe.ratio)) == (crop.scale, crop.ratio)
        assert tuple(crop.size) == (size, size)
        assert cfg.dataset.root == str(tmp_path)


@pytest.fixture
def jpeg_root(tmp_path):
    root = tmp_path / "jpegs"
    common.make_jpegs(root, per_class=-(-4 * 64 // common.JPEG_CLASSES), val_per_class=1)
    return root


def test_generated_jpegs_train_on_the_steps_asked_for(jpeg_root):
    splits = build_datasets(composed("D", jpeg_root).dataset)
    assert len(splits.train) // 64 == 4 and len(splits.val) == common.JPEG_CLASSES
    files = sorted((jpeg_root / "train").rglob("*.jpg"))
    sides = {side for f in files[:40] for side in Image.open(f).size}
    assert min(sides) >= common.JPEG_SIDES[0] and max(sides) <= common.JPEG_SIDES[1]
    assert len(sides) > 5  # sizes vary
    x, _ = splits.train[0]
    assert x.shape == workloads.WORKLOADS["D"].shape


def test_cells_and_workers():
    spec = workloads.WORKLOADS["C"]
    assert bench.cells(spec, None, smoke=False) == [(1, 0), (1, 2), (2, 0), (2, 2)]
    assert bench.cells(spec, None, smoke=True) == [(2, 2)]
    assert bench.cells(workloads.WORKLOADS["B"], [1], smoke=False) == [(1, None)]
    auto = bench.cells(workloads.WORKLOADS["D"], [1, 2], smoke=False)
    assert [w for _, w in auto] == [
        bench.resolve_workers("auto", 1),
        bench.resolve_workers("auto", 2),
    ]


def test_generated_mnist_trains_on_the_steps_asked_for(tmp_path):
    common.make_mnist(tmp_path, n_train=bench.train_file_size(4 * 256), n_test=5)
    splits = build_datasets(composed("B", tmp_path).dataset)
    assert len(splits.train) == 4 * 256  # one epoch: 4 steps of the global batch


def test_generated_mnist_reads_back(tmp_path):
    common.make_mnist(tmp_path, n_train=12, n_test=5)
    train, test = MNIST(tmp_path, train=True), MNIST(tmp_path, train=False)
    assert train.data.shape == (12, 28, 28) and train.data.dtype == torch.uint8
    assert len(test) == 5 and 0 <= int(train.targets.min()) <= int(train.targets.max()) <= 9


def test_steady_rate_drops_warmup_and_ratios():
    assert workloads.steady_rate([1.0, 10.0, 12.0, 11.0]) == 11.0
    assert workloads.steady_rate([5.0]) == 5.0  # too few windows: all of them
    assert workloads.steady_rate([]) is None
    assert common.ratio(3.0, 2.0) == 1.5 and common.ratio(None, 2.0) is None
    assert bench.overrides_for("A", ["x=1", "B:y=2", "A:z=3"]) == ("x=1", "z=3")


def test_process_age_is_positive():
    assert 0 < common.process_age() < 1e6


def run_bench(*args: str) -> subprocess.CompletedProcess:
    """`python -m docs.bench ARGS` to completion; it must exit 0."""
    proc = subprocess.run(
        [sys.executable, "-m", "docs.bench", *args],
        cwd=REPO,
        env=run_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_smoke_end_to_end(tmp_path):
    out = tmp_path / "r.json"
    proc = run_bench("--smoke", "--out", str(out))
    report = json.loads(out.read_text())
    rows = {(row["workload"], row["world_size"]): row for row in report["rows"]}
    assert set(rows) == {
        (w, n) for w, spec in workloads.WORKLOADS.items() for n in spec.smoke_world_sizes
    }
    assert {n for _, n in rows} == {1, 2} and set(workloads.WORKLOADS) == {"A", "B", "C", "D"}
    assert rows["C", 2]["workers"] == 2 and rows["B", 2]["workers"] is None
    for (workload, world), row in rows.items():
        rate = row["samples_per_s"]
        for mode in workloads.MODES:
            assert rate[mode] is not None and rate[mode] > 0, (workload, world, mode)
            runs = row["runs"][mode]
            assert len(runs) == 1 and runs[0]["samples_per_s"] == rate[mode]
            assert len(row["peak_memory_mb_per_rank"][mode] or [0] * world) == world
        assert row["ratios"]["train_vs_reference"] == pytest.approx(
            rate["train.py"] / rate["reference"]
        )
        assert row["ratios"]["train_vs_raw"] == pytest.approx(rate["train.py"] / rate["raw"])
        assert row["time_to_first_step_s"]["reference"] > 0 and row["import_s"] > 0
        for target in row["targets"].values():
            assert target["verdict"] in ("PASS", "MISS", "n/a")
        first_step = f"1st step <= import + {workloads.FIRST_STEP_MARGIN_S[world]} s"
        assert set(row["targets"]) == {
            first_step,
            next(name for name, w, _ in workloads.TARGETS if w == workload),
        }
    assert report["table"] in proc.stdout
    for row in report["rows"]:
        for name in row["targets"]:
            assert name in proc.stdout
    assert {
        "A: train/ref >= 1.0",
        "B: train/raw >= 0.95",
        "C: train/ref >= 1.0",
        "D: train/ref >= 1.3",
    } <= set(report["targets"])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_compare_python_runs_every_mode_again_with_the_other_interpreter(tmp_path):
    """--compare-python PY (torch versions side by side): each cell runs its modes under both
    interpreters in one rotation; one row each, labelled with its Python and torch."""
    out = tmp_path / "r.json"
    other = tmp_path / "other-python"  # another path to this interpreter: it must be the one run
    other.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    other.chmod(0o755)
    proc = run_bench(
        "--smoke", "--workloads", "B", "--compare-python", str(other), "--out", str(out)
    )
    rows = json.loads(out.read_text())["rows"]
    assert [row["workload"] for row in rows] == ["B", "B"]
    import torch

    label = f"py {sys.version.split()[0]}, torch {torch.__version__}"
    assert [row["python"] for row in rows] == [label, label]
    for row, python in zip(rows, (sys.executable, str(other)), strict=True):
        for mode in workloads.MODES:
            (run,) = row["runs"][mode]
            assert run["samples_per_s"] > 0 and run["command"][0] == python, (mode, run)
    assert f"B ({label})" in proc.stdout


# --- workload G: the GPU check (docs/bench/gpu.py) -------------------------------------------


def test_gpu_check_without_a_gpu_says_so_in_one_line_and_fails(tmp_path):
    """Here (and in the suite on any host: tests/conftest.py hides the GPUs) torch sees none."""
    proc = subprocess.run(
        [sys.executable, "-m", "docs.bench", "--workloads", "G", "--out", str(tmp_path / "r")],
        cwd=REPO,
        env=run_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, lines
    assert "needs a CUDA GPU" in lines[0] and "torch sees none" in lines[0]
    assert not (tmp_path / "r").exists()  # nothing ran


def test_gpu_check_cells_use_train_configs_that_compose(tmp_path, monkeypatch):
    """Every train.py cell of the GPU check composes, on CUDA, with what its name says: run
    first on a GPU machine, a cell must not fail on a config key."""
    from docs.bench import gpu

    commands = {}
    monkeypatch.setattr(
        gpu, "train_cell", lambda name, cmd, run_dir, t: commands.setdefault(name, cmd) and {}
    )
    cells = gpu.plan(tmp_path)
    assert len({name for name, _, _ in cells}) == len(cells)
    for name, limit, cell in cells:
        assert 0 < limit <= gpu.BUDGET_S
        cell(name, limit)
    assert len(commands) == 9  # 3 ways a rank starts + 6 throughput cells
    for name, cmd in commands.items():
        overrides = [o for o in cmd[cmd.index("train.py") + 1 :] if not o.startswith("hydra.")]
        sweep = "-m" in overrides
        overrides = [o for o in overrides if o != "-m"]
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
            cfg = compose("train", overrides=overrides)
        assert cfg.trainer.device == "cuda" and cfg.trainer.max_epochs == 1, name
        assert sweep == name.startswith("1-rank sweep job")
        if "bf16" in name:
            assert cfg.model.name == name.split()[0] and cfg.trainer.precision == "bf16"
            assert cfg.trainer.channels_last and cfg.dataset.fast == ("fast path" in name)
            assert cfg.trainer.compile == name.endswith("compiled")
            assert cfg.trainer.limit_train_batches == gpu.STEPS
