"""World-size rules, shared by the ranks (the public started_as_rank, rank_world_size,
parse_count, cores_per_rank) and the launchers (a job's world from its config, checked before
any rank starts). Imports no torch unless a GPU driver is present: launchers use it too.

`dist.nproc_per_node` and `dist.nnodes` are `auto` or a positive integer. `auto` nproc means
every usable GPU of a node, or 1 where the job uses no GPU (none visible, dist.backend=gloo, or
dist.device=cpu); `auto` nnodes means 1. Under torchrun (or srun) the environment's values win,
and an explicit value must agree with them. `dist.device` is `auto`, `cpu` or `cuda`: `cpu`
runs the job's ranks on the CPU (no GPU reserved, none visible to them).
"""

from __future__ import annotations

import glob
import os
import re
import sys
from types import SimpleNamespace
from typing import Any

from omegaconf import DictConfig, OmegaConf

from ddp_launcher.core.errors import UserError

RANK_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE")  # what torchrun (or our srun mapping) sets


def parse_count(value: Any, key: str, minimum: int = 1) -> int | None:
    """`auto` -> None, an integer >= `minimum` (1, or 0 for counts that may be none, like a
    node's GPUs) -> itself; anything else is a UserError naming `key`."""
    text = str(value).strip()
    if text == "auto":
        return None
    if text.isdigit() and int(text) >= minimum:
        return int(text)
    kinds = {0: "a non-negative integer", 1: "a positive integer"}
    kind = kinds.get(minimum, f"an integer >= {minimum}")
    raise UserError(f"{key}={text} is not valid: use {key}=auto or {kind}")


def started_as_rank(environ=os.environ) -> bool:
    """True in a process that torchrun (or srun mapped to torch's variables) started as a rank."""
    return all(k in environ for k in RANK_ENV)


def rank_world_size(environ=os.environ) -> int:
    """The world size this process is a rank of: torchrun's (or srun's) WORLD_SIZE, else 1."""
    return int(environ["WORLD_SIZE"]) if started_as_rank(environ) else 1


def gpu_driver_present() -> bool:
    """Whether Linux shows a GPU driver's device nodes (NVIDIA, WSL's, AMD ROCm's)."""
    if not sys.platform.startswith("linux"):
        return True  # cannot tell without asking torch
    return bool(glob.glob("/dev/nvidia[0-9]*")) or any(
        os.path.exists(p) for p in ("/dev/dxg", "/dev/kfd")
    )


def visible_gpus() -> int:
    """GPUs this process may use. No torch import (seconds) in a process without it: NVIDIA's
    device nodes, narrowed by CUDA_VISIBLE_DEVICES as CUDA narrows them (the list up to its
    first invalid entry); only other drivers (ROCm, WSL) ask torch."""
    if "torch" not in sys.modules:
        if not gpu_driver_present():
            return 0
        nodes = glob.glob("/dev/nvidia[0-9]*")
        if nodes:
            return min(len(nodes), len(cuda_visible(os.environ.get("CUDA_VISIBLE_DEVICES"))))
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def visible_gpu_ids() -> list[str]:
    """This process's GPUs as CUDA_VISIBLE_DEVICES names them, entries kept as written (ids,
    UUIDs, MIG instances): a launcher hands its jobs subsets of these, never positions. Unset:
    0..n-1."""
    n, value = visible_gpus(), os.environ.get("CUDA_VISIBLE_DEVICES")
    return cuda_visible(value)[:n] if value is not None else [str(i) for i in range(n)]


def cuda_visible(value: str | None) -> list[str]:
    """CUDA_VISIBLE_DEVICES' entries as CUDA reads them: unset is every device (a long list);
    a negative or empty entry ends the list."""
    if value is None:
        return [str(i) for i in range(1024)]
    kept = []
    for entry in value.split(","):
        entry = entry.strip()
        if not entry or entry.startswith("-"):
            break
        kept.append(entry)
    return kept


def uses_gpus(backend: Any, n_gpus: int, device: Any = "auto") -> bool:
    """Whether a job with this `dist.backend` and `dist.device` runs its ranks on GPUs, given
    `n_gpus` usable: not with gloo, nor with dist.device=cpu (its ranks run on the CPU)."""
    return n_gpus > 0 and str(backend) != "gloo" and str(device) != "cpu"


def requested_world(
    dist_cfg: Any, n_gpus: int, keys: dict[str, str] | None = None, device: Any = "auto"
) -> tuple[int, int]:
    """(nproc_per_node, nnodes) a job asks for outside torchrun, `auto` resolved (`device`: its
    dist.device); `keys`: the config key a value came from when it is not `dist.<name>` (its
    errors name it)."""
    keys = keys or {}
    nproc = parse_count(dist_cfg.nproc_per_node, keys.get("nproc_per_node", "dist.nproc_per_node"))
    nnodes = parse_count(dist_cfg.nnodes, keys.get("nnodes", "dist.nnodes"))
    if nproc is None:
        nproc = n_gpus if uses_gpus(dist_cfg.backend, n_gpus, device) else 1
    return nproc, nnodes or 1


DEVICES = ("auto", "cpu", "cuda")


def job_device(config: DictConfig) -> str:
    """The job's dist.device (`auto` for an app without one); another value is a UserError
    naming the key it came from (an app may set it from a key of its own: `${app.device}`)."""
    value = str(OmegaConf.select(config, "dist.device", default="auto"))
    if value not in DEVICES:
        key = interpolated_from(config, "dist.device") or "dist.device"
        raise UserError(f"{key}={value} is not valid: use auto, cpu or cuda")
    return value


def interpolated_from(config: DictConfig, key: str) -> str | None:
    """The key whose value `key` takes when it is a plain interpolation (`${app.device}`:
    app.device), else None."""
    parent, _, name = key.rpartition(".")
    node = OmegaConf.select(config, parent) if parent else config
    if not isinstance(node, DictConfig) or name not in node:
        return None
    raw = node._get_node(name)._value()  # the value as written, unresolved
    found = re.fullmatch(r"\$\{([\w.]+)\}", str(raw))
    return found.group(1) if found else None


def usable_cores() -> list[int]:
    """The CPU cores this process may run on (its affinity: a launcher gives each job that runs
    beside others a slice of its own, which the job's ranks inherit)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def cores_per_rank(local_world_size: int, environ=os.environ) -> int:
    """This rank's CPU cores, from the cores it may really run on (its affinity): shared among
    the node's ranks, as a torchrun job's are (its launcher gives the job a slice); inside
    SLURM, the task's CPUs (--cpus-per-task, where the affinity does not hold fewer) shared
    among the ranks that run in that task (:func:`ranks_per_slurm_task`)."""
    cores = len(usable_cores())
    if "SLURM_PROCID" in environ and environ.get("SLURM_CPUS_PER_TASK", "").isdigit():
        # On a cluster that binds tasks (task/affinity, task/cgroup) the affinity is the task's
        # own CPUs, and may be fewer than SLURM_CPUS_PER_TASK says: since SLURM 22.05 an srun
        # without -c (or SRUN_CPUS_PER_TASK) gives each task 1 CPU while the variable, set by
        # sbatch, still reads the job's count. On one that does not bind, the affinity is
        # the whole node's, shared by its tasks, and SLURM's count is the task's share. The
        # smaller is right on both.
        task_cpus = min(int(environ["SLURM_CPUS_PER_TASK"]), cores)
        return max(1, task_cpus // ranks_per_slurm_task(local_world_size, environ))
    return max(1, cores // max(1, local_world_size))


def ranks_per_slurm_task(local_world_size: int, environ=os.environ) -> int:
    """How many ranks share this rank's SLURM task, and so its CPUs: the `local_world_size`
    ranks of the torch elastic agent that started it (torchrun, or this package's launcher:
    TORCHELASTIC_RUN_ID is set), which is one process of one task (torchrun in the batch script
    or in an srun step, an app's own hand-off to N ranks in an `srun --pty` shell); 1 where the
    rank is a task of its own (ddp_launcher/ranks/slurm_task.py, sbatch_example.sh map SLURM's
    variables to torch's; no agent)."""
    return max(1, local_world_size) if "TORCHELASTIC_RUN_ID" in environ else 1


def job_world(
    config: DictConfig, n_gpus: int, launcher: tuple[Any, Any] | None = None
) -> tuple[int, int, bool]:
    """(ranks per node, nodes, whether its ranks use GPUs) a job asks for in its `dist` node
    (dist.device=cpu uses no GPU), `auto` resolved against `n_gpus` usable GPUs per
    node.

    `launcher`: the launcher's own (nproc_per_node, nnodes) (torchrun's names, e.g.
    hydra.launcher.nproc_per_node=2), the weaker side: a job's `dist` value set for it wins, and
    its `auto` or absent key takes the launcher's; an app without `dist` is then a job like any
    other (`auto` ranks: one per GPU, 1 on the CPU). Without `launcher` (SLURM's, which sizes jobs
    by keys of its own), an app without a `dist` node or key runs 1 rank on 1 node, no GPU."""
    dist = OmegaConf.select(config, "dist")
    if launcher is None and not isinstance(dist, DictConfig):
        return 1, 1, False
    dist = dist if isinstance(dist, DictConfig) else OmegaConf.create()
    request = SimpleNamespace(backend=OmegaConf.select(dist, "backend", default="auto"))
    keys = {}
    for i, key in enumerate(("nproc_per_node", "nnodes")):
        value = OmegaConf.select(dist, key, default=None)
        if launcher is None:
            value = 1 if value is None else value
        elif value is None or str(value).strip() == "auto":
            value, keys[key] = launcher[i], f"hydra.launcher.{key}"
        setattr(request, key, value)
    device = job_device(config)
    nproc, nnodes = requested_world(request, n_gpus, keys, device)
    return nproc, nnodes, uses_gpus(request.backend, n_gpus, device)


def check_gpus(
    nproc: int, gpu_job: bool, n_gpus: int, what: str, key: str = "dist.nproc_per_node"
) -> None:
    """A GPU job takes one GPU per rank: it cannot ask for more than a node has (`what`); `key`:
    where the job's ranks per node came from."""
    if gpu_job and nproc > n_gpus:
        raise UserError(f"{key}={nproc} asks for {nproc} GPUs per node but {what}: lower {key}")


C10D_DEFAULT_PORT = 29400  # torch's, for an endpoint without one (c10d_rendezvous_backend.py)


def endpoint_parts(endpoint: str) -> tuple[str, str]:
    """(host, port) of a rendezvous endpoint HOST[:PORT], as torch's parse_rendezvous_endpoint
    reads it ([v6 address] in brackets; no port: c10d's default)."""
    text = endpoint.strip()
    if not (text.startswith("[") and text.endswith("]")) and ":" in text:
        host, port = text.rsplit(":", 1)
        return host, port
    return text, str(C10D_DEFAULT_PORT)


def keeps_records(node_rank: int | None, rdzv_endpoint: str | None) -> bool:
    """Whether this node's launcher keeps the records of a sweep whose multi-node jobs every
    node's launcher runs (the job dir's lock, launch.json, what a start replaces): node 0's
    (hydra.launcher.node_rank), else the rendezvous host's, whose agent torch's c10d makes the
    store's: a name of this machine, or an address it can bind."""
    if node_rank is not None:
        return int(node_rank) == 0
    if not rdzv_endpoint:
        return True
    import socket

    host = endpoint_parts(rdzv_endpoint)[0].strip("[]")
    if host in ("localhost", socket.gethostname(), socket.getfqdn()):
        return True
    try:
        family, _, _, _, address = socket.getaddrinfo(host, None)[0]
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((address[0], 0))
        return True
    except OSError:
        return False
