"""The sweep report (what a sweep left, read back; it launches nothing): one table (CSV,
Markdown, text), one plot and one W&B run with ``job_type=sweep_summary`` for a Hydra multirun,
from its job dirs (``.hydra/``, ``result.json``, ``metrics.jsonl``), written next to
``multirun.yaml`` as ``summary.csv``, ``summary.md`` and ``summary.png``. What the table and
the plot show: docs/sweeps.md ("Summary") and tables.py's ``columns``.

Modules: jobs.py (reading job dirs, ranking), tables.py (text, Markdown, CSV), figure.py
(summary.png), seeds.py + groups.py (jobs aggregated over seeds), wandb_run.py (the W&B run),
sweep.py (``report_sweep``: the one path that writes and prints a sweep's report, finished,
failed or stopped), callback.py (the Hydra callback), __main__.py (the CLI). Used three ways:

* as a Hydra callback, written at the end of every multirun (also when a job failed)::

      hydra:
        callbacks:
          sweep_summary:
            _target_: launch.report.callback.SweepSummaryCallback

* from the command line for any sweep dir: ``python -m launch.report <sweep_dir> [--wandb]``;
* from Python: launch.report.sweep's ``write_summary``, launch.report.jobs' ``collect_jobs``,
  launch.report.tables' ``format_table``.

Cheap to import (Hydra loads callbacks at startup): no torch, matplotlib and wandb only when used.
A summary problem (W&B included) is a warning, never a failed sweep.
"""
