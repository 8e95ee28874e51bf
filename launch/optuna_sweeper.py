"""`hydra/sweeper=ddp_optuna`: hydra-optuna-sweeper's Optuna sweeper, able to resume.

hydra-optuna-sweeper 1.3 loads a stored study (`create_study(load_if_exists=True)`) but then
asks `n_trials` new trials and numbers their jobs from 0 again, over the old job dirs. With
`hydra.launcher.resume=true` (either launcher), this subclass continues the study instead:

* **storage**: `hydra.sweeper.storage: null` becomes `sqlite:///<sweep dir>/optuna.db` (and
  `study_name: null` the sweep dir's name), so the study lives beside its jobs; a database
  URL of your own works the same way;
* **trial count**: `n_trials` is the study's total: finished trials (complete, pruned,
  failed) are kept and counted, and only the rest are asked;
* **interrupted trials** (left running by a sweep that died) are asked again, first, into the
  job dirs they had (job number = trial number), where the launcher continues them from their
  checkpoints, or hands back their result if they had finished; one that cannot get its dir
  back (not among the study's last trials) is marked failed;
* a seeded sampler is reseeded: it would otherwise propose its first points again;
* a sweep dir with jobs but no stored study (it ran with its study in memory) is an error.

Without resume it is hydra-optuna-sweeper's sweeper, unchanged. The Sweeper class Hydra
instantiates is hydra_plugins/hydra_ddp_optuna_sweeper's subclass of :class:`DDPOptunaSweeperBase`.
Optuna 2.10's database storage needs SQLAlchemy < 2 (requirements.txt pins it).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra_plugins.hydra_optuna_sweeper.config import OptunaSweeperConf
from hydra_plugins.hydra_optuna_sweeper.optuna_sweeper import OptunaSweeper
from omegaconf import DictConfig, OmegaConf

from core.errors import UserError
from core.run_dir import LAUNCH_FILE

log = logging.getLogger(__name__)

STUDY_DB = "optuna.db"  # in the sweep dir: the study of a resumable sweep
OPEN_STATES = ("RUNNING", "WAITING")  # optuna.trial.TrialState names of unfinished trials


@dataclass
class DDPOptunaSweeperConf(OptunaSweeperConf):
    _target_: str = "hydra_plugins.hydra_ddp_optuna_sweeper.optuna_sweeper.DDPOptunaSweeper"


ConfigStore.instance().store(
    group="hydra/sweeper", name="ddp_optuna", node=DDPOptunaSweeperConf, provider="hydra-ddp"
)


@dataclass(frozen=True)
class TrialPlan:
    """How a resumed sweep continues its study."""

    rerun: list[int]  # unfinished trials asked again first, into their own job dirs
    fail: list[int]  # unfinished trials that cannot get their job dir back: marked failed
    finished: int  # trials that count towards n_trials (the failed ones above included)
    to_ask: int  # trials this run asks (reruns first)
    first_job: int  # the job number of the first trial asked


def plan_trials(states: Sequence[tuple[int, str]], n_trials: int) -> TrialPlan:
    """From the study's (trial number, state name) pairs: the unfinished trials at the end of
    the study (a dead sweep's last batch) are asked again in order, so their job numbers stay
    their trial numbers; other running ones are marked failed; `n_trials` counts the total."""
    states = sorted(states)
    tail: list[int] = []
    for number, state in reversed(states):
        if state not in OPEN_STATES:
            break
        tail.insert(0, number)
    fail = [n for n, state in states if state == "RUNNING" and n not in tail]
    finished = sum(state not in OPEN_STATES for _, state in states) + len(fail)
    first = [n for n, state in states if state == "WAITING" and n not in tail] + tail
    return TrialPlan(
        rerun=tail,
        fail=fail,
        finished=finished,
        to_ask=max(0, n_trials - finished),
        first_job=min(first) if first else len(states),
    )


class DDPOptunaSweeperBase(OptunaSweeper):
    """hydra-optuna-sweeper's OptunaSweeper; with hydra.launcher.resume=true it continues the
    sweep's stored study (see the module docstring)."""

    resume = False
    sweep_dir: Path | None = None

    def setup(self, *, hydra_context: Any, task_function: Any, config: DictConfig) -> None:
        super().setup(hydra_context=hydra_context, task_function=task_function, config=config)
        self.resume = bool(OmegaConf.select(config, "hydra.launcher.resume", default=False))
        impl = self.sweeper
        if self.resume:
            self.sweep_dir = sweep_dir = Path(str(config.hydra.sweep.dir)).resolve()
            sweep_dir.mkdir(parents=True, exist_ok=True)  # SQLite makes the file, not its dir
            if impl.storage is None:
                impl.storage = f"sqlite:///{sweep_dir / STUDY_DB}"
            if impl.study_name is None:
                impl.study_name = sweep_dir.name

    def sweep(self, arguments: list[str]) -> None:
        if self.resume and not continue_study(self.sweeper) and self.ran_before():
            raise UserError(
                f"{self.sweep_dir} holds jobs of an Optuna sweep but no study "
                f"{self.sweeper.study_name} in {self.sweeper.storage}: a study kept in memory "
                "(hydra.sweeper.storage=null without hydra.launcher.resume=true) ended with its "
                "sweep: start a new sweep dir, with hydra.launcher.resume=true from the start"
            )
        return super().sweep(arguments)

    def ran_before(self) -> bool:
        return any(self.sweep_dir.glob(f"*/{LAUNCH_FILE}"))


def continue_study(impl: Any) -> bool:
    """Prepare hydra-optuna-sweeper's sweeper (`impl`) to continue its stored study, if there
    is one (else False): trials to ask again set waiting (Optuna asks waiting trials first),
    the count left to ask and the first job number set, the sampler reseeded."""
    import optuna
    from optuna.trial import TrialState

    storage = optuna.storages.get_storage(impl.storage)
    try:
        study_id = storage.get_study_id_from_name(impl.study_name)
    except KeyError:
        return False  # a new study: this run creates it
    trials = storage.get_all_trials(study_id, deepcopy=False)
    plan = plan_trials([(t.number, t.state.name) for t in trials], impl.n_trials)
    state = {t.number: t.state for t in trials}
    for number in plan.fail:
        trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, number)
        storage.set_trial_state(trial_id, TrialState.FAIL)
    for number in plan.rerun:
        if state[number] == TrialState.RUNNING:
            trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, number)
            storage.set_trial_state(trial_id, TrialState.WAITING)
    impl.n_trials, impl.job_idx = plan.to_ask, plan.first_job
    if trials and hasattr(impl.sampler, "reseed_rng"):
        impl.sampler.reseed_rng()
    log.info(
        "Optuna study %s (%s): %d trial(s) finished, %d to run again%s, %d to ask",
        impl.study_name,
        impl.storage,
        plan.finished,
        len(plan.rerun),
        f", {len(plan.fail)} interrupted marked failed" if plan.fail else "",
        plan.to_ask,
    )
    return True
