"""The torch-free core below every other part of the package (the launchers, sweeper/, report/,
ranks/) and an app's code, importing none of them:

* errors.py: UserError (one line naming the fix, exit status 2), one-line descriptions, the
  Hydra callback that reports a user error once, JobReturn's value (job_value);
* world.py: world-size rules (nproc, nnodes, GPUs, per-rank batch, data workers);
* run_dir.py: a run dir's contract: file names, RunResult (result.json), LaunchRecord (launch.json);
* naming.py: how sweep jobs are told apart (swept keys, short names, values, W&B group);
* wandb_mode.py: W&B's mode from `wandb.mode` (credentials, offline, disabled);
* trials.py: how an Optuna trial and its job's rank 0 find each other (storage, pruner, env);
* requeue.py: `scontrol requeue` of this SLURM job (preemption, and a SLURM task's stop handler).
* hydra_compat.py: what Hydra 1.3 and 1.4 each need (version_base, the `_target_` whitelist, a
  search config's multirun);
* gate.py: the one gate before any write (RunGate: the app's checks, the run dir's plan);
  run_lock.py: one holder per run dir; fault_points.py: the crash points tests kill at;
* network.py: the interface gloo listens on for a job that spans hosts; wandb_service.py: one
  W&B service for many runs (a sweep's jobs, a run's ranks).
"""
