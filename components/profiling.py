"""`trainer.profile` (debug=profile): torch.profiler over a window of train steps.

The profiler skips `wait` steps, warms up for `warmup`, records `active` steps, once. Rank 0
writes `profile/trace.json` (a Chrome trace: chrome://tracing or https://ui.perfetto.dev) and
`profile/key_averages.txt` (the operators by self CPU time) into the run dir, and logs both as
a W&B artifact when W&B is on. Other ranks profile too (their steps cost the same) but keep
nothing.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from ddp_launcher import UserError

log = logging.getLogger(__name__)

PROFILE_DIR = "profile"


class StepProfiler:
    """`with StepProfiler(...) as profiler:` around the train loop, `profiler.step()` after each
    optimizer step; a no-op when `cfg` is None."""

    def __init__(self, cfg: Any, run_dir: Path, *, rank0: bool, on_written=None):
        self.cfg, self.dir, self.rank0 = cfg, run_dir / PROFILE_DIR, rank0
        self.on_written = on_written
        self.profiler: Any = nullcontext()
        if cfg is None:
            return
        wait, warmup, active = (int(cfg.wait), int(cfg.warmup), int(cfg.active))
        if wait < 0 or warmup < 0 or active < 1:
            raise UserError(
                f"trainer.profile: wait={wait} warmup={warmup} active={active}: use "
                "wait >= 0, warmup >= 0, active >= 1"
            )
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=wait, warmup=warmup, active=active, repeat=1),
            on_trace_ready=self._write,
            record_shapes=bool(cfg.record_shapes),
            profile_memory=bool(cfg.profile_memory),
        )

    def __enter__(self) -> StepProfiler:
        self.profiler.__enter__()
        return self

    def __exit__(self, *exc) -> bool:
        return bool(self.profiler.__exit__(*exc))

    def step(self) -> None:
        if self.cfg is not None:
            self.profiler.step()

    def _write(self, profiler: Any) -> None:
        if not self.rank0:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        trace, table = self.dir / "trace.json", self.dir / "key_averages.txt"
        profiler.export_chrome_trace(str(trace))
        sort_by = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        table.write_text(profiler.key_averages().table(sort_by=sort_by, row_limit=40) + "\n")
        log.info("profile of %d steps written: %s, %s", int(self.cfg.active), trace, table.name)
        if self.on_written is not None:
            self.on_written([trace, table])
