"""Small datasets written in the real on-disk formats torchvision reads (no network needed).

Also runnable under torchrun as the worker of the download-once test:
    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/data_fixtures.py \
        download-once <root> <mirror url> <md5 json> <log file>
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import pickle
import shutil
import struct
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from PIL import Image
from torch.utils.data import Dataset

MNIST_FILES = {
    True: ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    False: ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


def md5(path: str | os.PathLike) -> str:
    return hashlib.md5(Path(path).read_bytes()).hexdigest()


def write_idx(path: Path, array: np.ndarray) -> None:
    """IDX format (yann.lecun.com/exdb/mnist): magic 0x0000 08 <ndim>, big-endian int32 dims."""
    array = np.ascontiguousarray(array, dtype=np.uint8)
    header = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    path.write_bytes(header + array.tobytes())


def make_mnist(root: Path, folder: str = "MNIST", n_train: int = 300, n_test: int = 100):
    """<root>/<folder>/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte with random content.

    Returns {train: (images, labels)} for train=True/False.
    """
    raw = root / folder / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    out = {}
    for train, n in ((True, n_train), (False, n_test)):
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, size=n, dtype=np.uint8)
        image_file, label_file = MNIST_FILES[train]
        write_idx(raw / image_file, images)
        write_idx(raw / label_file, labels)
        out[train] = (images, labels)
    return out


def make_mnist_mirror(directory: Path) -> dict[str, str]:
    """Gzipped MNIST files as served by a mirror; returns {file name: md5} (MNIST.resources)."""
    make_mnist(directory / "build")
    raw = directory / "build" / "MNIST" / "raw"
    sums = {}
    for name in MNIST_FILES[True] + MNIST_FILES[False]:
        with open(raw / name, "rb") as src, gzip.open(directory / f"{name}.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        sums[f"{name}.gz"] = md5(directory / f"{name}.gz")
    shutil.rmtree(directory / "build")
    return sums


def _pickle(path: Path, obj: dict) -> str:
    with open(path, "wb") as f:
        pickle.dump(obj, f)
    return md5(path)


def make_cifar(root: Path, classes: int = 10, n_per_batch: int = 20):
    """cifar-10-batches-py (5 train batches + test_batch + batches.meta) or, for 100 classes,
    cifar-100-python (train, test, meta), as pickled dicts of uint8 rows (3x32x32, CHW).

    Returns (data, md5s): data[train] = (images NHWC, labels); md5s = the class attributes
    train_list, test_list and meta torchvision checks, with the md5 of the files written here.
    """
    rng = np.random.default_rng(1)
    if classes == 10:
        folder, label_key = root / "cifar-10-batches-py", "labels"
        train_files, test_files = [f"data_batch_{i}" for i in range(1, 6)], ["test_batch"]
        meta = {"filename": "batches.meta", "key": "label_names"}
    else:
        folder, label_key = root / "cifar-100-python", "fine_labels"
        train_files, test_files = ["train"], ["test"]
        meta = {"filename": "meta", "key": "fine_label_names"}
    folder.mkdir(parents=True, exist_ok=True)
    data, lists = {}, {}
    for train, files in ((True, train_files), (False, test_files)):
        rows, labels, entries = [], [], []
        for name in files:
            batch = rng.integers(0, 256, size=(n_per_batch, 3 * 32 * 32), dtype=np.uint8)
            batch_labels = rng.integers(0, classes, size=n_per_batch).tolist()
            entry = {"batch_label": name, "data": batch, label_key: batch_labels}
            entries.append([name, _pickle(folder / name, entry)])
            rows.append(batch)
            labels += batch_labels
        images = np.concatenate(rows).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
        data[train] = (images, labels)
        lists["train_list" if train else "test_list"] = entries
    names = {meta["key"]: [f"class_{i}" for i in range(classes)]}
    lists["meta"] = {**meta, "md5": _pickle(folder / meta["filename"], names)}
    return data, lists


COLORS = {"cat": (200, 10, 30), "dog": (5, 120, 250), "emu": (90, 90, 90)}


def make_imagefolder(root: Path, per_class: dict[str, int] | None = None, size=(40, 30)):
    """<root>/{train,val}/<class>/<i>.png, each image one solid colour per class (COLORS)."""
    per_class = per_class or {"train": 3, "val": 2}
    for split, n in per_class.items():
        for cls, color in COLORS.items():
            (root / split / cls).mkdir(parents=True, exist_ok=True)
            for i in range(n):
                Image.new("RGB", size, color).save(root / split / cls / f"{i}.png")


def _download_once_worker(root: str, mirror: str, sums_json: str, log: str) -> None:
    """One torchrun rank: build MNIST with download=true through build_datasets."""
    import torch.distributed as dist
    from torchvision.datasets import mnist

    from data import build_datasets

    sums = json.loads(sums_json)
    mnist.MNIST.mirrors = [mirror]
    mnist.MNIST.resources = [(name, sums[name]) for name, _ in mnist.MNIST.resources]
    rank = int(os.environ["RANK"])
    real_download = mnist.download_and_extract_archive

    def logged_download(url, *args, **kwargs):  # spy: records who fetched what, then fetches
        with open(log, "a") as f:
            f.write(f"{rank} {url}\n")
        return real_download(url, *args, **kwargs)

    mnist.download_and_extract_archive = logged_download

    dist.init_process_group("gloo")
    try:
        cfg = SimpleNamespace(name="mnist", root=root, download=True, augment=False, image_size=28)
        splits = build_datasets(cfg, local_rank=int(os.environ["LOCAL_RANK"]), barrier=dist.barrier)
        with open(log, "a") as f:
            f.write(f"{rank} loaded {len(splits.train)} {len(splits.val)}\n")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1] == "download-once":
        _download_once_worker(*sys.argv[2:6])
    else:
        raise SystemExit(f"unknown command {sys.argv[1]!r}")


class IndexDataset(Dataset):
    """Returns the index it was asked for (from an (epoch, index) key or a bare index): a
    loader over it shows which indices each batch holds."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, key):
        return key[1] if isinstance(key, tuple) else key
