"""Datasets, samplers and loaders for DDP training.

build_datasets(cfg.dataset, ...) -> DataSplits, then build_loaders(splits, ...) -> Loaders.
A dataset is any function returning a DataSource, named by `_target_` (data/catalog.py holds
the shipped ones).
"""

from data.datasets import DataSource, DataSplits, FastPath, SplitView, build_datasets, carve_val
from data.fast import FastEvalLoader, FastTrainLoader, InMemoryData
from data.loaders import (
    FirstBatches,
    Loaders,
    build_loaders,
    eval_loader,
    limited,
    loader_options,
    sample_positions,
)
from data.samplers import ExactShardSampler, ResumableDistributedSampler
from data.seeding import EpochSeededDataset
from data.unlabeled import ImageFiles

__all__ = [
    "DataSource",
    "DataSplits",
    "EpochSeededDataset",
    "ExactShardSampler",
    "FirstBatches",
    "FastEvalLoader",
    "FastPath",
    "FastTrainLoader",
    "ImageFiles",
    "InMemoryData",
    "Loaders",
    "ResumableDistributedSampler",
    "SplitView",
    "build_datasets",
    "build_loaders",
    "carve_val",
    "eval_loader",
    "limited",
    "loader_options",
    "sample_positions",
]
