"""How a rank starts: the one bootstrap for the ranks a launcher starts, and the entry point of
a script whose ranks something else starts (plain `torchrun train.py`, `srun python train.py`).

* **Ranks a launcher started** (:func:`run_rank`): torchrun ranks run `python -m
  launch.ranks.bootstrap <job dir>/.torchrun/job.pkl` (launch/torchrun.py writes the pickled
  JobSpec: task function, composed config, Hydra's singleton state), SLURM tasks call it from
  slurm_task.py. Rank 0 runs the job as the Hydra job (job dir, `.hydra/`, log, callbacks); the
  other ranks run it with `hydra.output_subdir=null`, errors-only logging and no callbacks, so
  they write nothing.
  A failure is reported here, once: one line (a traceback only for an error that is not the
  user's), the error left in torchrun's error file for the launcher, and the exit status
  UserError.exit_code (2) or 1. Torchrun's rank 0 also writes its JobReturn (result.pkl) and a
  record of the run (job.json: pid, rendezvous address, times). A rank of the torchrun launcher
  dies with its agent (:func:`die_with_parent`), as the agent does with the launcher: nothing of
  a sweep outlives a SIGKILLed launcher.
* **The entry point** (:func:`entry_point`, `entry_point(main)` under a script's
  `if __name__ == "__main__":`): every rank of a plain torchrun run agrees on one start instant,
  so `${now:}` names one run dir, and ranks other than 0 write nothing (:func:`prepare_argv`).
  Hydra reports a task's error itself (a user error as its message alone) and exits 1; a user
  error's exit status becomes UserError.exit_code.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import logging
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from hydra.errors import CompactHydraException

from core.errors import UserError, describe, find_user_error, job_value
from core.hydra_compat import (
    EXECUTION_WHITELIST,
    VERSION_BASE,
    hydra_context,
    search_as_multirun,
)
from core.run_dir import process_start_time
from launch.ranks.handoff import JOB_JSON, RESULT_PKL, JobRecord, write_job_return

log = logging.getLogger(
    "launch.ranks.bootstrap"
)  # also when run as `python -m launch.ranks.bootstrap`

# Set by the torchrun launcher for its agents, and by each agent for its ranks: the pid of the
# parent the process must die with (:func:`die_with_parent`).
PARENT_PID_ENV = "HYDRA_DDP_PARENT_PID"
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

# What ranks other than 0 change in their config: no `.hydra/` output, errors-only logging.
OTHER_RANKS_LOGGING = (
    Path(__file__).resolve().parents[2] / "conf/hydra/job_logging/other_ranks.yaml"
)
OTHER_RANK_OVERRIDES = ("hydra.output_subdir=null", f"hydra/job_logging={OTHER_RANKS_LOGGING.stem}")


# ---------------------------------------------------------------------------------------------
# the entry point of a script whose ranks something else starts

INFO_FLAGS = {
    "--help",
    "-h",
    "--hydra-help",
    "--version",
    "--cfg",
    "-c",
    "--info",
    "-i",
    "--shell-completion",
    "-sc",
    "--resolve",
    "-p",
    "--package",
}
MULTIRUN_FLAGS = {"-m", "--multirun"}
HELP_FLAGS = {"--help", "-h"}
START_TIME_KEY = "hydra_ddp/start_time"


def entry_point(
    script: str, task: str, config_name: str, hand_off: Callable[[str, Any], Any] | None = None
) -> None:
    """Run a script (train.py, eval.py) as this process's program: Hydra composes
    `conf/<config_name>.yaml` from the command line, then runs the task function `task`
    ("module:function") as its job (see the module docstring).

    The script calls this at its very top, before its own imports: Hydra answers `--help`,
    `--cfg` and a config that does not compose in a fraction of a second, and torch is
    imported (with the script, as a module) only when a job runs. A launcher pickles the task
    function by reference (`run_task` and the name), so its ranks import the script the same way.

    Hydra's run_and_report prints a task's error and calls sys.exit(1) inside its except block,
    so the SystemExit's __context__ is the error: a user error exits with its own status."""
    import hydra

    sys.argv = prepare_argv(search_as_multirun(sys.argv))
    conf = Path(script).resolve().parent / "conf"
    if HELP_FLAGS & set(sys.argv[1:]):
        print_help(conf, config_name, [a for a in sys.argv[1:] if not a.startswith("-")])
        raise SystemExit(0)
    # `hand_off(task, cfg)` decides where the task runs (launch/torchrun.py's run_task_or_hand_off:
    # here, or in the N ranks it starts) before anything imports the task's module.
    task_function = functools.partial(hand_off or run_task, task)
    # Hydra reads the config path and the job's name from the task function's module; the job
    # name is set in the config (hydra.job.name), the config path is the script's conf/.
    task_function.__module__ = __name__
    main = hydra.main(
        config_path=str(conf), config_name=config_name, **VERSION_BASE, **EXECUTION_WHITELIST
    )
    try:
        main(task_function)()
    except SystemExit as e:
        user_error = find_user_error(e.__context__) if e.code == 1 else None
        if user_error is not None:
            raise SystemExit(user_error.exit_code) from None
        raise
    except KeyboardInterrupt:  # Ctrl-C: the run recorded itself as interrupted
        if int(os.environ.get("RANK", "0")) == 0:
            print(
                "interrupted (Ctrl-C): rerun with resume=auto to continue from the last checkpoint",
                file=sys.stderr,
            )
        raise SystemExit(130) from None  # 128 + SIGINT, as a shell reports it
    raise SystemExit(0)


def print_help(conf: Path, config_name: str, overrides: list[str]) -> None:
    """`--help`: the app's help template (conf/hydra/help/) with its user-facing config groups
    (conf/'s folders, not Hydra's nor the typed schemas') and the composed config.

    Hydra's own --help lists groups by asking its config repository once per group, deep-copying
    the whole repository each time: seconds here. `--hydra-help` is still Hydra's."""
    import string

    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf, open_dict

    with initialize_config_dir(config_dir=str(conf), **VERSION_BASE):
        cfg = compose(config_name, overrides=overrides, return_hydra_config=True)
    template = cfg.hydra.help.template
    with open_dict(cfg):
        del cfg["hydra"]
    groups = sorted(
        f"{folder.relative_to(conf)}: {', '.join(sorted(p.stem for p in folder.glob('*.yaml')))}"
        for folder in conf.rglob("*")
        if folder.is_dir()
        and folder.name != "hydra"
        and "hydra" not in folder.parts
        and any(folder.glob("*.yaml"))
    )
    print(
        string.Template(template).safe_substitute(
            APP_CONFIG_GROUPS="\n".join(groups),
            CONFIG=OmegaConf.to_yaml(cfg),
            FLAGS_HELP="",
            HYDRA_CONFIG_GROUPS="",
        )
    )


def run_task(task: str, cfg: Any) -> Any:
    """Import the task's module ("module:function") and run the function on the job's config.
    The process that trains starts the W&B service first: it starts while torch imports."""
    import importlib

    if int(os.environ.get("RANK", "0")) == 0:
        from core.wandb_service import start_wandb_service, wandb_wanted

        if wandb_wanted(cfg):
            start_wandb_service(background=True)
    module, _, name = task.partition(":")
    function = getattr(importlib.import_module(module), name)
    # What is imported lives as long as the process: out of the garbage collector's sight,
    # its full collections no longer walk torch's ~360k objects (0.17 s each, here).
    gc.freeze()
    return function(cfg)


def prepare_argv(argv: list[str]) -> list[str]:
    """The command line each rank of a plain torchrun (or srun) run hands to Hydra.

    Every rank runs Hydra, which resolves `${now:}` per process: ranks that start in different
    seconds would land in different directories (hydra #2070), and every rank would write
    `.hydra/` and a log. So the ranks agree on one start instant through torchrun's store and
    pin Hydra's `now` to it, and ranks other than 0 write nothing."""
    if "RANK" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return argv
    if MULTIRUN_FLAGS & set(argv):
        print(
            "error: -m/--multirun under torchrun would start a sweep in every rank: run "
            "`python train.py -m ...` instead (each sweep job is started with torchrun)",
            file=sys.stderr,
        )
        raise SystemExit(UserError.exit_code)
    if INFO_FLAGS & set(argv):
        return argv
    pin_now(agreed_start_time())
    if int(os.environ["RANK"]) != 0:
        argv = [*argv, *OTHER_RANK_OVERRIDES]
    return argv


def pin_now(timestamp: float) -> None:
    """Make Hydra's `${now:...}` resolve to `timestamp` in this process.

    Hydra registers `now` as `lambda p: datetime.now().strftime(p)` over the `datetime` name in
    hydra.core.utils, and re-registers it at every start, so we swap that name for a datetime
    whose now() is the run's agreed start instant.
    """
    import hydra.core.utils

    fixed = datetime.fromtimestamp(timestamp)

    class _RunStart(datetime):
        @classmethod
        def now(cls, tz=None):  # noqa: ARG003 - same signature as datetime.now
            return fixed

    hydra.core.utils.datetime = _RunStart


def agreed_start_time() -> float:
    """The start instant of this run, the same in every rank, on every node, after restarts."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        import torch.distributed as dist

        # The elastic agent hosts a TCPStore at MASTER_ADDR:MASTER_PORT for its workers; the
        # first rank 0 of the run publishes its start time and restarted workers reuse it.
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=timedelta(seconds=120),
        )
        key = f"{START_TIME_KEY}/{os.environ.get('TORCHELASTIC_RUN_ID', 'none')}"
        if int(os.environ["RANK"]) == 0:
            value = store.compare_set(key, "", repr(time.time()))
        else:
            value = store.get(key)
        return float(value.decode() if isinstance(value, bytes) else value)
    # Without an agent store (srun, hand-set env://) the ranks of one node share a parent
    # process (srun's step daemon): its start time is common to them.
    return process_start_time(os.getppid())


# ---------------------------------------------------------------------------------------------
# the rank bootstrap


def die_with_parent(environ=os.environ) -> bool:
    """Have the kernel SIGKILL this process when its parent ends, however the parent ends
    (SIGKILL included): Linux's parent-death signal, prctl(PR_SET_PDEATHSIG). Only in a process
    whose starter named itself in PARENT_PID_ENV (the torchrun launcher's agents and their
    ranks; a SLURM task belongs to SLURM, not to the launcher). A parent that ended before the
    prctl call sends nothing: then this process ends itself. Returns whether it is set."""
    parent = environ.get(PARENT_PID_ENV)
    if not parent or not sys.platform.startswith("linux"):
        return False
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        return False
    if os.getppid() != int(parent):  # reparented: the parent is gone already
        os.kill(os.getpid(), signal.SIGKILL)
    return True


def run_rank(spec: Any, rank: int) -> Any:
    """Run one rank of a job (a launch.ranks.job_spec.JobSpec); return its JobReturn. A failure is
    reported here (:func:`report_failure`); a SystemExit of the task (75: requeue me) passes."""
    # Hydra's only way to an empty callback list for HydraContext (no public constructor).
    from hydra._internal.callbacks import Callbacks
    from hydra.core.singleton import Singleton
    from hydra.core.utils import JobStatus, run_job
    from omegaconf import OmegaConf, open_dict, read_write

    Singleton.set_state(spec.singleton_state)
    config, context = spec.config, spec.hydra_context
    with read_write(config.hydra), open_dict(config):
        if context is None:  # `python train.py dist.nproc_per_node=N`: that process is the
            config.hydra.output_subdir = None  # Hydra job: it wrote .hydra/, ran the callbacks
        if rank != 0:
            config.hydra.output_subdir = None
            config.hydra.job_logging = OmegaConf.load(OTHER_RANKS_LOGGING)
    if context is None or rank != 0:
        loader = context.config_loader if context is not None else None
        context = hydra_context(config_loader=loader, callbacks=Callbacks())
    ret = run_job(
        hydra_context=context,
        config=config,
        task_function=exits_as_errors(spec.task_function),
        job_dir_key=spec.job_dir_key,
        job_subdir_key=spec.job_subdir_key,
    )
    if ret.status == JobStatus.FAILED:
        report_failure(job_value(ret))
    return ret


def report_failure(error: BaseException) -> int:
    """Say once why this rank failed: one line for a user error (or another error Hydra prints
    alone: a CompactHydraException), else a traceback; leave it in torchrun's error file too.
    Returns the rank's exit status."""
    record_rank_error(error)
    if find_user_error(error) is not None or isinstance(error, CompactHydraException):
        log.error("%s", describe(error))  # the user's to fix: one line, no traceback
    else:
        log.error("job failed", exc_info=error)
    return exit_status(error)


def exit_status(error: BaseException | None) -> int:
    """A failed rank's exit status: a user error's own (UserError.exit_code: 2), else 1."""
    user_error = find_user_error(error)
    return user_error.exit_code if user_error is not None else 1


def record_rank_error(error: BaseException) -> None:
    """Leave this rank's error where torchrun looks for it (TORCHELASTIC_ERROR_FILE, in the
    format of torch's ErrorHandler): the launcher's failure report then names it."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {
        "message": {
            "message": describe(error),
            "extraInfo": {
                "py_callstack": "".join(traceback.format_exception(error)),
                "timestamp": str(int(time.time())),
            },
        }
    }
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data))
    except OSError:
        pass


class TaskExit(UserError):
    """A task function ended itself with sys.exit(n), n not 0 and not 75 (requeue me): it has
    said what went wrong, so the job fails with that one line and the rank exits with n
    (sys.exit("message"): a user error's 2)."""

    def __init__(self, message: str, exit_code: int = UserError.exit_code) -> None:
        super().__init__(message)
        self.exit_code = exit_code

    def __reduce__(self):  # it travels in result.pkl and submitit's result
        return type(self), (str(self), self.exit_code)


def exits_as_errors(task_function: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """Hydra's run_job records a task's exceptions in its JobReturn, but SystemExit passes
    through it (no JobReturn, no on_job_end callbacks): make a failing exit an exception. The
    preemption exit (75, "requeue me") stays an exit: the task ends without a result."""
    from core.run_dir import REQUEUE_EXIT_CODE

    @functools.wraps(task_function)
    def task(cfg):
        try:
            return task_function(cfg)
        except SystemExit as e:
            if e.code in (0, None):
                return None
            if e.code == REQUEUE_EXIT_CODE:
                raise
            if isinstance(e.code, int):
                raise TaskExit(f"the task exited with code {e.code}", e.code) from e
            raise TaskExit(str(e.code)) from e

    return task


def start_like_a_new_process() -> None:
    """A rank forked from the warm interpreter (launch/ranks/warm.py) starts from state a new
    interpreter would have: unbuffered-like output (torchrun runs `python -u`), the thread
    count the launcher chose (OMP_NUM_THREADS is read when OpenMP loads: before this job's
    environment existed), and numpy's global generator from fresh entropy (`random` reseeds
    itself after a fork; torch's generator is seeded by the task), and Python's own signal
    handlers, not the agent's (its SIGTERM handler would turn the agent's stop into an error
    of this rank's task)."""
    for sig in signal.valid_signals() - {signal.SIGKILL, signal.SIGSTOP}:
        with contextlib.suppress(OSError, ValueError):
            signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGPIPE, signal.SIGXFSZ):
        signal.signal(sig, signal.SIG_IGN)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, ValueError):
            stream.reconfigure(line_buffering=True)
    threads = os.environ.get("OMP_NUM_THREADS", "")
    torch = sys.modules.get("torch")
    if torch is not None and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def main(payload: Path) -> int:
    """One torchrun rank of a job the torchrun launcher started."""
    import cloudpickle

    start_like_a_new_process()

    with open(payload, "rb") as f:
        spec = cloudpickle.load(f)
    rank = int(os.environ["RANK"])
    record = JobRecord(payload.parent / JOB_JSON) if rank == 0 else None
    ret = run_rank(spec, rank)
    if record is not None:
        write_job_return(ret, payload.parent / RESULT_PKL)
        record.finish(ret.status.name.lower())
    return 0 if ret.status.name == "COMPLETED" else exit_status(job_value(ret))


if __name__ == "__main__":
    die_with_parent()
    try:
        code = main(Path(sys.argv[1]))
    except Exception as e:  # noqa: BLE001 - e.g. the job cannot be unpickled: an import fails
        code = report_failure(e)
    sys.exit(code)
