"""Fixtures shared by every test module; helpers live in tests/helpers.py."""

from pathlib import Path

import pytest
from hydra.version import VersionBase

FRESH_VERSION_BASE = VersionBase.instance().getbase()  # before any test composed a config


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"


@pytest.fixture(autouse=True)
def fresh_hydra_version_base():
    """initialize()/compose(version_base="1.3") sets Hydra's version base for the whole
    process, also from a module- or session-scoped fixture (outside any test); in-process
    sweeps (Hydra's launcher suites) expect a fresh process's. So every test starts and ends
    with the version base of a fresh process."""
    VersionBase.instance().version_base = FRESH_VERSION_BASE
    yield
    VersionBase.instance().version_base = FRESH_VERSION_BASE


@pytest.fixture
def train_config():
    """train.py's config as a launcher composes it (tests/helpers.py: train_composer)."""
    from tests.helpers import train_composer

    with train_composer() as composer:
        yield composer


@pytest.fixture(scope="session")
def two_ranks(wandb_data_dir):
    """Two ranks for the whole run (tests/rank_pool.py): a gloo group of two processes
    without starting them for each test."""
    from tests.rank_pool import RankPool

    pool = RankPool(world_size=2)
    yield pool
    pool.close(wait=30)


@pytest.fixture(autouse=True, scope="session")
def wandb_data_dir(tmp_path_factory):
    """W&B's staging copies of logged artifacts (checkpoints, tables' images), which offline
    runs keep until `wandb sync`, go to a temporary dir, not the user's ~/.local/share/wandb
    (tests/helpers.py's run_env passes WANDB_DATA_DIR on to processes)."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("WANDB_DATA_DIR", str(tmp_path_factory.mktemp("wandb_data")))
        yield


@pytest.fixture(autouse=True, scope="session")
def wandb_off_by_default():
    """W&B's service costs every run seconds: runs in this process are disabled unless a test
    asks for wandb.mode=offline (tests/helpers.py's OFFLINE), as run_env makes them in the
    processes tests start. (conf/wandb/default.yaml: mode ${oc.env:WANDB_MODE,auto}.)"""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("WANDB_MODE", "disabled")
        yield
