"""Datasets by `_target_`: any function that returns a DataSource is a dataset.

A dataset config (conf/dataset/<choice>.yaml) is instantiated like a model: `_target_` names a
function and the node's other keys are its arguments, except the loader's own keys
(`num_workers`, `fast`). The function returns a DataSource: its train, val and test splits as
plain datasets of ``(image, label)``, their shape and class count, and the transforms to apply.
build_datasets calls it (on local rank 0 first when `download` is true: downloads happen once
per node) and returns DataSplits, what the loaders take: transforms applied, train items seeded
per (seed, epoch, index), and, for sets held in memory, uint8 tensors for the fast path.

Splits: train / val / test, fixed for a dataset whatever the run's seed, rank or world size.
Where a dataset has no validation set of its own, its target carves one from the training data
with carve_val (a fixed seed, stratified by class where the labels are known); an official test
set stays held out as test. Only evaluation touches test.

The shipped datasets are targets in data/catalog.py; a new one is one function and one YAML.
"""

from __future__ import annotations

import inspect
import logging
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch
from ddp_launcher import UserError, describe, instantiate, one_line
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue
from torch.utils.data import Dataset, Subset

from data.fast import InMemoryData, as_uint8_nchw
from data.seeding import EpochSeededDataset
from data.transforms import Recipe, is_random

T = TypeVar("T")
log = logging.getLogger(__name__)

SPLITS = ("train", "val", "test")
# Keys of a dataset config that the loaders read; every other key goes to the target.
LOADER_KEYS = ("num_workers", "fast")
# Carved splits never depend on the run's seed, so val/test numbers stay comparable across runs.
SPLIT_SEED = 0


@dataclass(frozen=True)
class FastPath:
    """The in-memory fast path (data/fast.py) for a source whose splits hold their images as
    uint8 ``data`` ([N, H, W] or [N, H, W, C]) and labels as ``targets`` (torchvision's MNIST
    and CIFAR classes do; Subsets of them too): normalisation and train augmentation, applied
    to whole batches on the device."""

    mean: tuple[float, ...]
    std: tuple[float, ...]
    # The recipe the target's train_transform applies (conf/augment/): the fast path applies
    # what of it has a batched tensor version, and says when that is not all of it.
    recipe: Recipe = field(default_factory=Recipe)


@dataclass
class DataSource:
    """What a dataset target returns. Items are ``(image, label)``; the transforms turn an
    image into the model's float tensor (None: the items already are tensors)."""

    train: Dataset
    val: Dataset  # carve_val(train, fraction) where the dataset has no validation set
    test: Dataset | None  # the held-out set; None where the dataset has none
    num_classes: int
    in_channels: int
    image_size: int  # side of the square tensors the model receives
    train_transform: Callable | None = None  # may be random (seeded per sample)
    eval_transform: Callable | None = None  # deterministic: val, test, evaluation of train
    classes: Sequence[str] | None = None  # class names, by label (default "0", "1", ...)
    fast: FastPath | None = None


@dataclass
class DataSplits:
    """The run's datasets, built by build_datasets."""

    train: Dataset  # EpochSeededDataset: accepts ds[(epoch, index)] and ds[index]
    val: Dataset
    num_classes: int
    in_channels: int  # 1 for digits/mnist/fashion_mnist, 3 otherwise
    image_size: int  # side of the square tensors the model receives
    # The splits as uint8 tensors for the fast path (data/fast.py); None where the set is not
    # held in memory (imagenet, imagefolder, fake).
    memory: InMemoryData | None = None
    test: Dataset | None = None
    classes: list[str] = field(default_factory=list)
    train_eval: Dataset | None = None  # the train split with the eval transform
    eval_transform: Callable | None = None

    def eval_set(self, split: str) -> Dataset:
        """The split ``train``, ``val`` or ``test`` as evaluation sees it (no augmentation)."""
        sets = {"train": self.train_eval, "val": self.val, "test": self.test}
        if sets.get(split) is None:
            have = ", ".join(name for name, found in sets.items() if found is not None)
            raise UserError(
                f"this dataset has no {split!r} split: use split= one of {have} "
                "or a folder of images"
            )
        return sets[split]


# --- splits of a dataset --------------------------------------------------------------------


def unwrap(dataset: Dataset) -> tuple[Dataset, np.ndarray | None]:
    """The dataset under any Subsets, and which of its samples ``dataset`` holds (None: all)."""
    indices = None
    while isinstance(dataset, Subset):
        outer = np.asarray(dataset.indices, dtype=np.int64)
        indices = outer if indices is None else outer[indices]
        dataset = dataset.dataset
    return dataset, indices


def labels_of(dataset: Dataset) -> np.ndarray | None:
    """The labels of every sample, read without loading images: the ``targets`` of the dataset
    under any Subsets (torchvision's sets have them); None where there are none."""
    base, indices = unwrap(dataset)
    targets = getattr(base, "targets", None)
    if targets is None:
        return None
    labels = np.asarray(targets, dtype=np.int64)
    return labels if indices is None else labels[indices]


def stratified_holdout(
    labels: np.ndarray | None, n: int, size: int, seed: int = SPLIT_SEED
) -> tuple[np.ndarray, np.ndarray]:
    """(kept, held out) positions of ``n`` samples, ``size`` held out, both sorted: a fixed
    shuffle (``seed``), stratified by ``labels`` where given and every class can give one.

    The positions scikit-learn's ``train_test_split(np.arange(n), test_size=size,
    stratify=..., random_state=seed)`` gives (its ShuffleSplit / StratifiedShuffleSplit draws,
    restated in numpy; tests/test_data.py checks them against scikit-learn): importing
    scikit-learn took 1-2 s of every run's startup."""
    rng = np.random.RandomState(seed)  # sklearn's check_random_state(seed)
    if labels is not None:
        classes, inverse, counts = np.unique(labels, return_inverse=True, return_counts=True)
        if counts.min() >= 2 and len(classes) <= size <= n - len(classes):
            kept, held = _stratified_split(inverse, counts, n - size, size, rng)
            return np.sort(kept), np.sort(held)
        # too few of a class to stratify: a plain fixed shuffle
    permutation = rng.permutation(n)
    return np.sort(permutation[size:]), np.sort(permutation[:size])


def _stratified_split(
    inverse: np.ndarray, counts: np.ndarray, n_train: int, n_test: int, rng: np.random.RandomState
) -> tuple[np.ndarray, np.ndarray]:
    """StratifiedShuffleSplit's first split (scikit-learn 1.x, model_selection/_split.py)."""
    by_class = np.split(np.argsort(inverse, kind="stable"), np.cumsum(counts)[:-1])
    train_counts = _approximate_mode(counts, n_train, rng)
    test_counts = _approximate_mode(counts - train_counts, n_test, rng)
    train: list[int] = []
    test: list[int] = []
    for members, n_i, t_i in zip(by_class, train_counts, test_counts, strict=True):
        shuffled = members.take(rng.permutation(len(members)), mode="clip")
        train.extend(shuffled[:n_i])
        test.extend(shuffled[n_i : n_i + t_i])
    return rng.permutation(train), rng.permutation(test)


def _approximate_mode(counts: np.ndarray, n_draws: int, rng: np.random.RandomState) -> np.ndarray:
    """scikit-learn's utils.extmath._approximate_mode: samples per class of ``n_draws``, the
    floor of each class's share plus one for the largest remainders (ties broken by ``rng``)."""
    continuous = counts / counts.sum() * n_draws
    floored = np.floor(continuous)
    need_to_add = int(n_draws - floored.sum())
    if need_to_add > 0:
        remainder = continuous - floored
        for value in np.sort(np.unique(remainder))[::-1]:
            (candidates,) = np.where(remainder == value)
            add_now = min(len(candidates), need_to_add)
            floored[rng.choice(candidates, size=add_now, replace=False)] += 1
            need_to_add -= add_now
            if need_to_add == 0:
                break
    return floored.astype(int)


def holdout_size(fraction: float, n: int, key: str) -> int:
    """``ceil(fraction * n)`` samples, checked: both sides keep at least one sample."""
    fraction = float(fraction)
    size = int(np.ceil(fraction * n))
    if not 0.0 < fraction < 1.0 or not 1 <= size <= n - 1:
        raise UserError(
            f"{key}={fraction} is out of range: use a fraction between 0.01 and "
            f"0.99 that leaves samples on both sides ({n} samples)"
        )
    return size


def carve_val(
    train: Dataset, fraction: float, *, key: str = "dataset.val_fraction"
) -> tuple[Subset, Subset]:
    """(train, val): ``fraction`` of ``train`` held out as val, the same samples in every run,
    rank and world size (a fixed seed), stratified by class where the labels are known."""
    n = len(train)  # type: ignore[arg-type]
    kept, held = stratified_holdout(labels_of(train), n, holdout_size(fraction, n, key))
    return Subset(train, kept.tolist()), Subset(train, held.tolist())


class UnreadableImage(UserError):
    """An image file that does not decode. A DataLoader worker's exception reaches the training
    process as type(e)(a text holding the worker's traceback): this keeps the message alone."""

    def __init__(self, message: str) -> None:
        if message.startswith(f"Caught {type(self).__name__} "):
            message = one_line(message.strip().splitlines()[-1].partition(": ")[2]) or message
        super().__init__(message)


def readable_file(path: str) -> bool:
    """Whether the image file at ``path`` decodes (data.decode's decoder, as the loader's)."""
    from data.decode import decode, read_bytes

    try:
        decode(read_bytes(path))
    except Exception:
        return False
    return True


class SplitView(Dataset):
    """One split with its transform applied: ``(transform(image), label)``.

    torch has no transform-applying dataset wrapper, and a split carved from a training set
    needs its own transform (val and test: the deterministic one)."""

    def __init__(self, dataset: Dataset, transform: Callable | None) -> None:
        self.dataset = dataset
        self.transform = transform

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        try:  # a file-based set reads the file here, and decodes it in the transform
            image, label = self.dataset[index]
            if self.transform is None:
                return image, label
            if getattr(self.transform, "takes_index", False):  # (data.decode.PlanGeometry)
                return self.transform(image, index), label
            return self.transform(image), label
        except Exception as e:
            path = self.sample_file(index)
            if path is None or readable_file(path):  # not the file's fault
                raise
            reason = re.sub(r" ?<_io\.BytesIO object at \w+>|\w+, /\S+:\d+, ", "", describe(e))
            if os.path.getsize(path) == 0:
                reason = "an empty file"
            raise UnreadableImage(
                f"image {path} cannot be read ({reason}): remove or replace it, or set "
                "dataset.skip_unreadable=true to leave out unreadable images"
            ) from None

    def sample_file(self, index: int) -> str | None:
        """The file of sample ``index`` where samples are files (ImageFolder), else None."""
        base, indices = unwrap(self.dataset)
        samples = getattr(base, "samples", None)
        if samples is None:
            return None
        return str(samples[index if indices is None else int(indices[index])][0])

    @property
    def targets(self) -> np.ndarray | None:
        return labels_of(self.dataset)

    def sample_ids(self) -> list[int | str]:
        """What identifies each sample across runs: its file where it is one (ImageFolder,
        ImageNet), else its index in the dataset it was carved from (e.g. MNIST's training set)."""
        base, indices = unwrap(self.dataset)
        positions = range(len(self)) if indices is None else indices.tolist()
        samples = getattr(base, "samples", None)
        if samples is not None:
            return [str(samples[i][0]) for i in positions]
        return list(positions)

    def __repr__(self) -> str:
        return f"SplitView({self.dataset!r}, transform={self.transform!r})"


# --- calling a target -----------------------------------------------------------------------


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


def target_arguments(cfg: Any) -> dict[str, Any]:
    """The dataset config as the target's call: `_target_` and every key but the loader's."""
    node = cfg if isinstance(cfg, DictConfig) else OmegaConf.create(dict(cfg))
    try:
        args = OmegaConf.to_container(node, resolve=True, throw_on_missing=True)
    except MissingMandatoryValue as e:
        key = str(getattr(e, "key", None) or "root")
        name = str(node.get("_target_", "?")).rsplit(".", 1)[-1]
        fix = "point dataset.root at its folder" if key == "root" else f"set dataset.{key}=<value>"
        raise UserError(f"dataset {name} needs dataset.{key}: {fix}") from None
    if not args.get("_target_"):
        raise UserError(
            "the dataset config has no _target_: set dataset._target_ to a function "
            "that returns a data.DataSource (see conf/dataset/*.yaml)"
        )
    return {k: v for k, v in args.items() if k not in LOADER_KEYS}


def _takes_augment(target: str) -> bool:
    """Whether the dataset target has an ``augment`` argument (it then gets the run's recipe)."""
    from hydra.utils import get_method

    try:
        return "augment" in inspect.signature(get_method(target)).parameters
    except Exception:  # noqa: BLE001 - not importable: call_target reports it
        return False


def call_target(args: dict[str, Any], **objects: Any) -> DataSource:
    """The target called with the config's arguments and ``objects`` (e.g. the augmentation
    recipe), which are passed as they are: Hydra would turn a dataclass into a config."""
    target = args["_target_"]
    try:
        source = instantiate({**args, "_partial_": True})(**objects)
    except Exception as e:
        if "Error locating target" in str(e):
            fix = "name a function as <module>.<function>"
            if target.startswith("examples.shapes."):  # the example before it moved to data/
                fix = f"it moved: add dataset._target_=data.example.{target[9:]}"
            raise UserError(
                f"dataset._target_={target} cannot be imported ({one_line(e)[:120]}): {fix}"
            ) from None
        raise
    if not isinstance(source, DataSource):
        raise UserError(
            f"dataset._target_={target} returned {type(source).__name__}, not a "
            "data.DataSource: return DataSource(train=..., val=..., test=..., ...)"
        )
    return source


def build_datasets(
    cfg: Any,
    *,
    local_rank: int = 0,
    barrier: Callable[[], None] = lambda: None,
    seed: int = 0,
    augment: Recipe | None = None,
) -> DataSplits:
    """The splits of the dataset that ``cfg`` (the ``dataset`` config node) names.

    Train items are augmented deterministically from (seed, epoch, index); see
    EpochSeededDataset. ``augment`` is the run's train augmentation (conf/augment/, built by
    data.transforms.build_recipe): a target with an ``augment`` argument receives it. Pass the
    node-local rank and a barrier over all ranks (e.g. ``torch.distributed.barrier``) so a
    download happens once per node.
    """
    args = target_arguments(cfg)
    download = bool(args.get("download", False))
    objects = {"augment": augment or Recipe()} if _takes_augment(args["_target_"]) else {}

    def build(dl: bool) -> DataSource:
        return call_target({**args, "download": dl} if "download" in args else args, **objects)

    source = _download_once_then_load(
        build, download=download, local_rank=local_rank, barrier=barrier
    )
    names = [str(c) for c in (source.classes or range(source.num_classes))]
    evaluated = {
        split: SplitView(getattr(source, split), source.eval_transform)
        for split in SPLITS
        if getattr(source, split) is not None
    }
    return DataSplits(
        train=EpochSeededDataset(
            SplitView(source.train, source.train_transform),
            seed,
            random=is_random(source.train_transform),
        ),
        val=evaluated["val"],
        num_classes=int(source.num_classes),
        in_channels=int(source.in_channels),
        image_size=int(source.image_size),
        memory=_in_memory(source, seed) if source.fast is not None else None,
        test=evaluated.get("test"),
        classes=names,
        train_eval=evaluated["train"],
        eval_transform=source.eval_transform,
    )


def _tensors(dataset: Dataset) -> tuple[torch.Tensor, torch.Tensor]:
    """A split's uint8 images [N, C, H, W] and int64 labels: views of the dataset's own
    ``data`` and ``targets``, gathered where the split is a Subset of them."""
    base, indices = unwrap(dataset)
    images = as_uint8_nchw(base.data)  # type: ignore[attr-defined]
    labels = torch.as_tensor(np.asarray(base.targets), dtype=torch.int64)  # type: ignore[attr-defined]
    if indices is not None:
        index = torch.from_numpy(indices)
        images, labels = images[index], labels[index]
    return images, labels


def _in_memory(source: DataSource, seed: int) -> InMemoryData:
    fast = source.fast
    assert fast is not None
    (train_x, train_y), (val_x, val_y) = _tensors(source.train), _tensors(source.val)
    test_x, test_y = _tensors(source.test) if source.test is not None else (None, None)
    return InMemoryData(
        train_images=train_x,
        train_labels=train_y,
        val_images=val_x,
        val_labels=val_y,
        image_size=int(source.image_size),
        mean=tuple(fast.mean),
        std=tuple(fast.std),
        augment=fast.recipe.fast(int(source.image_size)),
        unsupported=fast.recipe.describe(),
        seed=seed,
        test_images=test_x,
        test_labels=test_y,
    )
