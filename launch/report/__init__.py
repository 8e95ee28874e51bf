"""The sweep report (what a sweep left, read back; it launches nothing): one table (CSV,
Markdown, text), one plot and one W&B run for a Hydra multirun.

Reads every job dir of a sweep dir (``<sweep_dir>/<subdir>/`` holding ``.hydra/``,
``result.json`` or ``metrics.jsonl``) and writes ``summary.csv``, ``summary.md`` and
``summary.png`` next to ``multirun.yaml``:

* the table has one column per swept key (the keys the sweep varies: its sweep overrides and
  its sweeper's params, from multirun.yaml, and any other key whose value differs between jobs;
  short names, floats to 4 significant digits; core/naming.py), then each job's status,
  its monitored metric's best value and epoch (result.json's ``monitor``/``mode``/``best``),
  the last epoch's val metrics, test metrics when there are any, wall time and samples/s; jobs
  ranked best first by their monitor and mode;
* the plot has val/acc and val/loss per epoch and train/loss over epochs, one style (colour,
  marker, line) per job so that curves on top of each other stay distinguishable, points of one
  epoch spread a little apart, integer epoch ticks, and a legend of swept values only;
* at the end of a multirun the callback also logs one W&B run with ``job_type=sweep_summary`` in
  the sweep's group (:func:`log_to_wandb`): the table as a W&B Table (a link to each job's run)
  and the plot. Offline, it lands with ``wandb sync <sweep dir>/wandb/offline-run-*``.

Modules: jobs.py (reading job dirs, ranking), tables.py (text, Markdown, CSV), figure.py
(summary.png), wandb_run.py (the W&B run), sweep.py (``report_sweep``: the one path that writes
and prints a sweep's report, finished, failed or stopped), callback.py (the Hydra callback),
__main__.py (the CLI). Used three ways:

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
