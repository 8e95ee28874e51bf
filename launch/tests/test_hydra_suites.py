"""Hydra's own launcher test suites (hydra.test_utils.launcher_common_tests) on
`hydra/launcher=torchrun`, parametrised as Hydra's plugins run theirs (hydra_submitit_launcher's
tests/test_submitit_launcher.py), and Hydra's discovery of the package's plugins.

In a checkout this tests the checkout's launch/ (put on the path of every process the suites
start). launch/tests/fresh_venv.sh runs a copy of this file outside the checkout, in a venv
holding only the installed package, torch and pytest: there it tests the installed package.
SLURM's suites need a cluster: tests/test_slurm.py runs them.
"""

import os
from pathlib import Path

import pytest
from hydra.core.plugins import Plugins
from hydra.plugins.launcher import Launcher
from hydra.plugins.sweeper import Sweeper
from hydra.test_utils.launcher_common_tests import IntegrationTestSuite, LauncherTestSuite

LAUNCH = Path(__file__).resolve().parents[1]
IN_CHECKOUT = (LAUNCH / "ddp_launcher" / "__init__.py").is_file()
PARALLEL = "hydra.launcher.max_parallel=2"  # two jobs at a time: the suites' sweeps overlap


@pytest.fixture(autouse=True)
def package_on_pythonpath(monkeypatch):
    """In a checkout, the processes the suites start import the checkout's package too."""
    if IN_CHECKOUT:
        paths = [str(LAUNCH), *filter(None, [os.environ.get("PYTHONPATH")])]
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join(paths))


def test_package_under_test() -> None:
    """The plugins and their package come from where this run means to test: the checkout's
    launch/, or (outside a checkout) the installed distribution."""
    import ddp_launcher
    import hydra_plugins.hydra_ddp_launcher as plugins

    for module in (ddp_launcher, plugins):
        where = Path(module.__file__).resolve()
        if IN_CHECKOUT:
            assert where.is_relative_to(LAUNCH), where
        else:
            assert "site-packages" in where.parts, where


@pytest.mark.parametrize(
    "kind, name",
    [
        (Launcher, "TorchrunLauncher"),
        (Launcher, "DDPSlurmLauncher"),
        (Sweeper, "OptunaSweeper"),
    ],
)
def test_discovery(kind, name) -> None:
    """Hydra finds the package's plugins in the hydra_plugins namespace (as Hydra's own plugin
    tests check theirs)."""
    assert name in [p.__name__ for p in Plugins.instance().discover(kind)]


@pytest.mark.slow
@pytest.mark.parametrize("launcher_name, overrides", [("torchrun", [PARALLEL])])
class TestTorchrunLauncher(LauncherTestSuite):
    """Hydra's launcher suite: in-process sweeps of hydra.test_utils apps. Under Hydra 1.4 it
    also asks that a failed job hand back the task's own exception with its traceback and
    cause (test_failure_preserves_task_traceback): the launcher's verdict rides on it."""


@pytest.mark.slow
@pytest.mark.parametrize(
    "task_launcher_cfg, extra_flags",
    [
        (
            {},
            [
                "-m",
                "hydra/job_logging=hydra_debug",
                "hydra/job_logging=disabled",
                "hydra/launcher=torchrun",
                PARALLEL,
            ],
        )
    ],
)
class TestTorchrunLauncherIntegration(IntegrationTestSuite):
    """Hydra's integration suite: `python task.py -m ...` apps written into a temp dir."""
