from launch import torchrun  # registers the `hydra/launcher=torchrun` schema


class TorchrunLauncher(torchrun.TorchrunLauncherBase):
    """`hydra/launcher=torchrun` (launch/torchrun.py): defined here, where Hydra looks."""
