"""A dataset of your own, not in torchvision: one function (here) and one YAML
(data/example/conf/dataset/shapes.yaml). No registry to edit:

    python train.py --config-dir data/example/conf dataset=shapes
    python train.py --config-dir data/example/conf dataset=shapes dataset.n_train=5000

Grayscale images of a filled circle, square or triangle at a random place and size, drawn
with PIL from a seed: the same images on every machine, no files, no network.
"""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image, ImageDraw
from torch.utils.data import Dataset
from torchvision.transforms import v2

from data import DataSource, FastPath, carve_val

CLASSES = ("circle", "square", "triangle")


class Shapes(Dataset):
    """``n`` images as ``(PIL "L" image, label)``. Keeping them as uint8 ``data`` [N, H, W] and
    ``targets`` gives stratified val carving and the in-memory fast path for free."""

    def __init__(self, n: int, size: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.targets = rng.integers(0, len(CLASSES), n).tolist()
        self.data = torch.from_numpy(np.stack([draw(k, size, rng) for k in self.targets]))

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[Image.Image, int]:
        return Image.fromarray(self.data[index].numpy()), self.targets[index]


def draw(kind: int, size: int, rng: np.random.Generator) -> np.ndarray:
    image = Image.new("L", (size, size), 0)
    r = rng.uniform(size / 6, size / 3)  # half the shape's extent
    x, y = rng.uniform(r, size - r, 2)
    pen = ImageDraw.Draw(image)
    if CLASSES[kind] == "circle":
        pen.ellipse((x - r, y - r, x + r, y + r), fill=255)
    elif CLASSES[kind] == "square":
        pen.rectangle((x - r, y - r, x + r, y + r), fill=255)
    else:
        pen.polygon([(x, y - r), (x - r, y + r), (x + r, y + r)], fill=255)
    return np.asarray(image)


def shapes(
    n_train: int = 1200, n_test: int = 300, image_size: int = 16, val_fraction: float = 0.1
) -> DataSource:
    """The dataset target: its arguments are the YAML's keys."""
    train, val = carve_val(Shapes(n_train, image_size, seed=0), val_fraction)
    test = Shapes(n_test, image_size, seed=1)  # never seen in training
    to_tensor = v2.Compose(
        [v2.ToImage(), v2.ToDtype(torch.float32, scale=True), v2.Normalize([0.5], [0.5])]
    )
    return DataSource(
        train,
        val,
        test,
        num_classes=len(CLASSES),
        in_channels=1,
        image_size=image_size,
        train_transform=to_tensor,
        eval_transform=to_tensor,
        classes=CLASSES,
        fast=FastPath(mean=(0.5,), std=(0.5,)),
    )
