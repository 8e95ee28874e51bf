"""models/: every conf/model choice composes and builds; torchvision adaptations; SmallCNN."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from ddp_launcher.core.errors import UserError
from ddp_launcher.core.hydra_compat import VERSION_BASE
from hydra import compose, initialize_config_dir
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import OmegaConf
from omegaconf.errors import MissingMandatoryValue
from torch import nn

import conf.schema  # registers the ConfigStore schemas the YAMLs extend
from models import SmallCNN, build_torchvision_model

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
MODEL_CHOICES = sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml"))
EXPECTED_CHOICES = {
    "small_cnn",
    "resnet18",
    "resnet50",
    "mobilenet_v3_small",
    "efficientnet_b0",
    "vit_b_16",
    "convnext_tiny",
    "torchvision",
}
# Extra overrides a choice needs to compose into something buildable.
CHOICE_OVERRIDES = {"torchvision": ["model.name=shufflenet_v2_x0_5"]}
# Every choice, ViT included (32 is a multiple of its 16x16 patch), handles 32x32 inputs.
IMAGE_SIZE = 32


def compose_model(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), **VERSION_BASE):
        return compose("train", overrides=list(overrides)).model


def forward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(x)


def first_conv(model: nn.Module) -> nn.Conv2d:
    return next(m for m in model.modules() if isinstance(m, nn.Conv2d))


def test_expected_model_choices_exist():
    assert set(MODEL_CHOICES) >= EXPECTED_CHOICES


@pytest.mark.parametrize("choice", MODEL_CHOICES)
def test_model_choice_composes_and_builds(choice):
    cfg = compose_model(f"model={choice}", *CHOICE_OVERRIDES.get(choice, []))
    # The YAML extends the repo's schema (its first defaults entry).
    expected_schema = (
        conf.schema.SmallCNNConfig if choice == "small_cnn" else conf.schema.TorchvisionModelConfig
    )
    assert OmegaConf.get_type(cfg) is expected_schema
    model = instantiate(cfg, num_classes=10, in_channels=3, image_size=IMAGE_SIZE)
    assert isinstance(model, nn.Module)
    out = forward(model, torch.randn(2, 3, IMAGE_SIZE, IMAGE_SIZE))
    assert out.shape == (2, 10)


def test_torchvision_choice_builds_another_classification_model():
    cfg = compose_model("model=torchvision", "model.name=regnet_x_400mf")
    model = instantiate(cfg, num_classes=7, in_channels=3, image_size=32)
    assert type(model).__name__ == "RegNet"
    assert forward(model, torch.randn(2, 3, 32, 32)).shape == (2, 7)


def test_torchvision_choice_requires_a_name():
    cfg = compose_model("model=torchvision")
    with pytest.raises(MissingMandatoryValue):
        instantiate(cfg, num_classes=10, in_channels=3, image_size=32)


def test_resnet18_choice_uses_small_input_stem():
    model = instantiate(
        compose_model("model=resnet18"), num_classes=10, in_channels=3, image_size=32
    )
    assert model.conv1.stride == (1, 1)
    assert isinstance(model.maxpool, nn.Identity)


@pytest.mark.parametrize(
    ("name", "conv_path", "size"),
    [
        ("resnet18", "conv1", 32),
        ("mobilenet_v3_small", "features.0.0", 32),
        ("efficientnet_b0", "features.0.0", 32),
        ("convnext_tiny", "features.0.0", 32),
        # two ViT-B/16 of 86M parameters each: seconds to build
        pytest.param("vit_b_16", "conv_proj", 16, marks=pytest.mark.slow),
    ],
)
def test_grayscale_input_replaces_first_conv(name, conv_path, size):
    rgb = build_torchvision_model(name, num_classes=10, in_channels=3, image_size=size)
    gray = build_torchvision_model(name, num_classes=10, in_channels=1, image_size=size)
    old, new = rgb.get_submodule(conv_path), gray.get_submodule(conv_path)
    assert first_conv(gray) is new
    assert new.in_channels == 1 and old.in_channels == 3
    for attr in ("out_channels", "kernel_size", "stride", "padding", "dilation", "groups"):
        assert getattr(new, attr) == getattr(old, attr), attr
    assert (new.bias is None) == (old.bias is None)
    assert forward(gray, torch.randn(2, 1, size, size)).shape == (2, 10)


def _layer1_size(model: nn.Module, in_channels: int = 3) -> int:
    sizes = []
    handle = model.layer1.register_forward_hook(lambda m, i, o: sizes.append(o.shape[-1]))
    try:
        forward(model, torch.randn(2, in_channels, 32, 32))
    finally:
        handle.remove()
    return sizes[0]


def test_small_input_stem_keeps_32x32_resolution():
    small = build_torchvision_model("resnet18", 10, image_size=32, small_input_stem=True)
    plain = build_torchvision_model("resnet18", 10, image_size=32, small_input_stem=False)
    assert _layer1_size(small) == 32
    assert _layer1_size(plain) == 8
    conv = small.conv1
    assert (conv.kernel_size, conv.stride, conv.padding) == ((3, 3), (1, 1), (1, 1))
    assert conv.bias is None
    assert isinstance(small.maxpool, nn.Identity)


def test_small_input_stem_with_grayscale():
    model = build_torchvision_model("resnet18", 10, in_channels=1, small_input_stem=True)
    assert model.conv1.in_channels == 1 and model.conv1.kernel_size == (3, 3)
    assert _layer1_size(model, in_channels=1) == 32


def test_googlenet_returns_plain_logits_in_train_mode():
    model = build_torchvision_model("googlenet", 10, image_size=32).train()
    out = model(torch.randn(2, 3, 32, 32))
    assert isinstance(out, torch.Tensor) and out.shape == (2, 10)


def _user_error(fn, *args, **kwargs) -> str:
    with pytest.raises(UserError) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_unknown_name_suggests_close_match():
    message = _user_error(build_torchvision_model, "resnt18", num_classes=10)
    assert "'resnt18'" in message
    assert "did you mean resnet18" in message
    assert "model.name=" in message


def test_unknown_name_through_hydra_keeps_user_error_as_cause():
    cfg = compose_model("model=torchvision", "model.name=resnt18")
    with pytest.raises(InstantiationException) as info:
        instantiate(cfg, num_classes=10, in_channels=3, image_size=32)
    assert isinstance(info.value.__cause__, UserError)


def test_non_classification_model_is_rejected():
    message = _user_error(build_torchvision_model, "fcn_resnet50", num_classes=10)
    assert "not a classification model" in message


@pytest.mark.parametrize("name", ["mobilenet_v3_small", "vit_b_16"])
def test_small_input_stem_on_unsupported_family(name):
    message = _user_error(build_torchvision_model, name, 10, image_size=32, small_input_stem=True)
    assert "resnet" in message and "model.small_input_stem=false" in message


def test_vit_image_size_must_be_multiple_of_patch():
    message = _user_error(build_torchvision_model, "vit_b_16", 10, image_size=28)
    assert "16" in message and "28" in message


@pytest.mark.parametrize(
    ("in_channels", "size", "feature_shape"),
    [(1, 8, (64, 2, 2)), (1, 28, (64, 7, 7)), (3, 32, (64, 8, 8))],
)
def test_small_cnn_forward_shapes(in_channels, size, feature_shape):
    model = SmallCNN(num_classes=10, in_channels=in_channels, image_size=size)
    assert model.feature_shape == feature_shape
    assert forward(model, torch.randn(2, in_channels, size, size)).shape == (2, 10)


def test_small_cnn_has_no_batchnorm_by_default():
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in SmallCNN(10).modules())
    with_bn = SmallCNN(10, batch_norm=True)
    assert sum(isinstance(m, nn.BatchNorm2d) for m in with_bn.modules()) == 2


def test_small_cnn_parameter_count_is_deterministic():
    def count(model: nn.Module) -> int:
        return sum(p.numel() for p in model.parameters())

    torch.manual_seed(0)
    a = SmallCNN(10, in_channels=1, image_size=8)
    torch.manual_seed(1)
    b = SmallCNN(10, in_channels=1, image_size=8)
    # conv 1->32, conv 32->64, linear 64*2*2->128, linear 128->10 (weights + biases)
    expected = (9 * 32 + 32) + (9 * 32 * 64 + 64) + (256 * 128 + 128) + (128 * 10 + 10)
    assert count(a) == count(b) == expected


def test_small_cnn_hydra_config_fields_apply():
    cfg = compose_model("model=small_cnn", "model.channels=[8,16,16]", "model.dropout=0.25")
    model = instantiate(cfg, num_classes=4, in_channels=1, image_size=8)
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert [c.out_channels for c in convs] == [8, 16, 16]
    assert model.feature_shape == (16, 2, 2)  # 8 -> 4 -> 2, no third pool below 2x2
    assert next(m for m in model.modules() if isinstance(m, nn.Dropout)).p == 0.25
    assert forward(model, torch.randn(2, 1, 8, 8)).shape == (2, 4)


@pytest.mark.parametrize(
    "kwargs", [{"dropout": 1.0}, {"hidden": 0}, {"channels": (32, 0)}, {"num_classes": 0}]
)
def test_small_cnn_rejects_bad_config(kwargs):
    _user_error(SmallCNN, **{"num_classes": 10, **kwargs})


def test_small_cnn_learns_sklearn_digits():
    """Quick guard; the end-to-end >=90% check lives with the training tests."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
    y = torch.tensor(y)
    gen = torch.Generator().manual_seed(0)
    perm = torch.randperm(len(x), generator=gen)
    n_val = len(x) // 5
    val, train = perm[:n_val], perm[n_val:]
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = SmallCNN(num_classes=10, in_channels=1, image_size=8)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model.train()
        for _ in range(5):
            order = train[torch.randperm(len(train), generator=gen)]
            for i in range(0, len(order), 64):
                idx = order[i : i + 64]
                loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
                opt.zero_grad()
                loss.backward()
                opt.step()
    accuracy = (forward(model, x[val]).argmax(1) == y[val]).float().mean().item()
    assert accuracy >= 0.9
