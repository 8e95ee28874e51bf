"""A small CNN for 8x8 digits, 28x28 MNIST-sized and 32x32 CIFAR-sized inputs.

Built by Hydra from conf/model/small_cnn.yaml (schema: conf.schema.SmallCNNConfig) as
``instantiate(cfg.model, num_classes=N, in_channels=C, image_size=S)``.
"""

from __future__ import annotations

from collections.abc import Sequence

from ddp_launcher import UserError
from torch import Tensor, nn

__all__ = ["SmallCNN"]


class SmallCNN(nn.Module):
    """Conv stack -> flatten -> Linear(hidden) -> ReLU -> Dropout -> Linear(num_classes).

    One block per entry of ``channels``: 3x3 conv (padding 1) [-> BatchNorm if batch_norm] ->
    ReLU, then a 2x2 max-pool only while the pooled size stays >= 2 (8x8: 8->4->2; 28x28:
    28->14->7; 32x32: 32->16->8 for the default two blocks). No BatchNorm unless asked for.
    The parameter count depends only on the arguments.
    """

    def __init__(
        self,
        num_classes: int,
        in_channels: int = 1,
        image_size: int = 8,
        channels: Sequence[int] = (32, 64),
        hidden: int = 128,
        dropout: float = 0.0,
        batch_norm: bool = False,
    ) -> None:
        super().__init__()
        channels = tuple(int(c) for c in channels)  # also takes Hydra's ListConfig
        for arg, value in (
            ("num_classes", num_classes),
            ("in_channels", in_channels),
            ("image_size", image_size),
        ):
            if value < 1:
                raise UserError(
                    f"SmallCNN needs {arg} >= 1, got {value}: check the dataset config "
                    "(dataset=...)"
                )
        if any(c < 1 for c in channels):
            raise UserError(
                f"model.channels must all be >= 1, got {list(channels)}: "
                "e.g. model.channels=[32,64]"
            )
        if hidden < 1:
            raise UserError(f"model.hidden must be >= 1, got {hidden}: e.g. model.hidden=128")
        if not 0.0 <= dropout < 1.0:
            raise UserError(
                f"model.dropout must be in [0, 1), got {dropout}: e.g. model.dropout=0.1"
            )

        layers: list[nn.Module] = []
        size, prev = image_size, in_channels
        for out in channels:
            layers.append(nn.Conv2d(prev, out, kernel_size=3, padding=1, bias=not batch_norm))
            if batch_norm:
                layers.append(nn.BatchNorm2d(out))
            layers.append(nn.ReLU())
            if size // 2 >= 2:
                layers.append(nn.MaxPool2d(2))
                size //= 2
            prev = out
        self.features = nn.Sequential(*layers)
        self.feature_shape = (prev, size, size)  # what the classifier flattens
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(prev * size * size, hidden),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(x))
