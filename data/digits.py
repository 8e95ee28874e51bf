"""scikit-learn's 8x8 handwritten digits as a torchvision VisionDataset (no download, no files)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from PIL import Image
from torchvision.datasets import VisionDataset

# The train/val split never depends on the run's seed, so validation numbers stay comparable
# across runs and sweeps.
SPLIT_SEED = 0


class Digits(VisionDataset):
    """The 1797 real 8x8 scans of ``sklearn.datasets.load_digits``, as ``(PIL "L" image, label)``.

    Pixels 0..16 are scaled to uint8 0..255 (``data``, like MNIST's). The digits set has no
    official split: ``val_fraction`` of it is held out by a stratified split with the fixed
    ``SPLIT_SEED``. ``root`` is unused (kept for the VisionDataset signature).
    """

    classes = [str(i) for i in range(10)]

    def __init__(
        self,
        root: Any = None,
        train: bool = True,
        transform: Callable | None = None,
        target_transform: Callable | None = None,
        val_fraction: float = 0.2,
    ) -> None:
        super().__init__(root, transform=transform, target_transform=target_transform)
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        self.train = train
        self.val_fraction = val_fraction
        # Imported here: scikit-learn is slow to import and only this dataset needs it.
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        bunch = load_digits()
        images = np.rint(bunch.images * (255.0 / 16.0)).astype(np.uint8)
        targets = bunch.target.astype(np.int64)
        train_idx, val_idx = train_test_split(
            np.arange(len(targets)),
            test_size=val_fraction,
            stratify=targets,
            random_state=SPLIT_SEED,
        )
        idx = np.sort(train_idx if train else val_idx)
        self.data = torch.from_numpy(images[idx])
        self.targets = torch.from_numpy(targets[idx])

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

    def extra_repr(self) -> str:
        return f"Split: {'train' if self.train else 'val'} (val_fraction={self.val_fraction})"
