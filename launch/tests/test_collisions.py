"""hydra-optuna-sweeper and this package in one environment: both register
`hydra/sweeper=optuna` (and `hydra/sweeper/sampler=*`). That name selects hydra-optuna-sweeper's
(whatever the scan's order), `hydra/sweeper=ddp_optuna` this package's, both work, and every
start says so in one line naming both and the alias. A sweep of the package's sweeper is not
resumed by hydra-optuna-sweeper (it would start the study over): one line before anything is
written, naming the alias, under which it resumes.

Runs where hydra-optuna-sweeper is installed (.ci/requirements-collide.txt, a venv of its own:
.ci/run), skipped elsewhere. The fake `hydra/launcher=torchrun` plugin's collision:
launch/tests/test_plugin.py.
"""

from __future__ import annotations

import hashlib
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from ddp_launcher.core.run_dir import read_launch_record

from tests.helpers import output, run_env

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("hydra_plugins.hydra_optuna_sweeper") is None,
    reason="hydra-optuna-sweeper is not installed (.ci/requirements-collide.txt)",
)

APP = """\
import hydra

@hydra.main(version_base=None, config_path=".", config_name="app")
def main(cfg):
    return (cfg.x - 0.3) ** 2

if __name__ == "__main__":
    main()
"""
THEIRS = "hydra_plugins.hydra_optuna_sweeper.optuna_sweeper.OptunaSweeper"
OURS = "hydra_plugins.hydra_ddp_launcher.optuna_sweeper.OptunaSweeper"


def sweep(tmp_path: Path, name: str, *overrides: str) -> subprocess.CompletedProcess:
    (tmp_path / "app.py").write_text(APP)
    (tmp_path / "app.yaml").write_text("x: 0.0\n")
    cmd = [sys.executable, "app.py", "-m", *overrides, f"hydra.sweep.dir={tmp_path / name}"]
    return subprocess.run(
        cmd, cwd=tmp_path, env=run_env(), capture_output=True, text=True, timeout=300
    )


def notice(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("hydra-ddp-launcher:")]


def sweeper_of_job(job_dir: Path) -> str:
    hydra = yaml.safe_load((job_dir / ".hydra" / "hydra.yaml").read_text())["hydra"]
    return hydra["sweeper"]["_target_"]


def snapshot(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_both_optuna_sweepers_run_and_one_line_names_both(tmp_path: Path) -> None:
    """`optuna` runs hydra-optuna-sweeper's, `ddp_optuna` this package's (its study in the
    sweep dir's optuna.db; with hydra-optuna-sweeper's hydra/sweeper/sampler=grid config), each
    2 trials on Hydra's basic launcher; each start says the same one line."""
    space = ["hydra.sweeper.n_trials=2", "hydra.sweeper.n_jobs=1"]
    theirs = sweep(tmp_path, "theirs", "hydra/sweeper=optuna", "x=interval(0,1)", *space)
    ours = sweep(
        tmp_path,
        "ours",
        "hydra/sweeper=ddp_optuna",
        "hydra/sweeper/sampler=grid",
        "x=choice(0.25,0.5)",
        *space,
    )
    for proc in (theirs, ours):
        assert proc.returncode == 0, output(proc)[-3000:]
        (line,) = notice(proc)
        assert "hydra-optuna-sweeper 1.3.0" in line and "hydra/sweeper=optuna" in line, line
        assert "hydra/sweeper=ddp_optuna selects hydra-ddp-launcher's" in line, line
    assert [sweeper_of_job(tmp_path / "theirs" / str(n)) for n in (0, 1)] == [THEIRS] * 2
    assert [sweeper_of_job(tmp_path / "ours" / str(n)) for n in (0, 1)] == [OURS] * 2
    assert (tmp_path / "ours" / "optuna.db").exists()
    tried = sorted(
        yaml.safe_load((tmp_path / "ours" / str(n) / ".hydra" / "overrides.yaml").read_text())[0]
        for n in (0, 1)
    )
    assert tried == ["x=0.25", "x=0.5"]  # the grid, each point once


@pytest.mark.slow
def test_a_sweep_of_the_packages_sweeper_resumes_under_its_alias(tmp_path: Path) -> None:
    """A study the package's sweeper ran (torchrun launcher): resumed with `hydra/sweeper=optuna`
    (hydra-optuna-sweeper here) it is one line naming the alias, exit 2, nothing written;
    resumed with `hydra/sweeper=ddp_optuna` it continues (the first trial is not run again);
    a dry run of hydra-optuna-sweeper's sweep is refused the same way."""
    common = ["hydra/launcher=torchrun", "x=interval(0,1)", "hydra.sweeper.n_jobs=1"]
    first = sweep(
        tmp_path, "study", "hydra/sweeper=ddp_optuna", *common, "hydra.sweeper.n_trials=1"
    )
    assert first.returncode == 0, output(first)[-3000:]
    before = snapshot(tmp_path / "study")

    resume = ["hydra.launcher.resume=true", "hydra.sweeper.n_trials=2"]
    refused = sweep(tmp_path, "study", "hydra/sweeper=optuna", *common, *resume)
    assert refused.returncode == 2, output(refused)[-3000:]
    assert "resume with hydra/sweeper=ddp_optuna" in output(refused), output(refused)
    assert snapshot(tmp_path / "study") == before
    dry = sweep(tmp_path, "dry", "hydra/sweeper=optuna", *common, "hydra.launcher.dry_run=true")
    assert dry.returncode == 2 and "not OptunaSweeper" in output(dry), output(dry)[-3000:]
    assert not (tmp_path / "dry").exists()

    again = sweep(tmp_path, "study", "hydra/sweeper=ddp_optuna", *common, *resume)
    assert again.returncode == 0, output(again)[-3000:]
    assert sorted(p.name for p in (tmp_path / "study").iterdir() if p.name.isdigit()) == ["0", "1"]
    for num in (0, 1):  # trial 0 ran once, in the first sweep; trial 1 in the resumed one
        record = read_launch_record(tmp_path / "study" / str(num))
        assert [a.status for a in record.attempts] == ["completed"], (num, record)
