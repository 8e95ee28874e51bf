"""Checkpoints: written by rank 0 only, atomically; loaded with weights_only=True.

A checkpoint is a plain dict of tensors and Python scalars/containers, so it loads with
`torch.load(weights_only=True)` (no pickled code runs on load):
  model (unwrapped state_dict), optimizer, scheduler, epoch (epochs completed), step (optimizer
  steps so far), best_val_acc, rng (one entry per rank), wandb_run_id, world_size.
"""

from __future__ import annotations

import io
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from launch.errors import UserError

LAST = "last.pt"
BEST = "best.pt"


def atomic_save(obj: Any, path: Path) -> None:
    """Write to a temp file in the same directory, fsync it, then rename over `path`.

    A crash at any point leaves either the previous file or the new one, never a torn file.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a failed save leaves the previous file and no litter
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)


def load_checkpoint(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise UserError(
            f"checkpoint {path} does not exist: pass resume=<an existing .pt file> or resume=null"
        )
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torn file, not a checkpoint, or pickled code we refuse to run
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(
            f"checkpoint {path} cannot be loaded ({reason[:160]}): "
            "pass resume=<another checkpoint> or resume=null to start fresh"
        ) from None
    required = {"model", "optimizer", "epoch", "step"}
    missing = required - set(state) if isinstance(state, dict) else required
    if missing:
        raise UserError(
            f"checkpoint {path} is not a hydra-ddp checkpoint (missing {sorted(missing)}): "
            "pass resume=<a checkpoints/last.pt> or resume=null"
        )
    return state


def resume_path(resume: str | None, run_dir: Path) -> Path | None:
    """None: start fresh. `auto`: <run dir>/checkpoints/last.pt when it exists. Else a path."""
    if resume is None or str(resume).lower() in ("null", "none", ""):
        return None
    if resume == "auto":
        last = run_dir / "checkpoints" / LAST
        return last if last.exists() else None
    return Path(resume).expanduser()


def rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": (np_state[0], torch.from_numpy(np_state[1].copy()), *np_state[2:]),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(_tuples(state["python"]))
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, keys.numpy(), *rest))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _tuples(x: Any) -> Any:
    # random.setstate wants tuples; a round trip through torch.save may give lists.
    return tuple(_tuples(v) for v in x) if isinstance(x, list | tuple) else x


def gather_rng_states() -> list[torch.Tensor]:
    """Every rank's RNG state, in rank order, each as a uint8 tensor of torch.save bytes
    (a collective: all ranks must call it). Bytes travel through all_gather_object, which
    cannot carry tensors on a one-rank gloo group."""
    buf = io.BytesIO()
    torch.save(rng_state(), buf)
    blobs: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(blobs, buf.getvalue())
    return [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in blobs]


def decode_rng_state(blob: torch.Tensor) -> dict[str, Any]:
    return torch.load(io.BytesIO(blob.numpy().tobytes()), weights_only=True)


class Checkpointer:
    """Saves <run dir>/checkpoints/{last,best}.pt from rank 0, then a barrier for all ranks."""

    def __init__(self, run_dir: Path, is_main: bool):
        self.dir = run_dir / "checkpoints"
        self.is_main = is_main

    def save(self, state: dict[str, Any], *, is_best: bool) -> None:
        state = {**state, "rng": gather_rng_states()}
        if self.is_main:
            atomic_save(state, self.dir / LAST)
            if is_best:
                atomic_save(state, self.dir / BEST)
        dist.barrier()
