"""The monitored metric (`trainer.monitor`): it picks best.pt, is the value train.py returns to
sweepers and ranks the sweep summary; early stopping (`trainer.early_stopping`) watches it too.

Its state is saved in every checkpoint, so a resumed run keeps its best and its patience count.
It is the one place the run's bests live: best.pt's value and epoch, and val/acc's best whatever
the monitored metric is (result.json's best_val_acc); the console, result.json and the W&B
checkpoint artifacts read them here.
"""

from __future__ import annotations

import math
from typing import Any

from core.errors import UserError

MODES = ("max", "min")


class Monitor:
    def __init__(self, metric: str, mode: str, patience: int | None = None, min_delta: float = 0.0):
        if mode not in MODES:
            raise UserError(f"trainer.monitor.mode={mode} is not valid: use max or min")
        if patience is not None and patience < 1:
            raise UserError(f"trainer.early_stopping.patience={patience} must be >= 1 or null")
        if min_delta < 0:
            raise UserError(f"trainer.early_stopping.min_delta={min_delta} must be >= 0")
        self.metric, self.mode = str(metric), str(mode)
        self.patience, self.min_delta = patience, float(min_delta)
        self.best: float | None = None  # the best value so far (best.pt's)
        self.best_epoch: int | None = None
        self.reference: float | None = None  # early stopping's: the last value that improved
        self.stale = 0  # validations in a row without an improvement by more than min_delta
        self.best_val_acc: float | None = None  # val/acc's best, whatever `metric` is

    def better(self, value: float, than: float | None, margin: float = 0.0) -> bool:
        if not math.isfinite(value):
            return False
        if than is None:
            return True
        return value > than + margin if self.mode == "max" else value < than - margin

    def update(self, epoch: int, metrics: dict[str, Any]) -> bool:
        """Record an epoch's validation metrics; whether it is the new best."""
        if self.metric not in metrics:
            known = ", ".join(k for k in metrics if "/" in k)
            raise UserError(
                f"trainer.monitor.metric={self.metric} is not a validation metric "
                f"of this run: use one of {known}"
            )
        value = float(metrics[self.metric])
        if "val/acc" in metrics:
            self.best_val_acc = max(self.best_val_acc or 0.0, float(metrics["val/acc"]))
        is_best = self.better(value, self.best)
        if is_best:
            self.best, self.best_epoch = value, epoch
        if self.better(value, self.reference, self.min_delta):
            self.reference, self.stale = value, 0
        else:
            self.stale += 1
        return is_best

    def describe_stop(self) -> str:
        """Why early stopping stops, in words (for its log line)."""
        return (
            f"{self.metric} has not improved by more than {self.min_delta:g} for {self.stale} "
            f"epochs (best {self.best:.4f} at epoch {self.best_epoch})"
        )

    @property
    def should_stop(self) -> bool:
        return self.patience is not None and self.stale >= self.patience

    def state_dict(self) -> dict[str, Any]:
        return {
            "best": self.best,
            "best_epoch": self.best_epoch,
            "reference": self.reference,
            "stale": self.stale,
            "best_val_acc": self.best_val_acc,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A key the checkpoint lacks (an older run's) keeps this monitor's fresh value."""
        for key in self.state_dict():
            if key in state:
                setattr(self, key, state[key])
        self.stale = int(self.stale or 0)
