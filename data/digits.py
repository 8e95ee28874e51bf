"""scikit-learn's 8x8 handwritten digits as a torchvision VisionDataset (no download, no files)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from PIL import Image
from torchvision.datasets import VisionDataset


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
        # Imported here: scikit-learn is slow to import and only this dataset needs it.
        from sklearn.datasets import load_digits

        bunch = load_digits()
        self.data = torch.from_numpy(np.rint(bunch.images * (255.0 / 16.0)).astype(np.uint8))
        self.targets = torch.from_numpy(bunch.target.astype(np.int64))

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
