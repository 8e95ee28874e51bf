"""The in-memory fast path (data/fast.py) against the standard DataLoader path."""

from __future__ import annotations

import functools
import itertools
import logging
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torchvision import datasets as tvd

from data import FastEvalLoader, FastTrainLoader, build_datasets, build_loaders
from data.fast import crop_flip, crop_flip_params, mix_seed_tensor
from data.seeding import mix_seed
from data.transforms import NORMALIZATION, FastAugment
from tests import helpers as fx
from tests.gpu import on_gpu
from tests.helpers import dataset_cfg

NAMES = ["digits", "mnist", "cifar10"]  # 1437 / 270 / 108 train samples (10% carved as val)
# Each dataset's shifting recipe: its default, but MNIST's (none since its 3-epoch recipe)
SHIFTING = {"digits": True, "mnist": "shift", "cifar10": True}


@pytest.fixture(scope="module")
def make_splits(tmp_path_factory):
    """make_splits(name, augment, seed=3) -> DataSplits (cached) from generated MNIST/CIFAR-10
    files (torchvision's md5 table patched to the generated files) or the real digits;
    augment: True for the dataset config's default recipe, False for none, or a choice of
    conf/augment/."""
    root = tmp_path_factory.mktemp("data")
    fx.make_mnist(root, "MNIST", n_train=300, n_test=100)
    _, sums = fx.make_cifar(root, classes=10, n_per_batch=24)
    with pytest.MonkeyPatch.context() as patch:
        for attr, value in sums.items():
            patch.setattr(tvd.CIFAR10, attr, value)

        @functools.cache
        def make(name: str, augment: bool | str, seed: int = 3):
            keys = {} if name == "digits" else {"root": str(root)}
            choice = [] if augment is True else [f"augment={augment or 'none'}"]
            return build_datasets(
                dataset_cfg(name, **keys), seed=seed, augment=fx.recipe(f"dataset={name}", *choice)
            )

        yield make


def loaders(splits, *, rank=0, world_size=1, batch_size=8, fast=True, device="cpu", seed=5):
    return build_loaders(
        splits,
        batch_size=batch_size,
        eval_batch_size=7,
        rank=rank,
        world_size=world_size,
        seed=seed,
        fast=fast,
        device=device,
    )


def position(ld, epoch: int, skip: int) -> None:
    ld.train_sampler.set_epoch(epoch)
    ld.train_sampler.skip(skip)


def to_uint8(x: torch.Tensor, name: str) -> torch.Tensor:
    """Undo the normalisation: back to the 0..255 pixels ([..., C, H, W])."""
    mean, std = (torch.tensor(v).view(-1, 1, 1) for v in NORMALIZATION[name])
    return ((x.cpu() * std + mean) * 255).round().to(torch.uint8)


# --- which path --------------------------------------------------------------------------


def test_fast_path_when_asked_and_only_for_in_memory_sets(make_splits, tmp_path, caplog):
    splits = make_splits("digits", False)
    assert splits.memory is not None and splits.memory.train_images.dtype == torch.uint8
    assert splits.memory.train_images.shape == (len(splits.train), 1, 8, 8)
    fast = loaders(splits)
    assert fast.fast and isinstance(fast.train, FastTrainLoader)
    assert isinstance(fast.val, FastEvalLoader)
    assert isinstance(fast.eval_loader("test"), FastEvalLoader)
    assert fast.train.sampler is fast.train_sampler
    fast.train_sampler.set_epoch(0)
    x, y = next(iter(fast.train))
    assert (x.shape, x.dtype, y.shape, y.dtype) == ((8, 1, 8, 8), torch.float32, (8,), torch.int64)
    xv, yv = next(iter(fast.val))
    assert (xv.shape, xv.dtype, yv.dtype) == ((7, 1, 8, 8), torch.float32, torch.int64)

    standard = loaders(splits, fast=False)  # the default of build_loaders
    assert not standard.fast and isinstance(standard.train, DataLoader)
    assert isinstance(standard.val, DataLoader)

    fake = build_datasets(dataset_cfg("fake", size=20, image_size=8))
    assert fake.memory is None
    with caplog.at_level(logging.DEBUG, logger="data.loaders"):
        fake_loaders = loaders(fake)
    assert not fake_loaders.fast and isinstance(fake_loaders.train, DataLoader)
    assert "fast data path: not for this dataset" in caplog.text

    fx.make_imagefolder(tmp_path / "folder")
    folder_cfg = dataset_cfg("imagefolder", root=str(tmp_path / "folder"), image_size=8)
    assert build_datasets(folder_cfg).memory is None


def test_memory_views_hold_the_dataset_pixels_and_labels(make_splits):
    for name in NAMES:
        splits = make_splits(name, False)
        mem = splits.memory
        assert mem.image_size == splits.image_size
        assert (mem.mean, mem.std) == NORMALIZATION[name]
        for images, labels, ds in (
            (mem.train_images, mem.train_labels, splits.train.dataset),
            (mem.val_images, mem.val_labels, splits.val),
            (mem.test_images, mem.test_labels, splits.test),
        ):
            assert images.shape == (len(ds), splits.in_channels, mem.image_size, mem.image_size)
            assert labels.dtype == torch.int64 and len(labels) == len(ds)
            for i in (0, len(ds) - 1):
                x, y = ds[i]
                assert torch.equal(to_uint8(x, name), images[i]) and y == labels[i]


@pytest.mark.parametrize(
    "name, recipe",
    [
        ("digits", FastAugment(1, False)),
        ("mnist", FastAugment(3, False)),
        ("cifar10", FastAugment(4, True)),
    ],
)
def test_augmentation_recipe_is_the_standard_paths(make_splits, name, recipe):
    assert make_splits(name, SHIFTING[name]).memory.augment == recipe
    assert make_splits(name, False).memory.augment == FastAugment()
    # The standard path's transform uses the same padding (and flip) ...
    ops = make_splits(name, SHIFTING[name]).train.dataset.transform.transforms
    crop = next(t for t in ops if type(t).__name__ == "RandomCrop")
    assert list(crop.padding) == [recipe.padding] * 4
    assert any(type(t).__name__ == "RandomHorizontalFlip" for t in ops) == recipe.flip


# --- same indices, same batches -------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_same_indices_per_rank_and_step_as_the_dataloader_path(make_splits, name):
    splits = make_splits(name, True)
    # The standard path over a dataset that returns its indices: the DataLoader's own batching.
    index_only = replace(
        splits,
        train=fx.IndexDataset(len(splits.train)),
        val=fx.IndexDataset(len(splits.val)),
        memory=None,
    )
    batch = 8
    for world_size in (1, 2):
        for rank in range(world_size):
            fast = loaders(splits, rank=rank, world_size=world_size, batch_size=batch)
            standard = loaders(
                index_only, rank=rank, world_size=world_size, batch_size=batch, fast=False
            )
            assert fast.fast and not standard.fast
            per_epoch = []
            for epoch, skip in itertools.product((0, 1), (0, 3, 2 * batch)):
                position(fast, epoch, skip)
                position(standard, epoch, skip)
                expected = [b.tolist() for b in standard.train]
                assert len(expected) >= 4
                seen = []
                for x, y in fast.train:
                    seen.append(fast.train.last_indices.tolist())
                    assert len(x) == len(y) == batch
                    assert torch.equal(y, splits.memory.train_labels[seen[-1]])
                assert seen == expected, (world_size, rank, epoch, skip)
                assert fast.step_indices() == standard.step_indices() == expected
                assert len(fast.train) == len(standard.train) == len(expected)
                if skip == 0:
                    per_epoch.append(expected)
            assert per_epoch[0] != per_epoch[1]  # set_epoch reshuffles
            assert fast.val.indices.tolist() == [i for b in standard.val for i in b.tolist()]
            test = fast.eval_loader("test")
            assert test.indices.tolist() == list(range(rank, len(splits.test), world_size))


@pytest.mark.parametrize("name", NAMES)
def test_without_augmentation_fast_batches_equal_standard_batches(make_splits, name):
    splits = make_splits(name, False)
    for world_size in (1, 2):
        for rank in range(world_size):
            fast = loaders(splits, rank=rank, world_size=world_size)
            standard = loaders(splits, rank=rank, world_size=world_size, fast=False)
            # Two ranks: their whole shards; one rank: the second half of the epoch (faster).
            skip = 8 if world_size == 2 else len(splits.train) // 16 * 8
            for ld in (fast, standard):
                position(ld, 1, skip)
            for kind in ("train", "val", "test"):
                got, want = (
                    list(ld.eval_loader(kind) if kind == "test" else getattr(ld, kind))
                    for ld in (fast, standard)
                )
                assert len(got) == len(want) > 0
                for (x, y), (xs, ys) in zip(got, want, strict=True):
                    assert x.dtype == xs.dtype and x.shape == xs.shape
                    torch.testing.assert_close(x, xs, atol=1e-6, rtol=0)
                    assert torch.equal(y, ys)


@pytest.mark.parametrize("name, augment", [("digits", False), ("cifar10", True)])
def test_two_ranks_together_see_the_one_rank_batches(make_splits, name, augment):
    """Step k of a 2-rank run (8 per rank) holds the same samples as step k of a 1-rank run
    (16), augmented identically: the data does not depend on the world size."""
    splits = make_splits(name, augment)

    def steps(world_size: int, rank: int):
        ld = loaders(splits, rank=rank, world_size=world_size, batch_size=16 // world_size)
        position(ld, 1, 0)
        out = []
        for x, y in ld.train:
            out.append((ld.train.last_indices.clone(), x, y))
        return out

    single, ranks = steps(1, 0), [steps(2, r) for r in (0, 1)]
    assert len(single) == len(ranks[0]) == len(ranks[1]) >= 5
    for k, (idx, x, y) in enumerate(single):
        idx2, x2, y2 = (torch.cat([r[k][j] for r in ranks]) for j in range(3))
        order, order2 = idx.argsort(), idx2.argsort()
        assert torch.equal(idx[order], idx2[order2])
        assert torch.equal(x[order], x2[order2]) and torch.equal(y[order], y2[order2])


# --- augmentation ---------------------------------------------------------------------------


def test_tensor_hash_equals_mix_seed():
    values = [0, 1, 2, 7, 255, 2**31, 2**32 + 5, 123456789012345, 2**62, 2**63 - 1]
    grid = torch.tensor(list(itertools.product(values, repeat=2)))
    for seed in (0, 3, 2**63 - 1):
        got = mix_seed_tensor(seed, grid[:, 0], grid[:, 1]).tolist()
        assert got == [mix_seed(seed, a, b) for a, b in grid.tolist()]


def test_crop_flip_is_a_crop_of_the_zero_padded_image():
    images = torch.randint(0, 256, (40, 3, 6, 5), dtype=torch.uint8)
    dy, dx = torch.randint(0, 5, (40,)), torch.randint(0, 5, (40,))
    flip = torch.rand(40) < 0.5
    out = crop_flip(images, dy, dx, flip, padding=2)
    padded = F.pad(images, (2, 2, 2, 2))
    for i in range(40):
        crop = padded[i, :, dy[i] : dy[i] + 6, dx[i] : dx[i] + 5]
        assert torch.equal(out[i], crop.flip(-1) if flip[i] else crop)


def test_crop_flip_draws_cover_the_padded_range_evenly():
    n = 20000
    indices = torch.arange(n)
    dy, dx, flip = crop_flip_params(3, torch.full((n,), 2), indices, FastAugment(4, True))
    for offsets in (dy, dx):
        counts = torch.bincount(offsets, minlength=9)
        assert len(counts) == 9 and counts.min() > 0.8 * n / 9 and counts.max() < 1.2 * n / 9
    assert 0.47 < flip.float().mean() < 0.53
    assert (dy != dx).float().mean() > 0.8  # independent draws, not one number twice
    _, _, no_flip = crop_flip_params(3, torch.full((n,), 2), indices, FastAugment(2, False))
    assert not no_flip.any()


@pytest.mark.parametrize("name", NAMES)
def test_augmented_samples_are_shifted_or_flipped_copies(make_splits, name):
    """Each augmented train image (normalisation undone) is a crop of the zero-padded original
    at an offset within the padding, mirrored only for CIFAR."""
    splits = make_splits(name, SHIFTING[name])
    mem, p = splits.memory, splits.memory.augment.padding
    ld = loaders(splits, batch_size=16)
    position(ld, 0, 0)
    x, _ = next(iter(ld.train))
    side = mem.image_size
    flips = (False, True) if mem.augment.flip else (False,)
    shifted = 0
    for image, i in zip(to_uint8(x, name), ld.train.last_indices.tolist(), strict=True):
        padded = F.pad(mem.train_images[i], (p,) * 4)

        def view(dy: int, dx: int, flip: bool, padded=padded) -> torch.Tensor:
            crop = padded[:, dy : dy + side, dx : dx + side]
            return crop.flip(-1) if flip else crop

        matches = [
            (dy, dx, flip)
            for dy, dx in itertools.product(range(2 * p + 1), repeat=2)
            for flip in flips
            if torch.equal(image, view(dy, dx, flip))
        ]
        assert matches, i
        shifted += (p, p, False) not in matches
    assert shifted >= 8  # mostly not the identity


def test_augmentation_depends_only_on_seed_epoch_and_index(make_splits):
    splits = make_splits("cifar10", True)
    mem, epoch = splits.memory, 2
    everything = torch.arange(len(mem.train_labels))

    def reference(memory, ep):
        # The loader's own two steps (data/fast.py): per-sample draws, then one gather.
        recipe = memory.augment
        dy, dx, flip = crop_flip_params(
            memory.seed, torch.full_like(everything, ep), everything, recipe
        )
        images = crop_flip(memory.train_images, dy, dx, flip, recipe.padding)
        mean, std = (torch.tensor(v).view(1, -1, 1, 1) for v in (memory.mean, memory.std))
        return images.float().mul_(1 / 255).sub_(mean).div_(std)

    expected = reference(mem, epoch)
    # Any rank, world size, batch size (batch composition), resume point, or shuffle seed.
    for world_size, rank, batch, skip, seed in [
        (1, 0, 4, 0, 5),
        (1, 0, 7, 9, 5),
        (2, 1, 5, 0, 6),
        (3, 2, 3, 5, 7),
    ]:
        ld = loaders(splits, rank=rank, world_size=world_size, batch_size=batch, seed=seed)
        position(ld, epoch, skip)
        count = 0
        for x, _ in ld.train:
            for image, i in zip(x, ld.train.last_indices.tolist(), strict=True):
                assert torch.equal(image, expected[i]), (world_size, rank, batch, skip, i)
                count += 1
        assert count >= 20

    # Different epochs and different (dataset) seeds give different crops/flips.
    def changed(images: torch.Tensor) -> int:
        return int((images != expected).flatten(1).any(1).sum())

    assert changed(reference(mem, epoch + 1)) >= 90  # of 108
    assert changed(reference(make_splits("cifar10", True, seed=4).memory, epoch)) >= 90


def test_normalisation(make_splits):
    # (x / 255 - mean) / std per channel, with each set's own constants.
    for name in NAMES:
        splits = make_splits(name, False)
        mem = splits.memory
        x = torch.cat([b for b, _ in loaders(splits).val])
        mean, std = (
            torch.tensor(v, dtype=torch.float64).view(1, -1, 1, 1) for v in NORMALIZATION[name]
        )
        want = (mem.val_images.double() / 255 - mean) / std
        torch.testing.assert_close(x.double(), want, atol=1e-6, rtol=0)
    # The digits constants were measured on the scans: the whole set comes out ~N(0, 1).
    splits = make_splits("digits", False)
    ld = loaders(splits, batch_size=len(splits.train))
    position(ld, 0, 0)
    (train, _), val = next(iter(ld.train)), torch.cat([b for b, _ in ld.val])
    test = torch.cat([b for b, _ in ld.eval_loader("test")])
    everything = torch.cat([train, val, test])
    assert len(everything) == 1797
    assert abs(everything.mean().item()) < 2e-3 and abs(everything.std().item() - 1) < 2e-3


# --- on the accelerator ---------------------------------------------------------------------


def cuda_batches_equal_cpu_batches(root: str) -> None:
    """In a process that sees the machine's GPUs (tests/gpu.py): make_splits("cifar10", True)'s
    data, built there, through both devices."""
    _, sums = fx.make_cifar(Path(root), classes=10, n_per_batch=24)
    for attr, value in sums.items():
        setattr(tvd.CIFAR10, attr, value)
    splits = build_datasets(
        dataset_cfg("cifar10", root=root), seed=3, augment=fx.recipe("dataset=cifar10")
    )
    cpu, gpu = (
        loaders(splits, world_size=2, rank=1),
        loaders(splits, world_size=2, rank=1, device="cuda"),
    )
    for ld in (cpu, gpu):
        position(ld, 3, 8)
    assert gpu.train.images.is_cuda and len(cpu.train) == len(gpu.train) > 0
    for kind in ("train", "val"):
        for (x, y), (xg, yg) in zip(getattr(cpu, kind), getattr(gpu, kind), strict=True):
            assert xg.is_cuda and yg.is_cuda and xg.dtype == torch.float32
            torch.testing.assert_close(xg.cpu(), x, atol=1e-6, rtol=0)
            assert torch.equal(yg.cpu(), y)
    grid = torch.tensor([[0, 1], [2**40, 7], [2**63 - 1, 2**62]])
    assert torch.equal(mix_seed_tensor(9, *grid.cuda().T).cpu(), mix_seed_tensor(9, *grid.T))


@pytest.mark.gpu
def test_cuda_batches_equal_cpu_batches(tmp_path):
    on_gpu(cuda_batches_equal_cpu_batches, str(tmp_path))
