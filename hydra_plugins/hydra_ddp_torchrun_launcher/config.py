from dataclasses import dataclass

from hydra.core.config_store import ConfigStore


@dataclass
class TorchrunLauncherConf:
    _target_: str = "hydra_plugins.hydra_ddp_torchrun_launcher.torchrun_launcher.TorchrunLauncher"
    # Jobs running at once. null: on a GPU node as many as fit on disjoint GPU sets; 1 on CPU.
    max_parallel: int | None = None
    # Passed to the elastic agent: restarts of a job's ranks after a rank fails.
    max_restarts: int = 0
    monitor_interval: float = 0.1
    # Single-node jobs get a free port each (torchrun --standalone). Multi-node jobs
    # (dist.nnodes > 1) need an endpoint every node reaches, and the same job on each node.
    rdzv_backend: str = "c10d"
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    node_rank: int | None = None
    # GPU ids jobs may use (null: every visible GPU); each job gets a disjoint set of them.
    gpus: list[int] | None = None
    # Per-rank stdout/stderr files, relative to the job dir (torchrun --log-dir / --tee).
    log_dir: str = "rank_logs"
    tee: str = "3"
    # Where in a job's config its world size is: `auto` = every usable GPU, 1 on CPU.
    nproc_key: str = "dist.nproc_per_node"
    nnodes_key: str = "dist.nnodes"
    backend_key: str = "dist.backend"


ConfigStore.instance().store(group="hydra/launcher", name="torchrun", node=TorchrunLauncherConf)
