"""Stable seeds, and the train-set wrapper that seeds augmentation from (seed, epoch, index).

Per-sample seeding (rather than relying on worker RNG state) is what makes an augmented sample
independent of the rank that loads it, the world size, the number of workers and where an
epoch was resumed: the same (seed, epoch, index) always gives the same tensor.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils.data import Dataset, get_worker_info

_MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    # SplitMix64 finaliser: cheap, well mixed, and identical in every process and Python version
    # (unlike hash(), whose str hashing is salted per process).
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def mix_state(*values: int) -> int:
    """The 64-bit hash state after `values`: mix_seed(*a, *b) == mix_seed_from(mix_state(*a), *b),
    so a constant prefix (seed, epoch) is hashed once, not once per sample."""
    h = 0
    for value in values:
        h = splitmix64(h ^ (int(value) & _MASK64))
    return h


def mix_seed_from(state: int, value: int) -> int:
    """mix_seed of the values behind `state` (mix_state) followed by `value`."""
    return splitmix64(state ^ (int(value) & _MASK64)) >> 1


def mix_seed(*values: int) -> int:
    """A 63-bit seed that depends on every value and their order (valid for torch.manual_seed)."""
    return mix_state(*values) >> 1


class EpochSeededDataset(Dataset):
    """Train-set wrapper: item ``(epoch, index)`` is loaded and transformed with torch's CPU RNG
    seeded from ``(seed, epoch, index)`` only; a bare ``index`` means epoch 0.

    ResumableDistributedSampler yields such tuples. The CPU generator's state is restored
    afterwards, so wrapping does not disturb any other randomness in the process. With
    ``random=False`` (a transform that draws no random number, see
    data.transforms.is_random) items are loaded as they are, without touching the RNG.

    Seeding goes straight to ``torch.default_generator`` (what v2 transforms draw from; they
    take no generator argument): ``torch.manual_seed`` also queues a lazy seed for every CUDA
    device, formatting the Python stack each time (~0.3 ms, more than the whole transform of a
    small image), and ``fork_rng`` adds ~10 us of context-manager overhead. Per sample the
    (seed, epoch) part of the hash is cached (one SplitMix64 round per sample), and in a
    DataLoader worker the generator's state is not saved and restored: every draw a worker
    makes is seeded per sample, so nothing else reads that state.
    """

    def __init__(self, dataset: Dataset, seed: int, random: bool = True) -> None:
        self.dataset = dataset
        self.seed = int(seed)
        self.random = bool(random)
        self._epoch_state: tuple[int, int] = (0, mix_state(self.seed, 0))  # (epoch, its state)

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: Any) -> Any:
        epoch, index = key if isinstance(key, tuple) else (0, key)
        index = int(index)
        if not self.random:
            return self.dataset[index]
        if self._epoch_state[0] != epoch:
            self._epoch_state = (epoch, mix_state(self.seed, epoch))
        seed = mix_seed_from(self._epoch_state[1], index)  # == mix_seed(self.seed, epoch, index)
        generator = torch.default_generator
        if get_worker_info() is not None:  # a worker: only seeded draws read this generator
            generator.manual_seed(seed)
            return self.dataset[index]
        # seeded(), inlined: this runs for every sample
        state = generator.get_state()
        generator.manual_seed(seed)
        try:
            return self.dataset[index]
        finally:
            generator.set_state(state)

    def __repr__(self) -> str:
        return (
            f"EpochSeededDataset(seed={self.seed}, random={self.random}, dataset={self.dataset!r})"
        )


@contextmanager
def seeded(seed: int) -> Iterator[None]:
    """torch's CPU generator seeded with ``seed`` inside the block, its state restored after:
    ``fork_rng(devices=[])`` + ``manual_seed`` for the CPU alone, at a fraction of the cost."""
    generator = torch.default_generator
    state = generator.get_state()
    generator.manual_seed(seed)
    try:
        yield
    finally:
        generator.set_state(state)


_RANK_STREAM = 0x72616E6B  # keeps the per-rank seeds apart from the per-sample ones


def seed_rank(seed: int, rank: int) -> int:
    """Seed this process's global generators (torch's CPU and CUDA ones, Python's `random`,
    numpy's) from (seed, rank): the draws each rank makes on its own, the model's dropout and
    stochastic-depth masks first, differ across ranks (with one seed for all, rank r's mask for
    its k-th sample would be every rank's). Call it after the draws every rank must share
    (the initial weights: DDP also broadcasts rank 0's); the data's draws (sampler order,
    augmentation, MixUp/CutMix) have seeds of their own. Returns the rank's seed."""
    import random

    import numpy as np

    rank_seed = mix_seed(seed, rank, _RANK_STREAM)
    torch.manual_seed(rank_seed)
    random.seed(rank_seed)
    np.random.seed([rank_seed & 0xFFFFFFFF, rank_seed >> 32])
    return rank_seed
