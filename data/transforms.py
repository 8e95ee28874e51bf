"""Normalisation constants, train augmentation recipes and train/val transforms
(torchvision.transforms.v2) per dataset.

A recipe (`Recipe`) is what `conf/augment/<choice>.yaml` instantiates: a crop (none, padded
random crop, random-resized crop), a horizontal flip, an optional policy (TrivialAugmentWide,
RandAugment, AutoAugment: any v2 transform), the user's own v2 transforms, and random erasing.
`train_transform` turns it into one v2 pipeline per dataset; `Recipe.fast` says whether the
in-memory fast path (data/fast.py) can do the same with batched tensor ops.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from ddp_launcher import UserError
from torchvision import transforms as v1
from torchvision.transforms import AutoAugmentPolicy, v2

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

CROPS = ("none", "pad", "resized")
# v2.RandomErasing's defaults (the fast path draws from the same ranges).
ERASE_SCALE, ERASE_RATIO = (0.02, 0.33), (0.3, 3.3)


@dataclass(frozen=True)
class FastAugment:
    """A recipe as the fast path's batched tensor ops: a random crop of the image's own size
    from it zero-padded by ``padding`` on every side, a horizontal flip with probability 1/2
    (if ``flip``), then, on the normalised tensor, random erasing with probability ``erasing``
    (v2.RandomErasing's area and aspect ranges, value 0). All zero/False: no augmentation."""

    padding: int = 0
    flip: bool = False
    erasing: float = 0.0

    @property
    def random(self) -> bool:
        return self.padding > 0 or self.flip or self.erasing > 0


@dataclass(frozen=True)
class Recipe:
    """A train augmentation recipe (conf/augment/*.yaml; schema conf.schema.AugmentConfig).

    Order: crop -> flip -> policy -> transforms (on the uint8/PIL image) -> to float and
    normalise -> random erasing. ``crop``: ``none`` (the val geometry), ``pad`` (the val
    geometry, then a random crop from the image zero-padded by ``padding`` pixels; None: an
    eighth of the side, at least 1), ``resized`` (v2.RandomResizedCrop with ``scale`` and
    ``ratio``, replacing the val geometry)."""

    crop: str = "none"
    padding: int | None = None
    scale: Sequence[float] = (0.08, 1.0)
    ratio: Sequence[float] = (3 / 4, 4 / 3)
    flip: bool = False
    policy: Any = None  # a v2 transform (instantiated), e.g. v2.TrivialAugmentWide()
    transforms: Sequence[Any] = field(default_factory=tuple)  # more v2 transforms
    random_erasing: float = 0.0  # probability of v2.RandomErasing

    def __post_init__(self) -> None:
        if self.crop not in CROPS:
            raise UserError(f"augment.crop={self.crop} is not valid: use none, pad or resized")
        if self.padding is not None and self.padding < 0:
            raise UserError(f"augment.padding={self.padding} must be >= 0 (or null)")
        if not 0.0 <= self.random_erasing <= 1.0:
            raise UserError(f"augment.random_erasing={self.random_erasing} must be in [0, 1]")
        for key, pair in (("scale", self.scale), ("ratio", self.ratio)):
            if len(pair) != 2 or not 0 < pair[0] <= pair[1]:
                raise UserError(f"augment.{key}={list(pair)} must be [low, high], 0 < low <= high")
        for t in (self.policy, *self.transforms):
            if t is not None and not callable(t):
                raise UserError(
                    f"augment: {t!r} is not a transform: give each entry a _target_ "
                    "(e.g. torchvision.transforms.v2.RandomRotation)"
                )

    def padding_for(self, image_size: int) -> int:
        return max(image_size // 8, 1) if self.padding is None else int(self.padding)

    def fast(self, image_size: int) -> FastAugment | None:
        """The same recipe as the fast path's batched ops, or None where it has none (a
        random-resized crop, a policy or other transforms)."""
        if self.crop == "resized" or self.policy is not None or self.transforms:
            return None
        padding = self.padding_for(image_size) if self.crop == "pad" else 0
        return FastAugment(padding, self.flip, self.random_erasing)

    def describe(self) -> str:
        """The parts the fast path lacks, for its log line."""
        parts = ["a random-resized crop"] if self.crop == "resized" else []
        parts += [type(t).__name__ for t in (self.policy, *self.transforms) if t is not None]
        return ", ".join(parts)


def auto_augment(policy: str = "imagenet", **kwargs: Any) -> v2.AutoAugment:
    """v2.AutoAugment by policy name (imagenet, cifar10 or svhn): YAML cannot name an enum."""
    names = [p.value for p in AutoAugmentPolicy]
    if policy not in names:
        raise UserError(f"augment.policy.policy={policy} is not valid: use one of {names}")
    return v2.AutoAugment(AutoAugmentPolicy(policy), **kwargs)


def build_recipe(augment_cfg: Any) -> Recipe:
    """Instantiate the `augment` config (None or missing: no augmentation); an argument a
    transform rejects becomes a one-line error naming the key."""
    from ddp_launcher import instantiate, one_line
    from hydra.errors import InstantiationException

    if augment_cfg is None:
        return Recipe()
    try:
        return instantiate(augment_cfg)  # (a transform's UserError comes back as itself)
    except UserError:
        raise
    except Exception as e:  # Hydra 1.3 wraps a transform's error, 1.4 raises it as it is
        cause = (e.__cause__ if isinstance(e, InstantiationException) else None) or e
        raise UserError(f"augment: {one_line(cause)}: fix augment.*") from None


def _to_normalized_tensor(name: str) -> list[v2.Transform]:
    mean, std = NORMALIZATION[name]
    return [v2.ToImage(), v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean, std)]


def _resize_center_crop(image_size: int) -> list[v2.Transform]:
    # The usual 256/224 ratio: resize the short side, then crop the centre.
    return [v2.Resize(int(image_size * 256 / 224)), v2.CenterCrop(image_size)]


def _val_geometry(name: str, image_size: int) -> list[v2.Transform]:
    return _resize_center_crop(image_size) if name in _RESIZED else []


def val_transform(name: str, image_size: int) -> v2.Compose:
    """Deterministic: resize/crop where sizes vary, then tensor + normalise."""
    return v2.Compose(_val_geometry(name, image_size) + _to_normalized_tensor(name))


def train_transform(name: str, image_size: int, recipe: Recipe | None = None) -> v2.Compose:
    """The recipe as one v2 pipeline; without a recipe (or `augment=none`), the val pipeline.

    All randomness comes from torch's global RNG, which EpochSeededDataset seeds per sample.
    """
    recipe = recipe or Recipe()
    if recipe.crop == "resized":
        ops = [
            v2.RandomResizedCrop(image_size, scale=tuple(recipe.scale), ratio=tuple(recipe.ratio))
        ]
    else:
        ops = _val_geometry(name, image_size)
        if recipe.crop == "pad":
            ops.append(v2.RandomCrop(image_size, padding=recipe.padding_for(image_size)))
    if recipe.flip:
        ops.append(v2.RandomHorizontalFlip())
    ops += [t for t in (recipe.policy, *recipe.transforms) if t is not None]
    ops += _to_normalized_tensor(name)
    if recipe.random_erasing > 0:
        ops.append(v2.RandomErasing(recipe.random_erasing, scale=ERASE_SCALE, ratio=ERASE_RATIO))
    return v2.Compose(ops)


# --- stages: per sample, then per batch ---------------------------------------------------

# Transforms that draw no random number (v2 and v1). Anything else counts as random.
_DETERMINISTIC: tuple[type, ...] = (
    v2.ToImage,
    v2.PILToTensor,
    v2.ToPureTensor,
    v2.ToDtype,
    v2.Normalize,
    v2.Resize,
    v2.CenterCrop,
    v2.Grayscale,
    v2.Identity,
    v1.ToTensor,
    v1.PILToTensor,
    v1.Normalize,
    v1.Resize,
    v1.CenterCrop,
    v1.Grayscale,
)
# Elementwise and deterministic: the same on one image as on each image of a batch, bit for
# bit, so they can run once per collated batch instead of once per sample.
_BATCHABLE: tuple[type, ...] = (v2.ToDtype, v2.Normalize, v2.ToPureTensor)
# What may precede the batch stage: the sample stage must end in a uint8 image tensor.
_TO_TENSOR: tuple[type, ...] = (v2.ToImage, v2.PILToTensor)


def is_random(transform: Callable | None) -> bool:
    """Whether ``transform`` may draw random numbers: False only for a (nested) Compose of
    known deterministic transforms (decoding, resize, centre crop, to tensor, normalise)."""
    if transform is None:
        return False
    if isinstance(transform, v2.Compose | v1.Compose):
        return any(is_random(t) for t in transform.transforms)
    return not (isinstance(transform, _DETERMINISTIC) or getattr(transform, "deterministic", False))


@dataclass(frozen=True)
class Stages:
    """A transform split in two: ``sample`` runs on every item in the loader (its workers),
    ``batch`` on each collated batch of images ``[B, C, H, W]`` (None: nothing left to do),
    where it is cheapest: in the workers on CPU, on the device on a GPU. ``batch`` runs on
    any device and is elementwise, so ``batch(stack(sample(x_i)))[i]`` is the whole
    transform's ``x_i``, bit for bit. ``collate``: how the items are batched (None: torch's
    default_collate); data/decode.py's device decoding batches undecoded files."""

    sample: Callable | None
    batch: Callable | None = None
    collate: Callable | None = None


class BatchStage:
    """The batchable tail of a v2 pipeline (to float, normalise) on a whole batch; returns a
    plain tensor. Each transform's own ``transform`` (its kernel call), without the input
    flattening of its ``forward``; normalisation in place (the batch is a fresh tensor):
    the same arithmetic, half the time."""

    def __init__(self, transforms: Sequence[Callable]) -> None:
        self.transforms = [
            v2.Normalize(t.mean, t.std, inplace=True) if isinstance(t, v2.Normalize) else t
            for t in transforms
        ]

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        x = images.as_subclass(torch.Tensor)
        for t in self.transforms:
            x = t.transform(x, {}) if isinstance(t, v2.Transform) else t(x)
        return x.as_subclass(torch.Tensor)

    def __repr__(self) -> str:
        return f"BatchStage({self.transforms!r})"


def split_stages(transform: Callable | None) -> Stages:
    """``transform`` as Stages: a v2.Compose ending in ``ToImage`` + elementwise ops (ToDtype,
    Normalize: every pipeline data.transforms builds without random erasing) gives those ops
    to the batch stage, so each sample stays uint8 until it is collated (4x less to copy
    between processes and to the device; one vectorised op per batch instead of a few
    dispatches per sample). Anything else runs whole per sample."""
    if isinstance(transform, v2.Compose):
        ops = list(transform.transforms)
        k = len(ops)
        while k > 0 and isinstance(ops[k - 1], _BATCHABLE):
            k -= 1
        if 0 < k < len(ops) and isinstance(ops[k - 1], _TO_TENSOR):
            head = ops[:k]
            if isinstance(head[-1], v2.ToImage):
                # Its kernel, without v2.Transform's input flattening: one image in, ~10 us
                # less per sample.
                head[-1] = v2.functional.to_image
            return Stages(head[0] if len(head) == 1 else v2.Compose(head), BatchStage(ops[k:]))
    return Stages(transform)
