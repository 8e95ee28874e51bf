"""Batch-level augmentation: MixUp and CutMix (torchvision.transforms.v2) with soft targets.

`trainer.mixup` (conf/schema.py MixupConfig) as timm's --mixup/--cutmix/--mixup-prob/
--mixup-switch-prob. A mixed batch's labels are class probabilities [B, num_classes], which
F.cross_entropy takes as they are (label smoothing applies on top).

Randomness: the mixing weight, the CutMix box and the choices are drawn from torch's CPU RNG
seeded by (seed, epoch, batch index in the epoch) only, so a resumed run mixes exactly as the
uninterrupted one, on either data path. Every rank draws the same numbers, but v2.MixUp pairs
each sample with its neighbour in the rank's own batch, so the pairs (and the weights learned)
depend on the world size.
"""

from __future__ import annotations

import torch
from torchvision.transforms import v2

from core.errors import UserError
from data.seeding import mix_seed, seeded

_MIX_STREAM = 0x6D6978  # keeps these seeds apart from the per-sample ones


class BatchMix:
    """``mix(x, y, epoch, batch)`` -> ``(x, y)``: mixed with probability ``prob`` (labels then
    soft, float ``[B, num_classes]``), else returned as they are."""

    def __init__(self, cfg, num_classes: int, seed: int) -> None:
        mixup, cutmix = float(cfg.mixup_alpha), float(cfg.cutmix_alpha)
        prob, switch = float(cfg.prob), float(cfg.switch_prob)
        for key, value, ok in (
            ("mixup_alpha", mixup, mixup >= 0),
            ("cutmix_alpha", cutmix, cutmix >= 0),
            ("prob", prob, 0 <= prob <= 1),
            ("switch_prob", switch, 0 <= switch <= 1),
        ):
            if not ok:
                raise UserError(
                    f"trainer.mixup.{key}={value} is out of range: alphas >= 0, "
                    "probabilities in [0, 1]"
                )
        self.seed = int(seed)
        options = []
        if mixup > 0:
            options.append((v2.MixUp(alpha=mixup, num_classes=num_classes), 1 - switch))
        if cutmix > 0:
            options.append((v2.CutMix(alpha=cutmix, num_classes=num_classes), switch))
        self.enabled = bool(options) and prob > 0
        if len(options) == 2:
            choice = v2.RandomChoice([t for t, _ in options], p=[p for _, p in options])
        else:
            choice = options[0][0] if options else v2.Identity()
        self.transform = v2.RandomApply([choice], p=prob)

    def __call__(
        self, x: torch.Tensor, y: torch.Tensor, epoch: int, batch: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.enabled:
            return x, y
        # The CPU generator only (what v2.MixUp/CutMix draw from), restored after: CUDA's
        # generators are left alone (torch.manual_seed would reseed them too).
        with seeded(mix_seed(self.seed, epoch, batch, _MIX_STREAM)):
            return self.transform(x, y)
