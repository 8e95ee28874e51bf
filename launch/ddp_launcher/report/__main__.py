"""`python -m ddp_launcher.report SWEEP_DIR [--metric M] [--mode max|min] [--wandb]`: its report."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from ddp_launcher.report.jobs import (
    METRICS,
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ddp_launcher.report",
        description="Write summary.csv/.md/.png for a Hydra sweep dir and print its table.",
    )
    parser.add_argument("sweep_dir", type=Path, help="the multirun dir (holds the job dirs)")
    parser.add_argument(
        "--metric",
        default="best",
        choices=METRICS,
        help="column to rank jobs by (default: best, each job's monitored metric)",
    )
    parser.add_argument(
        "--mode",
        default=None,
        choices=MODES,
        help="max: higher is better; min: lower is better (default: the jobs' monitor mode)",
    )
    parser.add_argument(
        "--wandb",
        action="store_true",
        help="also log a W&B sweep-summary run, as the sweep's wandb settings say",
    )
    parser.add_argument(
        "--aggregate",
        default=",".join(DEFAULT_OVER),
        help="keys whose jobs are aggregated: mean ± std, n, 95%% interval per configuration "
        "(comma-separated; default: seed; '' for none)",
    )
    args = parser.parse_args(argv)
    aggregate = [k for k in args.aggregate.split(",") if k]
    if not args.sweep_dir.is_dir():
        print(f"error: {args.sweep_dir} is not a directory", file=sys.stderr)
        return 2  # a user error (ddp_launcher/core/errors.py's policy)
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
        summary = write_summary(args.sweep_dir, args.metric, args.mode, aggregate)
    except (FileNotFoundError, UnreadableRecord) as e:  # no job dir, or none readable
        print(f"error: {flat(e)}", file=sys.stderr)
        return 2
    print(headline(summary))
    print(tables_text(summary, aggregate))
    if args.wandb:
        found = wandb_settings(read_multirun_config(args.sweep_dir))
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
