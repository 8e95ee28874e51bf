"""Workload E of `python -m docs.bench`: time to accuracy on real data.

    python -m docs.bench.real_data --out DIR            (once: real MNIST + Fashion-MNIST)
    python -m docs.bench --workloads E --real-data DIR [--world-sizes 1,2] [--e-seeds 0,1,2,3,4]
                         [--e-baseline b2beecb|none]

Per dataset x world size x seed, each side runs its whole recipe once as its own process (world
size 2: torchrun), the sides in turn (rotated per seed, so noise hits all alike), with the same
model family (the small CNN), data and val split:

  train.py  this tree's defaults for the dataset (`dataset=<name> dataset.root=DIR seed=N`,
            nothing else but logging, device and run dir; `trainer.target` set to the target,
            which records the first validation at it without changing the run)
  b2beecb   the same command in a git worktree of commit b2beecb (`--e-baseline REV`; none:
            skip): its defaults before the time-to-accuracy recipes (5 epochs, batch 64)
  seed      docs/bench/reference.py --workload E: the DDP lesson's plain loop (constant-lr SGD with
            momentum at the batch of 64, no augmentation, DataLoader + DistributedSampler) for
            b2beecb's 5 epochs, rank 0 validating after every epoch

Two figures per run: the seconds from process start to the first validation at the target
(MNIST val 99.0 %, Fashion-MNIST val 90.0 %): the clock starts just before the process is
started and stops at the wall time (Unix time) of that validation (train.py's metrics.jsonl val
row, the seed's VAL_TAG line), the same clock for every side; and the test accuracy at the
recipe's end (train.py: best.pt on the test split, result.json; the seed: its last epoch's, its
TEST_TAG line). Reported per side as the median and the worst over seeds; the first table is
train.py against the seed (the speed ratio is seed seconds / train.py seconds, medians).

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
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from docs.bench.common import REPO, app_part, fmt, launch, markdown, median, ratio, run_env

TARGETS = {"mnist": 0.99, "fashion_mnist": 0.90}
FOLDERS = {"mnist": "MNIST", "fashion_mnist": "FashionMNIST"}
SIDES = ("train.py", "seed")  # the speed ratio's
BASELINE_REV = "b2beecb"  # the tree before the time-to-accuracy recipes
SEEDS = (0, 1, 2, 3, 4)
VAL_TAG, TEST_TAG = "E_VAL ", "E_TEST "  # docs/bench/reference.py's lines
POLL_S = 0.1
# issue 45's "done when", per dataset: this tree's 1-rank median seconds to the target at most;
# 2 ranks at most this times the 1-rank median; the test accuracy's mean at least, and its
# worst seed within this many points of the mean
DONE_WHEN = {"mnist": (20.0, 1.15, 0.992, 0.003), "fashion_mnist": (25.0, 1.15, 0.915, 0.003)}


@dataclass(frozen=True)
class Run:
    dataset: str
    world_size: int
    data_root: Path
    threads: int
    target: float
    timeout_s: float = 1800.0
    train_overrides: tuple[str, ...] = ()
    baseline: Path | None = None  # a checkout of BASELINE_REV: its train.py is the side b2beecb


def train_command(r: Run, run_dir: Path, seed: int = 0, baseline: bool = False) -> list[str]:
    overrides = [
        f"dataset={r.dataset}",
        f"dataset.root={r.data_root}",
        f"seed={seed}",
        "trainer.progress_bar=false",
        "trainer.device=cpu",
        "dist.backend=gloo",
        "wandb.mode=disabled",
        f"hydra.run.dir={run_dir}",
        # records the first validation at it in result.json (b2beecb has no such key)
        *([] if baseline else [f"trainer.target={r.target}"]),
        *r.train_overrides,
    ]
    return launch(r.world_size, ["train.py", *overrides])


def seed_command(r: Run, seed: int = 0) -> list[str]:
    args = ["-m", "docs.bench.reference", "--workload", "E", "--dataset", r.dataset]
    return launch(r.world_size, [*args, "--data-root", str(r.data_root), "--seed", str(seed)])


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


def seed_vals(stdout_path: Path, tag: str = VAL_TAG) -> list[dict]:
    if not stdout_path.exists():
        return []
    return [
        json.loads(line[len(tag) :])
        for line in stdout_path.read_text().splitlines()
        if line.startswith(tag) and line.endswith("}")
    ]


def end_test_acc(side: str, run_dir: Path) -> float | None:
    """The test accuracy at the recipe's end: train.py's result.json, the seed's TEST_TAG line."""
    if side == "seed":
        tests = seed_vals(run_dir / "bench_stdout.txt", TEST_TAG)
        return tests[-1]["test_acc"] if tests else None
    try:
        return app_part(json.loads((run_dir / "result.json").read_text()))["test"].get("test/acc")
    except (OSError, ValueError, KeyError, AttributeError):
        return None


def run_side(r: Run, side: str, run_dir: Path, seed: int = 0) -> dict:
    """One process of ``side`` (train.py, BASELINE_REV's train.py or the seed), run to its
    recipe's end: seconds to its first validation at the target (None if never reached), the
    epoch, every validation seen, the test accuracy at the end."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if side == "seed":
        cmd, cwd = seed_command(r, seed), REPO
    else:
        baseline = side != "train.py"
        cmd, cwd = train_command(r, run_dir, seed, baseline), r.baseline if baseline else REPO
    out_path, err_path = run_dir / "bench_stdout.txt", run_dir / "bench_stderr.txt"
    vals = (lambda: seed_vals(out_path)) if side == "seed" else (lambda: train_vals(run_dir))
    with open(out_path, "w") as out, open(err_path, "w") as err:
        started = time.time()
        proc = subprocess.Popen(
            cmd,
            cwd=cwd,
            env=run_env(r.threads),
            stdout=out,
            stderr=err,
            start_new_session=True,  # stopping it stops torchrun's ranks too
        )
        try:
            while proc.poll() is None and time.time() - started < r.timeout_s:
                time.sleep(POLL_S)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        ran_s = time.time() - started
    seen = vals()
    reached = next((v for v in seen if v["val_acc"] >= r.target), None)
    result = {
        "side": side,
        "seed": seed,
        "command": cmd,
        "run_dir": str(run_dir),
        "vals": seen,
        "seconds": None if reached is None else reached["time"] - started,
        "epoch": None if reached is None else reached["epoch"],
        "ran_s": ran_s,  # with seconds None: the time to accuracy is longer than this
        "test_acc": end_test_acc(side, run_dir),
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


def bench_cell(r: Run, seeds: tuple[int, ...], work: Path) -> dict:
    sides = (*SIDES[:1], *([BASELINE_REV] if r.baseline else []), *SIDES[1:])
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    for rep, seed in enumerate(seeds):
        for side in sides[rep % len(sides) :] + sides[: rep % len(sides)]:  # rotated
            run_dir = work / f"E-{r.dataset}-ws{r.world_size}" / f"s{seed}-{side.replace('.', '_')}"
            res = run_side(r, side, run_dir, seed)
            runs[side].append(res)
            where = f"[E {r.dataset} world {r.world_size} seed {seed}] {side:8s}"
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
                    f"(epoch {res['epoch']}; val {accs}; test {fmt(res['test_acc'], '.4f')})",
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
    by_side = {side: side_stats(side_runs) for side, side_runs in runs.items()}
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
        "failed_runs": sum("error" in x for side in runs for x in runs[side]),
        "by_side": by_side,
        "runs": runs,
    }


def side_stats(runs: list[dict]) -> dict:
    """One side's figures over seeds: seconds to the target (median, worst; a seed that never
    got there counts as the time it ran, and makes them bounds), epochs to it, test accuracy at
    the end (mean, worst)."""
    seconds = [x["seconds"] if x["seconds"] is not None else x.get("ran_s") for x in runs]
    seconds = [v for v in seconds if v is not None]
    tests = [x["test_acc"] for x in runs if x.get("test_acc") is not None]
    return {
        "seeds": [x.get("seed") for x in runs],
        "reached": sum(x["seconds"] is not None for x in runs),
        "seconds_median": median(seconds),
        "seconds_worst": max(seconds) if seconds else None,
        "epochs": [x["epoch"] for x in runs],
        "test_mean": sum(tests) / len(tests) if tests else None,
        "test_worst": min(tests) if tests else None,
    }


def side_table(rows: list[dict]) -> str:
    """Workload E per side, over seeds: one line per side x dataset x world size, then this
    tree's verdict against DONE_WHEN (1 rank: seconds; 2 ranks: x the 1-rank median)."""
    head = "side|dataset|world|reached|s to target: median|worst|epochs to it|test acc: mean|worst"
    lines = [[*head.split("|"), "done when"]]
    one_rank = {
        row["dataset"]: row["by_side"]["train.py"]["seconds_median"]
        for row in rows
        if row["world_size"] == 1 and "by_side" in row
    }
    for row in rows:
        for side, st in row.get("by_side", {}).items():
            bound = ">" if st["reached"] < len(st["epochs"]) else ""
            lines.append(
                [
                    side,
                    row["dataset"],
                    str(row["world_size"]),
                    f"{st['reached']}/{len(st['epochs'])}",
                    bound + fmt(st["seconds_median"], ".1f"),
                    bound + fmt(st["seconds_worst"], ".1f"),
                    " ".join("-" if e is None else str(e) for e in st["epochs"]),
                    fmt(None if st["test_mean"] is None else 100 * st["test_mean"], ".2f"),
                    fmt(None if st["test_worst"] is None else 100 * st["test_worst"], ".2f"),
                    done_when(row, st, one_rank.get(row["dataset"])) if side == "train.py" else "",
                ]
            )
    return markdown(lines)


def done_when(row: dict, st: dict, one_rank_s: float | None) -> str:
    """This tree against issue 45's DONE_WHEN: PASS, or what misses it."""
    limit_s, factor, least, spread = DONE_WHEN[row["dataset"]]
    if row["world_size"] != 1:
        limit_s = None if one_rank_s is None else factor * one_rank_s
    misses = []
    if st["reached"] < len(st["epochs"]) or limit_s is None or st["seconds_median"] > limit_s:
        misses.append("seconds" if limit_s is None else f"seconds > {limit_s:.1f}")
    if st["test_mean"] is None or st["test_mean"] < least:
        misses.append(f"test mean < {100 * least:.1f}")
    elif st["test_mean"] - st["test_worst"] > spread:
        misses.append(f"worst > {100 * spread:.1f} below mean")
    return "PASS" if not misses else "MISS: " + ", ".join(misses)


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
    seeds: tuple[int, ...],
    cores: int,
    work: Path,
    datasets: tuple[str, ...] = tuple(TARGETS),
    train_overrides: tuple[str, ...] = (),
    timeout_s: float = 1800.0,
    digests: dict[str, dict[str, str]] | None = None,
    targets: dict[str, float] | None = None,
    baseline: str | None = BASELINE_REV,
) -> list[dict]:
    """Every dataset x world size over ``seeds``; the data's digests are checked first
    (docs/bench/real_data.py; ``digests`` and ``targets`` replace the official files' and
    TARGETS, for tests). ``baseline``: a commit whose train.py also runs, from a git worktree
    under ``work`` (None: not)."""
    from docs.bench import real_data

    targets = TARGETS if targets is None else targets
    for dataset in datasets:
        real_data.check(data_root, FOLDERS[dataset], None if digests is None else digests[dataset])
    with baseline_tree(baseline, work) as tree:
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
                    baseline=tree,
                ),
                tuple(seeds),
                work,
            )
            for dataset in datasets
            for world in world_sizes
        ]


@contextmanager
def baseline_tree(rev: str | None, work: Path) -> Iterator[Path | None]:
    """A detached git worktree of ``rev`` under ``work`` for the run, removed after."""
    if rev is None:
        yield None
        return
    tree = work / f"tree-{rev}"
    git = ["git", "-C", str(REPO)]
    subprocess.run([*git, "worktree", "remove", "--force", str(tree)], capture_output=True)
    subprocess.run(
        [*git, "worktree", "add", "--detach", str(tree), rev], check=True, capture_output=True
    )
    try:
        yield tree
    finally:
        subprocess.run([*git, "worktree", "remove", "--force", str(tree)], capture_output=True)


def legend(repeats: int, cores: int) -> str:
    return (
        "E = time to accuracy on real data: seconds from process start to the first validation "
        "at the target (val split: 10 % of the training set, by class), median (and worst) over "
        f"{repeats} seed(s), sides in turn; test acc: at the recipe's end (train.py: best.pt); "
        f"{cores} CPU cores, OMP_NUM_THREADS = cores / world size, gloo. train.py: this tree's "
        f"defaults for the dataset; {BASELINE_REV}: the same command in that commit's tree; "
        "seed: the DDP lesson's plain loop (docs/bench/reference.py --workload E). speed = seed "
        "s / train.py s (>= 1.0: PASS). >: that side never reached the target; its seconds are "
        "how long it ran (its epochs, or the timeout), so the speed is a lower bound."
    )
