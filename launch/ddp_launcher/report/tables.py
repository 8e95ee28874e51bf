"""The sweep table: its columns, as text (printed), Markdown (summary.md) and CSV
(summary.csv)."""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ddp_launcher.core.naming import fmt_duration, fmt_value, label, short_keys
from ddp_launcher.report.jobs import (
    BEST,
    PNG_NAME,
    JobSummary,
    SweepSummary,
    count_key,
    metric_kind,
    sweep_monitor,
    value_header,
    x_unit,
)


@dataclass
class Column:
    header: str  # text and Markdown tables, the W&B Table
    csv: str  # summary.csv
    get: Any  # JobSummary -> value
    numeric: bool = True
    text: Any = fmt_value  # value -> table text
    wandb: str = ""  # its W&B Table header when not `header`


def brief_kinds(rows: Sequence[JobSummary], monitor: str | None) -> set[str]:
    """The kinds of metric the printed table shows (brief): the monitored one's, the loss, and
    those of the first two metrics its row holds (`x/acc` and `x/loss`: `acc` and `loss`)."""
    kinds = {metric_kind(monitor) if monitor else "", "loss"}
    for row in rows:
        kinds |= {metric_kind(k) for k in [k for k in row.final if not count_key(k)][:2]}
    return kinds


def columns(rows: Sequence[JobSummary], keys: Sequence[str], brief: bool = False) -> list[Column]:
    """The table's columns: job, one per swept key, status, each job's value and the epoch it
    was reached at, the last row's metrics of the monitored one (metrics.jsonl), the app's
    summary (result.json), the target's time and step, wall time, samples/s. `brief`: of the
    metrics only those of brief_kinds."""
    short = short_keys(keys)
    monitor, _ = sweep_monitor(rows)
    kinds = brief_kinds(rows, monitor)

    def shown(key: str) -> bool:
        return not count_key(key) and (not brief or key == monitor or metric_kind(key) in kinds)

    finals = [k for r in rows for k in r.final if shown(k)]
    finals = list(dict.fromkeys(sorted(finals, key=lambda k: k != monitor)))  # monitor first
    summary = list(
        dict.fromkeys(
            k
            for r in rows
            for k, v in r.summary.items()
            if k not in keys and (shown(k) if not isinstance(v, str) else True)
        )
    )
    cols = [Column("job", "job", lambda r: r.job, numeric=False)]
    for key in keys:
        cols.append(Column(short[key], key, lambda r, k=key: r.swept.get(k)))
    cols.append(Column("status", "status", lambda r: r.status, numeric=False))
    cols.append(Column(value_header(monitor), BEST, lambda r: r.best))
    if any(r.best_epoch is not None for r in rows):
        cols.append(Column("epoch", "best_epoch", lambda r: r.best_epoch))
    cols += [Column(f"last {k}", f"last {k}", lambda r, k=k: r.final.get(k)) for k in finals]
    for key in summary:
        text = any(isinstance(r.summary.get(key), str) for r in rows)
        cols.append(Column(key, key, lambda r, k=key: r.summary.get(k), numeric=not text))
    targets = list(
        dict.fromkeys(f"{r.target['metric']}>={r.target['value']:g}" for r in rows if r.target)
    )
    if targets:  # the app's target: when each job first reached it (its seconds from start)
        what = targets[0] if len(targets) == 1 else "target"
        cols += [
            Column(f"s to {what}", "target_reached_at_s", lambda r: r.reached("reached_at_s")),
            Column("step", "target_reached_at_step", lambda r: r.reached("reached_at_step")),
        ]
    cols.append(
        Column(
            "wall", "wall_time_s", lambda r: r.wall_time_s, text=fmt_duration, wandb="wall_time_s"
        )
    )
    if any(r.samples_per_s is not None for r in rows):
        cols.append(Column("samples/s", "samples_per_s", lambda r: r.samples_per_s))
    if any((r.attempts or 0) > 1 for r in rows):  # retried or resumed: how many starts each
        cols.append(Column("attempts", "attempts", lambda r: r.attempts))
    if any(r.commits for r in rows):  # a→b: resumed after a commit (ddp_launcher/drift.py)
        cols.append(Column("commit", "commit", lambda r: "→".join(r.commits) or None, False, str))
    return cols


def mixed_commits(rows: Sequence[JobSummary]) -> str | None:
    """One line when the sweep's jobs ran more than one commit (or dirty tree): which jobs ran
    which; None when they all ran the same code."""
    jobs: dict[str, list[str]] = {}
    for row in rows:
        for commit in row.commits:
            jobs.setdefault(commit, []).append(row.job)
    if len(jobs) < 2:
        return None
    each = "; ".join(f"{c} (jobs {', '.join(j)})" for c, j in jobs.items())
    return f"mixed commits: the jobs ran {len(jobs)} versions of the code: {each}"


def _cell(col: Column, row: JobSummary) -> str:
    value = col.get(row)
    return "-" if value is None else col.text(value)


def job_label(row: JobSummary, keys: Sequence[str]) -> str:
    """Its swept values, else its overrides."""
    short = short_keys(keys)
    swept = label({short[k]: v for k, v in row.swept.items()}, " ")
    return swept or row.overrides or "(no overrides)"


def format_table(rows: Sequence[JobSummary], keys: Sequence[str] | None = None) -> str:
    """A fixed-width text table of ``rows`` (in the given order), then the failed jobs if any.
    ``keys``: the swept keys (default: those the rows have values for)."""
    keys = list(keys) if keys is not None else list(dict.fromkeys(k for r in rows for k in r.swept))
    cols = columns(rows, keys, brief=True)
    table = [[c.header for c in cols], *([_cell(c, r) for c in cols] for r in rows)]
    out = text_lines(table, [c.numeric for c in cols])
    # A pruned job finished: the sweeper's pruner ended it early.
    failed = [r for r in rows if r.status not in ("completed", "pruned", "running")]
    running = [r for r in rows if r.status == "running"]
    for title, listed in (("Running jobs:", running), ("Failed jobs:", failed)):
        if listed:
            out += ["", title]
        for r in listed:
            error = r.error or "no error recorded"
            out.append(f"  job {r.job} [{r.status}] {job_label(r, keys)}: {error}")
    return "\n".join(out)


def text_lines(table: Sequence[Sequence[str]], right: Sequence[bool]) -> list[str]:
    """A header row and body rows as fixed-width lines, a rule under the header; `right`:
    which columns are right-aligned (numbers)."""
    widths = [max(len(cell) for cell in col) for col in zip(*table, strict=True)]

    def line(cells: Sequence[str]) -> str:
        parts = [
            cell.rjust(w) if r else cell.ljust(w)
            for cell, w, r in zip(cells, widths, right, strict=True)
        ]
        return "  ".join(parts).rstrip()

    return [line(table[0]), line(["-" * w for w in widths]), *(line(r) for r in table[1:])]


def markdown_lines(table: Sequence[Sequence[str]], align: Sequence[str]) -> list[str]:
    """A header row and body rows as a Markdown table, `|` escaped in every cell."""

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.replace("\\", "\\\\").replace("|", "\\|") for c in cells) + " |"

    return [line(table[0]), "| " + " | ".join(align) + " |", *(line(r) for r in table[1:])]


def to_csv(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """CSV text, None as an empty cell (as csv writes it)."""
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows([header, *rows])
    return buf.getvalue()


def format_markdown(summary: SweepSummary, title: str = "") -> str:
    rows, cols = summary.rows, columns(summary.rows, summary.swept_keys, brief=True)
    lines = [f"# Sweep summary{': ' + title if title else ''}", ""]
    lines.append(
        f"{len(rows)} jobs, {sum(r.status == 'completed' for r in rows)} completed; "
        f"ranked by `{summary.ranked_by}` ({summary.mode})."
    )
    mixed = mixed_commits(rows)
    if mixed:
        lines += ["", f"**Warning: {mixed}.**"]
    table = [["rank", *(c.header for c in cols), "error"]]
    table += [[str(i), *(_cell(c, r) for c in cols), r.error or ""] for i, r in enumerate(rows, 1)]
    align = ["---:", *("---:" if c.numeric else "---" for c in cols), "---"]
    lines += ["", *markdown_lines(table, align)]
    if summary.panels:  # summary.png: the curves the jobs' metrics.jsonl hold
        per = x_unit(summary.rows)
        lines += ["", f"![{', '.join(summary.panels)} per {per}]({PNG_NAME})"]
    lines.append("")
    if summary.unreadable:  # job dirs left out: not in the table
        lines += ["## Job dirs left out", "", "Their records could not be read:", ""]
        lines += [f"- `{job_dir.name}`: {why}" for job_dir, why in summary.unreadable] + [""]
    return "\n".join(lines)


def csv_text(summary: SweepSummary) -> str:
    cols = columns(summary.rows, summary.swept_keys)
    extra = ["monitor", "mode", "wandb_run_id", "overrides", "attempts", "error"]  # JobSummary's
    if any(c.csv == "attempts" for c in cols):
        extra.remove("attempts")  # a column already
    header = [*(c.csv for c in cols), *extra]
    rows = [[*(c.get(r) for c in cols), *(getattr(r, k) for k in extra)] for r in summary.rows]
    return to_csv(header, rows)
