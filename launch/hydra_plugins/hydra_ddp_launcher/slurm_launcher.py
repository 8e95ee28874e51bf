"""`hydra/launcher=slurm` (also `hydra/launcher=ddp_slurm`): every job of a sweep is a SLURM job
whose tasks are its ranks (ddp_launcher/slurm.py)."""

from typing import Any

from hydra.plugins.launcher import Launcher


class DDPSlurmLauncher(Launcher):
    """What Hydra finds and instantiates; the instance is ddp_launcher/slurm.py's
    DDPSlurmLauncherBase, imported only here, when an app has selected the launcher."""

    def __new__(cls, **settings: Any) -> Launcher:
        from ddp_launcher.slurm import DDPSlurmLauncherBase

        return DDPSlurmLauncherBase(**settings)

    # Launcher's abstract methods (Hydra registers concrete classes only); never called: no
    # instance of this class is made.
    def setup(self, **kwargs: Any) -> None:
        raise NotImplementedError

    def launch(self, job_overrides: Any, initial_job_idx: int) -> Any:
        raise NotImplementedError
