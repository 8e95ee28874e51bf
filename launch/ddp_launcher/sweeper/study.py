"""The study of an Optuna sweep: where it is stored (outside the launching process: the ranks
report to it) and how a resumed sweep continues it.

`hydra.sweeper.storage`: `null`/`auto` is a journal file in the sweep dir under SLURM (no
database server; Optuna's file lock works on NFS-like file systems), else SQLite there;
`sqlite` or `journal` force one; a database URL of your own is used as is.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import takewhile
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from ddp_launcher.core.errors import UserError
from ddp_launcher.core.trials import JOURNAL_PREFIX

log = logging.getLogger(__name__)

STUDY_DB = "optuna.db"  # in the sweep dir: the study on one machine
STUDY_JOURNAL = "optuna.journal"  # in the sweep dir: the study of a SLURM sweep
OPEN_STATES = ("RUNNING", "WAITING")  # optuna.trial.TrialState names of unfinished trials


def on_slurm(config: DictConfig) -> bool:
    target = str(OmegaConf.select(config, "hydra.launcher._target_", default="") or "")
    return "slurm" in target.lower() or "submitit" in target.lower()


def storage_spec(storage: Any, config: DictConfig, sweep_dir: Path) -> str:
    """What `hydra.sweeper.storage` names, as ranks/pruning.py's open_storage reads it."""
    kind = "auto" if storage is None else str(storage)
    if kind == "auto":
        kind = "journal" if on_slurm(config) else "sqlite"
    if kind == "sqlite":
        return f"sqlite:///{sweep_dir / STUDY_DB}"
    if kind == "journal":
        return f"{JOURNAL_PREFIX}{sweep_dir / STUDY_JOURNAL}"
    if kind.startswith(JOURNAL_PREFIX) or "://" in kind:
        return kind
    raise UserError(
        f"hydra.sweeper.storage={kind}: use auto (null), sqlite, journal, journal:<file> or a "
        "database URL such as postgresql://host/db"
    )


def shown(spec: str) -> str:
    """A storage for the log: a database URL without its password."""
    if "://" not in spec or "@" not in spec:
        return spec
    scheme, rest = spec.split("://", 1)
    credentials, host = rest.rsplit("@", 1)
    return f"{scheme}://{credentials.split(':', 1)[0]}:***@{host}"


def directions(direction: Any) -> list[str]:
    """`direction`: minimize | maximize, or a list of them (multi-objective)."""
    many = not isinstance(direction, str) and isinstance(direction, Sequence | ListConfig)
    items = list(direction) if many else [direction]
    names = [getattr(d, "name", str(d)) for d in items]
    for name in names:
        if name not in ("minimize", "maximize"):
            raise UserError(f"hydra.sweeper.direction={name}: use minimize or maximize")
    return names


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
    the study (a dead sweep's last trials) are asked again in order, so their job numbers stay
    their trial numbers; other running ones are marked failed; `n_trials` counts the total."""
    states = sorted(states)
    tail = [n for n, _ in takewhile(lambda t: t[1] in OPEN_STATES, reversed(states))][::-1]
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


def continue_study(sweeper: Any) -> bool:
    """Prepare `sweeper` to continue its stored study, if there is one (else False): trials to
    ask again set waiting (Optuna asks those first), `n_trials` and `job_idx` set to what is left
    to ask and its first job number, the sampler reseeded (else it proposes its first points)."""
    from optuna.trial import TrialState

    from ddp_launcher.core.trials import open_storage

    storage = open_storage(sweeper.storage_spec)
    try:
        study_id = storage.get_study_id_from_name(sweeper.study_name)
    except KeyError:
        return False  # a new study: this run creates it
    trials = storage.get_all_trials(study_id, deepcopy=False)
    plan = plan_trials([(t.number, t.state.name) for t in trials], sweeper.n_trials)
    state = {t.number: t.state for t in trials}
    reset = {n: TrialState.FAIL for n in plan.fail}
    reset |= {n: TrialState.WAITING for n in plan.rerun if state[n] == TrialState.RUNNING}
    for number, new_state in reset.items():
        trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, number)
        storage.set_trial_state_values(trial_id, new_state)
    sweeper.n_trials, sweeper.job_idx = plan.to_ask, plan.first_job
    if trials and hasattr(sweeper.sampler, "reseed_rng"):
        sweeper.sampler.reseed_rng()
    log.info(
        "Optuna study %s (%s): %d trial(s) finished, %d to run again%s, %d to ask",
        sweeper.study_name,
        shown(sweeper.storage_spec),
        plan.finished,
        len(plan.rerun),
        f", {len(plan.fail)} interrupted marked failed" if plan.fail else "",
        plan.to_ask,
    )
    return True
