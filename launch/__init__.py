"""How runs and sweeps start and what they leave, one sub-package per process that runs it: this
folder runs in the launcher, sweeper/ in the sweeper (the same process; `hydra/sweeper=optuna`),
ranks/ in each rank process a launcher starts, report/ in the sweep or any shell. This file
imports nothing and nothing here imports torch when imported: what does not train stays torch-free.

A job's life is written once (lifecycle.py: compose (jobs.py), place, prepare (resume.py),
start, wait, close, retry or report); a backend implements only what differs (lifecycle.Backend).
Two backends:

* torchrun.py (`hydra/launcher=torchrun`, and `python train.py dist.nproc_per_node=N`): a job is
  a torchrun agent on this machine, forked by the launcher's warm start (warm.py:
  multiprocessing's forkserver, its server prepared by ranks/warm.py: torch is imported once
  per sweep); GPU jobs packed onto disjoint GPU sets, `max_parallel` jobs on disjoint CPU
  slices; run_task_or_hand_off is train.py's and eval.py's task function;
* slurm.py (`hydra/launcher=slurm`): a job is a SLURM job (submitit arrays), one task per rank;
  slurm_queue.py asks SLURM's commands; ranks/slurm_task.py runs in each task.

Hydra instantiates the Launcher and Sweeper classes from their thin subclasses in hydra_plugins/.
Imports flow one way: hydra_plugins -> sweeper/ -> launch -> report/, ranks/ -> the torch-free
core (tests/test_imports.py checks it); the in-rank services are components/.
"""
