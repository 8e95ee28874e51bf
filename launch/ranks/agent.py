"""The torchrun agent of one job, in its own process: `python -m launch.ranks.agent FAILURES_JSON
<torchrun args>` (launch/torchrun.py starts it). It runs torch's elastic agent
(torch.distributed.run), which starts, supervises and restarts the ranks (we write no process
manager); when ranks fail, which ones and how (exit code, signal, error) is written to
FAILURES_JSON for the launcher rather than only printed. The agent dies with the launcher, and
its ranks with it (launch/ranks/bootstrap.py's :func:`die_with_parent`)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from launch.ranks.bootstrap import PARENT_PID_ENV, die_with_parent
from launch.ranks.handoff import describe_failure, write_failures


def agent_main(argv: list[str]) -> int:
    """Run torchrun (torch.distributed.run) with the given arguments. When ranks
    fail, write who failed and how to FAILURES_JSON, earliest first, and print one line per
    failed rank instead of torchrun's 40-line traceback; the ranks' own errors are above it.
    The agent dies with the launcher, and its ranks with it (:func:`die_with_parent`)."""
    die_with_parent()
    os.environ[PARENT_PID_ENV] = str(os.getpid())  # what each rank checks (torchrun copies env)
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    cheap_rendezvous_event_names()
    failures_path, args = Path(argv[0]), argv[1:]
    try:
        run(parse_args(args))  # torchrun's main() minus @record, which would only log noise
    except SignalException as e:  # torchrun has stopped the ranks (SIGTERM, then SIGKILL)
        print(f"torchrun: stopped by {e.sigval.name}", file=sys.stderr, flush=True)
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        # In the order torch observed them (ranks it stopped itself come last); the earliest
        # first, as torch picks its root cause (timestamps have 1 s resolution: ties keep order).
        failures = sorted(
            (rank_failure(rank, failure) for rank, failure in e.failures.items()),
            key=lambda f: f["timestamp"],
        )
        write_failures(failures, failures_path)
        for i, failure in enumerate(failures):
            what = "first failure" if i == 0 else "then"
            print(f"torchrun: {what}: {describe_failure(failure)}", file=sys.stderr, flush=True)
        return 1
    return 0


def cheap_rendezvous_event_names() -> None:
    """torch's rendezvous names each event it records after the method that records it,
    calling inspect.stack() twice for it (dynamic_rendezvous.get_method_name): that reads
    every frame's source file and, with torch imported, searches thousands of modules for
    each frame, 0.5 s of every job's rendezvous (measured with py-spy). The same name, read
    from the frame itself."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    def get_method_name(depth: int = 2) -> str:
        try:
            return sys._getframe(depth).f_code.co_name
        except ValueError:  # fewer frames than that: torch's own answer then
            return "no_method_name"

    dynamic_rendezvous.get_method_name = get_method_name


def rank_failure(rank: int, failure: Any) -> dict:
    """A JSON view of torch's ProcessFailure; `error` only when the rank recorded one."""
    message = failure.message
    if isinstance(message, dict):  # torch's ErrorHandler format: {"message": ..., "extraInfo"}
        message = message.get("message")
    has_error_file = bool(failure.error_file) and os.path.isfile(failure.error_file)
    return {
        "rank": rank,
        "local_rank": failure.local_rank,
        "pid": failure.pid,
        "exitcode": failure.exitcode,
        "signal": failure.signal_name() if failure.exitcode < 0 else None,
        "error": str(message) if has_error_file and message else None,
        "timestamp": failure.timestamp,
    }


if __name__ == "__main__":
    sys.exit(agent_main(sys.argv[1:]))
