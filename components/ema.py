"""Exponential moving average of the weights: torch.optim.swa_utils.AveragedModel with
get_ema_multi_avg_fn (parameters and buffers, so BatchNorm statistics are averaged too).

Every rank keeps the same average (its model is the same after each all-reduced step), so each
can validate its share of the EMA model; checkpoints save it through the TrainingState.
"""

from __future__ import annotations

import torch
from ddp_launcher import UserError
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn


class EMA(AveragedModel):
    """AveragedModel updated every `every_n_steps` optimizer steps (`maybe_update`)."""

    def __init__(self, model: torch.nn.Module, decay: float, every_n_steps: int = 1):
        if not 0.0 < decay < 1.0:
            raise UserError(f"trainer.ema.decay={decay} must be in (0, 1), e.g. 0.999, or null")
        if every_n_steps < 1:
            raise UserError(f"trainer.ema.every_n_steps={every_n_steps} must be >= 1")
        super().__init__(model, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True)
        self.every_n_steps = every_n_steps

    def restart_from(self, model: torch.nn.Module) -> None:
        """Start the average afresh from `model`'s weights (a resume whose checkpoint has no
        EMA: the weights restored, not the fresh initialisation, are where it begins)."""
        with torch.no_grad():
            for mine, theirs in zip(
                self.module.state_dict().values(), model.state_dict().values(), strict=True
            ):
                mine.copy_(theirs)
        self.n_averaged.zero_()

    def maybe_update(self, model: torch.nn.Module, step: int) -> None:
        """After optimizer step `step` (1-based): fold `model` in on every N-th step."""
        if step % self.every_n_steps == 0:
            self.update_parameters(model)


def build_ema(model: torch.nn.Module, ema_cfg) -> EMA | None:
    """The EMA of `model` that `trainer.ema` asks for (None when decay is null)."""
    if ema_cfg.decay is None:
        return None
    return EMA(model, float(ema_cfg.decay), int(ema_cfg.every_n_steps))
