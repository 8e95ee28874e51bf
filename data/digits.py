"""scikit-learn's 8x8 handwritten digits as a torchvision VisionDataset (no download, no files)."""

from __future__ import annotations

import gzip
import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torchvision.datasets import VisionDataset


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """``sklearn.datasets.load_digits()``'s ``images`` [1797, 8, 8] (float64, 0..16) and
    ``target``, read from the file it reads (scikit-learn's datasets/data/digits.csv.gz, found
    without importing scikit-learn, whose import takes 1-2 s of every run's startup); through
    scikit-learn itself where that file is not where it used to be."""
    spec = importlib.util.find_spec("sklearn")  # finds the package, does not import it
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    path = next(
        (
            Path(f, "datasets", "data", "digits.csv.gz")
            for f in folders
            if Path(f, "datasets", "data", "digits.csv.gz").is_file()
        ),
        None,
    )
    if path is None:
        from sklearn import datasets

        bunch = datasets.load_digits()
        return bunch.images, bunch.target
    with gzip.open(path, mode="rt", encoding="utf-8") as f:
        rows = np.loadtxt(f, delimiter=",")  # what load_digits does: 64 pixels, then the label
    return rows[:, :-1].reshape(-1, 8, 8), rows[:, -1].astype(int)


class Digits(VisionDataset):
    """The 1797 real 8x8 scans of ``sklearn.datasets.load_digits``, as ``(PIL "L" image, label)``.

    Pixels 0..16 are scaled to uint8 0..255 (``data``, like MNIST's); ``targets`` are the labels.
    The set has no official split: data.catalog.digits partitions it into train/val/test.
    ``root`` is unused (kept for the VisionDataset signature).
    """

    classes = [str(i) for i in range(10)]

    def __init__(
        self,
        root: Any = None,
        transform: Callable | None = None,
        target_transform: Callable | None = None,
    ) -> None:
        super().__init__(root, transform=transform, target_transform=target_transform)
        images, labels = load_digits()
        self.data = torch.from_numpy(np.rint(images * (255.0 / 16.0)).astype(np.uint8))
        self.targets = torch.from_numpy(labels.astype(np.int64))

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        img = Image.fromarray(self.data[index].numpy())  # 2-D uint8 -> mode "L"
        target = int(self.targets[index])
        if self.transform is not None:
            img = self.transform(img)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return img, target

    def __len__(self) -> int:
        return len(self.data)
