"""Datasets, samplers and loaders for DDP training.

build_datasets(cfg.dataset, ...) -> DataSplits, then build_loaders(splits, ...) -> Loaders.
"""

from data.datasets import DataSplits, build_datasets
from data.fast import FastTrainLoader, FastValLoader, InMemoryData
from data.loaders import Loaders, build_loaders
from data.samplers import ExactShardSampler, ResumableDistributedSampler
from data.seeding import EpochSeededDataset

__all__ = [
    "DataSplits",
    "EpochSeededDataset",
    "ExactShardSampler",
    "FastTrainLoader",
    "FastValLoader",
    "InMemoryData",
    "Loaders",
    "ResumableDistributedSampler",
    "build_datasets",
    "build_loaders",
]
