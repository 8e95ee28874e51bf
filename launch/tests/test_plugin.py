"""A pure plugin: installing the package changes no other Hydra app.

Hydra's plugin scan (every app, every start) imports none of the package and patches nothing;
the package's configs come from its own config source (hydra_plugins/hydra_ddp_launcher/
searchpath.py), made only when an app composes one; a plain app's groups gain the launchers and
sweepers and nothing else; a dry run is set up by the launcher once an app selects it. Where
another plugin registers one of the package's names (here a fake `hydra/launcher=torchrun`,
scanned before and after the package), that name is the other plugin's, and one line at start
names both plugins and the alias that selects the package's. hydra-optuna-sweeper itself:
launch/tests/test_collisions.py (its own venv).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.core.config_store import ConfigStore
from hydra.core.object_type import ObjectType
from hydra_plugins.hydra_ddp_launcher import searchpath
from hydra_plugins.hydra_ddp_launcher.searchpath import CONFIGS, DDPLauncherConfigs, collisions

from tests.helpers import output, run_env

OURS = {"torchrun", "ddp_torchrun", "slurm", "ddp_slurm", "optuna", "ddp_optuna", "other_ranks"}
SWEEPER_GROUPS = {"hydra/launcher", "hydra/sweeper", "hydra/sweeper/sampler"}

# Hydra's scan as any app's start runs it, then a plain config composed (no plugin of ours
# selected), then one that selects the torchrun launcher.
SCAN = """\
import json, sys
from hydra import compose, initialize
from hydra.core.plugins import Plugins
from hydra._internal.hydra import Hydra
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra._internal.core_plugins.file_config_source import FileConfigSource

def ours():
    return sorted(m for m in sys.modules if m.startswith("ddp_launcher"))

Plugins.instance()
found = {
    "scan": ours(),
    "heavy": sorted(m for m in ("torch", "optuna", "cloudpickle", "wandb") if m in sys.modules),
    "patched": [
        f"{f.__module__}.{f.__qualname__}" for f in (
            Hydra.multirun, BasicSweeper.sweep, FileConfigSource.load_config
        )
        if hasattr(f, "previews") or hasattr(f, "names_yaml_errors")
    ] + [f"{f.__module__}" for f in (Hydra.multirun, BasicSweeper.sweep)
         if not f.__module__.startswith("hydra.")],
    "plugins": sorted(n for n in Plugins.instance().class_name_to_class if "ddp" in n),
}
with initialize(version_base=None, config_path=None):
    compose(overrides=["+x=1"], return_hydra_config=True)
    found["plain"] = ours()
    try:
        cfg = compose(overrides=["hydra/launcher=torchrun"], return_hydra_config=True)
        found["torchrun"] = [cfg.hydra.launcher._target_, cfg.hydra.launcher.get("nproc_per_node")]
    except Exception as e:
        found["torchrun"] = repr(e)
print(json.dumps(found))
"""
PLAIN_APP = """\
import hydra

@hydra.main(version_base=None, config_path=None, config_name=None)
def main(cfg):
    print("x =", cfg.x)

if __name__ == "__main__":
    main()
"""
FAKE_TORCHRUN = """\
from dataclasses import dataclass
from hydra.core.config_store import ConfigStore
from hydra.plugins.launcher import Launcher

@dataclass
class FakeConf:
    _target_: str = "hydra_plugins.fake_torchrun.FakeLauncher"
    nproc_per_node: int = 1

class FakeLauncher(Launcher):
    def setup(self, **kwargs):
        pass

    def launch(self, job_overrides, initial_job_idx):
        return []

ConfigStore.instance().store(
    group="hydra/launcher", name="torchrun", node=FakeConf, provider="fake"
)
"""


def python(code_or_file: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *code_or_file],
        cwd=cwd,
        env=run_env(**env),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_plugin_scan_imports_nothing_of_the_package_and_patches_nothing(
    tmp_path: Path,
) -> None:
    """After Hydra's scan (every app's start) no module of ddp_launcher is imported, nor torch
    or optuna, and Hydra's multirun, the basic sweeper and the file config source are Hydra's
    own; the plugins are registered all the same. A plain config imports none of the package
    either; selecting the launcher makes its config, with torchrun's keys."""
    proc = python(["-c", SCAN], tmp_path)
    assert proc.returncode == 0, output(proc)[-3000:]
    found = json.loads(proc.stdout.splitlines()[-1])
    assert found["scan"] == [] and found["plain"] == [], found
    assert found["heavy"] == [] and found["patched"] == [], found
    module = "hydra_plugins.hydra_ddp_launcher"
    assert set(found["plugins"]) >= {
        f"{module}.torchrun_launcher.TorchrunLauncher",
        f"{module}.slurm_launcher.DDPSlurmLauncher",
        f"{module}.optuna_sweeper.OptunaSweeper",
        f"{module}.searchpath.DDPLauncherSearchPath",
        f"{module}.searchpath.DDPLauncherConfigs",
    }, found
    assert found["torchrun"] == [f"{module}.torchrun_launcher.TorchrunLauncher", "auto"]


def test_a_plain_apps_groups_gain_only_launchers_and_sweepers(tmp_path: Path) -> None:
    """`--hydra-help` of an app that knows nothing of the package: its names are options of
    hydra/launcher, hydra/sweeper and hydra/sweeper/sampler only (no hydra/job_logging of
    ours), each launcher and sweeper also under its alias."""
    (tmp_path / "app.py").write_text(PLAIN_APP)
    proc = python(["app.py", "--hydra-help"], tmp_path)
    assert proc.returncode == 0, output(proc)[-3000:]
    groups = {}
    for line in proc.stdout.split("== Configuration groups ==")[1].splitlines():
        group, sep, options = line.partition(": ")
        if sep and group.startswith("hydra"):
            groups[group] = set(options.split(", "))
    assert {"hydra/launcher", "hydra/sweeper", "hydra/job_logging"} <= groups.keys(), groups
    elsewhere = {g: o & OURS for g, o in groups.items() if g not in SWEEPER_GROUPS and o & OURS}
    assert elsewhere == {}, groups
    assert {"torchrun", "ddp_torchrun", "slurm", "ddp_slurm"} <= groups["hydra/launcher"]
    assert {"optuna", "ddp_optuna"} <= groups["hydra/sweeper"]


def test_the_config_source_serves_each_name_until_another_plugin_has_it() -> None:
    """The package's config source: its groups and names (hydra/job_logging=other_ranks for
    apps of its entry point only), a config made when loaded; a name Hydra's ConfigStore holds
    is left to the ConfigStore, and collisions() says so, naming the alias."""
    source = DDPLauncherConfigs("hydra-ddp-launcher", "hydra-ddp-launcher://")
    assert source.list("hydra", ObjectType.GROUP) == ["launcher", "sweeper"]
    assert source.list("hydra/sweeper", ObjectType.GROUP) == ["pruner", "sampler"]
    assert source.list("hydra/launcher", ObjectType.CONFIG) == [
        "ddp_slurm",
        "ddp_torchrun",
        "slurm",
        "torchrun",
    ]
    assert source.is_group("hydra/sweeper/sampler") and not source.is_group("hydra/job_logging")
    assert not source.is_config("hydra/job_logging/other_ranks")
    entry = DDPLauncherConfigs("hydra-ddp-launcher", "hydra-ddp-launcher://entry")
    assert entry.is_config("hydra/job_logging/other_ranks")
    assert entry.load_config("hydra/job_logging/other_ranks").config.root.level == "ERROR"
    loaded = source.load_config("hydra/sweeper/ddp_optuna").config
    assert loaded._target_ == "hydra_plugins.hydra_ddp_launcher.optuna_sweeper.OptunaSweeper"
    assert source.load_config("hydra/sweeper/sampler/qmc").config.seed is None
    assert source.load_config("hydra/sweeper/pruner/median").config.type == "median"
    # (where hydra-optuna-sweeper is installed, its names are stored already: one line more)
    before = collisions()
    assert [line for line in before if "hydra/launcher=" in line] == []

    store, path = ConfigStore.instance(), "hydra/launcher/torchrun.yaml"
    store.store(group="hydra/launcher", name="torchrun", node={"_target_": "x.Y"}, provider="other")
    try:
        assert not source.is_config("hydra/launcher/torchrun")
        assert source.is_config("hydra/launcher/ddp_torchrun")
        assert "torchrun" not in source.list("hydra/launcher", ObjectType.CONFIG)
        line = (
            "hydra-ddp-launcher: provider other registers hydra/launcher=torchrun too; here "
            "those names select its configs (whatever the plugin scan's order), and "
            "hydra/launcher=ddp_torchrun selects hydra-ddp-launcher's"
        )
        assert sorted(collisions()) == sorted([*before, line])
    finally:
        del store.repo["hydra"]["launcher"][path.rpartition("/")[2]]


def test_the_sampler_names_are_the_sweepers() -> None:
    from ddp_launcher.sweeper.sweeper import SAMPLERS

    served = {p.rpartition("/")[2] for p in CONFIGS if p.startswith("hydra/sweeper/sampler/")}
    assert served == set(SAMPLERS)
    assert searchpath.ALIASES.keys() <= CONFIGS.keys()


@pytest.mark.parametrize("scanned", ["before", "after"])
def test_a_plugin_that_registers_torchrun_too_is_named_in_one_line(
    tmp_path: Path, scanned: str
) -> None:
    """A plugin that stores `hydra/launcher=torchrun` (as the other torchrun launchers do),
    scanned before or after the package: `torchrun` selects its launcher either way, the alias
    `ddp_torchrun` the package's, and one line at start names both plugins and the alias."""
    plugin = tmp_path / "plugins" / "hydra_plugins" / "fake_torchrun"
    plugin.mkdir(parents=True)
    (plugin / "__init__.py").write_text(FAKE_TORCHRUN)
    (tmp_path / "app.py").write_text(PLAIN_APP)
    ours = run_env()["PYTHONPATH"]
    path = (
        [str(tmp_path / "plugins"), ours] if scanned == "before" else [ours, str(plugin.parents[1])]
    )
    targets = {}
    for launcher in ("torchrun", "ddp_torchrun"):
        args = ["app.py", f"hydra/launcher={launcher}", "--cfg", "hydra", "-p", "hydra.launcher"]
        proc = python(args, tmp_path, PYTHONPATH=":".join(path))
        assert proc.returncode == 0, output(proc)[-3000:]
        targets[launcher] = proc.stdout.split("_target_: ")[1].split()[0]
        said = [line for line in proc.stderr.splitlines() if "fake_torchrun" in line]
        assert said == [
            "hydra-ddp-launcher: hydra_plugins.fake_torchrun registers hydra/launcher=torchrun "
            "too; here those names select its configs (whatever the plugin scan's order), and "
            "hydra/launcher=ddp_torchrun selects hydra-ddp-launcher's"
        ], proc.stderr
    assert targets == {
        "torchrun": "hydra_plugins.fake_torchrun.FakeLauncher",
        "ddp_torchrun": "hydra_plugins.hydra_ddp_launcher.torchrun_launcher.TorchrunLauncher",
    }


@pytest.mark.slow
def test_a_dry_run_of_a_plain_app_is_set_up_by_the_launcher(tmp_path: Path) -> None:
    """hydra.launcher.dry_run=true on an app that imports nothing of the package (nothing was
    patched at import: the launcher sets the preview up once selected): one row per job with
    the launcher's ranks, exit 0, nothing written, the task never run."""
    named = PLAIN_APP.replace(
        "config_path=None, config_name=None", 'config_path=".", config_name="app"'
    )
    (tmp_path / "app.py").write_text(named)
    (tmp_path / "app.yaml").write_text("x: 0\n")
    sweep_dir = tmp_path / "sweep"
    args = ["app.py", "-m", "hydra/launcher=torchrun", "hydra.launcher.nproc_per_node=2", "x=1,2"]
    args += [f"hydra.sweep.dir={sweep_dir}", "hydra.launcher.dry_run=true"]
    proc = python(args, tmp_path)
    assert proc.returncode == 0, output(proc)[-3000:]
    rows = [line.split() for line in proc.stdout.splitlines() if line[:2] in ("0 ", "1 ")]
    assert [r[1:5] for r in rows] == [["x=1", "1", "x", "2"], ["x=2", "1", "x", "2"]], proc.stdout
    assert not sweep_dir.exists() and "x =" not in proc.stdout


def test_an_optuna_too_old_for_the_sweeper_is_one_line() -> None:
    """pip gives hydra-optuna-sweeper 1.3.0 the Optuna 2.10 it asks for: this package's sweeper
    then stops in one line naming the fix, not an ImportError of Optuna's."""
    from ddp_launcher.core.errors import UserError
    from ddp_launcher.sweeper.sweeper import require_optuna

    require_optuna("4.9.0")
    require_optuna("5.0.0")
    with pytest.raises(UserError, match=r"needs optuna>=4, and optuna 2.10.1 is installed"):
        require_optuna("2.10.1")
