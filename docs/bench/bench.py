"""Throughput benchmark: train.py against the plain DDP recipe and a raw loop, same workload.

    python -m docs.bench [--workloads A,B] [--world-sizes 1,2] [--repeats 3] [--steps N]
                           [--smoke] [--out results.json] [--compare-python OTHER_PYTHON]

For each workload x world size it runs three modes, each as its own process (world size 2:
``python -m torch.distributed.run --standalone --nproc-per-node=2 ...``), alternating them
``--repeats`` times with the order rotated each repeat, so that machine noise hits all three
alike:

  train.py   train.py with the matching config (metrics.jsonl's samples_per_s windows)
  reference  docs/bench/reference.py --mode reference: DataLoader + DistributedSampler + DDP +
             set_epoch, nothing else
  raw        docs/bench/reference.py --mode raw: forward/backward/step on one pre-built batch

Workloads: A = torchvision resnet18 (3x3 stem) on FakeData 3x32x32, global batch 64; B = the
small CNN on MNIST-format idx files generated here (~30k samples), global batch 256. Every
process gets OMP_NUM_THREADS = cores / world size. Steady-state samples/s is the median of the
per-window rates (``log_every`` steps per window, rank 0's clock) after the first window
(warm-up); each mode's number is the median over repeats. Also reported: time from process
start to the end of the first optimizer step, ``python -c "import torch, torchvision"`` wall
time, peak RSS per rank. Targets are printed PASS/MISS for information: only a run that fails
makes the exit status non-zero.

Workload E (docs/bench/time_to_accuracy.py, `--workloads E --real-data DIR`): time to accuracy on
real MNIST and Fashion-MNIST (built by docs/bench/real_data.py), seeds 0-4 (`--e-seeds 0`: a
quick look): this tree's train.py, b2beecb's (`--e-baseline`) and the seed recipe side by side.
Workload V (docs/bench/seed_spread.py, `--workloads V`): every shipped default on seeds 0-4, one
seed sweep each: mean, std and the worst seed. Workload G (docs/bench/gpu.py, `--workloads G`):
the prepared GPU check, <= 7 min on one GPU (without one, or without its packages: one line,
exit status 2; `python -m docs.bench.gpu run .whl` installs them from wheels built here).

This module is the command line and the runs; workloads.py defines the workloads, tables.py
the report, common.py what every workload shares (all in docs/bench/). None imports torch.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from docs.bench.common import (
    JPEG_CLASSES,
    REPO,
    RESULT_TAG,
    app_part,
    fmt,
    launch,
    make_jpegs,
    make_mnist,
    run_env,
    run_process,
    torch_label,
)
from docs.bench.tables import best_table, legend, summarize, table
from docs.bench.workloads import (
    D_CHANNELS,
    D_HIDDEN,
    GPU_CHECK,
    MODES,
    PLAIN_LR,
    SEED_SPREAD,
    SMOKE_STEPS,
    STARTUP,
    TARGETS,
    TIME_TO_ACCURACY,
    WARMUP_WINDOWS,
    WINDOWS,
    WORKLOADS,
    Setup,
    Workload,
    steady_rate,
)


def train_file_size(train_samples: int, val_fraction: float = 0.1) -> int:
    """Samples the generated training file needs so that train.py, which carves
    ``val_fraction`` of it as val (conf/dataset/mnist.yaml), trains on ``train_samples``."""
    n = train_samples
    while n - math.ceil(val_fraction * n) < train_samples:
        n += 1
    return n


def resolve_workers(value: int | str, world_size: int) -> int:
    """A workload's workers per rank as train.py resolves ``dataset.num_workers`` (auto: this
    rank's share of the cores less one), so that both sides get the same number."""
    from data.loaders import data_workers

    return data_workers(value, world_size)


def train_overrides(s: Setup, run_dir: Path) -> list[str]:
    spec = WORKLOADS[s.workload]
    size = s.steps * spec.global_batch  # one epoch = s.steps optimizer steps at any world size
    if s.workload in ("A", "C"):
        data = [
            "model=resnet18",
            f"model.small_input_stem={str(s.workload == 'A').lower()}",
            "dataset=fake",
            f"dataset.size={size}",
            "dataset.image_size=32",
            "dataset.num_classes=10",
        ]
    elif s.workload == "B":
        data = ["model=small_cnn", "dataset=mnist", f"dataset.root={s.data_root}"]
        # the reference's model, math and augmentation, not MNIST's time-to-accuracy recipe
        # (conf/recipe/mnist.yaml: --train-override B:... measures its levers against raw)
        data += ["model.channels=[32,64]", "model.batch_norm=false", "optim.nesterov=false"]
        data += ["trainer.precision=32", "trainer.channels_last=false", "augment=shift"]
    else:
        data = [
            "model=small_cnn",
            f"model.channels=[{','.join(map(str, D_CHANNELS))}]",
            f"model.hidden={D_HIDDEN}",
            "dataset=imagefolder",
            f"dataset.root={s.data_root}",
            f"dataset.image_size={spec.shape[-1]}",
        ]
    if s.workers is not None:
        data.append(f"dataset.num_workers={s.workers}")
    return [
        *data,
        "optim=sgd",
        # the reference's plain SGD (docs/bench/reference.py LR): the lr as given, one parameter
        # group, no warm-up
        f"optim.lr={PLAIN_LR}",
        "optim.lr_scaling=none",
        "optim.decay_norm_and_bias=true",
        "trainer.warmup_epochs=0",
        "trainer.grad_clip=null",  # as the reference (imagefolder's recipe clips)
        f"trainer.batch_size={spec.global_batch}",
        "trainer.max_epochs=1",
        "trainer.test_after_fit=false",  # training throughput only
        f"trainer.log_every_n_steps={s.log_every}",
        "trainer.progress_bar=false",
        "trainer.device=cpu",
        "dist.backend=gloo",
        "wandb.mode=disabled",
        f"hydra.run.dir={run_dir}",
        *s.train_overrides,
    ]


def run_mode(s: Setup, mode: str, run_dir: Path) -> dict:
    """One process (or torchrun job) of ``mode``; its measurements, or ``error`` on failure."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if mode == "train.py":
        target = ["train.py", *train_overrides(s, run_dir)]
    else:
        target = [
            "-m",
            "docs.bench.reference",
            "--workload",
            s.workload,
            "--mode",
            mode,
            "--steps",
            str(s.steps),
            "--log-every",
            str(s.log_every),
            "--num-workers",
            str(s.workers or 0),
        ]
        if s.data_root is not None:
            target += ["--data-root", str(s.data_root)]
    cmd = launch(s.world_size, target, s.python)
    tic = time.perf_counter()
    stdout, stderr, rc = run_process(cmd, run_env(s.threads), s.timeout_s)
    wall = time.perf_counter() - tic
    (run_dir / "bench_stdout.txt").write_text(stdout)
    (run_dir / "bench_stderr.txt").write_text(stderr)
    out = {"mode": mode, "wall_s": wall, "command": cmd, "run_dir": str(run_dir)}
    if rc != 0:
        tail = "\n".join((stdout + stderr).strip().splitlines()[-15:])
        return {**out, "error": f"exit status {rc}: {tail}"}
    try:
        found = train_result(run_dir) if mode == "train.py" else reference_result(stdout)
    except (OSError, ValueError, KeyError) as e:
        return {**out, "error": f"no result: {e}"}
    return {**out, **found, "samples_per_s": steady_rate(found["window_rates"])}


def train_result(run_dir: Path) -> dict:
    """Window rates from metrics.jsonl; time to first step and peak memory from result.json
    (None where this train.py does not record them)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rates = [row["samples_per_s"] for row in rows if "samples_per_s" in row]
    if not rates:
        raise ValueError(f"no train rows with samples_per_s in {run_dir / 'metrics.jsonl'}")
    result_path = run_dir / "result.json"
    result = app_part(json.loads(result_path.read_text())) if result_path.exists() else {}
    peaks = [row["peak_mem_mb"] for row in rows if "peak_mem_mb" in row]
    return {
        "window_rates": rates,
        "time_to_first_step_s": result.get("time_to_first_step_s"),
        "peak_memory_mb_per_rank": result.get("peak_memory_mb_per_rank"),
        # rank 0's peak while training (train rows), i.e. before the end-of-epoch validation
        "training_peak_mb_rank0": max(peaks) if peaks else None,
    }


def reference_result(stdout: str) -> dict:
    for line in reversed(stdout.splitlines()):
        if line.startswith(RESULT_TAG):
            found = json.loads(line[len(RESULT_TAG) :])
            keys = ("window_rates", "time_to_first_step_s", "peak_memory_mb_per_rank")
            return {k: found[k] for k in keys}
    raise ValueError(f"no {RESULT_TAG.strip()} line in the output")


def import_time(threads: int, python: str | None = None) -> float:
    """Wall time of ``python -c "import torch, torchvision"`` (interpreter start included)."""
    tic = time.perf_counter()
    subprocess.run(
        [python or sys.executable, "-c", "import torch, torchvision"],
        cwd=REPO,
        env=run_env(threads),
        check=True,
        capture_output=True,
    )
    return time.perf_counter() - tic


def bench_cell(s: Setup, repeats: int, work: Path) -> dict:
    """All modes of one workload x world size, alternated ``repeats`` times; the summary row."""
    (row,) = bench_cells([s], repeats, work)
    return row


def bench_cells(setups: list[Setup], repeats: int, work: Path) -> list[dict]:
    """All modes of each setup (one cell under several interpreters: --compare-python), every
    setup's modes in turn, ``repeats`` rounds; a summary row per setup."""
    runs: list[dict[str, list[dict]]] = [{mode: [] for mode in MODES} for _ in setups]
    imports: list[list[float]] = [[] for _ in setups]
    items = ("import", *MODES)  # the import timing takes its turn in the rotation too
    for r in range(repeats):
        for i, s in enumerate(setups):
            for mode in items[r % len(items) :] + items[: r % len(items)]:
                if mode == "import":
                    imports[i].append(import_time(s.threads, s.python))
                    continue
                run_dir = work / f"{cell_name(s)}-py{i}" / f"r{r}-{mode.replace('.', '_')}"
                res = run_mode(s, mode, run_dir)
                runs[i][mode].append(res)
                progress(s, r, repeats, res)
    rows = [summarize(s, runs[i], imports[i]) for i, s in enumerate(setups)]
    if len(setups) > 1:
        for s, row in zip(setups, rows, strict=True):
            row["python"] = torch_label(s.python)
    return rows


def cell_name(s: Setup) -> str:
    return f"{s.workload}-ws{s.world_size}" + ("" if s.workers is None else f"-w{s.workers}")


def progress(s: Setup, r: int, repeats: int, res: dict) -> None:
    workers = "" if s.workers is None else f" workers {s.workers}"
    where = (
        f"[{s.workload} world {s.world_size}{workers} repeat {r + 1}/{repeats}] {res['mode']:9s}"
    )
    if "error" in res:
        print(f"{where} FAILED ({res['wall_s']:.1f} s): {res['error']}", file=sys.stderr)
    else:
        print(
            f"{where} {fmt(res['samples_per_s'], '.1f')} samples/s, first step "
            f"{fmt(res['time_to_first_step_s'], '.2f')} s, run {res['wall_s']:.1f} s",
            file=sys.stderr,
            flush=True,
        )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m docs.bench",
        description="train.py vs the plain DDP recipe vs a raw loop: samples/s, ratios, "
        "time to first step, peak memory.",
    )
    p.add_argument(
        "--workloads",
        default=",".join(WORKLOADS),
        help=f"comma-separated, of: {', '.join(WORKLOADS)} (default), E (time to accuracy "
        "on real data: needs --real-data), S (start-up costs, docs/bench/startup.py), V "
        "(the seed spread of every shipped default, docs/bench/seed_spread.py) and G (the "
        "GPU check, docs/bench/gpu.py)",
    )
    p.add_argument(
        "--compare",
        type=Path,
        metavar="OTHER_TREE",
        help="workload S: also time another checkout of this repo, in turn, and print ratios",
    )
    p.add_argument(
        "--compare-python",
        action="append",
        default=[],
        metavar="PYTHON",
        help="workloads S and A-D: also run every command with this interpreter (another "
        "venv's, e.g. with another torch), in the same rotation; repeatable",
    )
    p.add_argument(
        "--e-datasets",
        default="mnist,fashion_mnist",
        help="workload E's datasets, comma-separated (default mnist,fashion_mnist)",
    )
    p.add_argument(
        "--e-seeds",
        default="0,1,2,3,4",
        help="workload E's seeds, comma-separated (default 0,1,2,3,4; 0 for a quick look)",
    )
    p.add_argument(
        "--e-baseline",
        default="b2beecb",
        help="workload E: the commit whose train.py also runs, from a git worktree (default "
        "b2beecb; none: skip it)",
    )
    p.add_argument(
        "--v-defaults",
        default="digits,folder32,folder96,mnist_small,mnist,fashion_mnist",
        help="workload V's defaults, comma-separated (mnist and fashion_mnist need --real-data)",
    )
    p.add_argument(
        "--real-data",
        type=Path,
        help="workloads E and V: the dir python -m docs.bench.real_data --out built (MNIST/, "
        "FashionMNIST/)",
    )
    p.add_argument(
        "--world-sizes", help="comma-separated (default 1,2; --smoke: each workload's smoke cells)"
    )
    p.add_argument("--repeats", type=int, default=3, help="runs of each mode (default 3)")
    p.add_argument(
        "--steps",
        type=int,
        help="optimizer steps per run (default: "
        + ", ".join(f"{w} {spec.steps}" for w, spec in WORKLOADS.items())
        + ")",
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help=f"tiny: {SMOKE_STEPS} steps, 1 repeat (CI; numbers not meaningful)",
    )
    p.add_argument("--out", type=Path, help="also write the results as JSON here")
    p.add_argument(
        "--work-dir",
        type=Path,
        help="keep data, run dirs and logs here (default: a temp dir, removed)",
    )
    p.add_argument(
        "--train-override",
        action="append",
        default=[],
        metavar="[W:]KEY=VALUE",
        help="extra train.py override, for every workload or only workload W "
        "(repeatable), e.g. B:dataset.num_workers=1",
    )
    p.add_argument("--timeout", type=float, default=1800.0, help="per run, seconds")
    p.add_argument(
        "--report",
        type=Path,
        metavar="RESULTS_JSON",
        help="run nothing: print the tables of an earlier --out file again",
    )
    args = p.parse_args(argv)
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    extra = (TIME_TO_ACCURACY, STARTUP, SEED_SPREAD, GPU_CHECK)
    unknown = [w for w in args.workloads if w not in (*WORKLOADS, *extra)]
    if unknown or not args.workloads:
        p.error(f"--workloads: unknown {unknown}; choose from {', '.join(WORKLOADS)}, E, S, V, G")
    from docs.bench.seed_spread import DEFAULTS

    args.v_defaults = [d.strip() for d in args.v_defaults.split(",") if d.strip()]
    if not args.v_defaults or not set(args.v_defaults) <= set(DEFAULTS):
        p.error(f"--v-defaults: comma-separated, of {', '.join(DEFAULTS)}")
    args.e_datasets = tuple(d.strip() for d in args.e_datasets.split(",") if d.strip())
    if not args.e_datasets or not set(args.e_datasets) <= {"mnist", "fashion_mnist"}:
        p.error("--e-datasets: mnist, fashion_mnist or both")
    try:
        args.e_seeds = tuple(int(x) for x in args.e_seeds.split(",") if x.strip())
    except ValueError:
        p.error("--e-seeds: comma-separated integers, e.g. 0,1,2,3,4")
    if not args.e_seeds:
        p.error("--e-seeds: comma-separated integers, e.g. 0,1,2,3,4")
    args.e_baseline = None if args.e_baseline.lower() == "none" else args.e_baseline
    if TIME_TO_ACCURACY in args.workloads and args.real_data is None:
        p.error(
            "--workloads E needs --real-data DIR (build: python -m docs.bench.real_data --out DIR)"
        )
    if args.world_sizes is not None:
        try:
            args.world_sizes = [int(w) for w in args.world_sizes.split(",") if w.strip()]
        except ValueError:
            p.error("--world-sizes: comma-separated positive integers, e.g. 1,2")
        if not args.world_sizes or min(args.world_sizes) < 1:
            p.error("--world-sizes: comma-separated positive integers, e.g. 1,2")
    if args.smoke:
        args.repeats = 1
        args.steps = args.steps or SMOKE_STEPS
    if args.repeats < 1 or (args.steps is not None and args.steps < 1):
        p.error("--repeats and --steps must be >= 1")
    return args


def cells(
    spec: Workload, world_sizes: list[int] | None, smoke: bool
) -> list[tuple[int, int | None]]:
    """(world size, workers) of each of a workload's cells: every world size asked for (default
    1, 2) x every workers value; --smoke: the workload's smoke world sizes, its last workers
    value (so that a smoke run covers each workload once or twice, not every combination)."""
    if world_sizes is None:
        world_sizes = list(spec.smoke_world_sizes) if smoke else [1, 2]
    workers = [None] if spec.workers is None else list(spec.workers[-1:] if smoke else spec.workers)
    return [(n, None if w is None else resolve_workers(w, n)) for n in world_sizes for w in workers]


def make_data(workload: str, steps: int, work: Path) -> Path | None:
    """The files a workload reads (B: MNIST-format, D: JPEGs; None: generated in memory):
    one epoch of ``steps`` global batches."""
    samples = steps * WORKLOADS[workload].global_batch
    if workload == "B":
        return make_mnist(work / f"mnist-{samples}", train_file_size(samples))
    if workload == "D":
        return make_jpegs(work / f"jpegs-{samples}", per_class=-(-samples // JPEG_CLASSES))
    return None


def overrides_for(workload: str, given: list[str]) -> tuple[str, ...]:
    out = []
    for item in given:
        head, sep, rest = item.partition(":")
        if sep and head in (*WORKLOADS, TIME_TO_ACCURACY) and "=" not in head:
            if head == workload:
                out.append(rest)
        else:
            out.append(item)
    return tuple(out)


def print_report(report: dict) -> None:
    """The tables of a run, or of an --out file: workloads A-D's, then E's, each if it ran."""
    rows, e_rows = report["rows"], report.get("time_to_accuracy") or []
    if rows:
        print(table(rows))
        print("\nBest window of any repeat (the least disturbed by other load):")
        print(best_table(rows))
        print()
        print(legend(rows, report["repeats"], report["cores"]))
    if report.get("startup"):
        print("\n" + report["startup"])
    if e_rows:
        from docs.bench import time_to_accuracy

        print(("\n" if rows else "") + time_to_accuracy.table(e_rows))
        print("\n" + time_to_accuracy.side_table(e_rows))
        seeds = max(len(runs) for e in e_rows for runs in e["runs"].values())
        print("\n" + time_to_accuracy.legend(seeds, report["cores"]))
    if report.get("seed_spread"):
        from docs.bench import seed_spread

        print("\n" + seed_spread.table(report["seed_spread"]) + "\n\n" + seed_spread.legend())
    if report.get("gpu"):
        print("\n" + report["gpu"])


def resummarize(report: dict) -> dict:
    """The summary rows again from the runs an --out file holds (e.g. after this module's
    summary changed)."""
    rows = []
    for row in report["rows"]:
        setup = Setup(
            row["workload"],
            row["world_size"],
            row["steps"],
            row["log_every"],
            None,
            row["omp_num_threads"],
            workers=row.get("workers"),
        )
        rows.append(summarize(setup, row["runs"], row["imports_s"]))
    e_rows = report.get("time_to_accuracy") or []
    if e_rows:
        from docs.bench import time_to_accuracy as tta

        e_rows = [
            tta.summarize(
                tta.Run(e["dataset"], e["world_size"], Path(), e["omp_num_threads"], e["target"]),
                e["runs"],
            )
            for e in e_rows
        ]
    return {**report, "rows": rows, "table": table(rows), "time_to_accuracy": e_rows}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM as an exception, so that the runs' finally blocks stop the processes they started
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    if args.report:
        report = resummarize(json.loads(args.report.read_text()))
        print_report(report)
        if args.out:
            args.out.write_text(json.dumps(report, indent=2) + "\n")
        return 0
    if GPU_CHECK in args.workloads:
        from docs.bench import gpu

        machine, problem = gpu.preflight()  # its packages and a CUDA GPU, before any cell
        if problem:
            print(problem, file=sys.stderr)
            return 2
        print(f"[G] {gpu.machine_line(machine)}", file=sys.stderr)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cores = cores or 1
    started = time.perf_counter()
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="hydra-ddp-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    rows, e_rows, v_rows, startup_table, gpu_table, gpu_failed = [], [], [], None, None, 0
    try:
        if GPU_CHECK in args.workloads:
            gpu_table, gpu_failed = gpu.run(work / "gpu", machine)
        if TIME_TO_ACCURACY in args.workloads:
            from docs.bench import time_to_accuracy

            e_rows = time_to_accuracy.run(
                args.real_data.expanduser().resolve(),
                args.world_sizes or [1, 2],
                args.e_seeds,
                cores,
                work / "runs",
                datasets=args.e_datasets,
                train_overrides=overrides_for(TIME_TO_ACCURACY, args.train_override),
                timeout_s=args.timeout,
                baseline=args.e_baseline,
            )
        if SEED_SPREAD in args.workloads:
            from docs.bench import seed_spread

            real = args.real_data.expanduser().resolve() if args.real_data else None
            worlds = args.world_sizes or [2]
            v_rows = seed_spread.run(args.v_defaults, worlds, cores, work, real, args.timeout)
        if STARTUP in args.workloads:
            from docs.bench import startup

            startup_table = startup.run(
                args.repeats, work / "startup", args.compare, args.timeout, args.compare_python
            )
        for workload in (w for w in args.workloads if w in WORKLOADS):
            spec = WORKLOADS[workload]
            steps = args.steps or spec.steps
            log_every = max(1, steps // WINDOWS)
            data_root = make_data(workload, steps, work)  # shared by every run of the workload
            for world_size, workers in cells(spec, args.world_sizes, args.smoke):
                setup = Setup(
                    workload,
                    world_size,
                    steps,
                    log_every,
                    data_root,
                    threads=max(1, cores // world_size),
                    train_overrides=overrides_for(workload, args.train_override),
                    timeout_s=args.timeout,
                    workers=workers,
                )
                others = [replace(setup, python=py) for py in args.compare_python]
                rows += bench_cells([setup, *others], args.repeats, work / "runs")
    finally:
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    report = {
        "command": [sys.executable, "-m", "docs.bench.bench", *(argv or sys.argv[1:])],
        "cores": cores,
        "repeats": args.repeats,
        "smoke": args.smoke,
        "warmup_windows": WARMUP_WINDOWS,
        "targets": [name for name, _, _ in TARGETS],
        "total_s": time.perf_counter() - started,
        "table": table(rows),
        "rows": rows,
        "time_to_accuracy": e_rows,
        "startup": startup_table,
        "seed_spread": v_rows,
        "gpu": gpu_table,
    }
    print_report(report)
    failed = sum(row["failed_runs"] for row in (*rows, *e_rows)) + sum("error" in r for r in v_rows)
    failed += gpu_failed
    if failed:
        print(f"\n{failed} run(s) failed: see the messages above", file=sys.stderr)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
