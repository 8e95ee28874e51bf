"""The in-memory fast path: whole splits as uint8 tensors, batches built with tensor ops.

For sets that fit in memory (digits, the MNIST family, CIFAR-10/100) each split is one uint8
``[N, C, H, W]`` tensor, moved once to the training device. The train loader takes its
``(epoch, index)`` items from the very same ResumableDistributedSampler as the standard
DataLoader path (same shard, same order, ``set_epoch``/``skip`` respected) and turns each
``batch_size`` of them into a batch with a few batched ops on the device: gather, random
crop/flip, normalise, random erasing. No worker processes, no PIL, no per-sample Python.
Recipes it cannot express (a random-resized crop, a policy such as TrivialAugmentWide, other
v2 transforms: ``Recipe.fast`` is None) run on the DataLoader path (data/loaders.py says so).

Augmentation randomness is a counter-based hash of (seed, epoch, index) in int64 tensor
arithmetic (``mix_seed_tensor``, equal to data.seeding.mix_seed element by element), so like
the standard path an augmented sample does not depend on the rank, world size, batch
composition or resume point. The draws differ from the standard path's (torch's RNG), so
augmented pixels differ between the paths; without augmentation the batches are the same.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from data.samplers import ExactShardSampler, ResumableDistributedSampler
from data.seeding import splitmix64
from data.transforms import ERASE_RATIO, ERASE_SCALE, FastAugment

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class InMemoryData:
    """The splits of a fixed-size image set, as stored (uint8), plus how to turn them into the
    model's float inputs. Built by build_datasets; the tensors may share memory with the
    torchvision datasets (views, no copy) and may be non-contiguous."""

    train_images: torch.Tensor  # uint8 [N, C, H, W]
    train_labels: torch.Tensor  # int64 [N]
    val_images: torch.Tensor  # uint8 [M, C, H, W]
    val_labels: torch.Tensor  # int64 [M]
    image_size: int
    mean: tuple[float, ...]  # per channel, of the 0..1-scaled images
    std: tuple[float, ...]
    # The train augmentation as batched ops; None: the recipe has none (the DataLoader path
    # runs it instead, see data/loaders.py), `unsupported` naming what it lacks.
    augment: FastAugment | None
    seed: int  # augmentation seed: the one EpochSeededDataset uses on the standard path
    test_images: torch.Tensor | None = None  # None: the set has no test split
    test_labels: torch.Tensor | None = None
    unsupported: str = ""

    def split(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(images, labels) of the split ``train``, ``val`` or ``test``."""
        images, labels = getattr(self, f"{name}_images"), getattr(self, f"{name}_labels")
        if images is None:
            raise ValueError(f"no {name} split held in memory")
        return images, labels


def as_uint8_nchw(data: torch.Tensor | np.ndarray) -> torch.Tensor:
    """A torchvision dataset's ``data``: ``[N, H, W]`` (MNIST, digits) or numpy ``[N, H, W, C]``
    (CIFAR) uint8, as a ``[N, C, H, W]`` view (no copy)."""
    images = torch.from_numpy(data) if isinstance(data, np.ndarray) else data
    if images.dtype != torch.uint8 or images.ndim not in (3, 4):
        raise ValueError(f"expected uint8 [N,H,W] or [N,H,W,C], got {images.dtype} {images.shape}")
    return images.unsqueeze(1) if images.ndim == 3 else images.permute(0, 3, 1, 2)


# --- counter-based hashing in int64 tensor arithmetic ---------------------------------------


def _signed(value: int) -> int:
    """The int64 with the same 64 bits as ``value`` (a Python int taken modulo 2**64)."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical (unsigned) right shift of int64 (torch's >> is arithmetic on signed ints)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


_GOLDEN, _MUL1, _MUL2 = (
    _signed(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB)
)


def splitmix64_tensor(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser on int64 tensors (uint64 bits; + and * wrap modulo 2**64)."""
    x = x + _GOLDEN
    x = (x ^ _shr(x, 30)) * _MUL1
    x = (x ^ _shr(x, 27)) * _MUL2
    return x ^ _shr(x, 31)


def mix_seed_tensor(*values: torch.Tensor | int) -> torch.Tensor:
    """data.seeding.mix_seed, elementwise over broadcast int64 tensors: values >= 0 < 2**63.

    Leading Python ints are mixed in Python (no tensor ops for the constant part)."""
    h: torch.Tensor | int = 0
    for value in values:
        if torch.is_tensor(h) or torch.is_tensor(value):
            v = value if torch.is_tensor(value) else _signed(int(value))
            h = splitmix64_tensor((_signed(h) if isinstance(h, int) else h) ^ v)
        else:
            h = splitmix64(h ^ (int(value) & _MASK64))
    return _shr(h, 1) if torch.is_tensor(h) else torch.tensor(h >> 1)


# Streams of per-sample draws (any distinct constants).
_ROW, _COL, _FLIP, _ERASE, _TOP, _LEFT = 1, 2, 3, 4, 5, 6
_AREA, _ASPECT = 100, 200  # + attempt
_ERASE_ATTEMPTS = 10  # v2.RandomErasing's: the first of 10 draws that fits, else no erasing


def _uniform(key: torch.Tensor, stream: torch.Tensor | int) -> torch.Tensor:
    """float64 uniform in [0, 1) from the top 53 bits of a hash of (key, stream)."""
    return _shr(mix_seed_tensor(key, stream), 10).to(torch.float64) * 2.0**-53


def crop_flip_params(
    seed: int, epochs: torch.Tensor, indices: torch.Tensor, recipe: FastAugment
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample (row offset, column offset, flip) in the padded image, a function of
    (seed, epoch, index) only: offsets uniform in 0..2*padding, flip with probability 1/2
    (always False without ``recipe.flip``)."""
    key = mix_seed_tensor(seed, epochs, indices)
    span = 2 * recipe.padding + 1
    dy = mix_seed_tensor(key, _ROW) % span
    dx = mix_seed_tensor(key, _COL) % span
    flip = (mix_seed_tensor(key, _FLIP) & 1).bool()
    if not recipe.flip:
        flip = torch.zeros_like(flip)
    return dy, dx, flip


def erase_params(
    seed: int, epochs: torch.Tensor, indices: torch.Tensor, p: float, height: int, width: int
) -> torch.Tensor:
    """Per-sample erasing boxes ``[..., 4]`` (top, left, height, width; height 0: none), a
    function of (seed, epoch, index) only, drawn as v2.RandomErasing draws them: with
    probability ``p``, the first of 10 (area, aspect) draws that fits, at a uniform position."""
    key = mix_seed_tensor(seed, epochs, indices)
    attempts = key.unsqueeze(-1), torch.arange(_ERASE_ATTEMPTS, device=key.device)  # [..., A]
    fraction = _uniform(attempts[0], _AREA + attempts[1])
    area = height * width * (ERASE_SCALE[0] + (ERASE_SCALE[1] - ERASE_SCALE[0]) * fraction)
    low, high = math.log(ERASE_RATIO[0]), math.log(ERASE_RATIO[1])
    ratio = torch.exp(low + (high - low) * _uniform(attempts[0], _ASPECT + attempts[1]))
    h = torch.sqrt(area * ratio).round().long()
    w = torch.sqrt(area / ratio).round().long()
    fits = (h < height) & (w < width)
    first = fits.long().argmax(-1, keepdim=True)  # the first attempt that fits (0 if none)
    h, w = h.gather(-1, first).squeeze(-1), w.gather(-1, first).squeeze(-1)
    top = (_uniform(key, _TOP) * (height - h + 1)).long()
    left = (_uniform(key, _LEFT) * (width - w + 1)).long()
    erase = fits.any(-1) & (_uniform(key, _ERASE) < p)
    return torch.stack([top, left, h * erase, w * erase], -1)


def erase(x: torch.Tensor, boxes: torch.Tensor) -> torch.Tensor:
    """Zero each image of ``x`` ``[B, C, H, W]`` inside its box ``[B, 4]`` (in place)."""
    _, _, h, w = x.shape
    top, left, height, width = boxes.unbind(-1)
    rows = torch.arange(h, device=x.device)
    cols = torch.arange(w, device=x.device)
    in_rows = (rows >= top[:, None]) & (rows < (top + height)[:, None])  # [B, H]
    in_cols = (cols >= left[:, None]) & (cols < (left + width)[:, None])  # [B, W]
    return x.masked_fill_((in_rows[:, :, None] & in_cols[:, None, :]).unsqueeze(1), 0.0)


def crop_flip(
    images: torch.Tensor, dy: torch.Tensor, dx: torch.Tensor, flip: torch.Tensor, padding: int
) -> torch.Tensor:
    """``images`` ``[B, C, H, W]`` zero-padded by ``padding``, cropped back to H x W at per-image
    offsets ``(dy, dx)`` and mirrored left-right where ``flip``: one gather on the device."""
    b, c, h, w = images.shape
    hp, wp = h + 2 * padding, w + 2 * padding
    padded = F.pad(images, (padding,) * 4).reshape(b, c, hp * wp)
    device = images.device
    start = (dy * wp + dx)[:, None, None]  # [B, 1, 1]: the crop's top-left pixel
    rows = torch.arange(0, h * wp, wp, device=device)[:, None]  # [H, 1]
    cols = torch.arange(w, device=device)
    cols = torch.where(flip[:, None, None], w - 1 - cols, cols)  # [B, 1, W]
    flat = (start + rows + cols).reshape(b, 1, h * w)
    return padded.gather(2, flat.expand(b, c, h * w)).reshape(b, c, h, w)


class _Normalize:
    """uint8 -> float32 ``(x / 255 - mean) / std``, with torchvision's op order (ToDtype with
    scale, then Normalize) so results match the standard path's bit for bit on CPU."""

    def __init__(self, mean, std, device: torch.device) -> None:
        self.mean = torch.tensor(mean, dtype=torch.float32, device=device).view(1, -1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32, device=device).view(1, -1, 1, 1)

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        return images.to(torch.float32).mul_(1.0 / 255).sub_(self.mean).div_(self.std)


def _on(device: torch.device, images: torch.Tensor, labels: torch.Tensor):
    return images.to(device).contiguous(), labels.to(device=device, dtype=torch.int64)


class FastTrainLoader:
    """Per-rank train batches ``(x float32 [B, C, H, W], y int64 [B])`` on ``device``.

    Iterating takes this epoch's ``(epoch, index)`` items from ``sampler`` (call its
    ``set_epoch``/``skip`` first, as for a DataLoader) in order, ``batch_size`` per batch, and
    drops the last partial batch. ``last_indices`` is the index tensor of the batch yielded
    last (what it was built from); ``step_indices()`` lists every batch's indices upfront.
    """

    drop_last = True
    num_workers = 0

    def __init__(
        self,
        data: InMemoryData,
        sampler: ResumableDistributedSampler,
        batch_size: int,
        device: torch.device | str,
    ) -> None:
        self.device = torch.device(device)
        self.images, self.labels = _on(self.device, data.train_images, data.train_labels)
        self.sampler = sampler
        self.batch_size = batch_size
        self.seed = data.seed
        self.recipe = data.augment or FastAugment()
        self.normalize = _Normalize(data.mean, data.std, self.device)
        self.last_indices: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.sampler) // self.batch_size

    def _plan(self) -> torch.Tensor:
        """``[steps, batch_size, 2]`` int64 (epoch, index) on the device: one copy per epoch."""
        keys = list(self.sampler)
        steps = len(keys) // self.batch_size
        plan = torch.tensor(keys[: steps * self.batch_size], dtype=torch.int64).view(
            steps, self.batch_size, 2
        )
        return plan.to(self.device)

    def step_indices(self) -> list[list[int]]:
        return self._plan()[:, :, 1].tolist()

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        plan = self._plan()
        epochs, indices = plan[:, :, 0], plan[:, :, 1]
        recipe = self.recipe
        augment = recipe.padding > 0 or recipe.flip
        # The whole epoch's draws at once: a few dozen ops per epoch, not per batch.
        if augment:
            dy, dx, flip = crop_flip_params(self.seed, epochs, indices, recipe)
        if recipe.erasing > 0:
            boxes = erase_params(
                self.seed, epochs, indices, recipe.erasing, *self.images.shape[-2:]
            )
        for k in range(len(plan)):
            self.last_indices = batch = indices[k]
            images = self.images[batch]
            if augment:
                images = crop_flip(images, dy[k], dx[k], flip[k], recipe.padding)
            x = self.normalize(images)
            yield erase(x, boxes[k]) if recipe.erasing > 0 else x, self.labels[batch]


class FastEvalLoader:
    """This rank's exact shard (ExactShardSampler) of one split, ``batch_size`` per batch, the
    last one partial, normalised without augmentation: ``(x float32, y int64)`` on ``device``.
    ``indices`` are the split's sample indices this rank evaluates, in order."""

    drop_last = False
    num_workers = 0

    def __init__(
        self,
        data: InMemoryData,
        sampler: ExactShardSampler,
        batch_size: int,
        device: torch.device | str,
        split: str = "val",
    ) -> None:
        self.device = torch.device(device)
        self.images, self.labels = _on(self.device, *data.split(split))
        self.sampler = sampler
        self.batch_size = batch_size
        self.normalize = _Normalize(data.mean, data.std, self.device)
        self.indices = torch.tensor(list(sampler), dtype=torch.int64, device=self.device)

    def __len__(self) -> int:
        return -(-len(self.indices) // self.batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for indices in self.indices.split(self.batch_size):
            yield self.normalize(self.images[indices]), self.labels[indices]
