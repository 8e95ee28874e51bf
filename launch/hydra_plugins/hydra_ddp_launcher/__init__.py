"""Hydra's plugins of hydra-ddp-launcher (launch/README.md): `hydra/launcher=torchrun`,
`hydra/launcher=slurm` and `hydra/sweeper=optuna`.

Hydra discovers plugins only inside the `hydra_plugins` namespace package and instantiates only
classes defined there, so these modules hold the Launcher and Sweeper classes and nothing else;
their schemas and the work are in the `ddp_launcher` package beside this one. conf/ holds the
ready-to-use `hydra/launcher=slurm`, on every app's search path (searchpath.py).
"""
