"""The `hydra/launcher=torchrun` plugin (launch/torchrun.py, launch/job_rank.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hydra.core.plugins import Plugins
from hydra.plugins.launcher import Launcher
from hydra.test_utils.launcher_common_tests import IntegrationTestSuite, LauncherTestSuite

from hydra_plugins.hydra_ddp_torchrun_launcher.torchrun_launcher import TorchrunLauncher

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def repo_on_pythonpath(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hydra's integration tests run `python task.py` in a temp dir with our environment: the
    plugin (hydra_plugins/ here) and launch/ must be importable there."""
    rest = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), *([rest] if rest else [])]))


def test_discovery() -> None:
    """Hydra finds the launcher plugin in the hydra_plugins namespace package."""
    assert TorchrunLauncher.__name__ in [x.__name__ for x in Plugins.instance().discover(Launcher)]


@pytest.mark.slow
@pytest.mark.parametrize("launcher_name, overrides", [("torchrun", [])])
class TestTorchrunLauncher(LauncherTestSuite):
    """Hydra's launcher suite: in-process sweeps of hydra.test_utils apps (1 rank each)."""


@pytest.mark.slow
@pytest.mark.usefixtures("repo_on_pythonpath")
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
            ],
        )
    ],
)
class TestTorchrunLauncherIntegration(IntegrationTestSuite):
    """Hydra's integration suite: `python task.py -m ...` apps written into a temp dir."""
