"""Shared helpers: run train.py the way a user does (real processes, gloo, offline W&B)."""

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
# Quick settings for tests that only need a run to happen; each test adds what it checks.
QUICK = ["trainer.max_epochs=1", "wandb.mode=offline", "trainer.progress_bar=false"]


def run_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "HYDRA_"))}
    env.update(
        WANDB_SILENT="true",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=str(REPO),
    )
    env.update(extra)
    return env


def train_cmd(*overrides: str, nproc: int | None = None) -> list[str]:
    if nproc is None:
        return [sys.executable, "train.py", *overrides]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", "train.py", *overrides]  # fmt: skip


def run(cmd: list[str], *, timeout: float = 600, cwd: Path = REPO, **env: str):
    """Run a command to completion (a hang fails the test at `timeout`)."""
    return subprocess.run(
        cmd, cwd=cwd, env=run_env(**env), capture_output=True, text=True, timeout=timeout
    )


def output(proc) -> str:
    return proc.stdout + proc.stderr


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


@dataclass
class Sweep:
    """A finished multirun: its sweep dir and the process that ran it."""

    dir: Path
    proc: subprocess.CompletedProcess

    @property
    def out(self) -> str:
        return output(self.proc)

    def job(self, num: int) -> Path:
        return self.dir / str(num)

    def overrides(self, num: int) -> list[str]:
        return yaml.safe_load((self.job(num) / ".hydra" / "overrides.yaml").read_text())
