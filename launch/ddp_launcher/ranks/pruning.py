"""Pruning a sweep's trial from inside its ranks (`hydra.sweeper.pruner`, ddp_launcher/sweeper/).

The Optuna sweeper runs each trial as a DDP job in other processes (torchrun agents, SLURM
tasks), so the trial is reached through the study's shared storage: the sweeper exports the
storage, the study's name and its pruner (ddp_launcher/core/trials.py's STORAGE_ENV, STUDY_ENV,
PRUNER_ENV, inherited by every rank under either launcher) and tags each trial with its
sweep dir and job number, which each job reads from its own Hydra config. After every
validation rank 0 reports the monitored metric to its trial and asks the pruner
(`TrialLink.should_prune`); the app hands the answer to every rank (one broadcast), so all of
them stop at the same epoch, and raises :class:`Pruned` after the epoch's checkpoint: the
job's result says `pruned`, and the sweeper tells the study TrialState.PRUNED.

Torch-free. What the sweeper shares with this module (variable names, storage, pruner) is in
ddp_launcher/core/trials.py.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from ddp_launcher.core.trials import (
    JOB_NUM_ATTR,
    PRUNER_ENV,
    STORAGE_ENV,
    STUDY_ENV,
    SWEEP_DIR_ATTR,
    build_pruner,
    open_storage,
)

log = logging.getLogger(__name__)


class Pruned(Exception):  # noqa: N818 - a verdict, like Preempted, not an error
    """The sweeper's pruner stopped this trial after a validation (its checkpoint is saved)."""

    def __init__(self, epoch: int, value: float, best: float | None) -> None:
        super().__init__(f"pruned by the sweeper after epoch {epoch} ({value:.6g})")
        self.epoch, self.value, self.best = epoch, value, best


class TrialLink:
    """Rank 0's handle on its Optuna trial (None when the job is no pruned trial)."""

    def __init__(self, trial: Any) -> None:
        self.trial = trial

    @classmethod
    def from_env(cls, sweep_dir: str | None, job_num: int | None) -> TrialLink | None:
        """The running trial of this job (sweep dir, job number), when the Optuna sweeper
        started it with a pruner; else None."""
        spec, study_name = os.environ.get(STORAGE_ENV), os.environ.get(STUDY_ENV)
        if not spec or not study_name or sweep_dir is None or job_num is None:
            return None
        import optuna
        from optuna.trial import TrialState

        pruner = build_pruner(json.loads(os.environ.get(PRUNER_ENV) or "null"))
        study = optuna.load_study(study_name=study_name, storage=open_storage(spec), pruner=pruner)
        if len(study.directions) > 1:
            return None  # Optuna prunes single-objective studies only
        here = str(Path(sweep_dir).resolve())
        for frozen in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            attrs = frozen.user_attrs
            if attrs.get(SWEEP_DIR_ATTR) == here and attrs.get(JOB_NUM_ATTR) == int(job_num):
                return cls(optuna.trial.Trial(study, frozen._trial_id))
        log.warning("no running Optuna trial for job #%s of %s: not pruned", job_num, here)
        return None

    def should_prune(self, epoch: int, value: float) -> bool:
        self.trial.report(float(value), step=epoch)
        return self.trial.should_prune()


def pruner_for(rank: int) -> TrialLink | None:
    """Rank 0's trial of a job the Optuna sweeper runs with a pruner; None elsewhere."""
    if rank != 0:
        return None
    from hydra.core.hydra_config import HydraConfig

    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode is None or hydra_cfg.mode.name != "MULTIRUN":
        return None
    return TrialLink.from_env(str(hydra_cfg.sweep.dir), hydra_cfg.job.num)
