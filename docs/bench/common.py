"""What every benchmark workload shares: starting a run (one process or torchrun), its
environment, timing a process, medians and ratios, table formatting, generated data (MNIST-format
idx files, a JPEG ImageFolder). Imports nothing heavy."""

from __future__ import annotations

import os
import random
import signal
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


RESULT_TAG = "BENCH_RESULT "  # how bench_reference.py's result line starts


def app_part(result: dict) -> dict:
    """train.py's own fields of a result.json: its `app` part, or the record itself where a
    checkout compared against wrote one flat mapping (5f215d2 and before)."""
    return result["app"] if isinstance(result.get("app"), dict) else result


MNIST_TEST_SAMPLES = 1000


JPEG_CLASSES, JPEG_SIDES, JPEG_QUALITY, JPEG_VAL_PER_CLASS = 10, (96, 160), 90, 4


def process_age() -> float:
    """Seconds since this process started (Linux: /proc/self/stat start time, in clock ticks
    after boot, against CLOCK_BOOTTIME; 10 ms resolution)."""
    with open("/proc/self/stat") as f:
        fields = f.read().rpartition(")")[2].split()  # fields 3.. of proc(5)
    start_ticks = int(fields[22 - 3])  # field 22: starttime
    return time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")


def median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


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


def launch(world_size: int, target: list[str], python: str | None = None) -> list[str]:
    """`target`'s command line at `world_size` (torchrun above 1), run by `python` (None: this
    interpreter; another venv's to compare torch versions)."""
    python = python or sys.executable
    if world_size == 1:
        return [python, *target]
    return [
        python,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={world_size}",
        *target,
    ]


def run_env(threads: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.pop("HYDRA_DDP_FAULT", None)
    path = os.pathsep.join(p for p in (str(REPO), str(REPO / "launch"), env.get("PYTHONPATH")) if p)
    env.update(
        OMP_NUM_THREADS=str(threads),
        PYTHONPATH=path,
        PYTHONUNBUFFERED="1",
        WANDB_MODE="disabled",
        WANDB_SILENT="true",
    )
    return env


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


def fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def fmt_mb(values: list[float] | None) -> str:
    return "n/a" if not values else "/".join(f"{v:.0f}" for v in values)


def markdown(lines: list[list[str]]) -> str:
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    text = [
        "| " + " | ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) + " |"
        for line in lines
    ]
    text.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(text)


def torch_label(python: str | None) -> str:
    """`python`'s Python and torch versions, to tell compared interpreters apart."""
    code = "import sys, torch; print(sys.version.split()[0], torch.__version__)"
    out = subprocess.run(
        [python or sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    return f"py {out[0]}, torch {out[1]}"
