"""How runs and sweeps start and what they leave (docs/architecture.md), one sub-package per
process: this folder runs in the launcher, sweeper/ in the sweeper (the same process), ranks/ in
each rank process, report/ in the sweep or any shell. This file imports nothing, and nothing here
imports torch when imported: what does not train stays torch-free (tests/test_imports.py).

* lifecycle.py: a job's life, written once (compose: jobs.py; prepare: resume.py); a backend
  implements only what differs (lifecycle.Backend);
* torchrun.py (+ warm.py, the forkserver): `hydra/launcher=torchrun`, `python train.py
  dist.nproc_per_node=N`; slurm.py (+ slurm_queue.py): `hydra/launcher=slurm`;
* preview.py: `hydra.launcher.dry_run=true`; progress.py: the live status line; drift.py: a
  resumed job's changed code or config, said once.
"""
