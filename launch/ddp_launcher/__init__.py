"""hydra-ddp-launcher: Hydra launchers for DDP jobs (torchrun, SLURM) and an Optuna sweeper
that prunes across them (launch/README.md). This file names the public API: an app (its ranks,
its config's `_target_`s) uses these names and no module below them, which are the launcher's
own and may change. Importing this file imports nothing else: each name loads its module when
first used (the launcher's startup is measured).

The app's entry and its errors
* entry_point(script, task, config_name, schema=None, trusted_targets=()): the script's entry
  (Hydra's main, the hand-off to N ranks; `trusted_targets`: the `_target_`s the app's configs
  may name, Hydra 1.4's execution whitelist beside PACKAGE_TARGETS, the package's own, which an
  unmodified `@hydra.main` app naming the package's callbacks adds to its own whitelist); Ctrl-C
  however early is one line and exit 130 (ctrl_c_exits);
* UserError: bad input, one line naming the fix, exit 2 (in any rank: the job fails as a user
  error, never retried); describe(error), one_line(text): an error as one line;
  instantiate(node): Hydra's, re-raising a target's UserError as itself;
* callbacks an app's config names in hydra.callbacks: RunGate (one gate before any write: the
  app's checks, which dirs hold its runs (`records`), the run dir's lock, what a start
  replaces; every write of a start guarded, undone on any error), RunAttempts (a run's attempts in
  its launch.json), ReportUserError (a user error as one line), SweepSummaryCallback (the
  sweep report); NothingToDo (the app's checks: nothing left to do), resume_choice(resume).

The run dir a job writes for the launcher and the report
* RunResult, write_result, read_result (result.json: the launcher's fields and the app's own
  mapping), METRICS_FILE (metrics.jsonl rows; read_metrics), CHECKPOINT_DIR;
* atomic_path, write_atomic: the one way to replace a file; crash_point(name): a named point
  where the crash tests kill a process (a no-op outside them);
* on_full_disk(path, what, needed), DiskFull, free_bytes(path), fmt_bytes(n): a write that
  fills the disk as one line naming the dir and the bytes needed and free;
* write_repro, REPRO_DIR: the command, packages and uncommitted diff of a run;
* process_age_s(): seconds since this process started (time-to-first-step figures).

The rank's world
* started_as_rank(), rank_world_size(): the world the launcher (or torchrun, or srun) started;
  parse_count(value, key): `auto` or a count; cores_per_rank(n): this rank's CPU share;
* choose_gloo_interface(), lost_node(error, cpu_group): a job across nodes (which interface
  gloo listens on; which node a failed collective lost, as one line).

W&B, sweeps and SLURM
* resolve_wandb_mode(mode), wandb_settings(wandb, mode, timeout), job_identity(group, name):
  a rank's W&B run (the service the launcher started early, the job's group and name);
* pruner_for(rank), TrialLink, Pruned: pruning a trial of hydra/sweeper=optuna from its ranks;
* REQUEUE_EXIT_CODE (75: "requeue me"), requeue_on_slurm(): a preempted job back to the queue.

The code, one sub-package per process: this folder runs in the launcher (lifecycle.py: a job's
life; torchrun.py + warm.py, slurm.py + slurm_queue.py: the backends; preview.py, progress.py,
drift.py), sweeper/ in the sweeper, ranks/ in each rank, report/ in the sweep or any shell,
core/ everywhere (torch-free: errors, world sizes, the run dir's records, the gate).
"""

from __future__ import annotations

import importlib
from typing import Any

# public name -> "module" (the same name there) or "module:name"
_API = {
    "entry_point": "ddp_launcher.app",
    "PACKAGE_TARGETS": "ddp_launcher.core.hydra_compat",
    "ctrl_c_exits": "ddp_launcher.ranks.interrupt",
    "UserError": "ddp_launcher.core.errors",
    "describe": "ddp_launcher.core.errors",
    "one_line": "ddp_launcher.core.errors",
    "instantiate": "ddp_launcher.core.errors",
    "ReportUserError": "ddp_launcher.core.errors",
    "RunGate": "ddp_launcher.core.gate",
    "NothingToDo": "ddp_launcher.core.gate",
    "resume_choice": "ddp_launcher.core.gate",
    "RunAttempts": "ddp_launcher.resume",
    "SweepSummaryCallback": "ddp_launcher.report.callback",
    "RunResult": "ddp_launcher.core.run_dir",
    "write_result": "ddp_launcher.core.run_dir",
    "read_result": "ddp_launcher.core.run_dir",
    "read_metrics": "ddp_launcher.core.run_dir",
    "METRICS_FILE": "ddp_launcher.core.run_dir",
    "CHECKPOINT_DIR": "ddp_launcher.core.run_dir",
    "atomic_path": "ddp_launcher.core.run_dir",
    "DiskFull": "ddp_launcher.core.disk",
    "on_full_disk": "ddp_launcher.core.disk",
    "free_bytes": "ddp_launcher.core.disk",
    "fmt_bytes": "ddp_launcher.core.disk",
    "write_atomic": "ddp_launcher.core.run_dir",
    "process_age_s": "ddp_launcher.core.run_dir",
    "REQUEUE_EXIT_CODE": "ddp_launcher.core.run_dir",
    "crash_point": "ddp_launcher.core.fault_points:point",
    "write_repro": "ddp_launcher.core.repro",
    "REPRO_DIR": "ddp_launcher.core.repro",
    "started_as_rank": "ddp_launcher.core.world",
    "rank_world_size": "ddp_launcher.core.world",
    "parse_count": "ddp_launcher.core.world",
    "cores_per_rank": "ddp_launcher.core.world",
    "choose_gloo_interface": "ddp_launcher.ranks.nodes",
    "lost_node": "ddp_launcher.ranks.nodes",
    "resolve_wandb_mode": "ddp_launcher.core.wandb_mode",
    "wandb_settings": "ddp_launcher.core.wandb_service",
    "job_identity": "ddp_launcher.core.naming",
    "TrialLink": "ddp_launcher.ranks.pruning",
    "Pruned": "ddp_launcher.ranks.pruning",
    "pruner_for": "ddp_launcher.ranks.pruning",
    "requeue_on_slurm": "ddp_launcher.core.requeue",
}
__all__ = sorted(_API)


def __getattr__(name: str) -> Any:  # PEP 562: a name's module loads on first use
    if name not in _API:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, _, attr = _API[name].partition(":")
    return getattr(importlib.import_module(module), attr or name)


def __dir__() -> list[str]:
    return __all__
