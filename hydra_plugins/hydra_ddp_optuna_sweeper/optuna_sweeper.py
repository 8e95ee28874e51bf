"""Hydra sweeper plugin `hydra/sweeper=ddp_optuna`: the Optuna sweeper that continues a sweep's
study when `hydra.launcher.resume=true`.

Hydra discovers sweepers only inside the `hydra_plugins` namespace package (and instantiates
only classes defined there), so this shim holds the Sweeper class and nothing else; the schema
(`DDPOptunaSweeperConf`, registered as `hydra/sweeper=ddp_optuna`) and the work are in
launch/optuna_sweeper.py.
"""

from launch import optuna_sweeper  # registers the `hydra/sweeper=ddp_optuna` schema


class DDPOptunaSweeper(optuna_sweeper.DDPOptunaSweeperBase):
    """`hydra/sweeper=ddp_optuna` (launch/optuna_sweeper.py): defined here, where Hydra looks."""
