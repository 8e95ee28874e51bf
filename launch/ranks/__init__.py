"""How a rank process starts (the code that runs in the processes a launcher starts, not in the
launcher; launch/ imports it, it imports only core/):

* bootstrap.py: the one rank bootstrap (:func:`run_rank`, `python -m launch.ranks.bootstrap
  JOB_PKL` for a torchrun rank), the torchrun launcher's hand-off files, and the entry point of
  train.py/eval.py (:func:`entry_point`) for ranks something else starts;
* warm.py: the warm interpreter of a sweep (`python -m launch.ranks.warm FD MODULE...`): imports
  torch, torchvision and the task once, starts the sweep's W&B service, forks each job's agent;
* agent.py: the torchrun agent of one job (`python -m launch.ranks.agent FAILURES_JSON <torchrun
  args>`): torch's elastic agent, which writes down which ranks failed and how;
* slurm_task.py: each SLURM task of a job (SLURM -> torch variables, the rank, stop handlers;
  `srun python -m launch.ranks.slurm_task env` prints a task's mapping);
* handoff.py: the torchrun launcher's hand-off files (job.pkl, result.pkl, job.json,
  failures.json): names, writers, readers;
* job_spec.py: what a launcher hands the ranks of a job (JobSpec, pickled) and what comes back
  when none of them returned (Stopped, job_return).
"""
