"""The DataLoader path's stages (data/transforms.py Stages, data/decode.py): per-sample work up
to a uint8 tensor, normalisation per batch, image files decoded with torchvision.io, and the
GPU decode plan, against the plain per-sample v2 pipelines they replace."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
import torchvision
from PIL import Image
from torchvision.transforms import v2

from core.errors import UserError
from core.world import data_workers
from data import build_datasets, build_loaders
from data.catalog import FakeImages
from data.decode import (
    DecodeImage,
    DecodeOnDevice,
    PlanGeometry,
    collate_planned,
    decode,
    device_stages,
    read_bytes,
)
from data.loaders import staged
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
    (datas, plans), labels = collate_planned([plan_set[k] for k in keys])
    assert all(d.ndim == 1 for d in datas)  # the workers only read the files
    assert torch.equal(planned.batch((datas, plans)), expected)
    assert labels.tolist() == [cpu_set[k][1] for k in keys]


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
