"""Helpers shared by the tests: run train.py as a user does, read what a run wrote (metrics,
results, checkpoints, W&B's offline records), and write small datasets in the real on-disk
formats torchvision reads (no network needed)."""

from __future__ import annotations

import copy
import csv
import functools
import gzip
import hashlib
import json
import logging
import os
import pickle
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import yaml
from ddp_launcher.core.hydra_compat import VERSION_BASE
from ddp_launcher.core.run_dir import read_metrics
from PIL import Image
from torch.utils.data import Dataset

REPO = Path(__file__).resolve().parent.parent
# this checkout's code: the experiment and its launcher package (launch/pyproject.toml)
IMPORT_PATH = os.pathsep.join([str(REPO), str(REPO / "launch")])
FAULT_INJECTION = REPO / "tests" / "fault_injection"  # its sitecustomize (tests/faults.py)

# Quick settings for tests that only need a run to happen; each test adds what it checks.
# W&B is off unless a test reads what W&B wrote (OFFLINE): its service costs each run seconds.
QUICK = ["trainer.max_epochs=1", "wandb.mode=disabled", "trainer.progress_bar=false"]
OFFLINE = "wandb.mode=offline"


# ---------------------------------------------------------------------------------------------
# processes


def run_env(**extra: str) -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("WANDB_", "HYDRA_")) or k == "WANDB_DATA_DIR"
    }
    env.update(
        WANDB_MODE="disabled",  # wandb.mode's default (auto) in processes; OFFLINE to read W&B
        WANDB_SILENT="true",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=IMPORT_PATH,
    )
    env.update(extra)
    if env.get("HYDRA_DDP_FAULT") or env.get("HYDRA_DDP_OS_FAULT"):  # the suite's fault
        # injection (tests/faults.py, tests/os_faults.py), first
        env["PYTHONPATH"] = os.pathsep.join([str(FAULT_INJECTION), env["PYTHONPATH"]])
    return env


# What a run dir holds after a run (rank 0 writes it): records, checkpoints, its attempts.
RUN_DIR_ENTRIES = frozenset(
    {".hydra", "launch.json", "train.log", "metrics.jsonl", "result.json", "checkpoints"}
    | {"repro", "wandb"}
)


def train_cmd(*overrides: str, nproc: int | None = None, script: str = "train.py") -> list[str]:
    if nproc is None:
        return [sys.executable, script, *overrides]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        script,
        *overrides,
    ]


def eval_cmd(*overrides: str, nproc: int | None = None) -> list[str]:
    return train_cmd(*overrides, nproc=nproc, script="eval.py")


def run(cmd: list[str], *, timeout: float = 600, cwd: Path = REPO, **env: str):
    """Run a command to completion (a hang fails the test at `timeout`)."""
    return subprocess.run(
        cmd, cwd=cwd, env=run_env(**env), capture_output=True, text=True, timeout=timeout
    )


def sigint_as_in_a_terminal() -> None:
    """Popen's preexec_fn for a process a test Ctrl-C's: SIGINT as in a terminal. A suite
    started in the background of a script (`pytest &`, or by a runner that does) ignores
    SIGINT, every process it starts inherits that, and a launcher keeps an ignored signal
    ignored (as `nohup` asks of SIGHUP)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def frames_in_repo(text: str) -> list[str]:
    """The traceback frames (`File "..."` lines) in the repo's own files: a venv inside the
    checkout (CI's .ci/venv) is not the repo's code, so a frame of torchrun's agent there is not
    one of ours."""
    venv = f"{Path(sys.prefix).resolve()}{os.sep}"
    return [
        line
        for line in text.splitlines()
        if f'File "{REPO}{os.sep}' in line and f'File "{venv}' not in line
    ]


def output(proc) -> str:
    return proc.stdout + proc.stderr


@dataclass
class Sweep:
    """A finished multirun: its sweep dir and the process that ran it."""

    dir: Path
    proc: subprocess.CompletedProcess

    @property
    def out(self) -> str:
        return output(self.proc)

    def job(self, num: int) -> Path:
        return self.dir / str(num)

    def overrides(self, num: int) -> list[str]:
        return yaml.safe_load((self.job(num) / ".hydra" / "overrides.yaml").read_text())


def sweep(sweep_dir: Path, *overrides: str, timeout: float = 300, **env: str) -> Sweep:
    """`python train.py -m` with QUICK and `overrides`, run to completion."""
    cmd = train_cmd("-m", f"hydra.sweep.dir={sweep_dir}", *QUICK, *overrides)
    return Sweep(sweep_dir, run(cmd, timeout=timeout, **env))


# The session's 2x2 sweep (tests/suite_plugin.py: sweep_2x2): dist.nproc_per_node=2,1 x these lrs,
# and a secret in its environment that must not end up in the job files.
SWEEP_LRS = ("0.05", "0.1")
SWEEP_SECRET = "s3cret-launcher-test-value"


def processes_with_env(key: str, value: str) -> list[str]:
    """Live processes (zombies are dead) whose environment holds key=value, as "pid: command
    line": a test tags a launcher with a variable of its own, and every process started under
    it inherits the tag (agents, ranks, data workers), orphaned or not. Linux /proc; the
    caller's own process is left out."""
    needle = f"{key}={value}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            if needle not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError):  # gone meanwhile, or not ours to read
            continue
        found.append(f"{entry.name}: {command[:300]}")
    return found


def wait_for_no_processes(key: str, value: str, timeout: float = 30) -> list[str]:
    """Poll until no live process holds key=value (processes_with_env); those left at timeout."""
    deadline = time.time() + timeout
    while (left := processes_with_env(key, value)) and time.time() < deadline:
        time.sleep(0.2)
    return left


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def train_composer() -> Iterator[SimpleNamespace]:
    """train.py's config as Hydra composes it for a launcher (hydra node included), without a
    process: `.compose(*overrides)` a run's config, `.multirun(*overrides)` a sweep's master
    config, `.context` the HydraContext a launcher gets (config loader, no callbacks)."""
    from hydra import compose, initialize_config_dir
    from hydra._internal.callbacks import Callbacks
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.utils import setup_globals
    from hydra.types import HydraContext, RunMode

    import conf.schema  # noqa: F401 - registers the schema train.py's YAMLs extend

    setup_globals()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(str(REPO / "conf"), **VERSION_BASE, job_name="t"):
            loader = GlobalHydra.instance().config_loader()
            yield SimpleNamespace(
                compose=lambda *o: compose("train", list(o), return_hydra_config=True),
                multirun=lambda *o: loader.load_configuration(
                    "train", list(o), run_mode=RunMode.MULTIRUN
                ),
                context=HydraContext(config_loader=loader, callbacks=Callbacks()),
            )
    finally:
        GlobalHydra.instance().clear()


# ---------------------------------------------------------------------------------------------
# what a run wrote


def rows(run_dir: Path) -> list[dict]:
    """metrics.jsonl's rows (a line torn by a kill skipped)."""
    return read_metrics(run_dir)


def val_rows(run_dir: Path) -> list[dict]:
    return [r for r in rows(run_dir) if "val/acc" in r]


def train_rows(run_dir: Path) -> list[dict]:
    return [r for r in rows(run_dir) if "train/loss" in r]


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def summary_rows(sweep_dir: Path) -> list[dict]:
    with open(sweep_dir / "summary.csv", newline="") as f:
        return list(csv.DictReader(f))


def weights(run_dir: Path, name: str = "last.pt") -> dict:
    from components.checkpoint import load_checkpoint

    return load_checkpoint(run_dir / "checkpoints" / name)["model"]


MEASURED = {
    "samples_per_s",
    "step_time_ms",
    "data_wait_pct",
    "peak_mem_mb",
    "mfu",
    "time",
    "elapsed_s",
}  # measurements and clock times, not results


def assert_same_training(run_dir: Path, reference: Path) -> None:
    """Bit-identical final weights (last.pt: the model and any EMA of it), and the same
    metrics.jsonl rows, none missing, none twice, none torn (measured speeds and times aside:
    a measurement, not a result)."""
    import torch

    from components.checkpoint import load_checkpoint

    ref_ckpt = load_checkpoint(reference / "checkpoints" / "last.pt")
    got_ckpt = load_checkpoint(run_dir / "checkpoints" / "last.pt")
    for part in ("model", "ema"):
        assert (part in ref_ckpt) == (part in got_ckpt), part
        ref_w, got_w = ref_ckpt.get(part) or {}, got_ckpt.get(part) or {}
        assert ref_w.keys() == got_w.keys()
        for key in ref_w:
            assert torch.equal(ref_w[key], got_w[key]), (
                f"{run_dir}: {part} {key} differs from {reference}"
            )

    def results(path: Path) -> list[dict]:  # every line whole: a torn one fails here
        lines = (path / "metrics.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(x).items() if k not in MEASURED} for x in lines]

    assert results(run_dir) == results(reference), f"{run_dir}: metrics differ from {reference}"


def wait_for_rows(
    path: Path, n: int, proc: subprocess.Popen | None = None, timeout: float = 240
) -> None:
    """Until `path` (a metrics.jsonl) has `n` lines; fails when `proc` ends first or at timeout."""
    deadline = time.time() + timeout
    while time.time() < deadline and (proc is None or proc.poll() is None):
        if path.exists() and len(path.read_text().splitlines()) >= n:
            return
        time.sleep(0.05)
    out = proc.stdout.read() if proc is not None and proc.poll() is not None and proc.stdout else ""
    raise AssertionError(f"{path} never had {n} rows\n{out[-3000:]}")


# ---------------------------------------------------------------------------------------------
# W&B offline records: the run-<id>.wandb record log
#
# The file is a LevelDB-style log (32 KiB blocks, 7-byte record headers, FULL/FIRST/MIDDLE/LAST
# fragments) of protobuf `Record` messages from wandb.proto.wandb_internal_pb2.

BLOCK = 32 * 1024
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _payloads(data: bytes):
    assert data[:4] == b":W&B", "not a W&B record log"
    pos, parts = HEADER, b""
    while pos + HEADER <= len(data):
        room = BLOCK - pos % BLOCK
        if room < HEADER:  # block trailer padding
            pos += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        if kind == 0 and length == 0:
            pos += room
            continue
        chunk = data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind == FULL:
            yield chunk
        elif kind == FIRST:
            parts = chunk
        elif kind == MIDDLE:
            parts += chunk
        elif kind == LAST:
            yield parts + chunk
            parts = b""


@dataclass
class OfflineRun:
    path: Path  # <run dir>/wandb/offline-run-*/run-<id>.wandb
    run_id: str = ""
    group: str = ""
    job_type: str = ""
    name: str = ""
    config: dict = field(default_factory=dict)
    history: list[dict] = field(default_factory=list)
    summary: dict = field(default_factory=dict)  # the run summary, updates applied in order
    files: list[str] = field(default_factory=list)  # saved files, relative to files_dir
    # {type, name, aliases, metadata, paths, files: {path: local copy (W&B's staging dir)}}
    artifacts: list[dict] = field(default_factory=list)
    exit_code: int | None = None
    resumed: bool = False
    tags: list[str] = field(default_factory=list)  # as last set

    @property
    def files_dir(self) -> Path:
        return self.path.parent / "files"

    def table(self, key: str) -> dict:
        """A logged wandb.Table ({"columns": [...], "data": [[...]]}) read from its file, as
        the summary's (else the first history row's) `table-file` entry for `key` names it."""
        entry = self.summary.get(key) or next(row[key] for row in self.history if key in row)
        assert entry["_type"] == "table-file", entry
        return json.loads((self.files_dir / entry["path"]).read_text())

    def tables(self, key: str) -> list[dict]:
        """Every history row's table `key`, in order (media cells show as their type name)."""
        return [
            json.loads((self.files_dir / row[key]["path"]).read_text())
            for row in self.history
            if key in row
        ]

    def media_tables(self, key: str) -> list[tuple[dict, dict[str, str]]]:
        """Every logged table `key` as W&B keeps it, in its run_table artifact: the table with
        media cells as {"_type": "image-file", "path": ...}, and where the artifact's files
        are ({path: local copy}); in logging order."""
        name = f"{key}.table.json"
        return [
            (json.loads(Path(a["files"][name]).read_text()), a["files"])
            for a in self.artifacts
            if a["type"] == "run_table" and name in a["files"]
        ]


def _items(items) -> dict:
    """Record items as a dict: a nested key (["sweep/table", "path"]) becomes nested dicts."""
    out: dict = {}
    for item in items:
        keys = [item.key] if item.key else list(item.nested_key)
        node = out
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = json.loads(item.value_json)
    return out


def read_run(path: Path) -> OfflineRun:
    from wandb.proto import wandb_internal_pb2 as pb

    run = OfflineRun(path)
    for raw in _payloads(path.read_bytes()):
        record = pb.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            r = record.run
            run.run_id, run.group, run.job_type, run.name = (
                r.run_id,
                r.run_group,
                r.job_type,
                r.display_name,
            )
            run.resumed = bool(r.resumed)
            run.tags = list(r.tags)
            for item in r.config.update:
                run.config[item.key] = json.loads(item.value_json)
        elif kind == "config":
            run.config.update(_items(record.config.update))
        elif kind == "history":
            run.history.append(_items(record.history.item))
        elif kind == "summary":
            run.summary.update(_items(record.summary.update))
        elif kind == "files":
            run.files += [f.path for f in record.files.files]
        elif kind == "artifact":
            a = record.artifact
            files = {c.path: c.local_path for c in a.manifest.contents}
            run.artifacts.append(
                {
                    "type": a.type,
                    "name": a.name,
                    "aliases": list(a.aliases),
                    "metadata": json.loads(a.metadata or "{}"),
                    "paths": list(files),
                    "files": files,
                }
            )
        elif kind == "exit":
            run.exit_code = record.exit.exit_code
    return run


def offline_runs(root: Path) -> list[OfflineRun]:
    """Every offline W&B run under `root` (any depth), oldest first."""
    return [read_run(p) for p in sorted(root.rglob("offline-run-*/run-*.wandb"))]


# ---------------------------------------------------------------------------------------------
# datasets in their real formats

MNIST_FILES = {
    True: ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    False: ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


def md5(path: str | os.PathLike) -> str:
    return hashlib.md5(Path(path).read_bytes()).hexdigest()


def write_idx(path: Path, array: np.ndarray) -> None:
    """IDX format (yann.lecun.com/exdb/mnist): magic 0x0000 08 <ndim>, big-endian int32 dims."""
    array = np.ascontiguousarray(array, dtype=np.uint8)
    header = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    path.write_bytes(header + array.tobytes())


def make_mnist(root: Path, folder: str = "MNIST", n_train: int = 300, n_test: int = 100):
    """<root>/<folder>/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte with random content.

    Returns {train: (images, labels)} for train=True/False.
    """
    raw = root / folder / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    out = {}
    for train, n in ((True, n_train), (False, n_test)):
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, size=n, dtype=np.uint8)
        image_file, label_file = MNIST_FILES[train]
        write_idx(raw / image_file, images)
        write_idx(raw / label_file, labels)
        out[train] = (images, labels)
    return out


def make_mnist_mirror(directory: Path) -> dict[str, str]:
    """Gzipped MNIST files as served by a mirror; returns {file name: md5} (MNIST.resources)."""
    make_mnist(directory / "build")
    raw = directory / "build" / "MNIST" / "raw"
    sums = {}
    for name in MNIST_FILES[True] + MNIST_FILES[False]:
        with open(raw / name, "rb") as src, gzip.open(directory / f"{name}.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        sums[f"{name}.gz"] = md5(directory / f"{name}.gz")
    shutil.rmtree(directory / "build")
    return sums


def _pickle(path: Path, obj: dict) -> str:
    with open(path, "wb") as f:
        pickle.dump(obj, f)
    return md5(path)


def make_cifar(root: Path, classes: int = 10, n_per_batch: int = 20):
    """cifar-10-batches-py (5 train batches + test_batch + batches.meta) or, for 100 classes,
    cifar-100-python (train, test, meta), as pickled dicts of uint8 rows (3x32x32, CHW).

    Returns (data, md5s): data[train] = (images NHWC, labels); md5s = the class attributes
    train_list, test_list and meta torchvision checks, with the md5 of the files written here.
    """
    rng = np.random.default_rng(1)
    if classes == 10:
        folder, label_key = root / "cifar-10-batches-py", "labels"
        train_files, test_files = [f"data_batch_{i}" for i in range(1, 6)], ["test_batch"]
        meta = {"filename": "batches.meta", "key": "label_names"}
    else:
        folder, label_key = root / "cifar-100-python", "fine_labels"
        train_files, test_files = ["train"], ["test"]
        meta = {"filename": "meta", "key": "fine_label_names"}
    folder.mkdir(parents=True, exist_ok=True)
    data, lists = {}, {}
    for train, files in ((True, train_files), (False, test_files)):
        rows, labels, entries = [], [], []
        for name in files:
            batch = rng.integers(0, 256, size=(n_per_batch, 3 * 32 * 32), dtype=np.uint8)
            batch_labels = rng.integers(0, classes, size=n_per_batch).tolist()
            entry = {"batch_label": name, "data": batch, label_key: batch_labels}
            entries.append([name, _pickle(folder / name, entry)])
            rows.append(batch)
            labels += batch_labels
        images = np.concatenate(rows).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
        data[train] = (images, labels)
        lists["train_list" if train else "test_list"] = entries
    names = {meta["key"]: [f"class_{i}" for i in range(classes)]}
    lists["meta"] = {**meta, "md5": _pickle(folder / meta["filename"], names)}
    return data, lists


COLORS = {"cat": (200, 10, 30), "dog": (5, 120, 250), "emu": (90, 90, 90)}


def make_imagefolder(root: Path, per_class: dict[str, int] | None = None, size=(40, 30)):
    """<root>/{train,val}/<class>/<i>.png, each image one solid colour per class (COLORS)."""
    per_class = per_class or {"train": 3, "val": 2}
    for split, n in per_class.items():
        for cls, color in COLORS.items():
            (root / split / cls).mkdir(parents=True, exist_ok=True)
            for i in range(n):
                Image.new("RGB", size, color).save(root / split / cls / f"{i}.png")


def make_pattern_images(
    root: Path,
    classes: list[str],
    per_split: dict[str, int] | None = None,
    size: int = 32,
    noise: float = 40.0,
) -> None:
    """<root>/<split>/<class>/<i>.png (ImageFolder layout): each class a smooth random colour
    pattern, each image that pattern shifted by up to 4 px plus Gaussian noise, so a model can
    learn the classes (unlike make_cifar's uniform noise)."""
    per_split = per_split or {"train": 40, "val": 10}
    rng = np.random.default_rng(0)
    for cls in classes:
        coarse = Image.fromarray(rng.integers(0, 256, size=(4, 4, 3), dtype=np.uint8))
        pattern = np.asarray(coarse.resize((size, size), Image.BILINEAR), dtype=np.float32)
        for split, n in per_split.items():
            (root / split / cls).mkdir(parents=True, exist_ok=True)
            for i in range(n):
                shifted = np.roll(pattern, tuple(rng.integers(-4, 5, size=2)), axis=(0, 1))
                pixels = shifted + rng.normal(0, noise, size=shifted.shape)
                Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(
                    root / split / cls / f"{i}.png"
                )


def make_imagenet(
    root: Path, classes: int = 10, per_split: dict[str, int] | None = None, size: int = 32
) -> None:
    """torchvision.datasets.ImageNet's prepared layout: meta.bin (wnid -> class names, val
    wnids) and train/<wnid>/, val/<wnid>/ image folders (make_pattern_images), no tars."""
    import torch

    wnids = [f"n{i:08d}" for i in range(classes)]
    make_pattern_images(root, wnids, per_split, size)
    n_val = (per_split or {"val": 10})["val"]
    torch.save(
        (
            {w: (f"class {i}",) for i, w in enumerate(wnids)},
            [w for w in wnids for _ in range(n_val)],
        ),
        root / "meta.bin",
    )


def download_once_rank(rank: int, root: str, mirror: str, sums_json: str, log: str) -> None:
    """One rank (tests/rank_pool.py): build MNIST with download=true through build_datasets,
    from `mirror`; what it patched in torchvision is restored after."""
    import torch.distributed as dist
    from torchvision.datasets import mnist

    from data import build_datasets

    saved = (mnist.MNIST.mirrors, mnist.MNIST.resources, mnist.download_and_extract_archive)
    sums = json.loads(sums_json)

    def logged_download(url, *args, **kwargs):  # spy: records who fetched what, then fetches
        with open(log, "a") as f:
            f.write(f"{rank} {url}\n")
        return saved[2](url, *args, **kwargs)

    mnist.MNIST.mirrors = [mirror]
    mnist.MNIST.resources = [(name, sums[name]) for name, _ in mnist.MNIST.resources]
    mnist.download_and_extract_archive = logged_download
    try:
        dist.init_process_group("gloo")
        cfg = {"_target_": "data.catalog.mnist", "root": root, "download": True}
        splits = build_datasets(cfg, local_rank=int(os.environ["LOCAL_RANK"]), barrier=dist.barrier)
        with open(log, "a") as f:
            f.write(f"{rank} loaded {len(splits.train)} {len(splits.val)} {len(splits.test)}\n")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        mnist.MNIST.mirrors, mnist.MNIST.resources, mnist.download_and_extract_archive = saved


class IndexDataset(Dataset):
    """Returns the index it was asked for (from an (epoch, index) key or a bare index): a
    loader over it shows which indices each batch holds."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, key):
        return key[1] if isinstance(key, tuple) else key


# ---------------------------------------------------------------------------------------------
# train.py in this process


def compose(config_name: str, run_dir: Path, *overrides: str):
    """The config of `python <config_name>.py <overrides>` as Hydra composes it (hydra node
    included, the run dir set), without starting a process."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import open_dict

    import conf.schema  # noqa: F401 - registers the schema

    with initialize_config_dir(config_dir=str(REPO / "conf"), **VERSION_BASE):
        cfg = hydra_compose(
            config_name,
            overrides=[*overrides, f"hydra.run.dir={run_dir}"],
            return_hydra_config=True,
        )
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(run_dir)
    return cfg


@functools.cache
def _composed_train_config(overrides: tuple[str, ...]):
    return compose("train", Path("unused"), *overrides)


def composed_train_config(*overrides: str):
    """train.py's config for these overrides (no run dir of its own): each distinct override
    list is composed once per pytest run (a compose costs ~0.3 s; many tests ask for the same
    config), and each call gets its own copy to change."""
    return copy.deepcopy(_composed_train_config(overrides))


def recipe(*overrides: str):
    """The augmentation recipe (data.transforms.Recipe) train.py builds for these overrides,
    e.g. recipe("dataset=cifar10") is CIFAR's default, recipe("augment=trivial_augment")."""
    from data.transforms import build_recipe

    return build_recipe(composed_train_config(*overrides).augment)


def compose_train(run_dir: Path, *overrides: str):
    return compose("train", run_dir, *overrides)


def dataset_cfg(name: str, **keys):
    """The `dataset` node as Hydra hands it to train.py for `dataset=<name> dataset.<key>=...`."""
    overrides = [f"dataset={name}", *(f"dataset.{k}={v}" for k, v in keys.items())]
    return composed_train_config(*overrides).dataset


def _in_process(config_name: str, run_dir: Path, task, overrides) -> object:
    """Run `task(cfg)` here as one rank of a start would: on rank 0 the gate first
    (ddp_launcher/core/gate.py:
    the app's checks, the run dir's plan, its lock), then as Hydra's run_job would (config and
    run dir set up, no logging configured): errors propagate as raised, nothing is reported.
    The run dir's lock is given up and W&B's service shut down at the end, so its offline
    records are complete on disk."""
    from ddp_launcher.core import run_lock
    from ddp_launcher.core.gate import NothingToDo, check_as_peer, check_start, gate_of, open_run
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    cfg = compose(config_name, run_dir, *overrides)
    gated = int(os.environ.get("RANK", "0")) == 0  # as RunGate.on_run_start: rank 0 writes
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        if gated:
            plan = check_start(cfg, Path(run_dir), world_size, sweep=False)
            open_run(Path(run_dir), plan, "a test")
        else:
            check_as_peer(cfg, Path(run_dir), gate_of(cfg))
    except NothingToDo as e:  # (a start says it and exits 0)
        logging.getLogger("train").info("%s", e)
        return None
    HydraConfig.instance().set_config(cfg)
    task_cfg = copy.deepcopy(cfg)
    with open_dict(task_cfg):
        del task_cfg["hydra"]
    try:
        return task(task_cfg)
    finally:
        if gated:
            run_lock.release(Path(run_dir))
        if "wandb" in sys.modules:
            sys.modules["wandb"].teardown()


def train_in_process(run_dir: Path, *overrides: str):
    """train.py's `train(cfg)` in this process (see _in_process)."""
    import train

    return _in_process("train", run_dir, train.train, ["trainer.progress_bar=false", *overrides])


def eval_in_process(out_dir: Path, *overrides: str):
    """eval.py's `evaluate_checkpoint(cfg)` in this process, with world size 1: the returned
    accuracy; eval.json etc. in `out_dir`."""
    import eval as eval_py

    return _in_process("eval", out_dir, eval_py.evaluate_checkpoint, overrides)


class Counter:
    def __init__(self, n: int = 0):
        self.n = n

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, state: dict) -> None:
        self.n = state["n"]


def training_state(seed: int, rank: int = 0):
    """A small run's (TrainingState, model, progress, window) for the checkpoint tests: shared
    parts from `seed`, this rank's own window and RNG."""
    import torch
    from omegaconf import OmegaConf

    from components import checkpoint as ck

    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    progress, window = Counter(seed), Counter(10 * seed + rank)
    state = ck.TrainingState(
        shared={"model": model, "optimizer": optimizer, "progress": progress},
        per_rank={"window": window},
        config=OmegaConf.create({"seed": seed}),
    )
    torch.manual_seed(1000 * seed + rank)  # each rank's own stream
    return state, model, progress, window
