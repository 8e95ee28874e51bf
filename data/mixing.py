"""Batch-level augmentation: MixUp and CutMix (torchvision.transforms.v2) with soft targets.

`trainer.mixup` (conf/schema.py MixupConfig) as timm's --mixup/--cutmix/--mixup-prob/
--mixup-switch-prob. A mixed batch's labels are class probabilities [B, num_classes], which
F.cross_entropy takes as they are (label smoothing applies on top).

Randomness: the mixing weight, the CutMix box and the choices are drawn from torch's CPU RNG
seeded by (seed, epoch, global batch index in the epoch) only, so a resumed run mixes exactly as
the uninterrupted one, on either data path, and every rank draws the same numbers.

Pairs: v2.MixUp/CutMix pair each sample with its neighbour in the batch they are given, which
in DDP is one rank's share of the global batch: the pairs would depend on the world size. Here
each rank's batch is mixed half against half: sample j with sample j + b/2 (b: the per-rank
batch). A DistributedSampler gives rank r of W the global positions r, r + W, r + 2W, ... of
each global batch of size W*b, so local j and j + b/2 are global positions p and p + W*b/2:
the same pairs, never straddling ranks, at any world size with the same global batch (an even
per-rank batch; with an odd one the last sample of each rank's batch stays unmixed). The halves
go to v2.MixUp/CutMix as a batch of two (each half's images stacked along channels), whose
roll by one swaps them: the library's draws and formulas, our pairing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from ddp_launcher import UserError
from torchvision.transforms import v2

from data.seeding import mix_seed, seeded

_MIX_STREAM = 0x6D6978  # keeps these seeds apart from the per-sample ones


class BatchMix:
    """``mix(x, y, epoch, batch)`` -> ``(x, y)``: mixed with probability ``prob``, else the
    images as they are; when enabled the labels are always class probabilities, float
    ``[B, num_classes]`` (one-hot where unmixed). ``batch``: the global batch's index in the
    epoch (optimizer step x accumulation + micro-batch), the same on every rank."""

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
        self.seed, self.num_classes = int(seed), int(num_classes)
        options = []  # labels arrive one-hot (see __call__): no num_classes for v2
        if mixup > 0:
            options.append((v2.MixUp(alpha=mixup), 1 - switch))
        if cutmix > 0:
            options.append((v2.CutMix(alpha=cutmix), switch))
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
        b, c, h, w = x.shape
        half = b // 2
        soft = F.one_hot(y, self.num_classes).float() if y.ndim == 1 else y.float()
        if half == 0:
            return x, soft
        paired = 2 * half  # an odd batch's last sample stays as it is
        halves = x[:paired].reshape(2, half * c, h, w)
        labels = soft[:paired].reshape(2, half * self.num_classes)
        # The CPU generator only (what v2.MixUp/CutMix draw from), restored after: CUDA's
        # generators are left alone (torch.manual_seed would reseed them too).
        with seeded(mix_seed(self.seed, epoch, batch, _MIX_STREAM)):
            halves, labels = self.transform(halves, labels)
        mixed = halves.reshape(paired, c, h, w)
        labels = labels.reshape(paired, self.num_classes)
        if paired < b:
            mixed, labels = torch.cat([mixed, x[paired:]]), torch.cat([labels, soft[paired:]])
        return mixed, labels
