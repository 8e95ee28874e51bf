"""The package as a Hydra user installs it (launch/README.md, "Install", "Promises"): what it
needs of the machine (Linux, a torch at the floor) and of its extras, each a one-line refusal at
start; Hydra's contract for its keys (a dry run set in a config file, keys it does not have,
typed sampler and pruner options). Apps are written into a temp dir and import nothing of the
package (an unmodified `@hydra.main` app), or are faked in-process.

Package-alone: it imports nothing of the experiment, so launch/tests/fresh_venv.sh runs it in a
venv holding only the installed package (its core and the extras that venv has).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import hydra
import pytest
from ddp_launcher.core import host
from ddp_launcher.core.errors import UserError
from hydra.core.plugins import Plugins

LAUNCH = Path(__file__).resolve().parents[1]
IN_CHECKOUT = (LAUNCH / "ddp_launcher" / "__init__.py").is_file()

# An app that knows nothing of the package: Hydra's own decorator, one print per job. (Hydra
# 1.3 warns without a version_base, 1.4 with one: the app passes what its Hydra wants.)
HYDRA_1_4 = tuple(int(n) for n in re.findall(r"\d+", hydra.__version__)[:2]) >= (1, 4)
VERSION_BASE = "" if HYDRA_1_4 else "version_base=None, "
APP = f"""
import hydra

@hydra.main({VERSION_BASE}config_path="conf", config_name="app")
def main(cfg):
    print("job ran with x =", cfg.x, flush=True)

if __name__ == "__main__":
    main()
"""


def write_app(folder: Path, config: str = "") -> Path:
    """APP and its conf/app.yaml (x: 0, hydra/launcher=torchrun, and `config` after that)."""
    (folder / "conf").mkdir(parents=True)
    (folder / "app.py").write_text(APP)
    base = "defaults:\n  - override hydra/launcher: torchrun\n  - _self_\nx: 0\n"
    (folder / "conf" / "app.yaml").write_text(base + textwrap.dedent(config))
    return folder / "app.py"


def run_app(
    app: Path, *args: str, fake: str = "", timeout: float = 240
) -> subprocess.CompletedProcess:
    """`python app.py ARGS` in the app's folder; `fake`: Python run first in that process (a
    sitecustomize: what the machine or the environment pretends to be)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    paths = [str(LAUNCH)] if IN_CHECKOUT else []
    if fake:
        (app.parent / "fake").mkdir(exist_ok=True)
        (app.parent / "fake" / "sitecustomize.py").write_text(textwrap.dedent(fake))
        paths.insert(0, str(app.parent / "fake"))
    env["PYTHONPATH"] = os.pathsep.join([*paths, *filter(None, [env.get("PYTHONPATH")])])
    return subprocess.run(
        [sys.executable, str(app), *args],
        cwd=app.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def the_one_line(proc: subprocess.CompletedProcess, says: str) -> str:
    """The process's only line of output (stdout and stderr), which says `says`; exit 2."""
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert proc.returncode == 2, (proc.returncode, lines)
    assert len(lines) == 1 and says in lines[0], lines
    return lines[0]


DARWIN = "import sys\nsys.platform = 'darwin'\n"
OLD_TORCH = """
import importlib.metadata as metadata
version = metadata.version
metadata.version = lambda name: "2.1.2" if name == "torch" else version(name)
"""


def test_a_non_linux_os_is_one_line_at_start(tmp_path: Path) -> None:
    """sys.platform faked to darwin: the launcher (an unmodified app's sweep) and the entry
    point each refuse in one line, exit 2, before anything starts or is written."""
    with pytest.raises(UserError, match="runs on Linux only .this is darwin"):
        host.check_platform("darwin")
    host.check_platform("linux")
    app = write_app(tmp_path)
    proc = run_app(app, "-m", "x=1,2", "hydra.sweep.dir=sweep", fake=DARWIN)
    line = the_one_line(proc, "hydra-ddp-launcher runs on Linux only (this is darwin")
    assert "job ran" not in line and not (tmp_path / "sweep").exists()
    entry = (
        "import sys; sys.platform = 'darwin'\n"
        "from ddp_launcher import entry_point\n"
        "entry_point(__file__, task='x:main', config_name='app')\n"
    )
    (tmp_path / "entry.py").write_text(entry)
    proc = run_app(tmp_path / "entry.py")
    assert the_one_line(proc, "runs on Linux only").startswith("error: ")


def test_a_torch_below_the_floor_is_one_line_at_start(tmp_path: Path) -> None:
    """torch's version faked to 2.1.2 (below host.TORCH_FLOOR): one line naming the floor and
    the install command, exit 2; a torch at the floor (a CPU build's local version) passes."""
    with pytest.raises(UserError, match=f"torch 2.1.2 is older than .*floor {host.TORCH_FLOOR}"):
        host.check_torch("2.1.2")
    host.check_torch(f"{host.TORCH_FLOOR}.0+cpu")
    host.check_torch("2.15.0")
    assert host.version_tuple("2.10.0a0+git1234") == (2, 10, 0) > host.version_tuple("2.9.1")
    app = write_app(tmp_path)
    proc = run_app(app, "-m", "x=1,2", "hydra.sweep.dir=sweep", fake=OLD_TORCH)
    line = the_one_line(proc, "torch 2.1.2 is older than hydra-ddp-launcher's floor")
    assert f"pip install 'torch>={host.TORCH_FLOOR}'" in line


@pytest.mark.parametrize(
    "selects, extra, hidden",
    [
        ("hydra/sweeper=optuna", "optuna", "optuna"),
        ("hydra/launcher=slurm", "slurm", "submitit"),
    ],
)
def test_a_feature_whose_extra_is_missing_is_one_line(tmp_path, selects, extra, hidden) -> None:
    """The extra's module hidden (as a core-only install lacks it): selecting the feature is
    one line naming the extra to install, exit 2; every other Hydra app is untouched (the
    plugin scan imports the package without its extras: Hydra warns of nothing)."""
    app = write_app(tmp_path)
    hide = f"import sys\nsys.modules[{hidden!r}] = None\n"
    proc = run_app(app, "-m", selects, "x=1,2", "hydra.sweep.dir=sweep", fake=hide)
    line = the_one_line(proc, f"{selects} needs hydra-ddp-launcher[{extra}]")
    assert f"pip install 'hydra-ddp-launcher[{extra}]'" in line
    assert not (tmp_path / "sweep").exists()
    plain = run_app(app, "x=3", fake=hide)  # no feature of an extra: runs, says nothing more
    assert plain.returncode == 0 and "job ran with x = 3" in plain.stdout, plain.stderr
    assert "Warning" not in plain.stderr and "Error" not in plain.stderr, plain.stderr


def test_require_extra_names_the_extra(monkeypatch) -> None:
    for module in ("matplotlib", "scipy"):  # (a core install has neither)
        monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(UserError) as e:
        host.require_extra("report", "the sweep report")
    assert str(e.value) == (
        "the sweep report needs hydra-ddp-launcher[report] (matplotlib, scipy not installed): "
        "pip install 'hydra-ddp-launcher[report]'"
    )


def test_the_reports_wandb_run_without_its_extra_is_one_line(tmp_path, monkeypatch, capsys):
    """`python -m ddp_launcher.report SWEEP --wandb` where wandb is not installed: one line
    naming the [wandb] extra, exit 2, nothing written into the sweep dir. (Where the [report]
    extra is missing too, as in fresh_venv.sh's core-only venv, that one is named first:
    test_require_extra_names_the_extra.)"""
    for module in ("matplotlib", "scipy"):
        pytest.importorskip(module)
    from ddp_launcher.report.__main__ import main

    monkeypatch.setitem(sys.modules, "wandb", None)
    (tmp_path / "sweep").mkdir()
    assert main([str(tmp_path / "sweep"), "--wandb"]) == 2
    assert capsys.readouterr().err == (
        "error: --wandb needs hydra-ddp-launcher[wandb] (wandb not installed): "
        "pip install 'hydra-ddp-launcher[wandb]'\n"
    )
    assert list((tmp_path / "sweep").iterdir()) == []


def test_dry_run_set_in_a_config_file_previews(tmp_path: Path) -> None:
    """hydra.launcher.dry_run: true in the app's config file does what it does on the command
    line: every job previewed, none started, nothing written. (A dry run is a multirun's:
    Hydra uses a launcher in multirun only, and a pure plugin patches nothing that would turn
    an unmodified app's plain run into one.)"""
    app = write_app(tmp_path, "hydra:\n  launcher:\n    dry_run: true\n")
    for args in (["-m", "x=1,2"], ["-m", "x=3"]):
        proc = run_app(app, *args, "hydra.sweep.dir=sweep")
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, out
        jobs = 2 if "x=1,2" in args else 1
        assert f"torchrun launcher, dry run: {jobs} job(s) in sweep" in out, out
        assert "job ran" not in out and not (tmp_path / "sweep").exists(), out
        assert not (tmp_path / "outputs").exists()


def test_a_key_the_launcher_does_not_have_is_refused(caplog) -> None:
    """`+hydra.launcher.<key>=...` (Hydra lets `+` add any key to a launcher's node): one line
    naming the key and the launcher's keys, exit 2, for both launchers."""
    from hydra_plugins.hydra_ddp_launcher.torchrun_launcher import TorchrunLauncher

    with pytest.raises(SystemExit) as e:
        TorchrunLauncher(max_parallel=2, nproc=2)
    assert e.value.code == 2
    assert caplog.messages[-1].startswith(
        "hydra.launcher.nproc: not a key of hydra/launcher=torchrun, which would ignore it"
    )
    if host.importlib.util.find_spec("submitit") is None:
        return  # (the slurm extra: the check below runs where it is installed)
    from hydra_plugins.hydra_ddp_launcher.slurm_launcher import DDPSlurmLauncher

    with pytest.raises(SystemExit) as e:
        DDPSlurmLauncher(partition="gpu", gpus_per_node_max=8)
    assert e.value.code == 2 and "hydra.launcher.gpus_per_node_max: not a key" in caplog.text


def compose(*overrides: str):
    """The Optuna sweeper's node as Hydra composes it from the command line."""
    from hydra import compose as hydra_compose
    from hydra import initialize

    Plugins.instance()  # the plugins' configs in Hydra's ConfigStore
    with initialize(**({} if HYDRA_1_4 else {"version_base": None})):
        cfg = hydra_compose(
            overrides=["hydra/sweeper=optuna", *overrides], return_hydra_config=True
        )
    return cfg.hydra.sweeper


def test_sampler_and_pruner_options_are_typed() -> None:
    """hydra.sweeper.sampler.<option> and hydra.sweeper.pruner.<option> need no `+`: each
    sampler (hydra/sweeper/sampler=NAME) and pruner (hydra/sweeper/pruner=NAME) has its options
    typed; a value of the wrong type or an option the sampler lacks is refused as Hydra refuses
    any key; options left null keep Optuna's defaults (not passed)."""
    from hydra.errors import ConfigCompositionException

    sweeper = compose("hydra.sweeper.sampler.n_startup_trials=5", "hydra.sweeper.sampler.seed=3")
    assert sweeper.sampler.n_startup_trials == 5 and sweeper.sampler.seed == 3
    sweeper = compose(
        "hydra/sweeper/sampler=random",
        "hydra/sweeper/pruner=median",
        "hydra.sweeper.pruner.n_warmup_steps=2",
    )
    assert sweeper.sampler._target_ == "optuna.samplers.RandomSampler"
    assert sweeper.pruner.type == "median" and sweeper.pruner.n_warmup_steps == 2
    for bad in (
        ["hydra.sweeper.sampler.n_startup_trials=five"],
        ["hydra/sweeper/sampler=random", "hydra.sweeper.sampler.n_startup_trials=5"],
        ["hydra/sweeper/pruner=hyperband", "hydra.sweeper.pruner.n_warmup_steps=2"],
    ):
        with pytest.raises(ConfigCompositionException):
            compose(*bad)
    assert compose().pruner is None  # no pruner unless one is chosen


def test_sampler_and_pruner_built_from_their_typed_options() -> None:
    """Only the options set reach Optuna; a pruner's options are checked against its type
    however written ({type: median, ...} too); a `_target_` written over another sampler's
    options is one line naming the group to choose."""
    pytest.importorskip("optuna")
    from ddp_launcher.core.trials import build_pruner
    from ddp_launcher.sweeper.sweeper import sampler_node

    node = compose("hydra.sweeper.sampler.n_startup_trials=5").sampler
    assert sampler_node(node) == {"_target_": "optuna.samplers.TPESampler", "n_startup_trials": 5}
    pruner = build_pruner({"type": "median", "n_warmup_steps": 2})
    assert type(pruner).__name__ == "MedianPruner" and pruner._n_warmup_steps == 2
    pruner = build_pruner(dict(compose("hydra/sweeper/pruner=percentile").pruner))
    assert pruner._percentile == 25.0
    with pytest.raises(UserError, match="median: .*n_warmup_step.*its options: n_startup_trials"):
        build_pruner({"type": "median", "n_warmup_step": 2})
    with pytest.raises(UserError, match="median: .*n_warmup_steps"):
        build_pruner({"type": "median", "n_warmup_steps": "two"})
    wrong = compose("hydra.sweeper.sampler._target_=optuna.samplers.RandomSampler").sampler
    with pytest.raises(UserError, match="choose it with hydra/sweeper/sampler=random"):
        sampler_node(wrong)
