"""Rank 0's record of an evaluation (eval.py): eval.json, confusion_matrix.png and
predictions.csv in the evaluation's own run dir, a W&B run with job_type=eval in the training
run's group, and result.json, the launcher's record of the job (its value the split's top-1
accuracy: a sweep's report ranks evaluations as it ranks any job). Other ranks get a record
that writes nothing. Nothing is written for an evaluation that fails; W&B problems are warnings
and never fail it.
"""

from __future__ import annotations

import csv
import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from ddp_launcher import RunResult, atomic_path, resolve_wandb_mode, write_atomic, write_result
from omegaconf import DictConfig, OmegaConf

from components.evaluation import EvalResult
from components.metrics import init_wandb
from components.wandb_media import class_panels

EVAL_FILE = "eval.json"
CONFUSION_FILE = "confusion_matrix.png"
PREDICTIONS_FILE = "predictions.csv"


@dataclass
class EvalReport:
    """eval.json: what eval.py measured, on which checkpoint and split."""

    split: str  # train | val | test | the folder of images predicted on
    checkpoint: str
    status: str = "completed"
    # loss, acc, acc5, ece, count; {} for unlabeled images (predictions only)
    metrics: dict[str, float] = field(default_factory=dict)
    classes: list[str] = field(default_factory=list)
    per_class: list[dict[str, Any]] = field(default_factory=list)  # class, acc, count
    confusion_matrix: list[list[int]] = field(default_factory=list)  # [true][predicted]
    predictions: str | None = None  # the predictions file, relative to the eval dir
    world_size: int = 1
    train_wandb_run_id: str | None = None  # the W&B run of the training run
    wandb_run_id: str | None = None  # this evaluation's W&B run
    wall_time_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


log = logging.getLogger(__name__)

ANNOTATED_CLASSES = 20  # confusion_matrix.png writes each count up to this many classes


class EvalRecord:
    def __init__(self, out_dir: Path, *, enabled: bool) -> None:
        self.out_dir = out_dir
        self.enabled = enabled
        self.started = time.time()

    def save(
        self,
        report: EvalReport,
        result: EvalResult | None,
        classes: list[str],
        rows: list[dict] | None,
        dataset,
    ) -> None:
        """eval.json (+ the confusion matrix plot for labelled splits, + predictions.csv when
        there are prediction rows, each sample named by `dataset.sample_ids()`)."""
        if not self.enabled:
            return
        report.classes = classes
        if result is not None:
            report.metrics = result.numbers()
            report.per_class = [
                {"class": name, "acc": acc, "count": count}
                for name, acc, count in zip(
                    classes, result.per_class_acc, result.per_class_count, strict=True
                )
            ]
            report.confusion_matrix = result.confusion.tolist()
            plot_confusion(result, classes, self.out_dir / CONFUSION_FILE, report.split)
        if rows is not None:
            write_predictions(self.out_dir / PREDICTIONS_FILE, rows, classes, dataset.sample_ids())
            report.predictions = PREDICTIONS_FILE
        report.wall_time_s = round(time.time() - self.started, 3)
        write_atomic(self.out_dir / EVAL_FILE, json.dumps(report.to_json(), indent=2) + "\n")
        log.info(
            "wrote %s%s",
            self.out_dir / EVAL_FILE,
            f" and {PREDICTIONS_FILE}" if rows is not None else "",
        )

    def log_wandb(
        self,
        trained: DictConfig,
        progress: dict[str, Any],
        report: EvalReport,
        result: EvalResult | None,
        label: str,
    ) -> None:
        """A W&B run (job_type=eval) in the training run's group, named after it, its config the
        trained config plus `eval` (the training run's id, checkpoint, split): the metrics as
        `<label>/*`, per-class accuracy as a table, the confusion matrix as W&B's plot. Test
        metrics also go into the training run's summary as test/* (offline: recorded in this
        dir for `wandb sync`)."""
        if not self.enabled:
            return
        w = trained.wandb
        train_id, train_name = progress.get("wandb_run_id"), progress.get("wandb_name")
        group = progress.get("wandb_group") or w.group
        config = OmegaConf.to_container(trained, resolve=True, enum_to_str=True)
        config["eval"] = {
            "train_run_id": train_id,
            "checkpoint": report.checkpoint,
            "split": report.split,
            "world_size": report.world_size,
        }
        run = init_wandb(
            w,
            run_dir=self.out_dir,
            config=config,
            group=group,
            name=f"{train_name or train_id or 'run'} eval:{label}",
            job_type="eval",
            job="evaluation",
        )
        if run is None:
            return
        row: dict[str, Any] = {}
        if result is not None:
            row.update(result.scalars(label))
            # Per-class accuracy (table + bar plot) and the confusion matrix, as in training.
            row.update(
                class_panels(
                    result, report.classes, label, title=f"{label}: {train_name or train_id}"
                )
            )
        if report.predictions:
            row[f"{label}/predictions_file"] = report.predictions
        run.log(row)
        report.wandb_run_id = run.id
        run.finish()
        if label == "test" and result is not None and train_id:
            self._into_training_run(w, train_id, group, train_name, result.scalars("test"))
        write_atomic(self.out_dir / EVAL_FILE, json.dumps(report.to_json(), indent=2) + "\n")

    def write_result(self, report: EvalReport) -> None:
        """result.json (ddp_launcher.RunResult): the job's value is the split's top-1 accuracy
        (None for a folder of images), its metric `<split>/acc`, higher is better; its summary
        (the report's columns) the split and what was measured there (eval_acc, eval_loss,
        ...); eval.json stays the evaluation's full record."""
        if not self.enabled:
            return
        measured = {
            k: v
            for k, v in report.metrics.items()
            if isinstance(v, int | float) and not isinstance(v, bool) and not k.endswith("count")
        }
        result = RunResult(
            "completed",
            value=measured.get("acc"),
            metric=f"{report.split}/acc",
            direction="max",
            summary={"split": report.split, **{f"eval_{k}": v for k, v in measured.items()}},
            wall_time_s=report.wall_time_s,
            wandb_run_id=report.wandb_run_id,
        )
        result.app = {"checkpoint": report.checkpoint, "world_size": report.world_size}
        write_result(self.out_dir, result)

    def _into_training_run(self, w, run_id: str, group, name, test: dict) -> None:
        online = resolve_wandb_mode(w.mode) == "online"
        # Online, "must": only a run that exists (reachable) is resumed, never created.
        run = init_wandb(
            w,
            run_dir=self.out_dir,
            config=None,
            group=group,
            name=name,
            run_id=run_id,
            resume="must" if online else "allow",
            job="evaluation",
        )
        if run is None:
            log.warning("W&B: training run %s not reachable: test/* not written to it", run_id)
            return
        run.summary.update(test)
        run.finish()
        log.info(
            "W&B: test/* written into the training run %s's summary%s",
            run_id,
            "" if online else " (offline: `wandb sync` this run dir's wandb/)",
        )


def plot_confusion(result: EvalResult, classes: list[str], path: Path, split: str) -> None:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    counts = result.confusion.numpy()
    n = len(classes)
    side = min(4 + 0.45 * n, 30)
    fig, ax = plt.subplots(figsize=(side, side * 0.85))
    try:
        image = ax.imshow(counts, cmap="Blues")
        fig.colorbar(image, ax=ax, fraction=0.046)
        if n <= ANNOTATED_CLASSES:
            ticks = np.arange(n)
            ax.set_xticks(ticks, classes, rotation=90)
            ax.set_yticks(ticks, classes)
            for (i, j), value in np.ndenumerate(counts):
                if value:
                    dark = value > counts.max() / 2
                    ax.text(
                        j,
                        i,
                        str(value),
                        ha="center",
                        va="center",
                        fontsize="small",
                        color="white" if dark else "black",
                    )
        ax.set_xlabel("predicted class")
        ax.set_ylabel("true class")
        ax.set_title(f"{split}: acc {result.acc:.4f} ({result.count} samples)", fontsize="medium")
        with atomic_path(path) as tmp:
            fig.savefig(tmp, format="png", dpi=100, bbox_inches="tight")
    finally:
        plt.close(fig)


def write_predictions(path: Path, rows: list[dict], classes: list[str], sample_ids: list) -> None:
    """One row per sample in split order: sample (its index in the set it was carved from, or
    its file), label and predicted class (names; label empty when unknown), then the top-k
    classes with their probabilities."""
    k = len(rows[0]["classes"]) if rows else 0
    with atomic_path(path) as tmp, open(tmp, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(
            [
                "sample",
                "label",
                "predicted",
                *(c for j in range(1, k + 1) for c in (f"top{j}", f"p{j}")),
            ]
        )
        for row in rows:
            label = classes[row["label"]] if row["label"] >= 0 else ""
            top = [
                v
                for c, p in zip(row["classes"], row["probs"], strict=True)
                for v in (classes[c], f"{p:.6g}")
            ]
            writer.writerow([sample_ids[row["position"]], label, classes[row["classes"][0]], *top])
