from launch import slurm  # registers the `hydra/launcher=ddp_slurm` schema


class DDPSlurmLauncher(slurm.DDPSlurmLauncherBase):
    """`hydra/launcher=slurm` (launch/slurm.py): defined here, where Hydra looks."""
