"""`python -m ddp_launcher.report SWEEP_DIR [--metric M] [--mode max|min] [--panels A,B]
[--wandb]`: its report. What the sweep's own SweepSummaryCallback (its multirun.yaml) set is the
default of each option, so that the report is written again as the sweep wrote it."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ddp_launcher.core.errors import UserError
from ddp_launcher.core.host import require_extra
from ddp_launcher.report.jobs import (
    BEST,
    MODES,
    MULTIRUN_YAML,
    UnreadableRecord,
    find_job_dirs,
    flat,
    read_multirun_config,
    read_overrides,
)
from ddp_launcher.report.seeds import DEFAULT_OVER, strip_key
from ddp_launcher.report.sweep import headline, tables_text, write_summary
from ddp_launcher.report.wandb_run import log_to_wandb, wandb_settings

# callback.py's SweepSummaryCallback, by name: the CLI does not import Hydra's callback API
CALLBACK = "ddp_launcher.report.callback.SweepSummaryCallback"


def sweep_settings(config: Any) -> dict[str, Any]:
    """The settings of the sweep's SweepSummaryCallback in its config ({}: none, or unreadable)."""
    from omegaconf import OmegaConf

    target = CALLBACK
    callbacks = OmegaConf.select(config, "hydra.callbacks", default=None) if config else None
    for node in (callbacks or {}).values():
        if OmegaConf.select(node, "_target_", default=None) == target:
            try:
                settings = OmegaConf.to_container(node, resolve=True)
            except Exception:  # noqa: BLE001 - an interpolation of the jobs' own: the defaults
                return {}
            return {k: v for k, v in settings.items() if not k.startswith("_")}
    return {}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ddp_launcher.report",
        description="Write summary.csv/.md/.png for a Hydra sweep dir and print its table.",
    )
    parser.add_argument("sweep_dir", type=Path, help="the multirun dir (holds the job dirs)")
    parser.add_argument(
        "--metric",
        default=None,
        help="what to rank jobs by: best (each job's value, what its task returned; the "
        "default), or a number of the jobs by name: a column (wall_time_s, 'last <metric>', a "
        "summary key) or a number of the app's part of result.json",
    )
    parser.add_argument(
        "--mode",
        default=None,
        choices=MODES,
        help="max: higher is better; min: lower is better (default: the jobs' direction)",
    )
    parser.add_argument(
        "--panels",
        default=None,
        help="summary.png's metrics of the jobs' metrics.jsonl (comma-separated; default: the "
        "jobs' metric and the losses)",
    )
    parser.add_argument(
        "--wandb",
        action="store_true",
        help="also log a W&B sweep-summary run, as the sweep's wandb settings say",
    )
    parser.add_argument(
        "--aggregate",
        default=None,
        help="keys whose jobs are aggregated: mean ± std, n, 95%% interval per configuration "
        "(comma-separated; default: seed; '' for none)",
    )
    args = parser.parse_args(argv)
    try:
        require_extra("report", "the sweep report")
        if args.wandb:
            require_extra("wandb", "--wandb")
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    if not args.sweep_dir.is_dir():
        print(f"error: {args.sweep_dir} is not a directory", file=sys.stderr)
        return 2  # a user error (ddp_launcher/core/errors.py's policy)
    config = read_multirun_config(args.sweep_dir)
    own = sweep_settings(config)
    metric = args.metric or str(own.get("metric") or BEST)
    mode = args.mode or own.get("mode")
    aggregate = (
        [k for k in args.aggregate.split(",") if k]
        if args.aggregate is not None
        else list(own.get("aggregate", DEFAULT_OVER) or [])
    )
    panels = own.get("panels")
    if args.panels is not None:
        panels = [p for p in args.panels.split(",") if p]
    unknown = unknown_keys(args.sweep_dir, aggregate)
    if unknown:
        known = ", ".join(sorted(unknown[1])) or "(none: no job overrides a key)"
        print(
            f"error: --aggregate {','.join(unknown[0])}: not a key the sweep's jobs set; the "
            f"keys they set: {known}",
            file=sys.stderr,
        )
        return 2
    try:
        summary = write_summary(args.sweep_dir, metric, mode, aggregate, panels)
    except (FileNotFoundError, UnreadableRecord, ValueError) as e:  # no job, none readable, ...
        print(f"error: {flat(e)}", file=sys.stderr)
        return 2
    print(headline(summary))
    print(tables_text(summary, aggregate))
    if args.wandb:
        found = wandb_settings(config)
        if found is None:
            print(f"error: no wandb settings in {args.sweep_dir / MULTIRUN_YAML}", file=sys.stderr)
            return 2
        run_id = log_to_wandb(summary, *found)
        print(f"W&B sweep-summary run: {run_id}" if run_id else "no W&B run (see above)")
    return 0


def unknown_keys(sweep_dir: Path, aggregate: Sequence[str]) -> tuple[list[str], set[str]] | None:
    """The --aggregate keys no job of the sweep sets (seed, the default, aside: a sweep
    without seeds aggregates nothing) and the keys they set; None when every key is one."""
    known = {
        strip_key(o.partition("=")[0])
        for job_dir in find_job_dirs(sweep_dir)
        for o in read_overrides(job_dir) or []
    }
    unknown = [k for k in aggregate if strip_key(k) not in known | set(DEFAULT_OVER)]
    return (unknown, known) if unknown else None


if __name__ == "__main__":
    sys.exit(main())
