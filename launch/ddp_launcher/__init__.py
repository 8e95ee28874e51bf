"""hydra-ddp-launcher: Hydra launchers for DDP jobs (torchrun, SLURM) and an Optuna sweeper
that prunes across them (launch/README.md). What an app's ranks use is named here, the public
API; the rest is the launcher's own and may change. Importing this file imports nothing else:
each name loads its module when first used (the launcher's startup is measured).

* entry_point(script, task, config_name): the script's entry (Hydra's main, the hand-off to
  torchrun ranks); ctrl_c_exits(): Ctrl-C however early is one line and exit 130;
* UserError: bad input, one line naming the fix, exit 2 (in any rank: the job fails as a user
  error, never retried);
* the run dir a job writes for the launcher and the report: RunResult, write_result,
  read_result (result.json), METRICS_FILE (metrics.jsonl rows), CHECKPOINT_DIR;
* the rank's world: rank_world_size(), started_as_rank();
* pruning from the ranks (hydra/sweeper=optuna): pruner_for(rank) (rank 0's TrialLink of
  a trial with a pruner, else None), Pruned;
* requeue_on_slurm(): a preempted SLURM job goes back to the queue.

The code, one sub-package per process: this folder runs in the launcher (lifecycle.py: a job's
life; torchrun.py + warm.py, slurm.py + slurm_queue.py: the backends; preview.py, progress.py,
drift.py), sweeper/ in the sweeper, ranks/ in each rank, report/ in the sweep or any shell,
core/ everywhere (torch-free: errors, world sizes, the run dir's records, the gate).
"""

from __future__ import annotations

import importlib
from typing import Any

_API = {
    "entry_point": "ddp_launcher.app",
    "ctrl_c_exits": "ddp_launcher.ranks.interrupt",
    "UserError": "ddp_launcher.core.errors",
    "RunResult": "ddp_launcher.core.run_dir",
    "write_result": "ddp_launcher.core.run_dir",
    "read_result": "ddp_launcher.core.run_dir",
    "METRICS_FILE": "ddp_launcher.core.run_dir",
    "CHECKPOINT_DIR": "ddp_launcher.core.run_dir",
    "rank_world_size": "ddp_launcher.core.world",
    "started_as_rank": "ddp_launcher.core.world",
    "TrialLink": "ddp_launcher.ranks.pruning",
    "Pruned": "ddp_launcher.ranks.pruning",
    "pruner_for": "ddp_launcher.ranks.pruning",
    "requeue_on_slurm": "ddp_launcher.core.requeue",
}
__all__ = sorted(_API)


def __getattr__(name: str) -> Any:  # PEP 562: a name's module loads on first use
    if name not in _API:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_API[name]), name)
