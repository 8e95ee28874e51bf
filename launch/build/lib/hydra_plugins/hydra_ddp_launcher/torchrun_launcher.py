"""`hydra/launcher=torchrun`: every job of a sweep is a torchrun job (ddp_launcher/torchrun.py)."""

from ddp_launcher import torchrun  # registers the `hydra/launcher=torchrun` schema


class TorchrunLauncher(torchrun.TorchrunLauncherBase):
    """`hydra/launcher=torchrun` (ddp_launcher/torchrun.py): defined here, where Hydra looks."""
