"""The throughput benchmark (docs/bench/bench.py): end to end in its smoke size, no timing
assertions; and checks that its three modes really run the same workload as train.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ddp_launcher.core.hydra_compat import VERSION_BASE
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from PIL import Image
from torchvision.datasets import MNIST

import conf.schema  # noqa: F401 - registers the schema for compose()
from data import build_datasets
from data.transforms import NORMALIZATION, build_recipe
from docs.bench import bench, common, workloads
from docs.bench import reference as bench_reference
from tests.helpers import IMPORT_PATH, REPO, run_env


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


@pytest.mark.slow
def test_gpu_check_without_a_gpu_says_so_in_one_line_and_fails(tmp_path):
    """Here (and in the suite on any host: tests/suite_plugin.py hides the GPUs) torch sees none."""
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


# What hides packages from a process (and the processes it starts), as on a GPU machine that
# holds only torch and torchvision: a sitecustomize on PYTHONPATH that fails their imports.
HIDE_PACKAGES = """
import importlib.abc, sys

class Hidden(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {hidden!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)

sys.meta_path.insert(0, Hidden())
"""


@pytest.mark.slow
def test_gpu_check_without_its_packages_says_so_in_one_line_and_fails(tmp_path):
    """Without Hydra and OmegaConf (a bare GPU machine), G's preflight stops before any cell:
    one line naming what is missing and the command that installs it, exit status 2."""
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(HIDE_PACKAGES.format(hidden={"hydra", "omegaconf"}))
    proc = subprocess.run(
        [sys.executable, "-m", "docs.bench", "--workloads", "G", "--out", str(tmp_path / "r")],
        cwd=REPO,
        env=run_env(PYTHONPATH=f"{hide}{os.pathsep}{IMPORT_PATH}"),
        capture_output=True,
        text=True,
        timeout=180,
    )
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, lines
    assert lines[0].startswith("workload G needs hydra-core, omegaconf, ")
    assert "python -m docs.bench.gpu run .whl" in lines[0]
    assert "torch sees none" not in lines[0]  # what is missing first: it is what stops a GPU
    assert not (tmp_path / "r").exists()  # nothing ran


@pytest.mark.slow
def test_gpu_check_states_what_it_ran_on():
    """G's preflight probe (the process every cell's environment matches) finds torch's,
    CUDA's, torchvision's and Python's versions; the table's first line states them with the
    GPU and its driver."""
    from docs.bench import gpu

    proc = subprocess.run(
        [sys.executable, "-m", "docs.bench.gpu", "probe"],
        cwd=REPO,
        env=run_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr
    found = gpu.result_line(proc.stdout)
    import platform

    import torchvision

    assert found == {
        "missing": [],
        "count": 0,  # tests/suite_plugin.py hides any GPU
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "torchvision": torchvision.__version__,
    }
    h100 = {"name": "NVIDIA H100 80GB HBM3", "capability": "9.0", "driver": "580.95.05"}
    h100 |= {"count": 1, "torch": "2.11.0+cu130", "cuda": "13.0", "torchvision": "0.26.0"}
    assert gpu.machine_line({**h100, "python": "3.12.3"}) == (
        "NVIDIA H100 80GB HBM3 (compute capability 9.0, driver 580.95.05; 1 visible), torch "
        "2.11.0+cu130 (CUDA 13.0), torchvision 0.26.0, Python 3.12.3"
    )


def test_gpu_check_wheels_are_the_locks_closure_of_what_it_imports():
    """The wheels G carries to a GPU machine are read from requirements.lock, for each Python
    the repo supports: what G's processes import (WHEELS, each a package requirements.txt asks
    for) and everything the lock has them bring there, at the lock's versions, less torch's and
    torchvision's own. Nothing is written by hand but WHEELS. Here, by the installed packages'
    own metadata, that set is closed: nothing one of them needs is left out (torch's side
    aside), nothing unneeded is in."""
    from importlib.metadata import PackageNotFoundError, requires

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    from docs.bench import gpu

    lockfile = gpu.lockfile()
    lock = lockfile.Lock.read(REPO / "requirements.lock")
    asked = lockfile.read_requirements(REPO / "requirements.txt").asked
    assert set(gpu.WHEELS) <= {canonicalize_name(a.requirement.name) for a in asked}
    assert set(gpu.MODULES) == set(gpu.WHEELS)  # the preflight's module for each
    for python in lockfile.supported_pythons():
        env = gpu.marker_environment(python)
        pins = gpu.wheel_pins(python)
        assert list(pins)[: len(gpu.WHEELS)] == list(gpu.WHEELS), python
        assert pins == {name: lock.versions(env)[name] for name in pins}, python
        assert not set(pins) & set(lock.closure(list(gpu.TORCH_SIDE), env)), python

    def needs(name: str) -> set[str]:
        try:
            found = [Requirement(r) for r in requires(name) or []]
        except PackageNotFoundError:  # not installed here: the lock brings it elsewhere only
            return set()
        env = gpu.marker_environment()
        return {canonicalize_name(r.name) for r in found if not r.marker or r.marker.evaluate(env)}

    def closure(names) -> set[str]:
        seen, todo = set(), [canonicalize_name(n) for n in names]
        while todo:
            name = todo.pop()
            if name not in seen:
                seen.add(name)
                todo += [n for n in needs(name) if n not in seen]
        return seen

    pins = gpu.wheel_pins()  # this Python's
    torch_side = closure(gpu.TORCH_SIDE)
    listed = set(pins)
    needed = set().union(*(needs(n) for n in listed)) - torch_side
    assert needed <= listed, needed - listed  # nothing left out
    assert listed - set(gpu.WHEELS) <= needed, listed - needed  # each dependency needed
    assert not listed & torch_side  # torch's own (numpy, pillow) stay the machine's


def test_gpu_preflight_finds_missing_only_what_the_lock_lists_and_this_environment_lacks(
    tmp_path, monkeypatch
):
    """The preflight's probe reads requirements.lock: a package the lock adds to what G needs
    and this environment lacks is reported, by itself; what the lock does not list is not
    looked for (the hand-written list it replaces asked for six, which python-dateutil 4 no
    longer brings); a package installed but failing to import counts as missing."""
    from docs.bench import gpu

    assert gpu.missing_packages(gpu.wheel_pins()) == []
    lock = tmp_path / "requirements.lock"
    added = "no-such-distribution==1.0\n    # via matplotlib\n"
    lock.write_text((REPO / "requirements.lock").read_text() + added)
    monkeypatch.setattr(gpu, "LOCK", lock)
    assert "no-such-distribution" in gpu.wheel_pins()
    found = gpu.probe()
    assert found["missing"] == ["no-such-distribution"]
    listed = set(gpu.wheel_pins())
    assert "pytest" not in listed and "pytest" not in found["missing"]  # installed, not G's

    def broken(name, *args, **kwargs):
        if name == "kiwisolver":
            raise ImportError("a broken build")
        return real_import(name, *args, **kwargs)

    real_import = gpu.importlib.import_module
    monkeypatch.setattr(gpu.importlib, "import_module", broken)
    assert gpu.missing_packages(gpu.wheel_pins()) == ["kiwisolver", "no-such-distribution"]


@pytest.mark.slow
def test_gpu_check_wheel_folder_builds_here_and_installs_offline(tmp_path):
    """`python -m docs.bench.gpu wheels DIR` downloads (antlr4: builds) every wheel G needs
    into DIR, small enough to travel with the tree (the device tool carries 64 MiB); `python
    -m docs.bench.gpu run DIR` installs them offline into DIR and reaches G's preflight, which
    (here, without a GPU) stops in its one line."""
    from docs.bench import gpu

    folder, python = tmp_path / "whl", gpu.python_version()
    proc = subprocess.run(
        [sys.executable, "-m", "docs.bench.gpu", "wheels", str(folder)],
        cwd=REPO,
        env=run_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    wheels = sorted(folder.glob("*.whl"))
    pins = [
        line.split("==") for line in (folder / f"requirements-py{python}.txt").read_text().split()
    ]
    assert dict(pins) == gpu.wheel_pins(python)
    for name, version in pins:  # a wheel's file name: <name with _>-<version>-<tags>.whl
        stem = name.replace("-", "_").lower()
        assert [w for w in wheels if w.name.lower().startswith(f"{stem}-{version}-")], name
    assert len(wheels) == len(pins)
    size = sum(w.stat().st_size for w in wheels)
    assert size < 32 * 2**20, size  # ~20 MiB a Python
    assert f"({size / 2**20:.1f} MiB)" in proc.stdout

    proc = subprocess.run(
        [sys.executable, "-m", "docs.bench.gpu", "run", str(folder), "--out", str(tmp_path / "g")],
        cwd=REPO,
        env=run_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 2 and (proc.stdout + proc.stderr).strip() == gpu.NO_GPU
    site = folder / f"site-py{python}"
    code = f"import sys; sys.path.insert(0, {str(site)!r}); import hydra, omegaconf, yaml, "
    code += "antlr4, matplotlib, submitit; print(hydra.__file__, matplotlib.__file__)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert all(path.startswith(str(site)) for path in done.stdout.split()), done.stdout


@pytest.mark.slow
def test_gpu_check_cells_use_train_configs_that_compose(tmp_path, monkeypatch):
    """Every train.py and eval.py cell of the GPU check composes, on CUDA, with what its name
    says: run first on a GPU machine, a cell must not fail on a config key. The cells include
    a world-1 NCCL group with DDP forced on (eager, and compiled with DDPOptimizer's line
    checked), precision 32 (MFU), the GPU JPEG path on a folder with a CMYK JPEG, resume and
    eval.py, and a CUDA_VISIBLE_DEVICES given as the GPU's UUID."""
    from PIL import Image

    from docs.bench import gpu

    trains, evals = {}, {}
    monkeypatch.setattr(
        gpu,
        "train_cell",
        lambda name, cmd, run_dir, t, **kw: trains.setdefault(name, (cmd, run_dir, kw)) and {},
    )
    monkeypatch.setattr(
        gpu, "eval_cell", lambda name, cmd, out_dir, t: evals.setdefault(name, (cmd, out_dir))
    )
    uuid = "GPU-8f0c2a4e-5b1d-4c3e-9a7f-0123456789ab"
    cells = gpu.plan(tmp_path, uuid, gpus=2)
    assert len({name for name, _, _ in cells}) == len(cells) == 20
    for name, limit, cell in cells:
        assert 0 < limit <= gpu.BUDGET_S
        cell(name, limit)
    # 3 ways a rank starts, a resume, the UUID, DDP eager and compiled, DDP on 2 GPUs, the JPEG
    # path, then 8 throughput cells; eval.py; 2 probes
    assert len(trains) == 17 and len(evals) == 1
    configs = {}
    for name, (cmd, _run_dir, kw) in trains.items():
        overrides = [o for o in cmd[cmd.index("train.py") + 1 :] if not o.startswith("hydra.")]
        sweep = "-m" in overrides
        overrides = [o for o in overrides if o != "-m"]
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
            configs[name] = cfg = compose("train", overrides=overrides)
        assert cfg.trainer.device == "cuda" and cfg.trainer.max_epochs == (
            2 if "resume" in name else 1
        ), name
        assert sweep == name.startswith("1-rank sweep job")
        assert kw.get("extra_env", {}).get("CUDA_VISIBLE_DEVICES") == (
            uuid if "UUID" in name else None
        )
        assert cfg.dist.force_ddp == name.startswith("DDP at world size 1")
        if name.split()[0] in ("resnet18", "resnet50"):
            precision = name.split()[1]
            assert cfg.model.name == name.split()[0] and cfg.trainer.precision == precision
            assert cfg.trainer.channels_last and cfg.dataset.fast == ("fast path" in name)
            assert cfg.trainer.compile == name.endswith("compiled")
            assert cfg.trainer.limit_train_batches == gpu.STEPS
    assert {"resnet18 32 cl fast path", "resnet18 fp16 cl fast path"} <= trains.keys()
    # 2 NCCL ranks on 2 GPUs, each reporting its GPU memory; other cells: 1 rank
    two = configs[gpu.TWO_GPUS]
    assert (two.dist.nproc_per_node, two.dist.backend, two.trainer.device) == ("2", "nccl", "cuda")
    assert {name: kw.get("ranks", 1) for name, (_, _, kw) in trains.items() if kw.get("ranks")} == {
        gpu.TWO_GPUS: 2
    }
    assert gpu.rank_problem({"peak_memory_mb_per_rank": [812.5, 790.0]}, 2) is None
    assert gpu.rank_problem({"peak_memory_mb_per_rank": [812.5]}, 2) == "1 rank(s) reported, not 2"
    assert "no GPU memory" in gpu.rank_problem({"peak_memory_mb_per_rank": [0.0, 790.0]}, 2)
    compiled_ddp = "DDP at world size 1, compiled (DDPOptimizer)"
    assert configs[compiled_ddp].trainer.compile
    assert trains[compiled_ddp][2] == {
        "extra_env": {"TORCH_LOGS": "+torch._dynamo.backends.distributed"},
        "must_say": "DDPOptimizer used",
    }
    # the resume continues the nproc=1 run in its run dir, and eval.py evaluates its best.pt
    one, resume = "python train.py dist.nproc_per_node=1", "its resume (resume=auto, a 2nd epoch)"
    assert configs[resume].resume == "auto" and trains[resume][2] == {"must_say": "resumed from"}
    assert trains[resume][1] == trains[one][1]
    ((cmd, out_dir),) = evals.values()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("eval", overrides=[o for o in cmd[2:] if not o.startswith("hydra.")])
    assert Path(cfg.run) == trains[one][1] and f"hydra.run.dir={out_dir}" in cmd
    # the GPU JPEG path: an ImageFolder with a CMYK JPEG among RGB ones
    jpeg = configs["JPEG ImageFolder, nvjpeg, a CMYK file"].dataset
    assert jpeg._target_ == "data.catalog.imagefolder" and Path(jpeg.root) == tmp_path / "jpegs"
    gpu.make_folder_with_cmyk(tmp_path / "jpegs")
    modes = []
    for path in sorted((tmp_path / "jpegs" / "train").rglob("*.jpg")):
        with Image.open(path) as image:
            modes.append((image.format, image.mode))
    assert modes.count(("JPEG", "CMYK")) == 1 and modes.count(("JPEG", "RGB")) == len(modes) - 1
    # without the GPU's UUID from the preflight, that cell says so instead of running; on a
    # 1-GPU machine the 2-GPU cell says it in one line
    uuid_cell = next(c for c in gpu.plan(tmp_path) if "UUID" in c[0])
    assert uuid_cell[2](uuid_cell[0], 90)["status"] == "skipped (no UUID from the preflight)"
    two_cell = next(c for c in gpu.plan(tmp_path, uuid, gpus=1) if c[0] == gpu.TWO_GPUS)
    assert two_cell[2](two_cell[0], 90) == {"cell": gpu.TWO_GPUS, "status": gpu.ONE_GPU}
    assert gpu.table([two_cell[2](two_cell[0], 90)]).count("\n") == 2  # header, rule, 1 row


def test_gpu_check_jpeg_cell_fails_unless_nvjpeg_ran(tmp_path, monkeypatch, caplog):
    """The JPEG cell's run (its config, the folder_augment train.py applies at 64 px) takes
    the device path, whose first batch says that nvjpeg decoded (nvjpeg faked on the CPU);
    the cell requires that line, so a run that decoded everything on the host fails it."""
    import torchvision
    from hydra.core.hydra_config import HydraConfig

    from conf.folder_recipe import folder_augment
    from data import build_datasets
    from data.decode import DecodeOnDevice
    from data.loaders import staged
    from data.transforms import build_recipe
    from docs.bench import gpu
    from tests.helpers import compose as compose_run

    cells = {}
    monkeypatch.setattr(
        gpu, "train_cell", lambda name, cmd, run_dir, t, **kw: cells.setdefault(name, (cmd, kw))
    )
    name = "JPEG ImageFolder, nvjpeg, a CMYK file"
    cell = next(c for c in gpu.plan(tmp_path) if c[0] == name)
    cell[2](name, 90)
    cmd, kw = cells[name]
    assert kw == {"must_say": gpu.NVJPEG_RAN}
    gpu.make_folder_with_cmyk(tmp_path / "jpegs")
    overrides = [o for o in cmd[cmd.index("train.py") + 1 :] if not o.startswith("hydra.")]
    cfg = compose_run("train", tmp_path / "run", *overrides)
    HydraConfig.instance().set_config(cfg)
    augment = folder_augment(cfg)[0]  # as train.py sets it
    splits = build_datasets(cfg.dataset, seed=0, augment=build_recipe(augment))
    plan_set, planned = staged(splits.train, torch.device("cuda"))  # only plans: no CUDA used
    assert isinstance(planned.batch, DecodeOnDevice)
    planned.batch.device = torch.device("cpu")
    real = torchvision.io.decode_jpeg

    def nvjpeg(data, mode=torchvision.io.ImageReadMode.UNCHANGED, device=None):
        return [real(d, mode=mode) for d in data] if isinstance(data, list) else real(data, mode)

    monkeypatch.setattr("data.decode.decode_jpeg", nvjpeg)
    batch, _ = planned.collate([plan_set[(0, i)] for i in range(8)])
    with caplog.at_level("INFO", logger="data.decode"):
        planned.batch(batch)
    assert any(gpu.NVJPEG_RAN in r.getMessage() for r in caplog.records), caplog.text
    host_set, host = staged(splits.train, torch.device("cpu"))
    caplog.clear()
    with caplog.at_level("INFO", logger="data.decode"):
        host.batch(torch.stack([host_set[(0, i)][0] for i in range(8)]))
    assert not any(gpu.NVJPEG_RAN in r.getMessage() for r in caplog.records)
