"""`hydra/sweeper=optuna` (docs/sweeps.md, "Optuna"): hydra-optuna-sweeper 1.3's configuration
on current Optuna, plus pruning across a DDP job's ranks (`pruner`:
ddp_launcher/ranks/pruning.py), a new
trial whenever any running one ends (a launcher's `launch_stream`; else batches, `launch`), the
study beside its jobs (study.py; job number = trial number) and resume (study.py). Hydra
instantiates hydra_plugins/hydra_ddp_launcher/optuna_sweeper.py's class, which makes an
:class:`OptunaSweeperBase`; its configs (`hydra/sweeper=optuna`, its alias `ddp_optuna`, and
`hydra/sweeper/sampler=<name>`) are served from there too (searchpath.py).
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.plugins.sweeper import Sweeper
from omegaconf import MISSING, DictConfig, OmegaConf

from ddp_launcher.core.errors import UserError, instantiate, job_value
from ddp_launcher.core.host import require_extra
from ddp_launcher.core.hydra_compat import trusting_own_targets
from ddp_launcher.core.run_dir import LAUNCH_FILE, read_result
from ddp_launcher.core.trials import (
    JOB_NUM_ATTR,
    PRUNER_CONFS,
    PRUNER_ENV,
    STORAGE_ENV,
    STUDY_ENV,
    SWEEP_DIR_ATTR,
    build_pruner,
)
from ddp_launcher.jobs import launcher_errors
from ddp_launcher.sweeper.space import search_space, trial_overrides
from ddp_launcher.sweeper.study import continue_study, directions, shown, storage_spec
from ddp_launcher.sweeper.usage import SlotUsage

log = logging.getLogger(__name__)

TARGET = "hydra_plugins.hydra_ddp_launcher.optuna_sweeper.OptunaSweeper"
RESULTS_FILE = "optimization_results.yaml"


# hydra/sweeper/sampler=NAME, as hydra-optuna-sweeper names them: each sampler's options, typed
# (hydra.sweeper.sampler.n_startup_trials=5 needs no `+`). null: the sampler's own default, so
# that each Optuna version keeps its own; the options are those of Optuna 4 and 5 (objects and
# callables, e.g. TPE's gamma, need a config of your own: see OptunaSweeperConf.sampler).
@dataclass
class TPESamplerConf:
    _target_: str = "optuna.samplers.TPESampler"
    seed: int | None = None
    consider_prior: bool | None = None
    prior_weight: float | None = None
    consider_magic_clip: bool | None = None
    consider_endpoints: bool | None = None
    n_startup_trials: int | None = None
    n_ei_candidates: int | None = None
    multivariate: bool | None = None
    group: bool | None = None
    warn_independent_sampling: bool | None = None
    constant_liar: bool | None = None


@dataclass
class RandomSamplerConf:
    _target_: str = "optuna.samplers.RandomSampler"
    seed: int | None = None


@dataclass
class CmaEsSamplerConf:
    _target_: str = "optuna.samplers.CmaEsSampler"
    seed: int | None = None
    x0: dict[str, Any] | None = None
    sigma0: float | None = None
    n_startup_trials: int | None = None
    warn_independent_sampling: bool | None = None
    consider_pruned_trials: bool | None = None
    restart_strategy: str | None = None
    popsize: int | None = None
    inc_popsize: int | None = None
    use_separable_cma: bool | None = None
    with_margin: bool | None = None
    lr_adapt: bool | None = None


@dataclass
class NSGAIISamplerConf:
    _target_: str = "optuna.samplers.NSGAIISampler"
    seed: int | None = None
    population_size: int | None = None
    mutation_prob: float | None = None
    crossover_prob: float | None = None
    swapping_prob: float | None = None


@dataclass
class QMCSamplerConf:
    _target_: str = "optuna.samplers.QMCSampler"
    seed: int | None = None
    qmc_type: str | None = None
    scramble: bool | None = None
    warn_asynchronous_seeding: bool | None = None
    warn_independent_sampling: bool | None = None


@dataclass
class GPSamplerConf:
    _target_: str = "optuna.samplers.GPSampler"
    seed: int | None = None
    n_startup_trials: int | None = None
    deterministic_objective: bool | None = None


@dataclass
class GridSamplerConf:
    _target_: str = "optuna.samplers.GridSampler"
    _partial_: bool = True  # given its grid (the space) in sweep()
    seed: int | None = None


SAMPLERS: dict[str, type] = {
    "tpe": TPESamplerConf,
    "random": RandomSamplerConf,
    "cmaes": CmaEsSamplerConf,
    "nsgaii": NSGAIISamplerConf,
    "qmc": QMCSamplerConf,
    "gp": GPSamplerConf,
    "grid": GridSamplerConf,
}
SAMPLER_CONFS = {cls: name for name, cls in SAMPLERS.items()}


def sampler_node(sampler: Any) -> Any:
    """`hydra.sweeper.sampler` to instantiate: one of SAMPLERS' configs without the options left
    null; a config of the user's own (hydra/sweeper/sampler: null, then {_target_: ...}) as is.
    A `_target_` written over another sampler's options is one line naming the fix."""
    kind = OmegaConf.get_type(sampler)
    if kind not in SAMPLER_CONFS:
        return sampler
    own = kind.__dataclass_fields__["_target_"].default
    if sampler._target_ != own:
        name = next((n for n, c in SAMPLERS.items() if c._target_ == sampler._target_), None)
        fix = (
            f"choose it with hydra/sweeper/sampler={name} (in a config's defaults: "
            f"- override /hydra/sweeper/sampler: {name})"
            if name
            else "for a sampler of your own, drop the group's options first: "
            "- override /hydra/sweeper/sampler: null (in your config's defaults)"
        )
        raise UserError(
            f"hydra.sweeper.sampler._target_={sampler._target_}, but the options are "
            f"hydra/sweeper/sampler={SAMPLER_CONFS[kind]}'s ({own}): {fix}"
        )
    values = OmegaConf.to_container(sampler, resolve=True)
    return {k: v for k, v in values.items() if v is not None}


def open_params() -> Any:
    """An empty `params` that takes keys: its keys are the user's search keys, not a
    schema's, and the command line's `hydra.sweeper.params={optim.lr: ...}` merges into it
    (into null, OmegaConf cannot merge; into a closed {}, only with `+`)."""
    node = OmegaConf.create({})
    OmegaConf.set_struct(node, False)
    return node


@dataclass
class OptunaSweeperConf:
    """`hydra.sweeper` of `hydra/sweeper=optuna` (hydra-optuna-sweeper's keys, plus pruner)."""

    _target_: str = TARGET
    # Hydra 1.3 would instantiate `sampler` and `pruner` with the sweeper, a bad argument
    # then an error in lines of Hydra's; this class instantiates them (as under Hydra 1.4)
    _recursive_: bool = False
    # hydra/sweeper/sampler=tpe, hydra/sweeper/pruner=median: typed options (SAMPLERS,
    # PRUNER_CONFS); the pruner group is optional (null: `pruner` below, as written). _self_
    # first: a group's config is merged over this schema's defaults, not under them.
    defaults: list[Any] = field(
        default_factory=lambda: ["_self_", {"sampler": "tpe"}, {"pruner": None}]
    )
    # {_target_: optuna.samplers.TPESampler, seed: ...}; MISSING: the defaults' group config
    # (hydra/sweeper/sampler=tpe) stays unless this is set (None here would replace it)
    sampler: Any = MISSING
    direction: Any = "minimize"  # or maximize, or a list of them
    storage: Any = None  # null (auto), sqlite, journal, journal:<file>, a URL: study.py
    study_name: str | None = None  # null: the sweep dir's name
    n_trials: int = 20  # with hydra.launcher.resume=true: the study's total
    n_jobs: int = 2  # trials running at once
    max_failure_rate: float = 0.0
    # {key: search space}, e.g. {optim.lr: tag(log, interval(0.01, 1))}
    params: dict[str, str] = field(default_factory=open_params)
    custom_search_space: str | None = None  # a callable(config, trial) adding to the space
    # median | percentile | hyperband | successive_halving | none, or {type: NAME, args...}, or
    # hydra/sweeper/pruner=NAME (typed options: hydra.sweeper.pruner.n_warmup_steps=2)
    pruner: Any = None
    stream: bool = True  # false: batches of n_jobs trials, each waiting for its slowest


def sampler_config(name: str) -> type:
    """`hydra/sweeper/sampler=<name>`'s config, typed (hydra_plugins/hydra_ddp_launcher/
    searchpath.py serves it)."""
    return SAMPLERS[name]


def pruner_config(name: str) -> type:
    """`hydra/sweeper/pruner=<name>`'s config, typed (served as sampler_config's)."""
    return PRUNER_CONFS[name]


OPTUNA_FLOOR = 4  # the major version launch/pyproject.toml asks for (FloatDistribution, ...)


def require_optuna(version: str) -> None:
    """One line where an older Optuna is installed: hydra-optuna-sweeper 1.3.0 asks pip for
    optuna<3 and gets 2.10, on which this sweeper cannot run (hydra-optuna-sweeper itself runs
    on Optuna 4 and 5)."""
    major = version.split(".")[0]
    if not major.isdigit() or int(major) < OPTUNA_FLOOR:
        raise UserError(
            f"hydra-ddp-launcher's Optuna sweeper needs optuna>={OPTUNA_FLOOR}, and optuna "
            f"{version} is installed (hydra-optuna-sweeper asks for optuna<3): pip install "
            f"'optuna>={OPTUNA_FLOOR}'"
        )


def grid_without_space(sampler: Any) -> bool:
    """A GridSampler config that leaves its grid to the sweep."""
    return (
        OmegaConf.is_dict(sampler)
        and str(sampler.get("_target_")).endswith("GridSampler")
        and sampler.get("search_space") is None
    )


class OptunaSweeperBase(Sweeper):
    def __init__(self, search_space: Any = None, **settings: Any) -> None:
        """`settings`: OptunaSweeperConf's fields (its defaults for those not given)."""
        with launcher_errors():  # (Hydra would wrap it in lines of its own)
            require_extra("optuna", "hydra/sweeper=optuna")
        self.init(search_space, settings)

    def init(self, search_space: Any, settings: dict[str, Any]) -> None:
        if search_space:
            raise UserError(
                "hydra.sweeper.search_space was removed in Hydra 1.2: write the space as "
                "hydra.sweeper.params (e.g. optim.lr: tag(log, interval(0.001, 1)))"
            )
        conf = OptunaSweeperConf(**settings)
        sampler = None if conf.sampler is MISSING else conf.sampler
        if grid_without_space(sampler):
            # hydra-optuna-sweeper's hydra/sweeper/sampler=grid (where both are installed, its
            # configs of the shared names are used): the space is given in sweep(), as to ours
            plain = OmegaConf.to_container(sampler)
            plain.pop("search_space", None)
            sampler = OmegaConf.create({**plain, "_partial_": True})
        if OmegaConf.is_dict(sampler) and "_target_" in sampler:
            # Hydra leaves a plugin's nested `_target_`s to it (`_recursive_: false` above)
            with trusting_own_targets():  # Optuna's samplers: the package's, not the app's
                sampler = instantiate(sampler_node(sampler))
        self.conf = conf
        # set again by setup (the sweep dir's name) and continue_study (what is left to ask)
        self.sampler, self.study_name, self.n_trials = sampler, conf.study_name, conf.n_trials
        # a resumed study's first job to run (ddp_launcher/sweeper/study.py's plan_trials)
        self.job_idx = 0
        self.resume = False
        self.config: DictConfig | None = None
        self.launcher: Any = None
        self.sweep_dir = Path(".")
        self.storage_spec = ""

    def setup(self, *, hydra_context: Any, task_function: Any, config: DictConfig) -> None:
        from hydra.core.plugins import Plugins

        self.config, self.hydra_context = config, hydra_context
        self.check_settings()
        self.launcher = Plugins.instance().instantiate_launcher(
            config=config, hydra_context=hydra_context, task_function=task_function
        )
        self.resume = bool(OmegaConf.select(config, "hydra.launcher.resume", default=False))
        self.sweep_dir = Path(str(config.hydra.sweep.dir)).resolve()
        self.storage_spec = storage_spec(self.conf.storage, config, self.sweep_dir)
        if self.study_name is None:
            self.study_name = self.sweep_dir.name

    def check_settings(self) -> None:
        """The settings no schema type checks, before anything is written (here, not in
        __init__: Hydra's instantiate would wrap the error in lines of its own)."""
        import optuna

        require_optuna(optuna.__version__)
        conf = self.conf
        if not 0.0 <= conf.max_failure_rate <= 1.0:
            raise UserError("hydra.sweeper.max_failure_rate: a fraction between 0 and 1")
        if conf.n_jobs < 1:
            raise UserError(f"hydra.sweeper.n_jobs={conf.n_jobs}: at least 1")
        if conf.n_trials < 1:  # (with hydra.launcher.resume=true too: the study's total)
            raise UserError(f"hydra.sweeper.n_trials={conf.n_trials}: at least 1")
        build_pruner(self.pruner_config())  # a pruner's argument out of its range

    def sweep(self, arguments: list[str]) -> None:
        import optuna

        from ddp_launcher.core.trials import open_storage

        dry_run = self.config is not None and OmegaConf.select(
            self.config, "hydra.launcher.dry_run", default=False
        )
        if dry_run and hasattr(self.launcher, "preview"):
            self.preview(arguments)  # ddp_launcher/preview.py: nothing written, no callback
            raise SystemExit(0)

        space, fixed = search_space(self.conf.params, arguments)
        grid = self.grid_of(space)  # (a grid over an interval: one line, nothing written)
        # (only now, the search space accepted: SQLite makes the file, not its dir)
        self.sweep_dir.mkdir(parents=True, exist_ok=True)
        ran_before = any(self.sweep_dir.glob(f"*/{LAUNCH_FILE}"))
        if self.resume and not continue_study(self) and ran_before:
            raise UserError(
                f"{self.sweep_dir} holds jobs of an Optuna sweep but no study "
                f"{self.study_name} in {shown(self.storage_spec)}: start a new sweep dir, or "
                "give the storage and study_name the sweep had"
            )
        sampler = self.space_sampler(grid)
        pruner = self.pruner_config()
        study = optuna.create_study(
            study_name=self.study_name,
            storage=open_storage(self.storage_spec),
            sampler=sampler,
            pruner=build_pruner(pruner),
            directions=directions(self.conf.direction),
            load_if_exists=True,
        )
        # The ranks reach their trials through the storage (ddp_launcher/ranks/pruning.py).
        os.environ[STORAGE_ENV], os.environ[STUDY_ENV] = self.storage_spec, study.study_name
        os.environ[PRUNER_ENV] = json.dumps(pruner)
        trials = Trials(self, study, space, fixed)
        usage = SlotUsage(self.conf.n_jobs)
        stream = getattr(self.launcher, "launch_stream", None) if self.conf.stream else None
        if stream is not None:
            stream(trials.next_overrides, trials.tell, self.conf.n_jobs)
        else:
            while trials.to_ask > 0 and not trials.too_many_failures():
                batch = [o for o in (trials.next_overrides() for _ in range(self.conf.n_jobs)) if o]
                # a launch numbers its jobs on from the first: one per run of consecutive numbers
                for _, group in itertools.groupby(enumerate(batch), lambda p: p[1][0] - p[0]):
                    run = [item for _, item in group]
                    returns = self.launcher.launch(
                        [overrides for _, overrides in run], initial_job_idx=run[0][0]
                    )
                    for (num, _), ret in zip(run, returns, strict=True):
                        trials.tell(num, ret)
        usage.measure(trials.job_dirs.values())
        trials.raise_failures()
        self.serialize(study)
        log.info(
            "Optuna study %s: %s; %s",
            study.study_name,
            trials.counts(),
            usage.line(),
        )

    def grid_of(self, space: dict[str, Any]) -> dict[str, list[Any]] | None:
        """The grid GridSampler would walk over `space` (each key's values; a key that has none
        is a UserError); None for any other sampler."""
        if not isinstance(self.sampler, functools.partial):
            return None
        return {key: grid_choices(key, d) for key, d in space.items()}

    def space_sampler(self, grid: dict[str, list[Any]] | None) -> Any:
        """The sampler (GridSampler is given its `grid` only now, and caps n_trials)."""
        if grid is None:
            return self.sampler
        self.n_trials = min(self.n_trials, math.prod(len(c) for c in grid.values()))
        return self.sampler(grid)

    def preview(self, arguments: list[str]) -> None:
        """hydra.launcher.dry_run=true (ddp_launcher/preview.py): the first batch (n_jobs trials) as
        the sweep would ask them, previewed by the launcher; nothing stored. The study is a
        throwaway: a copy of the stored one in a temporary dir when the sweep resumes (the same
        trials continue in their job dirs), else a new one in memory, with the same sampler."""
        import shutil
        import tempfile

        import optuna

        from ddp_launcher.core.trials import open_storage

        space, fixed = search_space(self.conf.params, arguments)
        with tempfile.TemporaryDirectory() as scratch:
            stored = stored_file(self.storage_spec)
            copied = ""
            if self.resume and stored is not None and stored.exists():
                shutil.copy2(stored, Path(scratch) / stored.name)
                copied = self.storage_spec.replace(str(stored), str(Path(scratch) / stored.name))
                self.storage_spec = copied
                continue_study(self)  # (on the copy)
            elif self.resume and stored is None:
                log.warning(
                    "the study in %s is not copied for a dry run: its trials are previewed as "
                    "those of a new study",
                    shown(self.storage_spec),
                )
            sampler = self.space_sampler(self.grid_of(space))
            study = optuna.create_study(
                study_name=self.study_name,
                storage=open_storage(copied) if copied else None,
                sampler=sampler,
                directions=directions(self.conf.direction),
                load_if_exists=True,
            )
            trials = Trials(self, study, space, fixed)
            batch = [o for o in (trials.next_overrides() for _ in range(self.conf.n_jobs)) if o]
            del study, trials  # (before its copy goes)
        later = max(0, self.n_trials - len(batch))
        note = (
            f"the next {later} trial(s) of n_trials={self.conf.n_trials} are asked as trials "
            "end: they depend on the results of these (Optuna's sampler), so no dry run can "
            "list them"
        )
        if not batch:
            print(f"Optuna study {self.study_name}: no trial left to ask (n_trials reached)")
            return
        nums = [num for num, _ in batch]
        self.launcher.preview([o for _, o in batch], nums[0], notes=[note] if later else [])

    def pruner_config(self) -> Any:
        """`hydra.sweeper.pruner` as plain data, as written (a `_target_` not yet instantiated):
        the ranks build the same pruner from it."""
        node = OmegaConf.select(self.config or {}, "hydra.sweeper.pruner", default=None)
        if node is None:
            return None if hasattr(self.conf.pruner, "prune") else self.conf.pruner
        return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node

    def serialize(self, study: Any) -> None:
        """optimization_results.yaml: the best trial (or the Pareto front), as Hydra's sweeper
        writes it."""
        from optuna.trial import TrialState

        if not study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            return
        if len(study.directions) == 1:
            best = study.best_trial
            results = {"name": "optuna", "best_params": best.params, "best_value": best.value}
        else:
            front = [{"params": t.params, "values": t.values} for t in study.best_trials]
            results = {"name": "optuna", "solutions": front}
        OmegaConf.save(OmegaConf.create(results), self.sweep_dir / RESULTS_FILE)


def stored_file(spec: str) -> Path | None:
    """The file of a SQLite or journal storage (study.py's storage_spec); None for a server."""
    from ddp_launcher.core.trials import JOURNAL_PREFIX

    if spec.startswith("sqlite:///"):
        return Path(spec[len("sqlite:///") :])
    if spec.startswith(JOURNAL_PREFIX):
        return Path(spec[len(JOURNAL_PREFIX) :])
    return None


def grid_choices(key: str, distribution: Any) -> list[Any]:
    """A discrete distribution's values, for GridSampler."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    if isinstance(distribution, CategoricalDistribution):
        return list(distribution.choices)
    if isinstance(distribution, IntDistribution) and not distribution.log:
        return list(range(distribution.low, distribution.high + 1, distribution.step))
    if isinstance(distribution, FloatDistribution) and distribution.step is not None:
        n = int(round((distribution.high - distribution.low) / distribution.step))
        return [distribution.low + i * distribution.step for i in range(n + 1)]
    raise UserError(f"hydra.sweeper.params.{key}: GridSampler needs choice(...) or range(...)")


class Trials:
    """The sweep's trials: asked one at a time (`next_overrides`), told as their jobs end
    (`tell`), with the counts the sweep's last line gives."""

    def __init__(
        self, sweeper: OptunaSweeperBase, study: Any, space: dict[str, Any], fixed: dict[str, str]
    ) -> None:
        from hydra.utils import get_method

        self.sweeper, self.study, self.space, self.fixed = sweeper, study, space, fixed
        custom = sweeper.conf.custom_search_space
        self.extend = get_method(custom) if custom else None
        self.to_ask = sweeper.n_trials
        self.running: dict[int, Any] = {}  # job number -> trial
        self.job_dirs: dict[int, Path] = {}
        self.states: dict[str, int] = {}
        self.failures: list[Any] = []
        self.told = 0

    def too_many_failures(self) -> bool:
        return bool(self.failures) and (
            len(self.failures) / max(self.told, 1) > self.sweeper.conf.max_failure_rate
        )

    def next_overrides(self) -> tuple[int, list[str]] | None:
        """(job number, overrides) of a new trial, or None: none left to ask, or too many
        failed already."""
        if self.to_ask <= 0 or self.too_many_failures():
            return None
        trial = self.study.ask()
        for key, distribution in self.space.items():
            trial._suggest(key, distribution)  # noqa: SLF001 - hydra-optuna-sweeper's way
        for key, value in self.fixed.items():
            trial.set_user_attr(key, value)
        if self.extend is not None:
            self.extend(self.sweeper.config, trial)
        num = trial.number  # job number = trial number: a resumed trial finds its job dir
        trial.set_user_attr(SWEEP_DIR_ATTR, str(self.sweeper.sweep_dir))
        trial.set_user_attr(JOB_NUM_ATTR, num)
        self.to_ask -= 1
        self.running[num] = trial
        return num, trial_overrides(trial.params, self.fixed)

    def tell(self, num: int, ret: Any) -> None:
        """Tell the study how trial `num`'s job ended: its value(s), pruned (its result.json
        says so), or failed."""
        from optuna.trial import TrialState

        trial = self.running.pop(num)
        job_dir = job_dir_of(ret)
        if job_dir is not None:
            self.job_dirs[num] = job_dir
        result = read_result(job_dir) if job_dir is not None else None
        state, values = TrialState.FAIL, None
        if ret.status.name == "COMPLETED":
            if result is not None and result.status == "pruned":
                state = TrialState.PRUNED
            else:
                values = objective_values(job_value(ret), len(self.study.directions))
                state = TrialState.COMPLETE if values is not None else TrialState.FAIL
        if state == TrialState.FAIL:
            self.failures.append(ret)
        try:
            self.study.tell(trial, values, state=state, skip_if_finished=True)
        except RuntimeError:
            # GridSampler stops the study once its grid is done (after_trial), which raises
            # outside study.optimize, after the trial is stored; n_trials ends the sweep there.
            from optuna.samplers import GridSampler

            if not isinstance(self.study.sampler, GridSampler):
                raise
        self.told += 1
        self.states[state.name.lower()] = self.states.get(state.name.lower(), 0) + 1

    def raise_failures(self) -> None:
        """Too many failed trials (max_failure_rate): the first failure's error ends the sweep."""
        if self.too_many_failures():
            log.error(
                "%d of %d trial(s) failed (max_failure_rate=%g)",
                len(self.failures),
                self.told,
                self.sweeper.conf.max_failure_rate,
            )
            self.failures[0].return_value  # noqa: B018 - JobReturn raises the job's own error

    def counts(self) -> str:
        told = ", ".join(f"{n} {state}" for state, n in sorted(self.states.items()))
        return f"{self.told} trial(s) this run ({told or 'none'})"


def job_dir_of(ret: Any) -> Path | None:
    """The job dir of a JobReturn (its working_dir is the launch dir unless Hydra chdirs)."""
    hydra = OmegaConf.select(ret.hydra_cfg or {}, "hydra", default=None)
    if hydra is None:
        return None
    output_dir = OmegaConf.select(hydra, "runtime.output_dir", default=None)
    if output_dir:
        return Path(str(output_dir))
    return Path(str(hydra.sweep.dir)) / str(hydra.sweep.subdir)


def objective_values(value: Any, n_objectives: int) -> list[float] | None:
    """The job's return value as the study's objective values, or None (the trial fails)."""
    try:
        values = [float(v) for v in value] if n_objectives > 1 else [float(value)]
    except (TypeError, ValueError):
        log.warning(
            "a trial returned %r: not %d float(s); it counts as failed", value, n_objectives
        )
        return None
    if len(values) != n_objectives:
        log.warning("a trial returned %d values for %d objectives", len(values), n_objectives)
        return None
    return values
