"""A folder of unlabeled images to predict on (eval.py split=<folder>)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from ddp_launcher import UserError
from PIL import Image
from torch.utils.data import Dataset
from torchvision.datasets.folder import IMG_EXTENSIONS
from torchvision.transforms import v2

UNLABELED = -1  # the label of every item


class ImageFiles(Dataset):
    """Every image file under ``folder`` (any depth, sorted by path) as ``(x, -1)``: converted
    to the model's channels (grayscale or RGB), passed through the dataset's eval transform,
    and resized to ``image_size`` x ``image_size`` where the transform leaves another size."""

    def __init__(
        self, folder: str | Path, transform: Callable | None, in_channels: int, image_size: int
    ) -> None:
        self.folder = Path(folder).expanduser().resolve()
        if not self.folder.is_dir():
            raise UserError(
                f"split={folder} is not train, val, test or a folder: point split= "
                "at a folder of images, or name a split"
            )
        self.files = sorted(
            p for p in self.folder.rglob("*") if p.is_file() and p.suffix.lower() in IMG_EXTENSIONS
        )
        if not self.files:
            raise UserError(
                f"no images in {self.folder} (looked for "
                f"{', '.join(IMG_EXTENSIONS)} files): point split= at a folder of "
                "images"
            )
        self.transform = transform
        self.mode = "L" if in_channels == 1 else "RGB"
        self.image_size = image_size

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        with Image.open(self.files[index]) as image:
            image = image.convert(self.mode)
        if self.transform is not None:
            x = self.transform(image)
        else:
            x = v2.functional.to_dtype(v2.functional.to_image(image), torch.float32, scale=True)
        if tuple(x.shape[-2:]) != (self.image_size, self.image_size):
            x = v2.functional.resize(x, [self.image_size, self.image_size], antialias=True)
        return x, UNLABELED

    def sample_ids(self) -> list[str]:
        return [str(f) for f in self.files]
