"""Puts this package's conf/ (hydra/launcher/slurm.yaml) on every Hydra app's search path, the
way Hydra's own example_searchpath_plugin does: after the app's own config dirs, so an app's
file of the same name wins."""

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin


class DDPLauncherSearchPath(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        search_path.append(
            provider="hydra-ddp-launcher", path="pkg://hydra_plugins.hydra_ddp_launcher.conf"
        )
