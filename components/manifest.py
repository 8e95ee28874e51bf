"""checkpoints/manifest.json: the one commit point of every checkpoint save. Torch-free: the
gate (conf/checks.py) reads it before a start writes anything.

A save writes its step file (and digest), points last.pt / best.pt at it, and only then
commits: one atomic, durable rename of this manifest. What the manifest names is the
checkpoints dir's state; anything else there (a step file of a save killed before its commit,
a link pointing elsewhere) is undone before training continues (components/checkpoint.py's
`settle`), so a kill at any point of a save leaves the previous state or the new one, never a
mix. Each entry records what a resume or a reader needs without loading the file: its SHA-256,
step, epochs done, the best epoch and value as of that save, and what a resume must match.
"""

from __future__ import annotations

import hashlib
import json
import re
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ddp_launcher import CHECKPOINT_DIR, UserError, write_atomic

MANIFEST = "manifest.json"
LAST = "last.pt"
BEST = "best.pt"
LINKS = (LAST, BEST)  # hard links to the committed last / best step files, for people and eval
# step-<step>.pt, or step-<step>-<k>.pt for a step saved again (at its epoch's end after a stop
# there): a committed file is never written over
STEP_FILE = re.compile(r"^step-(\d+)(?:-(\d+))?\.pt$")


@dataclass
class Entry:
    sha256: str
    step: int
    epochs: int  # epochs completed at this save
    best_epoch: int | None = None  # the monitored metric's best epoch as of this save
    best: float | None = None  # its value
    fit: dict[str, Any] = field(default_factory=dict)  # what a resume must match (the model)


@dataclass
class Manifest:
    last: str | None = None
    best: str | None = None  # the step file holding best_epoch's weights
    files: dict[str, Entry] = field(default_factory=dict)  # every committed step file

    def to_json(self) -> dict[str, Any]:
        return {"format": 1, **asdict(self)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Manifest:
        files = {name: Entry(**entry) for name, entry in data["files"].items()}
        for name in (data.get("last"), data.get("best")):
            if name is not None and name not in files:
                raise ValueError(f"names {name}, which it does not list")
        return cls(data.get("last"), data.get("best"), files)

    def newest_first(self) -> list[str]:
        return sorted(self.files, key=order, reverse=True)

    def stands_for(self, name: str) -> str | None:
        """The step file `name` is: itself, or what last.pt / best.pt stand for."""
        if name == LAST:
            return self.last
        if name == BEST:
            return self.best
        return name if name in self.files else None


def order(name: str) -> tuple[int, int]:
    match = STEP_FILE.match(name)
    return (int(match.group(1)), int(match.group(2) or 0)) if match else (-1, -1)


def read_manifest(ckpt_dir: Path) -> Manifest | None:
    """The committed state of `ckpt_dir`; None without a manifest (nothing committed, or a dir
    written before manifests), or when it does not parse."""
    try:
        return Manifest.from_json(json.loads((Path(ckpt_dir) / MANIFEST).read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def commit(ckpt_dir: Path, manifest: Manifest) -> None:
    """The commit point: the new state replaces the old in one durable rename."""
    write_atomic(Path(ckpt_dir) / MANIFEST, json.dumps(manifest.to_json(), indent=1), durable=True)


def fresh_name(manifest: Manifest | None, step: int) -> str:
    """The file name of a new save of `step`: never one the manifest has committed."""
    taken = manifest.files if manifest is not None else {}
    name, k = f"step-{step:08d}.pt", 0
    while name in taken:
        k += 1
        name = f"step-{step:08d}-{k}.pt"
    return name


def committed_best(run_dir: Path) -> Entry | None:
    """The entry of the step file best.pt stands for in `run_dir`'s checkpoints (None: none)."""
    manifest = read_manifest(Path(run_dir) / CHECKPOINT_DIR)
    if manifest is None or manifest.best is None:
        return None
    return manifest.files[manifest.best]


def digest_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def committed_file(path: Path) -> tuple[Path, str | None]:
    """(the file `path` stands for, its recorded SHA-256). In a checkpoints dir with a manifest
    the commit says: a step file it lists is itself, last.pt and best.pt are the step files it
    names. Anywhere else (a copy, a dir written before manifests): `path` and the digest beside
    it (None without one)."""
    path = Path(path)
    manifest = read_manifest(path.parent)
    name = manifest.stands_for(path.name) if manifest is not None else None
    if name is not None:
        return path.with_name(name), manifest.files[name].sha256
    recorded = digest_path(path)
    return path, recorded.read_text().strip() if recorded.is_file() else None


def committed_entry(path: Path) -> Entry | None:
    """The manifest entry of the step file `path` stands for (None: not committed there)."""
    path = Path(path)
    manifest = read_manifest(path.parent)
    name = manifest.stands_for(path.name) if manifest is not None else None
    return manifest.files[name] if name is not None else None


def verify(path: Path) -> str | None:
    """None if `path` matches its recorded digest; else why it does not (a checkpoint without
    its digest cannot be told from a damaged one: every save writes both)."""
    target, expected = committed_file(path)
    if expected is None:
        return f"no {digest_path(path).name} beside it: not known to be whole"
    actual = hashlib.sha256(target.read_bytes()).hexdigest()
    return None if actual == expected else "SHA-256 mismatch: torn or corrupt"


def usable(path: Path, key: str) -> Path:
    """`path` (the `key=` setting: resume, ckpt) checked as a checkpoint file without loading it:
    a file, committed or beside its digest, and whole; the file it stands for. A UserError
    naming the setting otherwise (components/checkpoint.load_checkpoint says the same)."""
    fresh = " or resume=null to start fresh" if key == "resume" else ""
    path = Path(path).expanduser()
    if path.is_dir():
        auto = " (resume=auto continues this run's own dir)" if key == "resume" else ""
        last = path / CHECKPOINT_DIR / LAST
        if not last.is_file():  # (no run's dir: naming a file it does not have was no fix)
            raise UserError(
                f"{key}={path} is a directory without {CHECKPOINT_DIR}/{LAST}: pass "
                f"{key}=<a .pt file>, e.g. {key}=<a run dir>/{CHECKPOINT_DIR}/{LAST}{auto}"
            )
        raise UserError(
            f"{key}={path} is a directory: pass {key}=<a .pt file in it>, e.g. {key}={last}{auto}"
        )
    target = committed_file(path)[0]
    if not target.is_file():
        raise UserError(
            f"checkpoint {path} does not exist: pass {key}=<an existing .pt file>"
            + (" or resume=null" if key == "resume" else "")
        )
    problem = verify(path)
    torn = problem is not None and committed_file(path)[1] is not None  # (its digest differs)
    if not torn and not is_torch_archive(target):
        raise UserError(
            f"checkpoint {path} cannot be loaded: it is no torch.save archive (not a checkpoint, "
            f"or cut short): pass {key}=<another checkpoint, a .pt file a run saved>{fresh}"
        )
    if problem is not None:
        raise UserError(
            f"checkpoint {path} cannot be loaded ({problem}): "
            f"pass {key}=<another checkpoint>{fresh}"
        )
    return target


def is_torch_archive(path: Path) -> bool:
    """Whether `path` is what torch.save writes (a zip archive holding <name>/data.pkl), read
    from its directory, not loaded: anything else (a text file, an image, another zip) made
    torch.load fail with a miniz code or a weights_only note cut off mid-sentence."""
    try:
        with zipfile.ZipFile(path) as archive:
            return any(name.endswith("/data.pkl") for name in archive.namelist())
    except (OSError, zipfile.BadZipFile, ValueError):
        return False


def find_checkpoint(run: str | None, ckpt: str | None) -> Path:
    """`ckpt=<file>`, else `run=<training run dir>`'s checkpoints/best.pt (eval.py)."""
    if ckpt:
        path = Path(ckpt).expanduser()
        if not path.is_file() and not committed_file(path)[0].is_file():
            raise UserError(
                f"ckpt={ckpt}: no such file: pass ckpt=<a checkpoint file>, or "
                "run=<a training run dir>"
            )
        return path
    if not run:
        raise UserError(
            "which checkpoint? pass run=<a training run dir> (its best.pt) or "
            "ckpt=<a checkpoint file>"
        )
    run_dir = Path(run).expanduser()
    if not run_dir.is_dir():
        raise UserError(
            f"run={run}: no such run dir: pass run=<a training run dir> or ckpt=<a checkpoint file>"
        )
    path = run_dir / CHECKPOINT_DIR / BEST
    if not committed_file(path)[0].is_file():
        raise UserError(
            f"run={run} has no {CHECKPOINT_DIR}/{BEST} (no epoch finished): pass "
            f"ckpt=<one of its checkpoints> or another run="
        )
    return path
