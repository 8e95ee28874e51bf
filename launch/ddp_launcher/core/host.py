"""What the package needs of the machine and the environment, checked at start in one line each
(a UserError: exit 2): Linux (the launcher forks its agents, pins CPU cores with
os.sched_setaffinity and locks files with fcntl), a torch at or above the tested floor, and the
extra (`pip install 'hydra-ddp-launcher[optuna]'`) a selected feature needs. Read from package
metadata and import specs: nothing here imports torch or an extra.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from importlib import metadata

from ddp_launcher.core.errors import UserError

DISTRIBUTION = "hydra-ddp-launcher"
# The oldest torch the package's tests pass with (launch/README.md, "Install"; how it was found:
# launch/CHANGELOG.md). Older ones lack what the ranks use.
TORCH_FLOOR = "2.9.1"
# extra -> the modules it brings (importable names)
EXTRAS = {
    "slurm": ("submitit",),
    "optuna": ("optuna",),
    "report": ("matplotlib", "scipy"),
    "wandb": ("wandb",),
}


def check_platform(platform: str | None = None) -> None:
    """Linux only: elsewhere the agents would die with an AttributeError mid-sweep."""
    platform = sys.platform if platform is None else platform
    if not platform.startswith("linux"):
        raise UserError(
            f"{DISTRIBUTION} runs on Linux only (this is {platform}: it forks its jobs' agents, "
            "pins CPU cores and locks files the Linux way): run it on a Linux machine or in a "
            "Linux container"
        )


def version_tuple(version: str) -> tuple[int, ...]:
    """(2, 9, 1) for 2.9.1+cpu, 2.10.0a0+git..., 2.9.1rc2."""
    return tuple(int(n) for n in re.findall(r"\d+", version.split("+")[0])[:3])


def check_torch(version: str | None = None) -> None:
    """torch installed, at or above TORCH_FLOOR (its version from its metadata: no import)."""
    if version is None:
        try:
            version = metadata.version("torch")
        except metadata.PackageNotFoundError:
            raise UserError(
                f"torch is not installed: {DISTRIBUTION} runs your app's ranks with it; install "
                f"the build your machine needs (pip install 'torch>={TORCH_FLOOR}')"
            ) from None
    if version_tuple(version) < version_tuple(TORCH_FLOOR):
        raise UserError(
            f"torch {version} is older than {DISTRIBUTION}'s floor {TORCH_FLOOR}: pip install "
            f"'torch>={TORCH_FLOOR}' (the oldest the package is tested with)"
        )


def check_host() -> None:
    """Everything a launch needs of the machine, before anything starts."""
    check_platform()
    check_torch()


def require_extra(extra: str, feature: str) -> None:
    """`feature` (what the user selected, e.g. hydra/sweeper=optuna) needs the extra's
    modules; one line naming the extra when one is missing."""
    missing = [name for name in EXTRAS[extra] if importlib.util.find_spec(name) is None]
    if missing:
        raise UserError(
            f"{feature} needs {DISTRIBUTION}[{extra}] ({', '.join(missing)} not installed): "
            f"pip install '{DISTRIBUTION}[{extra}]'"
        )
