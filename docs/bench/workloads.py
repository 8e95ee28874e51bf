"""The throughput workloads A-D, the modes each runs in, and the targets the report checks."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

MODES = ("train.py", "reference", "raw")


WARMUP_WINDOWS = 1  # dropped from the front of each run's window rates


WINDOWS = 6  # throughput windows per run (log_every = steps // WINDOWS)


SMOKE_STEPS = 2


TIME_TO_ACCURACY = "E"  # docs/bench/time_to_accuracy.py
STARTUP = "S"  # docs/bench/startup.py
SEED_SPREAD = "V"  # docs/bench/seed_spread.py
GPU_CHECK = "G"  # docs/bench/gpu.py


PLAIN_LR = 0.1  # the plain recipe's SGD lr (docs/bench/reference.py), train.py's at the batch of 64


@dataclass(frozen=True)
class Workload:
    description: str
    global_batch: int
    shape: tuple[int, int, int]  # one sample as the model sees it, C x H x W
    steps: int  # default optimizer steps per run (one epoch of steps * global_batch samples)
    # DataLoader workers per rank, one cell each (the same on both sides; "auto": train.py's
    # rule, data.loaders.data_workers); None: not a DataLoader workload (B: fast path)
    workers: tuple[int | str, ...] | None = (0,)
    smoke_world_sizes: tuple[int, ...] = (1, 2)  # the cells --smoke runs


WORKLOADS = {
    "A": Workload(
        "resnet18 (3x3 stem) on FakeData 3x32x32", 64, (3, 32, 32), steps=24, smoke_world_sizes=(1,)
    ),
    # 120 * 256 = 30720 MNIST-format samples
    "B": Workload(
        "small CNN on MNIST-format idx files",
        256,
        (1, 28, 28),
        steps=120,
        workers=None,
        smoke_world_sizes=(2,),
    ),
    "C": Workload(
        "resnet18 (standard stem) on FakeData 3x32x32",
        64,
        (3, 32, 32),
        steps=40,
        workers=(0, 2),
        smoke_world_sizes=(2,),
    ),
    # 40 * 64 = 2560 JPEGs of 96-160 px, RandomResizedCrop(32) + flip on both sides
    "D": Workload(
        "small CNN [8, 16] on a JPEG ImageFolder (96-160 px), RandomResizedCrop 32 + flip",
        64,
        (3, 32, 32),
        steps=40,
        workers=("auto",),
        smoke_world_sizes=(1,),
    ),
}


# The small CNN of workload D: light enough (~0.3 ms per sample on a core) that the data path
# (decode + crop, ~0.5-0.9 ms per image) shows.
D_CHANNELS, D_HIDDEN = (8, 16), 32


# (name, workload it applies to or None for all, world size or None for all)
TARGETS = (
    ("A: train/ref >= 1.0", "A", None),
    ("B: train/raw >= 0.95", "B", None),
    ("C: train/ref >= 1.0", "C", None),
    ("D: train/ref >= 1.3", "D", None),
    ("1st step <= import + 1.0 s", None, 1),
    ("1st step <= import + 2.0 s", None, 2),
)


FIRST_STEP_MARGIN_S = {1: 1.0, 2: 2.0}


def steady_rate(window_rates: list[float]) -> float | None:
    """Median of the window rates after the warm-up window(s); all of them if too few."""
    kept = window_rates[WARMUP_WINDOWS:] or window_rates
    return statistics.median(kept) if kept else None


def best_rate(window_rates: list[float]) -> float | None:
    """The fastest window after the warm-up: the least disturbed by other load on the machine
    (noise only ever slows a window down)."""
    kept = window_rates[WARMUP_WINDOWS:] or window_rates
    return max(kept) if kept else None


@dataclass(frozen=True)
class Setup:
    workload: str
    world_size: int
    steps: int
    log_every: int
    data_root: Path | None  # workloads B and D
    threads: int  # OMP_NUM_THREADS per process
    train_overrides: tuple[str, ...] = ()
    timeout_s: float = 1800.0
    workers: int | None = None  # DataLoader workers per rank, both sides (None: B's fast path)
    python: str | None = None  # the interpreter of every mode (None: this one; --compare-python)
