"""Hydra sweeper plugin `hydra/sweeper=optuna`.

Hydra discovers sweepers only inside the `hydra_plugins` namespace package (and instantiates
only classes defined there), so this shim holds the Sweeper class and nothing else; the schema
(`OptunaSweeperConf`) and the work are in ddp_launcher/sweeper/sweeper.py.
"""

from ddp_launcher.sweeper import sweeper  # registers the `hydra/sweeper=optuna` schema


class OptunaSweeper(sweeper.OptunaSweeperBase):
    """`hydra/sweeper=optuna` (ddp_launcher/sweeper/sweeper.py): defined here, where Hydra looks."""
