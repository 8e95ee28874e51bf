"""How a rank process starts (the code that runs in the processes a launcher starts, not in the
launcher; launch/ imports it, it imports only core/):

* entry.py: the entry point of train.py/eval.py (:func:`entry_point`), in the process you start
  and in every rank something else starts (plain `torchrun train.py`, `srun python train.py`);
* bootstrap.py: the one bootstrap of a rank a launcher started (:func:`run_rank`;
  :func:`rank_main`, the entrypoint torch's elastic agent calls in each forked rank);
* warm.py: the warm start's server, prepared (multiprocessing's forkserver imports it): torch,
  torchvision and the task imported once, the sweep's W&B service, the clean-fork check;
* agent.py: the torchrun agent of one job (:func:`run_agent`, forked from the server): torch's
  elastic agent through `elastic_launch`, which writes down which ranks failed and how;
* forked.py: a forked process starts like a new one, and never as a CUDA "bad fork";
* lifeline.py: nothing a launcher starts outlives it (the parent-death signal);
* slurm_task.py: each SLURM task of a job (SLURM -> torch variables, the rank, stop handlers;
  `srun python -m launch.ranks.slurm_task env` prints a task's mapping);
* handoff.py: the torchrun launcher's hand-off files (job.pkl, result.pkl, job.json,
  failures.json): names, writers, readers;
* job_spec.py: what a launcher hands the ranks of a job (JobSpec, pickled) and a job's agent
  (AgentSpec), and what comes back when none of them returned (Stopped, job_return).
"""
