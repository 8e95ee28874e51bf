"""The monitored metric (`trainer.monitor`): it picks best.pt, is the value train.py returns to
sweepers and ranks the sweep summary; early stopping (`trainer.early_stopping`) watches it too.

Its state is saved in every checkpoint, so a resumed run keeps its best and its patience count.
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
        is_best = self.better(value, self.best)
        if is_best:
            self.best, self.best_epoch = value, epoch
        if self.better(value, self.reference, self.min_delta):
            self.reference, self.stale = value, 0
        else:
            self.stale += 1
        return is_best

    @property
    def should_stop(self) -> bool:
        return self.patience is not None and self.stale >= self.patience

    def state_dict(self) -> dict[str, Any]:
        return {
            "best": self.best,
            "best_epoch": self.best_epoch,
            "reference": self.reference,
            "stale": self.stale,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in self.state_dict():
            setattr(self, key, state.get(key))
        self.stale = int(self.stale or 0)
