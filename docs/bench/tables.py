"""The throughput report: one cell's runs summarised (medians over repeats), the targets
checked, and the tables `python -m docs.bench` prints."""

from __future__ import annotations

from docs.bench.common import fmt, fmt_mb, markdown, median, ratio
from docs.bench.workloads import FIRST_STEP_MARGIN_S, MODES, TARGETS, WORKLOADS, Setup, best_rate


def peak_per_rank(runs: list[dict]) -> list[float] | None:
    """Each rank's peak over the repeats."""
    lists = [r["peak_memory_mb_per_rank"] for r in runs if r.get("peak_memory_mb_per_rank")]
    return [max(values) for values in zip(*lists, strict=True)] if lists else None


def summarize(s: Setup, runs: dict[str, list[dict]], imports: list[float]) -> dict:
    rate = {mode: median(r.get("samples_per_s") for r in runs[mode]) for mode in MODES}
    best = {
        mode: max(
            (best_rate(r["window_rates"]) or 0.0 for r in runs[mode] if r.get("window_rates")),
            default=None,
        )
        for mode in MODES
    }
    first = {mode: median(r.get("time_to_first_step_s") for r in runs[mode]) for mode in MODES}
    row = {
        "workload": s.workload,
        "description": WORKLOADS[s.workload].description,
        "world_size": s.world_size,
        "workers": s.workers,
        "steps": s.steps,
        "log_every": s.log_every,
        "omp_num_threads": s.threads,
        "samples_per_s": rate,
        "ratios": {
            "train_vs_reference": ratio(rate["train.py"], rate["reference"]),
            "train_vs_raw": ratio(rate["train.py"], rate["raw"]),
            "reference_vs_raw": ratio(rate["reference"], rate["raw"]),
        },
        # Fastest window of any repeat: a check on the medians when the machine is shared.
        "best_window_samples_per_s": best,
        "best_window_ratios": {
            "train_vs_reference": ratio(best["train.py"], best["reference"]),
            "train_vs_raw": ratio(best["train.py"], best["raw"]),
        },
        "time_to_first_step_s": first,
        # train.py's startup beyond the plain recipe's (both include the first step's compute)
        "first_step_overhead_s": (
            first["train.py"] - first["reference"]
            if None not in (first["train.py"], first["reference"])
            else None
        ),
        "import_s": median(imports),
        "peak_memory_mb_per_rank": {mode: peak_per_rank(runs[mode]) for mode in MODES},
        "failed_runs": sum("error" in r for mode in MODES for r in runs[mode]),
        "runs": runs,
        "imports_s": imports,
    }
    row["targets"] = targets(row)
    return row


def targets(row: dict) -> dict[str, dict]:
    """Each target of this row: value, threshold, and PASS / MISS / n/a (not measured)."""
    out = {}
    for name, workload, world in TARGETS:
        if workload not in (None, row["workload"]) or world not in (None, row["world_size"]):
            continue
        if workload is None:  # time to first step against the import floor
            value, higher = row["time_to_first_step_s"]["train.py"], False
            margin = FIRST_STEP_MARGIN_S[world]
            limit = row["import_s"] + margin if row["import_s"] is not None else None
        elif "train/raw" in name:
            value, limit, higher = row["ratios"]["train_vs_raw"], float(name.split()[-1]), True
        else:
            value, higher = row["ratios"]["train_vs_reference"], True
            limit = float(name.split()[-1])
        if value is None or limit is None:
            verdict = "n/a"
        else:
            verdict = "PASS" if (value >= limit if higher else value <= limit) else "MISS"
        out[name] = {"value": value, "threshold": limit, "verdict": verdict}
    return out


def table(rows: list[dict]) -> str:
    """The summary as a Markdown table (readable in a terminal, pasteable into the README)."""
    head = [
        "workload",
        "world",
        "workers",
        "train.py s/s",
        "reference s/s",
        "raw s/s",
        "train/ref",
        "train/raw",
        "1st step train.py / ref s",
        "import s",
        "train.py - import s",
        "peak MB/rank train.py / ref",
        "targets",
    ]
    lines = [head]
    for row in rows:
        rate, first, mem = (
            row["samples_per_s"],
            row["time_to_first_step_s"],
            row["peak_memory_mb_per_rank"],
        )
        above = (
            first["train.py"] - row["import_s"]
            if None not in (first["train.py"], row["import_s"])
            else None
        )
        verdicts = "; ".join(f"{name} {t['verdict']}" for name, t in row["targets"].items())
        lines.append(
            [
                workload_label(row),
                str(row["world_size"]),
                fmt_workers(row.get("workers")),
                *(fmt(rate[m], ".1f") for m in MODES),
                fmt(row["ratios"]["train_vs_reference"], ".3f"),
                fmt(row["ratios"]["train_vs_raw"], ".3f"),
                f"{fmt(first['train.py'], '.2f')} / {fmt(first['reference'], '.2f')}",
                fmt(row["import_s"], ".2f"),
                fmt(above, "+.2f"),
                f"{fmt_mb(mem['train.py'])} / {fmt_mb(mem['reference'])}",
                verdicts,
            ]
        )
    return markdown(lines)


def workload_label(row: dict) -> str:
    """The workload, and its interpreter where several were compared (--compare-python)."""
    return row["workload"] + (f" ({row['python']})" if row.get("python") else "")


def fmt_workers(workers: int | None) -> str:
    return "-" if workers is None else str(workers)


def best_table(rows: list[dict]) -> str:
    """Best-window samples/s per mode and their ratios (informational)."""
    lines = [
        [
            "workload",
            "world",
            "workers",
            "best train.py s/s",
            "best reference s/s",
            "best raw s/s",
            "train/ref",
            "train/raw",
        ]
    ]
    for row in rows:
        best, ratios = row["best_window_samples_per_s"], row["best_window_ratios"]
        lines.append(
            [
                workload_label(row),
                str(row["world_size"]),
                fmt_workers(row.get("workers")),
                *(fmt(best[m], ".1f") for m in MODES),
                fmt(ratios["train_vs_reference"], ".3f"),
                fmt(ratios["train_vs_raw"], ".3f"),
            ]
        )
    return markdown(lines)


def legend(rows: list[dict], repeats: int, cores: int) -> str:
    used = sorted({r["workload"] for r in rows})
    lines = [
        f"{w} = {WORKLOADS[w].description}, global batch {WORKLOADS[w].global_batch}" for w in used
    ]
    steps = ", ".join(
        sorted({f"{r['workload']}: {r['steps']} steps, windows of {r['log_every']}" for r in rows})
    )
    lines += [
        f"{cores} CPU cores, OMP_NUM_THREADS = {cores} / world size; gloo; {repeats} "
        f"repeat(s) per mode, alternated; {steps}.",
        "s/s: samples/s, median over repeats of each run's median window rate after the first "
        "window. workers: DataLoader workers per rank, both sides (-: B's in-memory fast "
        "path). 1st step: process start -> end of the first optimizer step (rank 0). import: "
        '`python -c "import torch, torchvision"`, the floor. peak MB: max RSS per rank. '
        "reference: torchvision's dataset + v1 transforms (ToTensor, Normalize; C: FakeData, "
        "whose images train.py's `fake` draws without reseeding the global RNG, "
        "data/catalog.py FakeImages) + DataLoader + DistributedSampler + DDP. "
        "Targets are informational (PASS/MISS; n/a: not measured).",
    ]
    return "\n".join(lines)
