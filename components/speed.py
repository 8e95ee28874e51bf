"""Speed accounting: step time, data-wait share, peak memory, time to first step, and MFU.

Timings are host-side and read at log steps, which synchronise anyway (the loss all-reduce), so
a window's totals are exact without a sync per step.
"""

from __future__ import annotations

import logging
import resource
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from components.precision import as_model_input

log = logging.getLogger(__name__)

# Dense (not sparse) peak throughput per GPU part, in FLOP/s, by the math the FLOPs run in:
# bf16/fp16 under autocast; with precision 32, "tf32" where torch lets cuDNN or cuBLAS use
# TF32 tensor cores, "32" (plain FP32) where not. From NVIDIA's data sheets.
PEAK_FLOPS = {
    "H100 SXM": {"bf16": 989e12, "fp16": 989e12, "tf32": 494e12, "32": 67e12},
    "H100 PCIe": {"bf16": 756e12, "fp16": 756e12, "tf32": 378e12, "32": 51e12},
    "H100 NVL": {"bf16": 835e12, "fp16": 835e12, "tf32": 418e12, "32": 60e12},
    "H200 NVL": {"bf16": 835e12, "fp16": 835e12, "tf32": 418e12, "32": 60e12},
    "A100": {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "32": 19.5e12},
    "A10": {"bf16": 125e12, "fp16": 125e12, "tf32": 62.5e12, "32": 31.2e12},
    "A10G": {"bf16": 70e12, "fp16": 70e12, "tf32": 35e12, "32": 31.2e12},
    "L40S": {"bf16": 362e12, "fp16": 362e12, "tf32": 183e12, "32": 91.6e12},
    "L40": {"bf16": 181e12, "fp16": 181e12, "tf32": 90.5e12, "32": 90.5e12},
    "L4": {"bf16": 121e12, "fp16": 121e12, "tf32": 60e12, "32": 30.3e12},
    "V100 SXM2": {"fp16": 125e12, "32": 15.7e12},
    "V100 PCIe": {"fp16": 112e12, "32": 14e12},
    "RTX 4090": {"bf16": 165e12, "fp16": 165e12, "tf32": 82.6e12, "32": 82.6e12},
}
# torch.cuda.get_device_name -> its part above, matched exactly: a substring would take an
# "NVIDIA L40" for an L4, or an H100 PCIe for the SXM part. A name not listed has no MFU.
DEVICE_PARTS = {
    "NVIDIA H100 80GB HBM3": "H100 SXM",
    "NVIDIA H100 80GB HBM3e": "H100 SXM",
    "NVIDIA GH200 480GB": "H100 SXM",
    "NVIDIA H200": "H100 SXM",  # H200 SXM: H100 SXM's compute, more memory
    "NVIDIA H100 PCIe": "H100 PCIe",
    "NVIDIA H100 NVL": "H100 NVL",
    "NVIDIA H200 NVL": "H200 NVL",
    "NVIDIA A100-SXM4-40GB": "A100",
    "NVIDIA A100-SXM4-80GB": "A100",
    "NVIDIA A100-PCIE-40GB": "A100",
    "NVIDIA A100 80GB PCIe": "A100",
    "NVIDIA A10": "A10",
    "NVIDIA A10G": "A10G",
    "NVIDIA L40S": "L40S",
    "NVIDIA L40": "L40",
    "NVIDIA L4": "L4",
    "Tesla V100-SXM2-16GB": "V100 SXM2",
    "Tesla V100-SXM2-32GB": "V100 SXM2",
    "Tesla V100-PCIE-16GB": "V100 PCIe",
    "Tesla V100-PCIE-32GB": "V100 PCIe",
    "NVIDIA GeForce RTX 4090": "RTX 4090",
}


def math_precisions(precision: str) -> tuple[str | None, str | None]:
    """(convolutions', matmuls') math as torch is set now; (None, None) where torch's settings
    cannot be read (MFU is then left out, with one warning: it never stops a run). With
    precision 32, cuDNN runs convolutions in TF32 and cuBLAS runs matmuls in TF32 where torch
    lets them: the convolution's on by default, the matmul's off (both changed by
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32,
    torch.set_float32_matmul_precision or, torch >= 2.9, the fp32_precision settings)."""
    precision = str(precision)
    if precision != "32":
        return precision, precision
    try:
        conv_tf32, matmul_tf32 = _tf32_allowed()
    except Exception as e:  # noqa: BLE001 - MFU is a figure, never a reason to stop a run
        log.warning("MFU left out: torch's TF32 settings could not be read (%s)", e)
        return None, None
    return "tf32" if conv_tf32 else "32", "tf32" if matmul_tf32 else "32"


def set_fp32_math(precision: str, device: torch.device, tf32: bool | None) -> dict[str, str | None]:
    """trainer.tf32: with precision 32 on a GPU that has TF32 (compute capability 8.0+: A100,
    H100, L4, RTX 30xx/40xx), true runs cuBLAS matmuls and cuDNN convolutions in TF32 (torch's
    default is TF32 for convolutions only, FP32 for matmuls: a linear layer or attention ran at
    a fraction of the tensor cores' rate); false runs both in full FP32; null leaves torch's
    settings as they are (what the user set before the run). Returns the run's facts: the math
    its convolutions and matmuls run in (math_precisions), which MFU's peak follows too; None
    where torch cannot say. Off CUDA, the precision itself."""
    precision = str(precision)
    if device.type != "cuda":
        return {"conv_math": precision, "matmul_math": precision}
    if precision == "32" and tf32 is not None:
        allowed = bool(tf32) and has_tf32(device)
        matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
        if hasattr(matmul, "fp32_precision") and hasattr(cudnn, "conv"):  # torch >= 2.9
            # (after these, reading the legacy allow_tf32 flags raises: _tf32_allowed reads these)
            matmul.fp32_precision = "tf32" if allowed else "ieee"
            cudnn.conv.fp32_precision = "tf32" if allowed else "ieee"
        else:
            matmul.allow_tf32 = cudnn.allow_tf32 = allowed
    conv, matmul_math = math_precisions(precision)
    return {"conv_math": conv, "matmul_math": matmul_math}


def has_tf32(device: torch.device) -> bool:
    """Whether a CUDA device has TF32 tensor cores: NVIDIA's compute capability 8.0 and later
    (ROCm's builds report their own capabilities: left alone)."""
    if torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability(device) >= (8, 0)


def _tf32_allowed() -> tuple[bool, bool]:
    """Whether cuDNN convolutions and cuBLAS matmuls may run FP32 work in TF32. torch >= 2.9
    reads the fp32_precision settings (a "none" resolves through its parents, cudnn's then
    torch.backends', as the kernels resolve it: at::Context::float32Precision), and raises on
    reading the legacy allow_tf32 flags once those settings were changed; older torch has only
    the flags."""
    conv = getattr(torch.backends.cudnn, "conv", None)
    if conv is not None and hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        return (
            conv.fp32_precision == "tf32",
            torch.backends.cuda.matmul.fp32_precision == "tf32",
        )
    return torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32


def peak_flops(device: torch.device, precision: str, conv_share: float = 0.0) -> float | None:
    """The peak FLOP/s of `device` for a model whose FLOPs are `conv_share` convolutions (the
    rest matmuls): the time-weighted mix of both peaks. None off CUDA, for a GPU not in
    DEVICE_PARTS, or a math the part has no figure for (or that torch cannot tell)."""
    if device.type != "cuda":
        return None
    part = DEVICE_PARTS.get(torch.cuda.get_device_name(device))
    if part is None:
        return None
    conv_math, matmul_math = math_precisions(precision)
    conv_peak, matmul_peak = PEAK_FLOPS[part].get(conv_math), PEAK_FLOPS[part].get(matmul_math)
    seconds = 0.0  # per FLOP of the model
    for share, peak in ((conv_share, conv_peak), (1.0 - conv_share, matmul_peak)):
        if share > 0:
            if peak is None:
                return None
            seconds += share / peak
    return 1.0 / seconds if seconds else None


def forward_flops_per_sample(model: torch.nn.Module, x: torch.Tensor) -> tuple[float, float]:
    """Forward FLOPs of one sample, and how many of them are convolutions
    (torch.utils.flop_counter; a train step is about 3x that).

    Counted in eval mode without gradients, so BN statistics and RNG are left untouched.
    """
    from torch.utils.flop_counter import FlopCounterMode

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            model(as_model_input(x[:1], model))
    finally:
        model.train(was_training)
    by_op = counter.get_flop_counts().get("Global", {})
    conv = sum(n for op, n in by_op.items() if "convolution" in str(op))
    return float(counter.get_total_flops()), float(conv)


def model_facts(model: torch.nn.Module, sample: torch.Tensor) -> dict[str, float | int]:
    """Trainable parameters and forward FLOPs per sample, all and convolutions' (`sample`: one
    input batch)."""
    flops, conv = forward_flops_per_sample(model, sample)
    return {
        "params": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "flops_per_sample": flops,
        "conv_flops_per_sample": conv,
    }


def peak_memory_mb(device: torch.device) -> float:
    """This process's peak memory since its last reset (reset_peak_memory): on a GPU the
    allocator's peak, on the CPU the resident set's (Linux: since the last reset too)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak: the CUDA allocator's (torch.cuda.reset_peak_memory_stats), or on the
    CPU the process's peak resident set (Linux: writing 5 to /proc/self/clear_refs resets it,
    VmHWM and getrusage's ru_maxrss alike; elsewhere the CPU peak stays the process's)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


class PeakMemory:
    """Peak memory per phase of a run (each epoch's training, its validation): each phase
    starts a new peak, so a train row's `peak_mem_mb` is its training's alone, not the largest
    of everything since the process started (a validation at a larger batch, an earlier
    epoch's). `run_peak()`: the largest of all phases (result.json's)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.phase: str | None = None
        self.peaks: dict[str, float] = {}  # each phase's largest peak so far

    def start(self, phase: str) -> None:
        self._fold()
        reset_peak_memory(self.device)
        self.phase = phase

    def current(self) -> float:
        """The peak (MiB) since this phase started."""
        return peak_memory_mb(self.device)

    def run_peak(self) -> float:
        self._fold()
        return max(self.peaks.values(), default=self.current())

    def _fold(self) -> None:
        if self.phase is not None:
            self.peaks[self.phase] = max(self.peaks.get(self.phase, 0.0), self.current())


class StepTimer:
    """Per log window: time spent waiting for batches vs the whole window."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.window_start = time.perf_counter()
        self.data_wait = 0.0
        self.steps = 0

    @contextmanager
    def waiting_for_data(self) -> Iterator[None]:
        tic = time.perf_counter()
        yield
        self.data_wait += time.perf_counter() - tic

    def step_done(self) -> None:
        self.steps += 1

    def window(self) -> tuple[float, float, int]:
        """(seconds, data-wait share in %, steps) since the last reset."""
        seconds = time.perf_counter() - self.window_start
        return seconds, 100.0 * self.data_wait / max(seconds, 1e-9), self.steps


class Speed:
    """The train loop's throughput: a step timer, the rate of each logged window, the first
    step's time since process start, and train FLOPs per sample for MFU (on GPU)."""

    def __init__(
        self,
        device: torch.device,
        precision: str,
        samples_per_step: int,
        flops_per_sample: float | None = None,
        conv_share: float = 0.0,
    ):
        self.timer = StepTimer()
        self.memory = PeakMemory(device)
        self.samples_per_step = samples_per_step
        self.first_step_s: float | None = None
        self.flops_per_sample = flops_per_sample  # of a train step (forward + backward)
        # What the model's FLOPs run at (convolutions and matmuls may differ: TF32).
        self.peak_flops = peak_flops(device, precision, conv_share)

    def step_done(self) -> bool:
        """Count a step; True after the run's first one (startup is over)."""
        self.timer.step_done()
        if self.first_step_s is None:
            from ddp_launcher import process_age_s

            self.first_step_s = round(process_age_s(), 3)
            return True
        return False

    def window(self) -> tuple[float, float, float]:
        """(samples/s, step time in ms, data-wait %) since the last window; starts a new one."""
        seconds, wait_pct, steps = self.timer.window()
        self.timer.reset()
        rate = steps * self.samples_per_step / seconds
        return rate, 1000 * seconds / max(steps, 1), wait_pct

    def mfu(self, rate: float, world_size: int) -> float | None:
        if not self.flops_per_sample or not self.peak_flops:
            return None
        return self.flops_per_sample * rate / (self.peak_flops * world_size)
