"""Resuming a sweep and retrying its jobs: what a job dir's records say, and what to do next.

Hydra has no resume, but the same command line gives the same jobs in the same order
(BasicSweeper) or the same stored study (ddp_launcher/sweeper/sweeper.py), so a rerun with
`hydra.launcher.resume=true` and the old `hydra.sweep.dir` meets every job in the dir it had.
A job's fate is decided from its job dir alone (:func:`decide`):

    launch.json            the launcher's record: the job's number and overrides, one entry per
                           attempt (start, end, how, its SLURM job id)
    result.json            the run's own record, written by rank 0 however the run ends
    rank 0's JobReturn     .torchrun/result.pkl, or the attempt's submitit result pickle
    .hydra/overrides.yaml  Hydra's record of the overrides (for dirs without launch.json)

* completed: not run again; its JobReturn (else one holding result.json's `best`) goes to the
  sweeper;
* its SLURM job still queued or running (the launcher died, the job did not): waited for;
* anything else: run again in its own dir with `resume=auto`, continuing from its checkpoints
  (from the start where it has none), in the same W&B run;
* recorded overrides that differ from the job's: an error naming both (one sweep per dir).

`hydra.launcher.retries=N` reruns a failed job the same way, up to N times per launch, unless its
error is the user's (bad input fails the same way again). Both launchers use this module; it
imports no torch. A single run's attempts go into its own launch.json, from its
gate (:class:`RunAttempts`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from ddp_launcher.core import run_lock
from ddp_launcher.core.errors import UserError, describe
from ddp_launcher.core.fault_points import point
from ddp_launcher.core.gate import (
    NothingToDo,
    Opening,
    check_start,
    gate_of,
    open_run,
    refusal,
    what_runs,
)
from ddp_launcher.core.run_dir import (
    CHECKPOINT_DIR,
    LAUNCH_FILE,
    RESULT_FILE,
    Attempt,
    LaunchRecord,
    RunResult,
    read_launch_record,
    read_result,
    write_launch_record,
    write_result,
)
from ddp_launcher.drift import check_on_drift, drift_line, job_code, since_first
from ddp_launcher.jobs import STOPPED, verdict_of, write_launcher_result
from ddp_launcher.ranks.job_spec import fails_for_good, job_return
from ddp_launcher.report.jobs import read_overrides

log = logging.getLogger(__name__)

# A run that ended for good: a resumed sweep does not run it again (pruned: the sweeper's
# pruner stopped it, ddp_launcher/ranks/pruning.py).
ENDED = ("completed", "pruned")
LOCK_FILE = ".launcher.lock"  # in the sweep dir: one launcher per sweep dir at a time
# hydra-optuna-sweeper's sweeper (a config's `_target_` line may still name it): it would start
# its study over (the project's hydra/sweeper=optuna continues it).
HYDRA_OPTUNA_SWEEPER = "hydra_plugins.hydra_optuna_sweeper.optuna_sweeper.OptunaSweeper"


def check_overrides(
    job_num: int, overrides: Sequence[str], job_dir: Path, recorded: Sequence[str] | None
) -> None:
    """A job dir holds one job: recorded overrides (in any order; start_over and resume left out:
    how it starts, not which job) must be this job's; else a UserError naming where they
    differ."""
    if recorded is None or what_runs(recorded) == what_runs(overrides):
        return
    theirs = [o for o in recorded if o not in overrides] or list(recorded)
    ours = [o for o in overrides if o not in recorded] or list(overrides)
    raise UserError(
        f"{job_dir} holds another job ({' '.join(theirs)}) than job #{job_num} of this sweep "
        f"({' '.join(ours)}): never mix two sweeps in one dir: repeat the first sweep's command "
        "line to resume it, or pass another hydra.sweep.dir"
    )


@dataclass(frozen=True)
class Decision:
    action: str  # "done": completed earlier | "attach": wait for the attempt still running | "run"
    why: str  # for the log


def decide(
    *,
    rank0_completed: bool,
    result: RunResult | None,
    last: Attempt | None,
    attachable: bool = False,
) -> Decision:
    """What a resumed sweep does with a job, from its records (see the module docstring);
    `attachable`: its last attempt still runs without a launcher (its backend says so)."""
    if rank0_completed:
        return Decision("done", "completed")
    if last is not None and attachable:
        return Decision("attach", f"attempt {last.attempt} is still queued or running")
    if result is not None and result.status in ENDED:
        return Decision("done", result.status)
    if result is not None and result.status != "running":
        detail = f": {result.error}" if result.error and result.status == "failed" else ""
        return Decision("run", f"{result.status}{detail}")
    if last is not None:
        return Decision("run", "stopped without a result (killed?)")
    return Decision("run", "never started")


def attempt_end(
    result: RunResult | None, completed: bool, ended_as: tuple[str, ...]
) -> tuple[str, str | None] | None:
    """(status, error) of an attempt: completed (pruned if its result.json says so), else its
    result.json's status when one of `ended_as`; None otherwise."""
    if completed:
        pruned = result is not None and result.status == "pruned"
        return ("pruned", result.error) if pruned else ("completed", None)
    if result is not None and result.status in ended_as:
        return result.status, result.error
    return None


def settle(job_dir: Path, record: LaunchRecord, completed: bool) -> None:
    """Record how the last attempt ended when its launcher died before it could: completed,
    or what this attempt's result.json says, else interrupted (killed with the launcher)."""
    last = record.last
    result = read_result(job_dir, since=last.started)
    completed = completed or (result is not None and result.status == "completed")
    died = ("interrupted", "ended with its launcher, leaving no result")
    last.status, last.error = attempt_end(result, completed, ("pruned", "failed", *STOPPED)) or died
    last.ended = (Path(job_dir) / RESULT_FILE).stat().st_mtime if result else time.time()
    save_record(job_dir, record)


def save_record(job_dir: Path, record: LaunchRecord) -> None:
    """launch.json, replaced; a crash point (ddp_launcher/core/fault_points.py)."""
    write_launch_record(job_dir, record)
    point("launch.record", job=record.job_num)


def has_checkpoints(job_dir: Path) -> bool:
    ckpt = Path(job_dir) / CHECKPOINT_DIR
    return ckpt.is_dir() and any(ckpt.glob("*.pt"))


def check_job_dir(job: Any) -> LaunchRecord | None:
    """The job dir's launch record, after checking the dir holds this job (else a UserError):
    its overrides are launch.json's, else Hydra's .hydra/overrides.yaml, else result.json's."""
    record = read_launch_record(job.job_dir)
    recorded = record.overrides if record is not None else read_overrides(job.job_dir)
    if recorded is None and (result := read_result(job.job_dir)) is not None:
        recorded = result.overrides
    check_overrides(job.num, job.overrides, job.job_dir, recorded)
    return record


def prepare_job(
    job: Any, backend: Any, *, resume: bool, retries: int, on_drift: str = "warn"
) -> tuple[Any, Any]:
    """Read a sweep job's records before it runs: check its dir holds this job, give it its
    attempt count and retries, and with `resume` decide what to do with it, saying in one line
    when its code or config changed since its first attempt (on_drift=refuse: a UserError).
    Returns (rank 0's JobReturn when it completed earlier, else None; the `backend`'s handle of
    an earlier attempt still running, to wait for, else None)."""
    from hydra.core.utils import JobStatus

    job.retries_left = retries
    if not job.in_sweep:
        return None, None
    record = check_job_dir(job)
    job.attempt = len(record.attempts) if record is not None else 0
    result = read_result(job.job_dir)
    last = record.last if record is not None else None
    left_open = last is not None and last.ended is None  # its launcher died
    if not resume:
        if left_open and job.records:
            settle(job.job_dir, record, completed=False)
        starts_over = bool(OmegaConf.select(job.spec.config, "start_over", default=False))
        if (record is not None or result is not None) and not starts_over:
            log.warning(
                "#%d: %s already holds a run of this job: hydra.launcher.resume=true continues "
                "it, start_over=true starts it over (the job refuses to mix two runs)",
                job.num,
                job.job_dir,
            )
        return None, None
    decision, ret, handle = resume_decision(job, backend, record, result)
    completed = ret is not None and ret.status == JobStatus.COMPLETED
    if decision.action == "run" and (drift := drift_line(job, record)) is not None:
        if on_drift == "refuse":
            raise UserError(f"{drift}: hydra.launcher.on_drift=refuse (warn runs it anyway)")
        log.warning("%s: it goes on (hydra.launcher.on_drift=refuse stops instead)", drift)
    if left_open and decision.action != "attach" and job.records:
        settle(job.job_dir, record, completed)
    label = f"#{job.num} {' '.join(job.overrides) or '(no overrides)'}"
    if decision.action == "done":
        if not completed:  # no JobReturn of rank 0 left: result.json's value
            ret = job_return(job, JobStatus.COMPLETED, result.value if result else None)
        log.info("%s: completed earlier, not run again (value %s)", label, ret.return_value)
        return ret, None
    continue_in_dir(job)
    if decision.action == "attach":
        job.started = last.started
        log.info("%s: %s: waiting for it", label, decision.why)
        return None, handle
    if record is not None or result is not None:
        again = " from its checkpoints" if has_checkpoints(job.job_dir) else ""
        log.info("%s: %s: runs again%s", label, decision.why, again)
    return None, None


def refuse_drift(job: Any) -> None:
    """Before any job of a resumed sweep starts (hydra.launcher.on_drift=refuse): a UserError
    when this job would run again with other code or config than its first attempt's."""
    record = read_launch_record(job.job_dir)
    result = read_result(job.job_dir)
    if record is None or (result is not None and result.status in ENDED):
        return
    drift = drift_line(job, record)
    if drift is not None:
        raise UserError(
            f"{drift}: hydra.launcher.on_drift=refuse: nothing was started (on_drift=warn runs "
            "it anyway; or resume from the commit and config it started with)"
        )


def resume_decision(
    job: Any, backend: Any, record: LaunchRecord | None, result: RunResult | None
) -> tuple[Decision, Any, Any]:
    """What a resumed sweep does with `job` (:func:`decide`), changing nothing: the decision,
    rank 0's JobReturn of its last attempt (if any) and the `backend`'s handle of that attempt
    when it still runs without its launcher. prepare_job acts on it; ddp_launcher/preview.py shows
    it."""
    from hydra.core.utils import JobStatus

    last = record.last if record is not None else None
    ret = backend.earlier_return(job, last)
    completed = ret is not None and ret.status == JobStatus.COMPLETED
    left_open = last is not None and last.ended is None
    handle = backend.reattach(job, last) if left_open and not completed else None
    decision = decide(
        rank0_completed=completed, result=result, last=last, attachable=handle is not None
    )
    return decision, ret, handle


def continue_in_dir(job: Any) -> None:
    """The job's next attempt runs again in its dir. Where the launcher names the app's resume
    key (opt-in: `hydra.launcher.resume_key: resume`, as an app's config may set), that key says
    `auto`: the app continues from its checkpoints (with none yet, it starts over the attempt
    before, in one W&B run). Without one the app's config stays as it is (its `resume:
    /path/pretrained.pt` too): what it does in a dir holding its earlier attempt is its own."""
    job.continues = True
    config = job.spec.config
    key = resume_key(config)
    if key is None:
        return
    if OmegaConf.select(config, key, default=MISSING_KEY) is MISSING_KEY:
        raise UserError(
            f"hydra.launcher.resume_key={key}: the app's config has no key {key} to set to auto "
            "when a job continues: name the key the app resumes from, or null (no hook)"
        )
    if OmegaConf.select(config, key) != "auto":
        with open_dict(config):
            OmegaConf.update(config, key, "auto", merge=False)


MISSING_KEY = object()


def resume_key(config: Any) -> str | None:
    """hydra.launcher.resume_key: the app's key a continuing job gets `auto` in (None: no hook)."""
    key = OmegaConf.select(config, "hydra.launcher.resume_key", default=None)
    return str(key) if key else None


def gate_job(job: Any) -> Any:
    """A sweep job about to be queued, through the app's gate (ddp_launcher/core/gate.py: its
    checks with the
    job's world size, what its dir holds): job.plan, or job.error (it fails alone); a JobReturn
    when there is nothing left to do."""
    from hydra.core.utils import JobStatus

    world_size = job.nproc * job.nnodes
    try:
        if job.records:
            job.plan = check_start(
                job.spec.config, job.job_dir, world_size, sweep=True, continues=job.continues
            )
        elif (gate := gate_of(job.spec.config)) is not None and gate.checks is not None:
            gate.checks(job.spec.config, world_size, job.job_dir)  # (its dir: the other node's)
    except UserError as e:
        job.error = str(e)
    except NothingToDo as e:
        log.info("#%d: %s", job.num, e)
        result = read_result(job.job_dir)
        return job_return(job, JobStatus.COMPLETED, result.value if result else None)
    except Exception as e:  # noqa: BLE001 - the checks change nothing: the job fails alone
        job.error = refusal(e, Opening(Path(job.job_dir), "checking the start"), [])
    return None


class StartRefused(UserError):
    """A sweep job's start failed inside its guard (the job dir's lock, what it replaces,
    launch.json): undone, its dir as it was; the job fails alone with this one line, and is not
    retried."""


def start_attempt(job: Any, hold: bool = True) -> None:
    """Before a job's processes start (or its SLURM job is submitted): at its first attempt in
    this launch, the job dir opened as its gate planned (held by this launcher with `hold`
    unless the gate says lock: false, what it replaces set aside: ddp_launcher/core/gate.py);
    count the attempt and record it in launch.json. These steps run inside one guard: any
    error undoes them and is a StartRefused naming the step, its cause and fix."""
    gate = gate_of(job.spec.config)
    attempt, started = job.attempt + 1, time.time()
    opening = Opening(Path(job.job_dir))
    try:
        if job.plan is not None:
            open_run(
                job.job_dir,
                job.plan,
                f"job #{job.num} of a sweep",
                hold=hold and (gate is None or gate.lock),
                opening=opening,
                opt_out=gate.lock_opt_out if gate is not None else run_lock.NO_LOCK_FIX,
            )
        continued = job.continues and has_checkpoints(job.job_dir)
        if job.in_sweep and job.records:
            opening.step = f"recording the attempt ({LAUNCH_FILE})"
            opening.keep(Path(job.job_dir) / LAUNCH_FILE)
            record = read_launch_record(job.job_dir) or LaunchRecord(job.num, list(job.overrides))
            code, flat = job_code(job.spec.config, task_function=job.spec.task_function)
            if record.config is None:
                record.config = flat
            record.attempts.append(Attempt(attempt, started, continued=continued, code=code))
            save_record(job.job_dir, record)
    except Exception as e:
        raise StartRefused(refusal(e, opening, opening.undo())) from None
    except BaseException:  # Ctrl-C: its dir as it was, then on its way
        opening.undo()
        raise
    opening.say()
    job.plan = None  # a retry continues what this attempt starts
    job.attempt, job.started = attempt, started


def update_attempt(job: Any, **values: Any) -> None:
    """Add to the record of the job's current attempt (e.g. its SLURM job id once submitted)."""
    if not (job.in_sweep and job.records):
        return
    record = read_launch_record(job.job_dir)
    if record is None or record.last is None:
        return
    for key, value in values.items():
        setattr(record.last, key, value)
    save_record(job.job_dir, record)


def close_attempt(job: Any, ret: Any) -> None:
    """Record how the attempt that just ended with `ret` ended: the run's own result.json
    status when this attempt wrote one (pruned, preempted, interrupted, failed), else the
    JobReturn's, with its one-line error."""
    result = read_result(job.job_dir, since=job.started)
    ended = attempt_end(result, ret.status.name == "COMPLETED", ("failed", *STOPPED))
    status, error = ended or ("failed", describe(verdict_of(ret)))
    update_attempt(job, ended=time.time(), status=status, error=error)


def record_stopped(job: Any, signal_name: str, interrupted: bool = False) -> str:
    """A job the launcher stopped because it was asked to stop (SIGINT/SIGTERM): its run
    recorded `preempted` when it stopped at a checkpoint; a run that left no record of this
    attempt gets result.json `interrupted`. `interrupted`: the launcher stopped it on its own
    (hydra.launcher.fail_fast), recorded `interrupted` either way. Returns the status."""
    result = read_result(job.job_dir, since=job.started) if job.started else None
    if result is None or result.status == "running":
        stopped = "the sweep was stopped" if job.in_sweep else "the run was stopped"
        why = f"{stopped} ({signal_name}) before the job ended"
        result = write_launcher_result(job, "interrupted", why)
    ctrl_c = not job.in_sweep and signal_name == "SIGINT"
    if (ctrl_c or interrupted) and result.status in ("preempted", "interrupted"):
        # `python app.py dist.nproc_per_node=N` Ctrl-C'd, or a sweep job stopped by fail_fast:
        # its ranks stopped at a checkpoint as preemption does, but no scheduler preempted it
        # (the user or the launcher stopped it); resume=auto continues it
        said = "Ctrl-C" if ctrl_c else signal_name
        result.status = "interrupted"
        result.error = f"interrupted ({said})" + (
            result.error.partition("preempted")[2] if result.error.startswith("preempted") else ""
        )
        write_result(job.job_dir, result)
    update_attempt(job, ended=time.time(), status=result.status, error=result.error)
    # (a single run's own closing line says how it continues: resume=auto, not a sweep's key)
    resumable = result.status != "completed" and job.in_sweep
    hint = ": hydra.launcher.resume=true continues it" if resumable else ""
    log.warning("#%d %s: %s%s", job.num, " ".join(job.overrides), result.status, hint)
    return result.status


def should_retry(job: Any, ret: Any) -> bool:
    """Whether a job that just ended gets another attempt (hydra.launcher.retries): it failed,
    it has retries left in this launch, and its error is not the user's (bad input fails the
    same way every time). Counts the retry and says so."""
    if ret.status.name == "COMPLETED":
        return False
    if fails_for_good(job, ret):
        if job.retries_left > 0:
            log.info("#%d: not retried: a user error fails the same way again", job.num)
        return False
    job.retries_left -= 1
    continue_in_dir(job)
    again = " from its checkpoints" if has_checkpoints(job.job_dir) else ""
    left = f"{job.retries_left} retr{'y' if job.retries_left == 1 else 'ies'} left"
    log.warning(
        "#%d: attempt %d did not complete; retrying%s (%s)", job.num, job.attempt, again, left
    )
    return True


_HELD_LOCKS: dict[str, int] = {}


def hold_sweep_lock(sweep_dir: Path, opt_out: str = run_lock.NO_LOCK_FIX) -> None:
    """Hold <sweep dir>/.launcher.lock (an flock, dropped by the kernel however this process
    ends): a second launcher on the same sweep dir is an error instead of two launchers running
    the same jobs. Opened as a run's lock is (ddp_launcher/core/run_lock.py: never through a
    symlink, a regular file of its own); a file system without flock is a UserError naming
    `opt_out`."""
    path = Path(sweep_dir).resolve() / LOCK_FILE
    if str(path) in _HELD_LOCKS:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd, _, _ = run_lock.hold_file(path, opt_out=opt_out)
    except BlockingIOError:
        holder = "?"
        with contextlib.suppress(OSError), open(path, "rb") as f:
            holder = f.read(64).decode(errors="replace").strip() or "?"
        raise UserError(
            f"{sweep_dir} is in use by another launcher (pid {holder}): wait for it to end or "
            "stop it, then rerun with hydra.launcher.resume=true"
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    _HELD_LOCKS[str(path)] = fd


def release_sweep_lock(sweep_dir: Path) -> None:
    """Give the sweep dir's launcher lock up (its file stays; a refused start puts it back as
    it was: ddp_launcher/core/gate.py's undo_sweep_start)."""
    fd = _HELD_LOCKS.pop(str(Path(sweep_dir).resolve() / LOCK_FILE), None)
    if fd is not None:
        os.close(fd)


def check_sweeper(config: DictConfig, resume: bool) -> None:
    """A resumed sweep whose command line also starts every job over is a contradiction (start
    over lost silently); hydra-optuna-sweeper asks for new trials from 0 on every run:
    resuming needs ours."""
    target = OmegaConf.select(config, "hydra.sweeper._target_", default=None)
    if resume and OmegaConf.select(config, "start_over", default=False) is True:
        raise UserError(
            "hydra.launcher.resume=true and start_over=true contradict each other (continue the "
            "sweep's jobs, or start every job over): drop one, e.g. start_over=false to "
            "continue them"
        )
    if resume and target == HYDRA_OPTUNA_SWEEPER:
        raise UserError(
            "hydra.launcher.resume=true with hydra-optuna-sweeper would start the study over: "
            "resume with hydra/sweeper=ddp_optuna (hydra-ddp-launcher's Optuna sweeper, also "
            "hydra/sweeper=optuna where hydra-optuna-sweeper is not installed: the same "
            "options; it continues the study)"
        )


def restarted() -> bool:
    """A torchrun restart of the ranks or a SLURM requeue: the same attempt again."""
    counts = ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")
    return any(int(os.environ.get(var) or 0) > 0 for var in counts)


class RunAttempts:
    """A single run's attempts, recorded by its gate (ddp_launcher/core/gate.py's RunGate, rank 0
    only, so
    one line per run whatever its world size; sweep jobs never pass there: the launcher records
    and checks them). `plan` is the gate's: "continue" resumes the run dir's trajectory."""

    @staticmethod
    def check(config: DictConfig, run_dir: Path, plan: Any) -> str | None:
        """Before anything is written: the line saying what changed since the run's first
        attempt when it continues (None: nothing did, or it starts fresh);
        hydra.launcher.on_drift=refuse makes it a UserError."""
        on_drift = str(OmegaConf.select(config, "hydra.launcher.on_drift", default=None) or "warn")
        check_on_drift(on_drift)
        if plan.action != "continue":
            return None
        found = since_first(read_launch_record(run_dir), config, run_dir)
        if not found:
            return None
        line = f"{run_dir}: changed since the run started: {'; '.join(found)}"
        if on_drift == "refuse":
            raise UserError(
                f"{line}: hydra.launcher.on_drift=refuse: nothing was started (on_drift=warn runs "
                "it anyway; or resume from the commit and config it started with)"
            )
        return f"{line}: it goes on (hydra.launcher.on_drift=refuse stops instead)"

    @staticmethod
    def open(config: DictConfig, run_dir: Path, plan: Any) -> None:
        """Once the gate holds the dir: this attempt and its code in launch.json (a fresh start
        begins a new record; an attempt a killed run left open is settled first)."""
        if restarted():
            return
        record = read_launch_record(run_dir) if plan.action == "continue" else None
        if record is not None and record.last is not None and record.last.ended is None:
            settle(run_dir, record, completed=False)
        if record is None:
            overrides = OmegaConf.select(config, "hydra.overrides.task", default=None) or []
            record = LaunchRecord(0, [str(o) for o in overrides])
        code, flat = job_code(config, run_dir)
        if record.config is None:
            record.config = flat
        continued = plan.action == "continue"
        record.attempts.append(
            Attempt(len(record.attempts) + 1, time.time(), continued=continued, code=code)
        )
        write_launch_record(run_dir, record)

    @staticmethod
    def close(run_dir: Path, job_return: Any) -> None:
        """The run ended in this process (not killed): how, as a sweep job's attempt is closed
        (ddp_launcher/resume.py's close_attempt)."""
        record = read_launch_record(run_dir)
        last = record.last if record is not None else None
        if last is None or last.ended is not None:
            return
        result = read_result(run_dir, since=last.started)
        completed = job_return is not None and job_return.status.name == "COMPLETED"
        ended = attempt_end(result, completed, ("failed", *STOPPED))
        last.status, last.error = ended or ("failed", describe(verdict_of(job_return)))
        last.ended = time.time()
        write_launch_record(run_dir, record)
