"""What a run needs to be reproduced, written by rank 0 into `<run dir>/repro/` at start:

    repro/command.txt       the command that started this process (argv only) and the run as one
                            `python train.py <overrides>` line
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
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

log = logging.getLogger(__name__)

REPRO_DIR = "repro"
COMMAND_FILE = "command.txt"
REQUIREMENTS_FILE = "requirements.txt"
DIFF_FILE = "git.diff"
# Where the code lives: git runs here (tests point it at a repository of their own).
CODE_DIR = Path(__file__).resolve().parent.parent
MAX_DIFF_BYTES = 5 * 2**20  # a bigger diff (data committed by mistake?) is cut, and says so


def git(*args: str, cwd: Path | None = None) -> str | None:
    """`git <args>`'s stdout in the code dir; None where git or the repository is missing."""
    try:
        out = subprocess.run(
            ["git", *args], cwd=cwd or CODE_DIR, capture_output=True, text=True, timeout=10
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


def git_state(run_dir: Path | None = None) -> GitState:
    """The code's commit and uncommitted changes; a `run_dir` inside the repository (not
    ignored) is left out, so that a run's own outputs never make its tree dirty."""
    commit = (git("rev-parse", "HEAD") or "").strip() or None
    if commit is None:
        return GitState()
    paths: list[str] = []
    top = (git("rev-parse", "--show-toplevel") or "").strip()
    if run_dir is not None and top and Path(run_dir).resolve().is_relative_to(top):
        paths = ["--", ":(top)", f":(top,exclude){Path(run_dir).resolve().relative_to(top)}"]
    status = git("status", "--porcelain", *paths) or ""
    changed = [line for line in status.splitlines() if line.strip()]
    if not changed:
        return GitState(commit)
    untracked = [line[3:] for line in changed if line.startswith("??")]
    head = "".join(f"# untracked, not in this diff: {name}\n" for name in untracked)
    diff = git("diff", "HEAD", "--binary", *paths) or ""
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
    and, where Hydra says which overrides made this run, the run as one train.py command."""
    text = f"# this process\n{shlex.join(sys.orig_argv)}\n"
    if task_overrides is not None:
        text += f"# this run (its Hydra overrides)\npython train.py {shlex.join(task_overrides)}\n"
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
