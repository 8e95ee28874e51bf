"""Datasets, samplers and loaders for DDP training.

build_datasets(cfg.dataset, ...) -> DataSplits, then build_loaders(splits, ...) -> Loaders.
A dataset is any function returning a DataSource, named by `_target_` (data/catalog.py holds
the shipped ones).

Importing this package imports nothing else: each name below loads its module when first used,
so that image_tree.py (torch-free) serves the gate's checks in the launching process too
(conf/checks.py), where no torch is imported.
"""

import importlib
from typing import Any

# public name -> the module that defines it
_WHERE = {
    "DataSource": "data.datasets",
    "DataSplits": "data.datasets",
    "FastPath": "data.datasets",
    "SplitView": "data.datasets",
    "build_datasets": "data.datasets",
    "carve_val": "data.datasets",
    "FastEvalLoader": "data.fast",
    "FastTrainLoader": "data.fast",
    "InMemoryData": "data.fast",
    "FirstBatches": "data.loaders",
    "Loaders": "data.loaders",
    "build_loaders": "data.loaders",
    "eval_loader": "data.loaders",
    "limited": "data.loaders",
    "loader_options": "data.loaders",
    "sample_positions": "data.loaders",
    "ExactShardSampler": "data.samplers",
    "ResumableDistributedSampler": "data.samplers",
    "EpochSeededDataset": "data.seeding",
    "ImageFiles": "data.unlabeled",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'data' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
