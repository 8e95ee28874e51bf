"""How ranks and sweeps start, and nothing else (the in-rank services are in components/):

* jobs.py: the job model both launchers share: composing a sweep's jobs, their world size,
  the one-line reason a job failed and its failed JobReturn, a sweep batch;
* rank.py: how a rank starts: the one bootstrap for torchrun ranks and SLURM tasks, and the
  entry point of train.py (one run dir for the ranks of a plain torchrun or srun run);
* torchrun.py: `hydra/launcher=torchrun` and `python train.py dist.nproc_per_node=N`: jobs as
  torchrun jobs, a FIFO scheduler over GPUs, the agent that records which ranks failed;
* slurm.py: `hydra/launcher=slurm`: jobs as SLURM jobs, one task per rank; SLURM -> torch
  variables; sbatch_example.sh does the same by hand;
* resume.py: what a job dir's records say (launch.json: overrides and every attempt), and what
  a resumed sweep (`hydra.launcher.resume=true`) or a retry does with the job;
* summary.py: the sweep summary (a Hydra callback and `python -m launch.summary`).

The Launcher (and Sweeper) classes Hydra instantiates are thin subclasses in hydra_plugins/
(Hydra's rule); imports flow one way: hydra_plugins -> launch -> components.
"""
