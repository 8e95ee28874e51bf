"""The W&B sweep-summary run: the table as a W&B Table (a link to each job's run) and the
figure, in the group of the sweep's job runs."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from ddp_launcher.core.naming import sweep_group
from ddp_launcher.report.groups import groups_records
from ddp_launcher.report.jobs import JOB_TYPE, PNG_NAME, SweepSummary, flat
from ddp_launcher.report.tables import columns

log = logging.getLogger(__name__)

# What an offline W&B run of the summary writes beside its figure (its logs, records, table)
WANDB_ROOM = 256 * 1024


def wandb_settings(config: Any) -> tuple[dict[str, Any], str | None] | None:
    """(the sweep's `wandb` node, its experiment) from its config; None for an app without one."""
    from omegaconf import OmegaConf

    node = OmegaConf.select(config, "wandb", default=None) if config is not None else None
    if node is None:
        return None
    settings = OmegaConf.to_container(node, resolve=True, enum_to_str=True)
    experiment = OmegaConf.select(config, "hydra.runtime.choices.experiment", default=None)
    return (settings, experiment) if isinstance(settings, dict) else None


def log_to_wandb(
    summary: SweepSummary, settings: dict[str, Any], experiment: str | None = None
) -> str | None:
    """One W&B run with job_type=sweep_summary in the sweep's group (the group its jobs' runs
    are in, ddp_launcher/core/naming.py's sweep_group): the table as a W&B Table, with a link to
    each job's run (its id offline), and summary.png where it was drawn. Returns the run's id;
    None when W&B is disabled. A W&B failure is a warning."""
    from ddp_launcher.core.errors import UserError
    from ddp_launcher.core.wandb_mode import resolve_wandb_mode
    from ddp_launcher.core.wandb_service import run_settings

    try:
        mode = resolve_wandb_mode(settings.get("mode", "auto"))
    except UserError as e:
        log.warning("sweep summary: no W&B run (%s)", e)
        return None
    if mode == "disabled":
        return None
    try:
        import wandb
    except ImportError:
        return None
    from ddp_launcher.core.disk import check_room

    try:  # W&B's own log files fail line by line on a full disk (hundreds of lines of them)
        png = summary.sweep_dir / PNG_NAME
        needed = WANDB_ROOM + (png.stat().st_size if summary.panels and png.is_file() else 0)
        check_room(summary.sweep_dir, needed, "the sweep's W&B summary run")
    except UserError as e:
        log.warning("sweep summary: no W&B run (%s)", e)
        return None
    group = settings.get("group") or sweep_group(experiment, summary.sweep_dir)
    run = None
    try:
        run = wandb.init(
            project=settings.get("project"),
            entity=settings.get("entity"),
            group=group,
            name="summary",
            job_type=JOB_TYPE,
            tags=list(settings.get("tags") or []),
            config={
                "sweep_dir": str(summary.sweep_dir),
                "swept_keys": summary.swept_keys,
                "monitor": summary.monitor,
                "mode": summary.mode,
                "ranked_by": summary.ranked_by,
                "jobs": len(summary.rows),
            },
            dir=str(summary.sweep_dir),
            mode=mode,
            settings=run_settings(wandb, mode, float(settings.get("init_timeout_s", 60))),
        )
        project = "" if mode == "offline" else (run.url or "").rsplit("/runs/", 1)[0]
        runs = f"{project}/runs/" if project else ""  # offline: a job run's id, not its URL
        cols = columns(summary.rows, summary.swept_keys)
        data = [
            [*(c.get(r) for c in cols), runs + r.wandb_run_id if r.wandb_run_id else None, r.error]
            for r in summary.rows
        ]
        headers = [*(c.wandb or c.header for c in cols), "run", "error"]
        table = wandb.Table(columns=headers, data=data, allow_mixed_types=True)
        logged = {"sweep/table": table}
        if summary.panels:  # summary.png was drawn
            logged["sweep/plot"] = wandb.Image(str(summary.sweep_dir / PNG_NAME))
        if summary.groups:  # seeds aggregated: one row per configuration
            names, rows = groups_records(summary.groups, summary.swept_keys)
            logged["sweep/groups"] = wandb.Table(columns=names, data=rows, allow_mixed_types=True)
        run.log(logged)
        best = summary.rows[0] if summary.rows and summary.rows[0].best is not None else None
        if best is not None:
            name = f"best/{summary.monitor or 'value'}"
            run.summary.update({name: best.best, "best/job": best.job})
        run_id = run.id
        run.finish()
        return run_id
    except Exception as e:  # noqa: BLE001 - W&B failing never fails a sweep
        log.warning("sweep summary: W&B run failed (%s)", flat(e)[:200])
        if run is not None:
            with contextlib.suppress(Exception):
                run.finish(exit_code=1)
        return None
