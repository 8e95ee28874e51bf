"""A job's life, written once for every backend (ddp_launcher/torchrun.py, ddp_launcher/slurm.py):
compose
(jobs.py) -> place -> prepare (resume.py: done, re-attach or run) -> start an attempt -> wait ->
outcome -> close the attempt -> retry or report (jobs.py's job_done). A :class:`Backend`
implements only what differs. Jobs start in strict FIFO order as soon as the backend has room,
so :func:`run_jobs` takes any iterable and asks for a job only when it could start now. Any
error or stop signal stops the running attempts through the backend and records each.
"""

from __future__ import annotations

import logging
import signal
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

from omegaconf import OmegaConf

from ddp_launcher.core import run_lock
from ddp_launcher.core.errors import UserError, describe, find_user_error, job_value
from ddp_launcher.core.gate import (
    failure_line,
    gate_of,
    pending_sweep_start,
    sweep_started,
    undo_sweep_start,
)
from ddp_launcher.core.host import check_host
from ddp_launcher.core.naming import label, swept_values
from ddp_launcher.core.run_dir import LAUNCH_FILE, read_launch_record
from ddp_launcher.drift import check_on_drift
from ddp_launcher.jobs import (
    FailedFast,
    Job,
    SweepStopped,
    check_own_dirs,
    compose_jobs,
    configure_sweep_logging,
    failed_job_return,
    job_done,
    launcher_errors,
    stop_reason,
    stop_signals,
)
from ddp_launcher.progress import SweepProgress, wall_time
from ddp_launcher.ranks.job_spec import FENCE_FILE, NotStarted
from ddp_launcher.report.callback import report_unfinished
from ddp_launcher.resume import (
    StartRefused,
    check_job_dir,
    check_sweeper,
    close_attempt,
    gate_job,
    hold_sweep_lock,
    prepare_job,
    record_stopped,
    refuse_drift,
    release_sweep_lock,
    should_retry,
    start_attempt,
    update_attempt,
)

log = logging.getLogger(__name__)

# A supply of jobs: the next one's (job number, overrides), or None when none starts now.
NextOverrides = Callable[[], tuple[int, Sequence[str]] | None]


class Backend(Protocol):
    """Where and how a job's attempts run. A handle is the backend's object for one running
    attempt; `record(handle)` is what launch.json keeps of it (opaque JSON), handed back as
    `attempt.backend` to `earlier_return` and `reattach` when a sweep resumes."""

    poll_s: float  # how often the lifecycle asks `ended`
    # whether this launcher holds a job's dir for it (ddp_launcher/core/run_lock.py), or the job
    # does
    holds_job_dirs: bool

    def place(self, job: Job) -> None:
        """Set job.nproc, .nnodes, .uses_gpus from its config; UserError if it cannot run here."""

    def reserve(self, job: Job) -> Any:
        """The resources the job gets if it can start now (e.g. its GPUs), else None."""

    def release(self, job: Job, slot: Any) -> None:
        """Give a finished attempt's resources back."""

    def start(self, batch: list[tuple[Job, Any]]) -> list[Any]:
        """Start one attempt of each (job, slot), all at once; their handles, in order."""

    def record(self, handle: Any) -> dict | None:
        """What launch.json keeps of a started attempt to find it again (None: nothing)."""

    def ended(self, handles: list[Any]) -> list[Any]:
        """Those of the running attempts' handles that have ended."""

    def outcome(self, job: Job, handle: Any) -> Any:
        """The ended attempt's JobReturn: rank 0's own, or a failed one saying why."""

    def stop(self, running: list[tuple[Job, Any]], why: str) -> None:
        """Stop the running attempts as preemption does (they checkpoint) and wait for them."""

    def earlier_return(self, job: Job, attempt: Any) -> Any:
        """Rank 0's JobReturn of an earlier attempt (core/run_dir.py's Attempt), or None."""

    def reattach(self, job: Job, attempt: Any) -> Any:
        """A handle to an earlier attempt that still runs without its launcher, or None."""


def resume_args(sweep_dir: Path) -> str:
    """What a rerun of the same command adds to continue the sweep in `sweep_dir`."""
    return f"hydra.sweep.dir={sweep_dir} hydra.launcher.resume=true"


def stopped_line(why: str, sweep_dir: Path) -> str:
    """The line of a sweep a signal stopped (`why`: its name)."""
    return (
        f"the sweep was stopped ({why}): its running jobs stopped and are recorded in their job "
        f"dirs; rerun the same command with {resume_args(sweep_dir)} to continue it"
    )


def fail_fast_line(failed: str, sweep_dir: Path, *, user: bool, again: bool) -> str:
    """The line of a sweep hydra.launcher.fail_fast stopped at the job `failed` describes;
    `user`: its error is the user's (it fails the same way every time); `again`: it failed the
    same way in its attempt before. Either way a resume would stop there again: the line says
    how past it."""
    resume = resume_args(sweep_dir)
    if user or again:
        why = (
            "a user error fails the same way every time"
            if user
            else "it failed the same way in its last attempt"
        )
        how = (
            f"{why}: fix it, then rerun the same command with {resume}; or rerun it with "
            f"{resume} hydra.launcher.fail_fast=false to run the other jobs past it"
        )
    else:
        how = f"fix it, then rerun the same command with {resume} to continue the sweep"
    return (
        f"hydra.launcher.fail_fast: {failed}; the sweep stopped there: no job started after it, "
        f"the running ones stopped and are recorded in their job dirs; {how}"
    )


def failed_again(job: Job) -> bool:
    """Whether the job's attempt that just failed ended as its attempt before did (the same
    error, in its launch.json): what a resume of the sweep would meet first."""
    record = read_launch_record(job.job_dir) if job.in_sweep else None
    attempts = record.attempts if record is not None else []
    if len(attempts) < 2:
        return False
    last, before = attempts[-1], attempts[-2]
    return last.status == before.status == "failed" and last.error == before.error


def place(job: Job, backend: Backend) -> None:
    """Read the job's world size where the backend runs it, or job.error (it fails alone) when it
    cannot run there."""
    if job.error:  # its config did not compose
        return
    try:
        backend.place(job)
    except UserError as e:
        job.error = str(e)


def finish(job: Job, handle: Any, backend: Backend, ret: Any = None) -> Any:
    """An ended attempt: its JobReturn (`ret` when already read), the attempt closed in
    launch.json, one line said."""
    ret = backend.outcome(job, handle) if ret is None else ret
    close_attempt(job, ret)
    return job_done(job, ret)


def run_jobs(
    jobs: Iterable[Job],
    backend: Backend,
    *,
    resume: bool = False,
    retries: int = 0,
    sleep: Callable[[float], Any] = time.sleep,
    on_done: Callable[[Job, Any], Any] | None = None,
    fail_fast: bool = False,
    on_drift: str = "warn",
    progress: SweepProgress | None = None,
    fence: Path | None = None,
    claimed: dict[Path, Job] | None = None,
    on_first: Callable[[], Any] | None = None,
) -> dict[int, Any]:
    """Run `jobs` through their whole life on `backend`; return {job num: final JobReturn}.
    The next job is taken from `jobs` only when the backend has room to start it now;
    `on_done(job, ret)` hears of each job's final JobReturn at once (an ask-and-tell sweeper).
    With `fail_fast` the first job that fails for good raises FailedFast: no job starts after
    it, and the running ones are stopped and recorded as a stop signal would stop them; a
    scheduler that starts queued jobs on its own (SLURM) is fenced off by `fence`, a file made
    at that moment, whose jobs run nothing once it exists (Job.fence). `progress` hears of
    every start and end. `claimed`: the job dirs of the sweep's jobs so far (one job dir, one
    job: jobs/check_own_dirs); `on_first()` is called once, before the first job starts or
    ends (until then a refusal undoes the sweep's start)."""
    if retries < 0:
        raise UserError(f"hydra.launcher.retries={retries}: use 0 (no retry) or more")
    check_on_drift(on_drift)
    claimed = {} if claimed is None else claimed
    if isinstance(jobs, Sequence):  # every job dir checked before any job starts
        check_own_dirs(jobs, claimed)
        for job in jobs:
            if job.in_sweep:
                check_job_dir(job)
                if resume and on_drift == "refuse":
                    refuse_drift(job)
    results: dict[int, Any] = {}
    failed_first: list[tuple[Job, Any]] = []  # with fail_fast: the job that ends the sweep
    if fence is not None:
        fence.unlink(missing_ok=True)  # an earlier launch's: this one starts the sweep again

    def first() -> None:
        nonlocal on_first
        if on_first is not None:
            on_first, call = None, on_first
            call()

    def done(job: Job, ret: Any, ran: bool = True) -> None:
        first()
        run_lock.release(job.job_dir)  # held since its first attempt started (if by us)
        results[job.num] = ret
        failed = ret.status.name == "FAILED"
        if progress is not None:
            progress.ended(failed, wall_time(job) if ran else None, ran=ran)
        if fail_fast and failed and not failed_first:
            # the sweep ends here: an ask-and-tell sweeper is not told, so that its study keeps
            # the trial open and a resumed sweep runs it again, as it does the stopped ones
            failed_first.append((job, ret))
            return
        if on_done is not None:
            on_done(job, ret)

    pending: deque[Job] = deque()  # placed and prepared, waiting for room, in order
    running: list[tuple[Job, Any, Any]] = []  # (job, slot, handle)
    supply: Iterator[Job] = iter(jobs)

    def next_job() -> bool:
        """Place and prepare the next job; queue it unless it is done already."""
        job = next(supply, None)
        if job is None:
            return False
        place(job, backend)
        if not isinstance(jobs, Sequence) and not job.error:  # (a Sequence: checked above)
            try:
                check_own_dirs([job], claimed)
            except UserError as e:
                job.error = str(e)
        job.fence = fence if fail_fast else None
        ret, attach = prepare_job(job, backend, resume=resume, retries=retries, on_drift=on_drift)
        if ret is None and attach is None and not job.error and job.in_sweep:
            ret = gate_job(job)  # the app's checks, the job dir's plan (ddp_launcher/core/gate.py)
        if ret is None and job.error:
            ret = job_done(job, failed_job_return(job, job.error, cause=UserError(job.error)))
        if ret is not None:
            done(job, ret, ran=False)
        elif attach is not None:
            running.append((job, None, attach))
            if progress is not None:
                progress.started()
        else:
            pending.append(job)
        return True

    try:
        while True:
            batch = []
            while not failed_first and (pending or next_job()):
                if not pending:
                    continue
                job = pending[0]
                slot = backend.reserve(job)
                if slot is None:
                    if not running and not batch:
                        raise ValueError(f"job #{job.num} can never start here ({job.nproc} ranks)")
                    break
                pending.popleft()
                batch.append((job, slot))
            if failed_first:  # no job starts after it
                for job, slot in batch:
                    backend.release(job, slot)
                raise FailedFast(*failed_first[0])
            if batch:
                ready = []
                for job, slot in batch:
                    try:
                        start_attempt(job, hold=backend.holds_job_dirs)  # launch.json
                    except StartRefused as e:  # undone: it fails alone, its dir as it was
                        backend.release(job, slot)
                        job.refused = True
                        done(job, job_done(job, failed_job_return(job, str(e), cause=e)), False)
                        continue
                    ready.append((job, slot))
                batch = ready
            if batch:
                first()
                try:
                    handles = backend.start(batch)
                except BaseException as e:
                    for job, _ in batch:
                        error = f"not submitted: {describe(e)}"
                        update_attempt(job, ended=time.time(), status="failed", error=error)
                    raise
                for (job, slot), handle in zip(batch, handles, strict=True):
                    running.append((job, slot, handle))
                    update_attempt(job, backend=backend.record(handle))
                    if progress is not None:
                        progress.started()
            if not running:
                break
            sleep(backend.poll_s)
            if progress is not None:
                progress.draw()  # again, after the log lines that cleared it
            ended = backend.ended([handle for _, _, handle in running])
            for entry in [r for r in running if any(r[2] is h for h in ended)]:
                job, slot, handle = entry
                ret = backend.outcome(job, handle)
                if isinstance(job_value(ret), NotStarted):
                    continue  # fenced off: stopped and recorded with the running ones
                running.remove(entry)
                if slot is not None:
                    backend.release(job, slot)
                ret = finish(job, handle, backend, ret)
                if should_retry(job, ret):
                    pending.appendleft(job)  # next in line: it started before the others
                    if progress is not None:
                        progress.running -= 1
                else:
                    done(job, ret)
    except BaseException as e:
        if isinstance(e, FailedFast) and fence is not None:
            fence.touch()  # the job itself made it, unless it died first
        why = stop_reason(e)
        backend.stop([(job, handle) for job, _, handle in running], why)
        for job, _, _ in running:
            record_stopped(job, why, interrupted=isinstance(e, FailedFast))
        raise
    return results


class LifecycleLauncher:
    """Hydra's `Launcher.launch` (a batch) and `launch_stream` (jobs one at a time) through this
    lifecycle. A subclass names itself (`launcher_name`), says whether it can launch here
    (`check`: a UserError if not) and with what (`options`: backend, resume, retries, and
    fail_fast, on_drift, and optionally stop_on, the signals that stop a sweep, and lock, one
    launcher per sweep dir)."""

    launcher_name = "launcher"

    def check(self) -> None:
        pass

    def check_setup(self, config: Any, hydra_context: Any) -> None:
        """From the launcher's setup, which Hydra calls inside its sweeper's setup, before the
        sweeper writes anything: a resume the configured sweeper cannot do is refused, and a
        dry run takes the sweep over (ddp_launcher/preview.py's prepare_dry_run)."""
        from ddp_launcher.preview import prepare_dry_run

        resume = bool(OmegaConf.select(config, "hydra.launcher.resume", default=False))
        with launcher_errors():
            check_sweeper(config, resume)
            prepare_dry_run(config, hydra_context)

    def options(self) -> dict[str, Any]:
        raise NotImplementedError

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> list[Any]:
        """Compose the batch's jobs and run them; one JobReturn per job, in order, failed ones
        included (so Hydra's on_multirun_end runs)."""
        jobs: list[Job] = []

        def compose() -> list[Job]:
            from hydra.core.utils import filter_overrides

            for idx, overrides in enumerate(job_overrides, initial_job_idx):
                log.debug("\t#%d : %s", idx, " ".join(filter_overrides(overrides)))
            jobs.extend(compose_jobs(self, job_overrides, initial_job_idx))
            return jobs

        results = self.run_sweep(compose, first=initial_job_idx == 0, total=len(job_overrides))
        return [results[job.num] for job in jobs]

    def launch_stream(
        self, next_overrides: NextOverrides, on_result: Callable[[int, Any], Any], slots: int
    ) -> None:
        """Jobs supplied one at a time, as slots free (see :class:`JobFeed`); `on_result(num,
        ret)` hears of each job's final JobReturn as soon as it ends."""
        feed = JobFeed(self, next_overrides, slots)

        def ended(job: Job, ret: Any) -> None:
            feed.ended()
            on_result(job.num, ret)

        self.run_sweep(lambda: feed, first=True, on_done=ended)

    def preview(
        self,
        job_overrides: Sequence[Sequence[str]],
        initial_job_idx: int,
        notes: Sequence[str] = (),
    ) -> None:
        """hydra.launcher.dry_run=true (ddp_launcher/preview.py): compose and check the jobs as
        :meth:`launch` would, print one row each, start none, write nothing; a job that fails
        its checks is one line naming it, exit status 2."""
        from hydra.core.utils import setup_globals

        from ddp_launcher.preview import preview_jobs, print_table

        with launcher_errors():
            check_host()
            self.check()
            opts = self.options()
            setup_globals()
            check_sweeper(self.config, opts["resume"])
            jobs = compose_jobs(self, job_overrides, initial_job_idx)
            check_own_dirs(jobs)  # one job dir, one job (as a launch refuses it)
            rows, errors = preview_jobs(jobs, opts["backend"], opts["resume"], place)
            for error in errors:  # one line per job that would fail its checks
                log.error("%s", error)
            if errors:
                raise SystemExit(UserError.exit_code)
            sweep_dir = Path(str(self.config.hydra.sweep.dir))
            resuming = " (resuming)" if opts["resume"] else ""
            title = (
                f"{self.launcher_name}, dry run: {len(rows)} job(s) in {sweep_dir}{resuming}; "
                "nothing started, nothing written"
            )
            print_table(title, rows, notes)

    def run_sweep(
        self,
        jobs: Callable[[], Iterable[Job]],
        first: bool,
        on_done: Callable[[Job, Any], Any] | None = None,
        total: int | None = None,
    ) -> dict[int, Any]:
        """:func:`run_jobs` on `jobs()` once Hydra's globals and logging are set, the sweeper
        checked and the sweep dir made (and locked unless `lock` is false). A stop signal ends
        the sweep with SweepStopped once the running jobs are stopped and recorded; a failed
        job, the report of the sweep so far. Until a job starts or ends, a refusal of any kind
        undoes the sweep's start (:func:`undone_if_refused`)."""
        from hydra.core.utils import setup_globals

        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        with launcher_errors(), undone_if_refused(sweep_dir):
            if OmegaConf.select(self.config, "hydra.launcher.dry_run", default=False):
                # (preview.py previews every multirun asking for one before its sweeper runs)
                raise UserError(
                    "hydra.launcher.dry_run=true reached the launcher unpreviewed: nothing was "
                    "started; this is a bug of hydra-ddp-launcher (run without dry_run)"
                )
            check_host()
            self.check()
            opts = self.options()
            stop_on = opts.pop("stop_on", (signal.SIGINT, signal.SIGTERM))
            lock = opts.pop("lock", True)
            setup_globals()
            configure_sweep_logging(self.config)
            check_sweeper(self.config, opts["resume"])
            sweep_dir.mkdir(parents=True, exist_ok=True)
            gate = gate_of(self.config)
            opt_out = gate.lock_opt_out if gate is not None else run_lock.NO_LOCK_FIX
            if lock and (gate is None or gate.lock):
                hold_sweep_lock(sweep_dir, opt_out)
            said: list[tuple[int, str]] = []  # said as the first job starts or ends
            if first:  # Optuna hands out trials a few at a time: one line per sweep
                resuming = " (resuming)" if opts["resume"] else ""
                if opts["resume"] and not any(sweep_dir.glob(f"*/{LAUNCH_FILE}")):
                    # resume=true also starts a sweep resumable: say which this is (a typo)
                    resuming = " (hydra.launcher.resume=true: no earlier jobs there, a new sweep)"
                said.append(
                    (logging.INFO, f"{self.launcher_name}: sweep dir {sweep_dir}{resuming}")
                )
                if gate is not None and not gate.lock:
                    said.append(
                        (
                            logging.WARNING,
                            f"{opt_out}: the sweep dir and its job dirs are not locked: nothing "
                            "stops another launcher or run from writing into them",
                        )
                    )

            def begun() -> None:  # the sweep dir is this sweep's now (no undo)
                sweep_started(sweep_dir)
                for level, line in said:  # (a sweep refused before it is its one line alone)
                    log.log(level, "%s", line)

            parallel = getattr(opts["backend"], "limit", None) or total or 1
            progress = SweepProgress(total, parallel)
            try:
                try:
                    with stop_signals(stop_on):
                        results = run_jobs(
                            jobs(),
                            **opts,
                            on_done=on_done,
                            progress=progress,
                            fence=sweep_dir / FENCE_FILE,
                            claimed=self.claimed_dirs(),
                            on_first=begun,
                        )
                finally:
                    progress.close()
            except FailedFast as e:
                values = label(swept_values(e.job.overrides, e.job.swept), " ")
                failed = (
                    f"job #{e.job.num} ({values or ' '.join(e.job.overrides)}) failed: {e.reason}"
                )
                report_unfinished(self.config, f" (hydra.launcher.fail_fast: {failed})")
                user = find_user_error(job_value(e.ret)) is not None
                stopped = SweepStopped(
                    fail_fast_line(failed, sweep_dir, user=user, again=failed_again(e.job))
                )
                stopped.exit_code = UserError.exit_code if user else 1
                raise stopped from None
            except KeyboardInterrupt as e:
                report_unfinished(self.config, f" (the sweep was stopped: {stop_reason(e)})")
                stopped = SweepStopped(stopped_line(stop_reason(e), sweep_dir))
                stopped.exit_code = 128 + int(getattr(e, "signum", signal.SIGINT))
                raise stopped from None
            if any(ret.status.name == "FAILED" for ret in results.values()):  # may raise now
                report_unfinished(self.config, " (a job failed)")
            return results

    def claimed_dirs(self) -> dict[Path, Job]:
        """The job dirs of this sweep's jobs so far, over every batch (one job dir, one job)."""
        if not hasattr(self, "_claimed_dirs"):
            self._claimed_dirs: dict[Path, Job] = {}
        return self._claimed_dirs


@contextmanager
def undone_if_refused(sweep_dir: Path) -> Iterator[None]:
    """Until a job of the sweep starts or ends, the sweep's start is only what its sweeper and
    launcher wrote (multirun.yaml, the launcher's lock, the sweep dir): any failure undoes it
    to what the gate's on_multirun_start found (ddp_launcher/core/gate.py's SweepStart) and, of
    whatever type, is one line (a UserError: exit 2). Ctrl-C is undone too and goes on."""
    try:
        yield
    except BaseException as e:
        if not pending_sweep_start(sweep_dir):
            raise
        release_sweep_lock(sweep_dir)
        problems = undo_sweep_start(sweep_dir)
        if not isinstance(e, Exception) or (isinstance(e, UserError) and not problems):
            raise
        line = failure_line(e, sweep_dir, "the sweep's start failed")
        undone = "; ".join(problems) if problems else "the sweep dir is as it was"
        raise UserError(f"{line}; {undone}") from None


class JobFeed:
    """Jobs composed one at a time, while fewer than `slots` run. An iterator that may end and
    go on again: :func:`run_jobs` asks it again whenever a job has ended."""

    def __init__(self, launcher: Any, next_overrides: NextOverrides, slots: int) -> None:
        self.launcher, self.next_overrides, self.slots = launcher, next_overrides, slots
        self.running = 0

    def __iter__(self) -> JobFeed:
        return self

    def __next__(self) -> Job:
        item = self.next_overrides() if self.running < self.slots else None
        if item is None:
            raise StopIteration
        num, overrides = item
        (job,) = compose_jobs(self.launcher, [list(overrides)], num)
        self.running += 1
        return job

    def ended(self) -> None:
        self.running -= 1
