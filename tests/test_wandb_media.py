"""A training run's W&B panels beyond scalars, read back from its offline records: per-class
accuracy and the confusion matrix per epoch, the fixed val image table, checkpoints as
artifacts, wandb.watch, and the repro files (command, requirements, dirty-tree diff).

In this process (train_in_process, world size 1) on digits; two ranks in a slow test.
"""

from __future__ import annotations

import csv
import logging
import subprocess
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest
from ddp_launcher.core import repro
from PIL import Image

from components.wandb_media import CheckpointArtifacts, pick_samples
from data.digits import Digits
from tests.helpers import (
    OFFLINE,
    QUICK,
    eval_in_process,
    offline_runs,
    read_json,
    train_in_process,
    val_rows,
)

SAMPLE_COLUMNS = ["sample", "image", "label", "predicted", "confidence", "correct"]
# Every run here is read back from W&B's offline records.
QUIET = [OFFLINE, "trainer.test_after_fit=false", "trainer.log_every_n_steps=100"]


@pytest.fixture(scope="module")
def scans() -> np.ndarray:
    """The 1797 stored digits scans (uint8 8x8) and their labels, by sample id."""
    digits = Digits()
    return digits.data.numpy(), digits.targets.numpy()


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """2 epochs of the default digits job (fast path), offline W&B, media every epoch."""
    run_dir = tmp_path_factory.mktemp("media") / "run"
    train_in_process(run_dir, *QUICK, "trainer.max_epochs=2", *QUIET)
    return run_dir


def samples_rows(table: dict) -> list[dict]:
    assert table["columns"] == SAMPLE_COLUMNS
    return [dict(zip(SAMPLE_COLUMNS, row, strict=True)) for row in table["data"]]


def check_images(wb, scans, n: int) -> None:
    """Each logged val/samples table holds, per row, the stored scan of its sample as a PNG."""
    images, labels = scans
    logged = wb.media_tables("val/samples")
    assert len(logged) == n
    for table, files in logged:
        for row in samples_rows(table):
            cell = row["image"]
            assert cell["_type"] == "image-file" and (cell["width"], cell["height"]) == (8, 8)
            pixels = np.asarray(Image.open(files[cell["path"]]))
            np.testing.assert_array_equal(pixels, images[row["sample"]])
            assert row["label"] == str(labels[row["sample"]])


def test_per_epoch_panels_from_the_exact_validation(trained, scans):
    """Every epoch: per-class table (+ bar plot) and confusion matrix that agree with the
    logged val metrics, and the same 32 val samples with their true labels."""
    (wb,) = offline_runs(trained)
    vals = val_rows(trained)
    rows = [h for h in wb.history if "val/acc" in h]
    assert [h["epoch"] for h in rows] == [1, 2]
    for h in rows:
        assert {
            "val/per_class",
            "val/per_class_acc_table",
            "val/confusion_matrix_table",
            "val/samples",
        } <= h.keys()
    per_class, cells = wb.tables("val/per_class"), wb.tables("val/confusion_matrix_table")
    for val, table, matrix in zip(vals, per_class, cells, strict=True):
        assert table["columns"] == ["class", "acc", "count"]
        assert [c for c, _, _ in table["data"]] == [str(i) for i in range(10)]
        assert sum(n for _, _, n in table["data"]) == val["val/count"] == 180
        hits = sum(round(acc * n) for _, acc, n in table["data"])
        assert hits == round(val["val/acc"] * 180)
        assert sum(n for _, _, n in matrix["data"]) == 180
        assert sum(n for true, pred, n in matrix["data"] if true == pred) == hits

    _, labels = scans
    tables = [samples_rows(t) for t in wb.tables("val/samples")]
    ids = [[r["sample"] for r in t] for t in tables]
    assert len(ids[0]) == 32 and ids[0] == ids[1] == sorted(ids[0])  # the same, every epoch
    assert sorted({labels[i] for i in ids[0]}) == list(range(10))  # classes take turns
    for table in tables:
        for r in table:
            assert r["label"] == str(labels[r["sample"]])
            assert r["correct"] == (r["label"] == r["predicted"]) and 0 < r["confidence"] <= 1
    check_images(wb, scans, n=2)


def test_sample_predictions_are_the_evaluations_own(trained, tmp_path):
    """The best epoch's val/samples rows are what eval.py predicts with best.pt on val."""
    eval_in_process(
        tmp_path, f"run={trained}", "split=val", "predictions=true", "wandb.mode=disabled"
    )
    with open(tmp_path / "predictions.csv", newline="") as f:
        expected = {int(p["sample"]): p for p in csv.DictReader(f)}
    (wb,) = offline_runs(trained)
    best = read_json(trained / "result.json")["value_epoch"]
    for r in samples_rows(wb.tables("val/samples")[best - 1]):
        want = expected[r["sample"]]
        assert (r["label"], r["predicted"]) == (want["label"], want["predicted"])
        assert r["confidence"] == pytest.approx(float(want["p1"]), abs=1e-6)


def test_checkpoints_as_artifacts_and_repro_files(trained):
    """log_checkpoints=best (default): one model-<run id> version per new best, aliased best
    and latest, with step, epoch and the epoch's val metrics; repro/ in the run dir and W&B."""
    (wb,) = offline_runs(trained)
    models = [a for a in wb.artifacts if a["type"] == "model"]
    improved = [
        v
        for i, v in enumerate(val_rows(trained))
        if v["val/acc"] > max([0.0] + [u["val/acc"] for u in val_rows(trained)[:i]])
    ]
    assert len(models) == len(improved) >= 1
    for model, val in zip(models, improved, strict=True):
        assert model["name"] == f"model-{wb.run_id}" and model["paths"] == ["checkpoint.pt"]
        assert set(model["aliases"]) == {"best", "latest"}
        meta = model["metadata"]
        assert (meta["step"], meta["epoch"], meta["monitor"]) == (
            val["step"],
            val["epoch"],
            "val/acc",
        )
        assert meta["val/acc"] == val["val/acc"] == meta["best_val_acc"]
        assert Path(model["files"]["checkpoint.pt"]).stat().st_size > 0  # staged for sync

    names = [repro.COMMAND_FILE, repro.REQUIREMENTS_FILE]
    assert {f"repro/{n}" for n in names} <= set(wb.files)
    command = (trained / "repro" / repro.COMMAND_FILE).read_text()
    assert "python train.py" in command and "trainer.max_epochs=2" in command
    requirements = (trained / "repro" / repro.REQUIREMENTS_FILE).read_text().splitlines()
    assert f"torch=={metadata.version('torch')}" in requirements
    for name in names:  # W&B has the run dir's copy
        assert (wb.files_dir / "repro" / name).read_text() == (trained / "repro" / name).read_text()
    result = read_json(trained / "result.json")
    state = repro.git_state(trained)
    assert result["git_commit"] == state.commit == wb.config["run"]["git_commit"]
    assert result["git_dirty"] == state.dirty == wb.config["run"]["git_dirty"]


def git_repo(path: Path) -> str:
    """A repository with one commit; returns the commit."""
    path.mkdir()
    env = ["-c", "user.email=t@t", "-c", "user.name=t"]
    for args in (["init", "-q"], ["add", "."], [*env, "commit", "-qm", "one"]):
        if args[0] == "add":
            (path / "model.py").write_text("width = 1\n")
        subprocess.run(["git", *args], cwd=path, check=True)
    return repro.git("rev-parse", "HEAD", cwd=path).strip()


def test_dirty_tree_is_recorded_and_no_secret_is_written(tmp_path, monkeypatch, caplog):
    code = tmp_path / "code"
    commit = git_repo(code)
    monkeypatch.setattr(repro, "CODE_DIR", code)
    monkeypatch.setenv("WANDB_API_KEY", "secret-token-123")
    monkeypatch.setenv("HYDRA_DDP_DATA", "secret-token-123")
    off = [*QUICK, *QUIET, "wandb.media_every_n_epochs=0", "wandb.log_checkpoints=none"]

    train_in_process(tmp_path / "clean", *off)
    assert not (tmp_path / "clean" / "repro" / repro.DIFF_FILE).exists()
    assert read_json(tmp_path / "clean" / "result.json")["git_dirty"] is False

    (code / "model.py").write_text("width = 2\n")
    (code / "notes.py").write_text("x = 1\n")
    with caplog.at_level(logging.WARNING):
        train_in_process(tmp_path / "dirty", *off)
    run_dir = tmp_path / "dirty"
    diff = (run_dir / "repro" / repro.DIFF_FILE).read_text()
    assert "-width = 1\n+width = 2" in diff and "untracked, not in this diff: notes.py" in diff
    result = read_json(run_dir / "result.json")
    assert result["git_dirty"] is True and result["git_commit"] == commit
    assert any("dirty git tree" in r.getMessage() for r in caplog.records)
    (wb,) = offline_runs(run_dir)
    assert wb.config["run"]["git_dirty"] is True and wb.config["run"]["git_commit"] == commit
    assert (wb.files_dir / "repro" / repro.DIFF_FILE).read_text() == diff
    for path in [*run_dir.rglob("*"), *(tmp_path / "clean").rglob("*")]:
        if path.is_file():
            assert b"secret-token-123" not in path.read_bytes(), path


def test_log_checkpoints_all_and_resume_continue_one_lineage(tmp_path):
    """all: every checkpoint saved (mid-epoch ones too); a resumed run adds versions to the
    same artifact, in its W&B run."""
    run_dir = tmp_path / "r"
    common = [*QUICK, *QUIET, "wandb.log_checkpoints=all", "wandb.media_every_n_epochs=0"]
    train_in_process(run_dir, *common, "trainer.checkpoint_every_n_steps=10")
    train_in_process(run_dir, *common, "trainer.max_epochs=2", "resume=auto")
    first, resumed = offline_runs(run_dir)
    assert resumed.run_id == first.run_id
    steps = [
        [a["metadata"]["step"] for a in r.artifacts if a["type"] == "model"]
        for r in (first, resumed)
    ]
    assert steps == [[10, 20, 22], [44]]
    names = {a["name"] for r in (first, resumed) for a in r.artifacts if a["type"] == "model"}
    assert names == {f"model-{first.run_id}"}
    aliases = [sorted(a["aliases"]) for a in first.artifacts if a["type"] == "model"]
    assert aliases == [["latest"], ["latest"], ["best", "latest"]]  # W&B keeps them as a set


class FakeRun:
    id = "abc"

    def __init__(self) -> None:
        self.logged: list[tuple[str, list[str]]] = []

    def log_artifact(self, artifact, aliases):
        self.logged.append((artifact.metadata["step"], aliases))


@pytest.mark.parametrize(
    "policy,expected",
    [
        ("none", []),
        ("best", [(1, ["latest", "best"]), (3, ["latest", "best"])]),
        ("last", [(4, ["latest"])]),
        (
            "all",
            [(1, ["latest", "best"]), (2, ["latest"]), (3, ["latest", "best"]), (4, ["latest"])],
        ),
    ],
)
def test_checkpoint_policies(tmp_path, policy, expected):
    path = tmp_path / "step.pt"
    path.write_bytes(b"weights")
    artifacts, fake = CheckpointArtifacts(policy), FakeRun()
    for step, is_best in ((1, True), (2, False), (3, True), (4, False)):
        artifacts.saved(fake, path, {"step": step}, is_best)
    artifacts.ended(fake)
    assert fake.logged == expected


def test_wandb_failures_are_warnings(tmp_path, monkeypatch, caplog):
    """An artifact or a media upload that fails: a warning (once each), the run completes and
    W&B keeps its scalars."""
    import wandb
    from wandb.sdk.wandb_run import Run

    def down(*_args, **_kwargs):
        raise RuntimeError("W&B is down")

    monkeypatch.setattr(Run, "log_artifact", down)
    monkeypatch.setattr(wandb.plot, "confusion_matrix", down)
    run_dir = tmp_path / "r"
    with caplog.at_level(logging.WARNING):
        train_in_process(run_dir, *QUICK, *QUIET, "trainer.max_epochs=2")
    assert read_json(run_dir / "result.json")["status"] == "completed"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    for what in ("checkpoint artifact", "media"):
        assert (
            sum(
                f"W&B {what} failed, training goes on: RuntimeError: W&B is down" in w
                for w in warnings
            )
            == 1
        ), warnings
    (wb,) = offline_runs(run_dir)
    assert [h["epoch"] for h in wb.history if "val/acc" in h] == [1, 2]
    assert not [a for a in wb.artifacts if a["type"] == "model"] and wb.exit_code == 0


def test_watch_logs_histograms(tmp_path):
    run_dir = tmp_path / "r"
    train_in_process(
        run_dir,
        *QUICK,
        *QUIET,
        "wandb.watch=all",
        "trainer.log_every_n_steps=10",
        "wandb.media_every_n_epochs=0",
        "wandb.log_checkpoints=none",
    )
    (wb,) = offline_runs(run_dir)
    keys = {k for h in wb.history for k in h}
    assert any(k.startswith("gradients/") for k in keys), keys
    assert any(k.startswith("parameters/") for k in keys), keys


def test_pick_samples_is_fixed_sorted_and_takes_classes_in_turn():
    labels = np.repeat(np.arange(4), [50, 30, 15, 5])
    picked = pick_samples(100, 12, labels)
    assert picked.tolist() == sorted(picked.tolist()) and len(set(picked.tolist())) == 12
    assert np.bincount(labels[picked]).tolist() == [3, 3, 3, 3]
    assert picked.tolist() == pick_samples(100, 12, labels).tolist()
    assert len(pick_samples(100, 200, None)) == 100
    assert len(pick_samples(100, 30, labels)) == 30  # a small class runs out: others fill in


@pytest.mark.slow
def test_two_ranks_gather_the_samples_exactly(two_ranks, tmp_path, scans):
    """2 ranks on the DataLoader path: each sample's row comes from the rank that holds it,
    images are the stored scans, and eval.py (one rank) predicts the same with best.pt."""
    run_dir = tmp_path / "r"
    two_ranks.train(run_dir, *QUICK, *QUIET, "dataset.fast=false")
    (wb,) = offline_runs(run_dir)
    check_images(wb, scans, n=1)
    eval_in_process(
        tmp_path / "eval", f"run={run_dir}", "split=val", "predictions=true", "wandb.mode=disabled"
    )
    with open(tmp_path / "eval" / "predictions.csv", newline="") as f:
        expected = {int(p["sample"]): p for p in csv.DictReader(f)}
    (table,) = wb.tables("val/samples")
    rows = samples_rows(table)
    assert len(rows) == 32
    for r in rows:
        assert r["predicted"] == expected[r["sample"]]["predicted"]
        assert r["confidence"] == pytest.approx(float(expected[r["sample"]]["p1"]), abs=1e-5)


@pytest.mark.parametrize("key", ["wandb.num_images", "wandb.media_every_n_epochs"])
def test_negative_counts_are_one_user_error(tmp_path, key):
    from ddp_launcher.core.errors import UserError

    with pytest.raises(UserError, match=rf"^{key}=-1 must be >= 0 \(0: off\)$"):
        train_in_process(tmp_path / "r", *QUICK, f"{key}=-1")
    assert read_json(tmp_path / "r" / "result.json")["status"] == "failed"


@pytest.mark.parametrize(
    "override,valid",
    [
        ("wandb.log_checkpoints=bestt", "none, best, last, all"),
        ("wandb.watch=yes", "off, gradients, parameters, all"),
    ],
)
def test_choices_are_checked_at_composition(override, valid):
    from tests.helpers import compose_train

    with pytest.raises(Exception) as failure:  # Hydra's own error types vary
        compose_train(Path("unused"), override)
    text = f"{failure.value}\n{failure.value.__cause__}"
    assert override.split("=")[1] in text and valid in text, text


def test_stored_images_as_they_are_shrunk_when_large():
    import torch

    from components.wandb_media import MAX_IMAGE_SIDE, stored_image

    gray = torch.arange(64, dtype=torch.uint8).view(1, 8, 8)
    np.testing.assert_array_equal(np.asarray(stored_image(gray)), gray[0].numpy())
    rgb = np.random.default_rng(0).integers(0, 256, (5, 7, 3), dtype=np.uint8)
    np.testing.assert_array_equal(
        np.asarray(stored_image(torch.from_numpy(rgb).permute(2, 0, 1))), rgb
    )
    photo = Image.new("RGB", (600, 400), (10, 20, 30))
    width, height = stored_image(photo).size
    assert width == MAX_IMAGE_SIDE and abs(height - MAX_IMAGE_SIDE * 400 / 600) <= 1
    assert photo.size == (600, 400)  # the dataset's own image is left alone
    assert stored_image(torch.zeros(3, 8, 8)) is None  # not uint8: no image
