"""What rank 0 prints while a run goes: its progress within an epoch (a bar on a terminal, a
plain line every `trainer.progress_every_s` seconds otherwise, e.g. in SLURM logs), one line per
epoch, and one line when the run ends (status, best monitored metric and its epoch, run dir,
best checkpoint, where the W&B run is). Other ranks print nothing here.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Any

from ddp_launcher import RunResult
from tqdm import tqdm

log = logging.getLogger("train")  # the run's own lines: train.log and the console


def duration(seconds: float) -> str:
    """1.2 s, 3 min 04 s, 2 h 05 min."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


class Console:
    """Rank 0's progress display of the train loop (nothing on other ranks)."""

    def __init__(self, enabled: bool, *, bar: bool, every_s: float, max_epochs: int):
        self.enabled = enabled
        self.tty = bar and sys.stdout.isatty()
        self.every_s = every_s
        self.max_epochs = max_epochs
        self.bar: tqdm | None = None
        self.row: dict[str, Any] = {}  # the last train row logged: its loss and speed
        self.steps = self.done = 0
        self.epoch = 0
        self.last_print = self.epoch_start = time.monotonic()

    def start_epoch(self, epoch: int, steps: int, done: int) -> None:
        """Epoch `epoch` (1-based) of `steps` optimizer steps, `done` of them already (resume)."""
        self.epoch, self.steps, self.done = epoch, steps, done
        self.epoch_start = self.last_print = time.monotonic()
        if self.enabled and self.tty:
            self.bar = tqdm(
                total=steps,
                initial=done,
                desc=f"epoch {epoch}/{self.max_epochs}",
                leave=False,
                dynamic_ncols=True,
            )

    def step(self, row: dict[str, Any] | None = None) -> None:
        """One step done; `row`: the train row logged at this step, if any."""
        self.done += 1
        if row is not None:
            self.row = row
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(1)
            if row is not None:
                self.bar.set_postfix_str(self._speed(), refresh=False)
        elif time.monotonic() - self.last_print >= self.every_s:
            self.last_print = time.monotonic()
            elapsed = self.last_print - self.epoch_start
            left = elapsed / max(self.done, 1) * (self.steps - self.done)
            log.info(
                "epoch %d/%d: step %d/%d%s, epoch ends in %s",
                self.epoch,
                self.max_epochs,
                self.done,
                self.steps,
                f", {self._speed()}" if self.row else "",
                duration(left),
            )

    def _speed(self) -> str:
        return f"train/loss {self.row['train/loss']:.4g}, {self.row['samples_per_s']:.0f} samples/s"

    def end_epoch(
        self, val: dict[str, Any], *, monitor: str, best: float | None, best_epoch: int | None
    ) -> None:
        """The epoch's one line: its last train loss, val metrics, the best so far, its time."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if not self.enabled:
            return
        train = f"train/loss {self.row['train/loss']:.4f}, " if self.row else ""
        best_text = f", best {monitor} {best:.4f} (epoch {best_epoch})" if best is not None else ""
        log.info(
            "epoch %d/%d: %sval/loss %.4f, val/acc %.4f%s, %s",
            self.epoch,
            self.max_epochs,
            train,
            val["val/loss"],
            val["val/acc"],
            best_text,
            duration(time.monotonic() - self.epoch_start),
        )


def end_line(result: RunResult, run_dir: Path, wandb_where: str | None) -> str:
    """The run's last line: how it ended, what it reached (result.json's value, and the test
    score and best.pt of its app part), and where everything is."""
    parts = [f"{result.status} in {duration(result.wall_time_s or 0.0)}"]
    if result.value is not None:
        parts.append(f"best {result.metric} {result.value:.4f} (epoch {result.value_epoch})")
    test, best_checkpoint = result.app.get("test") or {}, result.app.get("best_checkpoint")
    if test.get("test/acc") is not None:
        parts.append(f"test/acc {test['test/acc']:.4f}")
    parts.append(f"run dir {run_dir}")
    if best_checkpoint:
        parts.append(f"best checkpoint {run_dir / best_checkpoint}")
    if wandb_where:
        parts.append(wandb_where)
    if result.git_dirty:
        parts.append("started from a dirty git tree (diff in repro/)")
    if result.status in ("preempted", "interrupted"):
        parts.append("continue with resume=auto and the same hydra.run.dir")
    return " | ".join(parts)
