"""How sweep jobs are told apart: the keys a sweep varies, short unambiguous names for them, and
values written to 4 significant digits. One place for W&B run names and config (job_identity,
in an app's ranks), the per-job lines of the launchers (ddp_launcher/jobs.py) and the sweep
summary's columns and legend (ddp_launcher/report/). Torch-free.

A job learns which of its overrides are swept from its launcher: ddp_launcher/jobs.py puts the
sweep's keys into the job's `hydra.job.env_set` under SWEPT_KEYS_ENV (recorded in .hydra/hydra.yaml
and set in the job's environment while it runs). Under `wandb agent` the swept keys are those of the
agent's parameter file (WANDB_SWEEP_PARAM_PATH).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SWEPT_KEYS_ENV = "HYDRA_DDP_SWEPT_KEYS"  # comma-separated override keys
WANDB_AGENT_ENV = ("WANDB_SWEEP_ID", "WANDB_RUN_ID")  # what `wandb agent` sets for a run


def parse_overrides(overrides: Iterable[str]) -> list[Any]:
    """Hydra's Override objects of `overrides` (each parsed alone: one bad string is skipped)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    parsed = []
    for text in overrides:
        try:
            parsed += parser.parse_overrides([str(text)])
        except Exception:  # noqa: BLE001 - e.g. a value Hydra's grammar rejects: not a key of ours
            continue
    return parsed


def override_key(override: Any) -> str:
    """`optim.lr` of `optim.lr=0.1`, `+optim.lr=0.1` and `~optim.lr`; `model` of `model=x`."""
    key = override.key_or_group
    return f"{key}@{override.package}" if override.package else key


def declared_sweep_keys(config: Any) -> list[str]:
    """The keys a sweep's own config declares swept, in order: sweep overrides of the command
    line (`optim.lr=0.05,0.1`, kept in hydra.overrides.task) and the sweeper's search space
    (`hydra.sweeper.params`: Optuna's, or the basic sweeper's)."""
    from omegaconf import OmegaConf

    task = OmegaConf.select(config, "hydra.overrides.task", default=None) or []
    params = OmegaConf.select(config, "hydra.sweeper.params", default=None) or {}
    if OmegaConf.is_config(params):
        params = OmegaConf.to_container(params)
    lines = [*(str(t) for t in task), *(f"{k}={v}" for k, v in dict(params).items())]
    keys = [override_key(o) for o in parse_overrides(lines) if o.is_sweep_override()]
    return list(dict.fromkeys(keys))


def varying_keys(job_overrides: Sequence[Sequence[str]]) -> list[str]:
    """Keys whose value differs between jobs (or that only some jobs set), in first-seen order."""
    values: dict[str, set[str]] = {}
    counts: dict[str, int] = {}
    for overrides in job_overrides:
        for key, value in override_pairs(overrides):
            values.setdefault(key, set()).add(value)
            counts[key] = counts.get(key, 0) + 1
    return [k for k in values if len(values[k]) > 1 or counts[k] < len(job_overrides)]


def swept_keys(config: Any, job_overrides: Sequence[Sequence[str]] = ()) -> list[str]:
    """The sweep's declared keys, then any other key whose value varies across `job_overrides`."""
    declared = declared_sweep_keys(config) if config is not None else []
    return list(dict.fromkeys([*declared, *varying_keys(job_overrides)]))


def override_pairs(overrides: Iterable[str]) -> list[tuple[str, str]]:
    """(key, value text) of each `key=value` override; deletions (`~key`) have value ""."""
    pairs = []
    for text in overrides:
        key, _, value = str(text).partition("=")
        pairs.append((key.lstrip("~+"), value))
    return pairs


def override_values(overrides: Iterable[str]) -> dict[str, Any]:
    """{key: typed value} of `key=value` overrides (0.1 a float, 64 an int, resnet18 a str), as
    Hydra's override grammar reads them."""
    values = {}
    for o in parse_overrides(overrides):
        if o.is_sweep_override():
            continue
        value = o.value()
        plain = isinstance(value, (int, float, str, bool))
        values[override_key(o)] = value if plain else str(value)
    return values


def fmt_value(value: Any) -> str:
    """A value for a name or a table: floats to 4 significant digits, the rest as is."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def fmt_duration(seconds: float) -> str:
    """41.2s, 12m05s, 2h05m."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    return f"{minutes // 60}h{minutes % 60:02d}m"


def short_keys(keys: Sequence[str]) -> dict[str, str]:
    """{key: its shortest dotted suffix no other key shares}: optim.lr -> lr, model.hidden ->
    hidden; optim.lr and sched.lr stay whole."""
    parts = {k: k.split(".") for k in keys}
    short = {}
    for key, mine in parts.items():
        for n in range(1, len(mine) + 1):
            candidate = ".".join(mine[-n:])
            if not any(".".join(p[-n:]) == candidate for k, p in parts.items() if k != key):
                short[key] = candidate
                break
        else:
            short[key] = key
    return short


def swept_values(overrides: Iterable[str], keys: Sequence[str]) -> dict[str, Any]:
    """{short key: typed value} of the swept `keys` among a job's `overrides`, in `keys` order."""
    values = override_values(overrides)
    names = short_keys(keys)
    return {names[k]: values[k] for k in keys if k in values}


def label(values: Mapping[str, Any], sep: str = ",") -> str:
    """`lr=0.01235,hidden=128`: a job's swept values, floats to 4 significant digits."""
    return sep.join(f"{k}={fmt_value(v)}" for k, v in values.items())


def sweep_group(experiment: str | None, sweep_dir: str | os.PathLike) -> str:
    """The W&B group of a sweep's runs: the experiment's name (else `sweep`) and the sweep dir's
    last two parts (date and time): `sweep-2026-11-29_21-30-00-123456`."""
    stamp = "_".join(Path(str(sweep_dir)).parts[-2:])
    return f"{experiment or 'sweep'}-{stamp}"


def agent_sweep_keys(environ: Mapping[str, str] = os.environ) -> list[str] | None:
    """Under `wandb agent`: the keys of the agent's parameter file for this run (what its sweep
    varies); None outside an agent, or when the file cannot be read."""
    if not all(environ.get(k) for k in WANDB_AGENT_ENV):
        return None
    path = environ.get("WANDB_SWEEP_PARAM_PATH")
    if not path:
        return None
    try:
        import yaml

        data = yaml.safe_load(Path(path).read_text())
    except (OSError, ValueError, ImportError):
        return None
    if not isinstance(data, dict):
        return None
    return [str(k) for k in data if not str(k).startswith("_") and k != "wandb_version"]


def in_wandb_agent(environ: Mapping[str, str] = os.environ) -> bool:
    """True in a run `wandb agent` started: its run id and sweep id are in the environment."""
    return all(environ.get(k) for k in WANDB_AGENT_ENV)


@dataclass
class JobIdentity:
    """Where a job's run goes in a tracker (W&B) and what tells it apart from its sweep's
    other jobs: the public `ddp_launcher.job_identity`."""

    group: str | None = None
    name: str | None = None
    swept: dict[str, Any] = field(default_factory=dict)  # {short key: value}
    agent: bool = False  # started by `wandb agent` (its run, project and entity are the agent's)


def job_identity(group: str | None = None, name: str | None = None) -> JobIdentity:
    """Defaults from Hydra, for the job running in this process (`group`, `name`: the app's own,
    which win): a sweep's jobs share one group (the `experiment` config group's choice, else
    `sweep`, plus the sweep dir's timestamp); a sweep job is named by its number and the values
    of the keys its sweep varies (`3:lr=0.01235,hidden=128`); a plain run by its overrides.
    Under `wandb agent` the swept keys are the agent's parameters."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    agent = in_wandb_agent()
    if not HydraConfig.initialized():
        return JobIdentity(group, name, agent=agent)
    hc = HydraConfig.get()
    sweep = hc.mode == RunMode.MULTIRUN
    experiment = hc.runtime.choices.get("experiment")
    if group is None:
        group = sweep_group(experiment, hc.sweep.dir) if sweep else experiment
    overrides = [str(o) for o in hc.overrides.task]
    keys = hc.job.env_set.get(SWEPT_KEYS_ENV)  # "" from a launcher: a sweep of one job
    keys = [k for k in keys.split(",") if k] if keys is not None else agent_sweep_keys()
    if keys is None and sweep:  # started by another launcher: every override tells it apart
        keys = [key for key, _ in override_pairs(overrides)]
    swept = swept_values(overrides, keys or [])
    if name is None:
        name = label(swept) if keys is not None else hc.job.override_dirname
        if sweep:
            name = f"{hc.job.num}:{name}" if name else str(hc.job.num)
    return JobIdentity(group, name or None, swept, agent)
