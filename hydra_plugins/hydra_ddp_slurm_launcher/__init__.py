"""Hydra launcher plugin `hydra/launcher=slurm`: every job of a sweep is a SLURM job whose tasks
are its ranks (one task per GPU, or per CPU rank).

Hydra discovers launchers only inside the `hydra_plugins` namespace package (and instantiates
only classes defined there), so this shim holds the Launcher class and nothing else; the schema
(`DDPSlurmQueueConf`, registered as `hydra/launcher=ddp_slurm`) and the work are in
launch/slurm.py. The project's ready-to-use config is conf/hydra/launcher/slurm.yaml.
"""
