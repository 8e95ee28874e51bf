"""`hydra.launcher.dry_run=true` (docs/sweeps.md, "Preview a sweep"): every job of a sweep
composed and checked as the launcher checks it before it starts, one row each, none started.

Hydra's sweepers write the sweep dir before their launcher sees a job (BasicSweeper makes it and
writes multirun.yaml; ours opens its study there), so a dry run takes the sweep over from the
launcher's setup, which Hydra runs inside the sweeper's setup (:func:`prepare_dry_run`): the
same config, sweeper and launcher, asked for the jobs instead of told to run them. A row comes
from the code the real launch runs: the backend places the job (its world size, its launcher
checks), the resume decision of ddp_launcher/resume.py, the app's gate
(ddp_launcher/core/gate.py's check_start: the app's checks, the run dir's plan), the
backend's own resources (torchrun's GPUs and CPU slice from its packing; SLURM's sbatch options
from submitit's batch script). Nothing is written, no process started, torch not imported; a job
that would fail its checks is one line naming it, exit 2.
"""

from __future__ import annotations

import functools
import logging
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from omegaconf import OmegaConf

from ddp_launcher.core.errors import UserError
from ddp_launcher.core.gate import NothingToDo, check_start, gate_of
from ddp_launcher.core.run_dir import read_result
from ddp_launcher.jobs import Job

log = logging.getLogger(__name__)


def prepare_dry_run(config: Any, hydra_context: Any = None) -> None:
    """hydra.launcher.dry_run=true, set on the command line or in a config: called by the
    launcher's setup (ddp_launcher/lifecycle.py's check_setup), the first code of this package
    that runs once an app selects the launcher, and inside the sweeper's setup, before the
    sweeper writes anything. Hydra has no hook between composing a sweep and its sweeper's first
    write, so for this process only (a dry run's) the basic sweeper's sweep is wrapped to preview
    its jobs (:func:`preview_basic_sweeps`); this package's Optuna sweeper previews by itself;
    any other sweeper is refused in one line. The gate's sweep checks run first (as an app's
    RunGate runs them at on_multirun_start), and the multirun's callbacks (its
    `hydra_context`'s) are dropped: Hydra 1.4 calls their on_multirun_end even when the
    preview ends the process, and a sweep report would be a write. Without a dry run nothing
    is touched."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.utils import get_class

    from ddp_launcher.core.gate import check_sweep
    from ddp_launcher.sweeper.sweeper import TARGET

    if not OmegaConf.select(config, "hydra.launcher.dry_run", default=False):
        return
    target = str(OmegaConf.select(config, "hydra.sweeper._target_", default=None))
    check_sweep(config)
    callbacks = getattr(hydra_context, "callbacks", None)
    if callbacks is not None:
        callbacks.callbacks = []  # Hydra's Callbacks: its list of the app's callbacks
    if target == TARGET:
        return  # ddp_launcher/sweeper/sweeper.py's sweep previews
    if issubclass(get_class(target), BasicSweeper):
        preview_basic_sweeps(BasicSweeper)
        return
    raise UserError(
        f"hydra.launcher.dry_run=true previews the basic and hydra/sweeper=ddp_optuna sweepers, "
        f"not {target.rpartition('.')[2]}: drop hydra.launcher.dry_run"
    )


def preview_basic_sweeps(basic_sweeper: Any) -> None:
    """Wrap `basic_sweeper`'s sweep, once: a sweep whose launcher has a dry run previews every
    job (one row each) and ends the process, exit 0, before Hydra's on_multirun_end callbacks
    (a report into the sweep dir would be a write); any other runs as before."""
    sweep = basic_sweeper.sweep
    if getattr(sweep, "previews", False):
        return

    @functools.wraps(sweep)
    def sweep_or_preview(self: Any, arguments: list[str]) -> Any:
        dry_run = OmegaConf.select(self.config, "hydra.launcher.dry_run", default=False)
        if not (dry_run and hasattr(self.launcher, "preview")):
            return sweep(self, arguments)
        self.launcher.preview(basic_sweep_jobs(self, arguments), 0)
        raise SystemExit(0)

    sweep_or_preview.previews = True  # type: ignore[attr-defined]
    basic_sweeper.sweep = sweep_or_preview


def basic_sweep_jobs(sweeper: Any, arguments: list[str]) -> list[list[str]]:
    """Every job's overrides, in order, as BasicSweeper.sweep computes its batches before it
    writes (hydra.sweeper.params, then the command line's)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    params = sweeper._parse_config()  # noqa: SLF001 - BasicSweeper.sweep's own first steps
    params.extend(arguments)
    parser = OverridesParser.create(config_loader=sweeper.hydra_context.config_loader)
    batches = sweeper.split_arguments(parser.parse_overrides(params), sweeper.max_batch_size)
    return [list(job) for batch in batches for job in batch]


def preview_jobs(
    jobs: list[Job], backend: Any, resume: bool, place: Callable[[Job, Any], None]
) -> tuple[list[dict], list[str]]:
    """Each job's row (or its one-line error), from what its launch would do; `place`:
    ddp_launcher/lifecycle.py's, which places a job on the backend."""
    from ddp_launcher.resume import check_job_dir, continue_in_dir, resume_decision

    rows, errors = [], []
    started: deque[tuple[Job, Any]] = deque()  # the jobs holding a slot, oldest first
    for job in jobs:
        place(job, backend)
        try:
            if job.error:
                raise UserError(job.error)
            what = None
            record = check_job_dir(job)
            if resume:
                decision, _, handle = resume_decision(
                    job, backend, record, read_result(job.job_dir)
                )
                if decision.action == "done":
                    what = f"skip ({decision.why})"
                elif decision.action == "attach":
                    what = f"wait for {backend.preview_attempt(handle)} (still running)"
                else:
                    continue_in_dir(job)
            if what is None:
                what = gate_row(job)
        except UserError as e:
            errors.append(f"job #{job.num} ({' '.join(job.overrides)}): {e}")
            continue
        resources = "-"
        if not what.startswith(("skip", "wait")):
            slot = backend.reserve(job)
            while slot is None and started:  # room once the oldest running job ends
                backend.release(*started.popleft())
                slot = backend.reserve(job)
            if slot is None:
                errors.append(f"job #{job.num}: can never start here ({job.nproc} ranks)")
                continue
            started.append((job, slot))
            resources = backend.preview_resources(job, slot)
        rows.append(
            {
                "#": str(job.num),
                "overrides": " ".join(swept_overrides(job)) or "(none)",
                "nodes x ranks": f"{job.nnodes} x {job.nproc}",
                "resources": resources,
                "run dir": str(job.job_dir),
                **({"resume": what} if resume else {}),
            }
        )
    return rows, errors


def swept_overrides(job: Job) -> list[str]:
    """The job's overrides of the sweep's keys (what tells it from the others), else all."""
    mine = [o for o in job.overrides if o.lstrip("+~").partition("=")[0] in job.swept]
    return mine or list(job.overrides)


def gate_row(job: Job) -> str:
    """What the job's start would do, by the app's gate (ddp_launcher/core/gate.py): start fresh,
    continue
    from where it stands (the gate's `progress` hook: the app's record of it), or nothing
    (completed); a UserError as is."""
    config, world = job.spec.config, job.nproc * job.nnodes
    try:
        if job.records:
            plan = check_start(config, job.job_dir, world, sweep=True, continues=job.continues)
        else:
            if (gate := gate_of(config)) is not None and gate.checks is not None:
                gate.checks(config, world, job.job_dir)
            return "start (its records: node 0's launcher)"
    except NothingToDo:
        return "skip (completed: nothing to do)"
    if plan.action == "continue":
        gate = gate_of(config)
        where = gate.progress(config, job.job_dir) if gate and gate.progress else None
        return f"continue from {where}" if where else "start fresh (nothing to continue from)"
    return "start fresh" + (
        f" (replaces the earlier run: {plan.replaces})" if plan.replaces else ""
    )


def print_table(title: str, rows: list[dict], notes: Sequence[str] = ()) -> None:
    """The rows as one aligned table, after a title line; notes below it."""
    lines = [title]
    if rows:
        keys = list(rows[0])
        widths = {k: max(len(k), *(len(r[k]) for r in rows)) for k in keys}
        lines.append("  ".join(k.ljust(widths[k]) for k in keys).rstrip())
        lines += ["  ".join(r[k].ljust(widths[k]) for k in keys).rstrip() for r in rows]
    lines += list(notes)
    print("\n".join(lines), flush=True)


def cores_text(cores: Sequence[int] | None) -> str:
    """0-3,8 for [0, 1, 2, 3, 8]; `all` for None (every core of the launcher)."""
    if cores is None:
        return "all"
    spans: list[list[int]] = []
    for core in sorted(cores):
        if spans and core == spans[-1][1] + 1:
            spans[-1][1] = core
        else:
            spans.append([core, core])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in spans)


__all__ = ["prepare_dry_run", "preview_jobs", "print_table"]
