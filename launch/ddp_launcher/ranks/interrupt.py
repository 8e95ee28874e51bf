"""Ctrl-C (SIGINT) before a run's own handling of it (the app's, once it trains): however
early, one line and exit status 130, never a traceback. Standard library only (Hydra when
asked), so that an app's entry point installs it first and the window before it is the
interpreter's own start.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

INTERRUPTED_EXIT = 130  # 128 + SIGINT, as a shell reports a Ctrl-C'd command
INTERRUPTED = "interrupted (Ctrl-C): rerun with resume=auto to continue from the last checkpoint"
SWEEP_INTERRUPTED = (
    "interrupted (Ctrl-C): rerun with hydra.launcher.resume=true to continue the sweep"
)
# An app whose config has no `resume` (an evaluation's): nothing to continue
RERUN = "interrupted (Ctrl-C): rerun the same command to run it again"
# A search config is a sweep with or without -m (core/hydra_compat.py adds it)
SEARCH = re.compile(r"^\+{0,2}hparams_search=(?!null$)\S")
RESUMABLE = [True]  # whether the app continues a run with resume=auto (app.py says)

_received: list[int] = []  # this process got a Ctrl-C (through on_sigint)


def on_sigint(signum: int, frame: Any) -> None:
    """Python's own SIGINT handler (KeyboardInterrupt), which also notes that it ran."""
    _received.append(signum)
    raise KeyboardInterrupt


def quiet_dropped_ctrl_c(unraisable: Any) -> None:
    """sys.unraisablehook: a KeyboardInterrupt dropped in a finalizer is not printed (with its
    traceback): stop_if_ctrl_c acts on it. Anything else as Python reports it."""
    if not issubclass(unraisable.exc_type, KeyboardInterrupt):
        sys.__unraisablehook__(unraisable)


def ctrl_c_received() -> bool:
    return bool(_received)


def stop_if_ctrl_c() -> None:
    """A KeyboardInterrupt if a Ctrl-C came that nothing acted on: one raised in a weakref
    callback or a __del__ (importlib's module locks have one) is printed as "Exception ignored"
    and dropped, and the start would go on as if no key had been pressed."""
    if _received:
        raise KeyboardInterrupt


def interrupted() -> SystemExit:
    """The exit of a Ctrl-C'd start: rank 0 says so in one line (a run that trained recorded
    itself `interrupted` first, the app's doing)."""
    if int(os.environ.get("RANK", "0")) == 0:
        args = sys.argv[1:]
        sweep = {"-m", "--multirun"} & set(args) or any(SEARCH.match(a) for a in args)
        line = INTERRUPTED if RESUMABLE[0] else RERUN
        print(SWEEP_INTERRUPTED if sweep else line, file=sys.stderr, flush=True)
    return SystemExit(INTERRUPTED_EXIT)


@contextmanager
def ctrl_c_exits() -> Iterator[None]:
    """A Ctrl-C during the block is the one line and exit 130: its KeyboardInterrupt, or an
    error raised in its place while it unwound (OmegaConf's flag contexts, open_dict and
    read_write, restore flags on their way out, and on a node Ctrl-C left half built that
    fails with an error of its own). A launcher's own stop handler (ddp_launcher/jobs.py) and the
    app's (a preemption handler while it trains) replace this one while they run. For a script's
    main block: Ctrl-C is ignored after it."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, on_sigint)
        sys.unraisablehook = quiet_dropped_ctrl_c
    try:
        yield
    except KeyboardInterrupt:
        raise interrupted() from None
    except Exception:
        if ctrl_c_received():
            raise interrupted() from None
        raise
    finally:
        # The start's outcome is decided (its line said, its exit status set): a Ctrl-C in the
        # interpreter's exit from here on would replace it with a KeyboardInterrupt (exit -2).
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.SIG_IGN)


def hydra_keeps_ctrl_c() -> None:
    """After a Ctrl-C, the error Hydra's run_and_report would print (its message or a
    traceback, then exit 1) propagates as a KeyboardInterrupt instead, for ctrl_c_exits; an
    error of ours (one with an `exit_code`: a UserError, a stopped sweep) is its one line and
    its exit status, without the "Set the environment variable HYDRA_FULL_ERROR=1" line Hydra
    prints after every error and its exit status 1. Hydra runs its composition, the job and
    the sweep through run_and_report and has no hook around it: it is wrapped, once."""
    import hydra._internal.utils as hydra_utils

    report = hydra_utils.run_and_report
    if getattr(report, "keeps_ctrl_c", False):
        return

    def run_and_report(func: Any) -> Any:
        def run() -> Any:
            try:
                stop_if_ctrl_c()  # (one dropped in the imports before)
                return func()
            except Exception as e:
                if ctrl_c_received():
                    raise KeyboardInterrupt from None
                if os.environ.get("HYDRA_FULL_ERROR") == "1":
                    raise
                ours = our_error(e)
                if ours is None:
                    from ddp_launcher.core.errors import UserError, config_error_line

                    line = config_error_line(e)  # a config that does not compose
                    if line is None:
                        raise
                    print(line, file=sys.stderr, flush=True)
                    raise SystemExit(UserError.exit_code) from None
                print(" ".join(str(ours).split()), file=sys.stderr, flush=True)
                raise SystemExit(ours.exit_code) from None

        return report(run)

    run_and_report.keeps_ctrl_c = True  # type: ignore[attr-defined]
    hydra_utils.run_and_report = run_and_report


def our_error(error: BaseException) -> BaseException | None:
    """The error of ours behind `error` (one that carries its `exit_code`: ddp_launcher's
    UserError, SweepStopped, ...; a full disk, wherever it was hit), looked for through its
    causes (Hydra's instantiate wraps what a plugin's constructor raises); None: Hydra's own,
    or an unexpected one."""
    from ddp_launcher.core.errors import find_cause  # (imports Hydra: only once one is raised)

    return find_cause(error, lambda e: isinstance(getattr(e, "exit_code", None), int))


@contextmanager
def sigint_held() -> Iterator[None]:
    """SIGINT during the block takes effect when it ends (raised again there, to the handler
    that was in place). For code that cannot be interrupted safely: an interrupt raised in
    Python code that C++ called during `import torch` reaches pybind11, which cannot pass it
    on and aborts the process (std::terminate, exit -6, its own lines). An ignored SIGINT
    stays ignored; outside the main thread (where no handler can be set) the block runs as
    it is."""
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or previous in (
        signal.SIG_IGN,
        None,
    ):
        yield
        return
    pending: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: pending.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if pending:
        signal.raise_signal(signal.SIGINT)
