"""One gate before any write. Every start of a run (a training or an evaluation, 1 rank or N,
rank 0 of plain torchrun or srun, a sweep job) passes here before anything is written into its
run dir: Hydra's `.hydra/` and log, the launcher's files, the run's records.

    check    the dir key is not blank, the dir takes a file; nobody holds it
             (ddp_launcher/core/run_lock.py); it is not inside another run's records, and no
             directory or symlink stands where the start writes a file; the app's own checks
             of the config (its `checks`, e.g. my_app.checks: values, keys, the resume
             checkpoint's fit), run where the run starts, with its world size
    plan     from the dir's records: start, continue, or nothing to do (:func:`plan_start`)
    hold     the run dir's lock, for the run's life (the gate's `lock: false`: none)
    replace  what the start replaces (start_over, a resume from another run's checkpoint into a
             dir holding a run, an evaluation run again) moves whole, `.hydra/` and the log
             included, into replaced/<time>/
    record   the attempt in launch.json (the app's `attempts`), `.hydra/` and the log file

The check changes nothing. The steps after it run inside one guard (:class:`Opening`,
:func:`refusing`): any exception there, of any type, refuses the start in one line (cause and
fix) with exit 2, never a warning, and undoes what the start did: the lock it made goes, what it
set aside moves back, the files it wrote are as they were. If that undo itself fails, the
earlier run stays whole in replaced/<time>/ and the line says where. A refused start leaves the
dir byte-identical; "nothing to do" (resume=auto on a completed run) is one line and exit 0.

Where it runs: :class:`RunGate`, a Hydra callback, in the process Hydra runs the job in, before
Hydra writes (on_run_start; Hydra turns a callback's exception into a warning, so nothing may
leave it but SystemExit); for sweep jobs the launchers (ddp_launcher/lifecycle.py), for every
job before any starts, then as each starts; for the sweep dir on_multirun_start, whose
:class:`SweepStart` lets the launcher undo the sweep's start when it is refused before a job
ran. An app names its checks, its kind and what its records are (`records`) in its config's
`hydra.callbacks` (`_target_: ddp_launcher.RunGate`): which dirs hold a training run or an
evaluation is the app's knowledge, not this package's.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import importlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

from ddp_launcher.core import run_lock
from ddp_launcher.core.app_command import app_name
from ddp_launcher.core.errors import UserError, describe, said_logger
from ddp_launcher.core.run_dir import (
    LAUNCH_FILE,
    REPLACED_DIR,
    check_writable,
    holds_run,
    read_result,
    write_atomic,
)

log = logging.getLogger(__name__)

# How an app's config names the gate: the public name (configs written before it was public, in
# sweeps that resume, name its module)
GATE_TARGETS = ("ddp_launcher.RunGate", "ddp_launcher.core.gate.RunGate")
TRAIN, EVAL = "train", "eval"  # the kinds of run: a trajectory that continues, or an evaluation
# What a start never moves aside: earlier runs set aside, the lock, a sweep job's attempts (a
# single run's attempts are its run's: they move aside with it).
KEPT_IN_PLACE = (REPLACED_DIR, run_lock.LOCK_FILE, LAUNCH_FILE)
KEPT_BY_A_SINGLE_RUN = (REPLACED_DIR, run_lock.LOCK_FILE)
# The files Hydra writes into a job's `hydra.output_subdir` (hydra/core/utils.py's run_job).
HYDRA_FILES = ("config.yaml", "hydra.yaml", "overrides.yaml")


class NothingToDo(Exception):
    """The start asks for nothing the run dir has not done already (one line, exit 0): e.g.
    resume=auto on a run that completed what it is asked to do (the app's checks say when)."""


@dataclass(frozen=True)
class Plan:
    action: str  # "start" (fresh) | "continue" (from the dir's own records)
    replaces: str | None = None  # why the dir's earlier records move to replaced/ first
    earlier: str = "run"  # what they are


def default_records(path: Path) -> str | None:
    """What a dir holds for an app without a `records` hook: a training run where it holds the
    records this package defines (result.json, a metrics.jsonl row, a checkpoint), else
    nothing it knows of."""
    return TRAIN if holds_run(path) else None


@dataclass(frozen=True)
class Gate:
    """An app's gate, as its config names it: `checks(config, world_size, run_dir)` raises a
    UserError for bad input (torch-free); `kind` is TRAIN or EVAL; `progress(config, run_dir)`
    says where a start that continues in run_dir picks up ("step 40 (epoch 4)"; None: from
    nothing), for the dry run; `records(path)` says what a dir holds of the app's records
    (TRAIN: a training run, EVAL: an evaluation, None: neither); `lock`: whether a start holds
    its run dir's lock (false: file systems without flock); `name`: its key in hydra.callbacks."""

    checks: Callable[[Any, int, Path], None] | None
    kind: str = TRAIN
    progress: Callable[[Any, Path], str | None] | None = None
    records: Callable[[Path], str | None] | None = None
    lock: bool = True
    name: str | None = None

    def holds(self, path: Path) -> str | None:
        """What `path` holds (TRAIN, EVAL or None); unreadable: None."""
        try:
            return (self.records or default_records)(Path(path))
        except OSError:
            return None

    @property
    def lock_opt_out(self) -> str:
        """The override that starts without a lock, as the user pastes it."""
        if self.name is None:
            return run_lock.NO_LOCK_FIX
        return f"hydra.callbacks.{self.name}.lock=false"


def gate_of(config: Any) -> Gate | None:
    """The gate a job's config names in hydra.callbacks (None: the app has none)."""
    from omegaconf import OmegaConf

    callbacks = OmegaConf.select(config, "hydra.callbacks", default=None) or {}
    for name, spec in callbacks.items():
        if OmegaConf.select(spec, "_target_", default=None) in GATE_TARGETS:
            return Gate(
                load(spec.get("checks")),
                str(spec.get("kind") or TRAIN),
                load(spec.get("progress")),
                load(spec.get("records")),
                lock=bool(spec.get("lock", True)),
                name=str(name),
            )
    return None


def load(name: str | None) -> Callable[..., Any] | None:
    """`module.function` (or `module:function`) -> the function."""
    if not name:
        return None
    module, _, function = str(name).replace(":", ".").rpartition(".")
    return getattr(importlib.import_module(module), function)


def resume_choice(resume: Any, say: bool = True) -> str | Path | None:
    """A run's `resume`: None (start fresh), "auto" (the newest valid checkpoint of its run
    dir, if any) or a path. A restarted job continues from its run dir's checkpoints: after
    torchrun restarted the ranks (--max-restarts) or SLURM requeued the job (`say`: one line)."""
    if resume is None or str(resume).lower() in ("null", "none", ""):
        for var, what in (
            ("TORCHELASTIC_RESTART_COUNT", "of the ranks"),
            ("SLURM_RESTART_COUNT", "of the SLURM job"),
        ):
            if int(os.environ.get(var) or 0) > 0:
                if say:
                    log.warning(
                        "restart %s %s: resuming from the latest checkpoint", os.environ[var], what
                    )
                return "auto"
        return None
    if str(resume) == "auto":
        return "auto"
    return Path(str(resume)).expanduser()


def own_record(path: Path, run_dir: Path) -> bool:
    """Whether `path` (a resume checkpoint) is one of `run_dir`'s own: inside it, and not in
    what an earlier start set aside there."""
    try:
        inside = Path(path).resolve().relative_to(Path(run_dir).resolve())
    except ValueError:
        return False
    return inside.parts[:1] != (REPLACED_DIR,)


def plan_start(
    run_dir: Path,
    config: Any,
    kind: str,
    *,
    sweep: bool,
    gate: Gate | None = None,
    continues: bool = False,
) -> Plan:
    """What a start does with `run_dir`, from its records alone (as the app's `records` hook
    names them); a UserError when it would mix two runs, NothingToDo when there is nothing
    left to do. `continues`: a sweep job run again (a resumed sweep, a retry); without a resume
    hook (hydra.launcher.resume_key) its `resume` still says what the app does, and none
    continues in place."""
    from omegaconf import OmegaConf

    run_dir = Path(run_dir)
    gate = gate or Gate(None, kind)
    if not sweep and holds_sweep(run_dir):
        # (its records would mix with the sweep's jobs, and a start_over or replaced run would
        # move them away with its own, multirun.yaml and the job dirs included)
        raise UserError(
            f"{run_dir} holds a sweep (multirun.yaml, its jobs' dirs): {app_name(config)} "
            "writes into a dir of its own, never into a sweep's: choose another output dir"
        )
    held = gate.holds(run_dir)
    if kind == EVAL:
        if held == TRAIN:
            raise UserError(
                f"{run_dir} holds a training run: {app_name(config)} writes into a dir of its "
                "own, never into a training run: drop hydra.run.dir or choose another one"
            )
        if held == EVAL:
            again = f"{app_name(config)} again in {run_dir}"
            return Plan("start", replaces=again, earlier="evaluation")
        return Plan("start")
    if held == EVAL:
        raise UserError(
            f"{run_dir} holds an evaluation: a training run writes into a dir of its own: "
            "choose another output dir"
        )
    resume = resume_choice(OmegaConf.select(config, "resume", default=None), say=False)
    start_over = bool(OmegaConf.select(config, "start_over", default=False))
    if held is None:
        return Plan("start")
    earlier = read_result(run_dir)
    status = earlier.status if earlier is not None else None
    if resume == "auto":  # (a completed run with nothing left to do: the app's checks say so)
        return Plan("continue")
    if resume is not None:
        if own_record(resume, run_dir):
            return Plan("continue")
        return Plan("start", replaces=f"resume={resume} starts another run's trajectory here")
    if start_over:
        return Plan("start", replaces="start_over=true")
    if continues:
        return Plan("continue")
    what = f"a {status} run" if status is not None else "a run that left no result"
    how = "rerun the sweep with hydra.launcher.resume=true" if sweep else "pass resume=auto"
    further = " (further, with more epochs: it completed)" if status == "completed" else ""
    raise UserError(
        f"{run_dir} already holds {what}: {how} to continue it{further}, start_over=true to "
        f"start it over there (the old run is kept in {REPLACED_DIR}/), or choose another "
        "output dir"
    )


def holds_sweep(path: Path) -> bool:
    """Whether `path` is a sweep's dir: Hydra's multirun.yaml, or a job dir of a launcher's
    (its launch.json) right below it."""
    if (path / "multirun.yaml").is_file():
        return True
    try:
        return any((d / LAUNCH_FILE).is_file() for d in path.iterdir() if d.is_dir())
    except OSError:  # (not a dir, or not readable: the start's own checks say so)
        return False


def check_dir_key(config: Any, key: str) -> None:
    """An output dir key that names no dir (empty, blank: the current directory) is refused."""
    from omegaconf import OmegaConf

    value = OmegaConf.select(config, key, default=None)
    if value is None or not str(value).strip():
        raise UserError(
            f"{key}={'' if value is None else value!r} names no dir (it would write into the "
            f"current directory, {Path.cwd()}): pass {key}=<dir>, or drop it for the default"
        )


def check_not_inside(path: Path, gate: Gate, what: str = "a run") -> None:
    """`path` is not inside a dir that holds a training run or an evaluation (the app's
    `records` say which): a run writes into a dir of its own, never into another's folders."""
    path = Path(path).absolute()
    for parent in path.resolve().parents:
        held = gate.holds(parent)
        if held is not None:
            kind = "a training run" if held == TRAIN else "an evaluation"
            raise UserError(
                f"{path} is inside {parent}, which holds {kind}: {what} writes into a dir of "
                f"its own, never into another run's (its next resume or start_over would move "
                "or delete what is written there): choose a dir outside it"
            )


def start_paths(config: Any, run_dir: Path, *, lock: bool, launch_record: bool) -> list[Path]:
    """The files a start writes in `run_dir` before its task runs (the lock, launch.json,
    Hydra's `.hydra/` files and the job's log files)."""
    from omegaconf import OmegaConf

    run_dir = Path(run_dir)
    paths = [run_dir / run_lock.LOCK_FILE] if lock else []
    if launch_record:
        paths.append(run_dir / LAUNCH_FILE)
    subdir = OmegaConf.select(config, "hydra.output_subdir", default=None)
    if subdir is not None:
        paths += [run_dir / str(subdir) / name for name in HYDRA_FILES]
    return paths + log_files(config, run_dir)


def log_files(config: Any, run_dir: Path) -> list[Path]:
    """The files the job's logging (hydra.job_logging) writes, for a job in `run_dir`."""
    from omegaconf import OmegaConf, open_dict, read_write

    handlers = OmegaConf.select(config, "hydra.job_logging.handlers", default=None)
    names = [n for n, h in (handlers or {}).items() if "filename" in (h or {})]
    if not names:
        return []
    hydra_node = copy.deepcopy(OmegaConf.select(config, "hydra"))
    with read_write(hydra_node), open_dict(hydra_node):
        hydra_node.runtime.output_dir = str(Path(run_dir).absolute())
    node = OmegaConf.create({"hydra": hydra_node})
    found = []
    for name in names:
        key = f"hydra.job_logging.handlers.{name}.filename"
        with contextlib.suppress(Exception):  # a filename only the job resolves: Hydra's
            found.append(Path(str(OmegaConf.select(node, key))))
    return found


def check_start_paths(run_dir: Path, paths: list[Path], replaces: bool) -> None:
    """No directory, symlink or other non-file stands where the start writes a file (and no
    file or symlink where it makes a dir): a start never writes through a link or over what it
    did not write. Changes nothing."""
    dirs = {p.parent for p in paths if p.parent != Path(run_dir)}
    if replaces:
        dirs.add(Path(run_dir) / REPLACED_DIR)
    for path in sorted(dirs):
        if path.is_symlink() or (path.exists() and not path.is_dir()):
            what = "a symlink" if path.is_symlink() else "a file"
            raise UserError(
                f"{path} is {what} where a start makes a directory: move it away (or choose "
                "another output dir)"
            )
    for path in paths:
        if path.is_symlink() or (path.exists() and not path.is_file()):
            what = "a symlink" if path.is_symlink() else "a directory"
            if path.exists() and not path.is_dir() and not path.is_symlink():
                what = "not a regular file"
            raise UserError(
                f"{path} is {what} where a start writes a file: a start never writes through "
                "a link or over what it did not write: move it away (or choose another output "
                "dir)"
            )


def check_start(
    config: Any,
    run_dir: Path,
    world_size: int,
    *,
    sweep: bool,
    gate: Gate | None = None,
    launch_record: bool = True,
    continues: bool = False,
) -> Plan:
    """Everything a start can check before it writes a byte (see the module docstring); changes
    nothing. The plan, or a UserError / NothingToDo. An app without a gate (a Hydra app of
    another project) gets the holder check, and what this package's own records say."""
    gate = gate or gate_of(config)
    run_dir = Path(run_dir)
    holder = run_lock.holder(run_dir)
    if holder is not None and not run_lock.held_for_me(run_dir):
        raise UserError(
            f"{run_dir} is in use by {holder}: wait for it to end (or stop it), or choose "
            "another output dir"
        )
    if gate is None:
        check_not_inside(run_dir, Gate(None))
        return Plan("start")
    check_not_inside(run_dir, gate, app_name(config) if gate.kind == EVAL else "a run")
    if gate.checks is not None:
        gate.checks(config, world_size, run_dir)
    plan = plan_start(run_dir, config, gate.kind, sweep=sweep, gate=gate, continues=continues)
    paths = start_paths(config, run_dir, lock=gate.lock, launch_record=launch_record)
    check_start_paths(run_dir, paths, plan.replaces is not None)
    return plan


def check_as_peer(config: Any, run_dir: Path, gate: Gate | None) -> None:
    """A rank other than 0 of a start whose every rank runs the app (plain torchrun, srun):
    rank 0's gate stands for the run, it alone says a refusal and writes. NothingToDo is
    raised here too, or this rank would wait for rank 0 at the rendezvous until
    dist.timeout_s; the app's checks only read (the config, this run's records)."""
    with contextlib.suppress(UserError):
        if gate is not None and gate.checks is not None:
            gate.checks(config, world_size_of_run(config), run_dir)


# ---------------------------------------------------------------------------------------------
# the guarded steps and their undo


@dataclass
class Opening:
    """What a start has changed in its run dir so far, in order, so that a refusal undoes it:
    dirs it made, files as they were before it wrote them, the lock it took, what it set aside.
    `step` names the step running now (for the refusal's line); `notes` are said once the whole
    start passed (a line said before a later step fails would be a second line)."""

    run_dir: Path
    step: str = "checking the start"
    done: list[tuple] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def make_dirs(self, path: Path) -> None:
        """`path` and its missing parents, each made noted."""
        missing, here = [], Path(path).absolute()
        while not os.path.lexists(here) and here != here.parent:
            missing.append(here)
            here = here.parent
        for folder in reversed(missing):
            try:
                folder.mkdir()
            except FileExistsError:
                # made meanwhile by another process: under plain torchrun (or srun) every
                # rank's Hydra makes the run dir (run_job, exist_ok) while rank 0's gate checks
                # the start. A real dir is taken as found (not this start's to undo); the lock,
                # taken next, still admits one start. Anything else there refuses, as before.
                if folder.is_symlink() or not folder.is_dir():
                    raise
                continue
            self.done.append(("made", folder))

    def keep(self, path: Path) -> None:
        """Before a step writes the file `path`: what it holds now (absent: nothing), to put
        back."""
        path = Path(path)
        if os.path.lexists(path):
            self.done.append(("was", path, path.read_bytes()))
        else:
            self.done.append(("absent", path))

    def locked(self) -> None:
        self.done.append(("lock", self.run_dir))

    def set_aside(self, aside: Path, what: str) -> list[str]:
        """Note a set-aside into `aside`; the names moved there so far are added to the list
        returned, one by one, as each moves."""
        moved: list[str] = []
        self.done.append(("aside", aside, moved, what))
        return moved

    def say(self) -> None:
        for note in self.notes:
            log.warning("%s", note)
        self.notes.clear()

    def undo(self) -> list[str]:
        """Undo every change, newest first; what could not be undone, one phrase each (empty:
        the dir is as it was)."""
        problems: list[str] = []
        kept_aside: set[Path] = set()
        for change in reversed(self.done):
            kind, path = change[0], change[1]
            try:
                if kind == "made":
                    if path in kept_aside or any(a in kept_aside for a in path.parents):
                        continue
                    if path.is_dir() and not path.is_symlink():
                        if any(p in kept_aside for p in path.iterdir()):
                            continue
                        path.rmdir()
                elif kind == "absent":
                    if path.is_dir() and not path.is_symlink():
                        path.rmdir()
                    elif os.path.lexists(path):
                        path.unlink()
                elif kind == "was":
                    data = change[2]
                    if not path.is_file() or path.is_symlink() or path.read_bytes() != data:
                        write_atomic(path, data)
                elif kind == "lock":
                    run_lock.give_back(path)
                elif kind == "aside":
                    problem = move_back(path, change[2], self.run_dir, change[3])
                    if problem is not None:
                        problems.append(problem)
                        kept_aside.add(path)
            except OSError as e:
                problems.append(f"{path} could not be undone ({e.strerror or e})")
        self.done.clear()
        return problems


def move_back(aside: Path, moved: list[str], run_dir: Path, what: str) -> str | None:
    """Move what a set-aside moved into `aside` back into `run_dir`; if one cannot move back,
    whatever moved back goes into `aside` again, so that the earlier run stays whole there:
    the phrase that says where (None: all moved back)."""
    back: list[str] = []
    for name in reversed(moved):
        try:
            os.replace(aside / name, run_dir / name)
            back.append(name)
        except OSError as e:
            failed = f"{name} ({e.strerror or e})"
            break
    else:
        return None
    for name in back:  # (best effort: each that stays out is named below)
        with contextlib.suppress(OSError):
            os.replace(run_dir / name, aside / name)
    left = [n for n in back if not (aside / n).exists()]
    out = f" ({', '.join(left)} moved back)" if left else ""
    return f"the undo could not move {failed} back: the earlier {what} is whole in {aside}{out}"


def open_run(
    run_dir: Path,
    plan: Plan,
    what: str,
    hold: bool = True,
    keep: tuple = KEPT_IN_PLACE,
    opening: Opening | None = None,
    opt_out: str = run_lock.NO_LOCK_FIX,
) -> Opening:
    """After check_start passed: hold the run dir (unless `hold` is false: a SLURM job's rank 0
    holds its own; the gate's lock: false), then set aside what the start replaces (all but
    `keep`). Each change is noted in `opening` for the caller's guard to undo; without one, its
    own, whose notes are said at once."""
    own = opening is None
    opening = opening or Opening(Path(run_dir))
    run_dir = Path(run_dir)
    opening.step = "making the run dir"
    opening.make_dirs(run_dir)
    if hold:
        opening.step = f"taking the run dir's lock ({run_lock.LOCK_FILE})"
        run_lock.acquire(run_dir, what, opt_out=opt_out)
        opening.locked()
    if plan.replaces is not None:
        opening.step = f"setting the earlier {plan.earlier} aside ({REPLACED_DIR}/)"
        aside = set_aside(run_dir, keep, opening, plan.earlier)
        if aside is not None:
            opening.notes.append(f"{plan.replaces}: the earlier {plan.earlier} is now in {aside}")
    if own:
        opening.say()
    return opening


def set_aside(
    run_dir: Path, keep: tuple = KEPT_IN_PLACE, opening: Opening | None = None, what: str = "run"
) -> Path | None:
    """Move the dir's earlier records whole (`.hydra/` and the log too) into
    <run dir>/replaced/<time>/; the folder, or None when there was nothing to move."""
    run_dir = Path(run_dir)
    opening = opening or Opening(run_dir)
    present = sorted(p for p in run_dir.iterdir() if p.name not in keep)
    if not present:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside = run_dir / REPLACED_DIR / stamp
    n = 0
    while os.path.lexists(aside):  # two replacements in one second
        n += 1
        aside = run_dir / REPLACED_DIR / f"{stamp}-{n}"
    opening.make_dirs(aside)
    moved = opening.set_aside(aside, what)
    for path in present:
        os.replace(path, aside / path.name)
        moved.append(path.name)
    return aside


def write_hydra_files(config: Any, run_dir: Path, opening: Opening) -> None:
    """What Hydra writes once the gate passed (its `.hydra/` files and the job's log file),
    written here first inside the guard, so that a dir that cannot take them (full, read-only,
    a directory in a file's place) refuses the start and is undone; Hydra then writes them
    again, the same."""
    from omegaconf import OmegaConf, open_dict, read_write

    subdir = OmegaConf.select(config, "hydra.output_subdir", default=None)
    if subdir is not None:
        opening.step = f"writing {subdir}/"
        hydra_dir = Path(run_dir) / str(subdir)
        opening.make_dirs(hydra_dir)
        task = copy.deepcopy(config)
        with read_write(task), open_dict(task):
            del task["hydra"]
        hydra_node = OmegaConf.create({"hydra": copy.deepcopy(config.hydra)})
        with read_write(hydra_node), open_dict(hydra_node):
            hydra_node.hydra.runtime.output_dir = str(Path(run_dir).absolute())
        overrides = OmegaConf.select(config, "hydra.overrides.task", default=[]) or []
        contents = {
            "config.yaml": OmegaConf.to_yaml(task),
            "hydra.yaml": OmegaConf.to_yaml(hydra_node),
            "overrides.yaml": OmegaConf.to_yaml(overrides),
        }
        for name, text in contents.items():
            opening.step = f"writing {subdir}/{name}"
            opening.keep(hydra_dir / name)
            write_atomic(hydra_dir / name, text)
    for path in log_files(config, run_dir):
        opening.step = f"opening the log ({path.name})"
        opening.make_dirs(path.parent)
        if not os.path.lexists(path):
            opening.done.append(("absent", path))
        with open(path, "a", encoding="utf-8"):  # (as logging's FileHandler opens it)
            pass


def refusal(error: BaseException, opening: Opening, problems: list[str]) -> str:
    """The one line of a start refused by `error` at `opening.step`: its cause and fix, and
    what the undo left (`problems`)."""
    line = failure_line(error, opening.run_dir, f"the start failed {opening.step}")
    if problems:
        return f"{line}; {'; '.join(problems)}"
    if not isinstance(error, UserError):
        line += "; nothing in it changed"
    return line


def failure_line(error: BaseException, place: Path, failed: str) -> str:
    """`error` of a start as one line: a UserError's own, else `place` and what `failed` ("the
    start failed recording the attempt"), then an OSError's cause and fix, or the error and how
    to see its traceback."""
    if isinstance(error, UserError):
        return describe(error)
    if isinstance(error, OSError):
        return f"{place}: {failed}: {os_cause(error, place)}"
    return f"{place}: {failed}: {describe(error)} (rerun with HYDRA_FULL_ERROR=1 for its traceback)"


def os_cause(error: OSError, run_dir: Path) -> str:
    """An OSError of a start, as cause and fix."""
    where = Path(error.filename) if error.filename else run_dir
    what = f"{error.strerror or type(error).__name__} ({where})"
    code = error.errno
    if code in (errno.ENOSPC, errno.EDQUOT):
        fix = "free space (or inodes: df -i) on its file system, or choose another output dir"
    elif code in (errno.EACCES, errno.EPERM, errno.EROFS):
        fix = f"make {where.parent} writable for you, or choose another output dir"
    elif code == errno.ENOTDIR:
        fix = (
            "a file stands where a directory must be on that path: move it away, or choose "
            "another output dir"
        )
    elif code == errno.EISDIR:
        fix = f"{where} is a directory where the start writes a file: move it away"
    elif code == errno.ELOOP:
        fix = f"{where} is a symlink: a start never writes through one: move it away"
    else:
        fix = f"check {run_dir} and its file system, or choose another output dir"
    return f"{what}: {fix}"


def world_size_of_run(config: Any) -> int:
    """The world size of a run started as this process is: torchrun's (or srun's), else what
    its `dist` node asks for (ddp_launcher/core/world.py)."""
    from ddp_launcher.core.world import job_world, rank_world_size, started_as_rank, visible_gpus

    if started_as_rank():
        return rank_world_size()
    nproc, nnodes, _ = job_world(config, visible_gpus())
    return nproc * nnodes


@contextmanager
def refusing(config: Any, opening: Opening | None = None) -> Iterator[None]:
    """In a Hydra callback (whose exceptions Hydra turns into warnings): nothing leaves the
    block but SystemExit. A refusal, of any type, undoes what `opening` noted and is one log
    line and SystemExit(2); nothing to do, one line and SystemExit(0); Ctrl-C is undone too and
    goes on. Said as the run's own lines are (its job logging's console), before the run's log
    file exists."""
    opening = opening or Opening(Path("."))
    try:
        yield
    except NothingToDo as e:
        opening.undo()
        console_logging(config)
        said_logger(__name__).info("%s", e)
        raise SystemExit(0) from None
    except Exception as e:
        line = refusal(e, opening, opening.undo())
        console_logging(config)
        full = os.environ.get("HYDRA_FULL_ERROR") == "1" and not isinstance(e, UserError)
        said_logger(__name__).error("%s", line, exc_info=e if full else None)
        raise SystemExit(UserError.exit_code) from None
    except BaseException:  # Ctrl-C, SystemExit: the dir as it was, then on its way
        opening.undo()
        raise


def console_logging(config: Any) -> None:
    """The job's logging (hydra.job_logging) without its file handlers: the gate speaks before
    the run may write."""
    import logging.config

    from omegaconf import OmegaConf

    node = OmegaConf.select(config, "hydra.job_logging", default=None)
    if node is None:
        return
    spec = OmegaConf.to_container(node, resolve=False)
    files = {n for n, h in (spec.get("handlers") or {}).items() if "filename" in h}
    spec["handlers"] = {n: h for n, h in (spec.get("handlers") or {}).items() if n not in files}
    for part in [spec.get("root") or {}, *(spec.get("loggers") or {}).values()]:
        part["handlers"] = [h for h in part.get("handlers", []) if h not in files]
    with contextlib.suppress(ValueError, TypeError, AttributeError, ImportError):
        logging.config.dictConfig(spec)  # (else Hydra's own format)


class RunGate(Callback):
    """The gate of a run Hydra runs in this process (`python app.py`, also with
    dist.nproc_per_node=N, whose ranks this process starts; each rank of plain torchrun or
    srun, where rank 0 alone writes and so alone checks): before Hydra makes `.hydra/` and the
    log. `checks`: the app's checks ("module.function"); `kind`: train or eval; `attempts`: the
    app's record of a run's attempts ("module.Class", ddp_launcher/resume.py's RunAttempts: its
    check(config, run_dir, plan) before anything is written says, or refuses with a UserError,
    what changed since the run's first attempt; open(...) records the attempt once the dir is
    held; close(run_dir, job_return) how it ended); `progress`: where a continuing start picks
    up; `records`: what a dir holds of the app's records ("module.function": path -> "train",
    "eval" or None); `lock`: false runs without the run dir's lock (a file system without
    flock), said in the run's log. Sweep jobs never pass here (Hydra calls on_run_start in run
    mode only): their launcher records and checks them."""

    def __init__(
        self,
        checks: str | None = None,
        kind: str = TRAIN,
        attempts: str | None = None,
        progress: str | None = None,
        records: str | None = None,
        lock: bool = True,
    ):
        super().__init__()
        self.gate = Gate(load(checks), kind, load(progress), load(records), lock=bool(lock))
        self.attempts = load(attempts)
        self.run_dir: Path | None = None  # the run this process opened
        self.said: list[str] = []  # said once the job's logging is set up (train.log too)

    def on_run_start(self, config: Any, **kwargs: Any) -> None:
        from omegaconf import OmegaConf

        if int(os.environ.get("RANK", "0")) != 0:  # plain torchrun or srun: each rank is here
            run_dir = Path(str(OmegaConf.select(config, "hydra.run.dir", default=""))).absolute()
            try:
                check_as_peer(config, run_dir, self.gate)
            except NothingToDo:
                raise SystemExit(0) from None
            return
        opening = Opening(Path(".").absolute())
        with refusing(config, opening):  # (nothing but SystemExit leaves it: fail closed)
            check_dir_key(config, "hydra.run.dir")
            run_dir = opening.run_dir = Path(
                str(OmegaConf.select(config, "hydra.run.dir"))
            ).absolute()
            gate = gate_of(config) or self.gate  # (its name in hydra.callbacks: the opt-out)
            check_writable(config, "hydra.run.dir")
            world_size = world_size_of_run(config)
            plan = check_start(
                config,
                run_dir,
                world_size,
                sweep=False,
                gate=self.gate,
                launch_record=self.attempts is not None,
            )
            if self.attempts is not None:
                drift = self.attempts.check(config, run_dir, plan)
                self.said += [drift] if drift is not None else []
            keep = KEPT_IN_PLACE if self.attempts is None else KEPT_BY_A_SINGLE_RUN
            what = f"{self.gate.kind}, world size {world_size}"
            open_run(
                run_dir,
                plan,
                what,
                hold=self.gate.lock,
                keep=keep,
                opening=opening,
                opt_out=gate.lock_opt_out,
            )
            if self.attempts is not None:
                opening.step = f"recording the attempt ({LAUNCH_FILE})"
                opening.keep(run_dir / LAUNCH_FILE)
                self.attempts.open(config, run_dir, plan)
            write_hydra_files(config, run_dir, opening)
        opening.say()
        if not self.gate.lock:
            self.said.append(
                f"{gate.lock_opt_out}: {run_dir} is not locked: nothing stops another start "
                "from writing into it while this run runs"
            )
        if self.attempts is not None:
            self.run_dir = run_dir
        if self.gate.lock:
            os.environ.update(run_lock.child_env(run_dir))  # for the ranks this process starts

    def on_job_start(self, config: Any, **kwargs: Any) -> None:
        for line in self.said:  # (in train.log too: Hydra has set up the job's logging)
            log.warning("%s", line)
        self.said = []

    def on_run_end(self, config: Any, job_return: Any = None, **kwargs: Any) -> None:
        if self.run_dir is not None:
            self.attempts.close(self.run_dir, job_return)

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        from omegaconf import OmegaConf

        sweep_dir = Path(str(OmegaConf.select(config, "hydra.sweep.dir", default="")))
        with refusing(config, Opening(sweep_dir.absolute())):
            check_dir_key(config, "hydra.sweep.dir")
            check_subdir_key(config)
            check_writable(config, "hydra.sweep.dir")
            check_sweep(config, gate_of(config) or self.gate)
            remember_sweep_start(sweep_dir)


def check_subdir_key(config: Any) -> None:
    """A blank hydra.sweep.subdir would put every job into the sweep dir itself."""
    from omegaconf import OmegaConf

    sweep = OmegaConf.select(config, "hydra.sweep", default=None)
    raw = OmegaConf.to_container(sweep, resolve=False).get("subdir") if sweep is not None else None
    if raw is not None and not str(raw).strip():
        raise UserError(
            f"hydra.sweep.subdir={raw!r} names no dir (every job would write into the sweep dir "
            "itself): pass hydra.sweep.subdir=<a name per job>, or drop it for the default "
            "(${hydra.job.num})"
        )


# Overrides a rerun of the same sweep may add or change: how it starts, not which jobs.
HOW_IT_STARTS = ("start_over", "resume")


def check_sweep(config: Any, gate: Gate | None = None) -> None:
    """A sweep dir holds one sweep: before the sweeper writes multirun.yaml, a sweep into a dir
    that holds a single run (or lies inside one) is refused, so is a sweep whose overrides are
    not those of the jobs already there, and a rerun of the same sweep that neither resumes it
    (hydra.launcher.resume=true) nor starts it over."""
    from omegaconf import OmegaConf

    from ddp_launcher.core.world import keeps_records

    gate = gate or Gate(None)
    launcher = OmegaConf.select(config, "hydra.launcher", default=None) or {}
    endpoint = launcher.get("rdzv_endpoint")
    if endpoint and not keeps_records(launcher.get("node_rank"), endpoint):
        return  # every node's launcher runs this sweep: node 0's keeps (and checks) its records
    sweep_dir = Path(str(OmegaConf.select(config, "hydra.sweep.dir")))
    held = gate.holds(sweep_dir)
    if held is not None:
        what = "a training run" if held == TRAIN else "an evaluation"
        raise UserError(
            f"{sweep_dir} holds {what} of its own, not a sweep: a sweep writes its jobs into a "
            "dir of its own: pass another hydra.sweep.dir"
        )
    check_not_inside(sweep_dir, gate, "a sweep")
    jobs = [
        d
        for d in sweep_dir.glob("*")
        if d.is_dir() and ((d / LAUNCH_FILE).exists() or gate.holds(d) is not None)
    ]
    if not jobs:
        return
    recorded = sweep_overrides(sweep_dir / "multirun.yaml")
    ours = [str(o) for o in OmegaConf.select(config, "hydra.overrides.task", default=[]) or []]
    if recorded is not None and what_runs(recorded) != what_runs(ours):
        theirs = " ".join(sorted(what_runs(recorded) - what_runs(ours))) or "(none)"
        mine = " ".join(sorted(what_runs(ours) - what_runs(recorded))) or "(none)"
        raise UserError(
            f"{sweep_dir} holds another sweep ({theirs} where this one has {mine}): never mix "
            "two sweeps in one dir: repeat the first sweep's command line to resume it, or pass "
            "another hydra.sweep.dir"
        )
    resume = bool(OmegaConf.select(config, "hydra.launcher.resume", default=False))
    start_over = bool(OmegaConf.select(config, "start_over", default=False))
    if not (resume or start_over):
        raise UserError(
            f"{sweep_dir} already holds this sweep's jobs: rerun with "
            "hydra.launcher.resume=true to continue it, start_over=true to start every job over "
            f"(each job's old run is kept in its {REPLACED_DIR}/), or pass another hydra.sweep.dir"
        )


def what_runs(overrides: list[str]) -> set[str]:
    """The overrides that say which jobs a sweep runs (HOW_IT_STARTS left out)."""
    return {o for o in overrides if o.lstrip("+~").partition("=")[0] not in HOW_IT_STARTS}


def sweep_overrides(path: Path) -> list[str] | None:
    """The task overrides a sweep's multirun.yaml records (None: none readable)."""
    from omegaconf import OmegaConf

    try:
        recorded = OmegaConf.select(OmegaConf.load(path), "hydra.overrides.task")
    except Exception:  # noqa: BLE001 - absent or damaged: the jobs' own records decide
        return None
    return [str(o) for o in recorded] if recorded is not None else None


# ---------------------------------------------------------------------------------------------
# a sweep's start: undone when the launcher refuses it before any job started

KEPT_BYTES = 1 << 20  # the top-level files of a sweep dir whose bytes a sweep's start keeps


@dataclass
class SweepStart:
    """The sweep dir as on_multirun_start found it, before the sweeper writes multirun.yaml and
    the launcher its lock: `missing`, the dirs the start will make (the sweep dir and its
    missing parents); `files`, every top-level file's bytes (None: too large to keep)."""

    sweep_dir: Path
    missing: list[Path]
    files: dict[str, bytes | None]
    names: set[str]


_SWEEP_STARTS: dict[str, SweepStart] = {}


def remember_sweep_start(sweep_dir: Path) -> None:
    sweep_dir = Path(sweep_dir).absolute()
    missing, here = [], sweep_dir
    while not os.path.lexists(here) and here != here.parent:
        missing.append(here)
        here = here.parent
    files: dict[str, bytes | None] = {}
    names: set[str] = set()
    if sweep_dir.is_dir():
        for path in sweep_dir.iterdir():
            names.add(path.name)
            if path.is_file() and not path.is_symlink():
                small = path.stat().st_size <= KEPT_BYTES
                files[path.name] = path.read_bytes() if small else None
    _SWEEP_STARTS[str(sweep_dir)] = SweepStart(sweep_dir, missing, files, names)


def pending_sweep_start(sweep_dir: Path) -> bool:
    """Whether the sweep's start is remembered and no job of it has started yet."""
    return str(Path(sweep_dir).absolute()) in _SWEEP_STARTS


def sweep_started(sweep_dir: Path) -> None:
    """A job of the sweep started: its sweep dir is this sweep's from now on (no undo)."""
    _SWEEP_STARTS.pop(str(Path(sweep_dir).absolute()), None)


def undo_sweep_start(sweep_dir: Path) -> list[str]:
    """Put the sweep dir back as on_multirun_start found it (the launcher's lock released
    first): files the start wrote as they were, those it made and the dirs it made gone. What
    could not be undone, one phrase each; nothing where no start was remembered."""
    start = _SWEEP_STARTS.pop(str(Path(sweep_dir).absolute()), None)
    if start is None:
        return []
    problems = []
    here = start.sweep_dir
    if here.is_dir():
        for path in here.iterdir():
            try:
                if path.name not in start.names:
                    if path.is_file() or path.is_symlink():
                        path.unlink()
                    elif path.is_dir() and not any(path.iterdir()):
                        path.rmdir()
                elif path.name in start.files and start.files[path.name] is not None:
                    data = start.files[path.name]
                    if not path.is_file() or path.read_bytes() != data:
                        write_atomic(path, data)
            except OSError as e:
                problems.append(f"{path} could not be undone ({e.strerror or e})")
    for folder in start.missing:  # the sweep dir first, then its parents
        with contextlib.suppress(OSError):
            folder.rmdir()
    return problems
