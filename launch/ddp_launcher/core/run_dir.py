"""The run dir's contract: what a run leaves in its directory, and how to read and write it.

One module, no torch, used by every process that touches a run dir: an app's rank 0 (the
writer), both launchers (they record jobs that failed without a record of their own), the sweep
summary and the benchmark (readers).

    <run dir>/
      .hydra/overrides.yaml   the job's overrides (Hydra)
      <job name>.log          rank 0's log (Hydra's job logging)
      metrics.jsonl           one JSON row per log step / epoch, appended line by line (the
                              app's, optional)
      result.json             the run's record (RunResult), rewritten atomically
      checkpoints/            the app's checkpoints (CHECKPOINT_DIR)
      repro/                  command.txt, requirements.txt, git.diff (ddp_launcher/core/repro.py)
      wandb/                  the W&B run
      launch.json             its overrides and every attempt with its code (LaunchRecord): a
                              sweep job's by its launcher (ddp_launcher/resume.py), a single run's
                              by its gate (ddp_launcher/resume.py)
      .torchrun/              the torchrun launcher's hand-off files (ddp_launcher/torchrun.py)
      .run.lock               its holder while it runs (ddp_launcher/core/run_lock.py)
      replaced/<time>/        an earlier run, whole, moved aside by the start that replaced it
                              (start_over=true, another run's checkpoint: ddp_launcher/core/gate.py)

Whatever else a run writes is the app's (an evaluation's own record, plots, predictions): the
package reads none of it.
"""

from __future__ import annotations

import errno
import json
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from ddp_launcher.core.errors import UserError

METRICS_FILE = "metrics.jsonl"
RESULT_FILE = "result.json"
CHECKPOINT_DIR = "checkpoints"
OVERRIDES_FILE = ".hydra/overrides.yaml"
LAUNCHER_DIR = ".torchrun"
LAUNCH_FILE = "launch.json"
# The attempt number a launcher gives a sweep job's processes (1, 2, ...: retries and resumed
# sweeps start a job again; a torchrun restart or SLURM requeue is the same attempt).
ATTEMPT_ENV = "HYDRA_DDP_ATTEMPT"

# The exit status of a rank that stopped at an agreed step after a stop signal and saved a
# checkpoint: EX_TEMPFAIL, "temporary failure, try again" (requeue me; resume=auto continues).
REQUEUE_EXIT_CODE = 75


NUMBER = (int, float)
DIRECTIONS = ("max", "min")


@dataclass
class RunResult:
    """result.json, split by owner: the launcher's part (every field but `app`), which the
    package reads (the launchers, resume, the sweepers, the report), and the app's part
    (`app`), the app's own record, which the package keeps as it is and never reads. The app
    writes it (its rank 0, with write_result); a launcher writes it for a job that left none.
    None: not known, or not this kind of run's."""

    status: str = "running"  # running | completed | pruned | failed | preempted | interrupted
    error: str | None = None  # one line, for every status but completed
    # The job's result, what its task returns and what a sweeper optimises (e.g. the best value
    # of the metric the app monitors), the metric's name (e.g. "val/acc"; None: unnamed) and
    # which way is better; the epoch it was reached at (None: not epoch-based).
    value: float | None = None
    metric: str | None = None
    direction: str = "max"  # max: higher is better; min: lower is
    value_epoch: int | None = None
    # A goal the app set on a metric and when the job first reached it, the report's
    # time-to-target columns: {metric, value, reached_at_s (from process start),
    # reached_at_step, ...}, reached_* null until reached; None: no goal.
    target: dict[str, Any] | None = None
    # The app's own numbers (or short strings) to show in reports, one column each, named as
    # they are here (e.g. a test score); the curves come from metrics.jsonl.
    summary: dict[str, Any] = field(default_factory=dict)
    attempts: int | None = None  # launches of the job so far (launch.json's, when it has one)
    started: float | None = None  # this attempt's start and end (unix times)
    ended: float | None = None
    wall_time_s: float | None = None
    git_commit: str | None = None  # the code's commit (None: not a git checkout)
    git_dirty: bool | None = None  # started with uncommitted changes (repro/git.diff)
    wandb_run_id: str | None = None  # the job's W&B run, linked from the report
    # Set by a launcher that records a job which left no result of its own.
    overrides: list[str] | None = None
    job_num: int | None = None
    app: dict[str, Any] = field(default_factory=dict)  # the app's part: opaque to the package
    extra: dict[str, Any] = field(default_factory=dict)  # keys of newer/other writers, kept

    def to_json(self) -> dict[str, Any]:
        """Every field (null: not measured, or not this kind of run's), then any extra keys:
        one schema for every way a run ends, whoever writes it."""
        data = asdict(self)
        extra = data.pop("extra")
        return {**data, **extra}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunResult:
        """A result.json as written now, or by 5f215d2 and the releases before it (one flat
        mapping: see from_flat_json)."""
        if "app" not in data and "value" not in data:
            return cls.from_flat_json(data)
        known = {f.name for f in fields(cls)} - {"extra"}
        result = cls(
            **{k: v for k, v in data.items() if k in known},
            extra={k: v for k, v in data.items() if k not in known},
        )
        result.app = result.app if isinstance(result.app, dict) else {}
        result.summary = result.summary if isinstance(result.summary, dict) else {}
        return result

    @classmethod
    def from_flat_json(cls, data: dict[str, Any]) -> RunResult:
        """A result.json of 5f215d2 or before: every key at the top level, the experiment's
        among them. Its best, monitor, mode and best_epoch are the job's value, metric,
        direction and value_epoch; its test metrics are its summary (and stay in the app's
        part); every key the launcher's part does not have goes to the app's part. Those
        releases' RunResult defaulted the monitor to val/acc (max): a record without one
        ranks by its metrics.jsonl's val/acc, as it did then."""
        renamed = {"best": "value", "monitor": "metric", "mode": "direction"}
        renamed["best_epoch"] = "value_epoch"
        launcher = {f.name for f in fields(cls)} - {"extra", "app", "summary"}
        result = cls(metric="val/acc")
        for key, value in data.items():
            name = renamed.get(key, key)
            if name in launcher:
                setattr(result, name, value)
            else:
                result.app[key] = value
        result.direction = result.direction or "max"
        test = data.get("test")
        if isinstance(test, dict):
            result.summary = dict(test)
        return result


# What the keys of result.json hold when not null, both layouts' (RunResult.from_json): checked
# where a record is read for a report (ddp_launcher/report/jobs.py), so that all after may trust
# them; (the launcher's part, then the flat layout's keys that are read).
RESULT_TYPES: dict[str, Any] = {
    "status": str,
    "error": str,
    "value": NUMBER,
    "metric": str,
    "direction": str,
    "value_epoch": NUMBER,
    "target": dict,
    "summary": dict,
    "attempts": NUMBER,
    "started": NUMBER,
    "ended": NUMBER,
    "wall_time_s": NUMBER,
    "git_commit": str,
    "wandb_run_id": str,
    "overrides": list,
    "app": dict,
    "best": NUMBER,
    "monitor": str,
    "mode": str,
    "best_epoch": NUMBER,
    "final": dict,
    "test": dict,
}


@dataclass
class Attempt:
    """One attempt at a job: what its backend started once (a torchrun agent, a SLURM job: a
    SLURM requeue is the same attempt)."""

    attempt: int
    started: float
    ended: float | None = None
    status: str = "running"  # running | completed | pruned | failed | preempted | interrupted
    error: str | None = None
    continued: bool = False  # started with resume=auto from the job dir's checkpoints
    backend: dict | None = (
        None  # what its backend needs to find it again (ddp_launcher/lifecycle.py: opaque)
    )
    # the code and config it ran (ddp_launcher/drift.py): commit, dirty, diff_sha256, config_sha256
    code: dict | None = None


@dataclass
class LaunchRecord:
    job_num: int
    overrides: list[str]
    attempts: list[Attempt] = field(default_factory=list)
    # the job's resolved config at its first recorded attempt, flat {key: JSON value}: a resumed
    # job names the keys that changed since (ddp_launcher/drift.py)
    config: dict[str, str] | None = None

    @property
    def last(self) -> Attempt | None:
        return self.attempts[-1] if self.attempts else None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LaunchRecord:
        known = {f.name for f in fields(Attempt)}
        attempts = [
            Attempt(**{k: v for k, v in a.items() if k in known})
            for a in data.get("attempts") or []
        ]
        config = data.get("config")
        return cls(
            int(data["job_num"]),
            [str(o) for o in data["overrides"]],
            attempts,
            dict(config) if isinstance(config, dict) else None,
        )


def read_launch_record(job_dir: Path) -> LaunchRecord | None:
    """The job dir's launch.json; None when absent or unreadable (it is written atomically, so
    unreadable means not ours)."""
    try:
        return LaunchRecord.from_json(json.loads((Path(job_dir) / LAUNCH_FILE).read_text()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def write_launch_record(job_dir: Path, record: LaunchRecord) -> None:
    Path(job_dir).mkdir(parents=True, exist_ok=True)
    write_json_atomic(Path(job_dir) / LAUNCH_FILE, record.to_json())


@contextmanager
def atomic_path(path: Path, *, durable: bool = False) -> Iterator[Path]:
    """The one way this repo replaces a file: yields a temp path beside `path` to fill; when
    the block ends, the temp file replaces `path` in one rename, so readers see the old file or
    the new one, never a part. An error in the block removes the temp file and leaves `path` as
    it was. `durable` (checkpoints): the file's bytes are on disk before the rename, and the
    rename itself is (fsync of the file, then of the directory)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.unlink(missing_ok=True)  # a stale one of a killed writer with a reused pid
    try:
        yield tmp
        if durable:
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # make the rename itself durable
        finally:
            os.close(dir_fd)


def write_atomic(path: Path, data: bytes | str, *, durable: bool = False) -> None:
    """Replace `path` with `data` (text as UTF-8) atomically (atomic_path)."""
    with atomic_path(path, durable=durable) as tmp:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)


def write_json_atomic(path: Path, data: Any, *, indent: int | None = 2) -> None:
    """Write `data` as JSON so that readers see the old file or the new one, never a part."""
    write_atomic(path, json.dumps(data, indent=indent) + "\n")


def write_result(run_dir: Path, result: RunResult) -> None:
    """Write result.json atomically. What its writer left unknown of the launcher's part is
    filled in: `attempts` and `started` as the run dir's launch.json has them (its attempts so
    far, the last one's start; without one, this process's start), `ended` now, `wall_time_s`
    between the two."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    record = read_launch_record(run_dir)
    last = record.last if record is not None else None
    if result.attempts is None and record is not None:
        result.attempts = len(record.attempts) or None
    if result.started is None:
        result.started = last.started if last is not None else process_start_time()
    if result.ended is None:
        result.ended = time.time()
    if result.wall_time_s is None:
        result.wall_time_s = round(result.ended - result.started, 3)
    write_json_atomic(run_dir / RESULT_FILE, result.to_json())


# What a start replaces (start_over, another run's checkpoint, an evaluation again) moves whole
# into <run dir>/replaced/<time>/ (ddp_launcher/core/gate.py).
REPLACED_DIR = "replaced"


def holds_run(run_dir: Path) -> bool:
    """Whether `run_dir` holds an earlier run's records as this package defines them: a
    result, a row, a checkpoint. The gate's default for an app that names no `records` of its
    own (ddp_launcher/core/gate.py: which dirs hold an app's runs is the app's to say)."""
    run_dir = Path(run_dir)
    ckpt = run_dir / CHECKPOINT_DIR
    return (
        (run_dir / RESULT_FILE).exists()
        or bool(read_metrics(run_dir / METRICS_FILE))
        or (ckpt.is_dir() and any(ckpt.glob("*.pt")))
    )


def check_writable(config: Any, key: str) -> None:
    """The dir at config `key` takes a file (where it does not exist yet, its nearest existing
    parent does), and nothing is left behind, and its disk has room for what a start writes
    (core/disk.py); else a UserError."""
    from omegaconf import OmegaConf

    path = Path(str(OmegaConf.select(config, key)))
    nearest = path.absolute()
    while not nearest.exists() and nearest != nearest.parent:
        if nearest.is_symlink():  # a link to nothing, or a loop: no dir can be made through it
            raise UserError(
                f"{key}={path} cannot be written ({nearest} is a link that leads nowhere: "
                f"dangling, or a loop): choose a writable dir with {key}=<dir>"
            )
        nearest = nearest.parent
    try:
        if not nearest.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR))
        tempfile.TemporaryFile(dir=nearest).close()  # removed as it closes
    except OSError as e:
        raise UserError(
            f"{key}={path} cannot be written ({e.strerror or type(e).__name__}): choose a "
            f"writable dir with {key}=<dir>"
        ) from None
    from ddp_launcher.core.disk import START_MARGIN, check_room

    written = len(OmegaConf.to_yaml(config, resolve=False)) * 2  # .hydra/: config and hydra
    check_room(
        nearest, written + START_MARGIN, f"a start in {key}={path}", f"or choose another {key}"
    )


def read_result(run_dir: Path, *, since: float | None = None) -> RunResult | None:
    """The run's result.json; None if absent or unreadable, or (with `since`, a unix time)
    older than that, i.e. left by an earlier run into the same dir."""
    path = Path(run_dir) / RESULT_FILE
    try:
        if since is not None and path.stat().st_mtime < since - 2.0:  # coarse mtimes
            return None
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return RunResult.from_json(data) if isinstance(data, dict) else None


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The JSON object rows of a metrics.jsonl (or of `<run dir>/metrics.jsonl`); a line torn
    by a kill, or anything else unparsable, is skipped."""
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    rows: list[dict[str, Any]] = []
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    row = json.loads(line)
                except ValueError:
                    continue
                if isinstance(row, dict):
                    rows.append(row)
    except OSError:
        pass
    return rows


def process_start_time(pid: int | str = "self") -> float:
    """When process `pid` started, as a unix time (Linux /proc; now where unavailable)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return boot + start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, StopIteration):
        return time.time()


def process_age_s() -> float:
    """Seconds since this process started (the clock of the time-to-first-step figures):
    start time in clock ticks after boot, against CLOCK_BOOTTIME; 10 ms resolution."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError):
        return time.process_time()
    return time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
