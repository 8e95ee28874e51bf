"""Workload S: what starting costs (`python -m docs.bench --workloads S [--compare OTHER_TREE]`).

Every figure is a whole command's wall time, each measured `repeats` times in turn with the
others (A B C ... A B C ...: a noisy machine slows all alike), reported as the median and as
seconds over the floor (`import torch, torch._dynamo`: every training process pays it, the
first optimizer step imports dynamo). A job's fixed cost is its wall at 1 epoch minus one
epoch, an epoch being (wall at 3 epochs - wall at 1 epoch) / 2. W&B is at its default, as a new
user has it (offline without a key). `--compare DIR` runs the same commands in another
checkout of this repo, in the same rotation, and prints the ratio this / other.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SWEEP_1, SWEEP_2 = 10, 4  # jobs in the 1-rank sweep and in the 2-rank sweep


def commands(out: Path, py: str | None = None) -> dict[str, list[str]]:
    """The timed commands, by name, run by the interpreter `py` (None: this one); `out` holds
    their run dirs."""
    py = py or sys.executable

    def train(name: str, *overrides: str) -> list[str]:
        return [py, "train.py", *overrides, f"hydra.run.dir={out / name}"]

    seeds = ",".join(str(s) for s in range(1, SWEEP_1 + 1))
    return {
        "floor": [py, "-c", "import torch, torch._dynamo"],
        "1 rank, 1 epoch": train("r1e1", "trainer.max_epochs=1"),
        "1 rank, 3 epochs": train("r1e3", "trainer.max_epochs=3"),
        "2 ranks, 1 epoch": train("r2e1", "dist.nproc_per_node=2", "trainer.max_epochs=1"),
        "2 ranks, 3 epochs": train("r2e3", "dist.nproc_per_node=2", "trainer.max_epochs=3"),
        "torchrun 2, 1 epoch": [
            *(py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"),
            *("train.py", "trainer.max_epochs=1", f"hydra.run.dir={out / 't2e1'}"),
        ],
        "torchrun 2, 3 epochs": [
            *(py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"),
            *("train.py", "trainer.max_epochs=3", f"hydra.run.dir={out / 't2e3'}"),
        ],
        "sweep 1-rank": [
            *(py, "train.py", "-m", "trainer.max_epochs=1", f"seed={seeds}"),
            f"hydra.sweep.dir={out / 's1'}",
        ],
        "sweep 2-rank": [
            *(py, "train.py", "-m", "trainer.max_epochs=1", "dist.nproc_per_node=2"),
            *(f"seed={','.join(str(s) for s in range(1, SWEEP_2 + 1))}",),
            f"hydra.sweep.dir={out / 's2'}",
        ],
        "--help": [py, "train.py", "--help"],
        "--cfg job": [py, "train.py", "--cfg", "job"],
    }


def tree_path(tree: Path) -> list[str]:
    """The import path of `tree`'s code alone: the tree, its launcher package (launch/, since it
    became one), and for a tree from before that a shadow of the installed package's Hydra
    plugin, so that Hydra, which imports every plugin on the path, finds only the tree's own."""
    if (tree / "launch" / "pyproject.toml").exists():
        return [str(tree), str(tree / "launch")]
    shadow = Path(tempfile.gettempdir()) / "hydra-ddp-bench-shadow"
    plugin = shadow / "hydra_plugins" / "hydra_ddp_launcher"
    plugin.mkdir(parents=True, exist_ok=True)
    (plugin / "__init__.py").touch()
    return [str(shadow), str(tree)]


def timed(cmd: list[str], tree: Path, timeout_s: float) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "HYDRA_"))}
    env["PYTHONPATH"] = os.pathsep.join(tree_path(tree))
    started = time.perf_counter()
    proc = subprocess.run(
        cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout_s, check=False
    )
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
        raise RuntimeError(f"{' '.join(cmd[1:4])} in {tree}: exit {proc.returncode}: {tail}")
    return wall


def measure(
    trees: list[tuple[Path, str]], repeats: int, work: Path, timeout_s: float
) -> list[dict]:
    """{name: [walls]} per (tree, interpreter), every command in turn, one after another,
    `repeats` rounds."""
    walls: list[dict[str, list[float]]] = [{} for _ in trees]
    for r in range(repeats):
        for i, (tree, py) in enumerate(trees):
            for name, cmd in commands(work / f"t{i}r{r}", py).items():
                walls[i].setdefault(name, []).append(timed(cmd, tree, timeout_s))
    return [{name: statistics.median(w) for name, w in tree.items()} for tree in walls]


def figures(m: dict[str, float]) -> dict[str, float]:
    """The table's figures from one tree's medians."""

    def fixed(one: str, three: str) -> float:
        return m[one] - (m[three] - m[one]) / 2

    return {
        "floor: import torch, torch._dynamo": m["floor"],
        "python train.py: fixed cost": fixed("1 rank, 1 epoch", "1 rank, 3 epochs"),
        "python train.py dist.nproc_per_node=2: fixed cost": fixed(
            "2 ranks, 1 epoch", "2 ranks, 3 epochs"
        ),
        "torchrun --nproc_per_node=2 train.py: fixed cost": fixed(
            "torchrun 2, 1 epoch", "torchrun 2, 3 epochs"
        ),
        f"{SWEEP_1}-job sweep of 1-rank jobs: per job": m["sweep 1-rank"] / SWEEP_1,
        f"{SWEEP_2}-job sweep of 2-rank jobs: per job": m["sweep 2-rank"] / SWEEP_2,
        "python train.py --help": m["--help"],
        "python train.py --cfg job": m["--cfg job"],
    }


def table(labels: list[str], results: list[dict[str, float]]) -> str:
    rows = [figures(m) for m in results]
    head = ["figure", *(f"{label} s (over floor)" for label in labels)]
    if len(labels) == 2:
        head.append("this / other")
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for key in rows[0]:
        cells = [key]
        for row in rows:
            over = row[key] - row["floor: import torch, torch._dynamo"]
            cells.append(f"{row[key]:.2f} ({over:+.2f})")
        if len(labels) == 2:
            cells.append(f"{rows[0][key] / rows[1][key]:.2f}")
        lines.append(" | ".join(cells))
    return "\n".join(lines)


def run(
    repeats: int,
    work: Path,
    compare: Path | None,
    timeout_s: float,
    compare_python: list[str] = (),
) -> str:
    """`compare`: another checkout, run by this interpreter; `compare_python`: other
    interpreters (another torch, say), each running this checkout (or `compare`)."""
    trees = [(REPO, sys.executable)]
    if compare:
        trees.append((compare.resolve(), sys.executable))
    trees += [(trees[-1][0], py) for py in compare_python]
    labels = [tree.name or str(tree) for tree, _ in trees]
    if compare_python:
        from docs.bench.common import torch_label

        pythons = [py for _, py in trees]
        labels = [f"{t} ({torch_label(py)})" for t, py in zip(labels, pythons, strict=True)]
    text = table(labels, measure(trees, repeats, work, timeout_s))
    return f"Workload S: start-up, medians of {repeats}, in turn\n{text}"
