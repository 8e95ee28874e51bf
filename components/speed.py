"""Speed accounting: step time, data-wait share, peak memory, time to first step, and MFU.

Timings are host-side and read at log steps, which synchronise anyway (the loss all-reduce), so
a window's totals are exact without a sync per step.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from components.precision import as_model_input

# Dense peak throughput per GPU, in FLOP/s, by the precision the matmuls run in.
# (tf32 is what fp32 matmuls use when torch.backends.cuda.matmul.allow_tf32 is on.)
PEAK_FLOPS = {
    # name fragment: {precision: FLOP/s}
    "H200": {"bf16": 989e12, "fp16": 989e12, "tf32": 494e12, "32": 67e12},
    "H100": {"bf16": 989e12, "fp16": 989e12, "tf32": 494e12, "32": 67e12},
    "A100": {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "32": 19.5e12},
    "A10G": {"bf16": 70e12, "fp16": 70e12, "tf32": 35e12, "32": 31.2e12},
    "L40S": {"bf16": 362e12, "fp16": 362e12, "tf32": 183e12, "32": 91.6e12},
    "L4": {"bf16": 121e12, "fp16": 121e12, "tf32": 60e12, "32": 30.3e12},
    "V100": {"fp16": 125e12, "32": 15.7e12},
    "RTX 4090": {"bf16": 165e12, "fp16": 165e12, "tf32": 82.6e12, "32": 82.6e12},
}


def peak_flops(device: torch.device, precision: str) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    if precision == "32" and torch.backends.cuda.matmul.allow_tf32:
        precision = "tf32"
    for fragment, table in PEAK_FLOPS.items():
        if fragment in name:
            return table.get(precision)
    return None


def forward_flops_per_sample(model: torch.nn.Module, x: torch.Tensor) -> float:
    """Forward FLOPs of one sample (torch.utils.flop_counter; a train step is about 3x that).

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
    return float(counter.get_total_flops())


def model_facts(model: torch.nn.Module, sample: torch.Tensor) -> dict[str, float | int]:
    """Trainable parameters and forward FLOPs per sample (`sample`: one input batch)."""
    return {
        "params": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "flops_per_sample": forward_flops_per_sample(model, sample),
    }


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


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
    ):
        self.timer = StepTimer()
        self.samples_per_step = samples_per_step
        self.first_step_s: float | None = None
        self.flops_per_sample = flops_per_sample  # of a train step (forward + backward)
        self.peak_flops = peak_flops(device, precision)

    def step_done(self) -> bool:
        """Count a step; True after the run's first one (startup is over)."""
        self.timer.step_done()
        if self.first_step_s is None:
            from core.run_dir import process_age_s

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
