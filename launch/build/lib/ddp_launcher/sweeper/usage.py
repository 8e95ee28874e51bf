"""Slot utilisation of a sweep: busy slot-seconds / (slots x the sweep's wall time). A slot is
busy from an attempt's start to its end in the job's launch.json, whichever launcher ran it (so
batches and streams compare); attempts of earlier runs of a resumed sweep do not count.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path

from ddp_launcher.resume import read_launch_record


class SlotUsage:
    def __init__(self, slots: int, started: float | None = None) -> None:
        self.slots = slots
        self.started = time.time() if started is None else started
        self.ended: float | None = None
        self.busy_s = 0.0

    def measure(self, job_dirs: Iterable[Path], now: float | None = None) -> float:
        """Add up the busy time of this run's attempts in `job_dirs`; the utilisation."""
        self.ended = time.time() if now is None else now
        self.busy_s = 0.0
        for job_dir in job_dirs:
            record = read_launch_record(job_dir)
            for attempt in record.attempts if record is not None else ():
                if attempt.started < self.started:
                    continue  # an earlier run of a resumed sweep
                ended = attempt.ended if attempt.ended is not None else self.ended
                self.busy_s += max(0.0, min(ended, self.ended) - attempt.started)
        return self.utilisation

    @property
    def wall_s(self) -> float:
        return max((self.ended or time.time()) - self.started, 1e-9)

    @property
    def utilisation(self) -> float:
        return self.busy_s / (self.slots * self.wall_s)

    def line(self) -> str:
        if self.busy_s == 0:
            return "no trial ran: no slot utilisation"
        return (
            f"slot utilisation {self.utilisation:.0%} ({self.busy_s:.0f} busy slot-s / "
            f"{self.slots} slot(s) x {self.wall_s:.0f} s)"
        )
