"""The app's own command, as its user typed it: what the package's lines tell the user to run
("run `python my_app.py -m ...` once") and how a run's repro/command.txt names the app, for any
app, found at run time. Torch-free, cheap: read only when a line is said.

Where the process is the app's (the user's shell ran it: `python my_app.py`, `python -m
pkg.app`; each rank of plain torchrun or srun, which run the script too), the
script is its own sys.argv[0], shortened to a path relative to the working dir when it lies
under it. Where it is not (a SLURM task, or a process of a test runner), the launcher that
started it said the app's command in APP_COMMAND_ENV; else Hydra's `hydra.job.name` (an
unmodified `@hydra.main` app's is its script's name).
"""

from __future__ import annotations

import os
import shlex
import sys
import sysconfig
from pathlib import Path
from typing import Any

# The app's command, set by a launcher for every process it starts (its ranks, a SLURM job's
# tasks), whose own sys.argv is the launcher's
APP_COMMAND_ENV = "HYDRA_DDP_APP_COMMAND"
# Where neither the process nor Hydra names the app
UNNAMED = "python <your app>"


def app_command(config: Any = None) -> str:
    """`python my_app.py` (or `python -m pkg.app`): how the user starts this app. `config`: a
    job's composed config (its hydra.job.name is the last resort; None: Hydra's current one)."""
    return typed_command() or os.environ.get(APP_COMMAND_ENV) or job_command(config) or UNNAMED


def app_name(config: Any = None) -> str:
    """The app as a word in a line: its script (`my_app.py`) or module (`pkg.app`)."""
    command = app_command(config)
    for prefix in ("python -m ", "python "):
        if command.startswith(prefix):
            return command.removeprefix(prefix)
    return command


def typed_command(argv: list[str] | None = None) -> str | None:
    """This process's own command where it runs the app's code (not an installed program's,
    nor this package's): from `__main__`'s module (`python -m`) or sys.argv[0]."""
    argv = sys.argv if argv is None else argv
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name and spec.origin:  # python -m pkg.app
        if not apps_code(Path(spec.origin)):
            return None
        return f"python -m {spec.name.removesuffix('.__main__')}"
    script = argv[0] if argv else ""
    path = Path(script)
    # python -c, an interactive interpreter, a program's console script (pytest, torchrun),
    # an installed module or this package's: not the app's
    if path.suffix != ".py" or not apps_code(path):
        return None
    shown = script
    if path.is_absolute():
        with_cwd = os.path.relpath(path)
        shown = with_cwd if not with_cwd.startswith("..") else script
    return f"python {shlex.quote(shown)}"


def installed(path: Path) -> bool:
    """Whether `path` lies in an installed package (site-packages, the interpreter's lib)."""
    roots = {sysconfig.get_paths()[k] for k in ("purelib", "platlib", "stdlib", "platstdlib")}
    return (
        "site-packages" in path.parts
        or "dist-packages" in path.parts
        or any(path.is_relative_to(Path(root).resolve()) for root in roots if root)
    )


def apps_code(path: Path) -> bool:
    """Whether `path` is an app's file: neither installed (site-packages, the interpreter's
    lib: pytest, torchrun, submitit) nor this package's own (its modules run as `python -m`)."""
    try:
        where = path.resolve()
    except OSError:
        return False
    package = Path(__file__).resolve().parents[1]  # ddp_launcher/
    plugins = package.parent / "hydra_plugins"
    return not (installed(where) or where.is_relative_to(package) or where.is_relative_to(plugins))


def job_command(config: Any = None) -> str | None:
    """`python <hydra.job.name>.py`, from `config` or Hydra's current config; None without."""
    name = None
    try:
        if config is not None:
            from omegaconf import OmegaConf

            name = OmegaConf.select(config, "hydra.job.name", default=None)
        else:
            from hydra.core.hydra_config import HydraConfig

            if HydraConfig.initialized():
                name = HydraConfig.get().job.name
    except Exception:  # noqa: BLE001 - a config whose job name does not resolve: unnamed
        name = None
    return f"python {shlex.quote(str(name))}.py" if name else None
