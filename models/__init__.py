"""Model builders, instantiated by Hydra from conf/model/*.yaml."""

from __future__ import annotations

from typing import Any

from torch import nn

from models.small_cnn import SmallCNN
from models.torchvision import build_torchvision_model

__all__ = ["SmallCNN", "build_model", "build_torchvision_model"]


def build_model(model_cfg: Any, splits: Any) -> nn.Module:
    """``cfg.model`` (any `_target_`) sized for the data: ``num_classes``, ``in_channels`` and
    ``image_size`` of ``splits`` (data.DataSplits) are passed to the target."""
    from ddp_launcher import instantiate

    return instantiate(
        model_cfg,
        num_classes=splits.num_classes,
        image_size=splits.image_size,
        in_channels=splits.in_channels,
    )
