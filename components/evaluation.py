"""Evaluation metrics, computed by the same code for validation in train.py and for eval.py.

Each rank evaluates its exact shard (ExactShardSampler: every sample on exactly one rank, no
padding) and accumulates sums and counts on the device, with no host sync per batch: the loss
sum, the confusion matrix (top-1 accuracy and per-class accuracy come from it), top-k hits and
calibration bins. `all_reduce()` then adds every rank's sums in one collective, so the metrics
are those of the whole split, each sample counted once (pytorch/examples' imagenet reduces
(sum, count) the same way; padding duplicates, as timm and Lightning do, would bias them).

    metrics = evaluate(model, loader, device, tc, num_classes)   # this rank's shard
    metrics.all_reduce()                                          # every rank: one collective
    result = metrics.result()                                     # EvalResult, same on all ranks
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F

from components.precision import as_model_input, memory_format

TOP_K = 5  # the "top-5" of the metrics (top-min(5, classes) for fewer classes)
ECE_BINS = 15  # equal-width confidence bins of the expected calibration error


@dataclass
class EvalResult:
    """Whole-split metrics. ``confusion[i, j]``: samples of class i predicted as class j."""

    loss: float  # mean cross-entropy
    acc: float  # top-1
    acc5: float  # top-k, k = min(5, classes)
    ece: float  # expected calibration error of the top-1 confidence, ECE_BINS bins
    count: int
    confusion: torch.Tensor  # int64 [classes, classes] on the CPU

    @property
    def per_class_count(self) -> list[int]:
        return self.confusion.sum(1).tolist()

    @property
    def per_class_acc(self) -> list[float | None]:
        """Recall of each class; None for a class with no samples in the split."""
        hits, counts = self.confusion.diagonal().tolist(), self.per_class_count
        return [h / c if c else None for h, c in zip(hits, counts, strict=True)]

    def numbers(self) -> dict[str, float | int]:
        return {
            "loss": self.loss,
            "acc": self.acc,
            "acc5": self.acc5,
            "ece": self.ece,
            "count": self.count,
        }

    def scalars(self, prefix: str) -> dict[str, float | int]:
        """The logged numbers: ``{prefix}/loss``, ``/acc``, ``/acc5``, ``/ece``, ``/count``."""
        return {f"{prefix}/{name}": value for name, value in self.numbers().items()}


class EvalAccumulator:
    """This rank's sums and counts, one float64 tensor on the device (exact for counts below
    2**53), so that the reduction over ranks is a single all-reduce."""

    def __init__(
        self,
        num_classes: int,
        device: torch.device | str,
        *,
        top_k: int = TOP_K,
        bins: int = ECE_BINS,
    ) -> None:
        self.num_classes, self.bins = num_classes, bins
        self.top_k = min(top_k, num_classes)
        c = num_classes
        self.sums = torch.zeros(2 + c * c + 3 * bins, dtype=torch.float64, device=device)
        self.loss_sum, self.topk_hits = self.sums[0], self.sums[1]  # views into sums
        self.confusion = self.sums[2 : 2 + c * c].view(c, c)
        self.bin_count, self.bin_confidence, self.bin_hits = self.sums[2 + c * c :].view(3, bins)

    def update(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        """Add one batch: ``logits`` [B, classes] (any float dtype), ``labels`` [B] int64."""
        logits = logits.float()
        c = self.num_classes
        # per-sample losses summed in float64: the sum then does not depend (beyond float64
        # rounding) on how the split is cut into batches and shards
        self.loss_sum += F.cross_entropy(logits, labels, reduction="none").double().sum()
        predicted = logits.argmax(1)
        # Counts added with index_add_ into the fixed-size sums, not torch.bincount: bincount
        # sizes its output from the data (its min and max read back to the host: on a GPU, 2
        # syncs per call, 8 per batch); index_add_ launches and returns.
        ones = torch.ones_like(predicted, dtype=torch.float64)
        self.confusion.view(-1).index_add_(0, labels * c + predicted, ones)
        top = logits.topk(self.top_k, dim=1).indices
        self.topk_hits += (top == labels[:, None]).any(1).sum()
        confidence = logits.softmax(1).gather(1, predicted[:, None])[:, 0].double()
        which = (confidence * self.bins).long().clamp_(0, self.bins - 1)
        hit = (predicted == labels).double()
        self.bin_count.index_add_(0, which, ones)
        self.bin_confidence.index_add_(0, which, confidence)
        self.bin_hits.index_add_(0, which, hit)

    def all_reduce(self) -> None:
        """Sum every rank's counts into every rank's (a collective: all ranks call it once)."""
        dist.all_reduce(self.sums)  # SUM

    def result(self) -> EvalResult:
        """The metrics of what was accumulated (call all_reduce first for the whole split)."""
        sums = self.sums.cpu()
        c = self.num_classes
        confusion = sums[2 : 2 + c * c].view(c, c).round().long()
        bin_count, bin_confidence, bin_hits = sums[2 + c * c :].view(3, self.bins)
        count = int(confusion.sum())
        n = max(count, 1)
        return EvalResult(
            loss=float(sums[0]) / n,
            acc=int(confusion.diagonal().sum()) / n,
            acc5=float(sums[1]) / n,
            ece=float((bin_hits - bin_confidence).abs().sum()) / n,
            count=count,
            confusion=confusion,
        )


class Predictions:
    """Per-sample top-k classes and probabilities of this rank's shard (for predictions.csv),
    gathered to every rank in split order."""

    def __init__(self, num_classes: int, top_k: int = TOP_K) -> None:
        self.top_k = min(top_k, num_classes)
        self.labels: list[torch.Tensor] = []
        self.classes: list[torch.Tensor] = []
        self.probs: list[torch.Tensor] = []

    def add(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        top = logits.float().softmax(1).topk(self.top_k, dim=1)
        self.labels.append(labels.cpu())
        self.classes.append(top.indices.cpu())
        self.probs.append(top.values.cpu())

    def gather(self, positions: list[int]) -> list[dict[str, Any]]:
        """Every rank's rows, sorted by position in the split (a collective): ``position``,
        ``label`` (-1: unlabeled), ``classes`` and ``probs`` (top-k, most probable first)."""
        mine = (
            []
            if not self.labels
            else [
                {"position": p, "label": int(y), "classes": c, "probs": q}
                for p, y, c, q in zip(
                    positions,
                    torch.cat(self.labels).tolist(),
                    torch.cat(self.classes).tolist(),
                    torch.cat(self.probs).tolist(),
                    strict=True,
                )
            ]
        )
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        return sorted((row for rows in every for row in rows), key=lambda r: r["position"])


class PredictionSink(Protocol):
    """What evaluate() hands each batch's logits to: Predictions, or the W&B sample table's
    watch (components/wandb_media.py)."""

    def add(self, logits: torch.Tensor, labels: torch.Tensor) -> None: ...


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    loader,
    device: torch.device,
    tc: Any,
    num_classes: int,
    *,
    labelled: bool = True,
    predictions: PredictionSink | None = None,
) -> EvalAccumulator:
    """This rank's metrics over ``loader`` (model in eval mode; not yet reduced over ranks).
    ``labelled=False`` (images without labels) only collects ``predictions``."""
    model.eval()
    metrics = EvalAccumulator(num_classes, device)
    for x, y in loader:
        x = x.to(device, non_blocking=True, memory_format=memory_format(tc))
        x = as_model_input(x, model)
        y = y.to(device, non_blocking=True)
        logits = model(x)
        if labelled:
            metrics.update(logits, y)
        if predictions is not None:
            predictions.add(logits, y)
    return metrics
