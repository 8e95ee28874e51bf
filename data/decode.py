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
A file that passes that check and still fails nvjpeg is decoded on the host, with one warning
naming it, and skips nvjpeg from then on (``DecodeOnDevice``).
"""

from __future__ import annotations

import io
import logging
import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from PIL import Image
from torchvision.io import ImageReadMode, decode_image, decode_jpeg
from torchvision.transforms import v2

from data.transforms import BatchStage, Stages, split_stages

log = logging.getLogger(__name__)

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


class Planned(NamedTuple):
    """A sample planned for the device: its bytes (or the image a worker decoded), the
    parameters of each geometric transform, and its index in the split (what names its file
    should nvjpeg fail on it)."""

    data: torch.Tensor
    plan: list[dict | None]
    index: int | None = None


class PlanGeometry:
    """Sample stage on a device: ``bytes -> Planned(bytes or image, params, index)``, the
    parameters each geometric transform would draw, drawn as v2 draws them (same RNG calls, same
    order), so that the device applies exactly what the CPU path would (data.transforms.Stages).
    A JPEG that nvjpeg takes stays bytes, for the device to decode; any other file is decoded
    here. ``takes_index``: data.datasets.SplitView passes the sample's index."""

    takes_index = True

    def __init__(self, ops: Sequence[Callable]) -> None:
        self.ops = list(ops)

    def __call__(self, data: torch.Tensor, index: int | None = None) -> Planned:
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
        return Planned(data, plan, index)


class PlannedBatch(NamedTuple):
    """A batch of Planned samples, as lists (their sizes differ until decoded and cropped)."""

    datas: list[torch.Tensor]
    plans: list[list[dict | None]]
    indices: list[int | None]


def collate_planned(items: list) -> tuple[PlannedBatch, torch.Tensor]:
    """Items ``(Planned, label)`` -> ``(PlannedBatch, labels)``."""
    batch = PlannedBatch(
        [p.data for p, _ in items], [p.plan for p, _ in items], [p.index for p, _ in items]
    )
    return batch, torch.as_tensor([label for _, label in items], dtype=torch.int64)


def _fixed_size_from(ops: Sequence[Callable]) -> int:
    """Where the per-image part of planned geometry ends: after the last crop to a fixed
    size (every image has that size from there on), so that the rest (flips, a resize) runs
    once on the stacked batch. len(ops) where no op fixes the size (then all of it is per
    image)."""
    last = max((k for k, t in enumerate(ops) if isinstance(t, _SIZED)), default=None)
    return len(ops) if last is None else last + 1


class DecodeOnDevice:
    """Batch stage on a device: decode the batch's JPEGs there (in one batched call), apply
    each image's planned geometry up to its fixed-size crop with the v2 kernels, stack, apply
    the rest of it (flips: one op for the images that flip) to the batch, then ``tail`` (to
    float, normalise).

    A file nvjpeg fails on although its header passed nvjpeg_decodes (the whole batched call
    fails for it: NVIDIA's DALI met such files in ImageNet) is decoded on the host instead:
    the batch is decoded again file by file on the device, the failing file on the host, and
    one warning names it (``name_of``: its path, from its index); from then on that file skips
    nvjpeg (once per file and rank)."""

    def __init__(
        self,
        ops: Sequence[Callable],
        tail: BatchStage,
        device: torch.device,
        name_of: Callable[[int], str | None] | None = None,
    ) -> None:
        self.ops, self.tail, self.device = list(ops), tail, torch.device(device)
        self.per_image = _fixed_size_from(self.ops)  # ops[:per_image] per image, then batched
        self.name_of = name_of
        self.host_files: set[int | None] = set()  # indices of the files nvjpeg failed on
        self.said = False  # the first batch's line (that nvjpeg runs: docs/bench/gpu.py checks)

    def decode_all(
        self, items: list[torch.Tensor], indices: Sequence[int | None] | None = None
    ) -> list[torch.Tensor]:
        """PlanGeometry's items as images on the device: JPEG bytes (1-D, what nvjpeg takes)
        decoded there, in one batched call (a file nvjpeg fails on: on the host); images the
        workers decoded copied there (non-blocking: the loader pinned them on a GPU)."""
        indices = list(indices) if indices is not None else [None] * len(items)
        images = list(items)
        files = [i for i, item in enumerate(items) if item.ndim == 1]
        on_device = [i for i in files if indices[i] is None or indices[i] not in self.host_files]
        for i in set(files) - set(on_device):
            images[i] = decode(items[i])
        if on_device:
            try:
                decoded = decode_jpeg(
                    [items[i] for i in on_device], mode=ImageReadMode.RGB, device=self.device
                )
            except RuntimeError:  # one file failed the call: each alone, that one on the host
                decoded = [self._decode_one(items[i], indices[i]) for i in on_device]
            for i, image in zip(on_device, decoded, strict=True):
                images[i] = image
            if not self.said:
                self.said = True
                log.info(
                    "JPEGs decoded on %s by nvjpeg: %d of the first batch's %d images (the "
                    "others decoded by the workers: formats nvjpeg does not take)",
                    self.device,
                    len(on_device),
                    len(items),
                )
        return [image.to(self.device, non_blocking=True) for image in images]

    def _decode_one(self, data: torch.Tensor, index: int | None) -> torch.Tensor:
        try:
            return decode_jpeg(data, mode=ImageReadMode.RGB, device=self.device)
        except RuntimeError as e:
            name = self.name_of(index) if self.name_of is not None and index is not None else None
            log.warning(
                "nvjpeg cannot decode %s (%s): decoding it on the host from now on",
                name or f"sample {index}",
                str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__,
            )
            self.host_files.add(index)
            return decode(data)

    def __call__(self, batch: PlannedBatch | tuple) -> torch.Tensor:
        datas, plans, *rest = batch
        indices = rest[0] if rest else None
        out = []
        head = self.ops[: self.per_image]
        for image, plan in zip(self.decode_all(datas, indices), plans, strict=True):
            for t, params in zip(head, plan, strict=False):
                if params is not None:
                    image = t.transform(image, params)
            out.append(image)
        images = torch.stack(out)
        for k in range(self.per_image, len(self.ops)):  # same size now: once for the batch
            images = self._batched(self.ops[k], images, [plan[k] for plan in plans])
        return self.tail(images)

    def _batched(self, t: Callable, images: torch.Tensor, params: list) -> torch.Tensor:
        """`t` applied with each image's planned parameters, as one op where they agree (a
        flip: to the images whose plan flips them; a resize: to all)."""
        chosen = [k for k, p in enumerate(params) if p is not None]
        if not chosen:
            return images
        if isinstance(t, _FLIPS) or all(p == params[chosen[0]] for p in params):
            if len(chosen) == len(params):
                return t.transform(images, params[chosen[0]])
            which = torch.tensor(chosen, device=images.device)
            done = t.transform(images.index_select(0, which), params[chosen[0]])
            return images.index_copy_(0, which, done)  # (a batch of its own: stacked above)
        return torch.stack(  # parameters of their own: one image at a time
            [t.transform(x, p) if p is not None else x for x, p in zip(images, params, strict=True)]
        )


def device_stages(
    transform: Callable | None,
    device: torch.device | str,
    name_of: Callable[[int], str | None] | None = None,
) -> Stages:
    """How a loader on ``device`` runs ``transform``: for a pipeline that starts by decoding
    (DecodeImage) followed only by plannable geometry (random-resized / centre / padded crops,
    resize, flips) and the batchable tail, on a CUDA device: plan in the workers, decode and
    transform on the device. Otherwise data.transforms.split_stages: everything per sample up
    to a uint8 tensor, the tail per batch. `name_of`: a sample index's file (warnings)."""
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
        DecodeOnDevice(geometry, tail, torch.device(device), name_of),
        collate=collate_planned,
    )
