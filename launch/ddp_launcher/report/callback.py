"""The Hydra callback: the sweep's report (sweep.py's report_sweep) when a multirun ends.

A multirun whose sweeper raises never reaches `on_multirun_end` (Hydra's basic sweeper raises on
the first failed job). Its report is written by the process that ran its jobs, through the same
report_sweep: this project's launchers when a batch had a failed job or was stopped
(:func:`report_unfinished`, from ddp_launcher/lifecycle.py), Hydra's basic launcher (jobs in this
process) from `on_job_end` once a job has failed.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import OmegaConf

from ddp_launcher.core.host import require_extra
from ddp_launcher.jobs import launcher_errors
from ddp_launcher.report.jobs import BEST
from ddp_launcher.report.seeds import DEFAULT_OVER
from ddp_launcher.report.sweep import report_sweep

log = logging.getLogger(__name__)


class SweepSummaryCallback(Callback):
    """`hydra.callbacks.sweep_summary: {_target_:
    ddp_launcher.report.callback.SweepSummaryCallback}`: the sweep's report ranked by `metric`
    (`best`: each job's value, what its task returned, in its direction; or a number of the jobs
    by name) in `mode` (None: the jobs' direction), jobs aggregated over the `aggregate` keys
    (seeds), summary.png's panels the `panels` metrics of the jobs' metrics.jsonl (None: the
    monitored one and the losses), with its W&B run unless `wandb` is false."""

    def __init__(
        self,
        metric: str = BEST,
        mode: str | None = None,
        wandb: bool = True,
        aggregate: Sequence[str] = DEFAULT_OVER,
        panels: Sequence[str] | None = None,
    ) -> None:
        with launcher_errors():  # Hydra makes the callbacks before the multirun starts
            require_extra("report", "hydra.callbacks' SweepSummaryCallback (the sweep report)")
        self.settings = dict(
            metric=metric,
            mode=mode,
            wandb=wandb,
            aggregate=list(aggregate or []),
            panels=None if panels is None else [str(p) for p in panels],
        )
        self._pid: int | None = None  # the process that runs the multirun
        self._failed = False

    def report(self, config: Any, when: str = "") -> None:
        try:  # resolving here fills the `${now:}` cache of this config, which the sweeper shares
            sweep_dir = Path(os.path.abspath(str(config.hydra.sweep.dir)))
        except Exception as e:  # noqa: BLE001 - a report problem must not fail the sweep
            log.warning("sweep summary: no sweep dir (%s: %s)", type(e).__name__, e)
            return
        report_sweep(sweep_dir, config, when=when, **self.settings)

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        from ddp_launcher.core.wandb_service import wandb_wanted

        if self.settings["wandb"] and wandb_wanted(config):
            with launcher_errors():
                require_extra("wandb", "the sweep report's W&B run (the config's wandb.mode)")
        self._pid, self._failed = os.getpid(), False

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        self.report(config)

    def on_job_end(self, config: Any, job_return: Any, **kwargs: Any) -> None:
        """A job that ran in the multirun's own process (Hydra's basic launcher): once one has
        failed, the sweeper will raise after its batch, so the report is written after each
        job from then on (the last one has them all). Jobs run elsewhere (ranks) say nothing."""
        if os.getpid() != self._pid:
            return
        self._failed = self._failed or job_return.status.name == "FAILED"
        if self._failed:
            self.report(config, " (the multirun did not finish)")


def configured(config: Any) -> list[SweepSummaryCallback]:
    """The SweepSummaryCallbacks a sweep's config sets in hydra.callbacks (its multirun.yaml's
    too), built as Hydra builds them."""
    from hydra.utils import instantiate

    targets = (  # the public name, and the module's (configs written before it was public)
        "ddp_launcher.SweepSummaryCallback",
        f"{SweepSummaryCallback.__module__}.{SweepSummaryCallback.__qualname__}",
    )
    callbacks = OmegaConf.select(config, "hydra.callbacks", default=None) or {}
    return [
        instantiate(node)
        for node in callbacks.values()
        if OmegaConf.select(node, "_target_", default=None) in targets
    ]


def report_unfinished(config: Any, when: str) -> None:
    """The report of a multirun that may not reach `on_multirun_end`, by the launcher that ran
    its jobs, with the sweep's own SweepSummaryCallback settings (none configured: no report)."""
    for callback in configured(config):
        callback.report(config, when)
