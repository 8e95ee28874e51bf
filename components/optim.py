"""Optimizer and learning-rate schedule, from the `optim` and `trainer` configs."""

from __future__ import annotations

import math

import torch
from hydra.utils import instantiate

from components.errors import UserError, one_line

SCHEDULES = ("cosine", "constant")


def build_optimizer(optim_cfg, model: torch.nn.Module) -> torch.optim.Optimizer:
    """`optim` is a partial over the parameters (conf/optim/*.yaml); torch's own argument checks
    (a negative lr, betas out of range) become one-line errors naming the key."""
    try:
        return instantiate(optim_cfg)(model.parameters())
    except (ValueError, TypeError) as e:
        raise UserError(f"optimizer {optim_cfg._target_}: {one_line(e)}: fix optim.*") from None


def lr_schedule(optimizer, trainer_cfg, steps_per_epoch: int):
    """Linear warm-up, then cosine decay to 0 (or constant), stepped once per optimizer step."""
    total = max(1, steps_per_epoch * trainer_cfg.max_epochs)
    warmup = int(trainer_cfg.warmup_epochs * steps_per_epoch)
    if trainer_cfg.lr_schedule not in SCHEDULES:
        raise UserError(f"trainer.lr_schedule={trainer_cfg.lr_schedule}: use cosine or constant")

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if trainer_cfg.lr_schedule == "constant":
            return 1.0
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
