"""The shipped datasets, each a dataset target (conf/dataset/<name>.yaml names it).

Every function returns a DataSource: train / val / test. Sets with an official test set keep it
as test and carve val from their training data (carve_val); digits, which has no official split,
is partitioned three ways; fake generates all three. Missing or undownloadable data is the
user's to fix, so it surfaces as a one-line UserError naming the path and the setting to
change, never as torchvision's traceback.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from ddp_launcher import UserError
from torch.utils.data import Subset
from torchvision import datasets as tvd
from torchvision.transforms import v2
from torchvision.transforms.functional import to_pil_image

from data.datasets import DataSource, FastPath, carve_val, holdout_size, stratified_holdout
from data.decode import DecodeImage, read_bytes
from data.digits import Digits
from data.image_tree import looks_readable, walk_once
from data.transforms import NORMALIZATION, Recipe, train_transform, val_transform

log = logging.getLogger(__name__)

DOWNLOAD_FIX = "set dataset.download=true or point dataset.root at a copy"
IMAGENET_FIX = (
    "put ILSVRC2012_devkit_t12.tar.gz and ILSVRC2012_img_train.tar/ILSVRC2012_img_val.tar "
    "(or the train/, val/ folders and meta.bin torchvision made from them) there"
)
FOLDER_FIX = "point dataset.root at a folder holding train/<class>/* (and optional val/, test/)"


def _one_line(error: BaseException, limit: int = 300) -> str:
    # torchvision's download errors span lines ("Error downloading X:\nTried <url>, got:\n...").
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


@contextmanager
def reading(name: str, root: str, download: bool, fix: str = DOWNLOAD_FIX) -> Iterator[None]:
    """What torchvision raises for absent, partial or corrupt files (and failed downloads), as
    a one-line UserError naming ``root`` and ``fix``."""
    path = Path(root)
    if (path.exists() and not path.is_dir()) or (path.is_symlink() and not path.exists()):
        # (a file's "not found", whose fix was dataset.download=true, which cannot download
        # into a file, and failed naming the network)
        what = "a file" if path.exists() else "a link that leads nowhere (dangling, or a loop)"
        raise UserError(
            f"dataset.root={root} is {what}, not a folder: point dataset.root at the folder "
            "that holds the dataset's files (or, with dataset.download=true, will hold them)"
        )
    try:
        yield
    except UserError:
        raise
    except (RuntimeError, OSError) as e:
        if download:
            raise UserError(
                f"downloading dataset {name!r} into {root} failed ({_one_line(e)}): "
                "check network access, or put the files there and set dataset.download=false"
            ) from e
        raise UserError(
            f"dataset {name!r} not found or incomplete under {root} (dataset.download=false): {fix}"
        ) from e


def _root(root: str) -> str:
    return os.path.abspath(os.path.expanduser(str(root)))


def _manual(name: str, root: str, download: bool) -> None:
    if download:
        raise UserError(
            f"dataset {name!r} cannot be downloaded and must be placed manually under {root}: "
            "set dataset.download=false"
        )


def _check_size(image_size: int) -> int:
    if int(image_size) < 1:
        raise UserError(f"dataset.image_size={image_size} must be >= 1")
    return int(image_size)


def _transforms(name: str, image_size: int, augment: Recipe | None) -> dict:
    return {
        "train_transform": train_transform(name, image_size, augment),
        "eval_transform": val_transform(name, image_size),
    }


def _file_transforms(name: str, image_size: int, augment: Recipe | None) -> dict:
    """The file-based sets' transforms: decode the file's bytes (data/decode.py), then the
    recipe on the uint8 tensor."""
    return {
        key: v2.Compose([DecodeImage(), *pipeline.transforms])
        for key, pipeline in _transforms(name, image_size, augment).items()
    }


def _in_memory(name: str, augment: Recipe | None) -> FastPath:
    mean, std = NORMALIZATION[name]
    return FastPath(mean, std, augment or Recipe())


# --- fixed-size sets held in memory ---------------------------------------------------------


def _train_test_set(name: str, cls: type, in_channels: int, image_size: int) -> Callable:
    """A target for a torchvision class with train=True/False files: val carved from train."""

    def load(
        root: str, download: bool = False, augment: Recipe | None = None, val_fraction: float = 0.1
    ) -> DataSource:
        root = _root(root)
        with reading(name, root, download):
            train = cls(root, train=True, download=download)
            test = cls(root, train=False, download=download)
        classes = list(train.classes)  # CIFAR reads them from its files
        train, val = carve_val(train, val_fraction)
        return DataSource(
            train,
            val,
            test,
            num_classes=len(classes),
            in_channels=in_channels,
            image_size=image_size,
            classes=classes,
            fast=_in_memory(name, augment),
            **_transforms(name, image_size, augment),
        )

    load.__name__ = load.__qualname__ = name
    load.__doc__ = f"torchvision's {cls.__name__}: val carved from its training set, test its own."
    return load


mnist = _train_test_set("mnist", tvd.MNIST, in_channels=1, image_size=28)
fashion_mnist = _train_test_set("fashion_mnist", tvd.FashionMNIST, in_channels=1, image_size=28)
cifar10 = _train_test_set("cifar10", tvd.CIFAR10, in_channels=3, image_size=32)
cifar100 = _train_test_set("cifar100", tvd.CIFAR100, in_channels=3, image_size=32)


def digits(
    val_fraction: float = 0.1, test_fraction: float = 0.1, augment: Recipe | None = None
) -> DataSource:
    """scikit-learn's 1797 8x8 scans, partitioned by class into test (``test_fraction`` of all
    scans), val (``val_fraction`` of all) and train (the rest), the same in every run."""
    scans = Digits()
    n, labels = len(scans), scans.targets.numpy()
    n_test = holdout_size(test_fraction, n, "dataset.test_fraction")
    n_val = holdout_size(val_fraction, n, "dataset.val_fraction")
    if float(val_fraction) + float(test_fraction) > 0.9:  # train keeps >= ~18 scans per class
        raise UserError(
            f"dataset.val_fraction={val_fraction} + dataset.test_fraction="
            f"{test_fraction} leave too few training scans: keep their sum <= 0.9"
        )
    rest, test = stratified_holdout(labels, n, n_test)
    kept, val = stratified_holdout(labels[rest], len(rest), n_val)
    train, val = rest[kept], rest[val]
    subset = lambda idx: Subset(scans, idx.tolist())  # noqa: E731 - three of the same
    return DataSource(
        subset(train),
        subset(val),
        subset(test),
        num_classes=10,
        in_channels=1,
        image_size=8,
        classes=Digits.classes,
        fast=_in_memory("digits", augment),
        **_transforms("digits", 8, augment),
    )


# --- sets read from image files -------------------------------------------------------------


def imagenet(
    root: str,
    download: bool = False,
    augment: Recipe | None = None,
    image_size: int = 224,
    val_fraction: float = 0.02,
    skip_unreadable: bool = False,
) -> DataSource:
    """torchvision's ImageNet layout under ``root``: val carved from the training set (by
    class), the official validation set held out as test. Never downloaded."""
    root, size = _root(root), _check_size(image_size)
    _manual("imagenet", root, download)
    with reading("imagenet", root, download, IMAGENET_FIX):
        train = tvd.ImageNet(root, split="train", loader=read_bytes)
        test = tvd.ImageNet(root, split="val", loader=read_bytes)
    if skip_unreadable:
        leave_out_unreadable(root, [train, test])
    train_part, val = carve_val(train, val_fraction)
    names = [c[0] if isinstance(c, tuple) else str(c) for c in train.classes]
    return DataSource(
        train_part,
        val,
        test,
        num_classes=len(names),
        in_channels=3,
        image_size=size,
        classes=names,
        **_file_transforms("imagenet", size, augment),
    )


def leave_out_unreadable(root: str, folders: list[tvd.DatasetFolder]) -> None:
    """dataset.skip_unreadable=true: drop the files that are empty, have no image header or
    end before their format's end marker (JPEG, PNG) from ``folders``, counted in one line.
    Every rank drops the same files, so their shards still agree; a file these checks pass
    that still does not decode stops the run naming it (data.datasets.SplitView)."""
    skipped, emptied = [], []
    for folder in folders:
        readable = [looks_readable(path) for path, _ in folder.samples]
        kept = [s for s, ok in zip(folder.samples, readable, strict=True) if ok]
        skipped += [s[0] for s, ok in zip(folder.samples, readable, strict=True) if not ok]
        folder.samples = folder.imgs = kept
        folder.targets = [label for _, label in kept]
        left = set(folder.targets)
        emptied += [
            os.path.relpath(os.path.join(folder.root, name), root)
            for name, label in folder.class_to_idx.items()
            if label not in left
        ]
    if emptied:  # (else carving val from what is left would blame dataset.val_fraction)
        raise UserError(
            f"class folder {', '.join(emptied[:5])}{', ...' if len(emptied) > 5 else ''} of "
            f"{root} holds no readable image (dataset.skip_unreadable=true left out "
            f"{len(skipped)} unreadable file(s)): put readable images there, or remove the folder"
        )
    if skipped:
        log.warning(
            "dataset.skip_unreadable=true: left out %d unreadable image(s) under %s (%s%s)",
            len(skipped),
            root,
            ", ".join(os.path.relpath(p, root) for p in skipped[:3]),
            ", ..." if len(skipped) > 3 else "",
        )


class FolderOnce(tvd.ImageFolder):
    """torchvision's ImageFolder (files read as bytes: data/decode.py), its samples found by
    walk_once: each file once however the tree links, and no link back into the dataset."""

    def __init__(self, root: str, split: str) -> None:
        splits = (os.path.join(root, s) for s in ("train", "val", "test"))
        self.guarded = [os.path.realpath(d) for d in splits if os.path.isdir(d)]
        super().__init__(os.path.join(root, split), loader=read_bytes)

    def make_dataset(  # type: ignore[override] - a method, to reach self.guarded
        self,
        directory: str,
        class_to_idx: dict[str, int],
        extensions: tuple[str, ...] | None = None,
        is_valid_file: Callable[[str], bool] | None = None,
        allow_empty: bool = False,
    ) -> list[tuple[str, int]]:
        """torchvision's make_dataset (its order, its error for a class without a file),
        over walk_once."""

        def valid(path: str) -> bool:
            if is_valid_file is not None:
                return is_valid_file(path)
            return tvd.folder.has_file_allowed_extension(path, extensions or ())

        samples = []
        for name in sorted(class_to_idx):
            class_dir = os.path.join(directory, name)
            if not os.path.isdir(class_dir):
                continue
            for folder, files in walk_once(class_dir, self.guarded):
                paths = (os.path.join(folder, f) for f in files)
                samples += [(path, class_to_idx[name]) for path in paths if valid(path)]
        labels = {label for _, label in samples}
        empty = sorted(name for name, label in class_to_idx.items() if label not in labels)
        if empty and not allow_empty:
            raise FileNotFoundError(f"Found no valid file for the classes {', '.join(empty)}.")
        return samples


def _image_folder(root: str, split: str) -> tvd.ImageFolder:
    """The ImageFolder of ``<root>/<split>`` (FolderOnce); a class folder without an image is
    named (torchvision's error names the class only, and `reading` would say "not found")."""
    try:
        return FolderOnce(root, split)
    except FileNotFoundError:
        split_dir = Path(root, split)
        empty = sorted(
            f"{split}/{folder.name}"
            for folder in (split_dir.iterdir() if split_dir.is_dir() else ())
            if folder.is_dir()
            and not any(
                tvd.folder.has_file_allowed_extension(f.name, tvd.folder.IMG_EXTENSIONS)
                for f in folder.rglob("*")
            )
        )
        if not empty:
            raise
        raise UserError(
            f"class folder {', '.join(empty[:5])} of {root} holds no image: put its images "
            "there, or remove the folder (a class needs images in train/ and in val/, test/ "
            "if present)"
        ) from None


def imagefolder(
    root: str,
    download: bool = False,
    augment: Recipe | None = None,
    image_size: int = 224,
    val_fraction: float = 0.1,
    skip_unreadable: bool = False,
) -> DataSource:
    """Any ``<root>/train/<class>/*`` tree; ``val/`` if present (else val carved from train,
    by class) and ``test/`` if present (else no test split), with the same class folders.
    ``skip_unreadable``: leave out files that are not images (leave_out_unreadable)."""
    root, size = _root(root), _check_size(image_size)
    _manual("imagefolder", root, download)
    with reading("imagefolder", root, download, FOLDER_FIX):
        train = _image_folder(root, "train")
        found = {
            split: _image_folder(root, split)
            for split in ("val", "test")
            if Path(root, split).is_dir()
        }
    if skip_unreadable:
        leave_out_unreadable(root, [train, *found.values()])
    for split, folder in found.items():
        # Labels are class-folder indices: differing folder sets would silently mislabel.
        if folder.classes != train.classes:
            only_train = sorted(set(train.classes) - set(folder.classes))
            only_other = sorted(set(folder.classes) - set(train.classes))
            raise UserError(
                f"class folders of {root}/train and {root}/{split} differ (only in train: "
                f"{only_train[:5]}, only in {split}: {only_other[:5]}): give both the same "
                "class folders"
            )
    train_part, val = (train, found["val"]) if "val" in found else carve_val(train, val_fraction)
    return DataSource(
        train_part,
        val,
        found.get("test"),
        num_classes=len(train.classes),
        in_channels=3,
        image_size=size,
        classes=train.classes,
        **_file_transforms("imagefolder", size, augment),
    )


class FakeImages(tvd.FakeData):
    """torchvision's FakeData, the very same images and labels, drawn from a generator of its
    own. FakeData reseeds torch's global RNG for each image with torch.manual_seed, which also
    queues a lazy seed for CUDA and formats the Python stack to do so: 0.5-1 ms per image,
    growing with the caller's stack depth (deeper in train.py than in a plain script), several
    times the cost of the image itself."""

    def __getitem__(self, index: int) -> tuple[Any, int]:
        if index >= len(self):
            raise IndexError(f"{self.__class__.__name__} index out of range")
        generator = torch.Generator().manual_seed(index + self.random_offset)
        image = torch.randn(*self.image_size, generator=generator)
        target = torch.randint(
            0, self.num_classes, size=(1,), dtype=torch.long, generator=generator
        )[0]
        image = to_pil_image(image)  # FakeData's ToPILImage(): the same 8-bit image
        if self.transform is not None:
            image = self.transform(image)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return image, int(target)


def fake(
    size: int = 1000, image_size: int = 32, num_classes: int = 10, augment: Recipe | None = None
) -> DataSource:
    """torchvision's FakeData: ``size`` random train images, ``size // 5`` each for val and
    test, all distinct (FakeData seeds image i with i + random_offset)."""
    side = _check_size(image_size)
    if int(size) < 1 or int(num_classes) < 2:  # (1 class: loss 0 and accuracy 1 from step 0)
        raise UserError(
            f"dataset.size={size} and dataset.num_classes={num_classes}: a size >= 1 and at "
            "least 2 classes, e.g. dataset.num_classes=10"
        )
    held = max(int(size) // 5, 1)

    def images(n: int, offset: int) -> tvd.FakeData:
        return FakeImages(n, (3, side, side), int(num_classes), random_offset=offset)

    return DataSource(
        images(size, 0),
        images(held, size),
        images(held, size + held),
        num_classes=int(num_classes),
        in_channels=3,
        image_size=side,
        **_transforms("fake", side, augment),
    )


__all__ = [
    "cifar10",
    "cifar100",
    "digits",
    "fake",
    "fashion_mnist",
    "imagefolder",
    "imagenet",
    "mnist",
]
