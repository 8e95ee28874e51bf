"""Optimizer and learning-rate schedule, from the `optim` and `trainer` configs.

The optimizer is any torch.optim class (conf/optim/*.yaml, a partial over parameter groups);
three recipe keys are read here and never reach it: `lr_scaling` + `base_batch_size` (the lr
is given at the base batch and scaled to the global batch, timm's --lr-base/--lr-base-size/
--lr-base-scale) and `decay_norm_and_bias` (false: no weight decay on parameters with
ndim <= 1, i.e. norm weights and biases, as timm's default).
"""

from __future__ import annotations

import logging
import math

import torch
from ddp_launcher import UserError, one_line
from hydra.utils import instantiate
from omegaconf import OmegaConf

log = logging.getLogger(__name__)

SCHEDULES = ("cosine", "constant")
SCALINGS = ("none", "linear", "sqrt")
RECIPE_KEYS = ("lr_scaling", "base_batch_size", "decay_norm_and_bias")


def scaled_lr(lr: float, scaling: str, global_batch: int, base_batch: int) -> float:
    """`lr` given at `base_batch`, for `global_batch`: x ratio (linear), x sqrt(ratio), or as is."""
    if scaling not in SCALINGS:
        raise UserError(f"optim.lr_scaling={scaling} is not valid: use none, linear or sqrt")
    if base_batch < 1:
        raise UserError(f"optim.base_batch_size={base_batch} must be >= 1")
    ratio = global_batch / base_batch
    return lr * {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[scaling]


def param_groups(model: torch.nn.Module, weight_decay: float, decay_norm_and_bias: bool):
    """The trainable parameters, as one group, or two: with weight decay, and without it for
    every parameter with ndim <= 1 (norm weights, biases) unless `decay_norm_and_bias`."""
    params = [p for p in model.parameters() if p.requires_grad]
    if decay_norm_and_bias or not weight_decay:
        return params
    decay = [p for p in params if p.ndim > 1]
    no_decay = [p for p in params if p.ndim <= 1]
    return [
        group
        for group in ({"params": decay}, {"params": no_decay, "weight_decay": 0.0})
        if group["params"]
    ]


def build_optimizer(optim_cfg, model: torch.nn.Module, global_batch: int) -> torch.optim.Optimizer:
    """`optim` is a partial over the parameter groups (conf/optim/*.yaml); torch's own argument
    checks (a negative lr, betas out of range) become one-line errors naming the key."""
    cfg = OmegaConf.to_container(optim_cfg, resolve=True)
    recipe = {key: cfg.pop(key) for key in RECIPE_KEYS if key in cfg}
    scaling = recipe.get("lr_scaling", "none")
    base = int(recipe.get("base_batch_size", global_batch))
    lr = scaled_lr(float(cfg["lr"]), scaling, global_batch, base)
    if scaling != "none":
        log.info(
            "lr %.4g: optim.lr=%g at optim.base_batch_size=%d, %s-scaled to the global batch %d",
            lr,
            cfg["lr"],
            base,
            scaling,
            global_batch,
        )
    groups = param_groups(
        model, cfg.get("weight_decay", 0.0), recipe.get("decay_norm_and_bias", True)
    )
    try:
        # _convert_: plain lists (betas), never ListConfig: checkpoints load weights_only.
        return instantiate({**cfg, "lr": lr, "_convert_": "all"})(groups)
    except (ValueError, TypeError, IndexError) as e:
        scaled = f" ({scaling}-scaled from optim.lr={cfg['lr']})" if lr != cfg["lr"] else ""
        reason = one_line(e)
        if isinstance(e, IndexError):  # a list shorter than the optimizer reads (betas=[])
            lists = ", ".join(f"optim.{k}={v}" for k, v in cfg.items() if isinstance(v, list))
            reason = f"{reason} (reading {lists})"
        raise UserError(f"optimizer {optim_cfg._target_}: {reason}{scaled}: fix optim.*") from None


def warmup_steps(trainer_cfg, steps_per_epoch: int) -> int:
    """Optimizer steps of the linear warm-up (trainer.warmup_epochs, at most the whole run)."""
    total = max(1, steps_per_epoch * trainer_cfg.max_epochs)
    return min(int(trainer_cfg.warmup_epochs * steps_per_epoch), total)


def lr_schedule(optimizer, trainer_cfg, steps_per_epoch: int):
    """Linear warm-up, then cosine decay to 0 (or constant), stepped once per optimizer step."""
    total = max(1, steps_per_epoch * trainer_cfg.max_epochs)
    warmup = warmup_steps(trainer_cfg, steps_per_epoch)
    if trainer_cfg.lr_schedule not in SCHEDULES:
        raise UserError(f"trainer.lr_schedule={trainer_cfg.lr_schedule}: use cosine or constant")
    if trainer_cfg.warmup_epochs < 0:
        raise UserError(f"trainer.warmup_epochs={trainer_cfg.warmup_epochs} must be >= 0")
    if trainer_cfg.warmup_epochs > trainer_cfg.max_epochs:  # (taken as the whole run: say so)
        log.warning(
            "trainer.warmup_epochs=%g is longer than trainer.max_epochs=%d: the lr warms up over "
            "the whole run and reaches its value only at the last step (lower "
            "trainer.warmup_epochs for a schedule after it)",
            trainer_cfg.warmup_epochs,
            trainer_cfg.max_epochs,
        )

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if trainer_cfg.lr_schedule == "constant":
            return 1.0
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
