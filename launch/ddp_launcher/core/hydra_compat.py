"""What the installed Hydra needs from the project's entry points, the pinned 1.3 and 1.4 alike
(docs/architecture.md#hydra-versions):

* VERSION_BASE: hydra.main's and initialize*()'s `version_base`. Hydra 1.3 needs "1.3" (without
  it, 1.1's defaults and a warning); Hydra 1.4 deprecates the parameter (a warning in every
  process that passes it) and its defaults are the current ones: it gets none.
* TRUSTED_TARGETS / EXECUTION_WHITELIST: the `_target_`s this project's configs may name.
  Hydra 1.4 reads an execution whitelist from hydra.main(execution_whitelist=...) and from a
  HydraContext's `execution_whitelist` (what run_job runs a job under); without one it warns
  for every `_target_` and, from 1.5, refuses it. Hydra 1.3 has neither parameter: empty.
* search_as_multirun: a search config (`hparams_search=<name>`) is a multirun with or without
  -m. Hydra 1.4 reads `hydra.mode` only from the primary config or the command line, so the
  search configs' `hydra.mode: MULTIRUN` alone ends in "hydra.mode changed during config
  composition": the entry point puts -m on the command line for them.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import sys
from typing import Any

import hydra
from hydra.types import HydraContext

HYDRA_VERSION = tuple(int(n) for n in re.findall(r"\d+", hydra.__version__)[:2])

VERSION_BASE: dict[str, str] = {} if HYDRA_VERSION >= (1, 4) else {"version_base": "1.3"}

# Packages, not single names, so a new class in one of them needs no edit here. A target of
# your own package (a dataset, a transform, a model) goes here too: the whitelist must come
# from code, not config, for it to mean anything (Hydra's threat model).
TRUSTED_TARGETS: tuple[str, ...] = (
    # the launcher's own (its callbacks), and the experiment's packages
    "ddp_launcher.*",
    "components.*",
    "conf.*",
    "data.*",
    "models.*",
    # libraries its configs name: optimizers, torchvision transforms and models, Optuna's
    # samplers and pruners (hydra.sweeper.sampler, hydra.sweeper.pruner)
    "torch.optim.*",
    "torchvision.*",
    "optuna.samplers.*",
    "optuna.pruners.*",
)

EXECUTION_WHITELIST: dict[str, Any] = (
    {"execution_whitelist": TRUSTED_TARGETS}
    if "execution_whitelist" in inspect.signature(hydra.main).parameters
    else {}
)

SEARCH_GROUP = "hparams_search"
MULTIRUN_FLAGS = {"-m", "--multirun"}
_SEARCH_OVERRIDE = re.compile(rf"^\+{{0,2}}{SEARCH_GROUP}=(?!null$)\S")


def hydra_context(**fields: Any) -> HydraContext:
    """A HydraContext that carries the project's execution whitelist where Hydra has one."""
    if any(f.name == "execution_whitelist" for f in dataclasses.fields(HydraContext)):
        fields.setdefault("execution_whitelist", TRUSTED_TARGETS)
    return HydraContext(**fields)


# Hydra's flags that print the config or its sources instead of running (--cfg job, --info)
INTROSPECTION_FLAGS = {"--cfg", "-c", "--info", "-i"}


def search_as_multirun(argv: list[str]) -> list[str]:
    """`argv` with -m added when it picks a search config (`hparams_search=<name>`) without
    -m/--multirun: what the search configs' own `hydra.mode: MULTIRUN` says, where Hydra 1.4
    reads it. With --cfg or --info (Hydra prints configs in RUN mode only: "Only one of --run,
    --multirun, --cfg, --info ... can be specified"), the search's job config is printed as a
    run's, with one line saying what a trial adds and how to preview the trials."""
    if not any(_SEARCH_OVERRIDE.match(a) for a in argv[1:]):
        return argv
    if INTROSPECTION_FLAGS & set(argv[1:]):
        print(
            "a search config: this is its jobs' config before each trial's hydra.sweeper.params; "
            "hydra.launcher.dry_run=true (without --cfg/--info) previews its first trials",
            file=sys.stderr,
        )
        # Right after the search override, among the command line's overrides: appended at
        # the end it became the argument of a trailing --info ("invalid choice")
        argv = [a for a in argv if a not in MULTIRUN_FLAGS]
        at = next(i for i, a in enumerate(argv) if i and _SEARCH_OVERRIDE.match(a)) + 1
        return [*argv[:at], "hydra.mode=RUN", *argv[at:]]
    if MULTIRUN_FLAGS & set(argv[1:]):
        return argv
    return [argv[0], "-m", *argv[1:]]


DRY_RUN_ARG = re.compile(r"^\+{0,2}hydra\.launcher\.dry_run=(?!(false|False|0|no)$)")


def dry_run_requested(overrides: list[str]) -> bool:
    """Whether command-line overrides ask for a dry run (hydra.launcher.dry_run=true)."""
    return any(DRY_RUN_ARG.match(str(arg)) for arg in overrides)


def dry_run_as_multirun(argv: list[str]) -> list[str]:
    """`argv` with -m added for a dry run (hydra.launcher.dry_run=true previews a sweep:
    ddp_launcher/preview.py)."""
    if not dry_run_requested(argv[1:]):
        return argv
    if MULTIRUN_FLAGS & set(argv[1:]) or INTROSPECTION_FLAGS & set(argv[1:]):
        return argv
    return [argv[0], "-m", *argv[1:]]


def yaml_errors_as_user_errors() -> None:
    """A config file that is not valid YAML: one line naming the file, the line and the
    problem (a UserError, which Hydra prints alone), not yaml's traceback through Hydra's
    composition. Hydra reads every config file through its `file` config source's
    load_config and has no hook around it: the method is wrapped, once. (Hydra's plugin scan
    loads its core plugins' modules afresh: the class to wrap is the one it registered.)"""
    try:
        from hydra._internal.sources_registry import SourcesRegistry
        from hydra.core.plugins import Plugins
    except ImportError:  # a Hydra without them: its own traceback, as before
        return
    Plugins.instance()  # the scan that registers the config sources
    FileConfigSource = SourcesRegistry.instance().resolve("file")
    load = FileConfigSource.load_config
    if getattr(load, "names_yaml_errors", False):
        return

    def load_config(self: Any, config_path: str) -> Any:
        import yaml

        from ddp_launcher.core.errors import UserError

        try:
            return load(self, config_path)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f", line {mark.line + 1}" if mark is not None else ""
            problem = " ".join(str(getattr(e, "problem", None) or e).split())
            path = f"{self.path}/{self._normalize_file_name(config_path)}"
            raise UserError(
                f"config file {path}{where} is not valid YAML ({problem}): fix the file"
            ) from None

    load_config.names_yaml_errors = True  # type: ignore[attr-defined]
    FileConfigSource.load_config = load_config  # type: ignore[method-assign]
