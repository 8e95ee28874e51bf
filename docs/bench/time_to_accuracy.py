"""Workload E of `python -m docs.bench`: time to accuracy on real data.

    python -m docs.bench.real_data --out DIR            (once: real MNIST + Fashion-MNIST)
    python -m docs.bench --workloads E --real-data DIR [--world-sizes 1,2] [--repeats 3]

Seconds from process start to the first validation at a target accuracy (MNIST val 99.0 %,
Fashion-MNIST val 90.0 %), for two sides with the same model (the small CNN) and data (the same
val split), each as its own process (world size 2: torchrun), alternated per repeat:

  train.py  its defaults for the dataset (`dataset=<name> dataset.root=DIR`, nothing else
            but logging, device and run dir): the dataset's recipe, schedule, fast data path
  seed      docs/bench/reference.py --workload E: the DDP lesson's plain loop (constant-lr SGD with
            momentum at train.py's default batch, no augmentation, DataLoader +
            DistributedSampler), rank 0 validating after every epoch

The clock starts just before the process is started and stops at the wall time (Unix time) the
first validation at the target was logged: train.py's metrics.jsonl val row, the seed's VAL_TAG
line. A run is stopped there. The speed ratio is seed seconds / train.py seconds (medians over
repeats): > 1 means train.py gets there sooner.

A side that ends (its epochs done, or the timeout) without reaching the target has no time to
accuracy, only a bound: it took longer than it ran. Its seconds are then the time it ran, marked
">" in the table; a seed bound makes the ratio a lower bound (">= 1.0 is still a PASS: the seed
had not got there when it stopped later than train.py got there), a train.py bound makes it a
MISS. A run counts as failed only if its process failed (exit status not 0, not stopped by us).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from docs.bench.common import REPO, fmt, launch, markdown, median, ratio, run_env

TARGETS = {"mnist": 0.99, "fashion_mnist": 0.90}
FOLDERS = {"mnist": "MNIST", "fashion_mnist": "FashionMNIST"}
MAX_EPOCHS = 10  # the seed's at most (train.py runs its own default number of epochs)
SIDES = ("train.py", "seed")
VAL_TAG = "E_VAL "  # docs/bench/reference.py's validation lines
POLL_S = 0.1


@dataclass(frozen=True)
class Run:
    dataset: str
    world_size: int
    data_root: Path
    threads: int
    target: float
    timeout_s: float = 1800.0
    train_overrides: tuple[str, ...] = ()


def train_command(r: Run, run_dir: Path) -> list[str]:
    overrides = [
        f"dataset={r.dataset}",
        f"dataset.root={r.data_root}",
        "trainer.test_after_fit=false",  # stopped at the target anyway
        "trainer.progress_bar=false",
        "trainer.device=cpu",
        "dist.backend=gloo",
        "wandb.mode=disabled",
        f"hydra.run.dir={run_dir}",
        *r.train_overrides,
    ]
    return launch(r.world_size, ["train.py", *overrides])


def seed_command(r: Run) -> list[str]:
    args = ["-m", "docs.bench.reference", "--workload", "E", "--dataset", r.dataset]
    args += ["--data-root", str(r.data_root), "--target", str(r.target)]
    return launch(r.world_size, [*args, "--max-epochs", str(MAX_EPOCHS)])


def train_vals(run_dir: Path) -> list[dict]:
    """train.py's validations so far: {epoch, val_acc, time} from metrics.jsonl."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:  # a line being written
            continue
        if "val/acc" in row:
            rows.append({"epoch": row["epoch"], "val_acc": row["val/acc"], "time": row["time"]})
    return rows


def seed_vals(stdout_path: Path) -> list[dict]:
    if not stdout_path.exists():
        return []
    return [
        json.loads(line[len(VAL_TAG) :])
        for line in stdout_path.read_text().splitlines()
        if line.startswith(VAL_TAG) and line.endswith("}")
    ]


def run_side(r: Run, side: str, run_dir: Path) -> dict:
    """One process of ``side``, stopped at its first validation at the target: seconds to it
    (None if never reached), the epoch, every validation seen."""
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = train_command(r, run_dir) if side == "train.py" else seed_command(r)
    out_path, err_path = run_dir / "bench_stdout.txt", run_dir / "bench_stderr.txt"
    vals = (lambda: train_vals(run_dir)) if side == "train.py" else (lambda: seed_vals(out_path))
    with open(out_path, "w") as out, open(err_path, "w") as err:
        started = time.time()
        proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            env=run_env(r.threads),
            stdout=out,
            stderr=err,
            start_new_session=True,  # stopping it stops torchrun's ranks too
        )
        reached = None
        try:
            while proc.poll() is None and time.time() - started < r.timeout_s:
                reached = next((v for v in vals() if v["val_acc"] >= r.target), None)
                if reached is not None:
                    break
                time.sleep(POLL_S)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        ran_s = time.time() - started
    seen = vals()
    reached = reached or next((v for v in seen if v["val_acc"] >= r.target), None)
    result = {
        "side": side,
        "command": cmd,
        "run_dir": str(run_dir),
        "vals": seen,
        "seconds": None if reached is None else reached["time"] - started,
        "epoch": None if reached is None else reached["epoch"],
        "ran_s": ran_s,  # with seconds None: the time to accuracy is longer than this
    }
    if reached is None and proc.returncode != 0 and ran_s < r.timeout_s:
        tail = "\n".join(err_path.read_text().strip().splitlines()[-10:])
        result["error"] = f"exit status {proc.returncode} before reaching {r.target}: {tail}"
    return result


def side_seconds(runs: list[dict]) -> tuple[float | None, bool]:
    """The median time to accuracy over repeats, and whether it is exact: where a repeat never
    got there, its run time stands in, and the median is a lower bound."""
    # ran_s: None in files saved before bounds existed
    seconds = median(x["seconds"] if x["seconds"] is not None else x.get("ran_s") for x in runs)
    return seconds, all(x["seconds"] is not None for x in runs)


def bench_cell(r: Run, repeats: int, work: Path) -> dict:
    runs: dict[str, list[dict]] = {side: [] for side in SIDES}
    for rep in range(repeats):
        for side in SIDES[rep % 2 :] + SIDES[: rep % 2]:  # alternated: noise hits both
            run_dir = work / f"E-{r.dataset}-ws{r.world_size}" / f"r{rep}-{side.replace('.', '_')}"
            res = run_side(r, side, run_dir)
            runs[side].append(res)
            where = f"[E {r.dataset} world {r.world_size} repeat {rep + 1}/{repeats}] {side:8s}"
            accs = " ".join(f"{v['val_acc']:.4f}" for v in res["vals"])
            if "error" in res:
                print(f"{where} FAILED: {res['error']}", flush=True)
            elif res["seconds"] is None:
                print(
                    f"{where} not at val/acc >= {r.target} after {res['ran_s']:.1f} s "
                    f"({len(res['vals'])} epochs; val {accs})",
                    flush=True,
                )
            else:
                print(
                    f"{where} {res['seconds']:.1f} s to val/acc >= {r.target} "
                    f"(epoch {res['epoch']}; val {accs})",
                    flush=True,
                )
    return summarize(r, runs)


def summarize(r: Run, runs: dict[str, list[dict]]) -> dict:
    """One cell's row from its runs by side (run_side's results): medians, bounds, the ratio."""
    seconds, exact = {}, {}
    for side in SIDES:
        seconds[side], exact[side] = side_seconds(runs[side])
    # where a repeat never got there: the epochs it ran (a lower bound, as its seconds)
    epochs = {side: median(x["epoch"] or len(x["vals"]) for x in runs[side]) for side in SIDES}
    return {
        "workload": "E",
        "dataset": r.dataset,
        "target": r.target,
        "world_size": r.world_size,
        "omp_num_threads": r.threads,
        "seconds": seconds,
        "exact": exact,  # False: that side's seconds are a lower bound (never got there)
        "epochs": epochs,
        "speed_ratio": ratio(seconds["seed"], seconds["train.py"]),
        "failed_runs": sum("error" in x for side in SIDES for x in runs[side]),
        "runs": runs,
    }


def bounds(row: dict) -> dict[str, str]:
    """By side: ">" where its seconds are a lower bound (it never got there), else ""."""
    exact = row.get("exact", dict.fromkeys(SIDES, True))  # rows saved before bounds existed
    return {side: "" if exact[side] or row["seconds"][side] is None else ">" for side in SIDES}


def verdict(row: dict) -> str:
    """PASS when train.py got there no later than the seed did, or than the seed stopped
    without getting there; MISS when train.py never got there or the seed was sooner."""
    if row["speed_ratio"] is None:
        return "n/a"
    return "PASS" if not bounds(row)["train.py"] and row["speed_ratio"] >= 1.0 else "MISS"


def speed_cell(row: dict) -> str:
    """The ratio, as a lower bound (">") where only the seed never got there, an upper bound
    ("<") where only train.py never did; no ratio where neither did."""
    bound = bounds(row)
    if row["speed_ratio"] is None or (bound["train.py"] and bound["seed"]):
        return "n/a"
    return ("<" if bound["train.py"] else bound["seed"]) + fmt(row["speed_ratio"], ".2f")


def table(rows: list[dict]) -> str:
    """Workload E's summary as a Markdown table, one row per dataset x world size."""
    head = "dataset|target val/acc|world|train.py s|seed s|seed/train.py (speed)"
    lines = [[*head.split("|"), "epochs train.py / seed", "target"]]
    for row in rows:
        s, e, bound = row["seconds"], row["epochs"], bounds(row)
        lines.append(
            [
                row["dataset"],
                f"{row['target']:.3f}",
                str(row["world_size"]),
                bound["train.py"] + fmt(s["train.py"], ".1f"),
                bound["seed"] + fmt(s["seed"], ".1f"),
                speed_cell(row),
                " / ".join(bound[side] + fmt(e[side], "g") for side in SIDES),
                verdict(row),
            ]
        )
    return markdown(lines)


def run(
    data_root: Path,
    world_sizes: list[int],
    repeats: int,
    cores: int,
    work: Path,
    datasets: tuple[str, ...] = tuple(TARGETS),
    train_overrides: tuple[str, ...] = (),
    timeout_s: float = 1800.0,
    digests: dict[str, dict[str, str]] | None = None,
    targets: dict[str, float] | None = None,
) -> list[dict]:
    """Every dataset x world size; the data's digests are checked first (docs/bench/real_data.py;
    ``digests`` and ``targets`` replace the official files' and TARGETS, for tests)."""
    from docs.bench import real_data

    targets = TARGETS if targets is None else targets
    for dataset in datasets:
        real_data.check(data_root, FOLDERS[dataset], None if digests is None else digests[dataset])
    return [
        bench_cell(
            Run(
                dataset,
                world,
                data_root,
                threads=max(1, cores // world),
                target=targets[dataset],
                timeout_s=timeout_s,
                train_overrides=train_overrides,
            ),
            repeats,
            work,
        )
        for dataset in datasets
        for world in world_sizes
    ]


def legend(repeats: int, cores: int) -> str:
    return (
        "E = time to accuracy on real data: seconds from process start to the first validation "
        "at the target (val split: 10 % of the training set, by class), median over "
        f"{repeats} repeat(s), sides alternated; {cores} CPU cores, OMP_NUM_THREADS = cores / "
        "world size, gloo. train.py: its defaults for the dataset; seed: the DDP lesson's "
        "plain loop (docs/bench/reference.py --workload E). speed = seed s / train.py s (>= 1.0: "
        "PASS). >: that side never reached the target; its seconds are how long it ran (its "
        "epochs, or the timeout), so the speed is a lower bound."
    )
