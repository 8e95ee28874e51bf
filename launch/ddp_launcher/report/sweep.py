"""Writing a sweep's report, the one path for a finished, failed or stopped sweep: the files
(summary.csv, summary.md, summary.png), the printed table, and the W&B sweep-summary run."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ddp_launcher.core.run_dir import METRICS_FILE, RESULT_FILE, write_atomic
from ddp_launcher.report.figure import plot_summary
from ddp_launcher.report.groups import (
    GROUPS_CSV,
    format_groups,
    groups_csv,
    groups_markdown,
    seed_groups,
)
from ddp_launcher.report.jobs import (
    BEST,
    CSV_NAME,
    MD_NAME,
    PNG_NAME,
    VALUE_NAMES,
    SweepSummary,
    UnreadableRecord,
    check_mode,
    chosen_panels,
    find_job_dirs,
    flat,
    read_sweep,
    sort_jobs,
    sweep_monitor,
)
from ddp_launcher.report.seeds import DEFAULT_OVER
from ddp_launcher.report.tables import csv_text, format_markdown, format_table, mixed_commits
from ddp_launcher.report.wandb_run import log_to_wandb, wandb_settings

log = logging.getLogger(__name__)


def write_summary(
    sweep_dir: str | os.PathLike,
    metric: str = BEST,
    mode: str | None = None,
    aggregate: Sequence[str] = DEFAULT_OVER,
    panels: Sequence[str] | None = None,
) -> SweepSummary:
    """Write summary.csv, summary.md and summary.png into ``sweep_dir``, rows best first (by
    each job's value, or by the number `metric` names: jobs.py's sort_jobs); when some
    configuration has several jobs that differ only in the `aggregate` keys (seeds), their
    aggregates too (groups.py: summary_groups.csv and a section of summary.md). summary.png
    draws the `panels` metrics of the jobs' metrics.jsonl (None: the monitored metric and the
    losses), and is not written when the jobs have none of those curves. Job dirs whose records
    cannot be read are left out (the summary's `unreadable`); a sweep dir that cannot be
    written gets no files (its `not_written` says why).

    Raises ValueError for an unknown metric/mode, FileNotFoundError when ``sweep_dir`` has
    no job dirs and UnreadableRecord when none of them could be read.
    """
    check_mode(mode)
    root = Path(sweep_dir)
    jobs, keys, unreadable = read_sweep(root)
    if not jobs and not unreadable:
        raise FileNotFoundError(
            f"no job dirs in {root} (nothing with .hydra/, {RESULT_FILE} or {METRICS_FILE})"
        )
    if not jobs:
        shown = "; ".join(f"{d.name}: {why}" for d, why in unreadable[:3])
        more = f"; and {len(unreadable) - 3} more" if len(unreadable) > 3 else ""
        raise UnreadableRecord(
            f"none of the {len(unreadable)} job dir(s) in {root} could be read ({shown}{more})"
        )
    rows = sort_jobs(jobs, metric, mode)
    monitor, monitor_mode = sweep_monitor(rows)
    mode = mode or (monitor_mode if metric in VALUE_NAMES else "max")
    groups = seed_groups(rows, keys, aggregate)
    summary = SweepSummary(root, rows, metric, mode, keys, monitor, groups, unreadable)
    summary.panels = chosen_panels(rows, monitor, panels)
    try:
        write_files(summary, aggregate)
    except OSError as e:  # e.g. a read-only sweep dir: the table is still printed
        summary.not_written = flat(e.strerror or e)
    return summary


def write_files(summary: SweepSummary, aggregate: Sequence[str]) -> None:
    root, groups, keys = summary.sweep_dir, summary.groups, summary.swept_keys
    write_atomic(root / CSV_NAME, csv_text(summary))
    markdown = format_markdown(summary, root.name)
    if groups:
        markdown += "\n" + groups_markdown(groups, keys, aggregate)
        write_atomic(root / GROUPS_CSV, groups_csv(groups, keys))
    else:
        (root / GROUPS_CSV).unlink(missing_ok=True)  # an earlier report's, of jobs since changed
    write_atomic(root / MD_NAME, markdown)
    if summary.panels:
        plot_summary(summary, root / PNG_NAME, root.name)
    else:  # no curves to draw: no figure (an earlier report's would be of other jobs)
        (root / PNG_NAME).unlink(missing_ok=True)


def tables_text(summary: SweepSummary, aggregate: Sequence[str]) -> str:
    """The job table, then the seeds table when jobs were aggregated."""
    text = format_table(summary.rows, summary.swept_keys)
    mixed = mixed_commits(summary.rows)
    if mixed:
        text += f"\n\nWarning: {mixed}"
    if summary.groups:
        text += "\n\n" + format_groups(summary.groups, summary.swept_keys, aggregate)
    if summary.unreadable:
        text += "\n\n" + "\n".join(unreadable_lines(summary))
    return text


def unreadable_lines(summary: SweepSummary) -> list[str]:
    """A heading, then one line per job dir left out: the dir and what is wrong."""
    lines = [f"Job dirs left out, their records unreadable ({len(summary.unreadable)}):"]
    return lines + [f"  {job_dir}: {why}" for job_dir, why in summary.unreadable]


def headline(summary: SweepSummary) -> str:
    rows = summary.rows
    done = sum(r.status == "completed" for r in rows)
    pruned = sum(r.status == "pruned" for r in rows)
    names = [CSV_NAME, MD_NAME, *([PNG_NAME] if summary.panels else [])]
    files = f"{summary.sweep_dir}/{{{','.join(names)}}}"
    if summary.not_written is not None:
        files = f"summary files not written into {summary.sweep_dir} ({summary.not_written})"
    left_out = f" ({len(summary.unreadable)} more unreadable)" if summary.unreadable else ""
    return (
        f"Sweep summary: {len(rows)} jobs{left_out}, {done} completed"
        f"{f', {pruned} pruned' if pruned else ''}, ranked by {summary.ranked_by} "
        f"({summary.mode}); {files}"
    )


def report_sweep(
    sweep_dir: Path,
    config: Any = None,
    *,
    metric: str = BEST,
    mode: str | None = None,
    wandb: bool = True,
    when: str = "",
    aggregate: Sequence[str] = DEFAULT_OVER,
    panels: Sequence[str] | None = None,
) -> None:
    """The sweep's whole report, however the sweep ended: the files, the printed table (its
    headline ends with `when`), and the W&B sweep-summary run when `wandb` and the sweep's
    `config` has a `wandb` node. A sweep that never got to a job has none. Never raises: a
    report problem is a warning, never a failed sweep."""
    if not find_job_dirs(sweep_dir):
        return
    try:
        summary = write_summary(sweep_dir, metric, mode, aggregate, panels)
    except Exception as e:  # noqa: BLE001 - never fail the sweep over its report
        log.warning(
            "sweep summary for %s not written (%s: %s)", sweep_dir, type(e).__name__, flat(e)
        )
        return
    try:
        print(f"\n{headline(summary)}{when}:")
        print(tables_text(summary, aggregate), flush=True)
    except Exception as e:  # noqa: BLE001 - e.g. a closed stdout
        log.warning("sweep summary written to %s but not printed (%s)", sweep_dir, e)
    try:
        found = wandb_settings(config) if wandb else None
    except Exception as e:  # noqa: BLE001 - e.g. an interpolation that does not resolve
        log.warning("sweep summary: no W&B run (%s)", flat(e))
        return
    if found is not None:
        log_to_wandb(summary, *found)
