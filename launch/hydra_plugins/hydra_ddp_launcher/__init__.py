"""Hydra's plugins of hydra-ddp-launcher (launch/README.md): `hydra/launcher=torchrun`,
`hydra/launcher=slurm` and `hydra/sweeper=optuna` (also `ddp_torchrun`, `ddp_slurm`,
`ddp_optuna`: names no other plugin has).

Hydra's plugin scan imports every module here for every Hydra app in the environment, on every
start, and Hydra instantiates only classes defined here: so these modules hold thin classes that
import nothing of the package until an app selects one (each makes its implementation's instance
from the `ddp_launcher` package beside this one), and the configs come from a config source of
the package's own that makes a config only when an app composes it (searchpath.py).
"""
