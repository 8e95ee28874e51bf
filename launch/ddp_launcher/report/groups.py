"""The seeds-aggregated table of a sweep report: jobs whose swept values differ only in the
aggregated keys (`seed` by default) as one row each, per metric mean ± std, n and the 95 % Student-t
interval (ddp_launcher/report/seeds.py), ranked by the mean of the ranking metric. Printed after
the job table, a section of summary.md, summary_groups.csv, and a W&B Table."""

from __future__ import annotations

from collections.abc import Sequence

from ddp_launcher.core.naming import fmt_value, label, short_keys
from ddp_launcher.report.jobs import (
    BEST,
    JobSummary,
    count_key,
    metric_kind,
    sweep_monitor,
    value_header,
)
from ddp_launcher.report.seeds import DEFAULT_OVER, Group, Stat, group_jobs, rank_groups
from ddp_launcher.report.tables import markdown_lines, text_lines, to_csv

GROUPS_CSV = "summary_groups.csv"


def job_metrics(row: JobSummary) -> dict[str, float]:
    """The metrics of a completed job that are aggregated: its value, the last row's metrics of
    the monitored one, the numbers of the app's summary."""
    metrics = {value_header(row.monitor): row.best} if row.best is not None else {}
    metrics |= {f"last {k}": v for k, v in row.final.items() if not count_key(k)}
    metrics |= {k: v for k, v in row.summary.items() if not count_key(k)}
    return {k: v for k, v in metrics.items() if isinstance(v, int | float)}


def seed_groups(
    rows: Sequence[JobSummary], keys: Sequence[str], over: Sequence[str] = DEFAULT_OVER
) -> list[Group]:
    """The completed jobs grouped over `over`, best mean first; [] when no group has more than
    one job (nothing was aggregated)."""
    if not over:
        return []
    done = [r for r in rows if r.status == "completed"]
    groups = group_jobs([(r.job, r.swept, job_metrics(r)) for r in done], over)
    if all(len(g.jobs) == 1 for g in groups):  # nothing was aggregated
        return []
    monitor, mode = sweep_monitor(done)
    return rank_groups(groups, value_header(monitor), mode)


def shown_metrics(groups: Sequence[Group], brief: bool) -> list[str]:
    names = list(dict.fromkeys(m for g in groups for m in g.stats))
    if brief:  # the printed table: the value, and metrics of the kinds tables.py's brief shows
        ranked = next((m for m in names if m.split(" ")[0] == BEST), "")
        finals = [m for m in names if m.startswith("last ")][:2]
        kinds = {metric_kind(m) for m in [ranked, *finals] if " " in m} | {"loss"}
        names = [m for m in names if m == ranked or metric_kind(m) in kinds]
    return names


def config_label(group: Group, keys: Sequence[str]) -> str:
    short = short_keys([k for k in keys if k in group.config] or list(group.config))
    return label({short.get(k, k): v for k, v in group.config.items()}, " ") or "(all jobs)"


def stat_cells(stat: Stat | None) -> list[str]:
    """Mean ± std and the 95 % interval; n = 1: the mean, and no interval rather than a zero one."""
    if stat is None:
        return ["-", "-"]
    if stat.std is None:
        return [fmt_value(stat.mean), "-"]
    ci = f"[{fmt_value(stat.ci_low)}, {fmt_value(stat.ci_high)}]"
    return [f"{fmt_value(stat.mean)} ± {fmt_value(stat.std)}", ci]


def group_table(groups: Sequence[Group], keys: Sequence[str]) -> list[list]:
    """Header row then one row per group: config, n, jobs, then mean ± std and 95 % CI per
    metric (the printed and Markdown tables)."""
    metrics = shown_metrics(groups, brief=True)
    header = ["rank", "config", "n", "jobs"]
    for m in metrics:
        header += [f"{m} (mean ± std)", "95% CI"]
    rows = [header]
    for rank, g in enumerate(groups, 1):
        n = max((s.n for s in g.stats.values()), default=len(g.jobs))
        row = [str(rank), config_label(g, keys), str(n), ",".join(g.jobs)]
        for m in metrics:
            row += stat_cells(g.stats.get(m))
        rows.append(row)
    return rows


def format_groups(groups: Sequence[Group], keys: Sequence[str], over: Sequence[str]) -> str:
    table = group_table(groups, keys)
    title = f"Aggregated over {', '.join(over)}: {len(groups)} group(s), best mean first"
    return "\n".join([title, *text_lines(table, [False] * len(table[0]))])


def groups_markdown(groups: Sequence[Group], keys: Sequence[str], over: Sequence[str]) -> str:
    table = group_table(groups, keys)
    note = "Mean ± sample standard deviation (n − 1) and the 95 % Student-t interval of the mean"
    lines = [f"## Aggregated over {', '.join(over)}", "", f"{note}; completed jobs only.", ""]
    return "\n".join([*lines, *markdown_lines(table, ["---"] * len(table[0])), ""])


def groups_records(groups: Sequence[Group], keys: Sequence[str]) -> tuple[list[str], list[list]]:
    """(columns, rows) of every metric's n, mean, std, ci_low, ci_high: summary_groups.csv
    and the W&B Table."""
    metrics = shown_metrics(groups, brief=False)
    keys = [k for k in keys if any(k in g.config for g in groups)]  # not the aggregated ones
    columns = ["rank", *keys, "jobs"]
    for m in metrics:
        columns += [f"{m} {part}" for part in ("n", "mean", "std", "ci95_low", "ci95_high")]
    rows = []
    for rank, g in enumerate(groups, 1):
        row = [rank, *(g.config.get(k) for k in keys), " ".join(g.jobs)]
        for m in metrics:
            s = g.stats.get(m)
            row += [None] * 5 if s is None else [s.n, s.mean, s.std, s.ci_low, s.ci_high]
        rows.append(row)
    return columns, rows


def groups_csv(groups: Sequence[Group], keys: Sequence[str]) -> str:
    return to_csv(*groups_records(groups, keys))
