"""Numeric precision and memory layout of a rank's model: autocast, the fp16 GradScaler,
channels_last."""

from __future__ import annotations

import logging
from contextlib import nullcontext

import torch

from core.errors import UserError

log = logging.getLogger(__name__)

# "64": the model and its inputs in float64, no autocast: for numerics checks (e.g. that a run
# resumed at another world size ends where the uninterrupted one ends: in float32 the all-reduce's
# rounding can flip a ReLU or max-pool near a tie and move the weights by ~1e-3).
DTYPES = {"32": None, "64": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def precision_context(precision: str, device: torch.device):
    """Autocast for bf16/fp16; a no-op for 32."""
    if str(precision) not in DTYPES:
        raise UserError(f"trainer.precision={precision} is not valid: use 32, 64, bf16 or fp16")
    dtype = DTYPES[str(precision)]
    return torch.autocast(device.type, dtype=dtype) if dtype else nullcontext()


def model_dtype(trainer_cfg) -> torch.dtype:
    """The weights' dtype: float64 with precision=64, else float32 (autocast lowers the rest)."""
    return torch.float64 if str(trainer_cfg.precision) == "64" else torch.float32


def as_model_input(x: torch.Tensor, model: torch.nn.Module) -> torch.Tensor:
    """Floating-point images in the model's own dtype (float64 only with precision=64)."""
    dtype = next(model.parameters()).dtype
    return x.to(dtype) if x.is_floating_point() and x.dtype != dtype else x


def memory_format(trainer_cfg) -> torch.memory_format:
    return torch.channels_last if trainer_cfg.channels_last else torch.preserve_format


def grad_scaler(precision: str, device: torch.device) -> torch.amp.GradScaler:
    """Loss scaling for fp16 only (bf16 has fp32's range); a no-op scaler otherwise."""
    return torch.amp.GradScaler(device.type, enabled=str(precision) == "fp16")


def warn_if_bf16_emulated(precision: str, device: torch.device) -> bool:
    """bf16 on a GPU without native bf16 (before Ampere: V100, T4, whose tensor cores take fp16,
    not bf16): torch emulates it, and says nothing; one warning line saying so. True where it
    warned."""
    if str(precision) != "bf16" or device.type != "cuda":
        return False
    # about the current device, which init_distributed set to the rank's (ROCm: always True)
    if torch.cuda.is_bf16_supported(including_emulation=False):
        return False
    log.warning(
        "trainer.precision=bf16 on %s, which has no native bf16: torch emulates it (no tensor "
        "cores); use trainer.precision=fp16 (or 32) on this GPU",
        torch.cuda.get_device_name(device),
    )
    return True
