"""Numeric precision and memory layout of a rank's model: autocast, the fp16 GradScaler,
channels_last; trainer.precision=auto resolved for this machine's hardware."""

from __future__ import annotations

import logging
import os
from contextlib import nullcontext

import torch
from ddp_launcher import UserError
from ddp_launcher.ranks.distributed import rank0_decides

log = logging.getLogger(__name__)

# "64": the model and its inputs in float64, no autocast: for numerics checks (e.g. that a run
# resumed at another world size ends where the uninterrupted one ends: in float32 the all-reduce's
# rounding can flip a ReLU or max-pool near a tie and move the weights by ~1e-3).
DTYPES = {"32": None, "64": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def precision_context(precision: str, device: torch.device):
    """Autocast for bf16/fp16; a no-op for 32."""
    check_precision(precision)
    dtype = DTYPES[str(precision)]
    return torch.autocast(device.type, dtype=dtype) if dtype else nullcontext()


def check_precision(precision: str) -> None:
    if str(precision) not in DTYPES:
        raise UserError(
            f"trainer.precision={precision} is not valid: use auto, 32, 64, bf16 or fp16"
        )


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


# --- trainer.precision=auto: bf16 where the hardware has it natively, else 32 ----------------

AUTO = "auto"

# oneDNN's ISA names below AVX512_CORE_BF16 in its order (doc: dispatcher_control.md; the
# AVX2 line ends at AVX2_VNNI_2, which converts bf16 but has no AVX512-BF16 dot products).
# ONEDNN_MAX_CPU_ISA (or the older DNNL_MAX_CPU_ISA) at one of them keeps oneDNN, which runs
# the CPU's bf16 convolutions and matmuls, off the bf16 instructions; oneDNN lower-cases the
# value and takes a name it does not know as no cap (src/cpu/x64/cpu_isa_traits.cpp).
ONEDNN_BELOW_BF16 = frozenset(
    {"sse41", "avx", "avx2", "avx2_vnni", "avx2_vnni_2", "avx512_core", "avx512_core_vnni"}
    | {"avx512_mic", "avx512_mic_4ops"}  # oneDNN < 3.0's Xeon Phi names
)


def onednn_isa_cap() -> str | None:
    """oneDNN's ISA cap from the environment as oneDNN reads it (ONEDNN_ first), else None."""
    for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        if os.environ.get(name):
            return f"{name}={os.environ[name]}"
    return None


def native_bf16(device: torch.device) -> tuple[bool, str]:
    """Whether `device` computes bf16 natively (not emulated), and why, in a few words.

    A GPU: torch.cuda.is_bf16_supported(including_emulation=False) (compute capability 8.0+;
    V100 and T4 emulate it). A CPU: AVX512-BF16 or AMX (torch's own probes), with oneDNN free
    to use them (ONEDNN_MAX_CPU_ISA). Measured with the recipes' small CNN (batch 256, one
    thread, AMD EPYC with AVX512-BF16): bf16 trained 1.5-1.7x fp32's samples/s; with oneDNN
    capped at AVX2 0.16x and at AVX512_CORE 0.8x; ATen capped at AVX2 (ATEN_CPU_CAPABILITY)
    alone still 2.0x, so torch.backends.cpu.get_cpu_capability() only names the CPU here."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return True, f"{name} has native bf16"
        major, minor = torch.cuda.get_device_capability(device)
        return False, f"{name} has no native bf16: compute capability {major}.{minor}"
    capability = torch.backends.cpu.get_cpu_capability()
    units = [
        unit
        for unit, probe in (
            ("AVX512-BF16", "_is_avx512_bf16_supported"),
            ("AMX", "_is_amx_tile_supported"),
        )
        if getattr(torch.cpu, probe, lambda: False)()  # private probes: absent in some builds
    ]
    if not units:
        return False, f"this CPU has no native bf16: {capability}"
    cap = onednn_isa_cap()
    if cap is not None and cap.split("=", 1)[1].strip().lower() in ONEDNN_BELOW_BF16:
        return False, f"this CPU has no native bf16 for oneDNN: {capability}, {cap}"
    if not torch.backends.mkldnn.is_available():
        return False, "this torch has no oneDNN, which runs bf16 on CPUs"
    return True, f"this CPU has native bf16: {capability} with {' and '.join(units)}"


def resolve_precision(precision, env) -> str:
    """trainer.precision as this run trains: `auto` becomes bf16 where rank 0's device has
    native bf16, else 32, every rank following rank 0 (`env`:
    ddp_launcher.ranks.distributed.DistEnv,
    its process group up), and rank 0 says which and why in one line. Other values come back
    as they are, checked."""
    precision = str(precision)
    if precision != AUTO:
        check_precision(precision)
        return precision
    native, why = native_bf16(env.device)
    chosen = "bf16" if rank0_decides(native, env.device) else "32"
    if env.is_main:
        log.info("trainer.precision=auto: %s (%s)", chosen, why)
    return chosen


def warn_if_bf16_emulated(precision: str, device: torch.device) -> bool:
    """bf16 on a GPU without native bf16 (before Ampere: V100, T4, whose tensor cores take fp16,
    not bf16): torch emulates it, and says nothing; one warning line saying so. True where it
    warned (trainer.precision=auto never picks it there: native_bf16)."""
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
