"""Checkpoints: written by rank 0 only, atomically and verifiably; loaded with weights_only=True.

Layout of <run dir>/checkpoints/:
  step-00000120.pt         immutable, one per save; the newest 2 are kept (plus the best)
  step-00000120.pt.sha256  its SHA-256, written before the checkpoint itself
  last.pt, best.pt         hard links to the newest and the best step file (+ .sha256)

A save serialises in memory, writes the digest, then the file (temp file + fsync + rename + dir
fsync): a SIGKILL at any point leaves only whole files, and a file that does not match its
digest (torn by a crash elsewhere, corrupted on disk) is never loaded. Resuming takes the newest
checkpoint that verifies and names every newer one it skipped.

What goes in is one TrainingState: everything a resume needs, saved and restored by the same
object (model, optimizer, scheduler, scaler, progress with the W&B run id, and under `ranks`
each rank's own state: its RNG states and loss window), plus the run's composed config as YAML
text (`config`): a checkpoint alone rebuilds its model and data (eval.py). A checkpoint is a
plain dict of tensors and Python scalars/containers/strings, so it loads with
`torch.load(weights_only=True)`: no pickled code runs on load.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import random
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist
from omegaconf import DictConfig

from core.errors import UserError, one_line, resolved_yaml
from core.run_dir import CHECKPOINT_DIR

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


def load_checkpoint(path: Path, key: str = "resume") -> dict[str, Any]:
    """The checkpoint at `path`, verified and loaded with weights_only=True; a UserError naming
    the setting `key` (resume=, ckpt=) to change when it cannot be used."""
    fresh = " or resume=null to start fresh" if key == "resume" else ""
    if not path.is_file():
        raise UserError(
            f"checkpoint {path} does not exist: pass {key}=<an existing .pt file>"
            + (" or resume=null" if key == "resume" else "")
        )
    problem = verify(path)
    if problem is None:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # torn file, not a checkpoint, or pickled code we refuse to run
            problem = one_line(e)[:160] or type(e).__name__
    if problem is not None:
        raise UserError(
            f"checkpoint {path} cannot be loaded ({problem}): "
            f"pass {key}=<another checkpoint>{fresh}"
        )
    required = {"model", "progress"}
    missing = required - set(state) if isinstance(state, dict) else required
    if missing:
        raise UserError(
            f"checkpoint {path} is not a hydra-ddp checkpoint (missing {sorted(missing)}): "
            f"pass {key}=<a checkpoints/last.pt>" + (" or resume=null" if key == "resume" else "")
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


def resume_choice(resume: str | None) -> str | Path | None:
    """None: start fresh; "auto": the newest valid checkpoint in the run dir, if any; a path.

    A restarted job continues from its run dir's checkpoints: after torchrun restarted the ranks
    (--max-restarts) or SLURM requeued the job."""
    if resume is None or str(resume).lower() in ("null", "none", ""):
        for var, what in (
            ("TORCHELASTIC_RESTART_COUNT", "of the ranks"),
            ("SLURM_RESTART_COUNT", "of the SLURM job"),
        ):
            if int(os.environ.get(var) or 0) > 0:
                log.warning(
                    "restart %s %s: resuming from the latest checkpoint", os.environ[var], what
                )
                return "auto"
        return None
    if resume == "auto":
        return "auto"
    return Path(resume).expanduser()


def prune_plan(step_paths: list[Path], keep: int, best: Path | None) -> list[Path]:
    """The step files to delete: all but the newest `keep` (`step_paths` newest first), never
    the one `best` (best.pt) links to."""
    doomed = step_paths[keep:]
    if best is not None and best.exists():
        doomed = [p for p in doomed if not os.path.samefile(p, best)]
    return doomed


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> Any: ...


class TrainingState:
    """Everything a resume needs, saved and restored by this one object.

    `shared`: objects that are the same on every rank (model, optimizer, scheduler, scaler,
    progress): rank 0 saves them. `per_rank`: each rank's own (e.g. its loss window); every
    rank's are gathered into the checkpoint together with its RNG states, and restored to the
    same rank when the world size is unchanged.
    """

    def __init__(self, shared: Mapping[str, Stateful], per_rank: Mapping[str, Stateful]):
        self.shared = dict(shared)
        self.per_rank = dict(per_rank)

    def state_dict(self) -> dict[str, Any]:
        return {name: obj.state_dict() for name, obj in self.shared.items()}

    def rank_state_dict(self) -> dict[str, Any]:
        return {name: obj.state_dict() for name, obj in self.per_rank.items()}

    def load_state_dict(self, ckpt: dict[str, Any], *, rank: int, world_size: int) -> None:
        for name, obj in self.shared.items():
            if name in ckpt and ckpt[name] is not None:
                obj.load_state_dict(ckpt[name])
        ranks = ckpt.get("ranks") or []
        if len(ranks) != world_size:
            log.warning("checkpoint from world size %d: per-rank state not restored", len(ranks))
            return
        mine = decode_rank_state(ranks[rank])
        set_rng_state(mine.pop("rng"))
        for name, obj in self.per_rank.items():
            if name in mine:
                obj.load_state_dict(mine[name])


class Checkpointer:
    """<run dir>/checkpoints/step-N.pt (+ last.pt, best.pt): saved by rank 0 while every rank
    contributes its own state, then a barrier; restored in every rank. `config`: the run's
    composed config, saved with every checkpoint as YAML text. `on_save(path, progress,
    is_best)`: called in rank 0 after each save (the step file, the checkpoint's `progress`)."""

    def __init__(
        self,
        run_dir: Path,
        *,
        rank: int,
        world_size: int,
        keep: int = KEEP,
        config: DictConfig | None = None,
        enabled: bool = True,
        on_save: Callable[[Path, dict, bool], None] | None = None,
    ):
        self.enabled = enabled  # False (trainer.save_checkpoints=false): save() writes nothing
        self.dir = run_dir / CHECKPOINT_DIR
        self.run_dir = run_dir
        self.rank = rank
        self.world_size = world_size
        self.keep = keep
        self.config = None if config is None else resolved_yaml(config)
        self.on_save = on_save

    @property
    def best(self) -> Path:
        return self.dir / BEST

    def save(self, state: TrainingState, *, step: int, is_best: bool) -> None:
        if not self.enabled:  # the same setting on every rank: none of them gathers
            return
        # Every rank takes part in the gather; only rank 0 writes.
        ranks = gather_rank_states(state.rank_state_dict())
        if self.rank == 0:
            ckpt = {
                **state.state_dict(),
                "world_size": self.world_size,
                "ranks": ranks,
                "config": self.config,
            }
            path = self.dir / f"step-{step:08d}.pt"
            try:
                atomic_save(ckpt, path)
                for name in [LAST, BEST] if is_best else [LAST]:
                    _link_atomic(digest_path(path), digest_path(self.dir / name))
                    _link_atomic(path, self.dir / name)
            except OSError as e:  # a full disk, a quota, a read-only mount: the user's to fix
                raise UserError(
                    f"cannot write checkpoint {path} ({e.strerror or e}): free space in "
                    f"{self.dir} or lower trainer.keep_checkpoints; the checkpoints already "
                    "there are whole, and resume=auto continues from the newest"
                ) from None
            for old in prune_plan(step_files(self.dir), self.keep, self.dir / BEST):
                old.unlink(missing_ok=True)
                digest_path(old).unlink(missing_ok=True)
            if self.on_save is not None:
                self.on_save(path, ckpt.get("progress") or {}, is_best)
        dist.barrier()

    def restore(self, state: TrainingState, resume: str | None) -> Path | None:
        """Load `resume` (see resume_choice) into `state`; the file used, or None (fresh)."""
        choice = resume_choice(resume)
        if choice is None:
            return None
        if choice == "auto":
            found = load_latest_valid(self.dir)
        else:
            found = choice, load_checkpoint(choice)
        if found is None:
            return None
        path, ckpt = found
        try:
            state.load_state_dict(ckpt, rank=self.rank, world_size=self.world_size)
        except (RuntimeError, KeyError, ValueError, TypeError) as e:
            raise UserError(
                f"checkpoint {path} does not fit this model/optimizer ({one_line(e)[:160]}): "
                "resume with the config it was saved with, or resume=null"
            ) from None
        return path
