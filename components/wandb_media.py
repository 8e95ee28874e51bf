"""W&B panels beyond scalars: what the model gets wrong, and its checkpoints as artifacts.

Rank 0 logs; the data come from every rank, exactly.

* Per class (:func:`class_panels`, also eval.py's): per-class accuracy as a Table and a bar
  plot, and W&B's confusion-matrix plot, from the all-reduced confusion matrix of the exact
  distributed evaluation (components/evaluation.py): no extra collective.
* A fixed subset of val (:class:`ValMedia`): `wandb.num_images` samples picked once from the
  val split with a fixed seed (not the run's: the same images in every run of a dataset, so
  tables compare across epochs and runs), classes taken in turn. Evaluation hands each rank's
  logits to a :class:`SampleWatch`, which keeps those of the picked samples in its shard; one
  small reduce brings them to rank 0 (each row comes from the one rank that holds the sample,
  so the sum is exact). Images are the val images as stored (uint8, before normalisation):
  the fast path's tensors, or the dataset's own item without the transform.
* Checkpoints (:class:`CheckpointArtifacts`, `wandb.log_checkpoints`): artifact
  `model-<run id>`, one version per logged checkpoint, aliases `latest` and `best`, metadata
  step, epoch, best so far and the epoch's val metrics. The name is stable per run, so a
  resumed run adds versions to the same lineage.

W&B failing at any of these is a warning (components/metrics.py's RunLogger catches it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from ddp_launcher import UserError

from components.evaluation import EvalResult

log = logging.getLogger(__name__)

MAX_PLOTTED_CLASSES = 100  # W&B's confusion plot has classes**2 rows; above this, the table only
SAMPLE_SEED = 0  # picks the val images: fixed, like the val split itself
MAX_IMAGE_SIDE = 256  # larger stored images are shrunk for the table (bandwidth)
SAMPLE_COLUMNS = ["sample", "image", "label", "predicted", "confidence", "correct"]


def class_panels(result: EvalResult, classes: list[str], prefix: str, title: str) -> dict:
    """`<prefix>/per_class` (Table: class, acc, count), `<prefix>/per_class_acc` (its bar
    plot) and `<prefix>/confusion_matrix` (W&B's plot; up to MAX_PLOTTED_CLASSES classes)."""
    import wandb

    table = wandb.Table(
        columns=["class", "acc", "count"],
        data=[
            [name, acc, count]
            for name, acc, count in zip(
                classes, result.per_class_acc, result.per_class_count, strict=True
            )
        ],
    )
    panels = {
        f"{prefix}/per_class": table,
        f"{prefix}/per_class_acc": wandb.plot.bar(
            table, "class", "acc", title=f"{title}: accuracy per class"
        ),
    }
    if len(classes) <= MAX_PLOTTED_CLASSES:
        # W&B's confusion plot takes one (true, predicted) pair per sample.
        n = len(classes)
        cells = np.repeat(np.arange(n * n), result.confusion.flatten().numpy())
        panels[f"{prefix}/confusion_matrix"] = wandb.plot.confusion_matrix(
            y_true=(cells // n).tolist(),
            preds=(cells % n).tolist(),
            class_names=classes,
            title=title,
        )
    return panels


def pick_samples(
    n_total: int, n: int, labels: np.ndarray | None, seed: int = SAMPLE_SEED
) -> np.ndarray:
    """`n` positions of a split of `n_total`, sorted: a fixed shuffle in which, where `labels`
    are known, the classes take turns (the first of each class, then the second, ...)."""
    order = np.random.default_rng(seed).permutation(n_total)
    if labels is not None and len(labels) == n_total:
        shuffled = np.asarray(labels)[order]
        by_class = np.argsort(shuffled, kind="stable")
        group_start = np.searchsorted(shuffled[by_class], shuffled[by_class])
        turn = np.empty(n_total, dtype=np.int64)
        turn[by_class] = np.arange(n_total) - group_start  # k: the k-th of its class
        order = order[np.argsort(turn, kind="stable")]
    return np.sort(order[:n])


class SampleWatch:
    """evaluate()'s `predictions` sink for one epoch: of this rank's shard (`positions`, the
    split's indices in the order its loader yields them), the label, predicted class and
    confidence of the `chosen` samples, kept on the device until :meth:`reduce`."""

    def __init__(self, chosen: np.ndarray, positions: list[int], device: torch.device) -> None:
        shard = np.asarray(positions, dtype=np.int64)
        self.local = np.flatnonzero(np.isin(shard, chosen))  # offsets in this rank's order
        self.rows = np.searchsorted(chosen, shard[self.local])  # their rows in the table
        self.count, self.device = len(chosen), device
        self.offset = 0
        self.parts: list[tuple[np.ndarray, torch.Tensor]] = []

    def add(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        start, self.offset = self.offset, self.offset + len(labels)
        hit = (self.local >= start) & (self.local < self.offset)
        if not hit.any():
            return
        index = torch.as_tensor(self.local[hit] - start, device=logits.device)
        # The accumulator's own arithmetic: softmax of the float logits, top-1.
        confidence, predicted = logits[index].float().softmax(1).max(1)
        values = torch.stack([labels[index].double(), predicted.double(), confidence.double()], 1)
        self.parts.append((self.rows[hit], values))

    def reduce(self) -> torch.Tensor | None:
        """A collective: rank 0 gets [chosen, 3] float64 rows (label, predicted, confidence),
        each from the one rank that evaluated that sample (the others add zeros); None
        elsewhere."""
        out = torch.zeros(self.count, 3, dtype=torch.float64, device=self.device)
        for rows, values in self.parts:
            out[torch.as_tensor(rows, device=self.device)] = values.to(self.device)
        dist.reduce(out, dst=0)  # SUM over disjoint rows: a gather, exact
        return out.cpu() if dist.get_rank() == 0 else None


def stored_image(item: Any):
    """A PIL image of a dataset item or uint8 tensor/array as stored ([C,H,W] tensors, [H,W]
    or [H,W,C] arrays), shrunk to MAX_IMAGE_SIDE; None for anything else."""
    from PIL import Image

    if torch.is_tensor(item) and item.dtype == torch.uint8 and item.ndim == 3:
        item = item.permute(1, 2, 0).cpu().numpy()
    if isinstance(item, np.ndarray) and item.dtype == np.uint8 and item.ndim in (2, 3):
        item = Image.fromarray(item[..., 0] if item.ndim == 3 and item.shape[2] == 1 else item)
    if not isinstance(item, Image.Image):
        return None
    if max(item.size) > MAX_IMAGE_SIDE:
        item = item.copy()
        item.thumbnail((MAX_IMAGE_SIDE, MAX_IMAGE_SIDE))
    return item


class ValMedia:
    """The per-epoch panels of validation (see the module docstring), in every rank.

        watch = media.watch(epoch)                       # None: no images this epoch
        metrics = evaluate(..., predictions=watch)
        metrics.all_reduce()
        run.log(row, media=media.panels(epoch, metrics.result(), watch))   # every rank

    Epochs with panels: every `wandb.media_every_n_epochs`-th and the last (0: none); none when
    W&B is disabled. The decision depends on the config only, so every rank takes part in the
    same reduces (also when rank 0's W&B failed to start)."""

    def __init__(self, cfg, splits, val_loader, env) -> None:
        """`cfg`: the run's config (wandb.*, trainer.max_epochs); `env`: this rank's DistEnv."""
        from ddp_launcher import resolve_wandb_mode

        from data import sample_positions
        from data.datasets import labels_of

        w = cfg.wandb
        for key in ("media_every_n_epochs", "num_images"):
            if int(w[key]) < 0:
                raise UserError(f"wandb.{key}={w[key]} must be >= 0 (0: off)")
        wandb_on = resolve_wandb_mode(w.mode) != "disabled"
        self.every = int(w.media_every_n_epochs) if wandb_on else 0
        self.max_epochs = int(cfg.trainer.max_epochs)
        self.rank, self.device = env.rank, env.device
        self.classes = list(splits.classes)
        memory = splits.memory
        labels = memory.val_labels.numpy() if memory is not None else labels_of(splits.val)
        n = min(int(w.num_images), len(splits.val)) if self.every else 0
        self.chosen = pick_samples(len(splits.val), n, labels)
        self.positions = sample_positions(val_loader) if n else []
        self._splits = splits
        self._images: list | None = None  # rank 0's wandb.Images, made once, reused every epoch
        self._ids: list | None = None  # each val sample's id (data.SplitView.sample_ids)

    def due(self, epoch: int) -> bool:
        return self.every > 0 and (epoch % self.every == 0 or epoch == self.max_epochs)

    def watch(self, epoch: int) -> SampleWatch | None:
        if not self.due(epoch) or not len(self.chosen):
            return None
        return SampleWatch(self.chosen, self.positions, self.device)

    def panels(
        self, epoch: int, result: EvalResult, watch: SampleWatch | None
    ) -> Callable[[], dict] | None:
        """Every rank calls it (the images' reduce is a collective); rank 0 gets a function
        that builds the W&B objects, called only when they are logged."""
        if not self.due(epoch):
            return None
        rows = watch.reduce() if watch is not None else None
        if self.rank != 0:
            return None

        def build() -> dict:
            panels = class_panels(result, self.classes, "val", f"val, epoch {epoch}")
            if rows is not None:
                panels["val/samples"] = self.samples_table(rows)
            return panels

        return build

    def samples_table(self, rows: torch.Tensor):
        import wandb

        images, ids = self.images(), self._ids
        data = []
        for k, (position, (label, predicted, confidence)) in enumerate(
            zip(self.chosen.tolist(), rows.tolist(), strict=True)
        ):
            label, predicted = int(label), int(predicted)
            data.append(
                [
                    ids[position],
                    images[k],
                    self.classes[label],
                    self.classes[predicted],
                    confidence,
                    label == predicted,
                ]
            )
        return wandb.Table(columns=SAMPLE_COLUMNS, data=data)

    def images(self) -> list:
        """The chosen val images as stored, as wandb.Images (None where an item is no image)."""
        if self._images is None:
            import wandb

            val = self._splits.val
            self._ids = val.sample_ids() if hasattr(val, "sample_ids") else range(len(val))
            memory = self._splits.memory
            raw = getattr(self._splits.val, "dataset", self._splits.val)  # without the transform
            self._images = []
            for position in self.chosen.tolist():
                item = memory.val_images[position] if memory is not None else raw[position][0]
                image = stored_image(item)
                self._images.append(wandb.Image(image) if image is not None else None)
            if any(image is None for image in self._images):
                log.warning(
                    "W&B: some val items are not uint8 images; val/samples shows no image for them"
                )
        return self._images


class CheckpointArtifacts:
    """Rank 0's checkpoint artifacts: `saved()` after each checkpoint, `ended()` at the end."""

    def __init__(self, policy: Any) -> None:
        # conf/schema.py's CheckpointPolicy (none | best | last | all), or its value
        self.policy = str(getattr(policy, "value", policy))
        self.pending: tuple[Path, dict, list[str]] | None = None

    def saved(self, run, path: Path, metadata: dict, is_best: bool) -> None:
        aliases = ["latest", "best"] if is_best else ["latest"]
        if self.policy == "all" or (self.policy == "best" and is_best):
            self.log(run, path, metadata, aliases)
        elif self.policy == "last":
            self.pending = (path, metadata, aliases)

    def ended(self, run) -> None:
        if self.pending is not None:
            pending, self.pending = self.pending, None
            self.log(run, *pending)

    @staticmethod
    def log(run, path: Path, metadata: dict, aliases: list[str]) -> None:
        """One version of `model-<run id>` holding `path` as checkpoint.pt. W&B copies the file
        into its staging dir at once (kept until uploaded: offline, until `wandb sync`), so
        checkpoints pruned later stay whole."""
        import wandb

        artifact = wandb.Artifact(f"model-{run.id}", type="model", metadata=metadata)
        artifact.add_file(str(path), name="checkpoint.pt")
        run.log_artifact(artifact, aliases=aliases)
        log.debug("W&B: %s as model-%s (%s)", path.name, run.id, ", ".join(aliases))


def save_files(run, files: list[Path], folder: str) -> None:
    """`files` as files of the W&B run, under `folder`/: copied into its files dir, then saved
    from there (W&B would otherwise link them in, with a warning on the console)."""
    import shutil

    files_dir = Path(run.dir)
    (files_dir / folder).mkdir(parents=True, exist_ok=True)
    for path in files:
        shutil.copyfile(path, files_dir / folder / path.name)
        run.save(str(files_dir / folder / path.name), base_path=str(files_dir), policy="now")
