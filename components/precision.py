"""Numeric precision and memory layout of a rank's model: autocast, the fp16 GradScaler,
channels_last."""

from __future__ import annotations

from contextlib import nullcontext

import torch

from core.errors import UserError

DTYPES = {"32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def precision_context(precision: str, device: torch.device):
    """Autocast for bf16/fp16; a no-op for 32."""
    if str(precision) not in DTYPES:
        raise UserError(f"trainer.precision={precision} is not valid: use 32, bf16 or fp16")
    dtype = DTYPES[str(precision)]
    return torch.autocast(device.type, dtype=dtype) if dtype else nullcontext()


def memory_format(trainer_cfg) -> torch.memory_format:
    return torch.channels_last if trainer_cfg.channels_last else torch.preserve_format


def grad_scaler(precision: str, device: torch.device) -> torch.amp.GradScaler:
    """Loss scaling for fp16 only (bf16 has fp32's range); a no-op scaler otherwise."""
    return torch.amp.GradScaler(device.type, enabled=str(precision) == "fp16")
