"""A run that diverges says so: when the train loss after the warm-up climbs clearly above its
first logged window's (RISE times it), rank 0 warns once, naming the step, the lr and the
overrides to try, and the run records it (result.json's `diverged`, the W&B run's summary).
Without it a run can spend its last epochs recovering from a spike while the console only
shows a worse final accuracy (docs/recipes.md#stability)."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("train")

RISE = 1.5  # after the warm-up, a train window above 1.5x the first one's: diverging


class DivergenceWatch:
    """Reads each logged train row. The first window's loss and whether the run has already
    warned live in Progress (checkpointed): a resumed run compares against the same start
    and does not warn twice."""

    def __init__(self, progress: Any, warmup_steps: int, optim_lr: float, grad_clip: Any):
        self.progress, self.warmup_steps = progress, warmup_steps
        self.optim_lr, self.grad_clip = optim_lr, grad_clip

    def check(self, row: dict[str, Any]) -> dict[str, Any] | None:
        """The divergence to record (once per run), or None. Every rank gets the same rows
        (their losses are all-reduced), so every rank decides alike."""
        p, loss = self.progress, row["train/loss"]
        if p.first_train_loss is None:
            p.first_train_loss = loss
            return None
        if p.diverged_step is not None or row["step"] <= self.warmup_steps:
            return None
        if not loss > RISE * p.first_train_loss:  # (a non-finite loss is train_row's to stop)
            return None
        p.diverged_step = row["step"]
        tries = [f"optim.lr={self.optim_lr / 2:g}"]
        if self.grad_clip is None:
            tries.append("trainer.grad_clip=1.0")
        found = {
            "step": row["step"],
            "epoch": row["epoch"],
            "train/loss": loss,
            "first_train/loss": p.first_train_loss,
            "lr": row["lr"],
            "try": tries,
        }
        log.warning(
            "diverging: train/loss %.4g at step %d (epoch %d, lr %.4g) is %.1fx its first "
            "window's %.4g, after the warm-up; try %s",
            loss,
            row["step"],
            row["epoch"],
            row["lr"],
            loss / p.first_train_loss,
            p.first_train_loss,
            " or ".join(tries),
        )
        return found
