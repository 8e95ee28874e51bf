"""Named crash points for the crash tests: every step of a checkpoint save, every write of
metrics.jsonl, result.json and the launch records calls :func:`point` with its name, and

    HYDRA_DDP_KILL_AT=<name>[#<n>][:launcher][@<job>][,<another>...]

SIGKILLs this process (with `:launcher`, the launcher that started it, HYDRA_DDP_LAUNCHER_PID:
its ranks die with it) the n-th time it gets there (in sweep job <job> only, with `@<job>`).
Torch-free. Unset (always, outside tests) a point costs one dict lookup. Public as
`ddp_launcher.crash_point`, for an app's own records. Only a job's first attempt is killed: a
restarted or resumed one runs clean; with HYDRA_DDP_KILL_ONCE_DIR each kill happens once (a
file there says it did), which also holds the launcher's own points when a sweep is resumed.
"""

from __future__ import annotations

import os
import signal

from ddp_launcher.core.run_dir import ATTEMPT_ENV

KILL_AT_ENV = "HYDRA_DDP_KILL_AT"
LAUNCHER_PID_ENV = "HYDRA_DDP_LAUNCHER_PID"  # set by a launcher for the processes of its jobs
ONCE_DIR_ENV = "HYDRA_DDP_KILL_ONCE_DIR"
_reached: dict[str, int] = {}

# Every point, in the order a run reaches them (tests/test_crash_points.py kills at each).
POINTS = (
    "save.digest_written",  # the step file's .sha256 is there, the file not yet
    "save.step_written",  # the step file renamed into place
    "save.last_linked",  # last.pt points at it
    "save.best_linked",  # best.pt points at it (a best epoch's save)
    "save.committed",  # manifest.json names it: the save is done
    "save.pruned",  # older step files removed
    "metrics.row",  # a row appended to metrics.jsonl
    "result.written",  # result.json replaced
    "launch.record",  # a sweep job's launch.json replaced (in the launcher)
)


def point(name: str, job: int | None = None) -> None:
    """A crash point (`job`: the sweep job it is for, where the caller knows)."""
    specs = os.environ.get(KILL_AT_ENV)
    if not specs:
        return
    key = name if job is None else f"{name}@{job}"  # (a launcher counts per job)
    _reached[key] = _reached.get(key, 0) + 1
    for spec in specs.split(","):
        where, _, for_job = spec.partition("@")
        where, _, who = where.partition(":")
        target, _, nth = where.partition("#")
        if target == name and _reached[key] == int(nth or 1) and _in_job(for_job, job):
            _kill(who == "launcher", spec)


def _in_job(wanted: str, job: int | None) -> bool:
    if not wanted:
        return True
    if job is None:  # in a rank: its sweep job's number
        from hydra.core.hydra_config import HydraConfig

        job = HydraConfig.get().job.num if HydraConfig.initialized() else None
    return job is not None and int(wanted) == int(job)


def _kill(launcher: bool, spec: str) -> None:
    if int(os.environ.get(ATTEMPT_ENV) or 1) > 1:
        return  # a job's later attempt runs clean
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    once = os.environ.get(ONCE_DIR_ENV)
    if once:
        done = os.path.join(once, spec.replace("/", "_"))
        if os.path.exists(done):
            return
        open(done, "w").close()
    pid = int(os.environ.get(LAUNCHER_PID_ENV) or os.getpid()) if launcher else os.getpid()
    os.kill(pid, signal.SIGKILL)
    if pid != os.getpid():  # the ranks die with their launcher (ddp_launcher/ranks/lifeline.py)
        signal.pause()
