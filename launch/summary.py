"""Sweep summary: one table (CSV, Markdown, text), one plot and one W&B run for a Hydra multirun.

Reads every job dir of a sweep dir (``<sweep_dir>/<subdir>/`` holding ``.hydra/``,
``result.json`` or ``metrics.jsonl``) and writes ``summary.csv``, ``summary.md`` and
``summary.png`` next to ``multirun.yaml``:

* the table has one column per swept key (the keys the sweep varies: its sweep overrides and
  its sweeper's params, from multirun.yaml, and any other key whose value differs between jobs;
  short names, floats to 4 significant digits; components/naming.py), then each job's status,
  its monitored metric's best value and epoch (result.json's ``monitor``/``mode``/``best``),
  the last epoch's val metrics, test metrics when there are any, wall time and samples/s; jobs
  ranked best first by their monitor and mode;
* the plot has val/acc and val/loss per epoch and train/loss over epochs, one style (colour,
  marker, line) per job so that curves on top of each other stay distinguishable, points of one
  epoch spread a little apart, integer epoch ticks, and a legend of swept values only;
* at the end of a multirun the callback also logs one W&B run with ``job_type=sweep_summary`` in
  the sweep's group (:func:`log_to_wandb`): the table as a W&B Table (a link to each job's run)
  and the plot. Offline, it lands with ``wandb sync <sweep dir>/wandb/offline-run-*``.

Used three ways:

* as a Hydra callback, written at the end of every multirun (also when a job failed)::

      hydra:
        callbacks:
          sweep_summary:
            _target_: launch.summary.SweepSummaryCallback

* from the command line for any sweep dir: ``python -m launch.summary <sweep_dir> [--wandb]``;
* from Python: :func:`write_summary`, :func:`collect_jobs`, :func:`format_table`.

Cheap to import (Hydra loads callbacks at startup): no torch, matplotlib and wandb only when used.
A summary problem (W&B included) is a warning, never a failed sweep.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import csv
import io
import logging
import math
import os
import sys
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from hydra.experimental.callback import Callback

from components.naming import (
    declared_sweep_keys,
    fmt_duration,
    fmt_value,
    label,
    override_values,
    short_keys,
    sweep_group,
    varying_keys,
)
from components.run_dir import (
    EVAL_FILE,
    METRICS_FILE,
    OVERRIDES_FILE,
    RESULT_FILE,
    RunResult,
    read_metrics,
)

log = logging.getLogger(__name__)

CSV_NAME = "summary.csv"
MD_NAME = "summary.md"
PNG_NAME = "summary.png"
MULTIRUN_YAML = "multirun.yaml"
NO_RESULT_ERROR = f"no {RESULT_FILE}"
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
    wandb_run_id: str | None = None
    attempts: int | None = None  # launch.json's: a launcher's retries and resumed sweeps
    # An eval.py job (eval.json, no result.json): its split and what it measured there.
    split: str | None = None
    eval: dict[str, float] = field(default_factory=dict)  # acc, acc5, loss, ece
    swept: dict[str, Any] = field(default_factory=dict)  # {swept key: value}, set by collect_jobs
    # per epoch: {"epoch": e, "val/acc": ..., "val/loss": ...}; train: (epochs done, train/loss)
    val_curve: list[dict[str, float]] = field(default_factory=list)
    train_curve: list[tuple[float, float]] = field(default_factory=list)

    @property
    def epochs(self) -> list[tuple[int | float, float]]:
        """(epoch, val/acc) per validated epoch."""
        return [(v["epoch"], v["val/acc"]) for v in self.val_curve if "val/acc" in v]


@dataclass
class SweepSummary:
    """What :func:`write_summary` wrote: the three files, the rows best first, and the keys."""

    sweep_dir: Path
    csv_path: Path
    md_path: Path
    png_path: Path
    rows: list[JobSummary]
    metric: str = "best"
    mode: str = "max"
    swept_keys: list[str] = field(default_factory=list)
    monitor: str = "val/acc"

    @property
    def ranked_by(self) -> str:
        return f"best {self.monitor}" if self.metric == "best" else self.metric


# --------------------------------------------------------------------------------------------
# Reading a sweep dir


def _number(value: Any) -> float | None:
    """A float, or None for missing / non-numeric values (bools are not numbers here)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _one_line(text: Any) -> str:
    return " ".join(str(text).split())


def _natural_key(name: str) -> tuple:
    """Job dirs ``2`` before ``10``; non-numeric names after the numbered ones, by name."""
    return (0, int(name), "") if name.isdigit() else (1, 0, name)


def is_job_dir(path: Path) -> bool:
    return path.is_dir() and any(
        (path / name).exists() for name in (".hydra", RESULT_FILE, METRICS_FILE, EVAL_FILE)
    )


def find_job_dirs(sweep_dir: str | os.PathLike) -> list[Path]:
    """The direct children of ``sweep_dir`` that are job dirs, in job order."""
    root = Path(sweep_dir)
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if is_job_dir(p)), key=lambda p: _natural_key(p.name))


def _read_overrides(job_dir: Path) -> list[str] | None:
    path = job_dir / OVERRIDES_FILE
    if not path.is_file():
        return None
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
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
        if _number(v) is not None and not _count_key(k)
    }
    overrides = _read_overrides(job_dir) or []
    return JobSummary(
        job=job_dir.name,
        overrides=" ".join(overrides),
        status=_one_line(evaluation.get("status") or "failed"),
        error=None,
        monitor=f"{split}/acc",
        best=measured.get("acc"),
        split=split,
        eval=measured,
        wall_time_s=_number(evaluation.get("wall_time_s")),
        wandb_run_id=evaluation.get("wandb_run_id"),
        attempts=_attempts(job_dir),
    )


def _attempts(job_dir: Path) -> int | None:
    """How many times the launcher started the job (launch.json; None: no record)."""
    from launch.resume import read_launch_record

    record = read_launch_record(job_dir)
    return len(record.attempts) if record is not None else None


def read_job(job_dir: str | os.PathLike) -> JobSummary:
    """Summarise one job dir: result.json first (components/run_dir.py's RunResult), gaps filled
    from metrics.jsonl (a job killed before its result.json still has its curves); an eval.py
    job from its eval.json."""
    import json

    job_dir = Path(job_dir)
    if not (job_dir / RESULT_FILE).is_file() and (job_dir / EVAL_FILE).is_file():
        try:
            evaluation = json.loads((job_dir / EVAL_FILE).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            evaluation = None
        if isinstance(evaluation, dict):
            return read_eval_job(job_dir, evaluation)
    derived = _from_metrics(read_metrics(job_dir / METRICS_FILE))
    result = RunResult(status="failed", error=NO_RESULT_ERROR)
    result_path = job_dir / RESULT_FILE
    if result_path.is_file():
        try:
            loaded = json.loads(result_path.read_text(encoding="utf-8"))
            if not isinstance(loaded, dict):
                raise ValueError("not a JSON object")
            result = RunResult.from_json(loaded)
        except (OSError, ValueError, TypeError) as e:
            result = RunResult(status="failed", error=_one_line(f"unreadable result.json: {e}"))
    overrides = _read_overrides(job_dir)
    if overrides is None and isinstance(result.overrides, list):
        overrides = [str(o) for o in result.overrides]
    curve = derived["val_curve"]
    last = curve[-1] if curve else {}
    best, best_epoch = _number(result.best), result.best_epoch
    if best is None:
        best, best_epoch = _best_of(curve, result.monitor, result.mode)
    final = {k: v for k, v in (result.final or last).items() if k != "epoch"}
    acc_best, _ = _best_of(curve, "val/acc", "max")

    def pick(value: Any, fallback: Any) -> float | None:
        return _number(value) if _number(value) is not None else fallback

    return JobSummary(
        job=job_dir.name,
        overrides=" ".join(overrides or []),
        status=_one_line(result.status or "failed"),
        error=None if result.error is None else _one_line(result.error),
        monitor=result.monitor,
        mode=result.mode,
        best=best,
        best_epoch=best_epoch,
        final=final,
        test={k: v for k, v in (result.test or {}).items() if _number(v) is not None},
        best_val_acc=pick(result.best_val_acc, acc_best),
        final_val_acc=pick(result.final_val_acc, last.get("val/acc")),
        final_val_loss=pick(result.final_val_loss, last.get("val/loss")),
        wall_time_s=_number(result.wall_time_s),
        samples_per_s=pick(result.samples_per_s, derived["samples_per_s"]),
        wandb_run_id=result.wandb_run_id,
        attempts=_attempts(job_dir),
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
        log.warning("sweep summary: cannot read %s (%s)", path, _one_line(e))
        return None


def sweep_keys(sweep_dir: str | os.PathLike, jobs: Sequence[JobSummary]) -> list[str]:
    """The keys the sweep varies: declared in its multirun.yaml, then any other key whose value
    differs between its jobs."""
    config = read_multirun_config(sweep_dir)
    declared = declared_sweep_keys(config) if config is not None else []
    varying = varying_keys([j.overrides.split() for j in jobs])
    return list(dict.fromkeys([*declared, *varying]))


def read_sweep(sweep_dir: str | os.PathLike) -> tuple[list[JobSummary], list[str]]:
    """(one JobSummary per job dir of ``sweep_dir``, in job order (``0``, ``1``, …, ``10``),
    each with its values of the sweep's keys; those keys)."""
    jobs = [read_job(d) for d in find_job_dirs(sweep_dir)]
    keys = sweep_keys(sweep_dir, jobs)
    for job in jobs:
        values = override_values(job.overrides.split())
        job.swept = {k: values[k] for k in keys if k in values}
    return jobs, keys


def collect_jobs(sweep_dir: str | os.PathLike) -> list[JobSummary]:
    """:func:`read_sweep`'s jobs."""
    return read_sweep(sweep_dir)[0]


def _check_metric(metric: str, mode: str | None) -> None:
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
    _check_metric(metric, mode)
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


# --------------------------------------------------------------------------------------------
# The table


def _count_key(key: str) -> bool:
    return key.endswith("count") or key == "epoch"


@dataclass
class Column:
    header: str  # text and Markdown tables, the W&B Table
    csv: str  # summary.csv
    get: Any  # JobSummary -> value
    numeric: bool = True
    text: Any = fmt_value  # value -> table text
    wandb: str = ""  # its W&B Table header when not `header`


BRIEF = ("/acc", "/loss")  # the metrics of the printed table (the files have them all)


def columns(rows: Sequence[JobSummary], keys: Sequence[str], brief: bool = False) -> list[Column]:
    """The table's columns: job, one per swept key, status, the monitored metric's best value
    and epoch, the last epoch's val metrics, test metrics, wall time, samples/s. `brief`: of
    the val and test metrics only acc and loss (and the monitored one)."""
    short = short_keys(keys)
    monitor, _ = sweep_monitor(rows)

    def shown(key: str) -> bool:
        return not _count_key(key) and (not brief or key == monitor or key.endswith(BRIEF))

    finals = [k for r in rows for k in r.final if shown(k)]
    finals = list(dict.fromkeys(sorted(finals, key=lambda k: k != monitor)))  # monitor first
    tests = list(dict.fromkeys(k for r in rows for k in r.test if shown(k)))
    cols = [Column("job", "job", lambda r: r.job, numeric=False)]
    for key in keys:
        cols.append(Column(short[key], key, lambda r, k=key: r.swept.get(k)))
    cols.append(Column("status", "status", lambda r: r.status, numeric=False))
    if not all(r.split for r in rows):  # eval.py jobs have no epochs: their acc column ranks
        cols += [
            Column(f"best {monitor}", "best", lambda r: r.best),
            Column("epoch", "best_epoch", lambda r: r.best_epoch),
        ]
    cols += [Column(f"last {k}", f"last {k}", lambda r, k=k: r.final.get(k)) for k in finals]
    cols += [Column(k, k, lambda r, k=k: r.test.get(k)) for k in tests]
    if any(r.split for r in rows):  # eval.py jobs: the split and what was measured on it
        if "split" not in keys:
            cols.append(Column("split", "split", lambda r: r.split, numeric=False))
        measured = list(dict.fromkeys(k for r in rows for k in r.eval))
        cols += [Column(k, f"eval_{k}", lambda r, k=k: r.eval.get(k)) for k in measured]
    cols += [
        Column(
            "wall", "wall_time_s", lambda r: r.wall_time_s, text=fmt_duration, wandb="wall_time_s"
        ),
        Column("samples/s", "samples_per_s", lambda r: r.samples_per_s),
    ]
    if any((r.attempts or 0) > 1 for r in rows):  # retried or resumed: how many starts each
        cols.append(Column("attempts", "attempts", lambda r: r.attempts))
    return cols


def _cell(col: Column, row: JobSummary) -> str:
    value = col.get(row)
    return "-" if value is None else col.text(value)


def _failures(rows: Sequence[JobSummary]) -> list[JobSummary]:
    return [r for r in rows if r.status != "completed"]


def _job_label(row: JobSummary, keys: Sequence[str], sep: str = " ") -> str:
    short = short_keys(keys)
    return label({short[k]: v for k, v in row.swept.items()}, sep)


def format_table(rows: Sequence[JobSummary], keys: Sequence[str] | None = None) -> str:
    """A fixed-width text table of ``rows`` (in the given order), then the failed jobs if any.
    ``keys``: the swept keys (default: those the rows have values for)."""
    keys = list(keys) if keys is not None else list(dict.fromkeys(k for r in rows for k in r.swept))
    cols = columns(rows, keys, brief=True)
    body = [[_cell(c, r) for c in cols] for r in rows]
    widths = [max(len(x) for x in col) for col in zip([c.header for c in cols], *body, strict=True)]

    def line(cells: Sequence[str]) -> str:
        parts = [
            cell.rjust(w) if c.numeric else cell.ljust(w)
            for c, cell, w in zip(cols, cells, widths, strict=True)
        ]
        return "  ".join(parts).rstrip()

    out = [line([c.header for c in cols]), line(["-" * w for w in widths])]
    out += [line(cells) for cells in body]
    failed = _failures(rows)
    if failed:
        out += ["", "Failed jobs:"]
        for r in failed:
            what = _job_label(r, keys) or r.overrides or "(no overrides)"
            out.append(f"  job {r.job} [{r.status}] {what}: {r.error or 'no error recorded'}")
    return "\n".join(out)


def _md_escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace("|", "\\|")


def format_markdown(summary: SweepSummary, title: str = "") -> str:
    rows, cols = summary.rows, columns(summary.rows, summary.swept_keys, brief=True)
    headers = ["rank", *(c.header for c in cols), "error"]
    lines = [f"# Sweep summary{': ' + title if title else ''}", ""]
    mode = summary.mode
    lines.append(
        f"{len(rows)} jobs, {sum(r.status == 'completed' for r in rows)} completed; "
        f"ranked by `{summary.ranked_by}` ({mode})."
    )
    lines += ["", "| " + " | ".join(headers) + " |"]
    align = ["---:", *("---:" if c.numeric else "---" for c in cols), "---"]
    lines.append("| " + " | ".join(align) + " |")
    for rank, row in enumerate(rows, 1):
        cells = [str(rank), *(_cell(c, row) for c in cols), row.error or ""]
        lines.append("| " + " | ".join(_md_escape(c) for c in cells) + " |")
    lines += ["", f"![{', '.join(PANELS)} per epoch]({PNG_NAME})", ""]
    return "\n".join(lines)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _csv_text(summary: SweepSummary) -> str:
    cols = columns(summary.rows, summary.swept_keys)
    extra = [
        ("monitor", lambda r: r.monitor),
        ("mode", lambda r: r.mode),
        ("wandb_run_id", lambda r: r.wandb_run_id),
        ("overrides", lambda r: r.overrides),
        *([] if any(c.csv == "attempts" for c in cols) else [("attempts", lambda r: r.attempts)]),
        ("error", lambda r: r.error),
    ]
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow([*(c.csv for c in cols), *(name for name, _ in extra)])
    for row in summary.rows:
        values = [*(c.get(row) for c in cols), *(get(row) for _, get in extra)]
        writer.writerow(["" if v is None else v for v in values])
    return buf.getvalue()


# --------------------------------------------------------------------------------------------
# The plot

MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">")
LINESTYLES = ("-", "--", ":", "-.")


def plot_summary(summary: SweepSummary, path: Path, title: str = "") -> None:
    """Write :func:`summary_figure` to `path` (PNG)."""
    import matplotlib.pyplot as plt

    fig = summary_figure(summary, title)
    try:
        tmp = path.with_name(f".{path.name}.tmp")
        fig.savefig(tmp, format="png", dpi=100, bbox_inches="tight")
        os.replace(tmp, path)
    finally:
        plt.close(fig)


def summary_figure(summary: SweepSummary, title: str = "") -> Any:
    """val/acc and val/loss per epoch, train/loss over epochs; one colour, marker and line style
    per job (hollow markers, points of one epoch spread apart, so that equal curves stay
    visible), integer epoch ticks, one legend of the swept values, jobs in rank order."""
    import matplotlib

    matplotlib.use("Agg", force=True)  # no display, and never the caller's interactive backend
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    rows = summary.rows
    fig, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 4.2), sharex=True)
    try:
        colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        n = len(rows)
        spread = min(0.08, 0.4 / max(n - 1, 1))  # how far apart one epoch's points of n jobs
        last_epoch = max((v["epoch"] for r in rows for v in r.val_curve), default=1.0)
        last_epoch = max([last_epoch, *(x for r in rows for x, _ in r.train_curve)])
        handles, labels = [], []
        for i, row in enumerate(rows):
            # Later jobs draw on top in broken lines: a solid curve under them still shows.
            style = dict(
                color=colors[i % len(colors)],
                marker=MARKERS[i % len(MARKERS)],
                linestyle=LINESTYLES[i % len(LINESTYLES)],
                markerfacecolor="none",
                markersize=7,
                linewidth=1.5,
            )
            if row.status != "completed":
                style["linestyle"] = (0, (1, 1))  # dotted: did not complete
            handle = None
            dodge = (i - (n - 1) / 2) * spread
            for ax, key in zip(axes, PANELS, strict=True):
                if key == "train/loss":
                    points = row.train_curve
                    every = max(1, len(points) // 8)
                else:
                    points = [(v["epoch"] + dodge, v[key]) for v in row.val_curve if key in v]
                    every = 1
                if points:
                    xs, ys = zip(*points, strict=True)
                    (handle,) = ax.plot(xs, ys, markevery=every, **style)
            if handle is not None:
                handles.append(handle)
                what = _job_label(row, summary.swept_keys) or row.overrides or "(no overrides)"
                status = "" if row.status == "completed" else f" [{row.status}]"
                labels.append(f"#{row.job} {what}{status}")
        for ax, key in zip(axes, PANELS, strict=True):
            ax.set_title(key, fontsize="medium")
            ax.set_xlabel("epoch")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
            ax.set_xlim(0, last_epoch + 0.5)
            ax.margins(y=0.12)  # points at the extremes stay off the frame
            ax.grid(True, alpha=0.3)
            if not ax.lines:
                ax.text(
                    0.5, 0.5, f"no {key} recorded", ha="center", va="center", transform=ax.transAxes
                )
        heading = f"{title}: " if title else ""
        fig.suptitle(
            f"{heading}{len(rows)} jobs, ranked by {summary.ranked_by} ({summary.mode})",
            fontsize="medium",
        )
        if handles:
            ncol = min(len(handles), 4)
            fig.legend(
                handles,
                labels,
                loc="lower center",
                ncol=ncol,
                fontsize="small",
                frameon=False,
                bbox_to_anchor=(0.5, 0.0),
            )
            rows_of_legend = math.ceil(len(handles) / ncol)
            fig.tight_layout(rect=(0, min(0.5, 0.06 + 0.055 * rows_of_legend), 1, 1))
        else:
            fig.tight_layout()
    except BaseException:
        plt.close(fig)
        raise
    return fig


# --------------------------------------------------------------------------------------------
# Writing it all


def write_summary(
    sweep_dir: str | os.PathLike, metric: str = "best", mode: str | None = None
) -> SweepSummary:
    """Write summary.csv, summary.md and summary.png into ``sweep_dir``; rows best first.

    Raises ValueError for an unknown metric/mode and FileNotFoundError when ``sweep_dir`` has
    no job dirs.
    """
    _check_metric(metric, mode)
    root = Path(sweep_dir)
    jobs, keys = read_sweep(root)
    if not jobs:
        raise FileNotFoundError(
            f"no job dirs in {root} (nothing with .hydra/, {RESULT_FILE} or {METRICS_FILE})"
        )
    rows = sort_jobs(jobs, metric, mode)
    monitor, monitor_mode = sweep_monitor(rows)
    summary = SweepSummary(
        root,
        root / CSV_NAME,
        root / MD_NAME,
        root / PNG_NAME,
        rows,
        metric,
        mode or (monitor_mode if metric == "best" else "max"),
        keys,
        monitor,
    )
    _write_atomic(summary.csv_path, _csv_text(summary))
    _write_atomic(summary.md_path, format_markdown(summary, root.name))
    plot_summary(summary, summary.png_path, root.name)
    return summary


def headline(summary: SweepSummary) -> str:
    rows = summary.rows
    done = sum(r.status == "completed" for r in rows)
    files = f"{summary.sweep_dir}/{{{CSV_NAME},{MD_NAME},{PNG_NAME}}}"
    return (
        f"Sweep summary: {len(rows)} jobs, {done} completed, ranked by {summary.ranked_by} "
        f"({summary.mode}); {files}"
    )


# --------------------------------------------------------------------------------------------
# W&B: the sweep-summary run


def wandb_settings(config: Any) -> tuple[dict[str, Any], str | None] | None:
    """(the sweep's `wandb` node, its experiment) from its config; None for an app without one."""
    from omegaconf import OmegaConf

    node = OmegaConf.select(config, "wandb", default=None) if config is not None else None
    if node is None:
        return None
    settings = OmegaConf.to_container(node, resolve=True, enum_to_str=True)
    experiment = OmegaConf.select(config, "hydra.runtime.choices.experiment", default=None)
    return (settings, experiment) if isinstance(settings, dict) else None


def log_to_wandb(
    summary: SweepSummary, settings: dict[str, Any], experiment: str | None = None
) -> str | None:
    """One W&B run with job_type=sweep_summary in the sweep's group (the group its jobs' runs
    are in, components/naming.py's sweep_group): the table as a W&B Table, with a link to each
    job's run (its id offline), and summary.png. Returns the run's id; None when W&B is
    disabled. A W&B failure is a warning."""
    from components.errors import UserError
    from components.wandb_mode import resolve_wandb_mode

    try:
        mode = resolve_wandb_mode(settings.get("mode", "auto"))
    except UserError as e:
        log.warning("sweep summary: no W&B run (%s)", e)
        return None
    if mode == "disabled":
        return None
    try:
        import wandb
    except ImportError:
        return None
    group = settings.get("group") or sweep_group(experiment, summary.sweep_dir)
    run = None
    try:
        run = wandb.init(
            project=settings.get("project"),
            entity=settings.get("entity"),
            group=group,
            name="summary",
            job_type=JOB_TYPE,
            tags=list(settings.get("tags") or []),
            config={
                "sweep_dir": str(summary.sweep_dir),
                "swept_keys": summary.swept_keys,
                "monitor": summary.monitor,
                "mode": summary.mode,
                "ranked_by": summary.ranked_by,
                "jobs": len(summary.rows),
            },
            dir=str(summary.sweep_dir),
            mode=mode,
            settings=wandb.Settings(
                init_timeout=float(settings.get("init_timeout_s", 60)), console="off", silent=True
            ),
        )
        runs_url = None if mode == "offline" else (run.url or "").rsplit("/runs/", 1)[0]
        cols = columns(summary.rows, summary.swept_keys)
        data = []
        for row in summary.rows:
            link = row.wandb_run_id and (
                f"{runs_url}/runs/{row.wandb_run_id}" if runs_url else row.wandb_run_id
            )
            data.append([*(c.get(row) for c in cols), link or None, row.error])
        headers = [*(c.wandb or c.header for c in cols), "run", "error"]
        table = wandb.Table(columns=headers, data=data, allow_mixed_types=True)
        run.log({"sweep/table": table, "sweep/plot": wandb.Image(str(summary.png_path))})
        best = summary.rows[0] if summary.rows and summary.rows[0].best is not None else None
        if best is not None:
            run.summary.update({f"best/{summary.monitor}": best.best, "best/job": best.job})
        run_id = run.id
        run.finish()
        return run_id
    except Exception as e:  # noqa: BLE001 - W&B failing never fails a sweep
        log.warning("sweep summary: W&B run failed (%s)", _one_line(e)[:200])
        if run is not None:
            with contextlib.suppress(Exception):
                run.finish(exit_code=1)
        return None


# --------------------------------------------------------------------------------------------
# Hydra callback


class SweepSummaryCallback(Callback):
    """Writes the sweep summary at the end of a multirun, prints its table and logs the W&B
    sweep-summary run (when the app's config has a `wandb` node and W&B is not disabled).

    Hydra's BasicSweeper raises on the first failed job, so ``on_multirun_end`` never runs
    then; a fallback registered in ``on_multirun_start`` writes the summary instead: run by
    launch/rank.py's entry point as the sweep's exception leaves Hydra
    (:func:`finish_unfinished_sweeps`), or at interpreter exit (``atexit``) otherwise. The
    entry point's turn comes first because at ``atexit`` time threading has shut down, and
    neither wandb nor torch can be imported any more. Nothing here raises: a summary problem
    is logged as a warning, never fails a sweep.
    """

    def __init__(self, metric: str = "best", mode: str | None = None, wandb: bool = True) -> None:
        self.metric = metric
        self.mode = mode
        self.wandb = wandb
        self._sweep_dir: Path | None = None
        self._config: Any = None
        self._fallback: Any = None

    @staticmethod
    def _resolve_sweep_dir(config: Any) -> Path:
        # Resolving here fills the `${now:}` cache of this config, which the sweeper shares.
        return Path(os.path.abspath(str(config.hydra.sweep.dir)))

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        try:
            self._config = config
            self._sweep_dir = self._resolve_sweep_dir(config)
            self._unregister()
            sweep_dir = self._sweep_dir

            def fallback() -> None:
                if find_job_dirs(sweep_dir):  # else the sweep never got to a job: nothing to say
                    self._summarise(sweep_dir, " (the multirun did not finish)")

            self._fallback = fallback
            atexit.register(fallback)
            _UNFINISHED.append(self)
        except Exception as e:  # a summary problem must not fail the sweep
            log.warning("sweep summary: could not set up (%s: %s)", type(e).__name__, e)

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        try:
            self._unregister()
            self._config = self._config if self._config is not None else config
            sweep_dir = self._sweep_dir or self._resolve_sweep_dir(config)
        except Exception as e:  # a summary problem must not fail the sweep
            log.warning("sweep summary: no sweep dir (%s: %s)", type(e).__name__, e)
            return
        self._summarise(sweep_dir)

    def _unregister(self) -> None:
        if self._fallback is not None:
            atexit.unregister(self._fallback)
            self._fallback = None
        if self in _UNFINISHED:
            _UNFINISHED.remove(self)

    def finish(self) -> None:
        """The fallback now, if the multirun has not ended (then it runs once only)."""
        fallback = self._fallback
        self._unregister()
        if fallback is not None:
            fallback()

    def _summarise(self, sweep_dir: Path, when: str = "") -> SweepSummary | None:
        try:
            summary = write_summary(sweep_dir, self.metric, self.mode)
        except Exception as e:  # never fail the sweep over its summary
            log.warning(
                "sweep summary for %s not written (%s: %s)",
                sweep_dir,
                type(e).__name__,
                _one_line(e),
            )
            return None
        try:
            print(f"\n{headline(summary)}{when}:")
            print(format_table(summary.rows, summary.swept_keys), flush=True)
        except Exception as e:  # e.g. a closed stdout at interpreter exit
            log.warning("sweep summary written to %s but not printed (%s)", sweep_dir, e)
        if self.wandb:
            try:
                found = wandb_settings(self._config)
            except Exception as e:  # noqa: BLE001 - e.g. an interpolation that does not resolve
                log.warning("sweep summary: no W&B run (%s)", _one_line(e))
                found = None
            if found is not None:
                log_to_wandb(summary, *found)
        return summary


# The callbacks whose multirun started and has not ended.
_UNFINISHED: list[SweepSummaryCallback] = []


def finish_unfinished_sweeps() -> None:
    """Write the summary of every multirun of this process that started but did not end (its
    sweeper raised), while the interpreter is still whole."""
    for callback in list(_UNFINISHED):
        callback.finish()


# --------------------------------------------------------------------------------------------
# CLI


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m launch.summary",
        description="Write summary.csv/.md/.png for a Hydra sweep dir and print its table.",
    )
    parser.add_argument("sweep_dir", type=Path, help="the multirun dir (holds the job dirs)")
    parser.add_argument(
        "--metric",
        default="best",
        choices=METRICS,
        help="column to rank jobs by (default: best, each job's monitored metric)",
    )
    parser.add_argument(
        "--mode",
        default=None,
        choices=MODES,
        help="max: higher is better; min: lower is better (default: the jobs' monitor mode)",
    )
    parser.add_argument(
        "--wandb",
        action="store_true",
        help="also log a W&B sweep-summary run, as the sweep's wandb settings say",
    )
    args = parser.parse_args(argv)
    if not args.sweep_dir.is_dir():
        print(f"error: {args.sweep_dir} is not a directory", file=sys.stderr)
        return 1
    try:
        summary = write_summary(args.sweep_dir, args.metric, args.mode)
    except FileNotFoundError as e:
        print(f"error: {_one_line(e)}", file=sys.stderr)
        return 1
    print(headline(summary))
    print(format_table(summary.rows, summary.swept_keys))
    if args.wandb:
        found = wandb_settings(read_multirun_config(args.sweep_dir))
        if found is None:
            print(f"error: no wandb settings in {args.sweep_dir / MULTIRUN_YAML}", file=sys.stderr)
            return 1
        run_id = log_to_wandb(summary, *found)
        print(f"W&B sweep-summary run: {run_id}" if run_id else "no W&B run (see above)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
