"""Normalisation constants and train/val transforms (torchvision.transforms.v2) per dataset."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torchvision.transforms import v2

_IMAGENET = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))

# (mean, std) per channel of the 0..1-scaled images.
NORMALIZATION: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    "digits": ((0.3053,), (0.3759,)),  # measured over all 1797 scans after 0..16 -> 0..255
    "mnist": ((0.1307,), (0.3081,)),
    "fashion_mnist": ((0.2860,), (0.3530,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
    "imagenet": _IMAGENET,
    "imagefolder": _IMAGENET,  # the customary default for natural photos
    "fake": ((0.5, 0.5, 0.5), (0.29, 0.29, 0.29)),  # measured on FakeData's PIL images
}

# Sets whose images are resized to cfg.image_size (the others keep their native size).
_RESIZED = ("imagenet", "imagefolder")


def _to_normalized_tensor(name: str) -> list[v2.Transform]:
    mean, std = NORMALIZATION[name]
    return [v2.ToImage(), v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean, std)]


def _resize_center_crop(image_size: int) -> list[v2.Transform]:
    # The usual 256/224 ratio: resize the short side, then crop the centre.
    return [v2.Resize(int(image_size * 256 / 224)), v2.CenterCrop(image_size)]


def val_transform(name: str, image_size: int) -> v2.Compose:
    """Deterministic: resize/crop where sizes vary, then tensor + normalise."""
    geometry = _resize_center_crop(image_size) if name in _RESIZED else []
    return v2.Compose(geometry + _to_normalized_tensor(name))


@dataclass(frozen=True)
class CropFlip:
    """Random crop of the image's own size from it zero-padded by ``padding`` on every side,
    then (if ``flip``) a horizontal flip with probability 1/2. ``padding=0, flip=False``: none.
    """

    padding: int = 0
    flip: bool = False


def crop_flip_recipe(name: str, image_size: int, augment: bool) -> CropFlip:
    """The train augmentation of the fixed-size sets (all but imagenet/imagefolder), shared by
    train_transform and the in-memory fast path (data/fast.py) so the two cannot drift apart."""
    if not augment:
        return CropFlip()
    if name in ("digits", "mnist", "fashion_mnist"):
        # Small shifts only: flipping changes a digit's meaning.
        return CropFlip(padding=max(image_size // 14, 1), flip=False)
    # cifar10, cifar100, fake: the standard CIFAR recipe (padding 4 at 32px)
    return CropFlip(padding=image_size // 8, flip=True)


def train_transform(name: str, image_size: int, augment: bool) -> v2.Compose:
    """The val pipeline when ``augment`` is false; otherwise random crops (and flips).

    All randomness comes from torch's global RNG, which EpochSeededDataset seeds per sample.
    """
    if not augment:
        return val_transform(name, image_size)
    if name in _RESIZED:
        geometry = [v2.RandomResizedCrop(image_size), v2.RandomHorizontalFlip()]
    else:
        recipe = crop_flip_recipe(name, image_size, augment)
        geometry = [v2.RandomCrop(image_size, padding=recipe.padding)]
        if recipe.flip:
            geometry.append(v2.RandomHorizontalFlip())
    return v2.Compose(geometry + _to_normalized_tensor(name))
