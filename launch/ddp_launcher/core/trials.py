"""How a sweep's Optuna trial and its job's rank 0 find each other (torch-free; the sweeper in
ddp_launcher/sweeper/ and the in-rank pruning in ddp_launcher/ranks/pruning.py both use it): the
environment the sweeper exports to every rank, the trial attributes that name a trial's job, the
storage a spec
names and the pruner `hydra.sweeper.pruner` names. Optuna is imported only when used."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ddp_launcher.core.errors import UserError, one_line

STORAGE_ENV = "HYDRA_DDP_OPTUNA_STORAGE"  # an RDB URL, or journal:<path> (a journal file)
STUDY_ENV = "HYDRA_DDP_OPTUNA_STUDY"
# The pruner's config as JSON: a study loaded elsewhere gets Optuna's default pruner, not the
# sweep's (the storage keeps no pruner), so each trial's rank 0 builds the sweep's own.
PRUNER_ENV = "HYDRA_DDP_OPTUNA_PRUNER"
PRUNERS = ("median", "percentile", "hyperband", "successive_halving", "none")
JOURNAL_PREFIX = "journal:"
# Trial user attributes that name the trial's job (the sweeper sets them when it asks).
SWEEP_DIR_ATTR = "sweep_dir"
JOB_NUM_ATTR = "job_num"


# The pruners' options, typed (`hydra/sweeper/pruner=median hydra.sweeper.pruner.n_warmup_steps=2`,
# or {type: median, n_warmup_steps: 2}); null: the pruner's own default, so that each Optuna
# version keeps its own (the options below are those of Optuna 4 and 5).
@dataclass
class MedianPrunerConf:
    type: str = "median"
    n_startup_trials: int | None = None
    n_warmup_steps: int | None = None
    interval_steps: int | None = None
    n_min_trials: int | None = None


@dataclass
class PercentilePrunerConf:
    type: str = "percentile"
    percentile: float = 25.0  # the quarter of the best trials goes on
    n_startup_trials: int | None = None
    n_warmup_steps: int | None = None
    interval_steps: int | None = None
    n_min_trials: int | None = None


@dataclass
class HyperbandPrunerConf:
    type: str = "hyperband"
    min_resource: int | None = None
    max_resource: Any = None  # "auto" or a count
    reduction_factor: int | None = None
    bootstrap_count: int | None = None


@dataclass
class SuccessiveHalvingPrunerConf:
    type: str = "successive_halving"
    min_resource: Any = None  # "auto" or a count
    reduction_factor: int | None = None
    min_early_stopping_rate: int | None = None
    bootstrap_count: int | None = None


@dataclass
class NopPrunerConf:
    type: str = "none"


PRUNER_CONFS: dict[str, type] = {
    "median": MedianPrunerConf,
    "percentile": PercentilePrunerConf,
    "hyperband": HyperbandPrunerConf,
    "successive_halving": SuccessiveHalvingPrunerConf,
    "none": NopPrunerConf,
}


def pruner_options(kind: str, args: dict[str, Any]) -> dict[str, Any]:
    """The pruner's arguments, checked against its typed options (an unknown key or a value of
    the wrong type is one line), those left null dropped."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        node = OmegaConf.merge(OmegaConf.structured(PRUNER_CONFS[kind]), {"type": kind, **args})
    except OmegaConfBaseException as e:
        known = ", ".join(k for k in PRUNER_CONFS[kind].__dataclass_fields__ if k != "type")
        raise UserError(
            f"hydra.sweeper.pruner: {kind}: {one_line(e)} (its options: {known or 'none'})"
        ) from None
    options = OmegaConf.to_container(node)
    return {k: v for k, v in options.items() if k != "type" and v is not None}


def build_pruner(pruner: Any) -> Any:
    """`hydra.sweeper.pruner`: a name (median, percentile, hyperband, successive_halving,
    none), a mapping with `type` and the pruner's own arguments (e.g. {type: median,
    n_warmup_steps: 2}), or one with a `_target_` (any Optuna pruner, instantiated)."""
    import optuna

    if pruner is None:
        return optuna.pruners.NopPruner()
    if hasattr(pruner, "prune"):
        return pruner
    if isinstance(pruner, Mapping):
        pruner = {str(k): v for k, v in pruner.items()}
    if isinstance(pruner, dict) and "_target_" in pruner:
        from hydra.utils import instantiate

        from ddp_launcher.core.hydra_compat import trusting_own_targets

        try:
            with trusting_own_targets():  # Optuna's pruners: the package's, not the app's
                return instantiate(pruner)
        except Exception as e:  # Hydra wraps the pruner's own ValueError/TypeError
            raise UserError(
                f"hydra.sweeper.pruner: {pruner['_target_']}: {one_line(e.__cause__ or e)}"
            ) from None
    args = dict(pruner) if isinstance(pruner, dict) else {"type": pruner}
    kind = str(args.pop("type", "none"))
    classes = {
        "median": optuna.pruners.MedianPruner,
        "percentile": optuna.pruners.PercentilePruner,
        "hyperband": optuna.pruners.HyperbandPruner,
        "successive_halving": optuna.pruners.SuccessiveHalvingPruner,
        "none": optuna.pruners.NopPruner,
    }
    if kind not in classes:
        raise UserError(f"hydra.sweeper.pruner={kind}: use one of {', '.join(PRUNERS)}")
    args = pruner_options(kind, args)
    try:
        return classes[kind](**args)
    except (TypeError, ValueError) as e:  # an unknown argument, or a value out of its range
        raise UserError(f"hydra.sweeper.pruner: {kind}: {one_line(e)}") from None


def open_storage(spec: str) -> Any:
    """The Optuna storage `spec` names: `journal:<path>` is a journal file (no database server;
    safe on NFS-like file systems, Optuna's file-lock backend), anything else a database URL
    (SQLite waits for a lock rather than failing at once: trials report concurrently)."""
    import optuna
    from sqlalchemy.exc import SQLAlchemyError

    try:
        if spec.startswith(JOURNAL_PREFIX):
            path = spec[len(JOURNAL_PREFIX) :]
            backend = optuna.storages.journal.JournalFileBackend(path)
            return optuna.storages.JournalStorage(backend)
        engine_kwargs = {"connect_args": {"timeout": 60}} if spec.startswith("sqlite:") else None
        return optuna.storages.RDBStorage(spec, engine_kwargs=engine_kwargs)
    except (ImportError, OSError, ValueError, SQLAlchemyError) as e:
        # (a URL's password stays out of the line)
        where = re.sub(r"://([^:/@]*):[^@/]*@", r"://\1:***@", spec)
        what = one_line(getattr(e, "orig", None) or e)  # SQLAlchemy's own, not its wrapper's
        raise UserError(
            f"hydra.sweeper.storage: cannot open the Optuna storage {where} "
            f"({type(e).__name__}: {what}): make its directory, install the URL's database "
            "driver, or use storage=sqlite or journal (a file in the sweep dir)"
        ) from None
