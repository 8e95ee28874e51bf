"""Hydra sweeper plugin `hydra/sweeper=optuna` (also `ddp_optuna`, its earlier name).

Hydra discovers sweepers only inside the `hydra_plugins` namespace package (and instantiates
only classes defined there), so this shim holds the Sweeper class and nothing else; the schema
(`OptunaSweeperConf`) and the work are in search/sweeper.py.
"""

from search import sweeper  # registers the `hydra/sweeper=optuna` schema


class OptunaSweeper(sweeper.OptunaSweeperBase):
    """`hydra/sweeper=optuna` (search/sweeper.py): defined here, where Hydra looks."""
