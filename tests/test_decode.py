"""The DataLoader path's stages (data/transforms.py Stages, data/decode.py): per-sample work up
to a uint8 tensor, normalisation per batch, image files decoded with torchvision.io, and the
GPU decode plan, against the plain per-sample v2 pipelines they replace."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
import torchvision
from ddp_launcher.core.errors import UserError
from PIL import Image
from torchvision.transforms import v2

from data import build_datasets, build_loaders
from data.catalog import FakeImages
from data.decode import (
    DecodeImage,
    DecodeOnDevice,
    PlanGeometry,
    collate_planned,
    decode,
    device_stages,
    jpeg_frame,
    nvjpeg_decodes,
    read_bytes,
)
from data.loaders import data_workers, loader_options, staged
from data.seeding import EpochSeededDataset, mix_seed, seeded
from data.transforms import NORMALIZATION, Recipe, is_random, split_stages, train_transform
from tests import helpers as fx
from tests.helpers import dataset_cfg

# Where the tensor path may differ from PIL's: torchvision's uint8 resize vs PIL's, at most one
# level of 255 on a pixel (decoding itself is exact), i.e. 1/255/std after normalisation.
RESIZE_LEVELS = 1
IMAGENET_STD_MIN = min(NORMALIZATION["imagefolder"][1])


def encoded(image: Image.Image, fmt: str, **options) -> torch.Tensor:
    buf = io.BytesIO()
    image.save(buf, fmt, **options)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def photo(width: int = 57, height: int = 41, mode: str = "RGB", seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    coarse = Image.fromarray(rng.integers(0, 256, (5, 5, 3), dtype=np.uint8))
    pixels = np.asarray(coarse.resize((width, height), Image.BICUBIC), dtype=np.float32)
    pixels = np.clip(pixels + rng.normal(0, 10, pixels.shape), 0, 255).astype(np.uint8)
    return Image.fromarray(pixels).convert(mode)


def pil_rgb(data: torch.Tensor) -> torch.Tensor:
    """What PIL (ImageFolder's loader) makes of the file: RGB, as a uint8 CHW tensor."""
    with Image.open(io.BytesIO(data.numpy().tobytes())) as image:
        return v2.functional.pil_to_tensor(image.convert("RGB"))


@pytest.mark.parametrize(
    "fmt, mode, options",
    [
        ("JPEG", "RGB", {"quality": 90}),
        ("JPEG", "RGB", {"quality": 75, "subsampling": 0}),  # 4:4:4
        ("JPEG", "RGB", {"quality": 95, "subsampling": 2}),  # 4:2:0
        ("JPEG", "L", {}),  # grayscale: RGB out, as PIL's convert
        ("JPEG", "CMYK", {}),
        ("PNG", "RGB", {}),
        ("PNG", "RGBA", {}),
        ("PNG", "P", {}),
        ("BMP", "RGB", {}),  # not torchvision's: PIL decodes it
        ("WEBP", "RGB", {"lossless": True}),
    ],
)
def test_decoding_equals_pil(fmt, mode, options):
    if mode == "P":
        image = photo().convert("P", palette=Image.Palette.ADAPTIVE)
    else:
        image = photo(mode=mode)
    data = encoded(image, fmt, **options)
    ours = decode(data)
    assert ours.dtype == torch.uint8 and ours.shape == (3, 41, 57)
    assert torch.equal(ours, pil_rgb(data))
    # DecodeImage: bytes are decoded; PIL images and tensors pass through as tensors
    assert torch.equal(DecodeImage()(data), ours)
    assert torch.equal(DecodeImage()(image), v2.functional.pil_to_tensor(image.convert("RGB")))
    assert DecodeImage()(ours) is ours


def test_read_bytes(tmp_path):
    path = tmp_path / "x.jpg"
    photo().save(path, quality=90)
    data = read_bytes(str(path))
    assert data.dtype == torch.uint8 and data.ndim == 1
    assert bytes(data.tolist()) == path.read_bytes()


# --- stages ---------------------------------------------------------------------------------


RECIPES = ["none", "shift", "crop_flip", "random_resized_crop", "trivial_augment"]


@pytest.mark.parametrize("choice", RECIPES + ["random_erasing"])
def test_batch_stage_gives_the_whole_transforms_samples_bit_for_bit(choice):
    overrides = (
        [f"augment={choice}"]
        if choice != "random_erasing"
        else ["augment=crop_flip", "augment.random_erasing=0.5"]
    )
    transform = train_transform("cifar10", 32, fx.recipe(*overrides))
    stages = split_stages(transform)
    if choice == "random_erasing":  # erasing follows normalisation: nothing to batch
        assert stages.batch is None and stages.sample is transform
        return
    assert stages.batch is not None
    images = [photo(32, 32, seed=i) for i in range(6)]
    whole, parts = [], []
    for i, image in enumerate(images):
        with seeded(mix_seed(1, 2, i)):
            whole.append(transform(image))
        with seeded(mix_seed(1, 2, i)):
            parts.append(stages.sample(image))
    assert all(p.dtype == torch.uint8 for p in parts)
    batch = stages.batch(torch.stack(parts))
    assert type(batch) is torch.Tensor and batch.dtype == torch.float32
    assert torch.equal(batch, torch.stack(whole))


def test_only_known_deterministic_transforms_count_as_not_random():
    assert not is_random(train_transform("fake", 32, Recipe()))
    files = v2.Compose([DecodeImage(), *train_transform("imagefolder", 64).transforms])
    assert not is_random(files)
    assert not is_random(None)
    for choice in RECIPES[1:]:
        assert is_random(train_transform("cifar10", 32, fx.recipe(f"augment={choice}"))), choice
    assert is_random(v2.Compose([v2.ToImage(), v2.Lambda(lambda x: x)]))  # unknown: random
    assert is_random(lambda x: x)


class Draw(torch.utils.data.Dataset):
    """Each item: two numbers drawn from torch's global RNG."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        return torch.rand(2)


def test_epoch_seeded_dataset_seeds_only_random_transforms_and_restores_the_rng():
    seeded_set = EpochSeededDataset(Draw(), seed=7)
    with seeded(mix_seed(7, 3, 2)):
        expected = torch.rand(2)
    torch.manual_seed(0)
    before = torch.rand(3)
    torch.manual_seed(0)
    assert torch.equal(seeded_set[(3, 2)], expected)  # = torch.manual_seed(mix_seed(...))
    assert torch.equal(torch.rand(3), before)  # the caller's stream untouched
    unseeded = EpochSeededDataset(Draw(), seed=7, random=False)
    torch.manual_seed(0)
    first = unseeded[(3, 2)]
    assert torch.equal(first, before[:2])  # drawn from the caller's stream: nothing reseeded


def test_seeded_draws_what_manual_seed_draws():
    torch.manual_seed(12345)
    expected = torch.randn(5)
    torch.manual_seed(0)
    before = torch.rand(2)
    torch.manual_seed(0)
    with seeded(12345):
        assert torch.equal(torch.randn(5), expected)
    assert torch.equal(torch.rand(2), before)


def test_fake_images_are_torchvisions_and_leave_the_rng_alone():
    ours = FakeImages(20, (3, 16, 16), 7, random_offset=5)
    theirs = torchvision.datasets.FakeData(20, (3, 16, 16), 7, random_offset=5)
    torch.manual_seed(0)
    before = torch.rand(3)
    torch.manual_seed(0)
    for i in range(20):
        (a, y), (b, z) = ours[i], theirs[i]
        assert np.array_equal(np.asarray(a), np.asarray(b)) and y == z
    with pytest.raises(IndexError):
        ours[20]
    torch.manual_seed(0)
    ours[3]
    assert torch.equal(torch.rand(3), before)


# --- image files ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def jpegs(tmp_path_factory):
    """A JPEG ImageFolder (mixed sizes, 96-160 px) with val/, and one PNG among the JPEGs."""
    from docs.bench.common import make_jpegs

    root = make_jpegs(tmp_path_factory.mktemp("jpegs"), per_class=3, val_per_class=1)
    photo(120, 100).save(root / "train" / "class0" / "z.png")
    return root


def folder_splits(root, choice: str = "random_resized_crop", seed: int = 3, size: int = 48):
    overrides = (
        [f"augment={choice}"]
        if choice != "random_erasing"
        else ["augment=random_resized_crop", "augment.random_erasing=0.5"]
    )
    cfg = dataset_cfg("imagefolder", root=str(root), image_size=size)
    return build_datasets(cfg, seed=seed, augment=fx.recipe("dataset=imagefolder", *overrides))


@pytest.mark.parametrize("choice", ["random_resized_crop", "crop_flip", "none"])
def test_file_samples_equal_pil_and_v2_within_one_level(jpegs, choice):
    """Same crop, flip and normalisation as PIL + v2 from the same seed (the parameters depend
    on the image size only); pixels within RESIZE_LEVELS of 255."""
    splits = folder_splits(jpegs, choice)
    reference = train_transform(
        "imagefolder", 48, fx.recipe("dataset=imagefolder", f"augment={choice}")
    )
    base = splits.train.dataset.dataset  # the ImageFolder (items: file bytes)
    tolerance = RESIZE_LEVELS / 255 / IMAGENET_STD_MIN + 1e-5
    for index in range(len(base)):
        data, label = base[index]
        with seeded(mix_seed(3, 1, index)):
            expected = reference(Image.open(io.BytesIO(data.numpy().tobytes())).convert("RGB"))
        ours, our_label = splits.train[(1, index)]
        assert our_label == label and ours.shape == expected.shape == (3, 48, 48)
        assert (ours - expected).abs().max() <= tolerance, index
    val, _ = splits.val[0]
    assert val.shape == (3, 48, 48)


@pytest.mark.parametrize("workers", [0, 2])
def test_loader_batches_are_the_indexed_samples(jpegs, workers):
    splits = folder_splits(jpegs)
    loaders = build_loaders(
        splits, batch_size=4, eval_batch_size=3, rank=1, world_size=2, seed=0, num_workers=workers
    )
    loaders.train_sampler.set_epoch(2)
    keys = list(loaders.train_sampler)
    images = torch.cat([x for x, _ in loaders.train])
    assert type(images) is torch.Tensor and images.dtype == torch.float32 and len(images) >= 8
    for (epoch, index), image in zip(keys, images, strict=False):
        assert torch.equal(image, splits.train[(epoch, index)][0])
    val = torch.cat([x for x, _ in loaders.val])
    assert torch.equal(val[0], splits.val[1][0])  # rank 1 of 2: val samples 1, 3, ...


@pytest.mark.parametrize("choice", ["random_resized_crop", "crop_flip", "none"])
def test_device_decode_plan_applies_the_cpu_paths_draws(jpegs, choice):
    """The GPU path's planning (in the workers) + decoding and transforming (on the device),
    run here on the CPU, gives the CPU path's batches exactly."""
    splits = folder_splits(jpegs, choice)
    cpu_set, cpu = staged(splits.train, torch.device("cpu"))
    plan_set, planned = staged(splits.train, torch.device("cuda"))  # only plans: no CUDA used
    assert isinstance(plan_set.dataset.transform, PlanGeometry)
    assert isinstance(planned.batch, DecodeOnDevice) and planned.collate is collate_planned
    planned.batch.device = torch.device("cpu")  # decode "on the device" here
    keys = [(4, i) for i in range(len(cpu_set))]
    expected = cpu.batch(torch.stack([cpu_set[k][0] for k in keys]))
    batch, labels = collate_planned([plan_set[k] for k in keys])
    files = [splits.train.dataset.sample_file(k[1]) for k in keys]
    # the workers only read the JPEG files; the PNG among them they decode
    assert [d.ndim for d in batch.datas] == [3 if f.endswith(".png") else 1 for f in files]
    assert batch.indices == [k[1] for k in keys]
    assert torch.equal(planned.batch(batch), expected)
    assert labels.tolist() == [cpu_set[k][1] for k in keys]


# --- what nvjpeg decodes ---------------------------------------------------------------------

# JPEGs as PIL writes them (libjpeg-turbo), and whether torchvision's GPU decode_jpeg takes them
# (data/decode.py nvjpeg_decodes says why).
JPEG_KINDS = {
    "rgb 4:2:0": ("RGB", {"quality": 90}, True),
    "rgb 4:4:4": ("RGB", {"subsampling": 0}, True),
    "rgb 4:2:2": ("RGB", {"subsampling": 1}, True),
    "grayscale": ("L", {}, True),  # nvjpeg gives it as RGB
    "progressive": ("RGB", {"progressive": True}, True),
    # metadata segments before the frame header, the ICC profile spread over two of them
    "exif and icc": (
        "RGB",
        {"exif": b"Exif\0\0" + bytes(60000), "icc_profile": bytes(90000)},
        True,
    ),
    "cmyk": ("CMYK", {}, False),
    "rgb stored as rgb": ("RGB", {"keep_rgb": True}, False),  # Adobe transform 0, no YCbCr
}


def jpeg_kind(kind: str, seed: int = 0) -> torch.Tensor:
    mode, options, _ = JPEG_KINDS[kind]
    return encoded(photo(mode=mode, seed=seed), "JPEG", **options)


def patched(data: torch.Tensor, old: bytes, new: bytes) -> torch.Tensor:
    """`data` with the first `old` byte string (a marker or segment start) replaced."""
    raw = bytes(data.tolist())
    assert old in raw
    return torch.frombuffer(bytearray(raw.replace(old, new, 1)), dtype=torch.uint8)


@pytest.mark.parametrize("kind", JPEG_KINDS)
def test_jpeg_frame_reads_what_pil_reads(kind):
    """The header parse (jpeg_frame) against PIL's own reading of the same file: size, one
    sampling pair per component, progressive or not, the Adobe marker's transform."""
    data = jpeg_kind(kind)
    frame = jpeg_frame(data)
    with Image.open(io.BytesIO(bytes(data.tolist()))) as image:
        assert (frame.width, frame.height) == image.size
        assert frame.precision == 8 and len(frame.sampling) == len(image.getbands())
        assert frame.sampling == tuple((h, v) for _, h, v, _ in image.layer)
        assert (frame.marker == 0xC2) == bool(image.info.get("progressive"))
        assert frame.adobe_transform == image.info.get("adobe_transform")


@pytest.mark.parametrize("kind", JPEG_KINDS)
def test_nvjpeg_takes_only_the_jpegs_it_decodes(kind):
    assert nvjpeg_decodes(jpeg_frame(jpeg_kind(kind))) is JPEG_KINDS[kind][2]


def test_nvjpeg_refuses_ycck_arithmetic_and_broken_headers():
    cmyk, rgb = jpeg_kind("cmyk"), jpeg_kind("rgb 4:2:0")
    ycck = patched(cmyk, b"Adobe\x00d\x00\x00\x00\x00\x00", b"Adobe\x00d\x00\x00\x00\x00\x02")
    assert jpeg_frame(ycck).adobe_transform == 2 and not nvjpeg_decodes(jpeg_frame(ycck))
    arithmetic = patched(rgb, b"\xff\xc0", b"\xff\xc9")  # SOF9: arithmetic-coded
    assert jpeg_frame(arithmetic).marker == 0xC9 and not nvjpeg_decodes(jpeg_frame(arithmetic))
    raw = bytes(rgb.tolist())
    before_scan = torch.frombuffer(bytearray(raw[: raw.index(b"\xff\xda")]), dtype=torch.uint8)
    assert jpeg_frame(before_scan) is None and not nvjpeg_decodes(None)  # cut short
    assert jpeg_frame(encoded(photo(), "PNG")) is None


def nvjpeg_like(seen: list):
    """decode_jpeg as torchvision's GPU path behaves for a list (nvjpeg, here run by the CPU
    decoder): the whole batched call fails for one file nvjpeg cannot take (CMYK here), and
    returns nothing else; a single tensor (the host path) decodes as it does. `seen` gets
    each batched call's inputs."""
    real = torchvision.io.decode_jpeg

    def decode_jpeg(data, mode=torchvision.io.ImageReadMode.UNCHANGED, device="cpu"):
        if not isinstance(data, list):
            return real(data, mode=mode)
        seen.append(data)
        for item in data:
            with Image.open(io.BytesIO(bytes(item.tolist()))) as image:
                if image.mode == "CMYK":
                    raise RuntimeError("Error while decoding JPEG images: nvjpeg status 5")
        return [real(item, mode=mode) for item in data]

    return decode_jpeg


@pytest.fixture(scope="module")
def mixed_jpegs(tmp_path_factory):
    """An ImageFolder of RGB JPEGs with, in each class, one CMYK, one grayscale, one
    progressive JPEG and one RGB-coded one (as ImageNet's train split mixes them)."""
    from docs.bench.common import make_jpegs

    root = make_jpegs(tmp_path_factory.mktemp("mixed"), per_class=2, val_per_class=1)
    for c, folder in enumerate(sorted((root / "train").iterdir())):
        for kind in ("cmyk", "grayscale", "progressive", "rgb stored as rgb"):
            path = folder / f"{kind.replace(' ', '_')}.jpg"
            path.write_bytes(bytes(jpeg_kind(kind, seed=c).tolist()))
    return root


def test_a_batch_with_a_cmyk_file_decodes_on_the_device_path(mixed_jpegs, monkeypatch):
    """The GPU path with nvjpeg's behaviour faked: every batch holds CMYK files, and still
    decodes, to the CPU path's pixels; only the JPEGs nvjpeg takes reach it, in one batched
    call, the others arrive decoded by the workers' host decoder."""
    seen: list = []
    monkeypatch.setattr("data.decode.decode_jpeg", nvjpeg_like(seen))
    splits = folder_splits(mixed_jpegs)
    cpu_set, cpu = staged(splits.train, torch.device("cpu"))
    plan_set, planned = staged(splits.train, torch.device("cuda"))  # only plans: no CUDA used
    planned.batch.device = torch.device("cpu")  # decode "on the device" here
    keys = [(2, i) for i in range(len(cpu_set))]
    expected = cpu.batch(torch.stack([cpu_set[k][0] for k in keys]))
    batch, _ = collate_planned([plan_set[k] for k in keys])
    items = batch.datas
    files = [splits.train.dataset.sample_file(i) for _, i in keys]
    host = {i for i, f in enumerate(files) if "cmyk" in f or "rgb_stored" in f}
    assert len(host) == 2 * len(splits.classes)
    assert [item.ndim for item in items] == [3 if i in host else 1 for i in range(len(items))]
    assert torch.equal(planned.batch(batch), expected)
    assert len(seen) == 1 and len(seen[0]) == len(keys) - len(host)


class CountOps(torch.utils._python_dispatch.TorchDispatchMode):
    """The aten ops run inside, by name (on a GPU each is at least one kernel launch)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("choice", ["random_resized_crop", "crop_flip"])
def test_the_device_stage_flips_a_batch_in_one_op_and_copies_without_blocking(
    jpegs, choice, monkeypatch
):
    """The device stage applies what follows the per-image crop to the stacked batch: one flip
    for all the images whose plan flips them, not one per image (same pixels: the CPU path's,
    test_device_decode_plan_applies_the_cpu_paths_draws); the images the workers decoded go
    to the device without a blocking copy each (the loader pinned them)."""
    splits = folder_splits(jpegs, choice)
    plan_set, planned = staged(splits.train, torch.device("cuda"))  # only plans: no CUDA used
    planned.batch.device = torch.device("cpu")  # decode "on the device" here
    keys = [(5, i) for i in range(len(plan_set))]
    batch, _ = collate_planned([plan_set[k] for k in keys])
    plans = batch[1]  # (the batch's plans, one per image)
    flipped = sum(plan[-1] is not None for plan in plans)  # the flip is the last op
    assert flipped >= 2
    copies: list[bool] = []
    real_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        if args and isinstance(args[0], torch.device):  # a copy to a device (not a cast)
            copies.append(kwargs.get("non_blocking", False))
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)
    with CountOps() as ops:
        planned.batch(batch)
    assert ops.counts.get("flip", 0) == 1, ops.counts
    assert len(copies) >= len(keys) and all(copies)


def nvjpeg_rejecting(bad: bytes, calls: list):
    """decode_jpeg as the GPU path meets a file nvjpeg fails on although its header passes
    nvjpeg_decodes: a device call (batched or single) holding `bad`'s bytes raises as nvjpeg
    does; the host decoder (called without a device) decodes everything. `calls` gets each
    device call's count of `bad` (0 or 1)."""
    real = torchvision.io.decode_jpeg

    def decode_jpeg(data, mode=torchvision.io.ImageReadMode.UNCHANGED, device=None):
        if device is None:  # the host decoder (data.decode.decode)
            return real(data, mode=mode)
        items = data if isinstance(data, list) else [data]
        hit = sum(bytes(item.numpy()) == bad for item in items)
        calls.append(hit)
        if hit:
            raise RuntimeError("Error while decoding JPEG images: nvjpeg status 7")
        decoded = [real(item, mode=mode) for item in items]
        return decoded if isinstance(data, list) else decoded[0]

    return decode_jpeg


def test_a_file_nvjpeg_fails_on_is_decoded_on_the_host_once_with_one_warning(
    jpegs, monkeypatch, caplog
):
    """A JPEG whose header nvjpeg_decodes accepts but nvjpeg still fails on (a monkeypatched
    decoder rejects it): the batch decodes all the same, to the CPU path's pixels; one warning
    names the file; nvjpeg meets it once (its batch's call, then alone), never again in later
    epochs."""
    splits = folder_splits(jpegs)
    cpu_set, cpu = staged(splits.train, torch.device("cpu"))
    plan_set, planned = staged(splits.train, torch.device("cuda"))  # only plans: no CUDA used
    planned.batch.device = torch.device("cpu")  # decode "on the device" here
    files = [splits.train.dataset.sample_file(i) for i in range(len(cpu_set))]
    bad = next(i for i, f in enumerate(files) if f.endswith(".jpg"))
    assert nvjpeg_decodes(jpeg_frame(read_bytes(files[bad])))  # the header check passes it
    calls: list = []
    monkeypatch.setattr(
        "data.decode.decode_jpeg", nvjpeg_rejecting(read_bytes(files[bad]).numpy().tobytes(), calls)
    )
    with caplog.at_level("WARNING", logger="data.decode"):
        for epoch in (1, 2, 3):
            keys = [(epoch, i) for i in range(len(cpu_set))]
            expected = cpu.batch(torch.stack([cpu_set[k][0] for k in keys]))
            batch, _ = collate_planned([plan_set[k] for k in keys])
            assert torch.equal(planned.batch(batch), expected), epoch
    warnings = [r.getMessage() for r in caplog.records if "nvjpeg" in r.getMessage()]
    assert len(warnings) == 1 and files[bad] in warnings[0], warnings
    assert sum(calls) == 2  # the batched call it failed, then alone; skipped from then on


@pytest.mark.filterwarnings("ignore:.*pin_memory")  # no accelerator here to pin memory for
def test_the_training_loaders_gpu_path_decodes_a_batch_with_a_cmyk_file(mixed_jpegs, monkeypatch):
    """As train.py builds them (build_datasets, build_loaders with loader_options for a CUDA
    device, worker processes): with nvjpeg's behaviour faked, batches that hold CMYK files
    equal the CPU loaders' batches."""
    seen: list = []
    monkeypatch.setattr("data.decode.decode_jpeg", nvjpeg_like(seen))
    splits = folder_splits(mixed_jpegs)
    cfg = dataset_cfg("imagefolder", root=str(mixed_jpegs), num_workers=2)

    def batches(device: str) -> list[torch.Tensor]:
        options = loader_options(cfg, rank=0, world_size=1, seed=0, device=torch.device(device))
        loaders = build_loaders(splits, batch_size=4, eval_batch_size=4, **options)
        loaders.train_sampler.set_epoch(1)
        if device == "cuda":  # the device stage, run here on the CPU
            assert isinstance(loaders.train.finish, DecodeOnDevice)
            loaders.train.device = loaders.train.finish.device = torch.device("cpu")
        return [x for x, _ in loaders.train]

    on_device = batches("cuda")
    assert len(seen) == len(on_device) > 0
    for ours, expected in zip(on_device, batches("cpu"), strict=True):
        assert torch.equal(ours, expected)


def test_device_decode_plan_only_where_it_can_plan(jpegs):
    cuda = torch.device("cuda")
    assert device_stages(folder_splits(jpegs).train.dataset.transform, "cpu").collate is None
    for choice in ("trivial_augment", "random_erasing"):  # pixel-dependent or after normalise
        transform = folder_splits(jpegs, choice).train.dataset.transform
        assert not isinstance(device_stages(transform, cuda).sample, PlanGeometry), choice
    fake = build_datasets(dataset_cfg("fake", size=8), augment=Recipe())
    stages = device_stages(fake.train.dataset.transform, cuda)  # no decoding: normalise only
    assert stages.collate is None and stages.batch is not None


def test_auto_workers_leave_a_core_per_rank(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)))
    assert data_workers("auto", 1) == 15 and data_workers("auto", 4) == 3
    assert data_workers("auto", 16) == 0 and data_workers("auto", 32) == 0
    assert data_workers(2, 8) == 2 and data_workers("0", 1) == 0
    with pytest.raises(UserError, match="dataset.num_workers"):
        data_workers("-1", 1)
