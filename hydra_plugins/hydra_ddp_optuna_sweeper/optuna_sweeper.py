"""Hydra sweeper plugin `hydra/sweeper=optuna`.

Hydra discovers sweepers only inside the `hydra_plugins` namespace package (and instantiates
only classes defined there), so this shim holds the Sweeper class and nothing else; the schema
(`OptunaSweeperConf`) and the work are in launch/sweeper/sweeper.py.
"""

from launch.sweeper import sweeper  # registers the `hydra/sweeper=optuna` schema


class OptunaSweeper(sweeper.OptunaSweeperBase):
    """`hydra/sweeper=optuna` (launch/sweeper/sweeper.py): defined here, where Hydra looks."""
