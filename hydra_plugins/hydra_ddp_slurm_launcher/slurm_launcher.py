from collections.abc import Sequence
from typing import Any

from hydra.core.utils import JobReturn
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher


class DDPSlurmLauncher(SlurmLauncher):
    """hydra-submitit-launcher's SlurmLauncher with one SLURM task per rank.

    launch(): each job's resources from its own `dist` config (jobs asking for the same go out
    as one array), then rank 0's JobReturn per job. __call__ (in every task): the SLURM ->
    torch environment, rank 0 as the Hydra job, the other ranks writing nothing.
    """

    def __call__(
        self,
        sweep_overrides: list[str],
        job_dir_key: str,
        job_num: int,
        job_id: str,
        singleton_state: dict[Any, Any],
    ) -> JobReturn | None:
        from launch.slurm import run_task

        return run_task(self, sweep_overrides, job_dir_key, job_num, singleton_state)

    def launch(
        self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int
    ) -> Sequence[JobReturn]:
        from launch.slurm import launch_sweep_batch

        return launch_sweep_batch(self, job_overrides, initial_job_idx)
