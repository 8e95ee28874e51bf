"""`hydra/launcher=torchrun` (also `hydra/launcher=ddp_torchrun`): every job of a sweep is a
torchrun job (ddp_launcher/torchrun.py)."""

from typing import Any

from hydra.plugins.launcher import Launcher


class TorchrunLauncher(Launcher):
    """What Hydra finds and instantiates; the instance is ddp_launcher/torchrun.py's
    TorchrunLauncherBase, imported only here, when an app has selected the launcher."""

    def __new__(cls, **settings: Any) -> Launcher:
        from ddp_launcher.torchrun import TorchrunLauncherBase

        return TorchrunLauncherBase(**settings)

    # Launcher's abstract methods (Hydra registers concrete classes only); never called: no
    # instance of this class is made.
    def setup(self, **kwargs: Any) -> None:
        raise NotImplementedError

    def launch(self, job_overrides: Any, initial_job_idx: int) -> Any:
        raise NotImplementedError
