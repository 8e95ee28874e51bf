"""Checkpoints: written by rank 0 only, atomically and verifiably; loaded with weights_only=True.

Layout of <run dir>/checkpoints/:
  manifest.json            the commit record (components/manifest.py): which step files are
                           committed, with their SHA-256, and which last.pt and best.pt are
  step-00000120.pt         one per step saved (a step saved again: step-00000120-1.pt); the
                           newest `keep` are kept, plus the best
  step-00000120.pt.sha256  its SHA-256 (also in the manifest), for a copy taken elsewhere
  last.pt, best.pt         hard links to the newest and the best committed step file

A save serialises in memory, writes the step file's digest, then the step file (temp file,
fsync, rename), links last.pt (and best.pt) to it, and commits with one durable rename of
manifest.json; then prunes. A kill at any point leaves the previous commit or the new one: a
resume first settles the dir (:func:`settle`): it keeps what the manifest names, removes what a
killed save left uncommitted, and puts the links back. A file that does not match its digest
(corrupted on disk) is never loaded: resuming takes the newest committed checkpoint that
verifies, names every newer one it skipped, and rolls the commit back to it.

What goes in is one TrainingState, which owns the whole format (encoded by its state_dict(),
decoded by its load_state_dict()): everything a resume needs (model, optimizer, scheduler,
scaler, monitor, EMA, progress with the W&B run id), `world_size` and under `ranks` each rank's
own state (its RNG states and loss window), plus the run's composed config as YAML text
(`config`): a checkpoint alone rebuilds its model and data (eval.py). A checkpoint is a plain
dict of tensors and Python scalars/containers/strings, so it loads with
`torch.load(weights_only=True)`: no pickled code runs on load.

Resuming, rank 0 chooses the checkpoint and every rank follows (Checkpointer.restore): one
broadcast of the chosen file's name and SHA-256; a rank whose own copy is missing or differs
(nodes need not share a file system; a copy may be torn) receives rank 0's bytes instead.
"""

from __future__ import annotations

import errno
import hashlib
import io
import logging
import os
import platform
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist
from ddp_launcher import (
    CHECKPOINT_DIR,
    UserError,
    atomic_path,
    crash_point,
    fmt_bytes,
    free_bytes,
    one_line,
    resume_choice,
    write_atomic,
)
from omegaconf import DictConfig

from components.manifest import (
    BEST,
    LAST,
    LINKS,
    MANIFEST,
    STEP_FILE,
    Entry,
    Manifest,
    commit,
    committed_entry,
    committed_file,
    digest_path,
    fresh_name,
    order,
    read_manifest,
    usable,
    verify,
)

log = logging.getLogger(__name__)

KEEP = 2  # newest step files kept, besides the best


def atomic_save(obj: Any, path: Path) -> str:
    """torch.save `obj` to `path` atomically and durably, `<path>.sha256` first; returns the
    digest. `path` is a name no commit holds (components/manifest.fresh_name): nothing
    committed is ever written over."""
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getvalue()
    digest = hashlib.sha256(data).hexdigest()
    write_atomic(digest_path(path), f"{digest}\n", durable=True)
    crash_point("save.digest_written")
    with atomic_path(path, durable=True) as staged:
        staged.write_bytes(data)
    crash_point("save.step_written")
    return digest


def link(target: Path, name: Path) -> None:
    """Point `name` at `target`'s data (a hard link, or a copy where links are unsupported)."""
    with atomic_path(name) as tmp:
        try:
            os.link(target, tmp)
        except OSError:
            tmp.write_bytes(target.read_bytes())


def state_bytes(state: Any) -> int:
    """The bytes of the tensors in a checkpoint's state: about its file's size."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, list | tuple):
        return sum(state_bytes(v) for v in state)
    return 0


def load_checkpoint(path: Path, key: str = "resume") -> dict[str, Any]:
    """The checkpoint at `path` (last.pt, best.pt: what the commit names), verified
    (components/manifest.usable) and loaded with weights_only=True; a UserError naming the
    setting `key` (resume=, ckpt=) to change when it cannot be used."""
    target = usable(path, key)
    try:
        state = torch.load(target, map_location="cpu", weights_only=True)
    except Exception as e:  # torn file, not a checkpoint, or pickled code we refuse to run
        fresh = " or resume=null to start fresh" if key == "resume" else ""
        # (torch's weights_only refusal is a paragraph: cut, it stopped mid-sentence)
        refused = "Weights only load failed" in str(e)
        why = "it holds pickled objects weights_only=True does not load" if refused else None
        raise UserError(
            f"checkpoint {path} cannot be loaded ({why or one_line(e)[:160] or type(e).__name__}"
            f"): pass {key}=<another checkpoint>{fresh}"
        ) from None
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
    found = [p for p in Path(ckpt_dir).glob("step-*.pt") if STEP_FILE.match(p.name)]
    return sorted(found, key=lambda p: order(p.name), reverse=True)


def entry_of(state: dict[str, Any], digest: str, fit: dict[str, Any]) -> Entry:
    """A checkpoint's manifest entry, from what it holds."""
    progress, monitor = state.get("progress") or {}, state.get("monitor") or {}
    return Entry(
        digest,
        int(progress.get("step") or 0),
        int(progress.get("epoch") or 0),
        monitor.get("best_epoch"),
        monitor.get("best"),
        fit,
    )


def same(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def step_file_of(ckpt_dir: Path, name: str) -> str:
    """The step file `name` stands for in `ckpt_dir` (last.pt, best.pt: the one the commit
    names, or, before manifests, the one they link to); `name` itself otherwise."""
    manifest = read_manifest(ckpt_dir)
    if manifest is not None:
        return manifest.stands_for(name) or name
    if name in LINKS:
        linked = [p.name for p in step_files(ckpt_dir) if same(p, Path(ckpt_dir) / name)]
        return linked[0] if linked else name
    return name


def prune_plan(step_paths: list[Path], keep: int, best: Path | None) -> list[Path]:
    """The step files to delete: all but the newest `keep` (`step_paths` newest first), never
    the one `best` (best.pt) stands for."""
    doomed = step_paths[keep:]
    if best is not None:
        doomed = [p for p in doomed if p != best and not same(p, best)]
    return doomed


def kept(manifest: Manifest, keep: int) -> Manifest:
    """The commit's files cut to the newest `keep` plus the best (and the last, always)."""
    names = [Path(n) for n in manifest.newest_first()]
    best = Path(manifest.best) if manifest.best is not None else None
    doomed = {p.name for p in prune_plan(names, keep, best)} - {manifest.last}
    files = {n: e for n, e in manifest.files.items() if n not in doomed}
    return Manifest(manifest.last, manifest.best, files)


def rolled_back(manifest: Manifest, name: str) -> Manifest:
    """The commit as it stood when `name` was saved: the files up to it, and as best the file of
    its best epoch (None where that one was pruned since)."""
    entry = manifest.files[name]
    files = {n: e for n, e in manifest.files.items() if order(n) <= order(name)}
    if manifest.best in files and files[manifest.best].epochs == entry.best_epoch:
        return Manifest(name, manifest.best, files)
    best = next(
        (
            n
            for n in sorted(files, key=order, reverse=True)
            if entry.best_epoch is not None
            and files[n].epochs == entry.best_epoch
            and files[n].best_epoch == entry.best_epoch
        ),
        None,
    )
    if best is None and entry.best_epoch is not None:
        log.warning(
            "resume: best epoch %d's checkpoint was pruned: best.pt starts again", entry.best_epoch
        )
    return Manifest(name, best, files)


def tidy(ckpt_dir: Path, manifest: Manifest) -> None:
    """Make the dir what `manifest` says: remove what it does not name (step files of a save
    killed before its commit, pruned ones, temp files), point last.pt and best.pt where it does."""
    keep = {MANIFEST, *LINKS, *manifest.files, *(f"{n}.sha256" for n in manifest.files)}
    for path in Path(ckpt_dir).iterdir():
        if path.name not in keep and path.is_file():
            path.unlink(missing_ok=True)
    for name, target in ((LAST, manifest.last), (BEST, manifest.best)):
        if target is None:
            (Path(ckpt_dir) / name).unlink(missing_ok=True)
        elif not same(Path(ckpt_dir) / name, Path(ckpt_dir) / target):
            link(Path(ckpt_dir) / target, Path(ckpt_dir) / name)


def settle(ckpt_dir: Path, wanted: str | None = None) -> tuple[Path, dict[str, Any]] | None:
    """Before training continues (rank 0): the newest committed checkpoint that verifies (or
    `wanted`, a file of this dir) and its contents, each newer one it skipped named; the commit
    rolled back to it, and the dir made what the commit says (:func:`tidy`): a save that a kill
    cut short is undone. In a dir without a commit (a kill during the first save, or a run from
    before manifests) the newest step file that verifies by its digest is committed as it would
    have been; nothing is removed there before that. None: nothing to continue from."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return None
    manifest = read_manifest(ckpt_dir)
    if wanted is not None:
        names = [wanted]
    elif manifest is not None:
        names = manifest.newest_first()
    else:  # nothing committed: a first save killed, or a dir from before manifests
        names = [p.name for p in step_files(ckpt_dir)]
        names = names or ([LAST] if (ckpt_dir / LAST).exists() else [])
    skipped = []
    for name in names:
        try:
            state = load_checkpoint(ckpt_dir / name)
        except UserError as e:
            if wanted is not None:
                raise
            skipped.append(f"{name} ({str(e).split('(', 1)[-1].split('):')[0]})")
            continue
        if skipped:
            log.warning("resume: skipped %s; using %s", ", ".join(skipped), name)
        if name in LINKS:  # a last.pt alone, from before manifests: its next save commits
            return ckpt_dir / name, state
        if manifest is None or name not in manifest.files:
            manifest = rolled_back(adopted(ckpt_dir, name, state), name)
        settled = manifest if name == manifest.last else rolled_back(manifest, name)
        if settled != read_manifest(ckpt_dir):
            commit(ckpt_dir, settled)
        tidy(ckpt_dir, settled)
        return ckpt_dir / name, state
    if skipped:
        raise UserError(
            f"no valid checkpoint in {ckpt_dir}: skipped {', '.join(skipped)}; "
            "pass resume=<a good checkpoint> or resume=null to start fresh"
        )
    if manifest is not None:
        tidy(ckpt_dir, Manifest())  # (an empty commit: a save killed before its first)
    return None


def adopted(ckpt_dir: Path, name: str, state: dict[str, Any]) -> Manifest:
    """A commit naming the uncommitted step file `name` (it verified by its digest), and
    best.pt's file where that one verifies too: what its save would have committed."""
    manifest = read_manifest(ckpt_dir) or Manifest()
    files = {**manifest.files, name: entry_of(state, sha256_of(ckpt_dir / name), {})}
    best = ckpt_dir / BEST
    if best.is_file() and verify(best) is None:
        for path in step_files(ckpt_dir):
            if path.name not in files and same(path, best) and verify(path) is None:
                loaded = torch.load(path, map_location="cpu", weights_only=True)
                files[path.name] = entry_of(loaded, sha256_of(path), {})
    return Manifest(name, manifest.best, files)


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
    set_cuda_rng_states(state["cuda"])


def set_cuda_rng_states(states: list[torch.Tensor]) -> None:
    """Each visible GPU's generator from the checkpoint's list (one per GPU the saving process
    saw). Fewer GPUs visible now (another CUDA_VISIBLE_DEVICES, a smaller node): the first ones
    are restored and one warning says what was left out."""
    if not states or not torch.cuda.is_available():
        return
    visible = torch.cuda.device_count()
    for device, state in enumerate(states[:visible]):
        torch.cuda.set_rng_state(state, device)
    if len(states) > visible:
        log.warning(
            "resume: the checkpoint has CUDA RNG states of %d GPUs but %d are visible: "
            "restored GPUs 0-%d, the others' draws start afresh",
            len(states),
            visible,
            visible - 1,
        )


def _tuples(x: Any) -> Any:
    # random.setstate wants tuples; a round trip through torch.save may give lists.
    return tuple(_tuples(v) for v in x) if isinstance(x, list | tuple) else x


def gather_rank_states(local: dict[str, Any], group: Any = None) -> list[torch.Tensor]:
    """Every rank's own state (its RNG states plus `local`), in rank order, each a uint8 tensor
    of torch.save bytes (a collective of `group`, the default group where None: all ranks must
    call it; without a process group, this process's alone). Bytes travel through
    all_gather_object, which cannot carry tensors on a one-rank gloo group."""
    buf = io.BytesIO()
    torch.save({**local, "rng": rng_state()}, buf)
    blobs: list[Any] = [buf.getvalue()]
    if dist.is_initialized():
        blobs = [None] * dist.get_world_size(group)
        dist.all_gather_object(blobs, buf.getvalue(), group=group)
    return [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in blobs]


def decode_rank_state(blob: torch.Tensor) -> dict[str, Any]:
    return torch.load(io.BytesIO(blob.numpy().tobytes()), weights_only=True)


def _place() -> tuple[int, int]:
    """(rank, world size): the process group's, or (0, 1) without one."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> Any: ...


# What a resume does instead when the checkpoint lacks a component this run has.
FRESH = {
    "optimizer": "the optimizer starts without its state (momentum, moments)",
    "scheduler": "the lr schedule starts from its first step",
    "scaler": "the fp16 loss scale starts from its initial value",
    "monitor": "the monitor starts empty: best.pt and early stopping count from here",
    "ema": "the EMA starts afresh",
    "progress": "training starts from epoch 1",
}
META = ("world_size", "ranks", "config")  # the format's own keys, not components


class TrainingState:
    """Everything a resume needs, encoded and decoded by this one object, so that
    `state.load_state_dict(state.state_dict())` restores it (RNG included).

    `shared`: objects that are the same on every rank (model, optimizer, scheduler, scaler,
    progress, monitor, EMA): rank 0's copy is saved. `per_rank`: each rank's own (e.g. its
    loss window); every rank's are gathered together with its RNG states, and restored to the
    same rank when the world size is unchanged. `config`: the run's composed config, saved as
    YAML text. `fresh`: {component: (what happens, how)} for a checkpoint that lacks a
    component (default: FRESH's words, the component as built). Format:
    {<component>: its state_dict, ..., "world_size": W, "ranks": [W uint8 tensors],
    "config": YAML text or None}. A component whose state_dict is empty (a disabled fp16
    scaler) counts as absent.
    """

    def __init__(
        self,
        shared: Mapping[str, Stateful],
        per_rank: Mapping[str, Stateful],
        *,
        config: DictConfig | None = None,
        fresh: Mapping[str, tuple[str, Callable[[], None]]] | None = None,
    ):
        self.shared = dict(shared)
        self.per_rank = dict(per_rank)
        self.config = None if config is None else resolved_yaml(config)
        self.fresh = dict(fresh or {})

    def state_dict(self, group: Any = None) -> dict[str, Any]:
        """The checkpoint's contents (a collective of `group`, the default group where None:
        every rank adds its own state)."""
        ranks = gather_rank_states(self.rank_state_dict(), group)
        shared = {name: obj.state_dict() for name, obj in self.shared.items()}
        return {**shared, "world_size": len(ranks), "ranks": ranks, "config": self.config}

    def rank_state_dict(self) -> dict[str, Any]:
        return {name: obj.state_dict() for name, obj in self.per_rank.items()}

    def load_state_dict(
        self, ckpt: dict[str, Any], *, rank: int | None = None, world_size: int | None = None
    ) -> None:
        """Restore from `ckpt` (this rank's place: the process group's unless given). A
        component on one side only is one warning line naming it and what happens."""
        here, world = _place()
        rank = here if rank is None else rank
        world_size = world if world_size is None else world_size
        for name, obj in self.shared.items():
            saved = ckpt.get(name)
            if saved:
                if obj.state_dict() or name != "scaler":
                    obj.load_state_dict(saved)
                else:
                    log.warning("resume: the checkpoint has a fp16 loss scale; this run has none")
                continue
            if name == "scaler" and not obj.state_dict():
                continue  # neither side uses one
            what, start_fresh = self.fresh.get(name, (FRESH.get(name, "it starts afresh"), None))
            log.warning("resume: the checkpoint has no %s: %s", name, what)
            if start_fresh is not None:
                start_fresh()
        for name in sorted(set(ckpt) - set(self.shared) - set(META)):
            if ckpt[name]:
                log.warning("resume: the checkpoint has %s, which this run does not use", name)
        ranks = ckpt.get("ranks") or []
        if len(ranks) != world_size:
            log.warning(
                "checkpoint from world size %d: per-rank state not restored (each rank's RNG "
                "and loss window start afresh; the data and mixing draws do not depend on them)",
                len(ranks),
            )
            return
        mine = decode_rank_state(ranks[rank])
        set_rng_state(mine.pop("rng"))
        for name, obj in self.per_rank.items():
            if name in mine:
                obj.load_state_dict(mine[name])
            else:
                log.warning("resume: the checkpoint has no %s: it starts empty", name)


class Checkpointer:
    """<run dir>/checkpoints/: saved by rank 0 while every rank contributes its own state, then a
    wait for rank 0's write; restored in every rank from the file rank 0 chose. `fit`: what a
    resume of these checkpoints must match (conf/checks.py checks it before a start).
    `on_save(path, progress, is_best)`: called in rank 0 after each committed save (the step
    file, the checkpoint's `progress`).

    Its collectives (the gather of every rank's state, the waits for rank 0's file work, the
    agreements on what to load) run on `group`, a gloo group of every rank (DistEnv.cpu_group;
    None: the default group, gloo itself), never on NCCL: a slow write on a shared file system
    must not meet NCCL's watchdog, which aborts every rank at the step timeout. The waits time
    out at `timeout_s` (dist.timeout_s, the startup's) plus the time a slow file system takes to
    write or read the checkpoint (:func:`file_wait_s`), with an error, not an abort."""

    def __init__(
        self,
        run_dir: Path,
        *,
        rank: int,
        keep: int = KEEP,
        enabled: bool = True,
        fit: dict[str, Any] | None = None,
        on_save: Callable[[Path, dict, bool], None] | None = None,
        group: Any = None,
        timeout_s: float = 600.0,
    ):
        self.enabled = enabled  # False (trainer.save_checkpoints=false): save() writes nothing
        self.dir = run_dir / CHECKPOINT_DIR
        self.run_dir = run_dir
        self.rank = rank
        self.keep = keep
        self.fit = dict(fit or {})
        self.on_save = on_save
        self.manifest = Manifest()  # the committed state (rank 0), once restore() has run
        self.group, self.timeout_s = group, timeout_s
        self.continued: Continued | None = None  # resume=<another run's checkpoint>: which

    @property
    def best(self) -> Path:
        return self.dir / BEST

    def save(self, state: TrainingState, *, step: int, is_best: bool) -> None:
        if not self.enabled:  # the same setting on every rank: none of them gathers
            return
        ckpt = state.state_dict(self.group)  # every rank adds its own state; rank 0 writes
        # The same on every rank (their shared state is the same): all stop together.
        refuse_non_finite(ckpt, state, step)
        if self.rank == 0:
            try:
                path = self._commit(ckpt, step, is_best)
            except OSError as e:  # a full disk, a quota, a read-only mount: the user's to fix
                # (trainer.keep_checkpoints is no fix: a save writes its new file before it
                # prunes, whatever the count, so the file must fit beside what is there)
                fix = (
                    f"make {self.dir} writable (or choose another hydra.run.dir)"
                    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS)
                    else f"free space on the disk of {self.dir} (or choose another hydra.run.dir)"
                )
                free = free_bytes(self.dir)
                room = (
                    f": it needs about {fmt_bytes(state_bytes(ckpt))}"
                    + (f", {fmt_bytes(free)} free there" if free is not None else "")
                    if e.errno in (errno.ENOSPC, errno.EDQUOT)
                    else ""
                )
                then = (
                    "the checkpoints already there are whole, and resume=auto continues from "
                    "the newest"
                    if self.manifest.files
                    else "no checkpoint was committed yet: resume=auto starts the run over"
                )
                raise UserError(
                    f"cannot write checkpoint {self.dir / fresh_name(self.manifest, step)} "
                    f"({e.strerror or e}{room}): {fix}; {then}"
                ) from None
            if self.on_save is not None:
                self.on_save(path, ckpt.get("progress") or {}, is_best)
        self.wait_for_rank0(tensor_bytes(ckpt))

    def wait_for_rank0(self, nbytes: int = 0) -> None:
        """Every rank waits here until every other, rank 0 with its file work done (writing or
        reading `nbytes`), has come: on the gloo group, under a timeout sized for that work
        (file_wait_s). A barrier whose timeout is its own (gloo's monitored_barrier), not the
        group's: the default group's is tightened to dist.step_timeout_s after the first step."""
        if not dist.is_initialized() or dist.get_world_size(self.group) == 1:
            return
        if dist.get_backend(self.group) != "gloo":  # (a group only gloo can wait on: none here)
            dist.barrier(self.group)
            return
        timeout = timedelta(seconds=file_wait_s(nbytes, self.timeout_s))
        dist.monitored_barrier(self.group, timeout=timeout)

    def _commit(self, ckpt: dict[str, Any], step: int, is_best: bool) -> Path:
        """The save protocol (module docstring): step file, links, one commit, then pruning."""
        name = fresh_name(self.manifest, step)
        path = self.dir / name
        entry = entry_of(ckpt, atomic_save(ckpt, path), self.fit)
        link(path, self.dir / LAST)
        crash_point("save.last_linked")
        if is_best:
            link(path, self.dir / BEST)
            crash_point("save.best_linked")
        files = {**self.manifest.files, name: entry}
        new = kept(Manifest(name, name if is_best else self.manifest.best, files), self.keep)
        commit(self.dir, new)
        self.manifest = new
        crash_point("save.committed")
        tidy(self.dir, new)
        crash_point("save.pruned")
        return path

    def restore(self, state: TrainingState, resume: str | None) -> Path | None:
        """Load `resume` (see resume_choice) into `state`; the file used, or None (fresh).

        Rank 0 chooses (the newest valid committed checkpoint of its run dir, or the path
        given), settles the dir to that commit (:func:`settle`) and broadcasts the file's name
        and SHA-256; every rank loads that very file: its own copy when it has one that
        matches, else rank 0's bytes, broadcast. A problem rank 0 meets (no valid checkpoint, a
        file that does not load) is every rank's one-line error."""
        choice = resume_choice(resume)  # the same on every rank: same config and environment
        if choice is None:
            return None
        chosen: dict[str, Any] | None = None
        ckpt: dict[str, Any] | None = None
        if self.rank == 0:
            try:
                found = self._choose(choice)
            except UserError as e:
                found, chosen = None, {"error": str(e)}
            if found is not None:
                path, ckpt = found
                own = path.parent == self.dir  # (else another run's, by its path)
                chosen = {"name": path.name if own else str(path), "own": own}
                chosen["sha256"] = sha256_of(path)
                if self.continued is not None:
                    chosen["continued"] = [str(self.continued.run), self.continued.best]
        nbytes = tensor_bytes({name: obj.state_dict() for name, obj in state.shared.items()})
        self.wait_for_rank0(nbytes)  # rank 0 read and verified the checkpoint
        chosen = _from_rank0(chosen, self.group)
        if chosen is not None and "error" in chosen:
            raise UserError(chosen["error"])
        if chosen is None:
            return None
        if "continued" in chosen:  # (every rank: the monitor's best is decided on each)
            self.continued = Continued(Path(chosen["continued"][0]), chosen["continued"][1])
        path = self.dir / chosen["name"] if chosen["own"] else Path(chosen["name"])
        ckpt = _follow(path, chosen["sha256"], ckpt, self.rank, self, nbytes)
        try:
            state.load_state_dict(ckpt)
        except (RuntimeError, KeyError, ValueError, TypeError) as e:
            raise UserError(
                f"checkpoint {path} does not fit this model/optimizer ({one_line(e)[:160]}): "
                "resume with the config it was saved with, or resume=null"
            ) from None
        return path

    def _choose(self, choice: str | Path) -> tuple[Path, dict[str, Any]] | None:
        """Rank 0: the checkpoint to continue from; this dir settled to its commit."""
        if choice == "auto":
            found = settle(self.dir)
        elif Path(choice).resolve().parent == self.dir.resolve():  # one of this run's own
            found = settle(self.dir, step_file_of(self.dir, Path(choice).name))
        elif (read_manifest(self.dir) or Manifest()).files:
            # another run's, but this dir has commits of its own: the gate set any earlier run
            # aside, so they are this run's, and this is a restart of it (torchrun's, a
            # requeue): it goes on from them, never back to where it began
            log.warning(
                "resume=%s: %s holds this run's own checkpoints (a restart): continuing from them",
                choice,
                self.dir,
            )
            found = settle(self.dir)
        else:  # another run's: the gate set this dir's earlier run aside
            found = Path(choice), load_checkpoint(Path(choice))
            self.continued = self._continue(*found)
        self.manifest = read_manifest(self.dir) or Manifest()
        return found

    def _continue(self, path: Path, state: dict[str, Any]) -> Continued:
        """Rank 0, resume=<another run's checkpoint> into this dir: that checkpoint, and the
        one holding its best epoch as of that save, become this dir's first commit, so that
        this run has its own last.pt and best.pt from its first step (its end-of-run test
        included, when no epoch it trains beats that best); one line says which run it
        continues. A best checkpoint that is not there to copy (pruned, a copy without its
        manifest) leaves best.pt to this run's own epochs."""
        source = committed_file(path)[0]
        run = source.parent.parent if source.parent.name == CHECKPOINT_DIR else source.parent
        entry = committed_entry(path) or entry_of(state, sha256_of(path), self.fit)
        best = best_as_of(path, state, entry)
        files: dict[str, Entry] = {}
        name = fresh_name(None, entry.step)
        copy_checkpoint(source, self.dir / name)
        files[name] = Entry(**{**entry.__dict__, "fit": self.fit})
        best_name = name if best == source else None
        if best is not None and best != source:
            best_entry = committed_entry(best)
            best_name = fresh_name(Manifest(files=files), best_entry.step)
            copy_checkpoint(best, self.dir / best_name)
            files[best_name] = Entry(**{**best_entry.__dict__, "fit": self.fit})
        manifest = Manifest(name, best_name, files)
        commit(self.dir, manifest)
        tidy(self.dir, manifest)
        at = f"its step {entry.step} (epoch {entry.epochs})"
        if best is not None:
            kept_best = f"best.pt starts as its best epoch {entry.best_epoch}'s"
        elif entry.best_epoch is not None:
            kept_best = (
                f"its best epoch {entry.best_epoch}'s checkpoint is not there to copy: best.pt "
                "counts from this run's epochs"
            )
        else:
            kept_best = "best.pt counts from this run's epochs"
        log.info(
            "resume=%s continues run %s from %s in %s, a run of its own (its own W&B run); %s",
            path,
            run,
            at,
            self.run_dir,
            kept_best,
        )
        return Continued(run, best is not None or entry.best_epoch is None)


@dataclass(frozen=True)
class Continued:
    """resume=<another run's checkpoint>: the run it continues, and whether that run's best
    checkpoint as of that save came along (False: the monitor's best restarts here)."""

    run: Path
    best: bool


def best_as_of(path: Path, state: dict[str, Any], entry: Entry) -> Path | None:
    """The committed step file holding `path`'s best epoch's weights as of that save: `path`
    itself when it was saved at that epoch's end, else its dir's best.pt file when that is the
    same epoch; None when neither is there (or does not verify)."""
    source = committed_file(path)[0]
    progress = state.get("progress") or {}
    if entry.best_epoch is None:
        return None
    if entry.epochs == entry.best_epoch and not progress.get("step_in_epoch"):
        return source
    manifest = read_manifest(source.parent)
    if manifest is None or manifest.best is None:
        return None
    best = manifest.files[manifest.best]
    if best.epochs == entry.best_epoch and best.best_epoch == entry.best_epoch:
        candidate = source.parent / manifest.best
        if verify(candidate) is None:
            return candidate
    return None


def copy_checkpoint(source: Path, target: Path) -> None:
    """A committed step file copied to `target`: its digest first, then its bytes (atomically,
    durably), as a save writes them."""
    data = source.read_bytes()
    target.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(digest_path(target), f"{hashlib.sha256(data).hexdigest()}\n", durable=True)
    with atomic_path(target, durable=True) as staged:
        staged.write_bytes(data)


def init_weights(model: torch.nn.Module, path: str, rank: int) -> None:
    """init_from=<checkpoint>: `model`'s weights (parameters and buffers) become the
    checkpoint's, on every rank (rank 0 loads: nodes may share no file system); everything else
    starts new: optimizer, lr schedule, epochs, monitor, W&B run. One line says so."""
    from components.distributed import broadcast_weights

    error = None
    if rank == 0:
        try:
            ckpt = load_checkpoint(Path(path).expanduser(), key="init_from")
            try:
                model.load_state_dict(ckpt["model"])
            except (RuntimeError, KeyError, ValueError, TypeError) as e:
                raise UserError(
                    f"init_from={path} does not fit this model ({one_line(e)[:160]}): pass the "
                    "model it was trained with, or another checkpoint"
                ) from None
        except UserError as e:
            error = str(e)
        else:
            progress = ckpt.get("progress") or {}
            log.info(
                "init_from=%s: the weights of its step %s (epoch %s); a new run from them: "
                "new optimizer, lr schedule and epoch count",
                path,
                progress.get("step"),
                progress.get("epoch"),
            )
    error = _from_rank0(error)  # every rank stops on rank 0's error, none waits for it
    if error is not None:
        raise UserError(error)
    if dist.is_initialized():
        broadcast_weights(model)


# How slowly a checkpoint may be written or read before a wait for it fails: a shared file
# system under load (NFS, Lustre) can fall to tens of MB/s; below this, something is wrong.
SLOWEST_FILE_BYTES_PER_S = 10e6


def file_wait_s(nbytes: int, timeout_s: float) -> float:
    """How long ranks wait for file work on `nbytes` of checkpoint: dist.timeout_s (what any
    wait of the startup may take), plus that much written at SLOWEST_FILE_BYTES_PER_S."""
    return float(timeout_s) + nbytes / SLOWEST_FILE_BYTES_PER_S


def tensor_bytes(obj: Any) -> int:
    """The bytes of every tensor in a (nested) state dict: about what torch.save writes."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, Mapping):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def non_finite_parts(ckpt: Mapping[str, Any], names: list[str]) -> list[str]:
    """Which of the components `names` of a checkpoint hold a NaN or an infinity in a floating
    tensor (weights, EMA, optimizer moments). One host sync per device for all of them."""
    flags: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}

    def visit(name: str, obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            if obj.is_floating_point() or obj.is_complex():
                flags.setdefault(obj.device, []).append((name, torch.isfinite(obj).all()))
        elif isinstance(obj, Mapping):
            for value in obj.values():
                visit(name, value)
        elif isinstance(obj, list | tuple):
            for value in obj:
                visit(name, value)

    for name in names:
        visit(name, ckpt.get(name))
    bad: set[str] = set()
    for pairs in flags.values():
        finite = torch.stack([flag for _, flag in pairs]).tolist()  # the device's one sync
        bad |= {name for (name, _), ok in zip(pairs, finite, strict=True) if not ok}
    return [name for name in names if name in bad]


def refuse_non_finite(ckpt: Mapping[str, Any], state: TrainingState, step: int) -> None:
    """A UserError, before anything is written, where the checkpoint would hold non-finite
    values: a NaN loss on a GPU is only seen at the next log step (no host sync per step), and
    an update can overflow the weights while the loss was still finite. Every checkpoint that
    stays holds finite weights, so resume=auto never continues from NaN."""
    bad = non_finite_parts(ckpt, list(state.shared))
    if bad:
        epoch = int((ckpt.get("progress") or {}).get("epoch") or 0)
        raise UserError(
            f"non-finite values in the {' and '.join(bad)} at step {step} (epoch {epoch + 1}): "
            "not saved, the checkpoints already there hold finite weights; lower optim.lr, set "
            "trainer.grad_clip, or trainer.nonfinite=skip"
        )


def sha256_of(path: Path) -> str:
    """The file's SHA-256: its recorded digest (load_checkpoint verified it), else computed."""
    recorded = committed_file(path)[1]
    return recorded if recorded is not None else hashlib.sha256(path.read_bytes()).hexdigest()


def _from_rank0(obj: Any, group: Any = None) -> Any:
    """Rank 0's `obj` on every rank (one broadcast on `group`; as it is without a process
    group)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def _follow(
    path: Path,
    sha256: str,
    loaded: dict[str, Any] | None,
    rank: int,
    checkpointer: Checkpointer | None = None,
    nbytes: int = 0,
) -> dict[str, Any]:
    """The checkpoint rank 0 chose, in this rank: rank 0's `loaded`; elsewhere its own copy at
    `path` if its SHA-256 is `sha256`, else rank 0's bytes (a collective of the checkpointer's
    group: every rank says whether it needs them, rank 0 names each that does in one line and
    broadcasts once; each after a wait sized for reading `nbytes`)."""
    group = checkpointer.group if checkpointer is not None else None
    data, problem = None, None
    if rank != 0:
        try:
            data = path.read_bytes()
            if hashlib.sha256(data).hexdigest() != sha256:
                problem = "differs from rank 0's (torn, or another file)"
        except OSError as e:
            problem = f"cannot be read ({e.strerror or e})"
    needs: list[Any] = [None]
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        if checkpointer is not None:
            checkpointer.wait_for_rank0(nbytes)  # every rank read its own copy
        needs = [None] * dist.get_world_size(group)
        dist.all_gather_object(
            needs, problem and f"rank {rank} on {platform.node()}: {problem}", group=group
        )
    if any(needs):
        if rank == 0:
            for need in filter(None, needs):
                log.warning("resume: %s: %s; sending rank 0's copy", path.name, need)
        box = [path.read_bytes() if rank == 0 else None]
        if checkpointer is not None:
            checkpointer.wait_for_rank0(nbytes)  # rank 0 read the file
        dist.broadcast_object_list(box, src=0, group=group)
        if problem is not None:
            data = box[0]
            if hashlib.sha256(data).hexdigest() != sha256:  # not what rank 0 chose: stop here
                raise UserError(
                    f"rank {rank} on {platform.node()}: checkpoint {path} did not arrive intact "
                    "from rank 0: rerun with resume=auto, or copy the file to this node"
                )
    if rank == 0:
        return loaded  # type: ignore[return-value]
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def resolved_yaml(cfg) -> str:
    """The config as YAML with every interpolation resolved; a value that does not resolve or
    validate (often from an environment variable, `${oc.env:...}`) is a UserError naming it."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        return OmegaConf.to_yaml(cfg, resolve=True)
    except OmegaConfBaseException as e:
        what = one_line(str(e).replace("While dereferencing interpolation", "from"))
        raise UserError(
            f"{e.full_key}: {what}: fix it, or the environment variable it reads"
        ) from None
