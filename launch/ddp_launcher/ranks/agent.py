"""The torchrun agent of one job, forked by the warm start's server: it becomes the job's process
(:func:`run_agent`) and runs torch's elastic agent (`elastic_launch`: it starts, supervises and
restarts the ranks, forked from here to run bootstrap.py's rank_main). Which ranks failed and
how goes to the job's failures.json, and one line per rank instead of torch's traceback.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import uuid
from pathlib import Path
from typing import Any

from ddp_launcher.core.run_dir import write_json_atomic
from ddp_launcher.core.wandb_service import SERVICE_ENV
from ddp_launcher.ranks.handoff import describe_failure
from ddp_launcher.ranks.job_spec import AgentSpec
from ddp_launcher.ranks.lifeline import PARENT_PID_ENV, die_with_parent
from ddp_launcher.ranks.warm import refuse_if_unclean


def run_agent(spec: AgentSpec) -> None:
    """In the child the warm start's server forked: become the job's agent, in a session of its
    own (the launcher signals it and its ranks as one group), with the environment, working dir,
    output and CPUs the launcher chose; run it and exit with its status."""
    refuse_if_unclean()
    server = dict(
        os.environ
    )  # the server's: it named itself our parent (ddp_launcher/ranks/warm.py)
    os.setsid()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # (the server's start held it)
    os.environ.clear()
    os.environ.update({**spec.env, PARENT_PID_ENV: server[PARENT_PID_ENV]})
    if SERVICE_ENV in server:
        os.environ.setdefault(SERVICE_ENV, server[SERVICE_ENV])  # the sweep's one W&B service
    die_with_parent(children_too=True)  # with the server, and its ranks with it
    os.chdir(spec.cwd)
    if spec.log:
        fd = os.open(spec.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    if spec.cpus:
        os.sched_setaffinity(0, spec.cpus)  # its ranks and their workers inherit it
    sys.exit(agent_main(spec))


def agent_main(spec: AgentSpec) -> int:
    """Run torch's elastic agent for the job. When ranks fail, write who failed and how to
    failures.json, earliest first, and one line per failed rank to the agent's own log, in
    place of torch's traceback of each (ProcessExitedException, its multiprocessing logger)."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    from ddp_launcher.ranks.bootstrap import rank_main

    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    # ... and its note that it stops the other ranks then ("Terminating process ... via signal")
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    # A stop comes from the launcher, which says why in its own line (a Ctrl-C, fail_fast): not
    # the agent's "Received 15 death signal, shutting down workers" on the run's console too
    logging.getLogger("torch.distributed.elastic.agent.server.api").addFilter(
        lambda record: "death signal" not in record.getMessage()
    )
    cheap_rendezvous_event_names()
    config = launch_config(spec, DefaultLogsSpecs(spec.log_dir, Std.ALL, Std.from_str(spec.tee)))
    try:
        elastic_launch(config, rank_main)(spec.payload)
    except SignalException as e:  # torch has stopped the ranks (SIGTERM, then SIGKILL)
        if spec.log:  # (in agent.log; on a run's console the launcher's line says it)
            print(f"torchrun: stopped by {e.sigval.name}", file=sys.stderr, flush=True)
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        # Earliest first, as torch picks its root cause; own errors before lost peers; ties
        # (torch's timestamps have 1 s resolution) in torch's order (ranks it stopped last).
        failures = [rank_failure(rank, failure) for rank, failure in e.failures.items()]
        failures = sorted(
            failures + other_ranks_errors(e.failures, failures),
            key=lambda f: (f["lost_a_peer"], f["time"] or f["timestamp"]),
        )
        write_json_atomic(Path(spec.failures), failures)
        for i, failure in enumerate(failures if spec.log else ()):
            what = "first failure" if i == 0 else "then"
            print(f"torchrun: {what}: {describe_failure(failure)}", file=sys.stderr, flush=True)
        return 1
    return 0


def launch_config(spec: AgentSpec, logs_specs: Any) -> Any:
    """torch's LaunchConfig for the job, built without a call into the CUDA driver: without
    numa_options, LaunchConfig.__post_init__ asks torch.accelerator for a device (to pick a NUMA
    binding), which makes every rank forked after it a CUDA "bad fork", GPU or not. Any
    numa_options skips the question; ours is then taken back (the launcher chose the CPUs)."""
    from torch.distributed.launcher.api import LaunchConfig
    from torch.numa.binding import AffinityMode, NumaOptions

    config = LaunchConfig(
        min_nodes=spec.nnodes,
        max_nodes=spec.nnodes,
        nproc_per_node=spec.nproc,
        logs_specs=logs_specs,
        run_id=spec.rdzv_id or str(uuid.uuid4()),
        role="default",
        rdzv_endpoint=spec.rdzv_endpoint,
        rdzv_backend=spec.rdzv_backend,
        # torchrun's --node-rank: read by the static rendezvous only (torch.distributed.run)
        rdzv_configs={
            **spec.rdzv_conf,
            **({"rank": spec.node_rank} if spec.rdzv_backend == "static" else {}),
        },
        max_restarts=spec.max_restarts,
        monitor_interval=spec.monitor_interval,
        start_method="fork",  # the ranks are forked from this warm process: nothing to import
        log_line_prefix_template=spec.line_prefix,
        numa_options=NumaOptions(affinity_mode=AffinityMode.NODE),  # skips the device query
    )
    config.numa_options = None
    return config


def cheap_rendezvous_event_names() -> None:
    """torch's rendezvous names each event after the method recording it with inspect.stack()
    (dynamic_rendezvous.get_method_name): it reads every frame's source, searching thousands of
    modules, 0.5 s of every job's rendezvous (py-spy). The same name, read from the frame."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    def get_method_name(depth: int = 2) -> str:
        try:
            return sys._getframe(depth).f_code.co_name
        except ValueError:  # fewer frames than that: torch's own answer then
            return "no_method_name"

    dynamic_rendezvous.get_method_name = get_method_name


def other_ranks_errors(torch_failures: dict, seen: list[dict]) -> list[dict]:
    """The failures torch did not report (it reports the first it notices, often rank 0's lost
    peer, and stops the others), from the error files beside the reported one's
    (<log dir>/<run>/attempt_<n>/<local rank>/error.json: bootstrap.py)."""
    rank, failure = next(iter(torch_failures.items()))
    if not failure.error_file:
        return []
    attempt, found = Path(failure.error_file).parent.parent, []
    known = {f["local_rank"] for f in seen}
    for path in sorted(attempt.glob("*/error.json")):
        local = int(path.parent.name)
        if local in known:
            continue
        try:
            message = json.loads(path.read_text())["message"]
        except (OSError, ValueError, KeyError):
            continue
        info = message.get("extraInfo", {})
        rank_here, stamp = rank - failure.local_rank + local, int(info.get("timestamp", 0))
        found.append(failure_record(rank_here, local, None, info.get("exitcode"), message, stamp))
    return found


def rank_failure(rank: int, f: Any) -> dict:
    """A JSON view of torch's ProcessFailure `f`; `error` only when the rank recorded one."""
    message = f.message if f.error_file and os.path.isfile(f.error_file) else None
    record = failure_record(rank, f.local_rank, f.pid, f.exitcode, message, f.timestamp)
    return record | {"signal": f.signal_name() if f.exitcode < 0 else None}


def failure_record(
    rank: int, local_rank: int, pid: int | None, exitcode: Any, message: Any, timestamp: int
) -> dict:
    """One failed rank in failures.json; `message`: its error file's, in torch's ErrorHandler
    format (ddp_launcher/ranks/bootstrap.py's record_rank_error), or None."""
    info = message.get("extraInfo", {}) if isinstance(message, dict) else {}
    error = message.get("message") if isinstance(message, dict) else message
    return {
        "rank": rank,
        "local_rank": local_rank,
        "pid": pid,
        "exitcode": exitcode,
        "signal": None,
        "error": str(error) if error else None,
        "timestamp": timestamp,
        "time": info.get("time"),
        "lost_a_peer": info.get("lost_a_peer", False),
    }
