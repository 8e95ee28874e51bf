"""Sweep summary: one table (CSV, Markdown, text) and one val/acc plot for a Hydra multirun.

Reads every job dir of a sweep dir (``<sweep_dir>/<subdir>/`` holding ``.hydra/``,
``result.json`` or ``metrics.jsonl``; ``launch.json`` for the attempts) and writes
``summary.csv``, ``summary.md`` and ``summary.png`` next to ``multirun.yaml``. Used three ways:

* as a Hydra callback, written at the end of every multirun (also when a job failed)::

      hydra:
        callbacks:
          sweep_summary:
            _target_: launch.summary.SweepSummaryCallback

* from the command line for any sweep dir: ``python -m launch.summary <sweep_dir>``;
* from Python: :func:`write_summary`, :func:`collect_jobs`, :func:`format_table`.

Cheap to import (Hydra loads callbacks at startup): no torch, matplotlib only when plotting.
"""

from __future__ import annotations

import argparse
import atexit
import csv
import io
import json
import logging
import math
import os
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from hydra.experimental.callback import Callback

from components.run_dir import METRICS_FILE, OVERRIDES_FILE, RESULT_FILE, read_metrics
from launch.resume import read_launch_record

log = logging.getLogger(__name__)

CSV_NAME = "summary.csv"
MD_NAME = "summary.md"
PNG_NAME = "summary.png"
NO_RESULT_ERROR = f"no {RESULT_FILE}"

# Fields of JobSummary a sweep can be ranked by.
METRICS = ("best_val_acc", "final_val_acc", "final_val_loss", "wall_time_s", "samples_per_s")
MODES = ("max", "min")
CSV_COLUMNS = (
    "job",
    "overrides",
    "status",
    "best_val_acc",
    "final_val_acc",
    "final_val_loss",
    "wall_time_s",
    "samples_per_s",
    "attempts",
    "error",
)
_TABLE_COLUMNS = (  # (header, field) of the text / Markdown tables; overrides and error last
    ("job", "job"),
    ("status", "status"),
    ("best_val_acc", "best_val_acc"),
    ("final_val_acc", "final_val_acc"),
    ("final_val_loss", "final_val_loss"),
    ("wall_time_s", "wall_time_s"),
    ("samples/s", "samples_per_s"),
    ("attempts", "attempts"),
    ("overrides", "overrides"),
)
_DECIMALS = {"wall_time_s": 1, "samples_per_s": 1}  # everything else: 4


@dataclass
class JobSummary:
    """One job of a sweep. Numbers are None when neither result.json nor metrics.jsonl has them."""

    job: str
    overrides: str = ""
    status: str = "failed"
    attempts: int | None = None  # launch.json's: a launcher's retries and resumed sweeps
    best_val_acc: float | None = None
    final_val_acc: float | None = None
    final_val_loss: float | None = None
    wall_time_s: float | None = None
    samples_per_s: float | None = None
    error: str | None = None
    epochs: list[tuple[int | float, float]] = field(default_factory=list)  # (epoch, val/acc)


@dataclass
class SweepSummary:
    """What :func:`write_summary` wrote: the three files and the rows, best first."""

    sweep_dir: Path
    csv_path: Path
    md_path: Path
    png_path: Path
    rows: list[JobSummary]
    metric: str = "best_val_acc"
    mode: str = "max"


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
        (path / name).exists() for name in (".hydra", RESULT_FILE, METRICS_FILE)
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
    """best/final val numbers, per-epoch val/acc and mean throughput derived from metrics rows."""
    by_epoch: dict[int | float, float] = {}
    best = final_acc = final_loss = None
    speeds: list[float] = []
    for row in rows:
        acc, loss = _number(row.get("val/acc")), _number(row.get("val/loss"))
        if acc is not None or loss is not None:  # a val row (possibly also a train row)
            final_acc, final_loss = acc, loss
            if acc is not None:
                if not math.isnan(acc) and (best is None or acc > best):
                    best = acc
                epoch = _number(row.get("epoch"))
                # A resumed job may log an epoch twice: its last val/acc wins.
                if epoch is None:
                    epoch = float(len(by_epoch))
                by_epoch[int(epoch) if epoch.is_integer() else epoch] = acc
        speed = _number(row.get("samples_per_s"))
        if speed is not None:
            speeds.append(speed)
    return {
        "best_val_acc": best,
        "final_val_acc": final_acc,
        "final_val_loss": final_loss,
        "samples_per_s": sum(speeds) / len(speeds) if speeds else None,
        "epochs": sorted(by_epoch.items()),
    }


def read_job(job_dir: str | os.PathLike) -> JobSummary:
    """Summarise one job dir: result.json first, gaps filled from metrics.jsonl."""
    job_dir = Path(job_dir)
    derived = _from_metrics(read_metrics(job_dir / METRICS_FILE))
    result: dict[str, Any] = {}
    result_path = job_dir / RESULT_FILE
    status, error = "failed", NO_RESULT_ERROR
    if result_path.is_file():
        try:
            loaded = json.loads(result_path.read_text(encoding="utf-8"))
            if not isinstance(loaded, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as e:
            error = _one_line(f"unreadable result.json: {e}")
        else:
            result = loaded
            status = _one_line(result.get("status") or "failed")
            error = None if result.get("error") is None else _one_line(result["error"])

    overrides = _read_overrides(job_dir)
    if overrides is None and isinstance(result.get("overrides"), list):
        overrides = [str(o) for o in result["overrides"]]

    def pick(key: str) -> float | None:
        value = _number(result.get(key))
        return derived.get(key) if value is None else value

    record = read_launch_record(job_dir)
    return JobSummary(
        job=job_dir.name,
        overrides=" ".join(overrides or []),
        status=status,
        attempts=len(record.attempts) if record is not None else None,
        best_val_acc=pick("best_val_acc"),
        final_val_acc=pick("final_val_acc"),
        final_val_loss=pick("final_val_loss"),
        wall_time_s=pick("wall_time_s"),
        samples_per_s=pick("samples_per_s"),
        error=error,
        epochs=derived["epochs"],
    )


def collect_jobs(sweep_dir: str | os.PathLike) -> list[JobSummary]:
    """One JobSummary per job dir of ``sweep_dir``, in job order (``0``, ``1``, …, ``10``)."""
    return [read_job(d) for d in find_job_dirs(sweep_dir)]


def _check_metric(metric: str, mode: str) -> None:
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}: choose one of {', '.join(METRICS)}")
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}: choose 'max' or 'min'")


def sort_jobs(
    rows: Iterable[JobSummary], metric: str = "best_val_acc", mode: str = "max"
) -> list[JobSummary]:
    """Best first by ``metric``; jobs without it (None or NaN) last, each group in job order."""
    _check_metric(metric, mode)

    def key(row: JobSummary) -> tuple[int, float]:
        value = getattr(row, metric)
        if value is None or math.isnan(value):
            return (1, 0.0)
        return (0, -value if mode == "max" else value)

    return sorted(rows, key=key)


# --------------------------------------------------------------------------------------------
# Rendering


def _fmt(name: str, value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{_DECIMALS.get(name, 4)}f}"
    return str(value)


def _cells(row: JobSummary) -> list[str]:
    return [_fmt(name, getattr(row, name)) for _, name in _TABLE_COLUMNS]


def _failures(rows: Sequence[JobSummary]) -> list[JobSummary]:
    return [r for r in rows if r.status != "completed"]


def format_table(rows: Sequence[JobSummary]) -> str:
    """A fixed-width text table of ``rows`` (in the given order), then the failed jobs if any."""
    headers = [h for h, _ in _TABLE_COLUMNS]
    body = [_cells(r) for r in rows]
    widths = [max(len(c) for c in col) for col in zip(headers, *body, strict=True)]
    numeric = {i for i, (_, name) in enumerate(_TABLE_COLUMNS) if name in METRICS}

    def line(cells: Sequence[str]) -> str:
        parts = [
            c.rjust(w) if i in numeric else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(parts).rstrip()

    out = [line(headers), line(["-" * w for w in widths])] + [line(c) for c in body]
    failed = _failures(rows)
    if failed:
        out += ["", "Failed jobs:"]
        for r in failed:
            out.append(
                f"  job {r.job} [{r.status}] {r.overrides or '(no overrides)'}: "
                f"{r.error or 'no error recorded'}"
            )
    return "\n".join(out)


def _md_escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace("|", "\\|")


def format_markdown(
    rows: Sequence[JobSummary], metric: str = "best_val_acc", mode: str = "max", title: str = ""
) -> str:
    headers = ["rank", *(h for h, _ in _TABLE_COLUMNS), "error"]
    lines = [f"# Sweep summary{': ' + title if title else ''}", ""]
    lines.append(
        f"{len(rows)} jobs, {sum(r.status == 'completed' for r in rows)} completed; "
        f"sorted by `{metric}` ({mode})."
    )
    lines += ["", "| " + " | ".join(headers) + " |"]
    names = ["rank", *(n for _, n in _TABLE_COLUMNS), "error"]
    align = ["---:" if n == "rank" or n in METRICS else "---" for n in names]
    lines.append("| " + " | ".join(align) + " |")
    for rank, row in enumerate(rows, 1):
        cells = [str(rank), *_cells(row), row.error or ""]
        lines.append("| " + " | ".join(_md_escape(c) for c in cells) + " |")
    lines += ["", f"![val/acc per epoch]({PNG_NAME})", ""]
    return "\n".join(lines)


def _csv_value(value: Any) -> Any:
    return "" if value is None else value


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _label(row: JobSummary, limit: int = 60) -> str:
    text = row.overrides or f"job {row.job}"
    return text if len(text) <= limit else text[: limit - 1] + "…"


def plot_val_acc(rows: Sequence[JobSummary], path: Path, title: str = "") -> None:
    """One line of val/acc per epoch per job, legend = overrides; a note if there is no data."""
    import matplotlib

    matplotlib.use("Agg", force=True)  # no display, and never the caller's interactive backend
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    try:
        plotted = 0
        for row in rows:
            if not row.epochs:
                continue
            xs, ys = zip(*row.epochs, strict=True)
            style = "-" if row.status == "completed" else "--"
            ax.plot(xs, ys, style, marker="o", markersize=3, label=_label(row))
            plotted += 1
        if plotted:
            ax.legend(
                fontsize="small" if plotted <= 12 else "x-small",
                loc="best",
                ncol=1 if plotted <= 20 else 2,
            )
        else:
            ax.text(
                0.5, 0.5, "no val/acc recorded", ha="center", va="center", transform=ax.transAxes
            )
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("epoch")
        ax.set_ylabel("val/acc (top-1)")
        ax.set_title(f"val/acc per epoch{': ' + title if title else ''}", fontsize="medium")
        ax.grid(True, alpha=0.3)
        tmp = path.with_name(f".{path.name}.tmp")
        fig.savefig(tmp, format="png", dpi=100, bbox_inches="tight")
        os.replace(tmp, path)
    finally:
        plt.close(fig)


def write_summary(
    sweep_dir: str | os.PathLike, metric: str = "best_val_acc", mode: str = "max"
) -> SweepSummary:
    """Write summary.csv, summary.md and summary.png into ``sweep_dir``; rows best first.

    Raises ValueError for an unknown metric/mode and FileNotFoundError when ``sweep_dir`` has
    no job dirs.
    """
    _check_metric(metric, mode)
    root = Path(sweep_dir)
    jobs = collect_jobs(root)
    if not jobs:
        raise FileNotFoundError(
            f"no job dirs in {root} (nothing with .hydra/, {RESULT_FILE} or {METRICS_FILE})"
        )
    rows = sort_jobs(jobs, metric, mode)
    title = root.name

    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for row in rows:
        writer.writerow([_csv_value(getattr(row, c)) for c in CSV_COLUMNS])
    summary = SweepSummary(
        root, root / CSV_NAME, root / MD_NAME, root / PNG_NAME, rows, metric, mode
    )
    _write_atomic(summary.csv_path, buf.getvalue())
    _write_atomic(summary.md_path, format_markdown(rows, metric, mode, title))
    plot_val_acc(rows, summary.png_path, title)
    return summary


# --------------------------------------------------------------------------------------------
# Hydra callback


class SweepSummaryCallback(Callback):
    """Writes the sweep summary at the end of a multirun, and prints its table.

    Hydra's BasicSweeper raises on the first failed job, so ``on_multirun_end`` never runs
    then; an ``atexit`` fallback registered in ``on_multirun_start`` writes the summary
    instead. Nothing here raises: a summary problem is logged as a warning, never fails a sweep.
    """

    def __init__(self, metric: str = "best_val_acc", mode: str = "max") -> None:
        self.metric = metric
        self.mode = mode
        self._sweep_dir: Path | None = None
        self._fallback: Any = None

    @staticmethod
    def _resolve_sweep_dir(config: Any) -> Path:
        # Resolving here fills the `${now:}` cache of this config, which the sweeper shares.
        return Path(os.path.abspath(str(config.hydra.sweep.dir)))

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        try:
            self._sweep_dir = self._resolve_sweep_dir(config)
            self._unregister()
            sweep_dir = self._sweep_dir

            def fallback() -> None:
                if find_job_dirs(sweep_dir):  # else the sweep never got to a job: nothing to say
                    self._summarise(sweep_dir, " at exit (the multirun did not finish)")

            self._fallback = fallback
            atexit.register(fallback)
        except Exception as e:  # a summary problem must not fail the sweep
            log.warning("sweep summary: could not set up (%s: %s)", type(e).__name__, e)

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        try:
            self._unregister()
            sweep_dir = self._sweep_dir or self._resolve_sweep_dir(config)
        except Exception as e:  # a summary problem must not fail the sweep
            log.warning("sweep summary: no sweep dir (%s: %s)", type(e).__name__, e)
            return
        self._summarise(sweep_dir)

    def _unregister(self) -> None:
        if self._fallback is not None:
            atexit.unregister(self._fallback)
            self._fallback = None

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
            print(f"\nSweep summary ({sweep_dir}, by {self.metric} {self.mode}):")
            print(format_table(summary.rows), flush=True)
            log.info(
                "sweep summary written%s: %s, %s, %s",
                when,
                summary.csv_path,
                summary.md_path.name,
                summary.png_path.name,
            )
        except Exception as e:  # e.g. a closed stdout at interpreter exit
            log.warning("sweep summary written to %s but not printed (%s)", sweep_dir, e)
        return summary


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
        default="best_val_acc",
        choices=METRICS,
        help="column to rank jobs by (default: best_val_acc)",
    )
    parser.add_argument(
        "--mode",
        default="max",
        choices=MODES,
        help="max: higher is better; min: lower is better (default: max)",
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
    print(format_table(summary.rows))
    print(f"\nwrote {summary.csv_path}, {summary.md_path.name}, {summary.png_path.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
