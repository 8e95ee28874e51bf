"""data/: datasets from files in their real formats, samplers, loaders, seeding, download-once."""

from __future__ import annotations

import functools
import json
import os
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
from omegaconf import OmegaConf
from torch.utils.data import Dataset, DistributedSampler
from torchvision import datasets as tvd

from components.errors import UserError
from conf.schema import DatasetConfig
from data import (
    DataSplits,
    ExactShardSampler,
    ResumableDistributedSampler,
    build_datasets,
    build_loaders,
)
from data.datasets import DATASETS, _download_once_then_load
from data.transforms import NORMALIZATION
from tests import helpers as fx

REPO = Path(__file__).resolve().parents[1]


def dataset_cfg(**overrides):
    """The `dataset` group as Hydra hands it over: the structured schema plus overrides."""
    return OmegaConf.structured(DatasetConfig(**overrides))


def to_uint8(x: torch.Tensor, name: str) -> torch.Tensor:
    """Undo Normalize and ToDtype(scale=True): back to the stored 0..255 pixels (CHW)."""
    mean, std = (torch.tensor(v).view(-1, 1, 1) for v in NORMALIZATION[name])
    return ((x * std + mean) * 255).round().to(torch.uint8)


# --- digits -------------------------------------------------------------------------------


def test_digits_shapes_classes_and_split_sizes():
    splits = build_datasets(dataset_cfg(name="digits"))
    assert (splits.num_classes, splits.in_channels, splits.image_size) == (10, 1, 8)
    assert len(splits.train) + len(splits.val) == 1797
    assert len(splits.val) == 360  # ceil(0.2 * 1797)
    x, y = splits.train[0]
    assert x.shape == (1, 8, 8) and x.dtype == torch.float32 and isinstance(y, int)
    assert torch.equal(splits.train[(0, 0)][0], x)  # a bare index is epoch 0
    xv, yv = splits.val[5]
    assert xv.shape == (1, 8, 8) and xv.dtype == torch.float32 and 0 <= yv < 10


def test_digits_split_is_a_fixed_stratified_partition_of_the_real_scans():
    from sklearn.datasets import load_digits

    bunch = load_digits()
    scans = np.rint(bunch.images * 255 / 16).astype(np.uint8)
    first = build_datasets(dataset_cfg(name="digits"), seed=1, augment=fx.recipe())
    second = build_datasets(dataset_cfg(name="digits"), seed=2, augment=fx.recipe())
    val_a = torch.stack([first.val[i][0] for i in range(len(first.val))])
    val_b = torch.stack([second.val[i][0] for i in range(len(second.val))])
    assert torch.equal(val_a, val_b)
    assert torch.equal(first.val.targets, second.val.targets)
    # Pixels and labels round-trip: every val tensor is a real scan, with that scan's label.
    labels_of = {}
    for image, label in zip(scans, bunch.target, strict=True):
        labels_of.setdefault(image.tobytes(), set()).add(int(label))
    for i in range(0, len(first.val), 37):
        x, y = first.val[i]
        assert y in labels_of[to_uint8(x, "digits").numpy().tobytes()]
    # Train and val partition the 1797 scans; each class is ~20% held out.
    both = torch.cat([first.train.dataset.data, first.val.data]).numpy()
    assert sorted(map(bytes, both)) == sorted(map(bytes, scans))
    counts = np.bincount(first.val.targets.numpy(), minlength=10)
    assert counts.min() >= 35 and counts.max() <= 37


@pytest.mark.parametrize("fraction", [0.0, 1.0, 0.001])
def test_digits_bad_val_fraction_is_user_error(fraction):
    with pytest.raises(UserError, match="dataset.val_fraction"):
        build_datasets(dataset_cfg(name="digits", val_fraction=fraction))


# --- file-backed datasets -----------------------------------------------------------------


@pytest.mark.parametrize("name, folder", [("mnist", "MNIST"), ("fashion_mnist", "FashionMNIST")])
def test_mnist_like_round_trip(tmp_path, name, folder):
    data = fx.make_mnist(tmp_path, folder, n_train=300, n_test=100)
    splits = build_datasets(dataset_cfg(name=name, root=str(tmp_path)))
    assert (splits.num_classes, splits.in_channels, splits.image_size) == (10, 1, 28)
    assert (len(splits.train), len(splits.val)) == (300, 100)
    for train, ds in ((True, splits.train), (False, splits.val)):
        images, labels = data[train]
        for i in (0, 41, len(labels) - 1):
            x, y = ds[i]
            assert x.shape == (1, 28, 28) and x.dtype == torch.float32
            assert y == labels[i]
            assert torch.equal(to_uint8(x, name)[0], torch.from_numpy(images[i]))


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
    splits = build_datasets(dataset_cfg(name=name, root=str(root)))
    assert (splits.num_classes, splits.in_channels, splits.image_size) == (classes, 3, 32)
    n_train = 100 if classes == 10 else 20  # 5 batches of 20, or one "train" file of 20
    assert (len(splits.train), len(splits.val)) == (n_train, 20)
    for train, ds in ((True, splits.train), (False, splits.val)):
        images, labels = data[classes][train]
        for i in (0, 13, len(labels) - 1):
            x, y = ds[i]
            assert x.shape == (3, 32, 32) and y == labels[i]
            assert torch.equal(to_uint8(x, name), torch.from_numpy(images[i]).permute(2, 0, 1))


def test_imagefolder_round_trip(tmp_path):
    fx.make_imagefolder(tmp_path)
    splits = build_datasets(dataset_cfg(name="imagefolder", root=str(tmp_path), image_size=16))
    assert (splits.num_classes, splits.in_channels, splits.image_size) == (3, 3, 16)
    assert (len(splits.train), len(splits.val)) == (9, 6)
    for ds, per_class in ((splits.train, 3), (splits.val, 2)):
        for i in range(len(ds)):
            x, y = ds[(1, i)] if ds is splits.train else ds[i]
            assert x.shape == (3, 16, 16) and x.dtype == torch.float32
            cls = sorted(fx.COLORS)[i // per_class]  # ImageFolder: sorted class folders
            assert y == i // per_class
            # Solid colours survive any crop/resize/flip, up to rounding.
            expected = torch.tensor(fx.COLORS[cls]).view(3, 1, 1).expand(3, 16, 16)
            assert (to_uint8(x, "imagefolder").int() - expected).abs().max() <= 1


def test_imagefolder_with_different_class_folders_is_user_error(tmp_path):
    fx.make_imagefolder(tmp_path)
    shutil.rmtree(tmp_path / "val" / "emu")
    with pytest.raises(UserError, match="emu"):
        build_datasets(dataset_cfg(name="imagefolder", root=str(tmp_path)))


def test_fake(tmp_path):
    cfg = dataset_cfg(name="fake", root=str(tmp_path), size=50, image_size=12, num_classes=7)
    splits = build_datasets(cfg)
    assert (splits.num_classes, splits.in_channels, splits.image_size) == (7, 3, 12)
    assert (len(splits.train), len(splits.val)) == (50, 10)
    x, _ = splits.train[0]
    assert x.shape == (3, 12, 12) and x.dtype == torch.float32
    assert {splits.train[i][1] for i in range(50)} <= set(range(7))
    # The val images are not copies of the first train images.
    assert not any(torch.equal(splits.val[i][0], splits.train[i][0]) for i in range(10))


# --- user errors ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["mnist", "fashion_mnist", "cifar10", "cifar100", "imagenet", "imagefolder"]
)
def test_missing_data_offline_is_one_line_user_error(tmp_path, name):
    root = tmp_path / "nowhere"
    with pytest.raises(UserError) as info:
        build_datasets(dataset_cfg(name=name, root=str(root), download=False))
    message = str(info.value)
    assert str(root) in message and "dataset.download" in message and "\n" not in message


def test_failed_download_is_user_error(tmp_path, monkeypatch):
    monkeypatch.setattr(tvd.MNIST, "mirrors", ["http://127.0.0.1:9/"])  # nothing listens there
    with pytest.raises(UserError, match="dataset.download=false") as info:
        build_datasets(dataset_cfg(name="mnist", root=str(tmp_path), download=True))
    assert str(tmp_path) in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("name", ["imagenet", "imagefolder"])
def test_manual_datasets_refuse_download(tmp_path, name):
    with pytest.raises(UserError, match="manually"):
        build_datasets(dataset_cfg(name=name, root=str(tmp_path), download=True))


def test_imagefolder_without_root_is_user_error():
    with pytest.raises(UserError, match="dataset.root"):
        build_datasets(dataset_cfg(name="imagefolder", root="???"))


def test_unknown_name_lists_known_names():
    with pytest.raises(UserError, match="unknown dataset.name='mnsit'") as info:
        build_datasets(dataset_cfg(name="mnsit"))
    assert all(name in str(info.value) for name in DATASETS)


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
            index_splits(n), batch_size=batch_size, eval_batch_size=2, rank=rank,
            world_size=world_size, seed=3,
        )  # fmt: skip
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
            splits, batch_size=1, eval_batch_size=1, rank=rank, world_size=2, seed=seed,
            num_workers=2, pin_memory=False,
        )  # fmt: skip
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
    splits = build_datasets(dataset_cfg(name="cifar10", root=str(root)), seed=3,
                            augment=crop_flip)  # fmt: skip
    epoch = 2
    expected = [splits.train[(epoch, i)][0] for i in range(len(splits.train))]

    # Any rank, world size, worker count or resume point yields those same tensors.
    for world_size, rank, workers, skip in [(1, 0, 0, 0), (1, 0, 2, 8), (2, 1, 2, 0), (3, 2, 0, 5)]:
        loaders = build_loaders(
            splits, batch_size=4, eval_batch_size=4, rank=rank, world_size=world_size, seed=7,
            num_workers=workers,
        )  # fmt: skip
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
    reseeded = build_datasets(dataset_cfg(name="cifar10", root=str(root)), seed=4,
                              augment=crop_flip)  # fmt: skip
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
def test_download_happens_once_per_node_under_torchrun(tmp_path):
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    sums = fx.make_mnist_mirror(mirror)
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(SlowMirror, directory=mirror))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/"
    log = tmp_path / "log.txt"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.update(no_proxy="127.0.0.1,localhost", NO_PROXY="127.0.0.1,localhost")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        fx.__file__, "download-once", str(tmp_path / "data"), url, json.dumps(sums), str(log),
    ]  # fmt: skip
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    finally:
        server.shutdown()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = log.read_text().splitlines()
    fetches = sorted(line for line in lines if "loaded" not in line)
    assert fetches == sorted(f"0 {url}{name}" for name in sums)  # rank 0 only, each file once
    assert sorted(line for line in lines if "loaded" in line) == [
        "0 loaded 300 100",
        "1 loaded 300 100",
    ]
