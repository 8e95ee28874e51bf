"""Rank 0's record of a run: metrics.jsonl, result.json and the W&B run, however the run ends.

Every other rank gets a RunLogger that writes nothing, so train.py calls it unconditionally.
W&B problems never stop training: init has a timeout, and a failure is a warning.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from ddp_launcher import (
    CHECKPOINT_DIR,
    METRICS_FILE,
    REPRO_DIR,
    DiskFull,
    Pruned,
    RunResult,
    crash_point,
    describe,
    job_identity,
    on_full_disk,
    read_metrics,
    read_result,
    resolve_wandb_mode,
    wandb_settings,
    write_atomic,
    write_repro,
    write_result,
)
from omegaconf import DictConfig, OmegaConf

from components.console import end_line
from components.manifest import BEST, committed_best
from components.preemption import Preempted
from components.wandb_media import CheckpointArtifacts, save_files

log = logging.getLogger(__name__)


def run_facts(
    world_size: int,
    per_rank_batch: int,
    device: torch.device,
    precision: str,
    math: dict[str, str | None] | None = None,
) -> dict[str, Any]:
    """Derived facts stored beside the config so every W&B run says how it was run (rank 0's
    RunLogger.open adds git_commit and git_dirty); `precision`: trainer.precision as resolved
    (components/precision.py), also result.json's; `math`: what its convolutions and matmuls
    run in (conv_math, matmul_math: e.g. tf32 with precision 32; set_fp32_math)."""
    return {
        "world_size": world_size,
        "per_rank_batch_size": per_rank_batch,
        "device_type": device.type,
        "precision": str(precision),
        **(math or {}),
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "gpu_name": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "hostname": platform.node(),
    }


def holds_run(run_dir: Path) -> bool:
    """Whether `run_dir` holds an earlier attempt's records: a result, a row, a checkpoint."""
    ckpt = run_dir / CHECKPOINT_DIR
    return (
        read_result(run_dir) is not None
        or bool(read_metrics(run_dir / METRICS_FILE))
        or (ckpt.is_dir() and any(ckpt.glob("*.pt")))
    )


def init_wandb(
    w: Any,
    *,
    run_dir: Path,
    config: dict[str, Any],
    group: str | None,
    name: str | None,
    job_type: str | None = None,
    run_id: str | None = None,
    resume: str | None = None,
    job: str = "training",
    agent: bool = False,
):
    """A W&B run as the `wandb` config `w` asks (mode, project, entity, tags, init timeout),
    or None: disabled, or a W&B failure, which is a warning and never stops the job. With a
    `run_id` the run continues (resume="allow" unless `resume` says otherwise). Under
    `wandb agent` (`agent`), the run, its project and entity are the agent's (W&B reads them
    from the environment: WANDB_RUN_ID, WANDB_PROJECT, ...; it would ignore ours)."""
    mode = resolve_wandb_mode(w.mode)
    if mode == "disabled":
        return None
    try:
        import wandb

        run = wandb.init(
            project=None if agent else w.project,
            entity=None if agent else w.entity,
            group=group,
            name=name,
            job_type=job_type or w.job_type,
            tags=list(w.tags),
            config=config,
            dir=str(run_dir),
            mode=mode,
            id=run_id,
            resume=resume or ("allow" if run_id else None),
            # (W&B's service the launcher started early: ddp_launcher.wandb_settings)
            settings=wandb_settings(wandb, mode, w.init_timeout_s),
        )
        log.info("W&B run %s (%s mode) in %s", run.id, mode, run.dir)
        return run
    except Exception as e:  # noqa: BLE001 - any W&B failure must leave the job running
        log.warning("W&B init failed, %s goes on without it: %s", job, describe(e)[:200])
        log.debug("W&B init failed", exc_info=True)
        return None


def task_overrides() -> list[str] | None:
    """The run's Hydra overrides (None outside a Hydra job)."""
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else None


def earlier_wandb_run_id(run_dir: Path) -> str | None:
    """The W&B run an earlier attempt in `run_dir` started (its result.json, else the newest
    run folder W&B left in <run dir>/wandb/: `run-<time>-<id>`, `offline-run-<time>-<id>`)."""
    result = read_result(run_dir)
    if result is not None and result.wandb_run_id:
        return result.wandb_run_id
    folders = sorted(Path(run_dir, "wandb").glob("*run-*-*"), key=lambda p: p.name.split("run-")[1])
    return folders[-1].name.rsplit("-", 1)[1] if folders else None


def row_kind(row: dict[str, Any]) -> str:
    """Rows are keyed by (step, kind): a train window, an epoch's validation and the final test
    of the best checkpoint may share a step."""
    return "val" if "val/acc" in row else "test" if "test/acc" in row else "train"


def rows_to_replay(rows: list[dict[str, Any]], wandb_start: int) -> list[dict[str, Any]]:
    """The rows of an earlier attempt W&B has not got: those at or after the step its history
    ends at (`starting_step`; 0 offline, where W&B cannot say and `wandb sync` keeps the first
    copy of a step)."""
    return [row for row in rows if row["step"] >= wandb_start]


def app_record() -> dict[str, Any]:
    """result.json's `app` part, this experiment's own record of a run (the launcher's part
    around it, ddp_launcher's RunResult, has the status, the value and its metric, direction
    and epoch, the target, the summary, times, attempts, commit, W&B run): every key, null
    (or empty) until measured."""
    return {
        "best_checkpoint": None,  # best.pt, relative to the run dir (None: no checkpoints)
        "final": {},  # the last epoch's val/* metrics, with its epoch
        "test": {},  # test/* of the best checkpoint
        "epochs": None,  # epochs completed
        "stopped_early": None,  # true: trainer.early_stopping ended the run
        "stopped_at_target": None,  # true: trainer.stop_at_target ended the run
        "params": None,  # the model's parameters (trainable ones)
        "flops_per_sample": None,  # forward FLOPs of one sample (torch flop counter)
        "precision": None,  # trainer.precision as trained (auto resolved: 32 or bf16)
        # val/acc's best and the last epoch's val/acc and val/loss, whatever the monitor is
        "best_val_acc": None,
        "final_val_acc": None,
        "final_val_loss": None,
        "samples_per_s": None,  # mean of this attempt's logged train windows
        "time_to_first_step_s": None,  # from process start
        "peak_memory_mb_per_rank": None,
        # The train loss rose above 1.5x its first window's after the warm-up (where, how much,
        # what to try: components/divergence.py); None: it did not.
        "diverged": None,
    }


def ending(error: BaseException | None) -> tuple[str, str | None]:
    """(status, one-line error) of a run that ended with `error` (None: it completed)."""
    if error is None:
        return "completed", None
    if isinstance(error, Preempted):
        return "preempted", str(error)
    if isinstance(error, Pruned):  # the sweeper's pruner stopped it (ddp_launcher/ranks/pruning.py)
        return "pruned", str(error)
    if isinstance(error, KeyboardInterrupt):
        return "interrupted", "interrupted (Ctrl-C)"
    return "failed", describe(error)


class RunLogger:
    """Rank 0's metrics.jsonl, result.json and W&B run; a context manager around the whole run
    that writes result.json and closes the W&B run however the run ends (completed, failed,
    preempted, interrupted).

    On resume, rows the earlier attempt already logged (same step, same kind) are not logged
    again: a resumed run recomputes them identically, so metrics.jsonl and the W&B history keep
    every step exactly once; rows W&B lost in a kill are replayed from metrics.jsonl.

    result.json (RunResult: the launcher's part, and `app`, this experiment's, app_record) is
    this object's alone: the training loop reports events (a train row logged,
    `epoch_validated`, `checkpoint_saved`, `target_reached`, `stopped_early`, `trained`,
    `tested`) and the fields follow from them. The value (the monitored metric's best: what
    train.py returns), its epoch, val/acc's best and the target's record are read from the
    Monitor given to `open` (the one place that keeps them), when result.json is written.
    """

    def __init__(self, run_dir: Path, *, enabled: bool):
        self.enabled = enabled
        self.run_dir = run_dir
        self.metrics_path = run_dir / METRICS_FILE
        self.result = RunResult(app=app_record())
        self.wandb = None
        self.logged: set[tuple[int, str]] = set()
        self.artifacts: CheckpointArtifacts | None = None  # with a W&B run
        self._last_val: dict[str, Any] | None = None  # the latest val row (artifact metadata)
        self._warned: set[str] = set()
        self._file = None
        self._started = self.result.started = time.time()
        self._monitor: Any = None  # components.monitor.Monitor: the run's bests
        self._rates: list[float] = []  # samples_per_s of this attempt's train rows
        self.opened = False  # the run began: open() ran
        self._wandb_start = 0  # the W&B run's history ends here: rows before it are there

    def __enter__(self) -> RunLogger:
        return self

    def __exit__(self, _kind, error, _tb) -> bool:
        if not self.opened and holds_run(self.run_dir):
            return False  # failed before it began: the earlier attempt's records stay as they were
        self.result.status, self.result.error = ending(error)
        self._read_bests()
        self.result.ended = time.time()
        self.result.wall_time_s = round(self.result.ended - self._started, 3)
        if self.enabled:
            if self._file is not None:
                self._file.close()
            try:
                with on_full_disk(self.run_dir, "result.json"):
                    write_result(self.run_dir, self.result)
            except DiskFull:
                if error is None:
                    raise
                # (the run's own error goes on: the disk's, most likely; the earlier
                # result.json, if any, stays whole)
            crash_point("result.written")
            if self.artifacts is not None:  # wandb.log_checkpoints=last: the newest, now
                self._guarded("checkpoint artifact", self.artifacts.ended, self.wandb)
            where = self.wandb_where()
            self._finish_wandb(self.result.status)
            # The run's last line (a failure's own error was reported just before, once).
            logging.getLogger("train").info("%s", end_line(self.result, self.run_dir, where))
        return False  # the error goes on to whoever reports it

    def wandb_where(self) -> str | None:
        """Where the W&B run is: its URL online, else the command that uploads it."""
        if self.wandb is None:
            return None
        if not self.wandb.settings._offline:
            return f"W&B {self.wandb.url}"
        return f"wandb sync {Path(self.wandb.dir).parent}"

    def save_profile(self, paths: list[Path]) -> None:
        """components/profiling.py's files, as a W&B artifact of type `profile` (rank 0)."""
        if self.wandb is None:
            return

        def log_artifact() -> None:
            import wandb

            artifact = wandb.Artifact(f"profile-{self.wandb.id}", type="profile")
            for path in paths:
                artifact.add_file(str(path))
            self.wandb.log_artifact(artifact)

        self._guarded("profile artifact", log_artifact)

    def _read_bests(self) -> None:
        """result.json's bests: the value and its epoch as the last commit of the checkpoints
        has them (what best.pt holds, even after a save that failed or was cut short), else (no
        checkpoints) as the monitor keeps them; val/acc's best and the target from the monitor."""
        m = self._monitor
        if m is None:
            return
        r, app = self.result, self.result.app
        r.value, r.value_epoch, app["best_val_acc"] = m.best, m.best_epoch, m.best_val_acc
        r.target = m.target_record()
        committed = committed_best(self.run_dir)
        app["best_checkpoint"] = f"{CHECKPOINT_DIR}/{BEST}" if committed is not None else None
        if committed is not None:
            r.value, r.value_epoch = committed.best, committed.best_epoch

    def epoch_validated(
        self,
        epoch: int,
        step: int,
        val: dict[str, Any],
        media: Callable[[], dict] | None = None,
    ) -> None:
        """Event: epoch `epoch` (1-based) was validated at optimizer step `step`: its val row
        (metrics.jsonl, W&B with `media`) and result.json's final metrics."""
        self.log({"step": step, "epoch": epoch, **val}, media=media)
        app = self.result.app
        app["epochs"], app["final"] = epoch, {"epoch": epoch, **val}
        app["final_val_acc"], app["final_val_loss"] = val.get("val/acc"), val.get("val/loss")

    def diverged(self, found: dict[str, Any]) -> None:
        """Event: the train loss climbed after the warm-up (components/divergence.py):
        result.json's `diverged`, and the W&B run's summary (train/diverged_step, ...)."""
        self.result.app["diverged"] = found
        if self.wandb is not None:
            summary = {f"train/diverged_{k.replace('/', '_')}": v for k, v in found.items()}
            self._guarded("divergence summary", self.wandb.summary.update, summary)

    def stopped_early(self) -> None:
        """Event: early stopping ended the run (trainer.early_stopping)."""
        self.result.app["stopped_early"] = True

    def target_reached(self) -> None:
        """Event: the monitored metric reached trainer.target (the Monitor given to `open` has
        when): result.json's `target` and the W&B run's summary (target/reached_at_s, ...)."""
        record = self._monitor.target_record()
        self.result.target = record
        if self.wandb is not None:
            summary = {f"target/{k}": v for k, v in record.items() if k not in ("metric", "mode")}
            self._guarded("target summary", self.wandb.summary.update, summary)

    def stopped_at_target(self) -> None:
        """Event: trainer.stop_at_target ended the run at the target."""
        self.result.app["stopped_at_target"] = True

    def trained(self, time_to_first_step_s: float | None, peak_memory_mb: list[float]) -> None:
        """Event: the training loop is over (every epoch, or stopped early)."""
        self.result.app["time_to_first_step_s"] = time_to_first_step_s
        self.result.app["peak_memory_mb_per_rank"] = peak_memory_mb

    def tested(self, step: int, epoch: int, test: dict[str, float]) -> None:
        """Event: best.pt was evaluated on the test split (`test`: test/* metrics; {}: none):
        the app's record, and the report's columns (result.json's summary)."""
        self.result.app["test"], self.result.summary = test, dict(test)
        if test:
            best_epoch = self._monitor.best_epoch if self._monitor is not None else None
            self.log({"step": step, "epoch": epoch, "best_epoch": best_epoch, **test})

    def open(
        self,
        cfg: DictConfig,
        facts: dict[str, Any],
        *,
        resuming: bool,
        wandb_run_id: str | None,
        model: torch.nn.Module | None = None,
        monitor: Any = None,
        epochs_done: int = 0,
        steps_done: int | None = None,
    ) -> str | None:
        """Write repro/ (ddp_launcher/core/repro.py), start metrics.jsonl and the W&B run
        (continuing
        `wandb_run_id`; with the repro files, and wandb.watch on `model` if asked); returns the
        W&B id. `facts` with `params`, `flops_per_sample` and `precision` go to result.json
        too; `monitor` (components.monitor.Monitor) keeps the bests result.json reports;
        `epochs_done`: the epochs a resumed checkpoint had completed; `steps_done`: its
        optimizer steps (0: a fresh start; None: every row kept), the last step of
        metrics.jsonl kept: rows after it belong to an attempt this run does not continue
        (killed before a checkpoint, or past the checkpoint a resume fell back to), so one
        trajectory is in the file, each step once."""
        self.opened = True
        self._monitor = monitor
        r, app = self.result, self.result.app
        app["params"], app["flops_per_sample"] = facts.get("params"), facts.get("flops_per_sample")
        app["precision"] = facts.get("precision")
        if monitor is not None:
            r.metric, r.direction = monitor.metric, monitor.mode
            if resuming and epochs_done:  # what the earlier attempts reached
                app["epochs"] = epochs_done
        if not self.enabled:
            return None
        repro = write_repro(self.run_dir, task_overrides())
        self.result.git_commit, self.result.git_dirty = repro.state.commit, repro.state.dirty
        facts = {**facts, "git_commit": repro.state.commit, "git_dirty": repro.state.dirty}
        earlier = self._rows_already_logged(steps_done)
        self.logged = {(row["step"], row_kind(row)) for row in earlier}
        # Unbuffered: a killed run keeps every row it logged; a row is one write, cut back
        # whole when the disk fills (_append).
        self._file = open(self.metrics_path, "ab", buffering=0)  # noqa: SIM115 - closed in __exit__
        # One W&B run per run dir: a start that continues it (resume=auto without a
        # checkpoint yet, a retry) continues its W&B run too.
        self._init_wandb(cfg, facts, wandb_run_id or earlier_wandb_run_id(self.run_dir))
        if self.wandb is not None:
            self._wandb_extras(cfg, repro.files, model)
        if self.wandb is not None and not self.wandb.settings._offline:
            self._wandb_start = self.wandb.starting_step
        if earlier and self.wandb is not None:
            self._replay_into_wandb(earlier)
        self.result.wandb_run_id = self.wandb_run_id
        return self.wandb_run_id

    def _rows_already_logged(self, steps_done: int | None) -> list[dict[str, Any]]:
        """The whole rows of metrics.jsonl up to step `steps_done`; the file keeps only those
        (a line torn by a kill, and rows of an abandoned trajectory, are dropped)."""
        if not self.metrics_path.exists():
            return []
        rows = read_metrics(self.metrics_path)
        done = float("inf") if steps_done is None else steps_done
        dropped = [row for row in rows if row.get("step", 0) > done]
        if dropped:
            log.warning(
                "metrics.jsonl: dropped %d row(s) after step %d, logged by an attempt this run "
                "does not continue; it logs those steps again",
                len(dropped),
                steps_done,
            )
            rows = [row for row in rows if row.get("step", 0) <= done]
        data = "".join(json.dumps(row) + "\n" for row in rows).encode()
        with on_full_disk(self.run_dir, METRICS_FILE, len(data)):  # (the old file stays)
            write_atomic(self.metrics_path, data)
        return rows

    def _append(self, data: bytes) -> None:
        """One row at the end of metrics.jsonl; when the disk fills partway, the file is cut
        back to its last whole row and the run stops in one line (DiskFull)."""
        end = self._file.tell()
        try:
            written = 0
            while written < len(data):
                written += self._file.write(data[written:]) or 0
        except OSError:
            self._file.truncate(end)
            self._file.seek(end)
            with on_full_disk(self.run_dir, f"a row of {METRICS_FILE}", len(data)):
                raise

    def _replay_into_wandb(self, rows: list[dict[str, Any]]) -> None:
        start = self._wandb_start
        missing = rows_to_replay(rows, start)
        for row in missing:
            self.wandb.log(row, step=row["step"])
        log.info("W&B: replayed %d row(s) from metrics.jsonl (steps >= %d)", len(missing), start)

    @property
    def wandb_run_id(self) -> str | None:
        return self.wandb.id if self.wandb is not None else None

    def _init_wandb(self, cfg: DictConfig, facts: dict[str, Any], run_id: str | None) -> None:
        if resolve_wandb_mode(cfg.wandb.mode) == "disabled":
            return
        w = cfg.wandb
        config = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
        config["run"] = facts
        who = job_identity(w.group, w.name)  # a sweep's group, the job's swept values
        if who.swept:  # the swept values as they are, for parallel-coordinates panels
            config["swept"] = who.swept
        agent = who.agent
        if agent and run_id and run_id != os.environ["WANDB_RUN_ID"]:
            log.info(
                "W&B: the agent's run %s records this run (the checkpoint's was %s)",
                os.environ["WANDB_RUN_ID"],
                run_id,
            )
        self.wandb = init_wandb(
            w,
            run_dir=self.run_dir,
            config=config,
            group=who.group,
            name=who.name,
            run_id=None if agent else run_id,
            agent=agent,
        )
        if self.wandb is not None:
            # Val metrics are plotted per epoch; the summary of val/acc and of the monitored
            # metric is its best value.
            self.wandb.define_metric("epoch")
            for prefix in ("val/*", "val_ema/*"):
                self.wandb.define_metric(prefix, step_metric="epoch")
            self.wandb.define_metric("val/acc", step_metric="epoch", summary="max")
            monitor = cfg.trainer.monitor
            self.wandb.define_metric(monitor.metric, step_metric="epoch", summary=monitor.mode)

    def _wandb_extras(
        self, cfg: DictConfig, repro_files: list[Path], model: torch.nn.Module | None
    ) -> None:
        """repro/ as files of the W&B run, the checkpoint artifacts' policy, wandb.watch."""
        w = cfg.wandb
        self.artifacts = CheckpointArtifacts(w.log_checkpoints)
        self._guarded("repro files", save_files, self.wandb, repro_files, REPRO_DIR)
        watch = str(getattr(w.watch, "value", w.watch))
        if watch != "off" and model is not None:
            # W&B counts backward passes: one per micro-batch.
            every = cfg.trainer.log_every_n_steps * cfg.trainer.accumulate_grad_batches
            self._guarded("watch", self.wandb.watch, model, log=watch, log_freq=every)

    def _guarded(self, what: str, call, *args, **kwargs) -> None:
        """`call(*args, **kwargs)`; a failure is a warning (once per `what`): W&B media,
        files and artifacts never stop training, nor turn W&B off for the scalars."""
        try:
            call(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - any W&B failure must leave the run going
            level = logging.DEBUG if what in self._warned else logging.WARNING
            self._warned.add(what)
            log.log(level, "W&B %s failed, training goes on: %s", what, describe(e)[:200])
            log.debug("W&B %s failed", what, exc_info=True)

    def checkpoint_saved(self, path: Path, progress: dict[str, Any], is_best: bool) -> None:
        """Checkpointer's `on_save` (rank 0): the checkpoint as a W&B artifact when
        wandb.log_checkpoints asks, with its progress and its epoch's val metrics."""
        if self.wandb is None or self.artifacts is None:
            return
        meta = {k: v for k, v in progress.items() if not k.startswith("wandb_")}
        meta.update(file=path.name, monitor=self.result.metric)
        if self._monitor is not None:
            meta.update(best=self._monitor.best, best_val_acc=self._monitor.best_val_acc)
        val = self._last_val
        if val is not None and val["step"] == progress.get("step"):
            meta.update({k: v for k, v in val.items() if k.startswith("val/")})
        self._guarded("checkpoint artifact", self.artifacts.saved, self.wandb, path, meta, is_best)

    @property
    def wandb_group_name(self) -> tuple[str | None, str | None]:
        """The W&B run's group and name, as W&B has them (None without a run)."""
        if self.wandb is None:
            return None, None
        return self.wandb.group or None, self.wandb.name or None

    def log(self, row: dict[str, Any], media: Callable[[], dict] | None = None) -> None:
        """One row of metrics.jsonl (and W&B), stamped with the time (unix) and the seconds
        since this attempt started. `media`: builds W&B-only objects (tables, plots) for the
        same step, called only when W&B logs the row."""
        if self.enabled and row_kind(row) == "val":
            self._last_val = row
        if self.enabled and row_kind(row) == "train" and row.get("samples_per_s") is not None:
            self._rates.append(row["samples_per_s"])  # result.json: their mean
            self.result.app["samples_per_s"] = sum(self._rates) / len(self._rates)
        if not self.enabled or (row["step"], row_kind(row)) in self.logged:
            return
        now = time.time()
        row = {**row, "time": round(now, 3), "elapsed_s": round(now - self._started, 3)}
        self._append((json.dumps(row) + "\n").encode())
        crash_point("metrics.row")
        if self.wandb is not None and row["step"] >= self._wandb_start:
            try:
                self.wandb.log(row, step=row["step"])
            except Exception as e:  # noqa: BLE001 - W&B failing never fails the run
                log.warning("W&B log failed, training goes on without it: %s", describe(e)[:200])
                self.wandb = None
        if media is not None and self.wandb is not None:  # merged into the row's step
            self._guarded("media", lambda: self.wandb.log(media(), step=row["step"]))

    def _finish_wandb(self, status: str) -> None:
        """W&B shows failed runs as failed and preempted ones as preempted."""
        if self.wandb is None:
            return
        try:
            if status == "preempted":
                self.wandb.mark_preempting()
            if status == "pruned":  # W&B has no pruned state: a finished run, tagged
                self.wandb.tags = (*self.wandb.tags, "pruned")
                self.wandb.summary["status"] = "pruned"
            exit_code = {"completed": 0, "pruned": 0, "preempted": 75}.get(status, 1)
            self.wandb.finish(exit_code=exit_code)
        except Exception as e:  # noqa: BLE001
            log.warning("W&B finish failed: %s", e)
