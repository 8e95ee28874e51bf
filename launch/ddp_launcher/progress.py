"""A sweep's progress at a glance (ddp_launcher/lifecycle.py drives it): jobs done, running, failed
and pending, and an ETA from the finished jobs' wall times.

On a terminal it is one live line at the bottom of the console, redrawn in place (a carriage
return and ANSI erase-line, as tqdm draws its bar) and cleared before each log line so the two
never mix; anywhere else (SLURM logs, CI, a pipe) it is a plain log line per change. Torch-free.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import IO, Any

from ddp_launcher.core.naming import fmt_duration

log = logging.getLogger(__name__)

ERASE_LINE = "\r\x1b[K"  # to the line's start, then erase it (ECMA-48 EL)


class SweepProgress:
    """Counts of a sweep's jobs, said on `stream` in place when it is a terminal, else as a log
    line when they change. `total`: the sweep's jobs (None: not known in advance, e.g. Optuna
    trials asked one at a time); `parallel`: jobs that run at once, for the ETA."""

    def __init__(self, total: int | None, parallel: int, stream: IO[str] | None = None) -> None:
        self.total, self.parallel = total, max(1, parallel)
        self.stream = stream if stream is not None else sys.stdout
        self.live = _isatty(self.stream)
        self.done = self.failed = self.running = 0
        self.walls: list[float] = []  # wall times of the jobs that ran to an end in this launch
        self.shown = ""  # the line on the console now ("" none)
        self.said = ""  # the last line said (plain mode)
        self.handlers: list[logging.Handler] = []
        if self.live:  # clear the line before any log line reaches the same terminal
            for handler in logging.getLogger().handlers:
                if getattr(handler, "stream", None) in (self.stream, sys.stdout, sys.stderr):
                    handler.addFilter(self.clear_filter)
                    self.handlers.append(handler)

    def started(self) -> None:
        self.running += 1
        self.update()

    def ended(self, failed: bool, wall_s: float | None = None, ran: bool = True) -> None:
        """A job ended for good (`ran`: it had an attempt running; False: done earlier or it
        never started)."""
        if ran:
            self.running -= 1
        if failed:
            self.failed += 1
        else:
            self.done += 1
        if wall_s is not None and wall_s > 0:
            self.walls.append(wall_s)
        self.update()

    def line(self) -> str:
        parts = [f"{self.done} done", f"{self.running} running", f"{self.failed} failed"]
        if self.total is not None:
            pending = max(0, self.total - self.done - self.failed - self.running)
            parts.append(f"{pending} pending")
            eta = self.eta(pending)
            if eta is not None:
                parts.append(f"ETA {fmt_duration(eta)}")
        return "sweep: " + ", ".join(parts)

    def eta(self, pending: int) -> float | None:
        """The mean wall time of the finished jobs times the rounds of `parallel` jobs left
        (the running ones count as half done). None before a job has finished, or when none
        is left."""
        left = pending + self.running / 2
        if not self.walls or not left:
            return None
        return left / self.parallel * (sum(self.walls) / len(self.walls))

    def update(self) -> None:
        text = self.line()
        if self.live:
            self.draw(text)
        elif text != self.said:
            self.said = text
            log.info("%s", text)

    def draw(self, text: str | None = None) -> None:
        """(Re)draw the live line; called after log lines too (the lifecycle's poll)."""
        text = self.line() if text is None else text
        if not self.live or text == self.shown:
            return
        self.stream.write(ERASE_LINE + text)
        self.stream.flush()
        self.shown = text

    def clear_filter(self, _record: Any) -> bool:
        if self.shown:
            self.stream.write(ERASE_LINE)
            self.stream.flush()
            self.shown = ""
        return True

    def close(self) -> None:
        """Leave the last line on the console, on a line of its own, and stop clearing."""
        for handler in self.handlers:
            handler.removeFilter(self.clear_filter)
        if self.live and self.shown:
            self.stream.write("\n")
            self.stream.flush()
            self.shown = ""


def _isatty(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def wall_time(job: Any) -> float | None:
    return time.time() - job.started if getattr(job, "started", 0) else None
