"""Model builders, instantiated by Hydra from conf/model/*.yaml."""

from models.small_cnn import SmallCNN
from models.torchvision import build_torchvision_model

__all__ = ["SmallCNN", "build_torchvision_model"]
