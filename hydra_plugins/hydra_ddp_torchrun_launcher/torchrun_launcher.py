from collections.abc import Sequence
from typing import Any

from hydra.core.utils import JobReturn
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig


class TorchrunLauncher(Launcher):
    def __init__(self, **settings: Any) -> None:
        self.settings_dict = settings
        self.config: DictConfig | None = None
        self.task_function: TaskFunction | None = None
        self.hydra_context: HydraContext | None = None

    def setup(
        self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig
    ) -> None:
        self.config = config
        self.task_function = task_function
        self.hydra_context = hydra_context

    @property
    def settings(self):
        from launch.torchrun import LauncherSettings

        return LauncherSettings.from_config(self.settings_dict)

    def launch(
        self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int
    ) -> Sequence[JobReturn]:
        from launch.torchrun import launch_sweep_batch

        return launch_sweep_batch(self, job_overrides, initial_job_idx)
