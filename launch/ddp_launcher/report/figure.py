"""summary.png: the app's curves from its metrics.jsonl, one panel per metric (the monitored one
and the losses unless the app names its panels), one style per job."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ddp_launcher.core.run_dir import atomic_path
from ddp_launcher.report.jobs import SweepSummary, x_unit
from ddp_launcher.report.tables import job_label

MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">")
LINESTYLES = ("-", "--", ":", "-.")


def plot_summary(summary: SweepSummary, path: Path, title: str = "") -> None:
    """Write :func:`summary_figure` to `path` (PNG)."""
    import matplotlib.pyplot as plt

    fig = summary_figure(summary, title)
    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, format="png", dpi=100, bbox_inches="tight")
    finally:
        plt.close(fig)


def once_per_x(points: list[tuple[float, float]]) -> bool:
    """Whether a curve has at most one point per epoch (a value per epoch, e.g. validation)."""
    return len({math.ceil(x) for x, _ in points}) == len(points)


def summary_figure(summary: SweepSummary, title: str = "") -> Any:
    """One panel per metric of `summary.panels`; one colour, marker and line style per job
    (hollow markers, the points of a once-per-epoch curve spread apart, so that equal curves
    stay visible), integer epoch ticks, one legend of the swept values, jobs in rank order."""
    import matplotlib

    matplotlib.use("Agg", force=True)  # no display, and never the caller's interactive backend
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    rows, panels = summary.rows, summary.panels
    fig, axes = plt.subplots(
        1, len(panels), figsize=(5 * len(panels), 4.2), sharex=True, squeeze=False
    )
    axes = list(axes[0])
    try:
        colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        n = len(rows)
        spread = min(0.08, 0.4 / max(n - 1, 1))  # how far apart one epoch's points of n jobs
        last_x = max((x for r in rows for k in panels for x, _ in r.curves.get(k, [])), default=1)
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
            for ax, key in zip(axes, panels, strict=True):
                points = row.curves.get(key, [])
                if once_per_x(points):
                    points, every = [(x + dodge, y) for x, y in points], 1
                else:
                    every = max(1, len(points) // 8)
                if points:
                    xs, ys = zip(*points, strict=True)
                    (handle,) = ax.plot(xs, ys, markevery=every, **style)
            if handle is not None:
                handles.append(handle)
                status = "" if row.status == "completed" else f" [{row.status}]"
                labels.append(f"#{row.job} {job_label(row, summary.swept_keys)}{status}")
        unit = x_unit(rows)
        for ax, key in zip(axes, panels, strict=True):
            ax.set_title(key, fontsize="medium")
            ax.set_xlabel(unit)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
            ax.set_xlim(0, last_x + 0.5 if unit == "epoch" else last_x * 1.05 + 1)
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
