"""The seed lesson's lines, in every rank: join the process group (`init_process_group`), pin
this rank's device (`torch.cuda.set_device(LOCAL_RANK)`), wrap the model (`DDP`), and the
collectives the loop uses besides DDP's own (barriers, broadcasts, rank-0 decisions).

Under torchrun, the launcher or srun (slurm_task.py maps SLURM's variables) the environment
defines the world (`ddp_launcher.started_as_rank`); a config value that disagrees with it is an
error naming both numbers. Without those variables the run is a single process (the launcher
starts more when dist.nproc_per_node asks for them). What is the launcher's stays behind its
public API: which interface gloo listens on across nodes, and which node a failed collective
lost (`ddp_launcher.choose_gloo_interface`, `ddp_launcher.lost_node`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from ddp_launcher import UserError, choose_gloo_interface, lost_node, parse_count, started_as_rank
from torch.nn.parallel import DistributedDataParallel as DDP

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    nnodes: int
    backend: str
    device: torch.device
    step_timeout_s: int | None = None  # collective timeout after the first step
    timeout_s: float = 600.0  # collective timeout until then (dist.timeout_s)
    # A gloo group of every rank for waits and flags on the host (None: the default group is
    # gloo): it times out with an error, where NCCL's watchdog aborts the process.
    cpu_group: Any = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


def visible_gpus() -> int:
    """The CUDA GPUs this rank may use (CUDA_VISIBLE_DEVICES narrows them)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def requested_world(dist_cfg, device: str = "auto") -> tuple[int, int]:
    """(nproc_per_node, nnodes) this run should have, `auto` resolved: under torchrun (or the
    launcher, or srun) the environment's values, which an explicit value must match; in a plain
    process every GPU (1 where the run uses none: no GPU, dist.backend=gloo, trainer.device=cpu)."""
    nproc = parse_count(dist_cfg.nproc_per_node, "dist.nproc_per_node")
    nnodes = parse_count(dist_cfg.nnodes, "dist.nnodes")
    if not started_as_rank():
        on_gpus = dist_cfg.backend != "gloo" and device != "cpu"
        return nproc or (visible_gpus() if on_gpus else 0) or 1, nnodes or 1
    env_nproc = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    env_nnodes = int(os.environ["WORLD_SIZE"]) // env_nproc
    if nproc is not None and nproc != env_nproc:
        raise UserError(
            f"dist.nproc_per_node={nproc} but torchrun started {env_nproc} processes per node: "
            f"drop the override or run torchrun --nproc_per_node={nproc}"
        )
    if nnodes is not None and nnodes != env_nnodes:
        raise UserError(
            f"dist.nnodes={nnodes} but torchrun started {env_nnodes} nodes: "
            f"drop the override or run torchrun --nnodes={nnodes}"
        )
    return env_nproc, env_nnodes


def resolve_backend(backend: str, device: str) -> str:
    if backend not in ("auto", "nccl", "gloo"):
        raise UserError(f"dist.backend={backend} is not valid: use auto, nccl or gloo")
    if backend == "auto":
        return "nccl" if visible_gpus() > 0 and device != "cpu" else "gloo"
    if backend == "nccl" and visible_gpus() == 0:
        raise UserError(
            "dist.backend=nccl needs a CUDA GPU and none is visible: "
            "use dist.backend=gloo (or auto) on CPU"
        )
    return backend


@contextmanager
def init_distributed(dist_cfg, device: str = "auto") -> Iterator[DistEnv]:
    """Set up this rank's device and process group; destroy the group on exit, error or not."""
    if device not in ("auto", "cpu", "cuda"):
        raise UserError(f"trainer.device={device} is not valid: use auto, cpu or cuda")
    if device == "cuda" and dist_cfg.backend == "gloo":
        # A gloo rank pins the CPU (below): it would train there and say nothing.
        raise UserError(
            "trainer.device=cuda with dist.backend=gloo would train on the CPU: use "
            "dist.backend=nccl (or auto) for GPUs, or trainer.device=cpu"
        )
    if device == "cuda" and visible_gpus() == 0:
        raise UserError("trainer.device=cuda but no CUDA GPU is visible: use trainer.device=auto")
    nproc, nnodes = requested_world(dist_cfg, device)
    backend = resolve_backend(dist_cfg.backend, device)
    if started_as_rank():
        rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
        world_size = int(os.environ["WORLD_SIZE"])
    else:
        if nproc * nnodes != 1:
            raise UserError(
                f"dist.nproc_per_node={nproc} dist.nnodes={nnodes} needs several processes: "
                "start them with torchrun or `python train.py` (which launches them itself)"
            )
        rank, local_rank, world_size = 0, 0, 1

    if dist_cfg.sync_batchnorm and backend != "nccl":
        raise UserError(
            "dist.sync_batchnorm=true needs CUDA ranks (torch's SyncBatchNorm runs on GPUs "
            f"only) but this run uses dist.backend={backend} on the CPU: use "
            "dist.sync_batchnorm=false"
        )
    # Pin this rank's device: GPU LOCAL_RANK with nccl (one GPU per rank), else the CPU.
    if backend == "nccl":
        check_device_ordinal(local_rank)
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")

    timeout = timedelta(seconds=dist_cfg.timeout_s)
    device_id = dev if dev.type == "cuda" else None  # NCCL: the group binds the rank's GPU
    choose_gloo_interface()  # a job across nodes: the interface the other nodes reach
    if world_size == 1 and not started_as_rank():
        # A one-rank group keeps every collective (metric all-reduce, barriers) valid without
        # a rendezvous port; DDP itself is skipped for a single rank.
        dist.init_process_group(
            backend,
            store=dist.HashStore(),
            rank=0,
            world_size=1,
            timeout=timeout,
            device_id=device_id,
        )
    elif os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun's agent hosts the store and it outlives restarts of the ranks (--max-restarts):
        # without a per-attempt prefix, restarted ranks can read the previous attempt's
        # addresses (default_pg/...) and fail to connect.
        store = dist.PrefixStore(
            f"hydra_ddp/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}",
            dist.TCPStore(
                os.environ["MASTER_ADDR"],
                int(os.environ["MASTER_PORT"]),
                is_master=False,
                timeout=timeout,
            ),
        )
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timeout,
            device_id=device_id,
        )
    else:
        dist.init_process_group(backend, timeout=timeout, device_id=device_id)
    env = DistEnv(
        rank,
        local_rank,
        world_size,
        nproc,
        nnodes,
        backend,
        dev,
        dist_cfg.step_timeout_s,
        dist_cfg.timeout_s,
        dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else None,
    )
    try:
        yield env
    except RuntimeError as e:  # (torch's DistBackendError is one)
        lost = lost_node(e, env.cpu_group)  # another node went: one line naming it
        if lost is None:
            raise
        raise lost from e
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def data_barrier(env: DistEnv) -> Callable[[], None]:
    """build_datasets' barrier (local rank 0 downloads while the node's other ranks wait): a
    barrier on the host (env.cpu_group), made before local rank 0 starts. A wait past
    dist.timeout_s ends on every rank that waited with one line naming the key: gloo raises
    at its timeout, where an NCCL barrier would leave NCCL's watchdog to abort the process
    (SIGABRT: no error of its own). Local rank 0, if it reaches the barrier after the others
    gave up, says the same."""
    started = time.monotonic()

    def barrier() -> None:
        try:
            dist.barrier(group=env.cpu_group)
        except RuntimeError:
            took = time.monotonic() - started
            if took < env.timeout_s:  # a rank failed before the timeout: the launcher names it
                raise
            if env.local_rank == 0:
                what = f"rank {env.rank} (local rank 0) took {took:.0f} s to build the data"
            else:
                what = f"rank {env.rank} waited {took:.0f} s for local rank 0 to build the data"
            raise UserError(
                f"{what}, past dist.timeout_s={env.timeout_s:g}: raise dist.timeout_s "
                f"(e.g. dist.timeout_s={4 * env.timeout_s:g}), or build the data once beforehand "
                "with one rank (dist.nproc_per_node=1)"
            ) from None

    return barrier


def check_device_ordinal(local_rank: int) -> None:
    """Every rank of this node must find its GPU (GPU LOCAL_RANK) among those it sees, or CUDA
    says "invalid device ordinal" in some ranks. Checked against the node's rank count
    (LOCAL_WORLD_SIZE), so that every rank of the node stops with the same line; under
    `torchrun --virtual-local-rank` each rank sees only its own GPU, as GPU 0."""
    visible = visible_gpus()
    if virtual_local_rank():
        ranks, fix = 1, "make its GPU visible to this rank (CUDA_VISIBLE_DEVICES)"
    else:
        ranks = max(local_rank + 1, int(os.environ.get("LOCAL_WORLD_SIZE") or 0))
        fix = (
            f"start at most {visible} ranks per node, or let every rank of a node see all of "
            "its GPUs (SLURM: --gpus-per-node, not --gpus-per-task; torchrun: "
            "--virtual-local-rank gives each rank one GPU)"
        )
    if ranks > visible:
        listed = os.environ.get("CUDA_VISIBLE_DEVICES")
        shown = "unset" if listed is None else f"'{listed}'"
        raise UserError(
            f"LOCAL_RANK={local_rank} of {ranks} ranks on this node takes GPU {local_rank}, but "
            f"this process sees {visible} GPU(s) (CUDA_VISIBLE_DEVICES={shown}): {fix}"
        )


def virtual_local_rank() -> bool:
    """Whether torchrun runs this rank with --virtual-local-rank (torch >= 2.14): LOCAL_RANK is
    0 in every rank and CUDA_VISIBLE_DEVICES names the rank's one GPU. No variable says so; the
    flag reaches the rank as its agent's PET_VIRTUAL_LOCAL_RANK, or on the command line of its
    agent, this process's parent (Linux /proc)."""
    if os.environ.get("PET_VIRTUAL_LOCAL_RANK", "").lower() in ("1", "true", "yes"):
        return True
    try:
        args = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"--virtual-local-rank" in args or b"--virtual_local_rank" in args


def sync_batchnorm(model: torch.nn.Module, dist_cfg, env: DistEnv) -> torch.nn.Module:
    """The model with SyncBatchNorm layers where dist.sync_batchnorm asks (several ranks): before
    the optimizer, the EMA and torch.compile take its parameters and modules. The new layers
    keep the old ones' Parameter objects and buffers."""
    if not (dist_cfg.sync_batchnorm and env.is_distributed):
        return model  # one rank: nothing to synchronise
    return torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)


def tighten_timeout(env: DistEnv) -> None:
    """Lower the collective timeout once startup (downloads, compilation) is over."""
    seconds = env.step_timeout_s
    if seconds and env.is_distributed:
        # torch < 2.14 has only the private name (torch 2.14 made it public, deprecating it)
        set_timeout = getattr(dist, "set_timeout", None) or dist.distributed_c10d._set_pg_timeout
        set_timeout(timedelta(seconds=seconds))


def gather_floats(value: float) -> list[float]:
    values: list = [None] * dist.get_world_size()
    dist.all_gather_object(values, round(value, 1))
    return values


def broadcast_weights(model: torch.nn.Module, src: int = 0) -> None:
    """Every rank's parameters and buffers become rank `src`'s (a collective). For state only
    rank 0 can read, e.g. a checkpoint on its node's disk (nodes may share no file system)."""
    with torch.no_grad():
        for tensor in model.state_dict().values():  # views of the module's own tensors
            dist.broadcast(tensor, src=src)


def wrap_ddp(model, dist_cfg, env: DistEnv):
    """DDP around `model` (SyncBatchNorm already converted: sync_batchnorm); the model itself
    on one rank, unless dist.force_ddp."""
    if not env.is_distributed and not dist_cfg.force_ddp:
        return model  # one rank: nothing to synchronise
    return DDP(
        model,
        device_ids=[env.local_rank] if env.device.type == "cuda" else None,
        find_unused_parameters=dist_cfg.find_unused_parameters,
        gradient_as_bucket_view=dist_cfg.gradient_as_bucket_view,
        static_graph=dist_cfg.static_graph,
        bucket_cap_mb=dist_cfg.bucket_cap_mb,
    )


def rank0_decides(flag: bool, device: torch.device) -> bool:
    """Rank 0's `flag`, on every rank (a broadcast): a decision all ranks must take together,
    e.g. to stop early, even should their own views ever differ."""
    tensor = torch.tensor([int(flag)], device=device)
    dist.broadcast(tensor, src=0)
    return bool(tensor.item())
