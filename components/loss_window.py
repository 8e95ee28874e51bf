"""The train loss window: what each rank sums between two logged train rows (train.py)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class LossWindow:
    """This rank's train loss (and, for hard labels, its correct predictions) since the last
    logged row, summed on the device (no host sync per step). Saved per rank in checkpoints,
    so a resume continues the window exactly."""

    def __init__(self, device: torch.device):
        self.sum = torch.zeros((), device=device)
        self.count = 0
        self.correct = torch.zeros((), device=device)
        self.samples = 0  # samples counted in `correct`

    def add(self, loss: torch.Tensor, correct: torch.Tensor | None = None, samples: int = 0):
        self.sum += loss
        self.count += 1
        if correct is not None:
            self.correct += correct
            self.samples += samples

    def mean_over_ranks(self) -> tuple[float, float | None]:
        """The window's mean loss and accuracy (None: no hard-label samples, e.g. with mixup)
        over every rank (one all-reduce), then start a new window."""
        totals = torch.stack(
            [
                self.sum,
                torch.tensor(float(self.count), device=self.sum.device),
                self.correct,
                torch.tensor(float(self.samples), device=self.sum.device),
            ]
        )
        dist.all_reduce(totals)  # SUM (gloo has no AVG)
        self.sum.zero_()
        self.correct.zero_()
        self.count = self.samples = 0
        loss_sum, count, correct, samples = totals.tolist()
        return loss_sum / max(count, 1), (correct / samples if samples else None)

    def state_dict(self) -> dict[str, Any]:
        return {
            "sum": float(self.sum),
            "count": self.count,
            "correct": float(self.correct),
            "samples": self.samples,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sum.fill_(state["sum"])
        self.count = int(state["count"])
        self.correct.fill_(state.get("correct", 0.0))
        self.samples = int(state.get("samples", 0))
