"""Fixtures shared by every test module; helpers live in tests/helpers.py."""

from pathlib import Path

import pytest


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"


@pytest.fixture(autouse=True)
def fresh_hydra_version_base():
    """initialize()/compose(version_base="1.3") in a test sets Hydra's version base for the
    whole process; later in-process sweeps (Hydra's launcher suites) expect a fresh process's."""
    from hydra.version import VersionBase

    saved = VersionBase.instance().getbase()
    yield
    VersionBase.instance().version_base = saved


@pytest.fixture
def train_config():
    """train.py's config as a launcher composes it (tests/helpers.py: train_composer)."""
    from tests.helpers import train_composer

    with train_composer() as composer:
        yield composer
