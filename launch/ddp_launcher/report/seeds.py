"""Seeds aggregated: a sweep's jobs grouped by their configuration less the keys to aggregate
over (`seed` by default), and per group and metric the mean ± sample standard deviation
(n − 1), n and the 95 % Student-t confidence interval of the mean, groups ranked by the mean.

Pure: it takes each job's swept values and metrics and returns numbers; the sweep report
formats them. A group of one job has no standard deviation and no interval (rather than a
zero one). Student's t quantiles come from scipy (scikit-learn's own dependency).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

DEFAULT_OVER = ("seed",)
CONFIDENCE = 0.95


@dataclass(frozen=True)
class Stat:
    """One metric over a group's jobs."""

    n: int
    mean: float
    std: float | None = None  # sample standard deviation (n − 1); None for n = 1
    ci_low: float | None = None  # the 95 % Student-t interval of the mean; None for n = 1
    ci_high: float | None = None


@dataclass
class Group:
    """Jobs whose swept values differ only in the aggregated keys."""

    config: dict[str, Any]  # the swept values they share
    jobs: list[str] = field(default_factory=list)
    over: dict[str, list[Any]] = field(default_factory=dict)  # aggregated key -> its values
    stats: dict[str, Stat] = field(default_factory=dict)


def describe(values: Sequence[float], confidence: float = CONFIDENCE) -> Stat:
    """n, mean, sample std and the Student-t interval of the mean of `values` (finite ones)."""
    xs = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    n = len(xs)
    if n == 0:
        raise ValueError("no values")
    mean = math.fsum(xs) / n
    if n == 1:
        return Stat(1, mean)
    std = math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / (n - 1))
    from scipy.special import stdtrit  # Student's t quantile: scipy.stats.t.ppf's, half the import

    half = float(stdtrit(n - 1, 0.5 + confidence / 2)) * std / math.sqrt(n)
    return Stat(n, mean, std, mean - half, mean + half)


def strip_key(key: str) -> str:
    return key.lstrip("+~")


def group_jobs(
    jobs: Sequence[tuple[str, Mapping[str, Any], Mapping[str, float]]],
    over: Sequence[str] = DEFAULT_OVER,
) -> list[Group]:
    """Group (job name, {swept key: value}, {metric: value}) triples by their swept values less
    the keys in `over`; each group's stats per metric over the jobs that measured it. Groups
    keep the order of their first job."""
    aggregated = {strip_key(k) for k in over}
    groups: dict[tuple, Group] = {}
    values: dict[tuple, dict[str, list[float]]] = {}
    for name, swept, metrics in jobs:
        config = {k: v for k, v in swept.items() if strip_key(k) not in aggregated}
        key = tuple(sorted((k, repr(v)) for k, v in config.items()))
        group = groups.setdefault(key, Group(config))
        group.jobs.append(name)
        for k, v in swept.items():
            if strip_key(k) in aggregated:
                group.over.setdefault(strip_key(k), []).append(v)
        for metric, value in metrics.items():
            if value is not None and math.isfinite(float(value)):
                values.setdefault(key, {}).setdefault(metric, []).append(float(value))
    for key, group in groups.items():
        group.stats = {m: describe(vs) for m, vs in values.get(key, {}).items()}
    return list(groups.values())


def rank_groups(groups: Sequence[Group], metric: str, mode: str) -> list[Group]:
    """Best mean of `metric` first (mode max: highest); groups without it last."""
    sign = -1.0 if mode == "max" else 1.0

    def key(group: Group) -> tuple[int, float]:
        stat = group.stats.get(metric)
        return (1, 0.0) if stat is None else (0, sign * stat.mean)

    return sorted(groups, key=key)
