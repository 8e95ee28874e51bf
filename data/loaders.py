"""Per-rank loaders: resumable shuffled train shards, exact eval shards, seeded workers.

Two paths share the samplers: torch DataLoaders over the datasets (any set), and for sets held
in memory the fast path (data/fast.py), which builds batches on the device with tensor ops.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import os
import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from ddp_launcher import UserError, cores_per_rank, parse_count
from torch.utils.data import DataLoader, Dataset, default_collate

from data.datasets import DataSplits, SplitView
from data.decode import device_stages
from data.fast import FastEvalLoader, FastTrainLoader
from data.samplers import ExactShardSampler, ResumableDistributedSampler
from data.seeding import EpochSeededDataset, mix_seed
from data.transforms import Stages

# Distinguish the train and eval loaders' worker seeds.
_TRAIN_STREAM, _EVAL_STREAM = 0, 1

log = logging.getLogger(__name__)


@dataclass
class Loaders:
    """``for x, y in train`` / ``val``; ``len(train)`` batches per epoch (after any skip).
    ``eval_loader(split)``: another split (e.g. ``test``), loaded like val."""

    train: DataLoader | FastTrainLoader
    val: DataLoader | FastEvalLoader
    train_sampler: ResumableDistributedSampler
    eval_loader: Callable[[str], DataLoader | FastEvalLoader]

    @property
    def fast(self) -> bool:
        """Whether batches come from the in-memory fast path (already on its device)."""
        return isinstance(self.train, FastTrainLoader)

    def step_indices(self) -> list[list[int]]:
        """The sample indices of each train batch this epoch, in order, without loading any
        data: the sampler's items in chunks of the batch size, the last partial one dropped
        (what either path iterates; set the sampler's epoch/skip first)."""
        if isinstance(self.train, FastTrainLoader):
            return self.train.step_indices()
        return chunk_indices(self.train_sampler, self.train.batch_size)  # type: ignore[arg-type]


def data_workers(value: Any, local_world_size: int) -> int:
    """`dataset.num_workers`: an integer >= 0, or `auto`: every core of this rank's share but
    the one its own process trains on (none where a rank has a single core)."""
    workers = parse_count(value, "dataset.num_workers", minimum=0)
    return cores_per_rank(local_world_size) - 1 if workers is None else workers


def chunk_indices(sampler: Iterable[tuple[int, int]], batch_size: int) -> list[list[int]]:
    """``(epoch, index)`` items -> the indices of each full batch of ``batch_size``."""
    indices = [index for _, index in sampler]
    steps = len(indices) // batch_size
    return [indices[k * batch_size : (k + 1) * batch_size] for k in range(steps)]


def seed_worker(worker_id: int) -> None:
    """Seed python ``random`` and numpy from this worker's torch seed.

    The loader's generator is seeded from (seed, rank) and torch gives worker w the seed
    base + w, so every RNG in a worker is a function of (seed, rank, worker id).
    """
    seed = torch.initial_seed()
    random.seed(seed)
    np.random.seed([seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF])


def loader_options(
    dataset_cfg,
    *,
    rank: int,
    world_size: int,
    seed: int,
    device: torch.device,
    local_world_size: int | None = None,
) -> dict:
    """This rank's keyword arguments of build_loaders / eval_loader: its place in the world,
    and from the dataset config (any dataset node: a user's may lack these keys) the workers
    (`auto`: from the cores this rank has, data_workers) and the fast path;
    pinned memory on GPU."""
    if local_world_size is None:
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    workers = data_workers(dataset_cfg.get("num_workers", "auto"), local_world_size)
    return dict(
        rank=rank,
        world_size=world_size,
        seed=seed,
        num_workers=workers,
        pin_memory=torch.device(device).type == "cuda",
        fast=bool(dataset_cfg.get("fast", True)),
        device=device,
    )


def build_loaders(
    splits: DataSplits, *, batch_size: int, eval_batch_size: int, shuffle: bool = True, **options
) -> Loaders:
    """Loaders for this rank; ``batch_size`` and ``eval_batch_size`` are per rank; ``options``
    are eval_loader's keyword arguments (``rank``, ``world_size``, ``seed``, ``num_workers``,
    ``pin_memory``, ``fast``, ``device``: loader_options makes them), for every split alike.

    With ``fast``, a set held in memory (``splits.memory``: digits, mnist, fashion_mnist,
    cifar10, cifar100) and an augmentation recipe it can express (crop, flip, erasing; one log
    line says when it cannot) the loaders are the fast path's: batches built on ``device``
    from uint8 tensors moved there once, same sample indices per rank and step as the
    DataLoaders (and the same batches without augmentation; augmentation is drawn differently).
    ``num_workers`` and ``pin_memory`` then do not apply. Otherwise, DataLoaders on the CPU.

    Train batches hold ``(epoch, index)``-seeded samples (see ResumableDistributedSampler).
    The sampler drops the tail that does not divide by the world size and the loader drops the
    last partial batch, so the global batch at step k is the same block of the epoch's
    permutation for any world size with the same global batch: 1-rank and N-rank runs train
    on identical batches (without padded duplicates), only split differently.
    Call ``train_sampler.set_epoch(epoch)`` before each epoch.
    """
    if batch_size < 1 or eval_batch_size < 1:
        raise ValueError(f"batch sizes must be >= 1, got {batch_size} and {eval_batch_size}")
    options = {"num_workers": 0, "pin_memory": False, **options}  # eval_loader's defaults
    fast, device = options.get("fast", False), options.get("device", "cpu")
    train_sampler = ResumableDistributedSampler(
        splits.train,
        num_replicas=options["world_size"],
        rank=options["rank"],
        shuffle=shuffle,  # False: the same batches every epoch (trainer.overfit_batches)
        seed=options["seed"],
        drop_last=True,
    )
    evaluate = functools.partial(eval_loader, splits, batch_size=eval_batch_size, **options)
    memory = splits.memory
    if fast and memory is not None and memory.augment is None:
        log.info(
            "fast data path off: the augmentation (%s) has no batched tensor version; "
            "using DataLoaders (dataset.fast=false skips this check)",
            memory.unsupported,
        )
    if fast and memory is not None and memory.augment is not None:
        train = FastTrainLoader(memory, train_sampler, batch_size, device)
    else:
        if fast and memory is None:
            log.debug(
                "fast data path: not for this dataset (not held in memory); using DataLoaders"
            )
        train = _loader(
            splits.train, train_sampler, batch_size, drop_last=True, stream=_TRAIN_STREAM, **options
        )
    return Loaders(
        train=train, val=evaluate("val"), train_sampler=train_sampler, eval_loader=evaluate
    )


def eval_loader(
    splits: DataSplits,
    split: str,
    *,
    batch_size: int,
    rank: int,
    world_size: int,
    seed: int,
    num_workers: int = 0,
    pin_memory: bool = False,
    fast: bool = False,
    device: torch.device | str = "cpu",
    dataset: Dataset | None = None,
) -> DataLoader | FastEvalLoader:
    """This rank's exact shard (ExactShardSampler: every sample on exactly one rank, no
    padding) of ``split`` (``train``, ``val``, ``test``: no augmentation), or of ``dataset``
    (e.g. a folder of images), ``batch_size`` per batch; the fast path's where it applies."""
    if dataset is None:
        dataset = splits.eval_set(split)
        if fast and splits.memory is not None:
            sampler = ExactShardSampler(len(dataset), rank, world_size)  # type: ignore[arg-type]
            return FastEvalLoader(splits.memory, sampler, batch_size, device, split)
    sampler = ExactShardSampler(len(dataset), rank, world_size)  # type: ignore[arg-type]
    return _loader(
        dataset,
        sampler,
        batch_size,
        drop_last=False,
        stream=_EVAL_STREAM,
        rank=rank,
        seed=seed,
        num_workers=num_workers,
        pin_memory=pin_memory,
        device=device,
    )


def _loader(
    dataset,
    sampler,
    size: int,
    *,
    drop_last: bool,
    stream: int,
    rank: int,
    seed: int,
    num_workers: int,
    pin_memory: bool,
    device: torch.device | str = "cpu",
    **_unused,
) -> DataLoader:
    device = torch.device(device)
    dataset, stages = staged(dataset, device)
    on_device = device.type != "cpu" and stages.batch is not None
    return StagedLoader(
        dataset,
        batch_size=size,
        sampler=sampler,
        drop_last=drop_last,
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=num_workers > 0,
        # at least 4 batches in flight in all (torch's default is 2 per worker)
        prefetch_factor=max(2, -(-4 // num_workers)) if num_workers else None,
        worker_init_fn=seed_worker,
        generator=torch.Generator().manual_seed(mix_seed(seed, rank, stream)),
        collate_fn=Collate(stages.collate, None if on_device else stages.batch),
        finish=stages.batch if on_device else None,
        device=device,
    )


def staged(dataset: Dataset, device: torch.device) -> tuple[Dataset, Stages]:
    """``dataset`` with its items cut short at its transform's sample stage, and the stages
    (data.transforms.Stages; data.decode.device_stages): the rest runs per batch. Datasets
    other than the SplitViews build_datasets makes are loaded as they are."""
    if isinstance(dataset, EpochSeededDataset):
        inner, stages = staged(dataset.dataset, device)
        return EpochSeededDataset(inner, dataset.seed, dataset.random), stages
    if isinstance(dataset, SplitView):
        stages = device_stages(dataset.transform, device, name_of=dataset.sample_file)
        return SplitView(dataset.dataset, stages.sample), stages
    return dataset, Stages(None)


class Collate:
    """Items -> a batch: ``collate`` (None: torch's default_collate), then the batch stage on
    the images where it runs here (CPU training: in the loader's workers)."""

    def __init__(self, collate: Callable | None, batch: Callable | None) -> None:
        self.collate, self.batch = collate or default_collate, batch

    def __call__(self, items: list) -> Any:
        batch = self.collate(items)
        if self.batch is None:
            return batch
        x, y = batch
        return self.batch(x), y


class StagedLoader(DataLoader):
    """A DataLoader whose batches, with a ``finish`` stage, are moved to ``device`` and
    finished there (GPU training: normalise, or decode and augment, on the device); without
    one, a plain DataLoader."""

    def __init__(
        self, *args, finish: Callable | None = None, device: torch.device | str = "cpu", **kwargs
    ) -> None:
        super().__init__(*args, **kwargs)
        self.finish, self.device = finish, torch.device(device)

    def __iter__(self):
        batches = super().__iter__()
        return batches if self.finish is None else self._finished(batches)

    def _finished(self, batches) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for x, y in batches:
            if isinstance(x, torch.Tensor):
                x = x.to(self.device, non_blocking=True)
            yield self.finish(x), y.to(self.device, non_blocking=True)


def sample_positions(loader: DataLoader | FastEvalLoader) -> list[int]:
    """The indices (in its split) of the samples an eval loader yields, in order."""
    if isinstance(loader, FastEvalLoader):
        return loader.indices.tolist()
    return list(loader.sampler)  # type: ignore[arg-type]


def limited(count: int, limit: Any, key: str) -> int:
    """How many of ``count`` steps (or batches) a ``trainer.limit_*`` setting keeps: all
    (null), at most a count (an integer >= 1), or a fraction of them (in (0, 1], at least 1)."""
    if limit is None:
        return count
    if isinstance(limit, bool) or not isinstance(limit, int | float):
        raise UserError(
            f"{key}={limit} is not valid: use null, a count >= 1 or a fraction in (0, 1]"
        )
    if isinstance(limit, int) and limit >= 1:
        return min(count, limit)
    if isinstance(limit, float) and 0 < limit <= 1:
        return min(count, max(1, math.ceil(limit * count)))
    raise UserError(f"{key}={limit} is not valid: use null, a count >= 1 or a fraction in (0, 1]")


class FirstBatches:
    """The first ``n`` batches of ``loader`` (trainer.limit_val_batches): every rank takes the
    same number of its own shard's batches, so the reduction stays one all-reduce."""

    def __init__(self, loader: Iterable, n: int) -> None:
        self.loader, self.n = loader, n

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator:
        return itertools.islice(iter(self.loader), self.n)
