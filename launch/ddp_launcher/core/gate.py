"""One gate before any write. Every start of a run (train.py or eval.py, 1 rank or N, rank 0 of
plain torchrun or srun, a sweep job) passes here before anything is written into its run dir:
Hydra's `.hydra/` and log, the launcher's files, the run's records.

    check    the dir takes a file; nobody holds it (ddp_launcher/core/run_lock.py); the app's own
    checks of
             the config (its `checks`, e.g. conf/checks.py: values, keys, the resume
             checkpoint's fit), run where the run starts, with its world size
    plan     from the dir's records: start, continue, or nothing to do (:func:`plan_start`)
    hold     the run dir's lock, for the run's life
    replace  what the start replaces (start_over, a resume from another run's checkpoint into a
             dir holding a run, an evaluation run again) moves whole, `.hydra/` and the log
             included, into replaced/<time>/

A refused start is one line and exit status 2, and the dir is byte-identical; "nothing to do"
(resume=auto on a completed run) is one line and exit 0. Where it runs: :class:`RunGate`, a
Hydra callback, in the process Hydra runs the job in, before Hydra writes (on_run_start); for
sweep jobs the launchers (ddp_launcher/lifecycle.py), for every job before any starts, then as each
starts. An app names its checks and kind in its config's `hydra.callbacks` (conf/train.yaml).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

from ddp_launcher.core import run_lock
from ddp_launcher.core.errors import UserError
from ddp_launcher.core.run_dir import (
    CHECKPOINT_DIR,
    EVAL_FILE,
    LAUNCH_FILE,
    REPLACED_DIR,
    check_writable,
    holds_run,
    read_result,
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


class NothingToDo(Exception):
    """The start asks for nothing the run dir has not done already (one line, exit 0): e.g.
    resume=auto on a run that completed what it is asked to do (conf/checks.py says when)."""


@dataclass(frozen=True)
class Plan:
    action: str  # "start" (fresh) | "continue" (from the dir's own records)
    replaces: str | None = None  # why the dir's earlier records move to replaced/ first
    earlier: str = "run"  # what they are


@dataclass(frozen=True)
class Gate:
    """An app's gate, as its config names it: `checks(config, world_size, run_dir)` raises a
    UserError for bad input (torch-free); `kind` is TRAIN or EVAL; `progress(config, run_dir)`
    says where a start that continues in run_dir picks up ("step 40 (epoch 4)"; None: from
    nothing), for the dry run."""

    checks: Callable[[Any, int, Path], None] | None
    kind: str = TRAIN
    progress: Callable[[Any, Path], str | None] | None = None


def gate_of(config: Any) -> Gate | None:
    """The gate a job's config names in hydra.callbacks (None: the app has none)."""
    from omegaconf import OmegaConf

    callbacks = OmegaConf.select(config, "hydra.callbacks", default=None) or {}
    for spec in callbacks.values():
        if OmegaConf.select(spec, "_target_", default=None) in GATE_TARGETS:
            return Gate(
                load(spec.get("checks")), str(spec.get("kind") or TRAIN), load(spec.get("progress"))
            )
    return None


def load(name: str | None) -> Callable[[Any, int, Path], None] | None:
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


def plan_start(
    run_dir: Path, config: Any, kind: str, *, sweep: bool, continues: bool = False
) -> Plan:
    """What a start does with `run_dir`, from its records alone; a UserError when it would mix
    two runs, NothingToDo when there is nothing left to do. `continues`: a sweep job run again
    (a resumed sweep, a retry); without a resume hook (hydra.launcher.resume_key) its `resume`
    still says what the app does, and none continues in place."""
    from omegaconf import OmegaConf

    run_dir = Path(run_dir)
    if kind == EVAL:
        run = OmegaConf.select(config, "run", default=None)
        if holds_run(run_dir) or (run and Path(str(run)).resolve() == run_dir.resolve()):
            raise UserError(
                f"{run_dir} holds a training run: eval.py writes into a dir of its own, never "
                "into a training run: drop hydra.run.dir or choose another one"
            )
        if (run_dir / EVAL_FILE).exists():
            return Plan("start", replaces=f"eval.py again in {run_dir}", earlier="evaluation")
        return Plan("start")
    resume = resume_choice(OmegaConf.select(config, "resume", default=None), say=False)
    start_over = bool(OmegaConf.select(config, "start_over", default=False))
    if not holds_run(run_dir):
        return Plan("start")
    earlier = read_result(run_dir)
    status = earlier.status if earlier is not None else None
    if resume == "auto":  # (a completed run with nothing left to do: the app's checks say so)
        return Plan("continue")
    if resume is not None:
        if resume.resolve().parent == (run_dir / CHECKPOINT_DIR).resolve():  # its own
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


def check_start(
    config: Any,
    run_dir: Path,
    world_size: int,
    *,
    sweep: bool,
    gate: Gate | None = None,
    continues: bool = False,
) -> Plan:
    """Everything a start can check before it writes a byte (see the module docstring); changes
    nothing. The plan, or a UserError / NothingToDo. An app without a gate (a Hydra app of
    another project) gets the holder check only: what its records mean is its own."""
    gate = gate or gate_of(config)
    run_dir = Path(run_dir)
    holder = run_lock.holder(run_dir)
    if holder is not None and not run_lock.held_for_me(run_dir):
        raise UserError(
            f"{run_dir} is in use by {holder}: wait for it to end (or stop it), or choose "
            "another output dir"
        )
    if gate is None:
        return Plan("start")
    if gate.checks is not None:
        gate.checks(config, world_size, run_dir)
    return plan_start(run_dir, config, gate.kind, sweep=sweep, continues=continues)


def check_as_peer(config: Any, run_dir: Path, gate: Gate | None) -> None:
    """A rank other than 0 of a start whose every rank runs the app (plain torchrun, srun):
    rank 0's gate stands for the run, it alone says a refusal and writes. NothingToDo is
    raised here too, or this rank would wait for rank 0 at the rendezvous until
    dist.timeout_s; the app's checks only read (the config, this run's records)."""
    with contextlib.suppress(UserError):
        if gate is not None and gate.checks is not None:
            gate.checks(config, world_size_of_run(config), run_dir)


def open_run(
    run_dir: Path, plan: Plan, what: str, hold: bool = True, keep: tuple = KEPT_IN_PLACE
) -> None:
    """After check_start passed: hold the run dir (unless `hold` is false: a SLURM job's rank 0
    holds its own), then set aside what the start replaces (all but `keep`)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if hold:
        run_lock.acquire(run_dir, what)
    if plan.replaces is not None:
        aside = set_aside(run_dir, keep)
        if aside is not None:
            log.warning("%s: the earlier %s is now in %s", plan.replaces, plan.earlier, aside)


def set_aside(run_dir: Path, keep: tuple = KEPT_IN_PLACE) -> Path | None:
    """Move the dir's earlier records whole (`.hydra/` and the log too) into
    <run dir>/replaced/<time>/; the folder, or None when there was nothing to move."""
    run_dir = Path(run_dir)
    present = [p for p in run_dir.iterdir() if p.name not in keep]
    if not present:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside = run_dir / REPLACED_DIR / stamp
    n = 0
    while aside.exists():  # two replacements in one second
        n += 1
        aside = run_dir / REPLACED_DIR / f"{stamp}-{n}"
    aside.mkdir(parents=True)
    for path in present:
        os.replace(path, aside / path.name)
    return aside


def world_size_of_run(config: Any) -> int:
    """The world size of a run started as this process is: torchrun's (or srun's), else what
    its `dist` node asks for (ddp_launcher/core/world.py)."""
    from ddp_launcher.core.world import job_world, rank_world_size, started_as_rank, visible_gpus

    if started_as_rank():
        return rank_world_size()
    nproc, nnodes, _ = job_world(config, visible_gpus())
    return nproc * nnodes


@contextmanager
def refusing(config: Any) -> Iterator[None]:
    """In a Hydra callback (whose exceptions Hydra turns into warnings): a refusal is one log
    line and SystemExit(2); nothing to do, one line and SystemExit(0). Said as the run's own
    lines are (its job logging's console), before the run's log file exists."""
    try:
        yield
    except (UserError, NothingToDo) as e:
        console_logging(config)
        if isinstance(e, NothingToDo):
            logging.getLogger("train").info("%s", e)
            raise SystemExit(0) from None
        logging.getLogger("train").error("%s", e)
        raise SystemExit(e.exit_code) from None


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
    """The gate of a run Hydra runs in this process (`python train.py`, also with
    dist.nproc_per_node=N, whose ranks this process starts; each rank of plain torchrun or
    srun, where rank 0 alone writes and so alone checks): before Hydra makes `.hydra/` and the
    log. `checks`: the app's checks ("module.function"); `kind`: train or eval; `attempts`: the
    app's record of a run's attempts ("module.Class", ddp_launcher/resume.py's RunAttempts: its
    check(config, run_dir, plan) before anything is written says, or refuses with a UserError,
    what changed since the run's first attempt; open(...) records the attempt once the dir is
    held; close(run_dir, job_return) how it ended). Sweep jobs never pass here (Hydra calls
    on_run_start in run mode only): their launcher records and checks them."""

    def __init__(
        self,
        checks: str | None = None,
        kind: str = TRAIN,
        attempts: str | None = None,
        progress: str | None = None,
    ):
        super().__init__()
        self.gate = Gate(load(checks), kind, load(progress))
        self.attempts = load(attempts)
        self.run_dir: Path | None = None  # the run this process opened
        self.drift: str | None = None  # said once the job's logging is set up

    def on_run_start(self, config: Any, **kwargs: Any) -> None:
        from omegaconf import OmegaConf

        run_dir = Path(str(OmegaConf.select(config, "hydra.run.dir"))).absolute()
        if int(os.environ.get("RANK", "0")) != 0:  # plain torchrun or srun: each rank is here
            try:
                check_as_peer(config, run_dir, self.gate)
            except NothingToDo:
                raise SystemExit(0) from None
            return
        with refusing(config):
            check_writable(config, "hydra.run.dir")
            world_size = world_size_of_run(config)
            plan = check_start(config, run_dir, world_size, sweep=False, gate=self.gate)
            if self.attempts is not None:
                self.drift = self.attempts.check(config, run_dir, plan)
            keep = KEPT_IN_PLACE if self.attempts is None else KEPT_BY_A_SINGLE_RUN
            open_run(run_dir, plan, f"{self.gate.kind}, world size {world_size}", keep=keep)
        if self.attempts is not None:
            self.attempts.open(config, run_dir, plan)
            self.run_dir = run_dir
        os.environ.update(run_lock.child_env(run_dir))  # for the ranks this process starts

    def on_job_start(self, config: Any, **kwargs: Any) -> None:
        if self.drift is not None:  # (in train.log too: Hydra has set up the job's logging)
            log.warning("%s", self.drift)
            self.drift = None

    def on_run_end(self, config: Any, job_return: Any = None, **kwargs: Any) -> None:
        if self.run_dir is not None:
            self.attempts.close(self.run_dir, job_return)

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        with refusing(config):
            check_writable(config, "hydra.sweep.dir")
            check_sweep(config)


# Overrides a rerun of the same sweep may add or change: how it starts, not which jobs.
HOW_IT_STARTS = ("start_over", "resume")


def check_sweep(config: Any) -> None:
    """A sweep dir holds one sweep: before the sweeper writes multirun.yaml, a sweep whose
    overrides are not those of the jobs already there is refused, and so is a rerun of the same
    sweep that neither resumes it (hydra.launcher.resume=true) nor starts it over."""
    from omegaconf import OmegaConf

    from ddp_launcher.core.world import keeps_records

    launcher = OmegaConf.select(config, "hydra.launcher", default=None) or {}
    endpoint = launcher.get("rdzv_endpoint")
    if endpoint and not keeps_records(launcher.get("node_rank"), endpoint):
        return  # every node's launcher runs this sweep: node 0's keeps (and checks) its records
    sweep_dir = Path(str(OmegaConf.select(config, "hydra.sweep.dir")))
    jobs = [d for d in sweep_dir.glob("*") if (d / LAUNCH_FILE).exists() or holds_run(d)]
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
