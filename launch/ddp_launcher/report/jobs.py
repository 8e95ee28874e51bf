"""Reading a sweep dir: one JobSummary per job dir (result.json, metrics.jsonl, eval.json,
launch.json, Hydra's overrides), the sweep's swept keys, and the jobs ranked best first."""

from __future__ import annotations

import json
import logging
import math
import os
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ddp_launcher.core.naming import override_values, swept_keys
from ddp_launcher.core.run_dir import (
    EVAL_FILE,
    METRICS_FILE,
    OVERRIDES_FILE,
    RESULT_FILE,
    RunResult,
    read_launch_record,
    read_metrics,
)

log = logging.getLogger(__name__)

CSV_NAME = "summary.csv"
MD_NAME = "summary.md"
PNG_NAME = "summary.png"
MULTIRUN_YAML = "multirun.yaml"
JOB_TYPE = "sweep_summary"  # the W&B summary run's job_type

# What a sweep can be ranked by: `best` is each job's monitored metric (result.json).
METRICS = (
    "best",
    "best_val_acc",
    "final_val_acc",
    "final_val_loss",
    "wall_time_s",
    "samples_per_s",
)
MODES = ("max", "min")
PANELS = ("val/acc", "val/loss", "train/loss")  # summary.png, left to right


@dataclass
class JobSummary:
    """One job of a sweep. Numbers are None when neither result.json nor metrics.jsonl has them."""

    job: str
    overrides: str = ""
    status: str = "failed"
    error: str | None = None
    monitor: str = "val/acc"
    mode: str = "max"
    best: float | None = None
    best_epoch: int | None = None
    final: dict[str, float] = field(default_factory=dict)  # the last epoch's val/* metrics
    test: dict[str, float] = field(default_factory=dict)
    best_val_acc: float | None = None
    final_val_acc: float | None = None
    final_val_loss: float | None = None
    wall_time_s: float | None = None
    samples_per_s: float | None = None
    # trainer.target (result.json's `target`): its value and metric, and when the job first
    # reached it (None: no target, or not reached)
    target: dict[str, Any] | None = None
    wandb_run_id: str | None = None
    attempts: int | None = None  # launch.json's: a launcher's retries and resumed sweeps
    # the commit(s) it ran: its attempts' in launch.json (a→b when a resume changed it), else
    # result.json's git_commit; 8 hex digits, `+` when the tree was dirty (None: not known)
    commits: list[str] = field(default_factory=list)
    # An eval.py job (eval.json, no result.json): its split and what it measured there.
    split: str | None = None
    eval: dict[str, float] = field(default_factory=dict)  # acc, acc5, loss, ece
    swept: dict[str, Any] = field(default_factory=dict)  # {swept key: value}, set by read_sweep
    # per epoch: {"epoch": e, "val/acc": ..., "val/loss": ...}; train: (epochs done, train/loss)
    val_curve: list[dict[str, float]] = field(default_factory=list)
    train_curve: list[tuple[float, float]] = field(default_factory=list)

    def reached(self, key: str) -> float | None:
        """trainer.target's reached_at_s or reached_at_step (None: not reached, no target)."""
        return _number((self.target or {}).get(key))


@dataclass
class SweepSummary:
    """What sweep.py's write_summary wrote (its files are in `sweep_dir`): the rows best first."""

    sweep_dir: Path
    rows: list[JobSummary]
    metric: str = "best"
    mode: str = "max"
    swept_keys: list[str] = field(default_factory=list)
    monitor: str = "val/acc"
    groups: list[Any] = field(default_factory=list)  # seeds.py's, best mean first; [] when none
    # (job dir, what is wrong) of each job dir whose records could not be read: not in `rows`
    unreadable: list[tuple[Path, str]] = field(default_factory=list)
    not_written: str | None = None  # why the files could not be written (None: they were)

    @property
    def ranked_by(self) -> str:
        return f"best {self.monitor}" if self.metric == "best" else self.metric


class UnreadableRecord(ValueError):
    """A job's result.json or eval.json that is not what its writer writes: the message names
    the file and what is wrong with it."""


# The keys of result.json (ddp_launcher/core/run_dir.py's RunResult) and eval.json (EvalReport) the
# report reads, and what each holds when not null: checked once, where the file is read, so that
# everything after may trust them.
NUMBER = (int, float)
RESULT_KEYS: dict[str, Any] = {
    "status": str,
    "error": str,
    "monitor": str,
    "mode": str,
    "best": NUMBER,
    "best_epoch": NUMBER,
    "final": dict,
    "test": dict,
    "target": dict,
    "wandb_run_id": str,
    "overrides": list,
    "best_val_acc": NUMBER,
    "final_val_acc": NUMBER,
    "final_val_loss": NUMBER,
    "wall_time_s": NUMBER,
    "samples_per_s": NUMBER,
}
EVAL_KEYS: dict[str, Any] = {
    "split": str,
    "status": str,
    "metrics": dict,
    "wall_time_s": NUMBER,
    "wandb_run_id": str,
}
JSON_NAMES = {dict: "an object", list: "an array", str: "a string", bool: "true or false"}


def _json_name(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, NUMBER):
        return JSON_NAMES.get(type(value), type(value).__name__)
    return "a number"


def read_record(path: Path, keys: dict[str, Any]) -> dict[str, Any]:
    """The JSON object in `path`, each of `keys` null or of its type (true/false is no
    number); UnreadableRecord naming the file and the first key that is not."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # UnicodeDecodeError is a ValueError
        raise UnreadableRecord(f"{path.name} cannot be read ({flat(e)})") from None
    if not isinstance(data, dict):
        raise UnreadableRecord(f"{path.name} holds {_json_name(data)}, not an object")
    for key, kind in keys.items():
        value = data.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, kind):
            want = "a number" if kind is NUMBER else JSON_NAMES[kind]
            raise UnreadableRecord(
                f"{path.name}: {key!r} is {_json_name(value)}, not {want} or null"
            )
    if data.get("mode") not in (*MODES, None):
        raise UnreadableRecord(f"{path.name}: 'mode' is {data['mode']!r}, not 'max' or 'min'")
    target = data.get("target") if keys is RESULT_KEYS else None
    if target is not None:
        if not isinstance(target.get("metric"), str):
            raise UnreadableRecord(f"{path.name}: 'target' has no 'metric' (a string)")
        if _number(target.get("value")) is None:
            raise UnreadableRecord(f"{path.name}: 'target' has no 'value' (a number)")
    return data


def _number(value: Any) -> float | None:
    """A float, or None for missing / non-numeric values (bools are not numbers here)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def count_key(key: str) -> bool:
    return key.endswith("count") or key == "epoch"


def flat(text: Any) -> str:
    return " ".join(str(text).split())


def find_job_dirs(sweep_dir: str | os.PathLike) -> list[Path]:
    """The direct children of ``sweep_dir`` that are job dirs, in job order: ``2`` before
    ``10``, non-numeric names after the numbered ones, by name."""
    root = Path(sweep_dir)
    if not root.is_dir():
        return []
    marks = (".hydra", RESULT_FILE, METRICS_FILE, EVAL_FILE)
    dirs = [p for p in root.iterdir() if p.is_dir() and any((p / m).exists() for m in marks)]
    return sorted(dirs, key=lambda p: (0, int(p.name), "") if p.name.isdigit() else (1, 0, p.name))


def read_overrides(job_dir: str | os.PathLike) -> list[str] | None:
    """Hydra's record of a job's overrides (.hydra/overrides.yaml); None if absent or unreadable."""
    try:
        data = yaml.safe_load((Path(job_dir) / OVERRIDES_FILE).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return None
    return [str(o) for o in data] if isinstance(data, list) else None


def _from_metrics(rows: Iterable[dict]) -> dict[str, Any]:
    """Per-epoch val metrics, the train/loss curve over epochs and mean throughput from
    metrics.jsonl rows (a resumed job may log an epoch twice: its last row wins)."""
    by_epoch: dict[float, dict[str, float]] = {}
    train: list[tuple[float, float, float]] = []  # (step, epoch in progress, loss)
    speeds: list[float] = []
    for row in rows:
        vals = {k: v for k, v in row.items() if k.startswith("val/") and _number(v) is not None}
        if vals:
            epoch = _number(row.get("epoch"))
            epoch = float(len(by_epoch) + 1) if epoch is None else epoch
            by_epoch[epoch] = {"epoch": epoch, "step": _number(row.get("step")), **vals}
        loss, step = _number(row.get("train/loss")), _number(row.get("step"))
        if loss is not None and step is not None:
            train.append((step, _number(row.get("epoch")) or 1.0, loss))
        speed = _number(row.get("samples_per_s"))
        if speed is not None:
            speeds.append(speed)
    val_curve = [by_epoch[e] for e in sorted(by_epoch)]
    return {
        "val_curve": [{k: v for k, v in r.items() if k != "step"} for r in val_curve],
        "train_curve": _train_over_epochs(train, val_curve),
        "samples_per_s": sum(speeds) / len(speeds) if speeds else None,
    }


def _train_over_epochs(
    train: list[tuple[float, float, float]], val_curve: list[dict]
) -> list[tuple[float, float]]:
    """train/loss against epochs done (step / steps per epoch, from a validated epoch's step),
    so jobs with other batch or world sizes share the x axis; without a validated epoch, spread
    each epoch's rows evenly over it."""
    per_epoch = next(
        (v["step"] / v["epoch"] for v in val_curve if v.get("step") and v["epoch"]), None
    )
    if per_epoch:
        return [(step / per_epoch, loss) for step, _, loss in train]
    counts = Counter(epoch for _, epoch, _ in train)
    seen: Counter = Counter()
    out = []
    for _, epoch, loss in train:
        seen[epoch] += 1
        out.append((epoch - 1 + seen[epoch] / counts[epoch], loss))
    return out


def _best_of(curve: list[dict[str, float]], monitor: str, mode: str) -> tuple[Any, Any]:
    points = [
        (v[monitor], v["epoch"]) for v in curve if monitor in v and not math.isnan(v[monitor])
    ]
    if not points:
        return None, None
    value, epoch = (max if mode == "max" else min)(points, key=lambda p: p[0])
    return value, int(epoch) if float(epoch).is_integer() else epoch


def read_eval_job(job_dir: Path, evaluation: dict[str, Any]) -> JobSummary:
    """An eval.py job: ranked by its split's top-1 accuracy."""
    split = str(evaluation.get("split"))
    measured = {
        k: float(v)
        for k, v in (evaluation.get("metrics") or {}).items()
        if _number(v) is not None and not count_key(k)
    }
    return JobSummary(
        job=job_dir.name,
        overrides=" ".join(read_overrides(job_dir) or []),
        status=flat(evaluation.get("status") or "failed"),
        monitor=f"{split}/acc",
        best=measured.get("acc"),
        split=split,
        eval=measured,
        wall_time_s=_number(evaluation.get("wall_time_s")),
        wandb_run_id=evaluation.get("wandb_run_id"),
        attempts=_attempts(job_dir),
    )


def _commits(job_dir: Path, result: RunResult | None) -> list[str]:
    """The commits the job's attempts ran, in order (ddp_launcher/drift.py's `code` entries), else
    its result.json's."""

    def short(commit: str, dirty: bool | None) -> str:
        return commit[:8] + ("+" if dirty else "")

    record = read_launch_record(job_dir)
    found = [
        short(a.code["commit"], a.code.get("dirty"))
        for a in (record.attempts if record is not None else [])
        if a.code and a.code.get("commit")
    ]
    if not found and result is not None and result.git_commit:
        found = [short(result.git_commit, result.git_dirty)]
    return list(dict.fromkeys(found))


def _attempts(job_dir: Path) -> int | None:
    """How many times the launcher started the job (launch.json's attempts; None: no record)."""
    record = read_launch_record(job_dir)
    return len(record.attempts) if record is not None else None


def read_job(job_dir: str | os.PathLike) -> JobSummary:
    """Summarise one job dir: result.json first (ddp_launcher/core/run_dir.py's RunResult), gaps
    filled
    from metrics.jsonl (a job killed before its result.json still has its curves); an eval.py
    job from its eval.json. UnreadableRecord when the job's result.json or eval.json is not
    what its writer writes (read_record)."""
    job_dir = Path(job_dir)
    result_path = job_dir / RESULT_FILE
    if not result_path.is_file() and (job_dir / EVAL_FILE).is_file():
        return read_eval_job(job_dir, read_record(job_dir / EVAL_FILE, EVAL_KEYS))
    derived = _from_metrics(read_metrics(job_dir / METRICS_FILE))
    result = RunResult(status="failed", error=f"no {RESULT_FILE}")
    if result_path.is_file():
        result = RunResult.from_json(read_record(result_path, RESULT_KEYS))
    overrides = read_overrides(job_dir)
    if overrides is None and result.overrides is not None:
        overrides = [str(o) for o in result.overrides]
    curve = derived["val_curve"]
    last = curve[-1] if curve else {}
    best, best_epoch = _number(result.best), result.best_epoch
    if best is None:
        best, best_epoch = _best_of(curve, result.monitor, result.mode)
    final = {
        k: v for k, v in (result.final or last).items() if k != "epoch" and _number(v) is not None
    }
    acc_best, _ = _best_of(curve, "val/acc", "max")

    def pick(value: Any, fallback: Any) -> float | None:
        return _number(value) if _number(value) is not None else fallback

    return JobSummary(
        job=job_dir.name,
        overrides=" ".join(overrides or []),
        status=flat(result.status or "failed"),
        error=None if result.error is None else flat(result.error),
        monitor=result.monitor or "val/acc",
        mode=result.mode or "max",
        best=best,
        best_epoch=best_epoch,
        final=final,
        test={k: v for k, v in (result.test or {}).items() if _number(v) is not None},
        best_val_acc=pick(result.best_val_acc, acc_best),
        final_val_acc=pick(result.final_val_acc, last.get("val/acc")),
        final_val_loss=pick(result.final_val_loss, last.get("val/loss")),
        wall_time_s=_number(result.wall_time_s),
        samples_per_s=pick(result.samples_per_s, derived["samples_per_s"]),
        target=result.target,
        wandb_run_id=result.wandb_run_id,
        attempts=_attempts(job_dir),
        commits=_commits(job_dir, result if result_path.is_file() else None),
        val_curve=curve,
        train_curve=derived["train_curve"],
    )


def read_multirun_config(sweep_dir: str | os.PathLike) -> Any:
    """The sweep's multirun.yaml (its config as the sweeper had it), or None."""
    from omegaconf import OmegaConf

    path = Path(sweep_dir) / MULTIRUN_YAML
    try:
        return OmegaConf.load(path) if path.is_file() else None
    except Exception as e:  # noqa: BLE001 - a summary problem is never fatal
        log.warning("sweep summary: cannot read %s (%s)", path, flat(e))
        return None


def read_sweep(
    sweep_dir: str | os.PathLike,
) -> tuple[list[JobSummary], list[str], list[tuple[Path, str]]]:
    """(one JobSummary per readable job dir of ``sweep_dir``, in job order, each with its values
    of the sweep's keys; those keys: declared in its multirun.yaml, then any other key whose
    value differs between its jobs; (job dir, what is wrong) of each job dir that could not
    be read)."""
    jobs, unreadable = [], []
    for job_dir in find_job_dirs(sweep_dir):
        try:
            jobs.append(read_job(job_dir))
        except UnreadableRecord as e:
            unreadable.append((job_dir, str(e)))
    keys = swept_keys(read_multirun_config(sweep_dir), [j.overrides.split() for j in jobs])
    for job in jobs:
        values = override_values(job.overrides.split())
        job.swept = {k: values[k] for k in keys if k in values}
    return jobs, keys, unreadable


def check_metric(metric: str, mode: str | None) -> None:
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}: choose one of {', '.join(METRICS)}")
    if mode not in (*MODES, None):
        raise ValueError(f"unknown mode {mode!r}: choose 'max' or 'min'")


def sweep_monitor(rows: Sequence[JobSummary]) -> tuple[str, str]:
    """(monitor, mode) of the sweep: those of most of its jobs that have a best value."""
    pairs = Counter((r.monitor, r.mode) for r in rows if r.best is not None)
    if not pairs:
        pairs = Counter((r.monitor, r.mode) for r in rows)
    return pairs.most_common(1)[0][0] if pairs else ("val/acc", "max")


def sort_jobs(
    rows: Iterable[JobSummary], metric: str = "best", mode: str | None = None
) -> list[JobSummary]:
    """Best first by ``metric`` (``best``: each job's monitored metric, by the sweep's monitor
    and mode unless ``mode`` is given); jobs without it (None, NaN, another monitor) last, each
    group in job order."""
    check_metric(metric, mode)
    rows = list(rows)
    monitor, monitor_mode = sweep_monitor(rows)
    mode = mode or (monitor_mode if metric == "best" else "max")

    def key(row: JobSummary) -> tuple[int, float]:
        value = getattr(row, metric)
        if metric == "best" and row.monitor != monitor:
            value = None
        if value is None or math.isnan(value):
            return (1, 0.0)
        return (0, -value if mode == "max" else value)

    return sorted(rows, key=key)
