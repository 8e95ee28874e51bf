"""Checkpoints: written by rank 0 only, atomically and verifiably; loaded with weights_only=True.

Layout of <run dir>/checkpoints/:
  step-00000120.pt         immutable, one per save; the newest 2 are kept (plus the best)
  step-00000120.pt.sha256  its SHA-256, written before the checkpoint itself
  last.pt, best.pt         hard links to the newest and the best step file (+ .sha256)

A save serialises in memory, writes the digest, then the file (temp file + fsync + rename + dir
fsync): a SIGKILL at any point leaves only whole files, and a file that does not match its
digest (torn by a crash elsewhere, corrupted on disk) is never loaded. Resuming takes the newest
checkpoint that verifies and names every newer one it skipped.

A checkpoint is a plain dict of tensors and Python scalars/containers (model, optimizer,
scheduler, epoch, step, step_in_epoch, best_val_acc, W&B run id, and under `ranks` each rank's
RNG states and loss window),
so it loads with `torch.load(weights_only=True)`: no pickled code runs on load.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from components.errors import UserError

log = logging.getLogger(__name__)

LAST = "last.pt"
BEST = "best.pt"
KEEP = 2  # newest step files kept, besides the best
STEP_FILE = re.compile(r"^step-(\d+)\.pt$")


def _write_atomic(data: bytes, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a failed write leaves the previous file and no litter
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)


def atomic_save(obj: Any, path: Path) -> str:
    """torch.save `obj` to `path` atomically, with `<path>.sha256` beside it. Returns the digest."""
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getvalue()
    digest = hashlib.sha256(data).hexdigest()
    _write_atomic(f"{digest}\n".encode(), digest_path(path))
    _write_atomic(data, path)
    return digest


def digest_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _link_atomic(target: Path, link: Path) -> None:
    """Point `link` at `target`'s data (hard link, or a copy where links are unsupported)."""
    tmp = link.with_name(f".{link.name}.tmp-{os.getpid()}")
    tmp.unlink(missing_ok=True)
    try:
        os.link(target, tmp)
    except OSError:
        tmp.write_bytes(target.read_bytes())
    os.replace(tmp, link)


def verify(path: Path) -> str | None:
    """None if `path` matches its recorded digest (or has none); else why it does not."""
    recorded = digest_path(path)
    if not recorded.exists():
        return None
    expected = recorded.read_text().strip()
    actual = hashlib.sha256(path.read_bytes()).hexdigest()
    return None if actual == expected else "SHA-256 mismatch: torn or corrupt"


def load_checkpoint(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise UserError(
            f"checkpoint {path} does not exist: pass resume=<an existing .pt file> or resume=null"
        )
    problem = verify(path)
    if problem is None:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # torn file, not a checkpoint, or pickled code we refuse to run
            problem = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
    if problem is not None:
        raise UserError(
            f"checkpoint {path} cannot be loaded ({problem}): "
            "pass resume=<another checkpoint> or resume=null to start fresh"
        )
    required = {"model", "optimizer", "epoch", "step"}
    missing = required - set(state) if isinstance(state, dict) else required
    if missing:
        raise UserError(
            f"checkpoint {path} is not a hydra-ddp checkpoint (missing {sorted(missing)}): "
            "pass resume=<a checkpoints/last.pt> or resume=null"
        )
    return state


def step_files(ckpt_dir: Path) -> list[Path]:
    """Step checkpoints, newest first."""
    found = [p for p in ckpt_dir.glob("step-*.pt") if STEP_FILE.match(p.name)]
    return sorted(found, key=lambda p: int(STEP_FILE.match(p.name).group(1)), reverse=True)


def load_latest_valid(ckpt_dir: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint that verifies and loads; logs each newer one it had to skip."""
    candidates = step_files(ckpt_dir) or ([ckpt_dir / LAST] if (ckpt_dir / LAST).exists() else [])
    skipped = []
    for path in candidates:
        try:
            state = load_checkpoint(path)
        except UserError as e:
            skipped.append(f"{path.name} ({str(e).split('(', 1)[-1].split('):')[0]})")
            continue
        if skipped:
            log.warning("resume: skipped %s; using %s", ", ".join(skipped), path.name)
        return path, state
    if skipped:
        raise UserError(
            f"no valid checkpoint in {ckpt_dir}: skipped {', '.join(skipped)}; "
            "pass resume=<a good checkpoint> or resume=null to start fresh"
        )
    return None


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


def gather_rank_states(local: dict[str, Any]) -> list[torch.Tensor]:
    """Every rank's own state (its RNG states plus `local`), in rank order, each a uint8 tensor
    of torch.save bytes (a collective: all ranks must call it). Bytes travel through
    all_gather_object, which cannot carry tensors on a one-rank gloo group."""
    buf = io.BytesIO()
    torch.save({**local, "rng": rng_state()}, buf)
    blobs: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(blobs, buf.getvalue())
    return [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in blobs]


def decode_rank_state(blob: torch.Tensor) -> dict[str, Any]:
    return torch.load(io.BytesIO(blob.numpy().tobytes()), weights_only=True)


def resume_path(resume: str | None, run_dir: Path) -> Path | str | None:
    """None: start fresh. "auto": the newest valid checkpoint in the run dir, if any. A path."""
    if resume is None or str(resume).lower() in ("null", "none", ""):
        return None
    if resume == "auto":
        return "auto"
    return Path(resume).expanduser()


def load_for_resume(resume: str | None, run_dir: Path) -> tuple[Path, dict[str, Any]] | None:
    choice = resume_path(resume, run_dir)
    if choice is None:
        return None
    if choice == "auto":
        return load_latest_valid(run_dir / "checkpoints")
    return choice, load_checkpoint(choice)


class Checkpointer:
    """Saves <run dir>/checkpoints/step-N.pt (+ last.pt, best.pt) from rank 0, then a barrier."""

    def __init__(self, run_dir: Path, is_main: bool, keep: int = KEEP):
        self.dir = run_dir / "checkpoints"
        self.is_main = is_main
        self.keep = keep

    def save(self, state: dict[str, Any], *, is_best: bool, rank_local: dict | None = None) -> None:
        """`state` is rank 0's; `rank_local` is this rank's own (stored per rank with its RNG)."""
        state = {**state, "ranks": gather_rank_states(rank_local or {})}  # every rank takes part
        if self.is_main:
            path = self.dir / f"step-{state['step']:08d}.pt"
            atomic_save(state, path)
            for name in [LAST, BEST] if is_best else [LAST]:
                _link_atomic(digest_path(path), digest_path(self.dir / name))
                _link_atomic(path, self.dir / name)
            self._prune()
        dist.barrier()

    def _prune(self) -> None:
        best = self.dir / BEST
        for old in step_files(self.dir)[self.keep :]:
            if best.exists() and os.path.samefile(old, best):
                continue  # best.pt is a link to it: keep the pair together for clarity
            old.unlink(missing_ok=True)
            digest_path(old).unlink(missing_ok=True)
