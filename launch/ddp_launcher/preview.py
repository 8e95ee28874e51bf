"""`hydra.launcher.dry_run=true` (docs/sweeps.md, "Preview a sweep"): every job of a sweep
composed and checked as the launcher checks it before it starts, one row each, none started.

Hydra's sweepers write the sweep dir before their launcher sees a job (BasicSweeper makes it and
writes multirun.yaml; ours opens its study there), so a dry run takes Hydra's multirun over
(:func:`install`: whether the command line or a config file asks for one): the same config, sweeper
and launcher, asked for the jobs instead of told to run them. A row comes from the code the real
launch runs: the backend places the job (its world size, its launcher checks), the resume decision
of ddp_launcher/resume.py, the app's gate (ddp_launcher/core/gate.py's check_start: conf/checks.py's
checks, the run dir's plan), the backend's own resources (torchrun's GPUs and CPU slice from its
packing; SLURM's sbatch options from submitit's batch script). Nothing is written, no process
started, torch not imported; a job that would fail its checks is one line naming it, exit 2.
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
from ddp_launcher.jobs import Job, launcher_errors

log = logging.getLogger(__name__)


class _AsMultirun(Exception):  # noqa: N818 - a signal between two wrappers, never seen
    """A run's config asks for a dry run: preview it as a multirun instead."""


class _Previewed(Exception):  # noqa: N818 - a signal between two wrappers, never seen
    """The multirun was previewed: nothing more to do."""


def install() -> None:
    """Hydra's run and multirun, for this process: a config that says
    hydra.launcher.dry_run=true, from the command line or from any config file, previews its
    sweep (:func:`preview_multirun`) right after Hydra composed it, before any callback or
    sweeper; a plain run asking for one is previewed as the multirun it would be (a dry run
    never runs a job). Any other config runs as before, composed once. Hydra has no hook between
    composing a config and its first write: the methods are wrapped, once; for the one call,
    the instance's compose_config hands the composed config to the preview. The launchers'
    module installs it on import (Hydra's plugin scan imports it before it composes), so any
    Hydra app with these launchers gets it."""
    from hydra._internal.hydra import Hydra

    if getattr(Hydra.multirun, "previews", False):
        return
    multirun, run = Hydra.multirun, Hydra.run

    def composing(self: Any, then: Callable[[Any], None]) -> Callable[..., Any]:
        """This Hydra's compose_config, calling `then(cfg)` on a config asking for a dry run."""
        compose = self.compose_config

        def compose_config(*args: Any, **kwargs: Any) -> Any:
            cfg = compose(*args, **kwargs)
            if OmegaConf.select(cfg, "hydra.launcher.dry_run", default=False):
                then(cfg)
            return cfg

        return compose_config

    @functools.wraps(multirun)
    def multirun_or_preview(
        self: Any,
        config_name: Any,
        task_function: Any,
        overrides: Any,
        with_log_configuration: bool = True,
        **more: Any,  # Hydra 1.4's parsed_overrides, passed on as they came
    ) -> Any:
        def preview(cfg: Any) -> None:
            preview_multirun(cfg, self.config_loader, task_function)
            raise _Previewed

        self.compose_config = composing(self, preview)
        try:
            return multirun(
                self, config_name, task_function, overrides, with_log_configuration, **more
            )
        except _Previewed:
            return None
        finally:
            del self.compose_config  # (the instance's: the class's method again)

    @functools.wraps(run)
    def run_or_preview(
        self: Any,
        config_name: Any,
        task_function: Any,
        overrides: Any,
        with_log_configuration: bool = True,
        **more: Any,
    ) -> Any:
        def as_multirun(_cfg: Any) -> None:
            raise _AsMultirun

        self.compose_config = composing(self, as_multirun)
        try:
            return run(self, config_name, task_function, overrides, with_log_configuration, **more)
        except _AsMultirun:
            pass
        finally:
            del self.compose_config
        return multirun_or_preview(
            self, config_name, task_function, overrides, with_log_configuration, **more
        )

    multirun_or_preview.previews = True  # type: ignore[attr-defined]
    Hydra.multirun = multirun_or_preview  # type: ignore[method-assign]
    Hydra.run = run_or_preview  # type: ignore[method-assign]


def preview_multirun(cfg: Any, config_loader: Any, task_function: Any) -> None:
    """Hydra's multirun up to the sweep, read-only: the gate's sweep checks
    (ddp_launcher/core/gate.py's
    check_sweep, as on_multirun_start runs them), the sweeper and its launcher set up, then the
    sweeper's jobs previewed instead of launched. No callback runs: nothing is written."""
    from hydra._internal.callbacks import Callbacks
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.plugins import Plugins
    from hydra.core.utils import setup_globals

    from ddp_launcher.core.gate import check_sweep
    from ddp_launcher.core.hydra_compat import hydra_context

    setup_globals()
    with launcher_errors():
        check_sweep(cfg)
        sweeper = Plugins.instance().instantiate_sweeper(
            config=cfg,
            hydra_context=hydra_context(config_loader=config_loader, callbacks=Callbacks(cfg)),
            task_function=task_function,
        )
        arguments = [str(o) for o in OmegaConf.to_container(cfg.hydra.overrides.task)]
        if hasattr(sweeper, "preview"):  # the project's Optuna sweeper (ddp_launcher/sweeper/)
            sweeper.preview(arguments)
        elif isinstance(sweeper, BasicSweeper):
            sweeper.launcher.preview(basic_sweep_jobs(sweeper, arguments), 0)
        else:
            raise UserError(
                f"hydra.launcher.dry_run=true previews the basic and optuna sweepers, not "
                f"{type(sweeper).__name__}: drop hydra.launcher.dry_run"
            )


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


__all__ = ["install", "preview_jobs", "print_table"]
