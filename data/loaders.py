"""Per-rank DataLoaders: resumable shuffled train shards, exact val shards, seeded workers."""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import DataLoader

from data.datasets import DataSplits
from data.samplers import ExactShardSampler, ResumableDistributedSampler
from data.seeding import mix_seed

# Distinguish the train and val loaders' worker seeds.
_TRAIN_STREAM, _VAL_STREAM = 0, 1


@dataclass
class Loaders:
    train: DataLoader
    val: DataLoader
    train_sampler: ResumableDistributedSampler


def seed_worker(worker_id: int) -> None:
    """Seed python ``random`` and numpy from this worker's torch seed.

    The loader's generator is seeded from (seed, rank) and torch gives worker w the seed
    base + w, so every RNG in a worker is a function of (seed, rank, worker id).
    """
    seed = torch.initial_seed()
    random.seed(seed)
    np.random.seed([seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF])


def build_loaders(
    splits: DataSplits,
    *,
    batch_size: int,
    eval_batch_size: int,
    rank: int,
    world_size: int,
    seed: int,
    num_workers: int = 0,
    pin_memory: bool = False,
) -> Loaders:
    """Loaders for this rank; ``batch_size`` and ``eval_batch_size`` are per rank.

    Train batches hold ``(epoch, index)``-seeded samples (see ResumableDistributedSampler).
    The sampler drops the tail that does not divide by the world size and the loader drops the
    last partial batch, so the global batch at step k is the same block of the epoch's
    permutation for any world size with the same global batch: 1-rank and N-rank runs train
    on identical batches (without padded duplicates), only split differently.
    Call ``train_sampler.set_epoch(epoch)`` before each epoch.
    """
    if batch_size < 1 or eval_batch_size < 1:
        raise ValueError(f"batch sizes must be >= 1, got {batch_size} and {eval_batch_size}")
    train_sampler = ResumableDistributedSampler(
        splits.train,
        num_replicas=world_size,
        rank=rank,
        shuffle=True,
        seed=seed,
        drop_last=True,
    )
    val_sampler = ExactShardSampler(len(splits.val), rank, world_size)  # type: ignore[arg-type]

    def loader(dataset, sampler, size: int, drop_last: bool, stream: int) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=size,
            sampler=sampler,
            drop_last=drop_last,
            num_workers=num_workers,
            pin_memory=pin_memory,
            persistent_workers=num_workers > 0,
            worker_init_fn=seed_worker,
            generator=torch.Generator().manual_seed(mix_seed(seed, rank, stream)),
        )

    return Loaders(
        train=loader(splits.train, train_sampler, batch_size, True, _TRAIN_STREAM),
        val=loader(splits.val, val_sampler, eval_batch_size, False, _VAL_STREAM),
        train_sampler=train_sampler,
    )
