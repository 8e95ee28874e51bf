"""Where Hydra finds this package's configs, and the line that says so when another plugin
registers one of their names.

Plugins usually store their configs in Hydra's ConfigStore when the plugin scan imports them,
which Hydra does for every app in the environment on every start, and each stored config class
is converted to a config there and then (milliseconds each). This package's configs come from a
config source of its own instead (:class:`DDPLauncherConfigs`, `hydra-ddp-launcher://`), which
:class:`DDPLauncherSearchPath` puts on every app's search path, after the app's own dirs (an
app's file of the same name wins): a name costs a lookup, and a config is made from its class
only when an app composes it.

Each name also has an alias no other plugin has (ALIASES). A name that another installed plugin
(or the app) stores in the ConfigStore stays theirs, whatever the order of the plugin scan: this
source leaves it to them, and one line at start names both plugins and the alias, which selects
this package's. Apps that run through the package's entry point (ddp_launcher.entry_point) also
get `hydra/job_logging=other_ranks`, the logging of ranks other than 0 under plain torchrun.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from hydra.core.config_search_path import ConfigSearchPath
from hydra.core.object_type import ObjectType
from hydra.plugins.config_source import ConfigLoadError, ConfigResult, ConfigSource
from hydra.plugins.search_path_plugin import SearchPathPlugin

PACKAGE = "hydra-ddp-launcher"
SCHEME = "hydra-ddp-launcher"
ENTRY = "entry"  # the source's path in an app run through ddp_launcher.entry_point
# config path -> "module:attribute" (a config class, or a function of the config's name)
LAUNCHER, SLURM, SWEEPER = (
    "ddp_launcher.torchrun:TorchrunLauncherConf",
    "ddp_launcher.slurm:DDPSlurmQueueConf",
    "ddp_launcher.sweeper.sweeper:OptunaSweeperConf",
)
CONFIGS = {
    "hydra/launcher/torchrun": LAUNCHER,
    "hydra/launcher/ddp_torchrun": LAUNCHER,
    "hydra/launcher/slurm": SLURM,
    "hydra/launcher/ddp_slurm": SLURM,
    "hydra/sweeper/optuna": SWEEPER,
    "hydra/sweeper/ddp_optuna": SWEEPER,
    # ddp_launcher/sweeper/sweeper.py's SAMPLERS and core/trials.py's PRUNER_CONFS, typed
    # (launch/tests/test_plugin.py checks)
    **{
        f"hydra/sweeper/sampler/{name}": "ddp_launcher.sweeper.sweeper:sampler_config"
        for name in ("tpe", "random", "cmaes", "nsgaii", "qmc", "gp", "grid")
    },
    **{
        f"hydra/sweeper/pruner/{name}": "ddp_launcher.sweeper.sweeper:pruner_config"
        for name in ("median", "percentile", "hyperband", "successive_halving", "none")
    },
}
ALIASES = {
    "hydra/launcher/torchrun": "hydra/launcher=ddp_torchrun",
    "hydra/launcher/slurm": "hydra/launcher=ddp_slurm",
    "hydra/sweeper/optuna": "hydra/sweeper=ddp_optuna",
}
OTHER_RANKS = "hydra/job_logging/other_ranks"  # entry-point apps only: conf/'s file
CONF = Path(__file__).resolve().parent / "conf"

_said = False  # the collision line: once per process


class DDPLauncherSearchPath(SearchPathPlugin):
    """Hydra creates every app's search path with this (after the plugin scan, before it
    composes anything): the package's config source goes on it, and where another plugin has
    one of its names, one line says so."""

    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        entry = sys.modules.get("ddp_launcher.ranks.entry")
        path = ENTRY if getattr(entry, "ENTERED", False) else ""
        search_path.append(provider=PACKAGE, path=f"{SCHEME}://{path}")
        say_collisions()


class DDPLauncherConfigs(ConfigSource):
    """The package's configs (CONFIGS), each made when it is loaded; none of the names that
    Hydra's ConfigStore holds (another plugin's, or the app's)."""

    @staticmethod
    def scheme() -> str:
        return SCHEME

    def names(self) -> list[str]:
        names = [path for path in CONFIGS if not stored_elsewhere(path)]
        return [*names, OTHER_RANKS] if self.path == ENTRY else names

    def available(self) -> bool:
        return True

    def is_config(self, config_path: str) -> bool:
        return config_path.strip("/").removesuffix(".yaml") in self.names()

    def is_group(self, config_path: str) -> bool:
        group = config_path.strip("/")
        return any(name.startswith(f"{group}/") or not group for name in self.names())

    def list(self, config_path: str, results_filter: ObjectType | None) -> list[str]:
        group = config_path.strip("/")
        prefix = f"{group}/" if group else ""
        found = set()
        for name in self.names():
            if not name.startswith(prefix):
                continue
            head, _, rest = name[len(prefix) :].partition("/")
            kind = ObjectType.GROUP if rest else ObjectType.CONFIG
            if results_filter in (None, kind):
                found.add(head)
        return sorted(found)

    def load_config(self, config_path: str) -> ConfigResult:
        from omegaconf import OmegaConf

        path = config_path.strip("/").removesuffix(".yaml")
        if not self.is_config(path):
            raise ConfigLoadError(f"{SCHEME}: no config {config_path}")
        if path == OTHER_RANKS:
            config = OmegaConf.load(CONF / f"{path}.yaml")
        else:
            config = make_config(CONFIGS[path], path.rpartition("/")[2])
        return ConfigResult(
            provider=self.provider, path=self.full_path(), config=config, header={"package": None}
        )


def make_config(where: str, name: str) -> Any:
    """The config at `where` ("module:attribute"): a config class's, or a function's for `name`."""
    import importlib

    from omegaconf import OmegaConf

    module, _, attribute = where.partition(":")
    made = getattr(importlib.import_module(module), attribute)
    if not isinstance(made, type):  # a function of the config's name: its class, or its dict
        made = made(name)
    return OmegaConf.structured(made) if isinstance(made, type) else OmegaConf.create(made)


def stored_elsewhere(path: str) -> bool:
    """Whether Hydra's ConfigStore holds config `path` (stored by another plugin or the app)."""
    from hydra.core.config_store import ConfigStore

    return ConfigStore.instance().get_type(f"{path}.yaml") == ObjectType.CONFIG


def say_collisions() -> None:
    """One line per other plugin that stores one of the package's names (once per process, on
    the launcher's side: not in every rank of plain torchrun)."""
    global _said
    if _said or os.environ.get("RANK", "0") != "0":
        return
    _said = True
    for line in collisions():
        print(line, file=sys.stderr, flush=True)


def collisions() -> list[str]:
    """The lines: for each other plugin (or the app) whose ConfigStore entries take names of
    this package's, which names, and the aliases that select this package's."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    owners: dict[Any, list[str]] = {}
    names: dict[Any, str] = {}
    for path in CONFIGS:
        if not stored_elsewhere(path):
            continue
        node = store.load(f"{path}.yaml")
        owners.setdefault(node.provider, []).append(path)
        plugin = plugin_of(node.node)
        if plugin is not None:
            names[node.provider] = plugin
    lines = []
    for provider, paths in owners.items():
        owner = names.get(provider) or (f"provider {provider}" if provider else "the app")
        groups: dict[str, list[str]] = {}
        for path in paths:
            group, _, name = path.rpartition("/")
            groups.setdefault(group, []).append(name)
        taken = " and ".join(f"{group}={','.join(sorted(n))}" for group, n in groups.items())
        aliases = " and ".join(ALIASES[path] for path in paths if path in ALIASES)
        mine = (
            f"{aliases} selects {PACKAGE}'s"
            if aliases
            else f"{PACKAGE}'s sweeper (hydra/sweeper=ddp_optuna) takes them"
        )
        lines.append(
            f"{PACKAGE}: {owner} registers {taken} too; here those names select its configs "
            f"(whatever the plugin scan's order), and {mine}"
        )
    return lines


def plugin_of(node: Any) -> str | None:
    """The plugin a stored config belongs to, by its `_target_`: its distribution and version
    where installed (hydra-optuna-sweeper 1.3.0), else its package (hydra_plugins.<name>)."""
    from importlib import metadata

    target = str(node.get("_target_", "")) if hasattr(node, "get") else ""
    parts = target.split(".")
    if parts[0] != "hydra_plugins" or len(parts) < 3:
        return None
    package = ".".join(parts[:2])
    try:
        dist = metadata.distribution(parts[1].replace("_", "-"))
        owns = any(str(f).startswith(f"hydra_plugins/{parts[1]}/") for f in dist.files or ())
        if owns:
            return f"{dist.metadata['Name']} {dist.version} ({package})"
    except metadata.PackageNotFoundError:
        pass
    return package
