"""What the installed Hydra needs from the project's entry points, the pinned 1.3 and 1.4 alike
(docs/architecture.md#hydra-versions):

* VERSION_BASE: hydra.main's and initialize*()'s `version_base`. Hydra 1.3 needs "1.3" (without
  it, 1.1's defaults and a warning); Hydra 1.4 deprecates the parameter (a warning in every
  process that passes it) and its defaults are the current ones: it gets none.
* the `_target_` whitelist: Hydra 1.4 reads an execution whitelist from
  hydra.main(execution_whitelist=...) and from a HydraContext's `execution_whitelist` (what
  run_job runs a job under); without one it warns for every `_target_` and, from 1.5, refuses
  it. Hydra 1.3 has neither parameter. The package trusts only its own targets
  (PACKAGE_TARGETS); an app's come from the app: `entry_point(..., trusted_targets=...)`, or
  an unmodified app's own hydra.main(execution_whitelist=...), which Hydra hands the launcher
  in its HydraContext and the launcher hands on to every rank of every job.
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
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import hydra
from hydra.types import HydraContext

HYDRA_VERSION = tuple(int(n) for n in re.findall(r"\d+", hydra.__version__)[:2])

VERSION_BASE: dict[str, str] = {} if HYDRA_VERSION >= (1, 4) else {"version_base": "1.3"}

# The package's own `_target_`s, and no app's: the callbacks an app's config names
# (ddp_launcher.RunGate, ...), its plugins' classes, and the Optuna samplers and pruners its
# sweeper instantiates (hydra.sweeper.sampler, hydra.sweeper.pruner). An app's own targets (its
# packages, the libraries its configs name) are the app's to trust: the whitelist must come
# from code, not config, for it to mean anything (Hydra's threat model).
PACKAGE_TARGETS: tuple[str, ...] = (
    "ddp_launcher.*",
    "hydra_plugins.hydra_ddp_launcher.*",
    "optuna.samplers.*",
    "optuna.pruners.*",
)
HAS_WHITELIST = "execution_whitelist" in inspect.signature(hydra.main).parameters


def execution_whitelist(app_targets: Sequence[str] = ()) -> dict[str, Any]:
    """hydra.main's `execution_whitelist` argument for an app run through the entry point, where
    Hydra has one: the package's targets and the app's own (`app_targets`, e.g. "my_pkg.*",
    "torch.optim.*"); {} under Hydra 1.3."""
    if not HAS_WHITELIST:
        return {}
    return {"execution_whitelist": (*PACKAGE_TARGETS, *app_targets)}


def active_whitelist() -> Any:
    """The execution whitelist this code runs under (hydra.main's in the process Hydra started,
    a job's inside run_job): what a job this process hands to its ranks runs under. None under
    Hydra 1.3, or outside both."""
    try:
        from hydra._internal.execution_policy import _get_active_execution_whitelist
    except ImportError:
        return None
    return _get_active_execution_whitelist()


@contextmanager
def trusting_own_targets() -> Iterator[None]:
    """Hydra's instantiate, inside, may also run PACKAGE_TARGETS (what the package instantiates
    itself: a sampler, a pruner), added to the whitelist in force (the app's): an app's own
    whitelist need not name them. A no-op under Hydra 1.3."""
    try:
        from hydra.utils import execution_whitelist as whitelist
    except ImportError:
        yield
        return
    with whitelist(PACKAGE_TARGETS):
        yield


SEARCH_GROUP = "hparams_search"
MULTIRUN_FLAGS = {"-m", "--multirun"}
_SEARCH_OVERRIDE = re.compile(rf"^\+{{0,2}}{SEARCH_GROUP}=(?!null$)\S")


def hydra_context(whitelist: Any = None, **fields: Any) -> HydraContext:
    """A HydraContext for a job the launcher runs itself, carrying `whitelist` where Hydra has
    the field: the app's, as Hydra gave it to the launcher (:func:`context_whitelist`) or as
    the app's process ran under it (:func:`active_whitelist`), never one of the package's."""
    if any(f.name == "execution_whitelist" for f in dataclasses.fields(HydraContext)):
        fields["execution_whitelist"] = whitelist
    return HydraContext(**fields)


def context_whitelist(context: Any) -> Any:
    """The execution whitelist a HydraContext carries (Hydra 1.4: hydra.main's, which Hydra
    gives the launcher and sweeper); None under Hydra 1.3."""
    return getattr(context, "execution_whitelist", None)


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
