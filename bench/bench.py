"""Throughput benchmark: train.py against the plain DDP recipe and a raw loop, same workload.

    python -m bench [--workloads A,B] [--world-sizes 1,2] [--repeats 3] [--steps N]
                           [--smoke] [--out results.json]

For each workload x world size it runs three modes, each as its own process (world size 2:
``python -m torch.distributed.run --standalone --nproc-per-node=2 ...``), alternating them
``--repeats`` times with the order rotated each repeat, so that machine noise hits all three
alike:

  train.py   train.py with the matching config (metrics.jsonl's samples_per_s windows)
  reference  bench/reference.py --mode reference: DataLoader + DistributedSampler + DDP +
             set_epoch, nothing else
  raw        bench/reference.py --mode raw: forward/backward/step on one pre-built batch

Workloads: A = torchvision resnet18 (3x3 stem) on FakeData 3x32x32, global batch 64; B = the
small CNN on MNIST-format idx files generated here (~30k samples), global batch 256. Every
process gets OMP_NUM_THREADS = cores / world size. Steady-state samples/s is the median of the
per-window rates (``log_every`` steps per window, rank 0's clock) after the first window
(warm-up); each mode's number is the median over repeats. Also reported: time from process
start to the end of the first optimizer step, ``python -c "import torch, torchvision"`` wall
time, peak RSS per rank. Targets are printed PASS/MISS for information: only a run that fails
makes the exit status non-zero.

Workload E (bench/time_to_accuracy.py, `--workloads E --real-data DIR`): time to accuracy on
real MNIST and Fashion-MNIST (built by bench/real_data.py), train.py against the seed recipe.

This module imports nothing heavy (bench/reference.py imports its helpers from here).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULT_TAG = "BENCH_RESULT "  # how bench_reference.py's result line starts
MODES = ("train.py", "reference", "raw")
WARMUP_WINDOWS = 1  # dropped from the front of each run's window rates
WINDOWS = 6  # throughput windows per run (log_every = steps // WINDOWS)
SMOKE_STEPS = 2
MNIST_TEST_SAMPLES = 1000
TIME_TO_ACCURACY = "E"  # bench/time_to_accuracy.py
PLAIN_LR = 0.1  # the plain recipe's SGD lr (bench/reference.py), train.py's at the batch of 64


@dataclass(frozen=True)
class Workload:
    description: str
    global_batch: int
    shape: tuple[int, int, int]  # one sample as the model sees it, C x H x W
    steps: int  # default optimizer steps per run (one epoch of steps * global_batch samples)
    # DataLoader workers per rank, one cell each (the same on both sides; "auto": train.py's
    # rule, core.world.data_workers); None: not a DataLoader workload (B: fast path)
    workers: tuple[int | str, ...] | None = (0,)
    smoke_world_sizes: tuple[int, ...] = (1, 2)  # the cells --smoke runs


WORKLOADS = {
    "A": Workload(
        "resnet18 (3x3 stem) on FakeData 3x32x32", 64, (3, 32, 32), steps=24, smoke_world_sizes=(1,)
    ),
    # 120 * 256 = 30720 MNIST-format samples
    "B": Workload(
        "small CNN on MNIST-format idx files",
        256,
        (1, 28, 28),
        steps=120,
        workers=None,
        smoke_world_sizes=(2,),
    ),
    "C": Workload(
        "resnet18 (standard stem) on FakeData 3x32x32",
        64,
        (3, 32, 32),
        steps=40,
        workers=(0, 2),
        smoke_world_sizes=(2,),
    ),
    # 40 * 64 = 2560 JPEGs of 96-160 px, RandomResizedCrop(32) + flip on both sides
    "D": Workload(
        "small CNN [8, 16] on a JPEG ImageFolder (96-160 px), RandomResizedCrop 32 + flip",
        64,
        (3, 32, 32),
        steps=40,
        workers=("auto",),
        smoke_world_sizes=(1,),
    ),
}
# The small CNN of workload D: light enough (~0.3 ms per sample on a core) that the data path
# (decode + crop, ~0.5-0.9 ms per image) shows.
D_CHANNELS, D_HIDDEN = (8, 16), 32
JPEG_CLASSES, JPEG_SIDES, JPEG_QUALITY, JPEG_VAL_PER_CLASS = 10, (96, 160), 90, 4

# (name, workload it applies to or None for all, world size or None for all)
TARGETS = (
    ("A: train/ref >= 1.0", "A", None),
    ("B: train/raw >= 0.95", "B", None),
    ("C: train/ref >= 1.0", "C", None),
    ("D: train/ref >= 1.3", "D", None),
    ("1st step <= import + 1.0 s", None, 1),
    ("1st step <= import + 2.0 s", None, 2),
)
FIRST_STEP_MARGIN_S = {1: 1.0, 2: 2.0}


def process_age() -> float:
    """Seconds since this process started (Linux: /proc/self/stat start time, in clock ticks
    after boot, against CLOCK_BOOTTIME; 10 ms resolution)."""
    with open("/proc/self/stat") as f:
        fields = f.read().rpartition(")")[2].split()  # fields 3.. of proc(5)
    start_ticks = int(fields[22 - 3])  # field 22: starttime
    return time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")


def steady_rate(window_rates: list[float]) -> float | None:
    """Median of the window rates after the warm-up window(s); all of them if too few."""
    kept = window_rates[WARMUP_WINDOWS:] or window_rates
    return statistics.median(kept) if kept else None


def best_rate(window_rates: list[float]) -> float | None:
    """The fastest window after the warm-up: the least disturbed by other load on the machine
    (noise only ever slows a window down)."""
    kept = window_rates[WARMUP_WINDOWS:] or window_rates
    return max(kept) if kept else None


def median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


# --- MNIST-format data ----------------------------------------------------------------------


def write_idx(path: Path, data: bytes, shape: tuple[int, ...]) -> None:
    """IDX file (yann.lecun.com/exdb/mnist): magic 0x0000 08 <ndim>, big-endian uint32 dims,
    then the uint8 data."""
    header = struct.pack(">HBB", 0, 0x08, len(shape)) + struct.pack(f">{len(shape)}I", *shape)
    path.write_bytes(header + data)


def make_mnist(root: Path, n_train: int, n_test: int = MNIST_TEST_SAMPLES) -> Path:
    """<root>/MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte of random content, as
    torchvision.datasets.MNIST(root) reads them. Returns root."""
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        write_idx(raw / f"{prefix}-images-idx3-ubyte", rng.randbytes(n * 28 * 28), (n, 28, 28))
        labels = bytes(b % 10 for b in rng.randbytes(n))
        write_idx(raw / f"{prefix}-labels-idx1-ubyte", labels, (n,))
    return root


# --- a JPEG ImageFolder -----------------------------------------------------------------------


def make_jpegs(root: Path, per_class: int, val_per_class: int = JPEG_VAL_PER_CLASS) -> Path:
    """<root>/{train,val}/<class>/<i>.jpg: ``per_class`` training images of each of
    JPEG_CLASSES classes (and ``val_per_class`` val images, so that train.py carves nothing
    from train), each JPEG_SIDES px wide and high at random, a smooth random pattern plus
    noise (photo-like compression: ~8 kB each), JPEG quality JPEG_QUALITY. Returns root."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, n in (("train", per_class), ("val", val_per_class)):
        for c in range(JPEG_CLASSES):
            folder = root / split / f"class{c}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                w, h = (int(v) for v in rng.integers(JPEG_SIDES[0], JPEG_SIDES[1] + 1, size=2))
                coarse = Image.fromarray(rng.integers(0, 256, (6, 6, 3), dtype=np.uint8))
                smooth = np.asarray(coarse.resize((w, h), Image.BICUBIC), dtype=np.float32)
                pixels = np.clip(smooth + rng.normal(0, 12, smooth.shape), 0, 255)
                Image.fromarray(pixels.astype(np.uint8)).save(
                    folder / f"{i}.jpg", quality=JPEG_QUALITY
                )
    return root


def train_file_size(train_samples: int, val_fraction: float = 0.1) -> int:
    """Samples the generated training file needs so that train.py, which carves
    ``val_fraction`` of it as val (conf/dataset/mnist.yaml), trains on ``train_samples``."""
    n = train_samples
    while n - math.ceil(val_fraction * n) < train_samples:
        n += 1
    return n


# --- one run ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Setup:
    workload: str
    world_size: int
    steps: int
    log_every: int
    data_root: Path | None  # workloads B and D
    threads: int  # OMP_NUM_THREADS per process
    train_overrides: tuple[str, ...] = ()
    timeout_s: float = 1800.0
    workers: int | None = None  # DataLoader workers per rank, both sides (None: B's fast path)


def resolve_workers(value: int | str, world_size: int) -> int:
    """A workload's workers per rank as train.py resolves ``dataset.num_workers`` (auto: this
    rank's share of the cores less one), so that both sides get the same number."""
    from core.world import data_workers

    return data_workers(value, world_size)


def launch(world_size: int, target: list[str]) -> list[str]:
    if world_size == 1:
        return [sys.executable, *target]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={world_size}",
        *target,
    ]


def run_env(threads: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.pop("HYDRA_DDP_FAULT", None)
    path = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env.update(
        OMP_NUM_THREADS=str(threads),
        PYTHONPATH=path,
        PYTHONUNBUFFERED="1",
        WANDB_MODE="disabled",
        WANDB_SILENT="true",
    )
    return env


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
        # the reference's plain SGD (bench/reference.py LR): the lr as given, one parameter
        # group, no warm-up
        f"optim.lr={PLAIN_LR}",
        "optim.lr_scaling=none",
        "optim.decay_norm_and_bias=true",
        "trainer.warmup_epochs=0",
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
            "bench.reference",
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
    cmd = launch(s.world_size, target)
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


def run_process(cmd: list[str], env: dict[str, str], timeout_s: float) -> tuple[str, str, object]:
    """(stdout, stderr, exit status or a timeout message). The command runs in its own session
    so that a timeout kills torchrun's ranks too, not only the agent."""
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
        return stdout, stderr, proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        return stdout, stderr, f"timeout after {timeout_s:.0f} s"
    finally:
        if proc.poll() is None:  # interrupted (Ctrl-C): leave no ranks behind
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def train_result(run_dir: Path) -> dict:
    """Window rates from metrics.jsonl; time to first step and peak memory from result.json
    (None where this train.py does not record them)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rates = [row["samples_per_s"] for row in rows if "samples_per_s" in row]
    if not rates:
        raise ValueError(f"no train rows with samples_per_s in {run_dir / 'metrics.jsonl'}")
    result_path = run_dir / "result.json"
    result = json.loads(result_path.read_text()) if result_path.exists() else {}
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


def import_time(threads: int) -> float:
    """Wall time of ``python -c "import torch, torchvision"`` (interpreter start included)."""
    tic = time.perf_counter()
    subprocess.run(
        [sys.executable, "-c", "import torch, torchvision"],
        cwd=REPO,
        env=run_env(threads),
        check=True,
        capture_output=True,
    )
    return time.perf_counter() - tic


# --- the benchmark ---------------------------------------------------------------------------


def bench_cell(s: Setup, repeats: int, work: Path) -> dict:
    """All modes of one workload x world size, alternated ``repeats`` times; the summary row."""
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    imports = []
    items = ("import", *MODES)  # the import timing takes its turn in the rotation too
    for r in range(repeats):
        for mode in items[r % len(items) :] + items[: r % len(items)]:
            if mode == "import":
                imports.append(import_time(s.threads))
                continue
            run_dir = work / cell_name(s) / f"r{r}-{mode.replace('.', '_')}"
            res = run_mode(s, mode, run_dir)
            runs[mode].append(res)
            progress(s, r, repeats, res)
    return summarize(s, runs, imports)


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


def fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def fmt_mb(values: list[float] | None) -> str:
    return "n/a" if not values else "/".join(f"{v:.0f}" for v in values)


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
                row["workload"],
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
                row["workload"],
                str(row["world_size"]),
                fmt_workers(row.get("workers")),
                *(fmt(best[m], ".1f") for m in MODES),
                fmt(ratios["train_vs_reference"], ".3f"),
                fmt(ratios["train_vs_raw"], ".3f"),
            ]
        )
    return markdown(lines)


def markdown(lines: list[list[str]]) -> str:
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    text = [
        "| " + " | ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) + " |"
        for line in lines
    ]
    text.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(text)


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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench",
        description="train.py vs the plain DDP recipe vs a raw loop: samples/s, ratios, "
        "time to first step, peak memory.",
    )
    p.add_argument(
        "--workloads",
        default=",".join(WORKLOADS),
        help=f"comma-separated, of: {', '.join(WORKLOADS)} (default), and E (time to accuracy "
        "on real data: needs --real-data)",
    )
    p.add_argument(
        "--e-datasets",
        default="mnist,fashion_mnist",
        help="workload E's datasets, comma-separated (default mnist,fashion_mnist)",
    )
    p.add_argument(
        "--real-data",
        type=Path,
        help="workload E: the dir python -m bench.real_data --out built (MNIST/, FashionMNIST/)",
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
    unknown = [w for w in args.workloads if w not in (*WORKLOADS, TIME_TO_ACCURACY)]
    if unknown or not args.workloads:
        p.error(f"--workloads: unknown {unknown}; choose from {', '.join(WORKLOADS)}, E")
    args.e_datasets = tuple(d.strip() for d in args.e_datasets.split(",") if d.strip())
    if not args.e_datasets or not set(args.e_datasets) <= {"mnist", "fashion_mnist"}:
        p.error("--e-datasets: mnist, fashion_mnist or both")
    if TIME_TO_ACCURACY in args.workloads and args.real_data is None:
        p.error(
            "--workloads E needs --real-data DIR (build it: python -m bench.real_data --out DIR)"
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
    rows = report["rows"]
    print(table(rows))
    print("\nBest window of any repeat (the least disturbed by other load):")
    print(best_table(rows))
    print()
    print(legend(rows, report["repeats"], report["cores"]))


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
    return {**report, "rows": rows, "table": table(rows)}


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
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cores = cores or 1
    started = time.perf_counter()
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="hydra-ddp-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    rows, e_rows = [], []
    try:
        if TIME_TO_ACCURACY in args.workloads:
            from bench import time_to_accuracy

            e_rows = time_to_accuracy.run(
                args.real_data.expanduser().resolve(),
                args.world_sizes or [1, 2],
                args.repeats,
                cores,
                work / "runs",
                datasets=args.e_datasets,
                train_overrides=overrides_for(TIME_TO_ACCURACY, args.train_override),
                timeout_s=args.timeout,
            )
        for workload in (w for w in args.workloads if w != TIME_TO_ACCURACY):
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
                rows.append(bench_cell(setup, args.repeats, work / "runs"))
    finally:
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    report = {
        "command": [sys.executable, "-m", "bench.bench", *(argv or sys.argv[1:])],
        "cores": cores,
        "repeats": args.repeats,
        "smoke": args.smoke,
        "warmup_windows": WARMUP_WINDOWS,
        "targets": [name for name, _, _ in TARGETS],
        "total_s": time.perf_counter() - started,
        "table": table(rows),
        "rows": rows,
        "time_to_accuracy": e_rows,
    }
    if rows:
        print_report(report)
    if e_rows:
        from bench import time_to_accuracy

        print(("\n" if rows else "") + time_to_accuracy.table(e_rows))
        print("\n" + time_to_accuracy.legend(args.repeats, cores))
    failed = sum(row["failed_runs"] for row in (*rows, *e_rows))
    if failed:
        print(f"\n{failed} run(s) failed: see the messages above", file=sys.stderr)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
