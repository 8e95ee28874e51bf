"""Image files as uint8 tensors: read the bytes in the dataset, decode in the loader.

The file-based sets (imagefolder, imagenet: data/catalog.py) read each file's bytes
(``read_bytes``, the ImageFolder loader) and start their transforms with ``DecodeImage``:
libjpeg-turbo through ``torchvision.io.decode_jpeg`` (PNG, GIF, WebP through
``decode_image``; anything else through PIL), then the v2 recipe on the uint8 tensor and
normalisation once per batch (data.transforms.split_stages). Against PIL + v2 per sample:
the decoded pixels are the same (both libjpeg-turbo, same IDCT and upsampling), the tensor
resize differs by at most 1 of 255 on some pixels (torchvision's uint8 kernel vs PIL's), and
the whole path costs about half as much per image (README, Benchmark).

On a GPU, where the recipe's geometry allows it (``device_stages``), the workers only read the
bytes and draw the random parameters (the same draws, from the same seeded RNG, as the CPU
path); the batch is decoded on the device (nvjpeg, ``decode_jpeg(list, device=...)``) and
cropped, resized, flipped and normalised there with the same v2 kernels.
"""

from __future__ import annotations

import io
import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from PIL import Image
from torchvision.io import ImageReadMode, decode_image, decode_jpeg
from torchvision.transforms import v2

from data.transforms import BatchStage, Stages, split_stages

# torchvision 0.29 deprecates its decoders in favour of TorchCodec, which this project does not
# install; they warn on every call (once per image) otherwise.
warnings.filterwarnings(
    "ignore",
    message="The image decoding and encoding capabilities of TorchVision are deprecated",
    category=DeprecationWarning,
)

_JPEG_MAGIC = b"\xff\xd8\xff"
_DECODABLE = (b"\x89PNG", b"GIF8", b"RIFF")  # decode_image's other formats (WebP: RIFF....WEBP)


def read_bytes(path: str) -> torch.Tensor:
    """A file's bytes as a 1-D uint8 tensor: the loader of the file-based sets' ImageFolder
    (one read into a buffer of the file's size: about half np.fromfile's cost per file)."""
    with open(path, "rb", buffering=0) as f:
        data = bytearray(os.fstat(f.fileno()).st_size)
        f.readinto(data)
    return torch.frombuffer(data, dtype=torch.uint8)


def looks_readable(path: str) -> bool:
    """A cheap check of an image file (its size, header and last bytes, not its pixels): not
    empty, an image format PIL knows, and a JPEG or PNG not cut short (its end marker there)."""
    try:
        with Image.open(path) as image:
            kind = image.format
        with open(path, "rb") as f:
            f.seek(-12, os.SEEK_END)
            tail = f.read()
    except (OSError, ValueError, SyntaxError):  # PIL's errors for files it cannot identify
        return False
    if kind == "JPEG":
        return tail.rstrip(b"\0").endswith(b"\xff\xd9")
    if kind == "PNG":
        return tail[4:8] == b"IEND"
    return True


def is_jpeg(data: torch.Tensor) -> bool:
    return bytes(data[:3].tolist()) == _JPEG_MAGIC


def decode(data: torch.Tensor) -> torch.Tensor:
    """An encoded image (1-D uint8 tensor) as a uint8 RGB ``[3, H, W]`` tensor, as PIL's
    ``Image.open(f).convert("RGB")`` would give it (no EXIF rotation, like ImageFolder's)."""
    head = bytes(data[:4].tolist())
    if head.startswith(_JPEG_MAGIC):
        return decode_jpeg(data, mode=ImageReadMode.RGB)
    if head.startswith(_DECODABLE) and not _damaged_png(data):
        try:
            return decode_image(data, mode=ImageReadMode.RGB)
        except RuntimeError:
            pass  # e.g. a RIFF file that is not WebP: let PIL say what it is
    with Image.open(io.BytesIO(data.numpy().tobytes())) as image:
        return v2.functional.pil_to_tensor(image.convert("RGB"))


def _damaged_png(data: torch.Tensor) -> bool:
    """A PNG without its header chunk first or its end chunk last: libpng would print its
    error to stderr before torchvision raises; PIL says what is wrong in its exception."""
    return bytes(data[:4].tolist()) == b"\x89PNG" and (
        bytes(data[12:16].tolist()) != b"IHDR" or bytes(data[-8:-4].tolist()) != b"IEND"
    )


class DecodeImage:
    """The first transform of a file-based set: bytes -> uint8 ``[3, H, W]``. Anything
    already decoded (a PIL image, e.g. from eval.py's folders, or an image tensor) passes
    through as a tensor, so the same pipeline serves both."""

    deterministic = True  # data.transforms.is_random: draws no random number

    def __call__(self, image: Any) -> Any:
        if isinstance(image, torch.Tensor) and image.ndim == 1:
            return decode(image)
        if isinstance(image, Image.Image):
            return v2.functional.pil_to_tensor(image.convert("RGB"))
        return image

    def __repr__(self) -> str:
        return "DecodeImage()"


def image_size(data: torch.Tensor) -> tuple[int, int]:
    """(height, width) of an encoded image, from its header only."""
    with Image.open(io.BytesIO(data.numpy().tobytes())) as image:
        width, height = image.size
    return height, width


# --- decoding on the device --------------------------------------------------------------------

# Geometry a worker can plan without the pixels: how each transform's output size follows
# from its input size (None: not known without computing it).
_FLIPS = (v2.RandomHorizontalFlip, v2.RandomVerticalFlip)
_SIZED = (v2.RandomResizedCrop, v2.CenterCrop, v2.RandomCrop)  # output: their `size`
_PLANNABLE = (*_FLIPS, *_SIZED, v2.Resize)
_NEEDS_SIZE = (v2.RandomResizedCrop, v2.RandomCrop)  # make_params reads the input size


def _plannable(ops: Sequence[Callable]) -> bool:
    known = True  # the decoded size is read from the header
    for t in ops:
        if type(t) not in _PLANNABLE or (isinstance(t, _NEEDS_SIZE) and not known):
            return False
        if isinstance(t, v2.Resize):
            known = False
        elif isinstance(t, _SIZED):
            known = True
    return True


class PlanGeometry:
    """Sample stage on a device: ``bytes -> (bytes, params)``, the parameters each geometric
    transform would draw, drawn as v2 draws them (same RNG calls, same order), so that the
    device applies exactly what the CPU path would (data.transforms.Stages)."""

    def __init__(self, ops: Sequence[Callable]) -> None:
        self.ops = list(ops)

    def __call__(self, data: torch.Tensor) -> tuple[torch.Tensor, list[dict | None]]:
        height, width = image_size(data)
        plan: list[dict | None] = []
        for t in self.ops:
            if isinstance(t, _FLIPS):  # v2's _RandomApplyTransform.forward
                plan.append(None if torch.rand(1) >= t.p else {})
                continue
            # make_params only reads the input's size: a zero-stride stand-in of that shape
            stand_in = torch.empty((1, 1, 1), dtype=torch.uint8).expand(3, height, width)
            plan.append(t.make_params([stand_in]))
            if isinstance(t, _SIZED):
                height, width = t.size
        return data, plan


def collate_planned(items: list) -> tuple[tuple[list[torch.Tensor], list], torch.Tensor]:
    """Items ``((bytes, plan), label)`` -> ``((bytes list, plans), labels)``."""
    return ([d for (d, _), _ in items], [p for (_, p), _ in items]), torch.as_tensor(
        [label for _, label in items], dtype=torch.int64
    )


class DecodeOnDevice:
    """Batch stage on a device: decode a batch of files there (JPEGs in one batched call),
    apply each image's planned geometry with the v2 kernels, stack, then ``tail`` (to float,
    normalise)."""

    def __init__(self, ops: Sequence[Callable], tail: BatchStage, device: torch.device) -> None:
        self.ops, self.tail, self.device = list(ops), tail, torch.device(device)

    def decode_all(self, datas: list[torch.Tensor]) -> list[torch.Tensor]:
        jpegs = [i for i, d in enumerate(datas) if is_jpeg(d)]
        images: list[torch.Tensor | None] = [None] * len(datas)
        if jpegs:
            decoded = decode_jpeg(
                [datas[i] for i in jpegs], mode=ImageReadMode.RGB, device=self.device
            )
            for i, image in zip(jpegs, decoded, strict=True):
                images[i] = image
        for i, image in enumerate(images):
            if image is None:  # other formats: decoded on the host
                images[i] = decode(datas[i]).to(self.device)
        return images  # type: ignore[return-value]

    def __call__(self, batch: tuple[list[torch.Tensor], list]) -> torch.Tensor:
        datas, plans = batch
        out = []
        for image, plan in zip(self.decode_all(datas), plans, strict=True):
            for t, params in zip(self.ops, plan, strict=True):
                if params is not None:
                    image = t.transform(image, params)
            out.append(image)
        return self.tail(torch.stack(out))


def device_stages(transform: Callable | None, device: torch.device | str) -> Stages:
    """How a loader on ``device`` runs ``transform``: for a pipeline that starts by decoding
    (DecodeImage) followed only by plannable geometry (random-resized / centre / padded crops,
    resize, flips) and the batchable tail, on a CUDA device: plan in the workers, decode and
    transform on the device. Otherwise data.transforms.split_stages: everything per sample up
    to a uint8 tensor, the tail per batch."""
    stages = split_stages(transform)
    if torch.device(device).type != "cuda" or stages.batch is None:
        return stages
    ops = list(getattr(transform, "transforms", []))
    tail = stages.batch
    head = ops[: len(ops) - len(tail.transforms)]  # type: ignore[attr-defined]
    if (
        not head
        or not isinstance(head[0], DecodeImage)
        or not isinstance(head[-1], v2.ToImage)
        or not _plannable(head[1:-1])
    ):
        return stages
    geometry = head[1:-1]
    return Stages(
        PlanGeometry(geometry),
        DecodeOnDevice(geometry, tail, torch.device(device)),
        collate=collate_planned,
    )
