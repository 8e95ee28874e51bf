"""dataset=imagefolder's default recipe by the size it trains at, decided from the composed
config alone (torch-free: the process that only starts the ranks says it too). The run's first
line says which recipe its size picked and how to override it (:class:`AnnounceRecipe`, a
Hydra callback: said by the process the user started, or by rank 0 of a sweep's job)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

# dataset=imagefolder's default recipe by the size it trains at. conf/dataset/imagefolder.yaml
# picks ImageNet's (random_resized_crop, for 224 px photos); at <= SMALL_IMAGE_PX its crops
# of 8-100 % of the area leave a few pixels of a small image (a 32 px folder of digit scans:
# 81 % val in 10 epochs, 94 % with a padded crop). The padded crop without a flip suits any
# small image (a flip changes a digit's or a letter's meaning).
SMALL_IMAGE_PX = 64
FOLDER_DEFAULT_AUGMENT, FOLDER_SMALL_AUGMENT = "random_resized_crop", "shift"
AUGMENT_DIR = Path(__file__).resolve().parent / "augment"


def _augment_chosen(overrides) -> bool:
    """Whether a command-line override sets the augment group or any augment.* key."""
    for item in overrides:
        key = item.lstrip("+~").split("=", 1)[0].split("@", 1)[0]
        if key == "augment" or key.startswith("augment."):
            return True
    return False


def folder_augment(cfg: Any) -> tuple[Any, str | None]:
    """The `augment` config a run trains with, and for dataset=imagefolder with its default
    recipe left alone (no augment override, no experiment choosing one) the line that says
    which recipe its image size picked and how to override it (None otherwise)."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    from conf.schema import AugmentConfig

    if not HydraConfig.initialized():
        return cfg.augment, None
    hydra_cfg = HydraConfig.get()
    choices = hydra_cfg.runtime.choices
    if choices.get("dataset") != "imagefolder" or choices.get("augment") != FOLDER_DEFAULT_AUGMENT:
        return cfg.augment, None
    if _augment_chosen(hydra_cfg.overrides.task):
        return cfg.augment, None
    size = int(cfg.dataset.image_size)
    if size > SMALL_IMAGE_PX:
        return cfg.augment, (
            f"dataset=imagefolder at {size} px (> {SMALL_IMAGE_PX}): ImageNet's recipe, "
            f"augment={FOLDER_DEFAULT_AUGMENT}; choose another with augment=<choice> "
            f"(e.g. augment={FOLDER_SMALL_AUGMENT})"
        )
    small = OmegaConf.load(AUGMENT_DIR / f"{FOLDER_SMALL_AUGMENT}.yaml")
    small.pop("defaults", None)
    augment = OmegaConf.merge(OmegaConf.structured(AugmentConfig), small)
    return augment, (
        f"dataset=imagefolder at {size} px (<= {SMALL_IMAGE_PX}): the small-image recipe, "
        f"augment={FOLDER_SMALL_AUGMENT} (padded random crop, no flip), not ImageNet's "
        f"{FOLDER_DEFAULT_AUGMENT}; choose one with augment=<choice> (augment=crop_flip for "
        "photos, whose flips keep their meaning)"
    )


class AnnounceRecipe(Callback):
    """Logs folder_augment's line as a job starts (before the task function: the run's first
    line). Ranks that a run's own process started run no callbacks; other ranks of a plain
    torchrun run log errors only: said once per run."""

    def on_job_start(self, config: Any, **kwargs: Any) -> None:
        line = folder_augment(config)[1]
        if line:
            logging.getLogger("train").info("%s", line)
