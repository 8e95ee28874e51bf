"""Datasets by name (cfg.dataset.name): one registry of torchvision datasets, built once per node.

Missing or undownloadable data is the user's to fix, so it surfaces as a one-line UserError
naming the path and the setting to change, never as torchvision's traceback.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from omegaconf.errors import MissingMandatoryValue
from torch.utils.data import Dataset
from torchvision import datasets as tvd

from components.errors import UserError
from data.digits import Digits
from data.fast import InMemoryData, as_uint8_nchw
from data.seeding import EpochSeededDataset
from data.transforms import NORMALIZATION, Recipe, train_transform, val_transform

T = TypeVar("T")


@dataclass
class DataSplits:
    train: Dataset  # EpochSeededDataset: accepts ds[(epoch, index)] and ds[index]
    val: Dataset
    num_classes: int
    in_channels: int  # 1 for digits/mnist/fashion_mnist, 3 otherwise
    image_size: int  # side of the square tensors the model receives
    # Both splits as uint8 tensors for the fast path (data/fast.py); None where the set is not
    # held in memory (imagenet, imagefolder, fake).
    memory: InMemoryData | None = None


@dataclass(frozen=True)
class _Request:
    name: str
    root: str
    image_size: int
    train_tf: Callable
    val_tf: Callable
    cfg: Any


# (request, download) -> (train, val)
_Loader = Callable[[_Request, bool], tuple[Dataset, Dataset]]


@dataclass(frozen=True)
class _Spec:
    load: _Loader
    in_channels: int
    image_size: int | None  # None: cfg.image_size
    # "torchvision": fetched by torchvision when dataset.download=true; "none": nothing on disk,
    # the flag is ignored; "manual": files must be put in place, download=true is an error.
    fetch: str
    missing_fix: str = "set dataset.download=true or point dataset.root at a copy"
    # The loaded datasets hold all images as uint8 ``data`` and labels as ``targets``.
    in_memory: bool = False


def _train_test(cls: type) -> _Loader:
    def load(req: _Request, download: bool) -> tuple[Dataset, Dataset]:
        return (
            cls(req.root, train=True, transform=req.train_tf, download=download),
            cls(req.root, train=False, transform=req.val_tf, download=download),
        )

    return load


def _digits(req: _Request, download: bool) -> tuple[Dataset, Dataset]:
    fraction = float(req.cfg.val_fraction)
    # Both sides must hold at least one sample per class (stratified split of 1797 samples).
    if not 0.01 <= fraction <= 0.99:
        raise UserError(f"dataset.val_fraction={fraction} is out of range: use 0.01 to 0.99")
    return (
        Digits(req.root, train=True, transform=req.train_tf, val_fraction=fraction),
        Digits(req.root, train=False, transform=req.val_tf, val_fraction=fraction),
    )


def _imagenet(req: _Request, download: bool) -> tuple[Dataset, Dataset]:
    return (
        tvd.ImageNet(req.root, split="train", transform=req.train_tf),
        tvd.ImageNet(req.root, split="val", transform=req.val_tf),
    )


def _imagefolder(req: _Request, download: bool) -> tuple[Dataset, Dataset]:
    train = tvd.ImageFolder(os.path.join(req.root, "train"), transform=req.train_tf)
    val = tvd.ImageFolder(os.path.join(req.root, "val"), transform=req.val_tf)
    # Labels are class-folder indices: differing folder sets would silently mislabel val.
    if train.classes != val.classes:
        only_train = sorted(set(train.classes) - set(val.classes))
        only_val = sorted(set(val.classes) - set(train.classes))
        raise UserError(
            f"class folders of {req.root}/train and {req.root}/val differ (only in train: "
            f"{only_train[:5]}, only in val: {only_val[:5]}): give both the same class folders"
        )
    return train, val


def _fake(req: _Request, download: bool) -> tuple[Dataset, Dataset]:
    cfg, s = req.cfg, req.image_size
    size, num_classes = int(cfg.size), int(cfg.num_classes)
    if size < 1 or num_classes < 1:
        raise UserError(
            f"dataset.size={size} and dataset.num_classes={num_classes} must both be >= 1"
        )
    return (
        tvd.FakeData(size, (3, s, s), num_classes, transform=req.train_tf),
        # Offset past the train indices: FakeData seeds image i with i + random_offset.
        tvd.FakeData(
            max(size // 5, 1), (3, s, s), num_classes, transform=req.val_tf, random_offset=size
        ),
    )


_IMAGENET_FIX = (
    "put ILSVRC2012_devkit_t12.tar.gz and ILSVRC2012_img_train.tar/ILSVRC2012_img_val.tar "
    "(or the train/, val/ folders and meta.bin torchvision made from them) there"
)

DATASETS: dict[str, _Spec] = {
    "digits": _Spec(_digits, in_channels=1, image_size=8, fetch="none", in_memory=True),
    "mnist": _Spec(
        _train_test(tvd.MNIST), in_channels=1, image_size=28, fetch="torchvision", in_memory=True
    ),
    "fashion_mnist": _Spec(
        _train_test(tvd.FashionMNIST),
        in_channels=1,
        image_size=28,
        fetch="torchvision",
        in_memory=True,
    ),
    "cifar10": _Spec(
        _train_test(tvd.CIFAR10), in_channels=3, image_size=32, fetch="torchvision", in_memory=True
    ),
    "cifar100": _Spec(
        _train_test(tvd.CIFAR100), in_channels=3, image_size=32, fetch="torchvision", in_memory=True
    ),
    "imagenet": _Spec(
        _imagenet, in_channels=3, image_size=None, fetch="manual", missing_fix=_IMAGENET_FIX
    ),
    "imagefolder": _Spec(
        _imagefolder,
        in_channels=3,
        image_size=None,
        fetch="manual",
        missing_fix="point dataset.root at a folder holding train/<class>/* and val/<class>/*",
    ),
    "fake": _Spec(_fake, in_channels=3, image_size=None, fetch="none"),
}


def _one_line(error: BaseException, limit: int = 300) -> str:
    # torchvision's download errors span lines ("Error downloading X:\nTried <url>, got:\n...").
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _download_once_then_load(
    build_fn: Callable[[bool], T],
    *,
    download: bool,
    local_rank: int,
    barrier: Callable[[], None],
) -> T:
    """``build_fn(download)`` with downloads done once per node.

    With ``download``, local rank 0 builds with download=True while the node's other ranks wait
    in ``barrier()``; then they build with download=False from the files rank 0 left. Rank 0
    keeps what it built (same files, no second load). Every rank calls ``barrier()`` exactly
    once when ``download`` (cfg.download is the same everywhere); none when not.
    """
    if not download:
        return build_fn(False)
    result: T | None = None
    error: Exception | None = None
    if local_rank == 0:
        try:
            result = build_fn(True)
        except Exception as e:  # raised after the barrier, so the other ranks are not left hanging
            error = e
    barrier()
    if error is not None:
        raise error
    return result if local_rank == 0 else build_fn(False)  # type: ignore[return-value]


def _load(spec: _Spec, req: _Request, download: bool) -> tuple[Dataset, Dataset]:
    try:
        return spec.load(req, download)
    except UserError:
        raise
    # What torchvision raises for absent, partial or corrupt files (and failed downloads).
    except (RuntimeError, OSError) as e:
        if download:
            raise UserError(
                f"downloading dataset {req.name!r} into {req.root} failed ({_one_line(e)}): "
                "check network access, or put the files there and set dataset.download=false"
            ) from e
        raise UserError(
            f"dataset {req.name!r} not found or incomplete under {req.root} "
            f"(dataset.download=false): {spec.missing_fix}"
        ) from e


def build_datasets(
    cfg: Any,
    *,
    local_rank: int = 0,
    barrier: Callable[[], None] = lambda: None,
    seed: int = 0,
    augment: Recipe | None = None,
) -> DataSplits:
    """The train/val datasets named by ``cfg`` (the ``dataset`` config group).

    Train items are augmented deterministically from (seed, epoch, index); see
    EpochSeededDataset. Pass the node-local rank and a barrier over all ranks (e.g.
    ``torch.distributed.barrier``) so a download happens once per node.
    """
    name = str(cfg.name)
    spec = DATASETS.get(name)
    if spec is None:
        raise UserError(f"unknown dataset.name={name!r}: use one of {', '.join(DATASETS)}")
    try:
        root = os.path.abspath(os.path.expanduser(str(cfg.root)))
    except MissingMandatoryValue:
        raise UserError(f"dataset {name!r} needs a path: set dataset.root=/path/to/data") from None
    download = bool(cfg.download)
    if download and spec.fetch == "manual":
        raise UserError(
            f"dataset {name!r} cannot be downloaded and must be placed manually under {root}: "
            "set dataset.download=false"
        )
    download = download and spec.fetch == "torchvision"

    image_size = spec.image_size or int(cfg.image_size)
    if image_size < 1:
        raise UserError(f"dataset.image_size={image_size} must be >= 1")
    req = _Request(
        name=name,
        root=root,
        image_size=image_size,
        train_tf=train_transform(name, image_size, augment),
        val_tf=val_transform(name, image_size),
        cfg=cfg,
    )
    train, val = _download_once_then_load(
        lambda dl: _load(spec, req, dl), download=download, local_rank=local_rank, barrier=barrier
    )
    num_classes = int(cfg.num_classes) if name == "fake" else len(train.classes)  # type: ignore[attr-defined]
    memory = None
    if spec.in_memory:
        memory = _in_memory(name, train, val, image_size, augment or Recipe(), seed)
    return DataSplits(
        train=EpochSeededDataset(train, seed),
        val=val,
        num_classes=num_classes,
        in_channels=spec.in_channels,
        image_size=image_size,
        memory=memory,
    )


def _in_memory(
    name: str, train: Any, val: Any, image_size: int, augment: Recipe, seed: int
) -> InMemoryData:
    """Views of the datasets' own uint8 ``data`` and labels (nothing copied)."""
    mean, std = NORMALIZATION[name]
    return InMemoryData(
        name=name,
        train_images=as_uint8_nchw(train.data),
        train_labels=torch.as_tensor(train.targets, dtype=torch.int64),
        val_images=as_uint8_nchw(val.data),
        val_labels=torch.as_tensor(val.targets, dtype=torch.int64),
        image_size=image_size,
        mean=mean,
        std=std,
        augment=augment.fast(image_size),
        seed=seed,
        unsupported=augment.describe(),
    )
