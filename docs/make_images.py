"""Redraw the pictures in docs/img/ from a real (small) sweep, so they show what the project
itself writes:

    python docs/make_images.py                      # runs a 2-job, 3-epoch digits sweep (~1 min)
    python docs/make_images.py --sweep-dir DIR      # or draws from a sweep dir you already have

* sweep_summary.png: the figure the sweep summary writes (`<sweep dir>/summary.png`), as is;
* wandb_scalars.png: the scalar panels of one job's W&B run, drawn from its metrics.jsonl (rank
  0 logs the same rows to W&B): train/loss, lr, samples_per_s per step; val/acc, val/loss,
  val/ece per epoch;
* wandb_per_class.png: the per-class accuracy and confusion-matrix panels, drawn from the tables
  the job's offline W&B run recorded (`wandb/offline-run-*/files/media/table/val/`), last epoch.

W&B runs offline here, so the panels are redrawn with matplotlib from the run's own records
rather than screenshotted; each picture stays well under 200 KB.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - after choosing the file-only backend
from matplotlib.ticker import MaxNLocator  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
IMG = REPO / "docs" / "img"
SWEEP = ["optim.lr=0.05,0.2", "trainer.max_epochs=3", "wandb.mode=offline"]
DPI = 80  # small files: the pictures illustrate, they are not for measuring


def run_sweep(parent: Path) -> Path:
    sweep_dir = parent / "lr-sweep"
    cmd = [sys.executable, "train.py", "-m", *SWEEP, f"hydra.sweep.dir={sweep_dir}"]
    print("$", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, cwd=REPO, check=True)
    return sweep_dir


def read_rows(job_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (job_dir / "metrics.jsonl").read_text().splitlines()]


def last_table(job_dir: Path, name: str) -> dict:
    """The last epoch's W&B table `val/<name>` from the job's offline run (files are named
    `<name>_<step>_<hash>.table.json`)."""
    tables = list(job_dir.glob(f"wandb/offline-run-*/files/media/table/val/{name}_*.table.json"))
    if not tables:
        raise SystemExit(f"no W&B table val/{name} under {job_dir}/wandb: was W&B disabled?")
    newest = max(tables, key=lambda p: int(p.name[len(name) + 1 :].split("_")[0]))
    return json.loads(newest.read_text())


def draw_scalars(job_dir: Path, out: Path) -> None:
    rows = read_rows(job_dir)
    train = [r for r in rows if "train/loss" in r]
    val = [r for r in rows if "val/acc" in r]
    panels = [
        ("train/loss", train, "step"),
        ("lr", train, "step"),
        ("samples_per_s", train, "step"),
        ("val/acc", val, "epoch"),
        ("val/loss", val, "epoch"),
        ("val/ece", val, "epoch"),
    ]
    fig, axes = plt.subplots(2, 3, figsize=(10, 5.2))
    for ax, (key, data, x) in zip(axes.flat, panels, strict=True):
        ax.plot([r[x] for r in data], [r[key] for r in data], marker="o", markersize=3)
        ax.set_title(key, fontsize=10)
        ax.set_xlabel(x, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if x == "epoch":
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.suptitle(f"W&B run of one job: {job_dir.parent.name}/{job_dir.name}", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=DPI)
    plt.close(fig)


def draw_per_class(job_dir: Path, out: Path) -> None:
    per_class = last_table(job_dir, "per_class")
    confusion = last_table(job_dir, "confusion_matrix_table")
    classes = [row[0] for row in per_class["data"]]
    index = {c: i for i, c in enumerate(classes)}
    counts = [[0.0] * len(classes) for _ in classes]
    for actual, predicted, n in confusion["data"]:
        counts[index[actual]][index[predicted]] = n

    fig, (bars, matrix) = plt.subplots(1, 2, figsize=(10, 4.2))
    bars.bar(classes, [row[1] for row in per_class["data"]])
    bars.set_title("val/per_class_acc", fontsize=10)
    bars.set_xlabel("class", fontsize=8)
    bars.set_ylim(0, 1)
    image = matrix.imshow(counts, cmap="Blues")
    matrix.set_title("val/confusion_matrix", fontsize=10)
    matrix.set_xlabel("predicted", fontsize=8)
    matrix.set_ylabel("actual", fontsize=8)
    matrix.set_xticks(range(len(classes)), classes, fontsize=7)
    matrix.set_yticks(range(len(classes)), classes, fontsize=7)
    fig.colorbar(image, ax=matrix, shrink=0.8)
    fig.suptitle("the last epoch's per-class panels (W&B tables of the offline run)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=DPI)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sweep-dir", type=Path, help="draw from this sweep instead of running one"
    )
    args = parser.parse_args()
    IMG.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        sweep_dir = args.sweep_dir or run_sweep(Path(tmp))
        job = sweep_dir / "1"  # lr=0.2: it learns within 3 epochs
        shutil.copyfile(sweep_dir / "summary.png", IMG / "sweep_summary.png")
        draw_scalars(job, IMG / "wandb_scalars.png")
        draw_per_class(job, IMG / "wandb_per_class.png")
    for picture in sorted(IMG.glob("*.png")):
        print(f"{picture.relative_to(REPO)}: {picture.stat().st_size / 1024:.0f} KB")


if __name__ == "__main__":
    main()
