"""Hydra launcher plugin `hydra/launcher=slurm`: every job of a sweep is a SLURM job whose tasks
are its ranks (one task per GPU, or per CPU rank).

A subclass of hydra-submitit-launcher's SlurmLauncher; Hydra discovers launchers only inside
the `hydra_plugins` namespace package, so this thin shim lives here and the work is done in
launch/slurm.py. The project's ready-to-use config is conf/hydra/launcher/slurm.yaml (it extends
the `ddp_slurm` schema registered in config.py).
"""
