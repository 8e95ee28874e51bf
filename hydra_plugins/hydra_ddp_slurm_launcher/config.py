from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra_plugins.hydra_submitit_launcher.config import SlurmQueueConf


@dataclass
class DDPSlurmQueueConf(SlurmQueueConf):
    """hydra-submitit-launcher's SLURM options, plus what a DDP job needs (launch/slurm.py).

    A job's world size comes from its own config, not from here: each job gets
    nodes = dist.nnodes and tasks per node = dist.nproc_per_node (one task per rank), and
    GPU jobs one GPU per task. `auto` resolves as with the torchrun launcher: nproc = the GPUs
    of a node (gpus_per_node), 1 on CPU or with dist.backend=gloo; nnodes = 1.
    """

    _target_: str = "hydra_plugins.hydra_ddp_slurm_launcher.slurm_launcher.DDPSlurmLauncher"
    # auto: each job's dist.nnodes / dist.nproc_per_node. An integer fixes the value for every
    # job of the sweep (then a job's explicit dist value must agree with it).
    nodes: Any = "auto"
    tasks_per_node: Any = "auto"
    # The GPUs a node offers to a job; GPU jobs ask for one per task (--gpus-per-node=<tasks>).
    # auto: what `sinfo` reports for the partition (gres gpu:N), 0 on a CPU cluster.
    gpus_per_node: Any = "auto"
    # Sent signal_delay_s seconds before the time limit (sbatch --signal): components/preemption.py
    # checkpoints, requeues the job (sbatch --requeue) and exits; the requeued job resumes.
    signal: str = "USR1"
    signal_delay_s: int = 120
    requeue: bool = True
    # Extra srun arguments (sbatch arguments: additional_parameters).
    srun_args: list[str] = field(default_factory=lambda: ["--kill-on-bad-exit=1"])
    # How often the launcher asks SLURM (squeue, else sacct) about its jobs.
    poll_interval_s: float = 5.0
    # Where in a job's config its world size is.
    nproc_key: str = "dist.nproc_per_node"
    nnodes_key: str = "dist.nnodes"
    backend_key: str = "dist.backend"


ConfigStore.instance().store(group="hydra/launcher", name="ddp_slurm", node=DDPSlurmQueueConf)
