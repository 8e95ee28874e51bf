"""Workload G: the one prepared GPU check (`python -m docs.bench --workloads G`), <= 5 min on one
GPU. Without a CUDA GPU it says so in one line and exits non-zero.

Each cell is one process with its own time limit, and the whole check has a budget (BUDGET_S):
a cell that would start past it is reported as skipped, so the check ends in time however slow
a compile is. The table:

  CUDA paths   a 1-rank sweep job (`python train.py -m ...`: the launcher forks its rank from the
               warm interpreter), `python train.py dist.nproc_per_node=1`, plain torchrun: each
               trains digits for an epoch with trainer.device=cuda; status, wall, first step
  throughput   resnet18 / resnet50 (3x3 stem) in bf16 + channels_last on MNIST-format files
               generated here (28 px, 1 channel), through the DataLoader (dataset.fast=false) and
               the fast path (data/fast.py), eager and compiled: samples/s (median window after
               the first) and MFU (train rows' `mfu`: components/speed.py's peak)
  JPEG decode  torchvision.io.decode_jpeg of a batch of generated 224-320 px JPEGs on the CPU
               and on the GPU (device="cuda", nvjpeg): images/s
  matmul       a bf16 8192^3 matmul's TFLOP/s against the peak components/speed.py uses for
               this GPU: how far MFU's denominator is from what the GPU does

The parent imports no torch (the probes below run in their own processes, `python -m
docs.bench.gpu <probe>`).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

from docs.bench.common import REPO, RESULT_TAG, fmt, make_mnist, markdown, run_env, run_process

BUDGET_S = 270.0  # cells start only while this much of the check's time is left unused
THREADS = 8  # OMP_NUM_THREADS per process
NO_GPU = (
    "workload G needs a CUDA GPU, and torch sees none here (torch.cuda.device_count() == 0): "
    "run it on a GPU machine"
)
STEPS, BATCH = 40, 256  # throughput: optimizer steps per run, global batch
QUICK = ("trainer.max_epochs=1", "trainer.progress_bar=false", "wandb.mode=disabled")


def cuda_devices(timeout_s: float = 120) -> tuple[int, str]:
    """(GPUs torch sees, the first one's name) in a process of its own."""
    stdout, _, rc = run_process([sys.executable, "-m", "docs.bench.gpu", "probe"], env(), timeout_s)
    found = result_line(stdout) if rc == 0 else None
    return (found["count"], found["name"]) if found else (0, "")


def env() -> dict[str, str]:
    return run_env(THREADS)


def result_line(stdout: str) -> dict | None:
    for line in reversed(stdout.splitlines()):
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG) :])
    return None


def tail(stdout: str, stderr: str, lines: int = 3) -> str:
    return " / ".join((stdout + stderr).strip().splitlines()[-lines:])


def train_cell(name: str, cmd: list[str], run_dir: Path, timeout_s: float) -> dict:
    """One train.py process; its status, wall, first step, steady samples/s and MFU from the
    run dir (`run_dir`: where its result.json and metrics.jsonl land)."""
    from docs.bench.workloads import steady_rate

    tic = time.perf_counter()
    stdout, stderr, rc = run_process(cmd, env(), timeout_s)
    row = {"cell": name, "wall_s": time.perf_counter() - tic, "command": " ".join(cmd[1:])}
    if rc != 0:
        return {**row, "status": f"FAILED ({rc})", "note": tail(stdout, stderr)}
    try:
        result = json.loads((run_dir / "result.json").read_text())
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    except (OSError, ValueError) as e:
        return {**row, "status": "FAILED (no result)", "note": str(e)}
    rates = [r["samples_per_s"] for r in rows if "samples_per_s" in r]
    mfus = [r["mfu"] for r in rows if "mfu" in r][1:] or [r["mfu"] for r in rows if "mfu" in r]
    return {
        **row,
        "status": result.get("status", "?"),
        "first_step_s": result.get("time_to_first_step_s"),
        "samples_per_s": steady_rate(rates),
        "mfu": statistics.median(mfus) if mfus else None,
    }


def probe_cell(name: str, probe: str, timeout_s: float) -> dict:
    tic = time.perf_counter()
    cmd = [sys.executable, "-m", "docs.bench.gpu", probe]
    stdout, stderr, rc = run_process(cmd, env(), timeout_s)
    row = {"cell": name, "wall_s": time.perf_counter() - tic, "command": " ".join(cmd[1:])}
    found = result_line(stdout) if rc == 0 else None
    if found is None:
        return {**row, "status": f"FAILED ({rc})", "note": tail(stdout, stderr)}
    return {**row, "status": "ok", "note": found["note"], **found.get("values", {})}


def plan(work: Path) -> list[tuple[str, float, object]]:
    """(name, time limit in s, how to run it) of every cell, most important first."""
    py = sys.executable
    cuda = ("trainer.device=cuda", *QUICK)
    runs = work / "runs"
    cells: list[tuple[str, float, object]] = [
        (
            "1-rank sweep job (launcher, forked rank)",
            120,
            lambda name, t: train_cell(
                name,
                [py, "train.py", "-m", "seed=1", *cuda, f"hydra.sweep.dir={runs / 'sweep'}"],
                runs / "sweep" / "0",
                t,
            ),
        ),
        (
            "python train.py dist.nproc_per_node=1",
            90,
            lambda name, t: train_cell(
                name,
                [py, "train.py", "dist.nproc_per_node=1", *cuda, f"hydra.run.dir={runs / 'one'}"],
                runs / "one",
                t,
            ),
        ),
        (
            "plain torchrun --nproc-per-node=1",
            90,
            lambda name, t: train_cell(
                name,
                [py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1"]
                + ["train.py", *cuda, f"hydra.run.dir={runs / 'torchrun'}"],
                runs / "torchrun",
                t,
            ),
        ),
        ("JPEG decode, CPU vs CUDA", 90, lambda name, t: probe_cell(name, "decode", t)),
        ("bf16 matmul vs the MFU peak", 60, lambda name, t: probe_cell(name, "matmul", t)),
    ]
    data = work / "mnist"
    throughput = [
        (model, fast, compiled)
        for compiled in (False, True)  # compiled last: the slowest to start
        for model in ("resnet18", "resnet50")
        for fast in (True, False)
        if not (compiled and not fast)  # compile: the fast path only (time)
    ]
    for model, fast, compiled in throughput:
        name = f"{model} bf16 cl {'fast path' if fast else 'DataLoader'}" + (
            " compiled" if compiled else ""
        )
        run_dir = runs / name.replace(" ", "_")
        overrides = [
            f"model={model}",
            "model.small_input_stem=true",
            "dataset=mnist",
            f"dataset.root={data}",
            f"dataset.fast={str(fast).lower()}",
            "trainer.precision=bf16",
            "trainer.channels_last=true",
            f"trainer.compile={str(compiled).lower()}",
            f"trainer.batch_size={BATCH}",
            f"trainer.limit_train_batches={STEPS}",
            "trainer.limit_val_batches=1",
            "trainer.log_every_n_steps=5",
            "trainer.save_checkpoints=false",
            *cuda,
            f"hydra.run.dir={run_dir}",
        ]
        cells.append(
            (
                name,
                180 if compiled else 90,
                lambda name, t, o=overrides, d=run_dir: train_cell(
                    name, [py, "train.py", *o], d, t
                ),
            )
        )
    return cells


def run(work: Path) -> tuple[str, int]:
    """The check's table and how many cells failed. Call only where cuda_devices() found one."""
    started = time.perf_counter()
    make_mnist(work / "mnist", n_train=(STEPS + 8) * BATCH)  # 10 % of it is carved as val
    rows = []
    for name, limit, cell in plan(work):
        left = BUDGET_S - (time.perf_counter() - started)
        if left < min(limit, 45):
            rows.append({"cell": name, "status": "skipped (time budget)"})
            continue
        row = cell(name, min(limit, left))
        rows.append(row)
        print(f"[G] {name}: {row['status']} ({row.get('wall_s', 0):.1f} s)", file=sys.stderr)
    return table(rows), sum(r["status"].startswith("FAILED") for r in rows)


def table(rows: list[dict]) -> str:
    lines = [["cell", "status", "wall s", "1st step s", "samples/s", "MFU", "note"]]
    for r in rows:
        mfu = r.get("mfu")
        lines.append(
            [
                r["cell"],
                r["status"],
                fmt(r.get("wall_s"), ".1f"),
                fmt(r.get("first_step_s"), ".2f"),
                fmt(r.get("samples_per_s"), ",.0f"),
                "n/a" if mfu is None else f"{100 * mfu:.1f} %",
                r.get("note", ""),
            ]
        )
    return markdown(lines)


# --- probes: each runs in its own process and prints one RESULT_TAG line --------------------


def probe() -> dict:
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return {"count": count, "name": torch.cuda.get_device_name(0) if count else ""}


def decode() -> dict:
    """Images/s of torchvision.io.decode_jpeg on a batch, on the CPU and on the GPU."""
    import numpy as np
    import torch
    from torchvision.io import decode_jpeg, encode_jpeg

    rng = np.random.default_rng(0)
    jpegs = []
    for _ in range(128):
        h, w = (int(v) for v in rng.integers(224, 321, size=2))
        coarse = torch.from_numpy(rng.integers(0, 256, (3, 8, 8), dtype=np.uint8))
        smooth = torch.nn.functional.interpolate(
            coarse[None].float(), size=(h, w), mode="bicubic", align_corners=False
        )[0]
        noisy = (smooth + torch.from_numpy(rng.normal(0, 12, (3, h, w))).float()).clamp(0, 255)
        jpegs.append(encode_jpeg(noisy.to(torch.uint8), quality=90))

    def rate(device: str, repeats: int = 5) -> float:
        decode_jpeg(jpegs, device=device)  # warm-up (nvjpeg's handle, allocations)
        torch.cuda.synchronize()
        tic = time.perf_counter()
        for _ in range(repeats):
            decode_jpeg(jpegs, device=device)
        torch.cuda.synchronize()
        return repeats * len(jpegs) / (time.perf_counter() - tic)

    cpu, cuda = rate("cpu", 2), rate("cuda")
    note = f"{len(jpegs)} JPEGs 224-320 px: CPU {cpu:,.0f} img/s, CUDA {cuda:,.0f} img/s"
    return {"note": note, "values": {"samples_per_s": cuda}}


def matmul() -> dict:
    """A bf16 matmul's TFLOP/s against the peak MFU divides by (components/speed.py)."""
    import torch

    from components.speed import math_precisions, peak_flops

    device = torch.device("cuda", 0)
    n = 8192
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    repeats = 20
    tic = time.perf_counter()
    for _ in range(repeats):
        a @ b
    torch.cuda.synchronize()
    achieved = 2 * n**3 * repeats / (time.perf_counter() - tic)
    peak = peak_flops(device, "bf16")
    name = torch.cuda.get_device_name(device)
    conv32, matmul32 = math_precisions("32")
    note = (
        f"{name}: {achieved / 1e12:.0f} TFLOP/s of a peak "
        f"{'not in the table' if peak is None else f'{peak / 1e12:.0f} TFLOP/s'}"
        f"{'' if peak is None else f' ({100 * achieved / peak:.0f} %)'}; precision 32 runs "
        f"convs in {conv32}, matmuls in {matmul32}"
    )
    return {"note": note, "values": {"mfu": None if peak is None else achieved / peak}}


PROBES = {"probe": probe, "decode": decode, "matmul": matmul}


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    print(RESULT_TAG + json.dumps(PROBES[sys.argv[1]]()), flush=True)
