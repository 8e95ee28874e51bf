"""One output directory per run, shared by every rank, written by rank 0 only.

Under plain `torchrun train.py`, every rank runs Hydra, and Hydra resolves `${now:}` in each
process: ranks that start in different seconds land in different directories (hydra #2070), and
every rank writes `.hydra/` and a log. Before Hydra starts we therefore
  1. agree on one start instant for the whole run through torchrun's own store, and make
     Hydra's `now` resolver return it in every rank (so any `${now:...}` pattern matches), and
  2. tell ranks other than 0 to write nothing: no `.hydra/` subdir, console-only error logging.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import datetime, timedelta

INFO_FLAGS = {
    "--help", "-h", "--hydra-help", "--version", "--cfg", "-c", "--info", "-i",
    "--shell-completion", "-sc", "--resolve", "-p", "--package",
}  # fmt: skip
MULTIRUN_FLAGS = {"-m", "--multirun"}
START_TIME_KEY = "hydra_ddp/start_time"


def prepare_argv(argv: list[str]) -> list[str]:
    """Return the command line each rank hands to Hydra (see the module docstring)."""
    if "RANK" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return argv
    if MULTIRUN_FLAGS & set(argv):
        sys.exit(
            "error: -m/--multirun under torchrun would start a sweep in every rank: run "
            "`python train.py -m ...` instead (each sweep job is started with torchrun)"
        )
    if INFO_FLAGS & set(argv):
        return argv
    pin_now(agreed_start_time())
    if int(os.environ["RANK"]) != 0:
        argv = [*argv, "hydra.output_subdir=null", "hydra/job_logging=other_ranks"]
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
    return parent_start_time()


def parent_start_time() -> float:
    try:
        with open(f"/proc/{os.getppid()}/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return boot + start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, StopIteration):
        return time.time()
