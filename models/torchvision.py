"""Any torchvision classification model by name, randomly initialised, adapted to the data.

Built by Hydra from conf/model/<choice>.yaml (schema: conf.schema.TorchvisionModelConfig) as
``instantiate(cfg.model, num_classes=N, in_channels=C, image_size=S)``. Pretrained weights are
never loaded (``weights=None``).

Adaptations, both done by replacing the network's first Conv2d (``_replace_first_conv``):
- ``in_channels != 3`` (e.g. grayscale): the first conv takes ``in_channels`` input channels.
- ``small_input_stem=True`` (32x32-sized inputs, resnet/resnext/wide_resnet only): the first conv
  becomes 3x3 stride 1 padding 1 and the stem max-pool an Identity, so the stem keeps the input's
  spatial size instead of dividing it by 4.
"""

from __future__ import annotations

import difflib
import re
from functools import lru_cache

import torchvision
from ddp_launcher import UserError
from torch import nn
from torchvision.models import ResNet

__all__ = ["build_torchvision_model", "classification_model_names"]

# Families whose stem is conv1 (7x7 stride 2) + maxpool (stride 2): the ones small_input_stem
# knows how to rewrite. All of them are torchvision.models.ResNet.
SMALL_STEM_FAMILIES = ("resnet", "resnext", "wide_resnet")

_VIT_NAME = re.compile(r"vit_[a-z]_(\d+)")  # vit_b_16, vit_l_32, vit_h_14: the number is the patch

_HOW_TO_CHOOSE = (
    "use model=<choice> or model=torchvision model.name=<one of "
    "torchvision.models.list_models(module=torchvision.models)>"
)


@lru_cache(maxsize=1)
def classification_model_names() -> tuple[str, ...]:
    """Names ``build_torchvision_model`` accepts: torchvision's classification models."""
    return tuple(torchvision.models.list_models(module=torchvision.models))


def _check_name(name: str) -> str:
    key = name.strip().lower()
    choices = classification_model_names()
    if key in choices:
        return key
    if key in torchvision.models.list_models():
        raise UserError(
            f"torchvision model {name!r} is not a classification model: {_HOW_TO_CHOOSE}"
        )
    close = difflib.get_close_matches(key, choices, n=3)
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    raise UserError(f"unknown torchvision classification model {name!r}{hint}: {_HOW_TO_CHOOSE}")


def _first_conv(model: nn.Module) -> tuple[str, nn.Conv2d]:
    """The network's first Conv2d (registration order), i.e. the one that sees the image."""
    for module_name, module in model.named_modules():
        if isinstance(module, nn.Conv2d):
            return module_name, module
    raise UserError(
        f"{type(model).__name__} has no Conv2d to adapt: use a CNN/ViT model, or 3-channel "
        "inputs without model.small_input_stem"
    )


def _replace_first_conv(
    model: nn.Module,
    *,
    in_channels: int | None = None,
    kernel_size: int | None = None,
    stride: int | None = None,
    padding: int | None = None,
) -> nn.Conv2d:
    """Swap the first Conv2d for a freshly initialised one; unset arguments keep the old values.

    Out channels, dilation, groups, bias and padding mode always stay. Returns the new conv.
    """
    module_name, old = _first_conv(model)
    new = nn.Conv2d(
        in_channels if in_channels is not None else old.in_channels,
        old.out_channels,
        kernel_size=kernel_size if kernel_size is not None else old.kernel_size,
        stride=stride if stride is not None else old.stride,
        padding=padding if padding is not None else old.padding,
        dilation=old.dilation,
        groups=old.groups,
        bias=old.bias is not None,
        padding_mode=old.padding_mode,
        device=old.weight.device,
        dtype=old.weight.dtype,
    )
    model.set_submodule(module_name, new)
    return new


def build_torchvision_model(
    name: str,
    num_classes: int,
    in_channels: int = 3,
    image_size: int = 224,
    small_input_stem: bool = False,
) -> nn.Module:
    """A randomly initialised torchvision classification model, adapted to the input shape.

    Args:
        name: a name from ``torchvision.models.list_models(module=torchvision.models)``.
        num_classes: size of the classifier output.
        in_channels: image channels; the first conv is replaced when this is not 3.
        image_size: side of the (square) input; ViT models are built for it.
        small_input_stem: 3x3 stride-1 first conv and no stem max-pool (resnet/resnext/
            wide_resnet only), for 32x32-sized inputs.

    Raises:
        UserError: unknown or non-classification name, an image size a ViT cannot patchify,
            small_input_stem on a family without a conv+max-pool stem, or non-positive sizes.
    """
    key = _check_name(name)
    for arg, value in (
        ("num_classes", num_classes),
        ("in_channels", in_channels),
        ("image_size", image_size),
    ):
        if int(value) < 1:
            raise UserError(
                f"{key} needs {arg} >= 1, got {value}: check the dataset config (dataset=...)"
            )
    if small_input_stem and not key.startswith(SMALL_STEM_FAMILIES):
        raise UserError(
            f"model.small_input_stem=true is supported only by the "
            f"{'/'.join(SMALL_STEM_FAMILIES)} families, not {key!r}: set "
            "model.small_input_stem=false or use e.g. model=resnet18"
        )

    extra: dict = {}
    vit = _VIT_NAME.fullmatch(key)
    if vit:
        patch = int(vit.group(1))
        if image_size % patch:
            raise UserError(
                f"{key} splits images into {patch}x{patch} patches but the image size is "
                f"{image_size}: use a dataset whose image size is a multiple of {patch} "
                f"or another model"
            )
        extra["image_size"] = image_size
    elif key == "maxvit_t":
        # Its attention grid is fixed at construction; build it for the real input size.
        extra["input_size"] = (image_size, image_size)
    elif key in ("googlenet", "inception_v3"):
        # Auxiliary heads make forward() return a namedtuple in train mode: plain logits only.
        # init_weights=True is what weights=None does anyway, minus a FutureWarning.
        extra.update(aux_logits=False, init_weights=True)

    try:
        model = torchvision.models.get_model(key, weights=None, num_classes=num_classes, **extra)
    except ValueError as e:
        if key != "maxvit_t":
            raise
        # maxvit_t: an input size its attention partitions cannot divide.
        first_line = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(
            f"{key} cannot be built for {image_size}x{image_size} inputs ({first_line}): "
            "use another model or image size"
        ) from e

    if small_input_stem:
        if not isinstance(model, ResNet):  # guards SMALL_STEM_FAMILIES against drift
            raise UserError(
                f"model.small_input_stem=true: {key!r} has no resnet-style stem: set "
                "model.small_input_stem=false"
            )
        _replace_first_conv(model, in_channels=in_channels, kernel_size=3, stride=1, padding=1)
        model.maxpool = nn.Identity()
    elif in_channels != 3:
        _replace_first_conv(model, in_channels=in_channels)
    return model
