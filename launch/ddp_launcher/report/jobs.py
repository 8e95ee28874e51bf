"""Reading a sweep dir: one JobSummary per job dir (result.json's launcher part, the app's
metrics.jsonl curves where it has them, launch.json, Hydra's overrides), the sweep's swept keys,
and the jobs ranked best first. The app's own part of result.json (`app`) is never interpreted:
a job is ranked by its value (what its task returned) in its direction, or by a number the user
names."""

from __future__ import annotations

import json
import logging
import math
import os
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ddp_launcher.core.naming import override_values, swept_keys
from ddp_launcher.core.run_dir import (
    DIRECTIONS,
    METRICS_FILE,
    NUMBER,
    OVERRIDES_FILE,
    RESULT_FILE,
    RESULT_TYPES,
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

# What a sweep is ranked by unless told otherwise: each job's value (result.json's `value`, in
# its `direction`), the `best` column. Any other number a job has may be named instead: a
# column (wall_time_s, samples_per_s, `last <metric>`, a summary key) or a number at the top of
# the app's part of result.json.
BEST = "best"
VALUE_NAMES = (BEST, "value")
MODES = DIRECTIONS
# A metrics.jsonl row's keys that say when it was logged, not what was measured.
AXES = ("step", "epoch", "time", "elapsed_s")
THROUGHPUT = "samples_per_s"  # a row's throughput, averaged into the samples/s column
MAX_PANELS = 4  # summary.png's panels when the app names none


@dataclass
class JobSummary:
    """One job of a sweep. Numbers are None when neither result.json nor metrics.jsonl has them."""

    job: str
    overrides: str = ""
    status: str = "failed"
    error: str | None = None
    monitor: str | None = None  # the metric `best` measures (result.json's `metric`)
    mode: str = "max"  # which way is better (result.json's `direction`)
    best: float | None = None  # the job's value (result.json's, else its curve's best)
    best_epoch: float | None = None  # the epoch it was reached at
    # the last metrics.jsonl row holding the monitored metric: its metrics (the last epoch's)
    final: dict[str, float] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)  # result.json's: the app's columns
    wall_time_s: float | None = None
    samples_per_s: float | None = None  # the mean of metrics.jsonl's throughput rows
    # result.json's `target`: its value and metric, and when the job first reached it (None:
    # no target, or not reached)
    target: dict[str, Any] | None = None
    wandb_run_id: str | None = None
    attempts: int | None = None  # launch.json's: a launcher's retries and resumed sweeps
    # the commit(s) it ran: its attempts' in launch.json (a→b when a resume changed it), else
    # result.json's git_commit; 8 hex digits, `+` when the tree was dirty (None: not known)
    commits: list[str] = field(default_factory=list)
    swept: dict[str, Any] = field(default_factory=dict)  # {swept key: value}, set by read_sweep
    # per metrics.jsonl key: (x, value) points, x in epochs done when the rows say their epoch
    # (step / steps per epoch), else the step
    curves: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    in_epochs: bool = True  # the curves' x is in epochs (else in steps)
    # keys logged in more than one row, or beside the monitored metric: drawn as curves
    series: list[str] = field(default_factory=list)
    app: dict[str, Any] = field(default_factory=dict, repr=False)  # the app's part, opaque
    rows: list[dict[str, Any]] = field(default_factory=list, repr=False)  # its metrics.jsonl

    def reached(self, key: str) -> float | None:
        """The target's reached_at_s or reached_at_step (None: not reached, no target)."""
        return _number((self.target or {}).get(key))

    def number(self, name: str) -> float | None:
        """The number `name` of this job (see sort_jobs), None where it has none."""
        if name in VALUE_NAMES:
            return self.best
        if name in ("wall_time_s", THROUGHPUT, "attempts"):
            return _number(getattr(self, name))
        if name.startswith("last ") and name[5:] in self.final:
            return _number(self.final[name[5:]])
        if name in self.summary:
            return _number(self.summary[name])
        return _number(self.app.get(name))


@dataclass
class SweepSummary:
    """What sweep.py's write_summary wrote (its files are in `sweep_dir`): the rows best first."""

    sweep_dir: Path
    rows: list[JobSummary]
    metric: str = BEST
    mode: str = "max"
    swept_keys: list[str] = field(default_factory=list)
    monitor: str | None = None  # the metric the jobs' values measure (most of them)
    groups: list[Any] = field(default_factory=list)  # seeds.py's, best mean first; [] when none
    # (job dir, what is wrong) of each job dir whose records could not be read: not in `rows`
    unreadable: list[tuple[Path, str]] = field(default_factory=list)
    not_written: str | None = None  # why the files could not be written (None: they were)
    panels: list[str] = field(default_factory=list)  # summary.png's; [] when no curves

    @property
    def ranked_by(self) -> str:
        return value_header(self.monitor) if self.metric in VALUE_NAMES else self.metric


def value_header(monitor: str | None) -> str:
    """The value's column header: `best <metric>`, or `best` for jobs whose metric is unnamed."""
    return f"{BEST} {monitor}" if monitor else BEST


class UnreadableRecord(ValueError):
    """A job's result.json (or evaluation record) that is not what its writer writes: the
    message names the file and what is wrong with it."""


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
    for key in ("direction", "mode"):  # (mode: the flat layout's)
        if data.get(key) not in (*MODES, None):
            raise UnreadableRecord(f"{path.name}: {key!r} is {data[key]!r}, not 'max' or 'min'")
    target = data.get("target") if keys is RESULT_TYPES else None
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


def metric_kind(key: str) -> str:
    """What a metric measures, whatever split or phase: `loss` of train/loss, x/loss, x_loss."""
    return re.split(r"[/_]", key)[-1]


def flat(text: Any) -> str:
    return " ".join(str(text).split())


def find_job_dirs(sweep_dir: str | os.PathLike) -> list[Path]:
    """The direct children of ``sweep_dir`` that are job dirs, in job order: ``2`` before
    ``10``, non-numeric names after the numbered ones, by name."""
    root = Path(sweep_dir)
    if not root.is_dir():
        return []
    marks = (".hydra", RESULT_FILE, METRICS_FILE)
    dirs = [p for p in root.iterdir() if p.is_dir() and any((p / m).exists() for m in marks)]
    return sorted(dirs, key=lambda p: (0, int(p.name), "") if p.name.isdigit() else (1, 0, p.name))


def read_overrides(job_dir: str | os.PathLike) -> list[str] | None:
    """Hydra's record of a job's overrides (.hydra/overrides.yaml); None if absent or unreadable."""
    try:
        data = yaml.safe_load((Path(job_dir) / OVERRIDES_FILE).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return None
    return [str(o) for o in data] if isinstance(data, list) else None


def read_curves(
    rows: Sequence[dict[str, Any]],
) -> tuple[dict[str, list[tuple[float, float]]], bool]:
    """Every number metrics.jsonl's rows hold, as (x, value) points in row order, a step logged
    twice by its last row; x is the epochs done (step / steps per epoch, the steps per epoch
    read off the rows: an epoch's last row has step = epoch x steps per epoch), so that jobs
    with other batch or world sizes share the axis; rows without a step are placed at their
    epoch, and rows without an epoch at their step (then the second value is False)."""
    per_epoch = max(
        (
            step / epoch
            for step, epoch in ((_number(r.get("step")), _number(r.get("epoch"))) for r in rows)
            if step is not None and epoch is not None and epoch > 0
        ),
        default=None,
    )
    in_epochs = any(_number(r.get("epoch")) is not None for r in rows)
    points: dict[str, dict[Any, tuple[float, float]]] = {}
    for n, row in enumerate(rows):
        step, epoch = _number(row.get("step")), _number(row.get("epoch"))
        if step is not None and per_epoch:
            x = step / per_epoch
        elif in_epochs:
            x = epoch
        else:
            x = step
        if x is None:
            continue
        for key, value in row.items():
            if key not in AXES and _number(value) is not None:
                points.setdefault(key, {})[step if step is not None else ("row", n)] = (
                    x,
                    float(value),
                )
    return {k: sorted(p.values(), key=lambda xy: xy[0]) for k, p in points.items()}, in_epochs


def _metric_rows(rows: Sequence[dict], metric: str | None) -> list[dict]:
    """The rows holding `metric` as a number (not NaN), a step logged twice by its last row."""
    if not metric:
        return []
    by_step: dict[Any, dict] = {}
    for n, row in enumerate(rows):
        value = _number(row.get(metric))
        if value is not None and not math.isnan(value):
            step = row.get("step")
            by_step.pop(step if step is not None else n, None)  # keep the row order
            by_step[step if step is not None else n] = row
    return list(by_step.values())


def _whole(epoch: Any) -> float | int | None:
    number = _number(epoch)
    return int(number) if number is not None and number.is_integer() else number


def fill_from_rows(job: JobSummary, monitor: str | None, mode: str) -> None:
    """What a job's metrics.jsonl says of its `monitor` (its own, or the sweep's for a job that
    names none): its value where result.json has none (a killed job: the best of the curve), the
    epoch of its value (the first row that holds it), the last row's metrics (`final`)."""
    rows = _metric_rows(job.rows, monitor)
    if job.monitor is None and (rows or job.best is None):
        job.monitor, job.mode = monitor, mode
    if not rows:
        return
    if job.best is None:
        pick = max if mode == "max" else min
        job.best = float(pick(rows, key=lambda r: float(r[monitor]))[monitor])
    if job.best_epoch is None:
        reached = next((r for r in rows if float(r[monitor]) == job.best), None)
        job.best_epoch = _whole(reached.get("epoch")) if reached is not None else None
    last = rows[-1]
    job.final = {k: float(v) for k, v in last.items() if k not in AXES and _number(v) is not None}
    job.series = list(dict.fromkeys([*job.series, *job.final]))


def _series(rows: Sequence[dict]) -> list[str]:
    """The keys logged in more than one row: curves (a one-off row, e.g. a final test, is not)."""
    seen = Counter(k for row in rows for k, v in row.items() if _number(v) is not None)
    return [k for k, n in seen.items() if n > 1 and k not in AXES]


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


def _attempts(job_dir: Path, result: RunResult | None) -> int | None:
    """How many times a launcher started the job: launch.json's attempts, else result.json's
    count (None: neither says)."""
    record = read_launch_record(job_dir)
    if record is not None:
        return len(record.attempts)
    return int(result.attempts) if result is not None and result.attempts else None


def read_result_record(job_dir: Path) -> RunResult | None:
    """The job's result.json (read_record's checks), else None."""
    result_path = job_dir / RESULT_FILE
    if result_path.is_file():
        return RunResult.from_json(read_record(result_path, RESULT_TYPES))
    return None


def read_job(job_dir: str | os.PathLike) -> JobSummary:
    """Summarise one job dir: result.json's launcher part (ddp_launcher/core/run_dir.py's
    RunResult), then the app's metrics.jsonl where it has one: the curves, the value's epoch,
    the last row of the monitored metric, and the value of a job killed before its result.json.
    UnreadableRecord when the job's result.json is not what its writer writes
    (read_record)."""
    job_dir = Path(job_dir)
    found = read_result_record(job_dir)
    result = found or RunResult(status="failed", error=f"no {RESULT_FILE}", metric=None)
    if found is None or found.status == "running":
        from ddp_launcher.core import run_lock

        held = run_lock.holder(job_dir)  # (a report while the sweep runs: not a failure)
        if held is not None:
            result = RunResult(status="running", error=f"running ({held})", metric=None)
    overrides = read_overrides(job_dir)
    if overrides is None and result.overrides is not None:
        overrides = [str(o) for o in result.overrides]
    rows = read_metrics(job_dir / METRICS_FILE)
    curves, in_epochs = read_curves(rows)
    speeds = [v for row in rows if (v := _number(row.get(THROUGHPUT))) is not None]
    job = JobSummary(
        job=job_dir.name,
        overrides=" ".join(overrides or []),
        status=flat(result.status or "failed"),
        error=None if result.error is None else flat(result.error),
        monitor=result.metric or None,
        mode=result.direction if result.direction in MODES else "max",
        best=_number(result.value),
        best_epoch=_whole(result.value_epoch),
        summary={
            k: v
            for k, v in (result.summary or {}).items()
            if _number(v) is not None or isinstance(v, str)
        },
        wall_time_s=_number(result.wall_time_s),
        samples_per_s=sum(speeds) / len(speeds) if speeds else None,
        target=result.target,
        wandb_run_id=result.wandb_run_id,
        attempts=_attempts(job_dir, found),
        commits=_commits(job_dir, found),
        curves=curves,
        in_epochs=in_epochs,
        series=_series(rows),
        app=result.app if isinstance(result.app, dict) else {},
        rows=rows,
    )
    if job.monitor is not None:
        fill_from_rows(job, job.monitor, job.mode)
    return job


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
    be read). A job that names no metric (killed before its result.json) is read by the
    sweep's."""
    jobs, unreadable = [], []
    for job_dir in find_job_dirs(sweep_dir):
        try:
            jobs.append(read_job(job_dir))
        except UnreadableRecord as e:
            unreadable.append((job_dir, str(e)))
    monitor, mode = sweep_monitor(jobs)
    for job in jobs:
        if job.monitor is None and monitor is not None:
            fill_from_rows(job, monitor, mode)
    keys = swept_keys(read_multirun_config(sweep_dir), [j.overrides.split() for j in jobs])
    for job in jobs:
        values = override_values(job.overrides.split())
        job.swept = {k: values[k] for k in keys if k in values}
    return jobs, keys, unreadable


def check_mode(mode: str | None) -> None:
    if mode not in (*MODES, None):
        raise ValueError(f"unknown mode {mode!r}: choose 'max' or 'min'")


def check_metric(rows: Sequence[JobSummary], metric: str) -> None:
    """ValueError naming the choices when no job has a number called `metric`."""
    if metric in (*VALUE_NAMES, "wall_time_s", THROUGHPUT):
        return
    if any(row.number(metric) is not None for row in rows):
        return
    names = [f"{BEST} (each job's value)", "wall_time_s", THROUGHPUT]
    names += [f"last {k}" for row in rows for k in row.final]
    names += [k for row in rows for k, v in row.summary.items() if _number(v) is not None]
    names += [k for row in rows for k, v in row.app.items() if _number(v) is not None]
    names = list(dict.fromkeys(names))
    raise ValueError(f"unknown metric {metric!r}: choose one of {', '.join(names)}")


def sweep_monitor(rows: Sequence[JobSummary]) -> tuple[str | None, str]:
    """(monitor, mode) of the sweep: those of most of its jobs that have a value."""
    pairs = Counter((r.monitor, r.mode) for r in rows if r.best is not None)
    if not pairs:
        pairs = Counter((r.monitor, r.mode) for r in rows if r.monitor is not None)
    return pairs.most_common(1)[0][0] if pairs else (None, "max")


def sort_jobs(
    rows: Iterable[JobSummary], metric: str = BEST, mode: str | None = None
) -> list[JobSummary]:
    """Best first by ``metric`` (``best``: each job's value, by the sweep's monitor and mode
    unless ``mode`` is given; else a number of the jobs, JobSummary.number, highest first
    unless ``mode`` is min); jobs without it (None, NaN, another monitor) last, each group in
    job order."""
    check_mode(mode)
    rows = list(rows)
    check_metric(rows, metric)
    monitor, monitor_mode = sweep_monitor(rows)
    mode = mode or (monitor_mode if metric in VALUE_NAMES else "max")

    def key(row: JobSummary) -> tuple[int, float]:
        value = row.number(metric)
        if metric in VALUE_NAMES and row.monitor != monitor:
            value = None
        if value is None or math.isnan(value):
            return (1, 0.0)
        return (0, -value if mode == "max" else value)

    return sorted(rows, key=key)


def default_panels(rows: Sequence[JobSummary], monitor: str | None) -> list[str]:
    """summary.png's panels when the app names none: the monitored metric, then the losses
    (its own split's first), of the curves the jobs drew (at most MAX_PANELS)."""
    drawn = list(dict.fromkeys(k for r in rows for k in r.series if r.curves.get(k)))
    split = monitor.rpartition("/")[0] if monitor else ""
    losses = [k for k in drawn if metric_kind(k) == "loss" and not count_key(k)]
    losses.sort(key=lambda k: k.rpartition("/")[0] != split)  # stable: file order otherwise
    panels = [monitor] if monitor in drawn else []
    return list(dict.fromkeys([*panels, *losses]))[:MAX_PANELS]


def chosen_panels(rows: Sequence[JobSummary], monitor: str | None, panels: Sequence[str] | None):
    """The panels to draw: `panels` as the app names them (None: default_panels), each only
    where some job has its curve."""
    if panels is None:
        return default_panels(rows, monitor)
    return [p for p in dict.fromkeys(panels) if any(r.curves.get(p) for r in rows)]


def x_unit(rows: Sequence[JobSummary]) -> str:
    """What the curves' x axis counts: epochs where a job's rows say their epoch, else steps."""
    return "epoch" if any(r.in_epochs for r in rows if r.curves) else "step"
