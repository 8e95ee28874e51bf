"""How a rank process starts (code that runs in the processes a launcher starts; it imports only
core/): entry.py (train.py's and eval.py's entry point), bootstrap.py (a launched rank), warm.py
(the warm start's server), agent.py (a job's torchrun agent), forked.py (a forked process starts
like a new one), lifeline.py (dies with its parent), slurm_task.py (each SLURM task), handoff.py
and job_spec.py (what launcher and ranks hand each other); docs/architecture.md says more.
"""
