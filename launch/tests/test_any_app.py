"""The package names nothing of the app it launches: its lines name the app by the app's own
command, its log lines are its modules', `dist.device` is its key, and the `_target_` whitelist
its jobs run under is the app's (Hydra 1.4), never one of its own naming an app's packages.

Apps written into a temp dir: a 3-line entry-point app (no torch), a plain `@hydra.main` app
with the package's callbacks, and an entry-point app whose ranks instantiate a target of its own.
"""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import pytest
from ddp_launcher.core import app_command as names
from ddp_launcher.core.errors import UserError
from ddp_launcher.core.hydra_compat import HAS_WHITELIST, PACKAGE_TARGETS
from ddp_launcher.core.world import job_device, job_world
from omegaconf import OmegaConf

from tests.helpers import output, run

PACKAGE = Path(names.__file__).resolve().parents[1]  # ddp_launcher/


def run_app(cmd: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return run([sys.executable, *cmd], cwd=cwd, timeout=300, **env)


# ---------------------------------------------------------------------------------------------
# the app's own command


@pytest.fixture
def a_script_main(monkeypatch):
    """This process as `python <script>` runs it: a __main__ without a module spec."""
    monkeypatch.setitem(sys.modules, "__main__", types.ModuleType("__main__"))
    monkeypatch.delenv(names.APP_COMMAND_ENV, raising=False)


def test_the_apps_command_is_its_script_as_typed(a_script_main, tmp_path, monkeypatch) -> None:
    """sys.argv[0] as the user typed it, a path under the working dir made relative to it; not
    `python -c`, an installed program's (pytest, torchrun) nor this package's own modules (a
    rank's agent, a SLURM task): there the launcher's word (APP_COMMAND_ENV), else Hydra's
    hydra.job.name, else a placeholder."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    typed = names.typed_command
    assert typed(["my_app.py"]) == "python my_app.py"
    assert typed(["sub/my_app.py"]) == "python sub/my_app.py"
    assert typed([str(tmp_path / "sub" / "my_app.py")]) == "python sub/my_app.py"
    assert typed(["/elsewhere/my app.py"]) == "python '/elsewhere/my app.py'"
    for not_the_app in (
        ["-c"],
        [""],
        [str(Path(sys.executable).parent / "pytest")],
        [str(PACKAGE / "ranks" / "slurm_task.py")],
        [str(Path(pytest.__file__))],  # an installed module's file
    ):
        assert typed(not_the_app) is None, not_the_app

    monkeypatch.setattr(sys, "argv", ["-c"])
    job = OmegaConf.create({"hydra": {"job": {"name": "my_app"}}})
    assert names.app_command(job) == "python my_app.py" and names.app_name(job) == "my_app.py"
    assert names.app_command(OmegaConf.create({})) == names.UNNAMED
    monkeypatch.setenv(names.APP_COMMAND_ENV, "python -m pkg.app")
    assert names.app_command(job) == "python -m pkg.app" and names.app_name(job) == "pkg.app"
    monkeypatch.setattr(sys, "argv", ["renamed.py"])  # this process's own word comes first
    assert names.app_command(job) == "python renamed.py"


def test_an_app_run_as_a_module_is_named_as_one(tmp_path, monkeypatch) -> None:
    """`python -m pkg.app`: its module (`__main__`'s spec), not the file sys.argv[0] names."""
    import importlib.util

    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "app.py").write_text("")
    main = types.ModuleType("__main__")
    main.__spec__ = importlib.util.spec_from_file_location("pkg.app", tmp_path / "pkg" / "app.py")
    monkeypatch.setitem(sys.modules, "__main__", main)
    assert names.typed_command([str(tmp_path / "pkg" / "app.py")]) == "python -m pkg.app"


def test_the_run_command_in_repro_and_the_ranks_env_are_the_apps(
    a_script_main, tmp_path, monkeypatch
) -> None:
    """repro/command.txt's run line and what a job's ranks are told the app is (they say it
    in lines of their own: a bad fork, the gate's refusals in a SLURM task)."""
    from ddp_launcher.core import repro
    from ddp_launcher.jobs import Job
    from ddp_launcher.ranks.job_spec import JobSpec
    from ddp_launcher.torchrun import TorchrunBackend, TorchrunLauncherConf

    monkeypatch.setattr(sys, "argv", ["my_app.py", "lr=0.1"])
    text = repro.command(["lr=0.1", "name=a b"])
    assert text.endswith("# this run (its Hydra overrides)\npython my_app.py lr=0.1 'name=a b'\n")
    config = OmegaConf.create({"hydra": {"job": {"name": "my_app"}}})
    job = Job(0, [], tmp_path / "0", JobSpec(None, config, None), nproc=1)
    env = TorchrunBackend(TorchrunLauncherConf(), gpu_ids=[]).job_env(job, [], None)
    assert env[names.APP_COMMAND_ENV] == "python my_app.py"


MINIMAL = """\
if __name__ == "__main__":
    from ddp_launcher import entry_point

    entry_point(__file__, task="renamed_app:main", config_name="renamed")
"""


def test_a_line_of_the_package_names_the_app_as_it_was_started(tmp_path) -> None:
    """-m under torchrun (each rank would start a sweep) is one line telling the user what to
    run: the app's own command, the script as typed (relative, or absolute from elsewhere)."""
    app = tmp_path / "app"
    (app / "conf").mkdir(parents=True)
    (app / "renamed_app.py").write_text(MINIMAL)
    (app / "conf" / "renamed.yaml").write_text("x: 0\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    rank = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}
    for cmd, cwd, said in (
        (["renamed_app.py", "-m", "x=1,2"], app, "python renamed_app.py"),
        ([str(app / "renamed_app.py"), "-m"], app, "python renamed_app.py"),
        ([str(app / "renamed_app.py"), "-m"], elsewhere, f"python {app / 'renamed_app.py'}"),
    ):
        proc = run_app(cmd, cwd, **rank)
        assert proc.returncode == 2, output(proc)
        assert f"run `{said} -m ...` instead" in proc.stderr, output(proc)
        assert "train.py" not in output(proc)


# ---------------------------------------------------------------------------------------------
# the package's log lines: its modules' loggers, through the root's handlers

SAID_APP = """\
import hydra
import ddp_launcher

@hydra.main(version_base=None, config_path=".", config_name="said")
def main(cfg):
    raise ddp_launcher.UserError("lr=-1 is not valid: use lr > 0")

if __name__ == "__main__":
    main()
"""
SAID_CHECKS = """\
import ddp_launcher

def check(config, world_size, run_dir):
    if config.refuse:
        raise ddp_launcher.UserError("refuse=true: use refuse=false")
"""
# (disable_existing_loggers left out: logging.config's default, true, disables every logger
# made before the job's logging is set up, as the package's modules make theirs at import)
SAID_CONFIG = """\
refuse: false
hydra:
  job:
    name: said
  job_logging:
    version: 1
    formatters:
      simple:
        format: "[%(name)s][%(levelname)s] - %(message)s"
    handlers:
      console:
        class: logging.StreamHandler
        formatter: simple
        stream: ext://sys.stdout
      file:
        class: logging.FileHandler
        formatter: simple
        filename: ${hydra.runtime.output_dir}/${hydra.job.name}.log
    root:
      level: INFO
      handlers: [console, file]
  callbacks:
    run_gate:
      _target_: ddp_launcher.RunGate
      checks: said_checks.check
    user_error:
      _target_: ddp_launcher.ReportUserError
"""


def test_the_packages_lines_are_its_modules_and_reach_console_and_log(tmp_path) -> None:
    """A plain Hydra app with the package's gate and ReportUserError: a refused start and a
    user error of the task are each one line, logged under the package's module (not a name of
    an app's), on the console (and the user error in the job's log file), even where the app's
    job logging disables the loggers made before it."""
    app = tmp_path / "app"
    app.mkdir()
    (app / "said_app.py").write_text(SAID_APP)
    (app / "said_checks.py").write_text(SAID_CHECKS)
    (app / "said.yaml").write_text(SAID_CONFIG)

    refused_dir = tmp_path / "refused"
    proc = run_app(["said_app.py", "refuse=true", f"hydra.run.dir={refused_dir}"], app)
    assert proc.returncode == 2, output(proc)
    line = "[ddp_launcher.core.gate][ERROR] - refuse=true: use refuse=false"
    assert proc.stdout.splitlines().count(line) == 1, output(proc)
    assert not refused_dir.exists()  # (refused before a byte was written)

    run_dir = tmp_path / "run"
    proc = run_app(["said_app.py", f"hydra.run.dir={run_dir}"], app)
    assert proc.returncode == 2, output(proc)
    line = "[ddp_launcher.core.errors][ERROR] - lr=-1 is not valid: use lr > 0"
    assert proc.stdout.splitlines().count(line) == 1, output(proc)
    assert line in (run_dir / "said.log").read_text().splitlines()


# ---------------------------------------------------------------------------------------------
# dist.device: the package's key


def test_dist_device_is_the_packages_key_checked_where_it_came_from() -> None:
    """`dist.device` (auto, cpu, cuda; absent: auto) says whether a job's ranks use GPUs: cpu
    runs 1 CPU rank for `auto` on a GPU node. A bad value is one line naming the key it came
    from: dist.device, or the app's own key it interpolates (as `${trainer.device}`)."""
    assert job_device(OmegaConf.create({})) == "auto"
    dist = {"device": "${app.device}", "nproc_per_node": "auto", "backend": "auto"}
    own = {"dist": dist, "app": {"device": "cpu"}}
    assert job_device(OmegaConf.create(own)) == "cpu"
    assert job_world(OmegaConf.create(own), 8) == (1, 1, False)
    assert job_world(OmegaConf.create({**own, "app": {"device": "cuda"}}), 8) == (8, 1, True)
    for config, key in (
        ({"dist": {"device": "gpu"}}, "dist.device"),
        ({**own, "app": {"device": "gpu"}}, "app.device"),
    ):
        with pytest.raises(UserError) as caught:
            job_device(OmegaConf.create(config))
        assert str(caught.value) == f"{key}=gpu is not valid: use auto, cpu or cuda"


# ---------------------------------------------------------------------------------------------
# the `_target_` whitelist: the app's


def test_the_package_trusts_only_its_own_targets() -> None:
    assert PACKAGE_TARGETS == (
        "ddp_launcher.*",
        "hydra_plugins.hydra_ddp_launcher.*",
        "optuna.samplers.*",
        "optuna.pruners.*",
    )


TARGETS_APP = """\
if __name__ == "__main__":
    from ddp_launcher import entry_point

    entry_point(
        __file__, task="targets_app:main", config_name="targets", trusted_targets=("made.*",)
    )

import os
from pathlib import Path

from hydra.utils import instantiate


def main(cfg):
    Path(cfg.out, f"rank{os.environ.get('RANK', '0')}").write_text(instantiate(cfg.thing))
"""
TARGETS_CONFIG = """\
dist:
  nproc_per_node: 2
  backend: gloo
thing:
  _target_: made.thing
out: ???
hydra:
  job:
    name: targets
"""


@pytest.mark.slow
def test_every_rank_runs_under_the_apps_whitelist(tmp_path) -> None:
    """An entry-point app trusting its own package (`trusted_targets`): every rank of `python
    app.py dist.nproc_per_node=2` (handed off) and of a sweep job (the HydraContext Hydra gave
    the launcher) instantiates the app's target, without a warning; under Hydra 1.4 a target
    the app did not trust is refused there (a config cannot widen the whitelist). Hydra 1.4's
    launcher used to run them under a list of another app's packages."""
    app = tmp_path / "app"
    (app / "conf").mkdir(parents=True)
    (app / "targets_app.py").write_text(TARGETS_APP)
    (app / "made.py").write_text("def thing():\n    return 'made'\n")
    (app / "unmade.py").write_text("def thing():\n    return 'unmade'\n")
    (app / "conf" / "targets.yaml").write_text(TARGETS_CONFIG)
    for how, args in (
        ("handed_off", [f"hydra.run.dir={tmp_path / 'run'}"]),
        ("sweep", ["-m", "hydra/launcher=torchrun", f"hydra.sweep.dir={tmp_path / 'sweep'}"]),
    ):
        out = tmp_path / f"made-{how}"
        out.mkdir()
        proc = run_app(["targets_app.py", *args, f"out={out}"], app)
        said = output(proc) + "".join(p.read_text() for p in tmp_path.rglob("rank_logs/**/*.log"))
        assert proc.returncode == 0, said[-3000:]
        assert [p.read_text() for p in sorted(out.iterdir())] == ["made", "made"], how
        assert "whitelist" not in said, said[-3000:]
    if not HAS_WHITELIST:
        return  # Hydra 1.3: no whitelist to refuse with
    out = tmp_path / "widened"
    out.mkdir()
    proc = run_app(["targets_app.py", f"out={out}", "thing._target_=unmade.thing"], app)
    assert proc.returncode != 0 and not any(out.iterdir()), output(proc)[-3000:]
    assert "'unmade.thing' is not in the Hydra execution whitelist" in output(proc)
