"""data/: datasets from files in their real formats, samplers, loaders, seeding, download-once."""

from __future__ import annotations

import functools
import json
import random
import shutil
import subprocess
import sys
import threading
import time
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
import torch
from ddp_launcher.core.errors import UserError
from omegaconf import OmegaConf
from torch.utils.data import Dataset, DistributedSampler
from torchvision import datasets as tvd

from data import (
    DataSource,
    DataSplits,
    EpochSeededDataset,
    ExactShardSampler,
    ResumableDistributedSampler,
    build_datasets,
    build_loaders,
)
from data.datasets import _download_once_then_load, unwrap
from data.transforms import NORMALIZATION
from tests import helpers as fx
from tests.helpers import dataset_cfg

REPO = Path(__file__).resolve().parents[1]


def to_uint8(x: torch.Tensor, name: str) -> torch.Tensor:
    """Undo Normalize and ToDtype(scale=True): back to the stored 0..255 pixels (CHW)."""
    mean, std = (torch.tensor(v).view(-1, 1, 1) for v in NORMALIZATION[name])
    return ((x * std + mean) * 255).round().to(torch.uint8)


# --- digits -------------------------------------------------------------------------------


def ids(ds) -> list:
    """Sample ids of a split (its scans' / files' / parent set's indices)."""
    return (ds.dataset if isinstance(ds, EpochSeededDataset) else ds).sample_ids()


def test_digits_shapes_classes_and_split_sizes():
    splits = build_datasets(dataset_cfg("digits"))
    assert (splits.num_classes, splits.in_channels, splits.image_size) == (10, 1, 8)
    # 10% test and 10% val of the 1797 scans (ceil), the rest to train on
    assert (len(splits.train), len(splits.val), len(splits.test)) == (1437, 180, 180)
    x, y = splits.train[0]
    assert x.shape == (1, 8, 8) and x.dtype == torch.float32 and isinstance(y, int)
    assert torch.equal(splits.train[(0, 0)][0], x)  # a bare index is epoch 0
    for ds in (splits.val, splits.test):
        xv, yv = ds[5]
        assert xv.shape == (1, 8, 8) and xv.dtype == torch.float32 and 0 <= yv < 10


def test_digits_split_is_a_fixed_stratified_partition_of_the_real_scans():
    from sklearn.datasets import load_digits

    bunch = load_digits()
    scans = np.rint(bunch.images * 255 / 16).astype(np.uint8)
    first = build_datasets(dataset_cfg("digits"), seed=1)
    second = build_datasets(dataset_cfg("digits"), seed=2, local_rank=1)
    # The same scans in each split whatever the run's seed or the rank.
    for split in ("train", "val", "test"):
        assert ids(getattr(first, split)) == ids(getattr(second, split))
    # Train, val and test partition the 1797 scans (by scan index) ...
    train, val, test = (set(ids(getattr(first, s))) for s in ("train", "val", "test"))
    assert not (train & val or train & test or val & test)
    assert train | val | test == set(range(1797))
    # ... and every sample is that scan, with its label.
    for ds in (first.val, first.test):
        for i in range(0, len(ds), 37):
            x, y = ds[i]
            scan = ids(ds)[i]
            assert y == bunch.target[scan]
            assert torch.equal(to_uint8(x, "digits")[0], torch.from_numpy(scans[scan]))
    # Each class is ~10% held out in val and in test.
    for ds in (first.val, first.test):
        counts = np.bincount(ds.targets, minlength=10)
        assert counts.min() >= 17 and counts.max() <= 19


@pytest.mark.slow  # starts a Python process; scikit-learn's import alone takes seconds
def test_digits_scans_are_scikit_learns_without_importing_it():
    from sklearn.datasets import load_digits as sklearn_digits

    from data.digits import load_digits

    images, labels = load_digits()
    bunch = sklearn_digits()
    assert images.dtype == bunch.images.dtype and np.array_equal(images, bunch.images)
    assert np.array_equal(labels, bunch.target)
    code = "import data.catalog, data.datasets, data.digits, sys; print('sklearn' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert out.stdout.strip() == "False", out.stderr


def test_holdouts_are_scikit_learns_train_test_split():
    """stratified_holdout restates train_test_split's draws in numpy: the same positions for
    any labels (balanced, skewed, with ties, too few to stratify), size and seed."""
    from sklearn.model_selection import train_test_split

    from data.datasets import stratified_holdout

    rng = np.random.default_rng(0)
    stratified = 0
    for trial in range(300):
        n, classes = int(rng.integers(5, 300)), int(rng.integers(1, 15))
        labels = (
            None
            if trial % 7 == 0
            else rng.integers(0, classes, n)
            if trial % 2
            else np.repeat(np.arange(classes), -(-n // classes))[:n]
        )
        size, seed = int(rng.integers(1, n)), int(rng.integers(0, 5))
        stratify = labels
        if labels is not None:
            counts = np.bincount(labels)
            counts = counts[counts > 0]
            if counts.min() < 2 or not len(counts) <= size <= n - len(counts):
                stratify = None
        stratified += stratify is not None
        kept, held = train_test_split(
            np.arange(n), test_size=size, stratify=stratify, random_state=seed
        )
        ours = stratified_holdout(labels, n, size, seed)
        assert np.array_equal(ours[0], np.sort(kept)) and np.array_equal(ours[1], np.sort(held))
    assert stratified > 100


@pytest.mark.parametrize(
    "keys, message",
    [
        ({"val_fraction": 0.0}, "dataset.val_fraction=0.0"),
        ({"val_fraction": 1.0}, "dataset.val_fraction=1.0"),
        ({"test_fraction": 0.9999}, "dataset.test_fraction=0.9999"),
        ({"val_fraction": 0.5, "test_fraction": 0.45}, "keep their sum"),
    ],
)
def test_digits_bad_fractions_are_user_errors(keys, message):
    with pytest.raises(UserError, match=message):
        build_datasets(dataset_cfg("digits", **keys))


# --- file-backed datasets -----------------------------------------------------------------


def check_carved(splits, data: dict, name: str, n_train: int, n_test: int, fraction=0.1):
    """val carved from the training file (fraction, ceil), test the test file, each sample the
    file's pixels and label at its id; train and val disjoint."""
    n_val = -(-int(fraction * 100) * n_train // 100)
    sizes = (len(splits.train), len(splits.val), len(splits.test))
    assert sizes == (n_train - n_val, n_val, n_test)
    assert not set(ids(splits.train)) & set(ids(splits.val))
    assert sorted(ids(splits.train) + ids(splits.val)) == list(range(n_train))
    assert ids(splits.test) == list(range(n_test))
    for ds, (images, labels) in (
        (splits.train.dataset, data[True]),
        (splits.val, data[True]),
        (splits.test, data[False]),
    ):
        for i in (0, len(ds) // 2, len(ds) - 1):
            x, y = ds[i]
            j = ids(ds)[i]
            assert y == labels[j]
            stored = torch.from_numpy(images[j])
            assert torch.equal(
                to_uint8(x, name), stored.permute(2, 0, 1) if stored.ndim == 3 else stored[None]
            )


@pytest.mark.parametrize("name, folder", [("mnist", "MNIST"), ("fashion_mnist", "FashionMNIST")])
def test_mnist_like_round_trip(tmp_path, name, folder):
    data = fx.make_mnist(tmp_path, folder, n_train=300, n_test=100)
    splits = build_datasets(dataset_cfg(name, root=str(tmp_path)))
    assert (splits.num_classes, splits.in_channels, splits.image_size) == (10, 1, 28)
    assert splits.train[0][0].shape == (1, 28, 28) and splits.train[0][0].dtype == torch.float32
    check_carved(splits, data, name, n_train=300, n_test=100)
    # stratified: each class ~10% held out
    labels, held = data[True][1], np.bincount(splits.val.targets, minlength=10)
    assert (np.abs(held - np.bincount(labels, minlength=10) * 0.1) <= 1).all()


@pytest.fixture
def cifar_root(tmp_path, monkeypatch):
    """Generated CIFAR-10 and CIFAR-100 under tmp_path, with torchvision's md5 table set to the
    generated files' sums (it verifies every file). Yields (root, {classes: data})."""
    data = {}
    for classes, cls in ((10, tvd.CIFAR10), (100, tvd.CIFAR100)):
        data[classes], sums = fx.make_cifar(tmp_path, classes=classes)
        for attr, value in sums.items():
            monkeypatch.setattr(cls, attr, value)
    return tmp_path, data


@pytest.mark.parametrize("name, classes", [("cifar10", 10), ("cifar100", 100)])
def test_cifar_round_trip(cifar_root, name, classes):
    root, data = cifar_root
    splits = build_datasets(dataset_cfg(name, root=str(root)))
    assert (splits.num_classes, splits.in_channels, splits.image_size) == (classes, 3, 32)
    n_train = 100 if classes == 10 else 20  # 5 batches of 20, or one "train" file of 20
    check_carved(splits, data[classes], name, n_train=n_train, n_test=20)


def test_val_fraction_sets_the_carved_share(tmp_path):
    fx.make_mnist(tmp_path, n_train=300, n_test=100)
    splits = build_datasets(dataset_cfg("mnist", root=str(tmp_path), val_fraction=0.25))
    assert (len(splits.train), len(splits.val), len(splits.test)) == (225, 75, 100)
    with pytest.raises(UserError, match="dataset.val_fraction=1.5 is out of range"):
        build_datasets(dataset_cfg("mnist", root=str(tmp_path), val_fraction=1.5))


@pytest.mark.parametrize(
    "folders", [("train", "val"), ("train", "val", "test"), ("train",), ("train", "test")]
)
def test_imagefolder_round_trip(tmp_path, folders):
    fx.make_imagefolder(
        tmp_path, {split: {"train": 4, "val": 2, "test": 3}[split] for split in folders}
    )
    splits = build_datasets(dataset_cfg("imagefolder", root=str(tmp_path), image_size=16))
    assert (splits.num_classes, splits.in_channels, splits.image_size) == (3, 3, 16)
    # val/: 2 per class; else carved from train: ceil(10% of 12)
    assert (len(splits.train), len(splits.val)) == ((12, 6) if "val" in folders else (10, 2))
    assert (splits.test is None) == ("test" not in folders)
    sets = [("train", splits.train), ("val", splits.val)] + [("test", splits.test)] * (
        "test" in folders
    )
    seen = []
    for split, ds in sets:
        files = ids(ds)
        seen += files
        for i in range(len(ds)):
            x, y = ds[(1, i)] if split == "train" else ds[i]
            assert x.shape == (3, 16, 16) and x.dtype == torch.float32
            cls = sorted(fx.COLORS)[y]  # ImageFolder: sorted class folders
            assert Path(files[i]).parent.name == cls
            carved = split == "val" and "val" not in folders
            assert Path(files[i]).parts[-3] == ("train" if carved else split)
            # Solid colours survive any crop/resize/flip, up to rounding.
            expected = torch.tensor(fx.COLORS[cls]).view(3, 1, 1).expand(3, 16, 16)
            assert (to_uint8(x, "imagefolder").int() - expected).abs().max() <= 1
    assert len(seen) == len(set(seen))  # disjoint by file


@pytest.mark.parametrize("split", ["val", "test"])
def test_imagefolder_with_different_class_folders_is_user_error(tmp_path, split):
    fx.make_imagefolder(tmp_path, {"train": 3, split: 2})
    shutil.rmtree(tmp_path / split / "emu")
    with pytest.raises(UserError, match=f"only in train: \\['emu'\\], only in {split}"):
        build_datasets(dataset_cfg("imagefolder", root=str(tmp_path)))


@pytest.mark.parametrize(
    "link, target",
    [
        ("train/cat/loop", ".."),  # back up its tree: walked again and again
        ("train/cat/root", "../.."),  # above the splits: val would leak into train
        ("train/cat/leak", "../../val/emu"),  # another split's images
        ("train/dog/twin", "../cat"),  # another class's images, read twice
    ],
)
def test_a_link_back_into_an_image_folder_stops_naming_it(tmp_path, link, target):
    """Issue 55: torchvision walks an ImageFolder with os.walk(followlinks=True), which keeps
    no record of the dirs it visited: `train/cat/loop -> ..` made 60 images ~2,460 samples and
    leaked val into train. Each file is read once: such a link is one line naming it."""
    fx.make_imagefolder(tmp_path, {"train": 8, "val": 2})
    (tmp_path / link).symlink_to(target)
    with pytest.raises(UserError) as caught:
        build_datasets(dataset_cfg("imagefolder", root=str(tmp_path)))
    message = str(caught.value)
    assert str(tmp_path / link) in message and "remove the link" in message, message
    assert "\n" not in message


def test_links_to_folders_elsewhere_are_followed_once(tmp_path):
    """Links out of the dataset (a class folder, or a folder inside one, kept elsewhere) are
    followed as torchvision follows them: the same samples, in the same order."""
    fx.make_imagefolder(tmp_path / "data", {"train": 4, "val": 2})
    fx.make_imagefolder(tmp_path / "elsewhere", {"more": 2})
    (tmp_path / "data" / "train" / "cat" / "more").symlink_to(tmp_path / "elsewhere/more/cat")
    shutil.move(tmp_path / "data" / "train" / "dog", tmp_path / "elsewhere" / "dogs")
    (tmp_path / "data" / "train" / "dog").symlink_to(tmp_path / "elsewhere" / "dogs")
    splits = build_datasets(dataset_cfg("imagefolder", root=str(tmp_path / "data")))
    torchvision = tvd.ImageFolder(str(tmp_path / "data" / "train"))
    assert len(torchvision.samples) == 14  # 3 x 4, and the 2 cats from elsewhere
    assert ids(splits.train) == [path for path, _ in torchvision.samples]


@pytest.mark.parametrize("unreadable", [["emu"], ["cat", "dog", "emu"]])
def test_skip_unreadable_that_empties_a_class_names_it(tmp_path, unreadable):
    """dataset.skip_unreadable=true leaving a class without an image names that class folder
    (with every image unreadable the error blamed dataset.val_fraction; a class left empty
    was not named at all)."""
    fx.make_imagefolder(tmp_path, {"train": 4})
    for name in unreadable:
        for image in (tmp_path / "train" / name).iterdir():
            image.write_bytes(b"")
    cfg = dataset_cfg("imagefolder", root=str(tmp_path), skip_unreadable="true")
    with pytest.raises(UserError) as caught:
        build_datasets(cfg)
    message = str(caught.value)
    named = ", ".join(f"train/{name}" for name in unreadable)
    assert f"class folder {named} of {tmp_path} holds no readable image" in message, message
    assert f"left out {4 * len(unreadable)} unreadable file(s)" in message
    assert "val_fraction" not in message and "\n" not in message


def test_fake(tmp_path):
    cfg = dataset_cfg("fake", size=50, image_size=12, num_classes=7)
    splits = build_datasets(cfg)
    assert (splits.num_classes, splits.in_channels, splits.image_size) == (7, 3, 12)
    assert (len(splits.train), len(splits.val), len(splits.test)) == (50, 10, 10)
    x, _ = splits.train[0]
    assert x.shape == (3, 12, 12) and x.dtype == torch.float32
    assert {splits.train[i][1] for i in range(50)} <= set(range(7))
    # Three generated sets: no val or test image is a copy of another split's.
    images = {s: [getattr(splits, s)[i][0] for i in range(10)] for s in ("train", "val", "test")}
    for a, b in (("train", "val"), ("train", "test"), ("val", "test")):
        assert not any(torch.equal(x, y) for x in images[a] for y in images[b])


# --- user errors ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["mnist", "fashion_mnist", "cifar10", "cifar100", "imagenet", "imagefolder"]
)
def test_missing_data_offline_is_one_line_user_error(tmp_path, name):
    root = tmp_path / "nowhere"
    with pytest.raises(UserError) as info:
        build_datasets(dataset_cfg(name, root=str(root), download=False))
    message = str(info.value)
    assert str(root) in message and "dataset.download" in message and "\n" not in message


def test_failed_download_is_user_error(tmp_path, monkeypatch):
    monkeypatch.setattr(tvd.MNIST, "mirrors", ["http://127.0.0.1:9/"])  # nothing listens there
    with pytest.raises(UserError, match="dataset.download=false") as info:
        build_datasets(dataset_cfg("mnist", root=str(tmp_path), download=True))
    assert str(tmp_path) in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("name", ["imagenet", "imagefolder"])
def test_manual_datasets_refuse_download(tmp_path, name):
    with pytest.raises(UserError, match="manually"):
        build_datasets(dataset_cfg(name, root=str(tmp_path), download=True))


def test_imagefolder_without_root_is_user_error():
    with pytest.raises(UserError, match="dataset imagefolder needs dataset.root"):
        build_datasets(dataset_cfg("imagefolder"))


def not_a_source(size: int = 3):
    return list(range(size))


def test_a_bad_target_is_one_line_user_error():
    cfg = dataset_cfg("digits")
    cfg._target_ = "data.catalog.mnsit"
    with pytest.raises(UserError, match="dataset._target_=data.catalog.mnsit cannot be imported"):
        build_datasets(cfg)
    wrong = OmegaConf.create({"_target_": f"{__name__}.not_a_source", "size": 2})
    with pytest.raises(UserError, match="returned list, not a data.DataSource"):
        build_datasets(wrong)


def source_of(n: int, *, download: bool = False) -> DataSource:
    """A target with its own argument, in an untyped config (no schema): tensors, no transforms."""
    images = torch.arange(n * 4, dtype=torch.float32).view(n, 1, 2, 2)
    labels = [i % 2 for i in range(n)]
    data = list(zip(images, labels, strict=True))
    return DataSource(
        train=data, val=data[:2], test=None, num_classes=2, in_channels=1, image_size=2
    )


def test_any_function_is_a_dataset():
    cfg = OmegaConf.create({"_target_": f"{__name__}.source_of", "n": 6, "num_workers": 0})
    splits = build_datasets(cfg)
    assert (len(splits.train), len(splits.val), splits.test, splits.num_classes) == (6, 2, None, 2)
    assert splits.memory is None and splits.classes == ["0", "1"]
    assert torch.equal(splits.train[(3, 5)][0], torch.arange(20, 24.0).view(1, 2, 2))
    with pytest.raises(UserError, match="no 'test' split: use split= one of train, val"):
        splits.eval_set("test")


# --- samplers -------------------------------------------------------------------------------


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_resumable_sampler_matches_torch_and_skips(world_size, drop_last):
    n = 11  # divisible by none of 2, 3
    perms = {}
    for rank in range(world_size):
        kwargs = dict(num_replicas=world_size, rank=rank, shuffle=True, seed=5, drop_last=drop_last)
        ours = ResumableDistributedSampler(range(n), **kwargs)
        theirs = DistributedSampler(range(n), **kwargs)
        for epoch in (0, 1, 2):
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            got = list(ours)
            assert got == [(epoch, i) for i in theirs] and len(ours) == len(theirs)
            perms.setdefault(epoch, [None] * world_size)[rank] = [i for _, i in got]
            for k in (1, 2, len(got) - 1, len(got)):
                ours.skip(k)
                assert list(ours) == got[k:] and len(ours) == len(got) - k
            ours.set_epoch(epoch)  # clears the skip
            assert list(ours) == got and len(ours) == len(got)
        with pytest.raises(ValueError):
            ours.skip(len(theirs) + 1)
    # All ranks stride through one permutation per epoch, and it changes with the epoch.
    orders = {}
    for epoch, shards in perms.items():
        interleaved = [shard[j] for j in range(len(shards[0])) for shard in shards]
        usable = n - n % world_size if drop_last else n
        assert sorted(interleaved[:usable]) == sorted(set(interleaved[:usable]))
        orders[epoch] = interleaved
    assert orders[0] != orders[1] != orders[2]


@pytest.mark.parametrize("n", [0, 1, 7, 10, 11])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_exact_shard_sampler_covers_every_index_once(n, world_size):
    shards = [list(ExactShardSampler(n, r, world_size)) for r in range(world_size)]
    assert sorted(i for shard in shards for i in shard) == list(range(n))
    assert [len(ExactShardSampler(n, r, world_size)) for r in range(world_size)] == list(
        map(len, shards)
    )
    assert max(map(len, shards)) - min(map(len, shards)) <= 1
    assert shards[0] == list(range(0, n, world_size))


# --- loaders --------------------------------------------------------------------------------


def index_splits(n: int) -> DataSplits:
    indices = fx.IndexDataset(n)
    return DataSplits(indices, indices, num_classes=2, in_channels=1, image_size=1)


def global_batches(n: int, world_size: int, batch_size: int, epoch: int = 1) -> list[list[int]]:
    per_rank = []
    for rank in range(world_size):
        loaders = build_loaders(
            index_splits(n),
            batch_size=batch_size,
            eval_batch_size=2,
            rank=rank,
            world_size=world_size,
            seed=3,
        )
        loaders.train_sampler.set_epoch(epoch)
        per_rank.append([batch.tolist() for batch in loaders.train])
        assert len(per_rank[-1]) == len(loaders.train)
    assert len({len(batches) for batches in per_rank}) == 1  # ranks step together
    return [sorted(sum((b[k] for b in per_rank), [])) for k in range(len(per_rank[0]))]


@pytest.mark.parametrize("n", [11, 12, 13, 14])
def test_same_global_batches_for_any_world_size(n):
    for world_size in (2, 3):
        for batch_size in (1, 2, 3):
            single = global_batches(n, 1, world_size * batch_size)
            assert global_batches(n, world_size, batch_size) == single, (world_size, batch_size)


def test_val_loader_sees_each_sample_once_across_ranks():
    seen = []
    for rank in range(3):
        loaders = build_loaders(
            index_splits(11), batch_size=2, eval_batch_size=2, rank=rank, world_size=3, seed=0
        )
        assert loaders.val.drop_last is False and loaders.train.drop_last is True
        seen += [i for batch in loaders.val for i in batch.tolist()]
    assert sorted(seen) == list(range(11))


class RandomDataset(Dataset):
    """Reports the state of every RNG a worker has: python, numpy, torch."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, key):
        return torch.tensor([random.random(), np.random.random(), torch.rand(()).item()])


def test_workers_are_seeded_from_seed_and_rank():
    def draws(rank: int, seed: int) -> torch.Tensor:
        splits = DataSplits(RandomDataset(), RandomDataset(), 2, 1, 1)
        loaders = build_loaders(
            splits,
            batch_size=1,
            eval_batch_size=1,
            rank=rank,
            world_size=2,
            seed=seed,
            num_workers=2,
            pin_memory=False,
        )
        assert loaders.train.persistent_workers and loaders.train.num_workers == 2
        assert isinstance(loaders.train.sampler, ResumableDistributedSampler)
        assert loaders.train.sampler is loaders.train_sampler
        assert isinstance(loaders.val.sampler, ExactShardSampler)
        loaders.train_sampler.set_epoch(0)
        return torch.cat(list(loaders.train))  # batch k comes from worker k % 2

    a = draws(rank=0, seed=1)
    assert torch.equal(a, draws(rank=0, seed=1))
    assert not torch.equal(a, draws(rank=1, seed=1))
    assert not torch.equal(a, draws(rank=0, seed=2))
    assert (a[0] != a[1]).all()  # the two workers differ in every RNG


# --- augmentation determinism ---------------------------------------------------------------


def test_augmentation_depends_only_on_seed_epoch_and_index(cifar_root):
    root, _ = cifar_root
    crop_flip = fx.recipe("dataset=cifar10")
    splits = build_datasets(dataset_cfg(name="cifar10", root=str(root)), seed=3, augment=crop_flip)
    epoch = 2
    expected = [splits.train[(epoch, i)][0] for i in range(len(splits.train))]

    # Any rank, world size, worker count or resume point yields those same tensors.
    for world_size, rank, workers, skip in [(1, 0, 0, 0), (1, 0, 2, 8), (2, 1, 2, 0), (3, 2, 0, 5)]:
        loaders = build_loaders(
            splits,
            batch_size=4,
            eval_batch_size=4,
            rank=rank,
            world_size=world_size,
            seed=7,
            num_workers=workers,
        )
        loaders.train_sampler.set_epoch(epoch)
        loaders.train_sampler.skip(skip)
        keys = list(loaders.train_sampler)
        images = torch.cat([x for x, _ in loaders.train])
        assert len(images) >= 16
        for (key_epoch, i), image in zip(keys, images, strict=False):
            assert key_epoch == epoch and torch.equal(image, expected[i])

    # The augmentation is random: it changes with the epoch and with the seed ...
    other_epoch = sum(
        not torch.equal(splits.train[(epoch + 1, i)][0], expected[i]) for i in range(20)
    )
    assert other_epoch >= 15
    reseeded = build_datasets(
        dataset_cfg(name="cifar10", root=str(root)), seed=4, augment=crop_flip
    )
    assert sum(not torch.equal(reseeded.train[(epoch, i)][0], expected[i]) for i in range(20)) >= 15
    # ... and leaves the caller's RNG stream alone.
    torch.manual_seed(0)
    before = torch.rand(3)
    torch.manual_seed(0)
    splits.train[(epoch, 0)]
    assert torch.equal(torch.rand(3), before)


# --- download once per node -----------------------------------------------------------------


def test_download_once_helper_order_and_errors():
    def run(local_rank: int, download: bool, fail: bool = False) -> list:
        events = []

        def build(dl: bool):
            events.append(("build", dl))
            if fail:
                raise RuntimeError("boom")
            return dl

        def barrier():
            events.append("barrier")

        try:
            result = _download_once_then_load(
                build, download=download, local_rank=local_rank, barrier=barrier
            )
            events.append(("result", result))
        except RuntimeError:
            events.append("raised")
        return events

    assert run(0, True) == [("build", True), "barrier", ("result", True)]
    assert run(1, True) == ["barrier", ("build", False), ("result", False)]
    assert run(0, False) == [("build", False), ("result", False)]
    # A failing download still reaches the barrier, so the other ranks are not left waiting.
    assert run(0, True, fail=True) == [("build", True), "barrier", "raised"]


class SlowMirror(SimpleHTTPRequestHandler):
    """Serves a directory slowly, so a rank that did not wait would find the files missing."""

    def do_GET(self):
        time.sleep(0.3)
        super().do_GET()

    def log_message(self, *args):
        pass


@pytest.mark.slow
def test_download_happens_once_per_node_under_torchrun(two_ranks, tmp_path):
    """Two ranks of one node (tests/rank_pool.py, torchrun's variables): rank 0 downloads,
    rank 1 waits at the barrier, then both load."""
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    sums = fx.make_mnist_mirror(mirror)
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(SlowMirror, directory=mirror))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/"
    log = tmp_path / "log.txt"
    no_proxy = "127.0.0.1,localhost"
    try:
        args = (str(tmp_path / "data"), url, json.dumps(sums), str(log))
        two_ranks.run(fx.download_once_rank, *args, no_proxy=no_proxy, NO_PROXY=no_proxy)
    finally:
        server.shutdown()
    lines = log.read_text().splitlines()
    fetches = sorted(line for line in lines if "loaded" not in line)
    assert fetches == sorted(f"0 {url}{name}" for name in sums)  # rank 0 only, each file once
    assert sorted(line for line in lines if "loaded" in line) == [
        "0 loaded 270 30 100",  # val: 10% of the 300 training samples
        "1 loaded 270 30 100",
    ]


# --- splits across ranks and epochs ---------------------------------------------------------


@pytest.mark.parametrize("name", ["digits", "mnist"])
def test_training_never_sees_val_or_test_and_splits_match_on_every_rank(tmp_path, name):
    """Every sample a train batch holds, over epochs, ranks and world sizes, is a train sample
    (by its index in the set it was carved from); val and test are disjoint from it and the
    same whatever the rank, the local rank or the seed."""
    keys = {} if name == "digits" else {"root": str(tmp_path)}
    if name == "mnist":
        fx.make_mnist(tmp_path, n_train=300, n_test=100)
    splits = build_datasets(dataset_cfg(name, **keys), seed=0)
    train_ids = ids(splits.train)

    def source(ds) -> object:  # which file a split indexes: MNIST's train or test, or digits
        view = ds.dataset if isinstance(ds, EpochSeededDataset) else ds  # a SplitView
        base, _ = unwrap(view.dataset)
        return getattr(base, "train", "scans")

    held = {
        s: {(source(getattr(splits, s)), i) for i in ids(getattr(splits, s))}
        for s in ("val", "test")
    }
    for world_size in (1, 2):
        seen = set()
        for rank in range(world_size):
            other = build_datasets(dataset_cfg(name, **keys), seed=rank + 5, local_rank=rank)
            assert [ids(getattr(other, s)) for s in ("train", "val", "test")] == [
                train_ids,
                ids(splits.val),
                ids(splits.test),
            ]
            loaders = build_loaders(
                other,
                batch_size=16,
                eval_batch_size=8,
                rank=rank,
                world_size=world_size,
                seed=3,
                fast=True,
            )
            for epoch in range(3):
                loaders.train_sampler.set_epoch(epoch)
                seen |= {
                    (source(other.train), train_ids[i])
                    for batch in loaders.step_indices()
                    for i in batch
                }
        assert seen <= {(source(splits.train), i) for i in train_ids}
        assert len(seen) > 0.9 * len(train_ids)
        assert not seen & held["val"] and not seen & held["test"]
    if name == "mnist":  # val is carved from the training file, test is the test file
        assert {source(splits.train), source(splits.val), source(splits.test)} == {True, False}
        assert held["test"] == {(False, i) for i in range(100)}
