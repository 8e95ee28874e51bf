"""The sweep report (a sweep read back from its job dirs; it launches nothing): summary.csv,
summary.md, summary.png and a W&B run, written by the Hydra callback (callback.py, named in an
app's hydra.callbacks), `python -m ddp_launcher.report SWEEP_DIR [--wandb]` or sweep.py's
write_summary.
jobs.py reads job dirs, tables.py, figure.py, groups.py + seeds.py (over seeds) and wandb_run.py
write; docs/sweeps.md ("Summary") says what they show. Cheap to import (Hydra loads callbacks at
startup): no torch, matplotlib and wandb only when used. A report problem is a warning, never a
failed sweep.
"""
