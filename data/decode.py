"""Image files as uint8 tensors: read the bytes in the dataset, decode in the loader.

The file-based sets (imagefolder, imagenet: data/catalog.py) read each file's bytes
(``read_bytes``, the ImageFolder loader) and start their transforms with ``DecodeImage``:
libjpeg-turbo through ``torchvision.io.decode_jpeg`` (PNG, GIF, WebP through
``decode_image``; anything else through PIL), then the v2 recipe on the uint8 tensor and
normalisation once per batch (data.transforms.split_stages). Against PIL + v2 per sample:
the decoded pixels are the same (both libjpeg-turbo, same IDCT and upsampling), the tensor
resize differs by at most 1 of 255 on some pixels (torchvision's uint8 kernel vs PIL's), and
the whole path costs about half as much per image (README, Benchmark).

On a GPU, where the recipe's geometry allows it (``device_stages``), the workers read the bytes
and draw the random parameters (the same draws, from the same seeded RNG, as the CPU path); the
batch's JPEGs are decoded on the device (nvjpeg, ``decode_jpeg(list, device=...)``) and
cropped, resized, flipped and normalised there with the same v2 kernels. A file nvjpeg cannot
take (CMYK or YCCK JPEGs, which ImageNet's train split holds; other formats) is decoded in the
worker as on the CPU path: nvjpeg fails a whole batch for one such file (``nvjpeg_decodes``).
"""

from __future__ import annotations

import io
import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

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


# --- which JPEGs nvjpeg decodes -----------------------------------------------------------------

# Frame headers (SOFn; C4, C8 and CC are other markers): C0 baseline, C1 extended sequential and
# C2 progressive are Huffman-coded, C3 lossless, C9-CF arithmetic-coded.
_FRAMES = frozenset({0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF})
_STANDALONE = frozenset({0x01, *range(0xD0, 0xD8)})  # TEM, RST0-7: markers without a length
_SCAN = 0xDA  # SOS: entropy-coded data follows, no header after it concerns the frame


class JpegFrame(NamedTuple):
    """What a JPEG's headers (up to its first scan) say about its pixels."""

    marker: int  # its frame header's, e.g. 0xC0 baseline, 0xC2 progressive (_FRAMES)
    precision: int  # bits per sample
    height: int  # 0: given later (a DNL marker)
    width: int
    sampling: tuple[tuple[int, int], ...]  # each component's (horizontal, vertical) factors
    adobe_transform: int | None  # APP14 "Adobe" marker: 0 stored as is (RGB, CMYK), 1 YCbCr, 2 YCCK


def jpeg_frame(data: torch.Tensor) -> JpegFrame | None:
    """A JPEG's frame header and Adobe marker, read from its marker segments up to the first
    scan (a few hundred bytes past any EXIF or ICC segments, which are skipped by length).
    None for bytes that are not a JPEG, or end or break the marker syntax before its scan."""
    head = memoryview(data.numpy())
    if bytes(head[:2]) != b"\xff\xd8":
        return None
    pos, frame, adobe = 2, None, None
    while pos + 4 <= len(head) and head[pos] == 0xFF:
        marker = head[pos + 1]
        if marker == 0xFF:  # a fill byte before the marker
            pos += 1
        elif marker in _STANDALONE:
            pos += 2
        elif marker == _SCAN:
            return None if frame is None else JpegFrame(*frame, adobe)
        else:
            length = head[pos + 2] << 8 | head[pos + 3]  # the segment's, its 2 length bytes too
            segment = head[pos + 4 : pos + 2 + length]
            if marker == 0xEE and bytes(segment[:5]) == b"Adobe" and len(segment) >= 12:
                adobe = segment[11]
            elif marker in _FRAMES and len(segment) >= 6 and len(segment) >= 6 + 3 * segment[5]:
                size = (segment[1] << 8 | segment[2], segment[3] << 8 | segment[4])
                factors = (segment[7 + 3 * k] for k in range(segment[5]))
                frame = (marker, segment[0], *size, tuple((f >> 4, f & 15) for f in factors))
            pos += 2 + length
    return None


# What torchvision's GPU decode_jpeg takes (torchvision/csrc/io/image/cuda/decode_jpegs_cuda.cpp,
# nvjpeg in RGB mode): 8-bit, Huffman-coded baseline, extended or progressive JPEGs (nvjpeg's
# documented JPEG options), grayscale (nvjpeg writes it to the 3 RGB planes torchvision
# allocates; torchvision's CUDA tests decode their gray JPEG so) or YCbCr in a chroma
# subsampling nvjpeg knows (prepare_buffers fails the batch on "Unknown chroma subsampling").
# Not CMYK or YCCK: torchvision never calls nvjpegDecodeParamsSetAllowCMYK and its CUDA tests
# skip its CMYK file; nor an RGB-coded JPEG (Adobe transform 0): nvjpeg documents YCbCr or
# grayscale only. A batched decode returns nothing for a batch with one file it fails on.
_NVJPEG_FRAMES = (0xC0, 0xC1, 0xC2)
# luma's sampling factors with both chroma planes at 1x1: 4:4:4, 4:2:2, 4:2:0, 4:4:0, 4:1:1, 4:1:0
_NVJPEG_LUMA = ((1, 1), (2, 1), (2, 2), (1, 2), (4, 1), (4, 2))


def nvjpeg_decodes(frame: JpegFrame | None) -> bool:
    """Whether the GPU decoder takes a JPEG with this frame (jpeg_frame); any other file is
    decoded on the host."""
    if frame is None or frame.marker not in _NVJPEG_FRAMES or frame.precision != 8:
        return False
    if not frame.height:  # given by a DNL marker after the first scan: decoded on the host
        return False
    if len(frame.sampling) == 1:
        return True
    luma, *chroma = frame.sampling
    return (
        len(frame.sampling) == 3
        and frame.adobe_transform != 0
        and luma in _NVJPEG_LUMA
        and all(c == (1, 1) for c in chroma)
    )


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
    """Sample stage on a device: ``bytes -> (bytes or image, params)``, the parameters each
    geometric transform would draw, drawn as v2 draws them (same RNG calls, same order), so that
    the device applies exactly what the CPU path would (data.transforms.Stages). A JPEG that
    nvjpeg takes stays bytes, for the device to decode; any other file is decoded here."""

    def __init__(self, ops: Sequence[Callable]) -> None:
        self.ops = list(ops)

    def __call__(self, data: torch.Tensor) -> tuple[torch.Tensor, list[dict | None]]:
        frame = jpeg_frame(data)
        if nvjpeg_decodes(frame):
            height, width = frame.height, frame.width
        else:
            data = decode(data)
            height, width = data.shape[-2:]
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
    """Items ``((bytes or image, plan), label)`` -> ``((bytes or images, plans), labels)``."""
    return ([d for (d, _), _ in items], [p for (_, p), _ in items]), torch.as_tensor(
        [label for _, label in items], dtype=torch.int64
    )


class DecodeOnDevice:
    """Batch stage on a device: decode the batch's JPEGs there (in one batched call), apply
    each image's planned geometry with the v2 kernels, stack, then ``tail`` (to float,
    normalise)."""

    def __init__(self, ops: Sequence[Callable], tail: BatchStage, device: torch.device) -> None:
        self.ops, self.tail, self.device = list(ops), tail, torch.device(device)

    def decode_all(self, items: list[torch.Tensor]) -> list[torch.Tensor]:
        """PlanGeometry's items as images on the device: JPEG bytes (1-D, what nvjpeg takes)
        decoded there; images the workers decoded moved there."""
        images = list(items)
        files = [i for i, item in enumerate(items) if item.ndim == 1]
        if files:
            decoded = decode_jpeg(
                [items[i] for i in files], mode=ImageReadMode.RGB, device=self.device
            )
            for i, image in zip(files, decoded, strict=True):
                images[i] = image
        return [image.to(self.device) for image in images]

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
