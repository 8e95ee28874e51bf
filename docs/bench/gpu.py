"""Workload G: the one prepared GPU check (`python -m docs.bench --workloads G`), <= 7 min on one
GPU, so that a rerun fits a 15-minute lease. A GPU machine may hold only torch and torchvision
(and no network): the wheels the check needs besides (WHEELS) are built here and travel with
the tree, and one command there installs them and runs the check:

    here:             python -m docs.bench.gpu wheels .whl [--python 3.12]   (~20 MiB a Python)
    the GPU machine:  python -m docs.bench.gpu run .whl [--out g.json]

(.whl/ is git-ignored; `run` installs with `pip install --no-index --no-deps --target`, which
leaves the machine's own packages, torch first, as they are, and hands the folder to the check
on PYTHONPATH.) Before any cell, a preflight in a process of its own stops in one line (exit
status 2) where a package is missing or torch sees no CUDA GPU, and finds what the table's
first line states: GPU, driver, torch, CUDA, torchvision and Python versions. Nothing here
needs a torch newer than 2.11.

Each cell is one process with its own time limit, and the whole check has a budget (BUDGET_S):
a cell that would start past it is reported as skipped, so the check ends in time however slow
a compile is. The cells, on generated data only (MNIST-format files; a JPEG ImageFolder):

  CUDA paths   a 1-rank sweep job (`python train.py -m ...`: the launcher forks its rank from the
               warm interpreter), `python train.py dist.nproc_per_node=1`, then its resume
               (resume=auto, a second epoch) and `eval.py` of its checkpoint, plain torchrun, a
               sweep job under CUDA_VISIBLE_DEVICES=<the GPU's UUID>, a world-1 NCCL group with
               DDP forced on (dist.force_ddp: DDP's reducer; compiled: dynamo's DDPOptimizer,
               its log line checked), DDP on 2 GPUs (2 NCCL ranks: a real all-reduce between
               GPUs; on a 1-GPU machine one line says it was skipped), and the GPU JPEG path
               (nvjpeg batch decode, its log line checked: nvjpeg ran) through train.py on an
               ImageFolder holding a CMYK JPEG: status, wall, first step
  throughput   resnet18 / resnet50 (3x3 stem) in bf16 + channels_last on MNIST-format files
               (28 px, 1 channel), through the DataLoader (dataset.fast=false) and the fast path
               (data/fast.py), eager and compiled, resnet18 in precision 32 (TF32) and in fp16
               (autocast with the GradScaler): samples/s (median window after the first) and
               MFU (train rows' `mfu`: components/speed.py)
  JPEG decode  torchvision.io.decode_jpeg of a batch of generated 224-320 px JPEGs on the CPU
               and on the GPU (device="cuda", nvjpeg): images/s
  matmul       a bf16 8192^3 matmul's TFLOP/s against the peak components/speed.py uses for
               this GPU: how far MFU's denominator is from what the GPU does

The parent imports no torch (the probes below run in their own processes, `python -m
docs.bench.gpu <probe>`).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from docs.bench.common import (
    REPO,
    RESULT_TAG,
    app_part,
    fmt,
    make_jpegs,
    make_mnist,
    markdown,
    run_env,
    run_process,
)

BUDGET_S = 390.0  # cells start only while this much of the check's time is left unused
THREADS = 8  # OMP_NUM_THREADS per process
NO_GPU = (
    "workload G needs a CUDA GPU, and torch sees none here (torch.cuda.device_count() == 0): "
    "run it on a GPU machine"
)
STEPS, BATCH = 40, 256  # throughput: optimizer steps per run, global batch
QUICK = ("trainer.max_epochs=1", "trainer.progress_bar=false", "wandb.mode=disabled")

# What G's processes (train.py, eval.py, the launcher, docs.bench) import that a machine with
# only torch and torchvision lacks: Hydra; tqdm (the console); cloudpickle (the launcher);
# matplotlib (eval.py's confusion matrix); submitit (the SLURM launcher's extra; its plugin
# imports without it, as every plugin in hydra_plugins/ does). W&B, Optuna, scikit-learn and
# scipy stay out: G runs with W&B off, no search, and no digits (the MNIST files and JPEGs are
# generated here). What these need in turn, and every version, comes from requirements.lock
# (wheel_pins): the wheels are the ones the suite runs with.
WHEELS = (
    "hydra-core",
    "omegaconf",
    "tqdm",
    "cloudpickle",
    "matplotlib",
    "submitit",
)
TORCH_SIDE = ("torch", "torchvision")  # the GPU machine's own, with all they bring
SOURCE_ONLY = ("antlr4-python3-runtime",)  # built into a wheel here (pip wheel)
# The module the preflight imports for each of WHEELS where it is not the distribution's only
# top-level one; for the rest it imports the top-level modules the installed distribution lists.
MODULES = {
    "hydra-core": "hydra",
    "omegaconf": "omegaconf",
    "tqdm": "tqdm",
    "cloudpickle": "cloudpickle",
    "matplotlib": "matplotlib",
    "submitit": "submitit",
}
WHEEL_DIR = ".whl"  # git-ignored: the device tool carries it with the tree
LOCK = REPO / "requirements.lock"


def python_version() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def lockfile():
    """.ci/lockfile.py, the locks' reader (packaging only, or pip's copy of it)."""
    if "lockfile" not in sys.modules:
        spec = importlib.util.spec_from_file_location("lockfile", REPO / ".ci" / "lockfile.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["lockfile"] = module  # before it runs: its dataclasses look it up
        spec.loader.exec_module(module)
    return sys.modules["lockfile"]


def marker_environment(python: str | None = None) -> dict[str, str]:
    """This interpreter's marker environment; with `python` ("3.12"), that Python's on this
    machine (what `pip download --python-version` fetches for)."""
    env = {**lockfile().default_environment(), "extra": ""}
    if python is not None:
        env |= {"python_version": python, "python_full_version": f"{python}.0"}
        env |= {"implementation_version": f"{python}.0"}
    return env


def wheel_pins(python: str | None = None) -> dict[str, str]:
    """{distribution: version} of every wheel G needs on Python `python` ("3.12"; default:
    this interpreter), from requirements.lock: WHEELS and all they bring there, less torch's
    and torchvision's own (numpy, pillow, ...: the GPU machine's)."""
    env = marker_environment(python)
    lock = lockfile().Lock.read(LOCK)
    try:
        needed = lock.closure(list(WHEELS), env)
        torch_side = set(lock.closure(list(TORCH_SIDE), env))
    except KeyError as missing:
        raise SystemExit(f"{LOCK.name}: {missing.args[0]}: python .ci/lock.py refresh") from None
    versions = lock.versions(env)
    return {name: versions[name] for name in needed if name not in torch_side}


def requirements_file(folder: Path, python: str) -> Path:
    return folder / f"requirements-py{python}.txt"


def build_wheels(folder: Path, pythons: list[str]) -> int:
    """The wheels G needs into `folder`, for each Python in `pythons`, with one
    requirements-py<X.Y>.txt each (exact pins): what `run` installs on the GPU machine."""
    folder.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    for python in pythons:
        pins = wheel_pins(python)
        binary = [f"{n}=={v}" for n, v in pins.items() if n not in SOURCE_ONLY]
        source = [f"{n}=={v}" for n, v in pins.items() if n in SOURCE_ONLY]
        # Wheels as published, for that Python on this platform; no dependencies: the list is
        # the whole set, and torch's own (numpy, pillow) are the GPU machine's
        download = ["download", "--no-deps", "--only-binary=:all:", "--python-version", python]
        steps = [
            [*pip, *download, "--dest", str(folder), *binary],
            [*pip, "wheel", "--no-deps", "--wheel-dir", str(folder), *source],
        ]
        for step in steps:
            done = subprocess.run(step, capture_output=True, text=True)
            if done.returncode != 0:
                why = tail(done.stdout, done.stderr, 1)
                print(f"pip failed ({' '.join(step[3:5])}): {why}", file=sys.stderr)
                return 1
        requirements_file(folder, python).write_text(
            "".join(f"{n}=={v}\n" for n, v in pins.items())
        )
    size = sum(f.stat().st_size for f in folder.glob("*.whl"))
    print(
        f"{len(list(folder.glob('*.whl')))} wheels for Python {', '.join(pythons)} in "
        f"{folder} ({size / 2**20:.1f} MiB); on the GPU machine: "
        f"python -m docs.bench.gpu run {folder}"
    )
    return 0


def install_and_run(folder: Path, bench_args: list[str]) -> int:
    """On the GPU machine: the wheels in `folder` into `folder`/site-py<X.Y> (pip, offline,
    nothing else touched), then `python -m docs.bench --workloads G` with them on PYTHONPATH."""
    python = python_version()
    requirements = requirements_file(folder, python)
    if not requirements.exists():
        built = sorted(p.stem.removeprefix("requirements-py") for p in folder.glob("req*.txt"))
        print(
            f"{folder} holds no wheels for this Python {python} (for: "
            f"{', '.join(built) or 'none'}): build them with python -m docs.bench.gpu wheels "
            f"{folder} --python {python}",
            file=sys.stderr,
        )
        return 2
    site = folder / f"site-py{python}"
    install = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    install += ["--no-index", "--no-deps", "--find-links", str(folder), "--target", str(site)]
    install += ["--upgrade", "-r", str(requirements)]
    done = subprocess.run(install, capture_output=True, text=True)
    if done.returncode != 0:
        why = tail(done.stdout, done.stderr, 1)
        print(f"installing {folder}'s wheels failed: {why}", file=sys.stderr)
        return 2
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(site.resolve()), env.get("PYTHONPATH")) if p
    )
    bench = [sys.executable, "-m", "docs.bench", "--workloads", "G", *bench_args]
    return subprocess.run(bench, cwd=REPO, env=env).returncode


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m docs.bench.gpu")
    commands = parser.add_subparsers(dest="command", required=True)
    wheels = commands.add_parser("wheels", help="build the wheels G needs into a folder (here)")
    wheels.add_argument("folder", nargs="?", type=Path, default=REPO / WHEEL_DIR)
    wheels.add_argument(
        "--python",
        action="append",
        metavar="X.Y",
        help="the GPU machine's Python (repeatable; default: this one's)",
    )
    run_g = commands.add_parser("run", help="install them and run workload G (GPU machine)")
    run_g.add_argument("folder", nargs="?", type=Path, default=REPO / WHEEL_DIR)
    args, rest = parser.parse_known_args(argv)
    if args.command == "wheels":
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        return build_wheels(args.folder, args.python or [python_version()])
    return install_and_run(args.folder, rest)


# --- the preflight and the cells ---------------------------------------------------------------


def missing_line(missing: list[str]) -> str:
    return (
        f"workload G needs {', '.join(missing)}, which this Python ({sys.executable}) lacks: "
        f"build the wheels with pip access (python -m docs.bench.gpu wheels {WHEEL_DIR}), bring "
        f"{WHEEL_DIR}/ here and run python -m docs.bench.gpu run {WHEEL_DIR}"
    )


def preflight(timeout_s: float = 180) -> tuple[dict, str | None]:
    """(what the probe found, None) where G can run; else (..., the one line that says why
    not). In a process of its own, as every cell runs (same interpreter and environment)."""
    cmd = [sys.executable, "-m", "docs.bench.gpu", "probe"]
    stdout, stderr, rc = run_process(cmd, env(), timeout_s)
    found = result_line(stdout) if rc == 0 else None
    if found is None:
        return {}, f"workload G's preflight failed ({rc}): {tail(stdout, stderr, 1)}"
    if found["missing"]:
        return found, missing_line(found["missing"])
    if not found["count"]:
        return found, NO_GPU
    return found, None


def machine_line(found: dict) -> str:
    """What G ran on, in one line."""
    return (
        f"{found['name']} (compute capability {found['capability']}, driver "
        f"{found['driver']}; {found['count']} visible), torch {found['torch']} (CUDA "
        f"{found['cuda']}), torchvision {found['torchvision']}, Python {found['python']}"
    )


def env(**extra: str) -> dict[str, str]:
    return {**run_env(THREADS), **extra}


def result_line(stdout: str) -> dict | None:
    for line in reversed(stdout.splitlines()):
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG) :])
    return None


def tail(stdout: str, stderr: str, lines: int = 3) -> str:
    return " / ".join((stdout + stderr).strip().splitlines()[-lines:])


def train_cell(
    name: str,
    cmd: list[str],
    run_dir: Path,
    timeout_s: float,
    extra_env: dict[str, str] | None = None,
    must_say: str | None = None,
    ranks: int = 1,
) -> dict:
    """One train.py process (`extra_env` on top of G's environment); its status, wall, first
    step, steady samples/s and MFU from the run dir (`run_dir`: where its result.json and
    metrics.jsonl land). `must_say`: a line its output must hold, else it failed; `ranks`: how
    many ranks result.json must report (each with GPU memory used), else it failed."""
    from docs.bench.workloads import steady_rate

    tic = time.perf_counter()
    stdout, stderr, rc = run_process(cmd, env(**(extra_env or {})), timeout_s)
    row = {"cell": name, "wall_s": time.perf_counter() - tic, "command": " ".join(cmd[1:])}
    if rc != 0:
        return {**row, "status": f"FAILED ({rc})", "note": tail(stdout, stderr)}
    try:
        result = json.loads((run_dir / "result.json").read_text())
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    except (OSError, ValueError) as e:
        return {**row, "status": "FAILED (no result)", "note": str(e)}
    if must_say is not None and must_say not in stdout + stderr:
        return {**row, "status": "FAILED (not said)", "note": f"no {must_say!r} in its output"}
    if (problem := rank_problem(result, ranks)) is not None:
        return {**row, "status": "FAILED (ranks)", "note": problem}
    rates = [r["samples_per_s"] for r in rows if "samples_per_s" in r]
    mfus = [r["mfu"] for r in rows if "mfu" in r][1:] or [r["mfu"] for r in rows if "mfu" in r]
    own = app_part(result)
    return {
        **row,
        "status": result.get("status", "?"),
        "first_step_s": own.get("time_to_first_step_s"),
        "samples_per_s": steady_rate(rates),
        "mfu": statistics.median(mfus) if mfus else None,
        "note": f"precision {own.get('precision')}, {own.get('epochs')} epoch(s)",
    }


def rank_problem(result: dict, ranks: int) -> str | None:
    """What is wrong with a completed run's ranks (result.json's peak memory per rank: one
    entry per rank, each the GPU memory it used), or None."""
    peaks = result.get("peak_memory_mb_per_rank") or []
    if len(peaks) != ranks:
        return f"{len(peaks)} rank(s) reported, not {ranks}"
    if not all(peak and peak > 0 for peak in peaks):
        return f"a rank used no GPU memory: {peaks} MiB"
    return None


def eval_cell(name: str, cmd: list[str], out_dir: Path, timeout_s: float) -> dict:
    """One eval.py process: its status and what its eval.json says."""
    tic = time.perf_counter()
    stdout, stderr, rc = run_process(cmd, env(), timeout_s)
    row = {"cell": name, "wall_s": time.perf_counter() - tic, "command": " ".join(cmd[1:])}
    if rc != 0:
        return {**row, "status": f"FAILED ({rc})", "note": tail(stdout, stderr)}
    try:
        report = json.loads((out_dir / "eval.json").read_text())
    except (OSError, ValueError) as e:
        return {**row, "status": "FAILED (no eval.json)", "note": str(e)}
    metrics = report.get("metrics") or {}
    note = f"{report.get('split')} acc {metrics.get('acc', 0):.4f} of {metrics.get('count')}"
    return {**row, "status": report.get("status", "?"), "note": note}


def probe_cell(name: str, probe: str, timeout_s: float) -> dict:
    tic = time.perf_counter()
    cmd = [sys.executable, "-m", "docs.bench.gpu", probe]
    stdout, stderr, rc = run_process(cmd, env(), timeout_s)
    row = {"cell": name, "wall_s": time.perf_counter() - tic, "command": " ".join(cmd[1:])}
    found = result_line(stdout) if rc == 0 else None
    if found is None:
        return {**row, "status": f"FAILED ({rc})", "note": tail(stdout, stderr)}
    return {**row, "status": "ok", "note": found["note"], **found.get("values", {})}


def make_folder_with_cmyk(root: Path) -> Path:
    """A JPEG ImageFolder (docs.bench.common.make_jpegs) whose first training image is a CMYK
    JPEG (ImageNet's train split holds some; nvjpeg does not decode them). Returns root."""
    from PIL import Image

    make_jpegs(root, per_class=32)
    first = root / "train" / "class0" / "0.jpg"
    with Image.open(first) as image:
        image.convert("CMYK").save(first, quality=90)
    return root


TWO_GPUS = "DDP on 2 GPUs (2 NCCL ranks)"
ONE_GPU = "skipped (this machine has 1 GPU: the 2-GPU NCCL DDP cell needs 2)"
NVJPEG_RAN = "by nvjpeg"  # data/decode.py's line on the device path's first batch


def plan(work: Path, gpu_uuid: str | None = None, gpus: int = 1) -> list[tuple[str, float, object]]:
    """(name, time limit in s, how to run it) of every cell, most important first, the
    compiled ones last (the slowest to start). `gpu_uuid`: the GPU's (GPU-...), from the
    preflight; `gpus`: how many it found (2 or more: the 2-GPU NCCL cell runs)."""
    py = sys.executable
    runs = work / "runs"
    device = ("trainer.device=cuda", "trainer.progress_bar=false", "wandb.mode=disabled")
    mnist = (*device, "dataset=mnist", f"dataset.root={work / 'mnist'}")  # its recipe
    one_epoch = ("trainer.max_epochs=1", *mnist)

    def train(name, limit, overrides, run_dir, sweep=False, **kwargs):
        where = f"hydra.sweep.dir={run_dir}" if sweep else f"hydra.run.dir={run_dir}"
        cmd = [py, "train.py", *(["-m", "seed=1"] if sweep else []), *overrides, where]
        landed = run_dir / "0" if sweep else run_dir
        return (name, limit, lambda n, t: train_cell(n, cmd, landed, t, **kwargs))

    def torchrun(name, limit, overrides, run_dir):
        cmd = [py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1"]
        cmd += ["train.py", *overrides, f"hydra.run.dir={run_dir}"]
        return (name, limit, lambda n, t: train_cell(n, cmd, run_dir, t))

    def evaluate(name, limit, trained, out_dir):
        cmd = [py, "eval.py", f"run={trained}", "wandb.mode=disabled", f"hydra.run.dir={out_dir}"]
        return (name, limit, lambda n, t: eval_cell(n, cmd, out_dir, t))

    def skipped(name, status):
        return (name, 30, lambda n, t: {"cell": n, "status": status})

    def throughput(model, precision, fast, compiled=False):
        name = f"{model} {precision} cl {'fast path' if fast else 'DataLoader'}"
        name += " compiled" if compiled else ""
        overrides = (
            f"model={model}",
            "model.small_input_stem=true",
            f"dataset.fast={str(fast).lower()}",
            f"trainer.precision={precision}",
            "trainer.channels_last=true",
            f"trainer.compile={str(compiled).lower()}",
            f"trainer.batch_size={BATCH}",
            f"trainer.limit_train_batches={STEPS}",
            "trainer.limit_val_batches=1",
            "trainer.log_every_n_steps=5",
            "trainer.save_checkpoints=false",
            *one_epoch,
        )
        return train(name, 180 if compiled else 90, overrides, runs / name.replace(" ", "_"))

    uuid = "1-rank sweep job, CUDA_VISIBLE_DEVICES=<GPU UUID>"
    force_ddp = ("dist.force_ddp=true", *one_epoch)
    jpegs = ("dataset=imagefolder", f"dataset.root={work / 'jpegs'}", "dataset.image_size=64")
    return [
        train("1-rank sweep job (launcher, forked rank)", 120, one_epoch, runs / "sweep", True),
        train(
            "python train.py dist.nproc_per_node=1",
            90,
            ("dist.nproc_per_node=1", *one_epoch),
            runs / "one",
        ),
        train(
            "its resume (resume=auto, a 2nd epoch)",
            60,
            ("dist.nproc_per_node=1", "trainer.max_epochs=2", "resume=auto", *mnist),
            runs / "one",
            must_say="resumed from",
        ),
        evaluate("eval.py of its best.pt", 60, runs / "one", runs / "eval"),
        torchrun("plain torchrun --nproc-per-node=1", 90, one_epoch, runs / "torchrun"),
        train(
            uuid, 90, one_epoch, runs / "uuid", True, extra_env={"CUDA_VISIBLE_DEVICES": gpu_uuid}
        )
        if gpu_uuid
        else (uuid, 90, lambda n, t: {"cell": n, "status": "skipped (no UUID from the preflight)"}),
        train("DDP at world size 1 (NCCL, dist.force_ddp)", 90, force_ddp, runs / "ddp"),
        # a real all-reduce between 2 GPUs (the cells above: 1-rank groups)
        train(
            TWO_GPUS,
            120,
            ("dist.nproc_per_node=2", "dist.backend=nccl", *one_epoch),
            runs / "two_gpus",
            ranks=2,
        )
        if gpus >= 2
        else skipped(TWO_GPUS, ONE_GPU),
        train(
            "JPEG ImageFolder, nvjpeg, a CMYK file",
            90,
            (*jpegs, "trainer.batch_size=64", "trainer.max_epochs=1", *device),
            runs / "jpeg",
            must_say=NVJPEG_RAN,  # the device path ran, not the workers' host decoder
        ),
        ("JPEG decode, CPU vs CUDA", 90, lambda name, t: probe_cell(name, "decode", t)),
        ("bf16 matmul vs the MFU peak", 60, lambda name, t: probe_cell(name, "matmul", t)),
        throughput("resnet18", "32", fast=True),  # MFU at precision 32 (TF32's peak)
        throughput("resnet18", "fp16", fast=True),  # autocast fp16 with the GradScaler
        *(
            throughput(model, "bf16", fast)
            for model in ("resnet18", "resnet50")
            for fast in (True, False)
        ),
        # dynamo's DDPOptimizer says so in its log when it splits the graph at DDP's buckets
        train(
            "DDP at world size 1, compiled (DDPOptimizer)",
            180,
            ("trainer.compile=true", *force_ddp),
            runs / "ddp_compiled",
            extra_env={"TORCH_LOGS": "+torch._dynamo.backends.distributed"},
            must_say="DDPOptimizer used",
        ),
        # compile: the fast path only (time)
        *(throughput(model, "bf16", True, compiled=True) for model in ("resnet18", "resnet50")),
    ]


def run(work: Path, found: dict | None = None) -> tuple[str, int]:
    """The check's table and how many cells failed. Call only where the preflight passed
    (`found`: what it found)."""
    found = found or {}
    started = time.perf_counter()
    make_mnist(work / "mnist", n_train=(STEPS + 8) * BATCH)  # 10 % of it is carved as val
    make_folder_with_cmyk(work / "jpegs")
    rows = []
    for name, limit, cell in plan(work, found.get("uuid"), found.get("count") or 1):
        left = BUDGET_S - (time.perf_counter() - started)
        if left < min(limit, 45):
            rows.append({"cell": name, "status": "skipped (time budget)"})
            continue
        row = cell(name, min(limit, left))
        rows.append(row)
        print(f"[G] {name}: {row['status']} ({row.get('wall_s', 0):.1f} s)", file=sys.stderr)
    ran_on = f"Ran on: {machine_line(found)}\n\n" if found.get("count") else ""
    return ran_on + table(rows), sum(r["status"].startswith("FAILED") for r in rows)


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
    """The preflight's look: which of the packages the lock lists for G this environment lacks
    (missing_packages), the GPUs torch sees, and the versions G runs with."""
    missing = missing_packages(wheel_pins())
    import torch
    import torchvision

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    found = {
        "missing": missing,
        "count": count,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "torchvision": torchvision.__version__,
    }
    if count:
        props = torch.cuda.get_device_properties(0)
        uuid = getattr(props, "uuid", None)  # CUDA_VISIBLE_DEVICES names it GPU-<uuid>
        found |= {
            "name": props.name,
            "capability": f"{props.major}.{props.minor}",
            "uuid": f"GPU-{uuid}" if uuid is not None else None,
            "driver": driver_version(),
        }
    return found


def missing_packages(pins: dict[str, str]) -> list[str]:
    """The distributions of `pins` this environment lacks: not installed, or installed but one
    of its modules fails to import (MODULES, else the top-level modules it lists). Versions are
    not compared: `run` installs the lock's."""
    from importlib.metadata import PackageNotFoundError, distribution, packages_distributions

    canonical = lockfile().canonicalize_name
    top_level: dict[str, list[str]] = {}
    for module, dists in packages_distributions().items():
        if module.isidentifier() and not module.startswith("_"):
            for dist in dists:
                top_level.setdefault(canonical(dist), []).append(module)
    missing = []
    for dist in pins:
        try:
            distribution(dist)
            modules = [MODULES[dist]] if dist in MODULES else sorted(top_level.get(dist, []))
            for module in modules:
                importlib.import_module(module)
        except (PackageNotFoundError, ImportError):
            missing.append(dist)
    return missing


def driver_version() -> str:
    """The NVIDIA driver's version (nvidia-smi; torch does not say), or "n/a"."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "n/a"
    query = [smi, "--query-gpu=driver_version", "--format=csv,noheader"]
    try:
        done = subprocess.run(query, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "n/a"
    lines = done.stdout.split()
    return lines[0] if done.returncode == 0 and lines else "n/a"


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
    sys.path[:0] = [str(REPO), str(REPO / "launch")]
    if sys.argv[1] in ("wheels", "run"):
        sys.exit(main(sys.argv[1:]))
    print(RESULT_TAG + json.dumps(PROBES[sys.argv[1]]()), flush=True)
