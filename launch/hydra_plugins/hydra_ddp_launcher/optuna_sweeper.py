"""`hydra/sweeper=optuna` (also `hydra/sweeper=ddp_optuna`, the name to use where
hydra-optuna-sweeper is installed too): ddp_launcher/sweeper/sweeper.py."""

from typing import Any

from hydra.plugins.sweeper import Sweeper


class OptunaSweeper(Sweeper):
    """What Hydra finds and instantiates; the instance is ddp_launcher/sweeper/sweeper.py's
    OptunaSweeperBase, imported only here, when an app has selected the sweeper."""

    def __new__(cls, **settings: Any) -> Sweeper:
        from ddp_launcher.sweeper.sweeper import OptunaSweeperBase

        return OptunaSweeperBase(**settings)

    # Sweeper's abstract methods (Hydra registers concrete classes only); never called: no
    # instance of this class is made.
    def setup(self, **kwargs: Any) -> None:
        raise NotImplementedError

    def sweep(self, arguments: list[str]) -> Any:
        raise NotImplementedError
