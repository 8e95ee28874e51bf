"""A dataset target that records how the rank building it started: `dataset._target_=
tests.gpu_probe.digits`, with GPU_PROBE_LOG naming a file. Every rank builds its dataset, so each
rank of each way a run starts appends one JSON line there: whether torch marks it a CUDA "bad
fork" (forked after its parent called into the CUDA driver: on a GPU its first CUDA call would
raise "Cannot re-initialize CUDA in forked subprocess"; torch sets the flag on a CPU machine
too), whether its torch._C has the flag's probe (a CPU-only build has none:
tests/cpu_only_torch/ fakes one), and the CPU share it was given (its cores, its OpenMP threads,
its DataLoader workers).
Then it builds scikit-learn's digits, as `dataset=digits` does."""

from __future__ import annotations

import json
import os

LOG_ENV = "GPU_PROBE_LOG"


def digits(**kwargs):
    import torch
    from ddp_launcher.core.run_dir import ATTEMPT_ENV

    from data.catalog import digits as build
    from data.loaders import data_workers

    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    record = {
        "rank": int(os.environ.get("RANK", "0")),
        "pid": os.getpid(),
        "bad_fork": torch.cuda._is_in_bad_fork(),  # torch's reading: CPU-only builds too
        "probe_compiled": hasattr(torch._C, "_cuda_isInBadFork"),
        "attempt": os.environ.get(ATTEMPT_ENV),
        "job": os.getcwd(),
        "cores": sorted(os.sched_getaffinity(0)),
        "threads": torch.get_num_threads(),
        "workers": data_workers(kwargs.get("num_workers", "auto"), local_world),
    }
    with open(os.environ[LOG_ENV], "a") as f:  # one short line: an atomic append
        f.write(json.dumps(record) + "\n")
    return build(**kwargs)
