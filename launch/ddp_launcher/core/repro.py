"""What a run needs to be reproduced, written by rank 0 into `<run dir>/repro/` at start:

    repro/command.txt       the command that started this process (argv only) and the run as one
                            `python <the app's script> <overrides>` line (core/app_command.py)
    repro/requirements.txt  every installed distribution as `name==version` (pip freeze's view,
                            read with importlib.metadata: no subprocess, no pip needed)
    repro/git.diff          the uncommitted changes against the commit (only when the tree is
                            dirty; untracked files are named at its top, not included)

The commit itself goes into the W&B config (`run.git_commit`) and result.json, with `git_dirty`.
Nothing from the environment is written: no variables, no tokens. A resumed attempt whose code,
packages or command differ from what repro/ holds writes its own set into repro/attempt-<k>/.
No torch: cheap to import.
"""

from __future__ import annotations

import functools
import logging
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from ddp_launcher.core.app_command import app_command, installed

log = logging.getLogger(__name__)

REPRO_DIR = "repro"
COMMAND_FILE = "command.txt"
REQUIREMENTS_FILE = "requirements.txt"
DIFF_FILE = "git.diff"
# Where the app's code lives, if set: git runs here (tests point it at a repository of their
# own); None: :func:`code_dir` finds the app's.
CODE_DIR: Path | None = None
# The app's folder a launcher found for its jobs (their task module's), for every process it
# starts: its ranks, a SLURM job's tasks.
CODE_DIR_ENV = "HYDRA_DDP_CODE_DIR"
MAX_DIFF_BYTES = 5 * 2**20  # a bigger diff (data committed by mistake?) is cut, and says so


def module_dir(name: str) -> Path | None:
    """The folder a module's code is imported from (a package's module: the folder holding its
    top package); None for one not found or not a file."""
    import importlib.util

    loaded = sys.modules.get(name)
    origin = getattr(loaded, "__file__", None)
    if origin is None and name != "__main__":
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        origin = spec.origin if spec is not None and spec.has_location else None
    if not origin:
        return None
    folder = Path(origin).resolve().parent
    depth = name.count(".") + (Path(origin).name == "__init__.py")
    for _ in range(depth):
        folder = folder.parent
    return folder


def app_dir(modules: list[str] = ()) -> Path | None:
    """The app's folder: that of the first of `modules` (its task's) found, else the script's
    (`__main__`); never an installed package's."""
    for name in [*modules, "__main__"]:
        folder = module_dir(name)
        if folder is not None and not installed(folder):
            return folder
    return None


def code_dir() -> Path:
    """Where git reads the app's commit and changes: CODE_DIR when set, the folder the app's
    launcher found (CODE_DIR_ENV), the script's folder, Hydra's runtime cwd, or this process's
    cwd. Never this package's own folder: installed from a wheel, it is no repository of the
    app's."""
    if CODE_DIR is not None:
        return Path(CODE_DIR)
    if os.environ.get(CODE_DIR_ENV):
        return Path(os.environ[CODE_DIR_ENV])
    script = app_dir()
    if script is not None:
        return script
    try:
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.initialized():
            return Path(HydraConfig.get().runtime.cwd)
    except Exception:  # noqa: BLE001 - no Hydra, or no runtime node: the cwd
        pass
    return Path.cwd()


def task_code_dir(task_function: Any = None, config: Any = None) -> Path:
    """The app's folder as a launcher sees a job: CODE_DIR or CODE_DIR_ENV when set, else the
    task module's folder (an entry point's "module:function", or the function's own module,
    the script's for `__main__`), else Hydra's runtime cwd in the job's `config`, else
    :func:`code_dir`."""
    if CODE_DIR is not None or os.environ.get(CODE_DIR_ENV):
        return code_dir()
    args = getattr(task_function, "args", ())
    if args and isinstance(args[0], str) and ":" in args[0]:
        modules = [args[0].partition(":")[0]]
    else:
        modules = [getattr(task_function, "__module__", None) or "__main__"]
    found = app_dir(modules) if task_function is not None else None
    if found is not None:
        return found
    cwd = None
    if config is not None:
        from omegaconf import OmegaConf

        cwd = OmegaConf.select(config, "hydra.runtime.cwd", default=None)
    return Path(str(cwd)) if cwd else code_dir()


def git(*args: str, cwd: Path | None = None) -> str | None:
    """`git <args>`'s stdout in the app's code dir; None where git or the repository is
    missing."""
    try:
        out = subprocess.run(
            ["git", *args], cwd=cwd or code_dir(), capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


@dataclass
class GitState:
    commit: str | None = None  # None: not a git checkout (or no git)
    dirty: bool = False  # tracked files changed, or untracked files present
    diff: str = ""  # `git diff HEAD`, with the untracked files named at the top
    changed: list[str] = field(default_factory=list)  # `git status --porcelain` entries


def git_state(run_dir: Path | None = None, where: Path | None = None) -> GitState:
    """The app's commit and uncommitted changes (git in `where`, default :func:`code_dir`); a
    `run_dir` inside the repository (not ignored) is left out, so that a run's own outputs
    never make its tree dirty."""
    where = where or code_dir()
    commit = (git("rev-parse", "HEAD", cwd=where) or "").strip() or None
    if commit is None:
        return GitState()
    paths: list[str] = []
    top = (git("rev-parse", "--show-toplevel", cwd=where) or "").strip()
    if run_dir is not None and top and Path(run_dir).resolve().is_relative_to(top):
        paths = ["--", ":(top)", f":(top,exclude){Path(run_dir).resolve().relative_to(top)}"]
    status = git("status", "--porcelain", *paths, cwd=where) or ""
    changed = [line for line in status.splitlines() if line.strip()]
    if not changed:
        return GitState(commit)
    untracked = [line[3:] for line in changed if line.startswith("??")]
    head = "".join(f"# untracked, not in this diff: {name}\n" for name in untracked)
    diff = git("diff", "HEAD", "--binary", *paths, cwd=where) or ""
    if len(diff) > MAX_DIFF_BYTES:
        diff = diff[:MAX_DIFF_BYTES] + f"\n# ... cut at {MAX_DIFF_BYTES} bytes\n"
    return GitState(commit, True, head + diff, changed)


# the warm interpreter (ddp_launcher/ranks/warm.py) lists them once for all its jobs
@functools.cache
def requirements() -> str:
    """`name==version` of every installed distribution, sorted, one per line (pip freeze)."""
    import email

    found: dict[str, str] = {}
    for dist in metadata.distributions():
        # Name and Version are headers (core metadata: the header block ends at the first blank
        # line). dist.metadata and dist.version each parse the whole file, long description
        # too: 76 ms of every run's start for ~180 packages, against 20 ms for the headers.
        text = dist.read_text("METADATA") or dist.read_text("PKG-INFO") or ""
        headers = email.message_from_string(text.partition("\n\n")[0])
        name = headers["Name"]
        if name and name.lower() not in found:
            found[name.lower()] = f"{name}=={headers['Version']}"
    return "".join(line + "\n" for _, line in sorted(found.items()))


def command(task_overrides: list[str] | None) -> str:
    """The process's own command line (sys.orig_argv: interpreter, flags, script, arguments)
    and, where Hydra says which overrides made this run, the run as one command of the app's
    (`python my_app.py <overrides>`: core/app_command.py)."""
    text = f"# this process\n{shlex.join(sys.orig_argv)}\n"
    if task_overrides is not None:
        run = f"{app_command()} {shlex.join(task_overrides)}".rstrip()
        text += f"# this run (its Hydra overrides)\n{run}\n"
    return text


@dataclass
class Repro:
    state: GitState
    dir: Path  # where this attempt's files are (repro/ or repro/attempt-<k>/)
    files: list[Path]


def write_repro(run_dir: Path, task_overrides: list[str] | None) -> Repro:
    """This attempt's repro files (see the module docstring); logs a warning when the tree is
    dirty. A file system error is a warning: reproducibility notes never stop a run."""
    state = git_state(run_dir)
    contents = {COMMAND_FILE: command(task_overrides), REQUIREMENTS_FILE: requirements()}
    if state.dirty:
        contents[DIFF_FILE] = state.diff
    target = _attempt_dir(run_dir / REPRO_DIR, contents)
    written = []
    try:
        target.mkdir(parents=True, exist_ok=True)
        for name, text in contents.items():
            (target / name).write_text(text)
            written.append(target / name)
    except OSError as e:
        log.warning("cannot write %s (%s): the run goes on without it", target, e)
    if state.dirty:
        log.warning(
            "started from a dirty git tree (%d change(s) against %s): the diff is in %s",
            len(state.changed),
            (state.commit or "")[:12],
            target / DIFF_FILE,
        )
    return Repro(state, target, written)


def _attempt_dir(root: Path, contents: dict[str, str]) -> Path:
    """repro/ for the first attempt and for resumed ones that match it; else the first free
    repro/attempt-<k>/ (k >= 2), unless an earlier attempt already recorded the same."""
    attempts = [p for p in root.glob("attempt-*") if p.name[8:].isdigit()]
    candidates = [root, *sorted(attempts, key=lambda p: int(p.name[8:]))]
    for folder in candidates:
        if not folder.is_dir():
            return folder
        existing = {p.name: p.read_text(errors="replace") for p in folder.iterdir() if p.is_file()}
        if existing == contents:
            return folder
    return root / f"attempt-{len(candidates) + 1}"
