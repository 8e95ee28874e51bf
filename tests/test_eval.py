"""eval.py, and the evaluation it shares with train.py's validation and test_after_fit.

Runs in this process (train_in_process / eval_in_process, world size 1) where one rank is
enough; real processes (torchrun, the sweep launcher), marked slow, for 2 ranks and sweeps.
All on scikit-learn's digits (train 1437 / val 180 / test 180 scans).
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from ddp_launcher.core.errors import UserError
from omegaconf import OmegaConf
from PIL import Image

from components.checkpoint import atomic_save, load_checkpoint
from data import FastEvalLoader, build_datasets
from tests.helpers import (
    OFFLINE,
    QUICK,
    dataset_cfg,
    eval_cmd,
    eval_in_process,
    offline_runs,
    output,
    read_json,
    rows,
    run,
    summary_rows,
    train_cmd,
    train_in_process,
    val_rows,
)

NO_WANDB = ["wandb.mode=disabled"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A 2-epoch digits run (fast path, offline W&B in a group), trained in this process."""
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    train_in_process(run_dir, *QUICK, OFFLINE, "trainer.max_epochs=2", "wandb.group=digits-eval")
    return run_dir


def metrics_of(eval_dir: Path, prefix: str) -> dict:
    """eval.json's metrics as train.py logs them: {"<prefix>/acc": ..., ...}."""
    return {f"{prefix}/{k}": v for k, v in read_json(eval_dir / "eval.json")["metrics"].items()}


def logged(row: dict, prefix: str) -> dict:
    return {k: v for k, v in row.items() if k.startswith(f"{prefix}/")}


def predictions(eval_dir: Path) -> list[dict]:
    with open(eval_dir / "predictions.csv", newline="") as f:
        return list(csv.DictReader(f))


def snapshot(directory: Path) -> dict:
    """Every file under `directory` with its size and mtime: what "nothing written" compares.
    A link is compared as itself, not its target: W&B links a run's logs/debug-core.log to its
    service's log outside the run dir, which any run on that service writes to."""
    return {
        p: (p.lstat().st_size, p.lstat().st_mtime_ns)
        for p in directory.rglob("*")
        if p.is_symlink() or p.is_file()
    }


# ------------------------------------------------------------------------------ one rank


def test_eval_reproduces_the_logged_val_metrics_exactly(trained, tmp_path, monkeypatch):
    """Validation in train.py and eval.py run the same code: best.pt on val gives the numbers
    logged at its epoch, bit for bit, on the fast path and on the DataLoader path."""
    fast_batches = []
    real_iter = FastEvalLoader.__iter__
    monkeypatch.setattr(
        FastEvalLoader, "__iter__", lambda self: (fast_batches.append(1), real_iter(self))[1]
    )
    result = read_json(trained / "result.json")
    best = next(r for r in val_rows(trained) if r["epoch"] == result["value_epoch"])
    assert set(logged(best, "val")) == {"val/loss", "val/acc", "val/acc5", "val/ece", "val/count"}
    for fast in ("true", "false"):
        out = tmp_path / f"fast-{fast}"
        fast_batches.clear()
        acc = eval_in_process(out, f"run={trained}", "split=val", f"dataset.fast={fast}", *NO_WANDB)
        assert bool(fast_batches) == (fast == "true")  # the path asked for was taken
        assert metrics_of(out, "val") == logged(best, "val"), fast
        assert acc == best["val/acc"] == result["app"]["best_val_acc"]
        report = read_json(out / "eval.json")
        confusion = np.array(report["confusion_matrix"])
        assert confusion.sum() == 180 and confusion.trace() / 180 == acc
        assert [c["count"] for c in report["per_class"]] == confusion.sum(1).tolist()
        assert (out / "confusion_matrix.png").read_bytes()[:4] == b"\x89PNG"
    # The checkpoint carries the config it was trained with (and still loads weights_only).
    config = OmegaConf.create(load_checkpoint(trained / "checkpoints" / "best.pt")["config"])
    assert config.trainer.max_epochs == 2 and config.dataset._target_ == "data.catalog.digits"


def test_test_after_fit_eval_predictions_and_wandb(trained, tmp_path):
    """best.pt on test: train.py's test_after_fit, eval.py's eval.json and predictions.csv agree;
    the W&B eval run is in the training run's group with its tables, and the training run's
    summary gets test/* (offline: recorded in the eval dir)."""
    out = tmp_path / "eval"
    acc = eval_in_process(out, f"run={trained}", "predictions=true", "wandb.mode=offline")
    test = read_json(trained / "result.json")["app"]["test"]
    (test_row,) = [r for r in rows(trained) if "test/acc" in r]
    assert metrics_of(out, "test") == test == logged(test_row, "test")
    assert test["test/count"] == 180 and acc == test["test/acc"]

    # predictions.csv: one row per test scan, in split order, matching eval.json.
    report, preds = read_json(out / "eval.json"), predictions(out)
    splits = build_datasets(dataset_cfg("digits"))
    assert [int(p["sample"]) for p in preds] == splits.test.sample_ids()
    assert [int(p["label"]) for p in preds] == splits.test.targets.tolist()
    assert sum(p["label"] == p["predicted"] for p in preds) / len(preds) == acc
    top5 = sum(p["label"] in [p[f"top{j}"] for j in range(1, 6)] for p in preds) / len(preds)
    assert top5 == report["metrics"]["acc5"]
    for p in preds:
        probs = [float(p[f"p{j}"]) for j in range(1, 6)]
        assert p["top1"] == p["predicted"] and probs == sorted(probs, reverse=True)
    per_class = {c["class"]: c for c in report["per_class"]}
    for name, entry in per_class.items():
        mine = [p for p in preds if p["label"] == name]
        assert len(mine) == entry["count"]
        assert sum(p["predicted"] == name for p in mine) / len(mine) == entry["acc"]

    # W&B: the eval run, and test/* recorded into the training run's summary.
    (train_wb,) = offline_runs(trained)
    runs = {r.job_type: r for r in offline_runs(out)}
    ev, into_train = runs["eval"], runs["train"]
    assert ev.group == train_wb.group == "digits-eval"
    assert ev.name == f"{train_wb.name or train_wb.run_id} eval:test"
    assert ev.config["eval"]["train_run_id"] == train_wb.run_id == report["train_wandb_run_id"]
    assert ev.run_id == report["wandb_run_id"] and ev.exit_code == 0
    assert {k: ev.summary[k] for k in test} == test
    table = ev.table("test/per_class")
    assert table["columns"] == ["class", "acc", "count"]
    assert table["data"] == [[c["class"], c["acc"], c["count"]] for c in report["per_class"]]
    cells = ev.table("test/confusion_matrix_table")["data"]  # W&B's plot: one row per cell
    assert sum(n for _, _, n in cells) == 180
    assert sum(n for true, pred, n in cells if true == pred) == round(acc * 180)
    assert into_train.run_id == train_wb.run_id
    assert {k: into_train.summary[k] for k in test} == test


def test_predict_on_a_folder_of_images(trained, tmp_path):
    """split=<folder>: predictions only, for any image file (converted to the model's channels,
    resized to its input); a scan saved as a PNG is predicted as it is in the test split."""
    splits = build_datasets(dataset_cfg("digits"))
    scans = splits.test.dataset.dataset.data  # the 1797 uint8 scans the test split indexes
    picks = splits.test.sample_ids()[:4]
    folder = tmp_path / "images" / "nested"
    folder.mkdir(parents=True)
    for i in picks:
        Image.fromarray(scans[i].numpy()).save(folder / f"scan{i}.png")
    Image.fromarray(scans[picks[0]].numpy()).convert("RGB").resize((32, 32)).save(
        tmp_path / "images" / "big.jpg"
    )
    (tmp_path / "images" / "notes.txt").write_text("not an image")

    eval_in_process(tmp_path / "on-test", f"run={trained}", "predictions=true", *NO_WANDB)
    expected = {int(p["sample"]): p for p in predictions(tmp_path / "on-test")}
    assert (
        eval_in_process(
            tmp_path / "out", f"run={trained}", f"split={tmp_path / 'images'}", *NO_WANDB
        )
        is None
    )
    got = {Path(p["sample"]).name: p for p in predictions(tmp_path / "out")}
    assert set(got) == {"big.jpg", *(f"scan{i}.png" for i in picks)}
    for i in picks:
        row, want = got[f"scan{i}.png"], expected[i]
        assert row["label"] == "" and row["predicted"] == want["predicted"]
        assert float(row["p1"]) == pytest.approx(float(want["p1"]), abs=1e-5)
    report = read_json(tmp_path / "out" / "eval.json")
    assert report["metrics"] == {} and report["predictions"] == "predictions.csv"
    assert not (tmp_path / "out" / "confusion_matrix.png").exists()


@pytest.fixture(scope="module")
def odd_checkpoints(trained, tmp_path_factory) -> dict[str, Path]:
    """Checkpoints eval.py must refuse: torn, from before configs were kept, and one whose
    dataset has no test split (an ImageFolder tree without test/)."""
    root = tmp_path_factory.mktemp("odd")
    best = load_checkpoint(trained / "checkpoints" / "best.pt")
    (root / "corrupt.pt").write_bytes(b"not a checkpoint")
    atomic_save({k: v for k, v in best.items() if k != "config"}, root / "old.pt")
    config = OmegaConf.create(best["config"])
    config.dataset = {
        "_target_": "data.catalog.imagefolder",
        "root": str(root / "folder"),
        "image_size": 8,
    }
    for cls in ("a", "b"):
        (root / "folder" / "train" / cls).mkdir(parents=True)
        for i in range(3):
            Image.new("RGB", (8, 8), (i * 80, 0, 0)).save(root / "folder/train" / cls / f"{i}.png")
    atomic_save({**best, "config": OmegaConf.to_yaml(config)}, root / "no_test.pt")
    (root / "empty").mkdir()
    (root / "no_best").mkdir()
    return {"root": root}


BAD_EVAL_INPUTS = [
    ([], ["which checkpoint? pass run=<a training run dir>", "ckpt="]),
    (["run={root}/nowhere"], ["run=", "nowhere: no such run dir", "ckpt="]),
    (["ckpt={root}/nowhere.pt"], ["nowhere.pt: no such file", "ckpt="]),
    (["run={root}/no_best"], ["has no checkpoints/best.pt", "ckpt="]),
    (["ckpt={root}/corrupt.pt"], ["corrupt.pt cannot be loaded", "pass ckpt=<another"]),
    (["ckpt={root}/old.pt"], ["old.pt carries no config", "evaluate a checkpoint of a run"]),
    (
        ["run={run}", "model.hidden=64"],
        ["does not fit this model", "size mismatch", "drop the model overrides"],
    ),
    (["run={run}", "model=resnet18"], ["does not fit this model", "ResNet"]),
    (
        ["run={run}", "dataset.rot=/data"],
        ["dataset.rot is not in the config the checkpoint", "+dataset.rot="],
    ),
    (
        ["run={run}", "dataset.val_fraction=abc"],
        ["dataset.val_fraction='abc' does not fit", "give a float"],
    ),
    (["run={run}", "split=tset"], ["split=tset is not train, val, test or a folder"]),
    (["run={run}", "trainer.eval_batch_size=0"], ["trainer.eval_batch_size=0 is not valid"]),
    (["run={run}", "split={root}/empty"], ["no images in", "empty", "point split= at"]),
    (["ckpt={root}/no_test.pt", "split=test"], ["no 'test' split", "one of train, val"]),
]


@pytest.mark.parametrize("overrides, fragments", BAD_EVAL_INPUTS)
def test_bad_input_is_one_user_error_and_writes_nothing(
    trained, odd_checkpoints, tmp_path, overrides, fragments
):
    root, before = odd_checkpoints["root"], snapshot(trained)
    out = tmp_path / "eval"
    args = [o.format(root=root, run=trained) for o in overrides]
    with pytest.raises(UserError) as caught:
        eval_in_process(out, *args, *NO_WANDB)
    message = str(caught.value)
    assert "\n" not in message and all(f in message for f in fragments), message
    assert snapshot(trained) == before  # the training run is untouched
    assert not out.exists() or not any(out.iterdir())  # and the evaluation wrote nothing


# ------------------------------------------------------------------------------ processes


@pytest.fixture(scope="session")
def train_sweep(sweep_2x2) -> Path:
    """A training sweep with 1-rank and 2-rank jobs (1 epoch each, test_after_fit on): the
    session's 2x2 sweep (tests/suite_plugin.py), jobs #0 and #1 on 2 ranks, #2 and #3 on 1."""
    return sweep_2x2.dir


@pytest.mark.slow
def test_a_training_sweep_summary_has_test_columns(train_sweep):
    table = summary_rows(train_sweep)
    jobs = [p for p in train_sweep.iterdir() if p.name.isdigit()]
    assert len(table) == len(jobs)  # a row per job
    # ranked by val (what sweepers optimise), test reported beside it
    assert [r["monitor"] for r in table] == ["val/acc"] * len(jobs)
    assert [float(r["best"]) for r in table] == sorted(
        (float(r["best"]) for r in table), reverse=True
    )
    for row in table:
        test = read_json(train_sweep / row["job"] / "result.json")["app"]["test"]
        assert float(row["test/acc"]) == test["test/acc"] and test["test/count"] == 180
        assert float(row["test/loss"]) == test["test/loss"]


@pytest.mark.slow
def test_eval_sweep_on_two_ranks_is_exact(train_sweep, tmp_path):
    """`eval.py -m run=a,b split=val,test` through the torchrun launcher, 2 ranks per job (two
    jobs at a time), on the DataLoader path: the 2-rank-trained run's logged val and test
    metrics exactly; the 1-rank-trained run evaluated as on 1 rank (predictions too)."""
    one, two = train_sweep / "2", train_sweep / "0"  # trained on 1 rank, on 2 ranks
    sweep_dir = tmp_path / "evals"
    proc = run(
        eval_cmd(
            "-m",
            f"run={one},{two}",
            "split=val,test",
            "dist.nproc_per_node=2",
            "hydra.launcher.max_parallel=2",
            "dataset.fast=false",
            "predictions=true",
            *NO_WANDB,
            f"hydra.sweep.dir={sweep_dir}",
        )
    )
    assert proc.returncode == 0, output(proc)
    jobs = {}
    for job in (p for p in sweep_dir.iterdir() if p.name.isdigit()):
        report = read_json(job / "eval.json")
        assert report["world_size"] == 2
        jobs[(Path(report["checkpoint"]).parents[1].name, report["split"])] = job
    assert set(jobs) == {(r.name, s) for r in (one, two) for s in ("val", "test")}

    # Trained on 2 ranks (fast path), evaluated on 2 ranks (DataLoader path): exact.
    (val_row,) = val_rows(two)
    assert metrics_of(jobs[two.name, "val"], "val") == logged(val_row, "val")
    assert (
        metrics_of(jobs[two.name, "test"], "test") == read_json(two / "result.json")["app"]["test"]
    )

    # Trained on 1 rank: 2-rank eval = 1-rank eval (counts exact; sums of floats to rounding).
    for split in ("val", "test"):
        single = tmp_path / f"single-{split}"
        eval_in_process(single, f"run={one}", f"split={split}", "predictions=true", *NO_WANDB)
        a, b = read_json(single / "eval.json"), read_json(jobs[one.name, split] / "eval.json")
        assert a["confusion_matrix"] == b["confusion_matrix"] and a["per_class"] == b["per_class"]
        for key, value in a["metrics"].items():
            assert b["metrics"][key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
        rows_a, rows_b = predictions(single), predictions(jobs[one.name, split])
        assert [(r["sample"], r["label"], r["predicted"]) for r in rows_a] == [
            (r["sample"], r["label"], r["predicted"]) for r in rows_b
        ]
        assert all(
            math.isclose(float(x["p1"]), float(y["p1"]), rel_tol=1e-5)
            for x, y in zip(rows_a, rows_b, strict=True)
        )

    table = {(r["overrides"], r["split"]): r for r in summary_rows(sweep_dir)}
    assert len(table) == 4 and all(r["status"] == "completed" for r in table.values())
    for (run_name, split), job in jobs.items():
        row = next(r for (o, s), r in table.items() if s == split and f"/{run_name} " in o + " ")
        assert float(row["eval_acc"]) == read_json(job / "eval.json")["metrics"]["acc"]
        # ranked as any job: by the value eval.py wrote into result.json, the split's accuracy
        result = read_json(job / "result.json")
        assert (result["status"], result["metric"], result["direction"]) == (
            "completed",
            f"{split}/acc",
            "max",
        )
        acc = read_json(job / "eval.json")["metrics"]["acc"]
        assert result["value"] == float(row["best"]) == acc


@pytest.mark.slow
def test_the_documented_dataset_example_trains_and_evaluates(tmp_path):
    """docs/own-dataset.md: data/example/shapes.py + data/example/conf/dataset/shapes.yaml, chosen
    with --config-dir; its checkpoint alone (its config inside) is enough for eval.py."""
    run_dir = tmp_path / "shapes"
    proc = run(
        train_cmd(
            "--config-dir",
            "data/example/conf",
            "dataset=shapes",
            "trainer.max_epochs=3",
            *NO_WANDB,
            f"hydra.run.dir={run_dir}",
        )
    )
    assert proc.returncode == 0, output(proc)
    result = read_json(run_dir / "result.json")
    assert result["status"] == "completed" and result["app"]["best_val_acc"] > 0.6  # chance: 1/3
    assert result["app"]["final"]["val/count"] == 120 and result["app"]["test"]["test/count"] == 300
    out = tmp_path / "eval"
    eval_in_process(out, f"run={run_dir}", "dataset.fast=false", *NO_WANDB)
    # Same counts; float sums only to rounding: this process runs more threads than the run's.
    assert metrics_of(out, "test") == pytest.approx(result["app"]["test"], rel=1e-6)
    assert metrics_of(out, "test")["test/count"] == 300
    assert read_json(out / "eval.json")["classes"] == ["circle", "square", "triangle"]


def test_eval_accumulator_counts_like_a_reference():
    """components/evaluation.py against plain per-sample arithmetic on random logits."""
    from components.evaluation import EvalAccumulator

    torch.manual_seed(0)
    logits, labels = torch.randn(50, 7) * 3, torch.randint(0, 7, (50,))
    acc = EvalAccumulator(7, "cpu")
    for chunk in range(0, 50, 16):  # batches of any size add up
        acc.update(logits[chunk : chunk + 16], labels[chunk : chunk + 16])
    result = acc.result()
    probs = logits.softmax(1)
    confidence, predicted = probs.max(1)
    hits = (predicted == labels).double()
    assert result.count == 50 and result.acc == hits.mean().item()
    assert result.loss == pytest.approx(torch.nn.functional.cross_entropy(logits, labels).item())
    top5 = (logits.topk(5, 1).indices == labels[:, None]).any(1).double().mean().item()
    assert result.acc5 == top5
    bins = (confidence * 15).long().clamp(max=14)
    ece = (
        sum(
            abs(hits[bins == b].sum() - confidence[bins == b].double().sum()).item()
            for b in range(15)
        )
        / 50
    )
    assert result.ece == pytest.approx(ece)
    for c in range(7):
        mine = labels == c
        want = hits[mine].mean().item() if mine.any() else None
        assert result.per_class_acc[c] == (pytest.approx(want) if want is not None else None)
    assert result.confusion.sum(1).tolist() == torch.bincount(labels, minlength=7).tolist()


def test_evaluation_reads_nothing_back_to_the_host_per_batch():
    """evaluate() over shape-only tensors (the meta device: no values at all): an op whose
    output size depends on the values, as torch.bincount's does (it reads its input's min and
    max back: on a GPU, host syncs every batch, 8 for the 4 bincounts it took), cannot run
    there. Every batch's sums stay on the device until all_reduce()/result()."""
    from types import SimpleNamespace

    from components.evaluation import evaluate

    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 10)).to("meta")
    batches = [
        (torch.empty(16, 3, 8, 8, device="meta"), torch.empty(16, dtype=torch.long, device="meta"))
        for _ in range(3)
    ]
    tc = SimpleNamespace(channels_last=False)
    metrics = evaluate(model, batches, torch.device("meta"), tc, num_classes=10)
    assert metrics.sums.device.type == "meta" and metrics.confusion.shape == (10, 10)
