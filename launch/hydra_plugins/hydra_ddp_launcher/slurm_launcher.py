"""`hydra/launcher=slurm` (conf/hydra/launcher/slurm.yaml): every job of a sweep is a SLURM job
whose
tasks are its ranks (ddp_launcher/slurm.py)."""

from ddp_launcher import slurm  # registers the `hydra/launcher=ddp_slurm` schema


class DDPSlurmLauncher(slurm.DDPSlurmLauncherBase):
    """`hydra/launcher=slurm` (ddp_launcher/slurm.py): defined here, where Hydra looks."""
