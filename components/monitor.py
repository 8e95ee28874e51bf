"""The monitored metric (`trainer.monitor`): it picks best.pt, is the value train.py returns to
sweepers and ranks the sweep summary; early stopping (`trainer.early_stopping`) watches it too.

Its state is saved in every checkpoint, so a resumed run keeps its best and its patience count.
It is the one place the run's bests live: best.pt's value and epoch, and val/acc's best whatever
the monitored metric is (result.json's best_val_acc); the console, result.json and the W&B
checkpoint artifacts read them here. So does the target (`trainer.target`): the first validation
at which the monitored metric reached a given value, and when (result.json's `target`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from ddp_launcher import UserError

if TYPE_CHECKING:
    from ddp_launcher import TrialLink

MODES = ("max", "min")


class Monitor:
    def __init__(
        self,
        metric: str,
        mode: str,
        patience: int | None = None,
        min_delta: float = 0.0,
        target: float | None = None,
    ):
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
        self.target = check_target(self.metric, target)
        self.last: float | None = None  # the latest validation's value
        # The first validation at the target: {reached_at_s, reached_at_step, epoch, reached_value}
        self.reached: dict[str, Any] | None = None

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
        value = self.last = float(metrics[self.metric])
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

    def reach_target(self, epoch: int, step: int, seconds: float) -> bool:
        """After `update`: whether the latest validation (epoch `epoch`, at optimizer step
        `step`, `seconds` from process start) is the first at the target; records it if so."""
        if self.target is None or self.reached is not None or self.last is None:
            return False
        if not math.isfinite(self.last):
            return False
        at = self.last >= self.target if self.mode == "max" else self.last <= self.target
        if at:
            self.reached = {
                "reached_at_s": round(seconds, 3),
                "reached_at_step": step,
                "epoch": epoch,
                "reached_value": self.last,
            }
        return at

    def target_record(self) -> dict[str, Any] | None:
        """result.json's `target`: None without trainer.target; the reached_* fields are None
        while the metric has not reached it."""
        if self.target is None:
            return None
        reached = self.reached or dict.fromkeys(
            ("reached_at_s", "reached_at_step", "epoch", "reached_value")
        )
        return {"value": self.target, "metric": self.metric, "mode": self.mode, **reached}

    def describe_target(self) -> str:
        """The target reached, in words (for its log line)."""
        r = self.reached or {}
        return (
            f"{self.metric} reached the target {self.target:g} ({r.get('reached_value', 0):.4f}) "
            f"at epoch {r.get('epoch')}, step {r.get('reached_at_step')}, "
            f"{r.get('reached_at_s', 0):.1f} s from process start"
        )

    def describe_stop(self) -> str:
        """Why early stopping stops, in words (for its log line)."""
        return (
            f"{self.metric} has not improved by more than {self.min_delta:g} for {self.stale} "
            f"epochs (best {self.best:.4f} at epoch {self.best_epoch})"
        )

    def restart_best(self) -> None:
        """The best (best.pt's) counts again from the next validation: a run continued from
        another run's checkpoint whose best epoch's weights did not come along."""
        self.best, self.best_epoch = None, None

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
            "reached": self.reached,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A key the checkpoint lacks (an older run's) keeps this monitor's fresh value."""
        for key in self.state_dict():
            if key in state:
                setattr(self, key, state[key])
        self.stale = int(self.stale or 0)


# Metrics whose values are fractions in [0, 1] (val/acc, val_ema/acc5, ...): a target outside
# that is a percentage typed by habit (99 for 0.99), never reached.
FRACTIONS = ("/acc", "/acc5", "/ece")


def check_target(metric: str, target: float | None) -> float | None:
    """trainer.target as a float (None: off), or one line naming the fix."""
    if target is None:
        return None
    value = float(target)
    if not math.isfinite(value):
        raise UserError(f"trainer.target={target} is not a number: use a value of {metric}")
    if metric.endswith(FRACTIONS) and not 0.0 <= value <= 1.0:
        hint = f", e.g. trainer.target={value / 100:g}" if 0 < value <= 100 else ""
        raise UserError(
            f"trainer.target={target} is outside {metric}'s range: use a fraction in [0, 1]{hint}"
        )
    return value


def check_prune(
    link: TrialLink | None, epoch: int, val: dict[str, float], monitor: Monitor, device
):
    """After a validation of a trial the Optuna sweeper prunes (`link`: rank 0's, else None):
    rank 0 reports the monitored metric and asks the pruner; every rank gets the answer in one
    broadcast (always, so all ranks call the same collectives). Raises Pruned on every rank
    when the trial is to stop."""
    from ddp_launcher import Pruned

    from components.distributed import rank0_decides

    metric, pruned = monitor.metric, False
    if link is not None and metric in val:
        pruned = link.should_prune(epoch, val[metric])
    if rank0_decides(pruned, device):
        raise Pruned(epoch, float(val.get(metric, float("nan"))), monitor.best)
