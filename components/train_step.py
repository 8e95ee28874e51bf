"""One optimizer step, its metrics row, and where training stands (Progress): what train.py's
loop calls once per step.

TrainStep runs `accumulate_grad_batches` micro-batches through the DDP model (MixUp/CutMix
where asked, autocast, loss, backward), then clips, steps the optimizer and the schedule, and
folds the weights into the EMA. train_row turns the loss window into metrics.jsonl's row.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from ddp_launcher import UserError
from omegaconf import DictConfig

from components.distributed import DistEnv
from components.loss_window import LossWindow
from components.precision import as_model_input, memory_format, precision_context
from components.speed import Speed
from data.mixing import BatchMix


@dataclass
class Progress:
    """Where training stands (saved in every checkpoint, with the W&B run that records it)."""

    epoch: int = 0  # the epoch in progress (or the next one to run)
    step: int = 0  # optimizer steps so far
    step_in_epoch: int = 0  # batches of `epoch` already trained: the sampler's position
    skipped_steps: int = 0  # non-finite updates skipped (trainer.nonfinite=skip)
    max_epochs: int | None = None  # what the run planned (its lr schedule's length)
    wandb_run_id: str | None = None
    wandb_group: str | None = None  # eval.py puts its W&B run in this group
    wandb_name: str | None = None
    first_train_loss: float | None = None  # the first logged window's (components/divergence.py)
    diverged_step: int | None = None  # where the run warned that it diverges (once per run)

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        known = self.state_dict()  # an older checkpoint's other keys (best_val_acc) are dropped
        for key, value in state.items():
            if key in known:
                setattr(self, key, value)


class TrainStep:
    """One optimizer step: `accumulate_grad_batches` micro-batches (each mixed by `mix` where
    trainer.mixup asks), of which DDP all-reduces the gradients during the last one's backward
    only (no_sync before); then clip, update, advance the schedule and fold the weights into
    the EMA. `grad_norm`: the step's gradient norm (computed on log steps and when clipping)."""

    def __init__(
        self,
        ddp_model,
        model,
        optimizer,
        scheduler,
        scaler,
        env: DistEnv,
        tc: DictConfig,
        mix: BatchMix,
        ema=None,
    ):
        self.model, self.plain_model = ddp_model, model
        self.optimizer, self.scheduler, self.scaler = optimizer, scheduler, scaler
        self.env, self.tc, self.mix, self.ema = env, tc, mix, ema
        self.autocast = precision_context(tc.precision, env.device)
        self.grad_norm: torch.Tensor | None = None

    def __call__(self, batches, progress: Progress, speed: Speed, *, logged: bool):
        """The step's (mean loss, correct predictions, samples) on the device (correct None
        with soft, mixed labels), or None when trainer.nonfinite=skip skipped it. `logged`:
        a train row follows this step (its gradient norm is measured)."""
        env, tc, device = self.env, self.tc, self.env.device
        accumulate = tc.accumulate_grad_batches
        self.optimizer.zero_grad(set_to_none=True)
        step_loss = torch.zeros((), device=device)
        correct = None if self.mix.enabled else torch.zeros((), device=device)
        samples = 0
        for micro in range(accumulate):
            with speed.timer.waiting_for_data():
                x, y = next(batches)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            x = as_model_input(x, self.plain_model)
            # MixUp/CutMix seeded by (seed, epoch, global batch index): the same on resume
            # and at any world size.
            x, y = self.mix(x, y, progress.epoch, progress.step_in_epoch * accumulate + micro)
            x = x.contiguous(memory_format=memory_format(tc))
            last = micro == accumulate - 1
            with nullcontext() if last or not env.is_distributed else self.model.no_sync():
                with self.autocast:
                    logits = self.model(x)
                    loss = F.cross_entropy(logits, y, label_smoothing=tc.label_smoothing)
                # On CPU this check is free; on GPU it waits for the log step (no host sync).
                if tc.nonfinite == "error" and device.type == "cpu" and not torch.isfinite(loss):
                    raise non_finite(loss.item(), progress.step + 1, progress.epoch, env.rank)
                self.scaler.scale(loss / accumulate).backward()
            step_loss += loss.detach() / accumulate
            if correct is not None:
                correct += (logits.detach().argmax(1) == y).sum()
                samples += len(y)
        updated = self.optimizer_step(log_step=logged)
        self.scheduler.step()
        if not updated:
            return None
        if self.ema is not None:
            self.ema.maybe_update(self.plain_model, progress.step + 1)
        return step_loss, correct, samples

    def optimizer_step(self, log_step: bool) -> bool:
        """Unscale (fp16), clip, step. False when `trainer.nonfinite=skip` skipped the update:
        the gradients are all-reduced, so every rank sees the same norm and skips the same step."""
        tc, scaler, optimizer = self.tc, self.scaler, self.optimizer
        self.grad_norm = None
        if tc.grad_clip or tc.nonfinite == "skip" or log_step:
            scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
            params = [p for p in self.model.parameters() if p.grad is not None]
            norm = torch.nn.utils.get_total_norm([p.grad for p in params])
            if tc.grad_clip:
                torch.nn.utils.clip_grads_with_norm_(params, tc.grad_clip, norm)
            self.grad_norm = norm
            if tc.nonfinite == "skip" and not torch.isfinite(norm):
                scaler.update()
                return False
        scaler.step(optimizer)
        scaler.update()
        return True


def train_row(
    progress: Progress, window: LossWindow, step: TrainStep, env: DistEnv, tc, speed: Speed
) -> dict:
    """metrics.jsonl's row for the window since the last one (one all-reduce: the mean loss
    and accuracy over ranks; no train/acc when mixup/cutmix make the labels soft)."""
    mean_loss, accuracy = window.mean_over_ranks()
    if tc.nonfinite == "error" and not math.isfinite(mean_loss):
        raise non_finite(mean_loss, progress.step, progress.epoch, env.rank)
    rate, step_ms, wait_pct = speed.window()
    row = {
        "step": progress.step,
        "epoch": progress.epoch + 1,
        "train/loss": mean_loss,
        "lr": step.scheduler.get_last_lr()[0],
        "samples_per_s": rate,
        "step_time_ms": step_ms,
        "data_wait_pct": wait_pct,
        "peak_mem_mb": speed.memory.current(),  # this epoch's training's peak
    }
    if accuracy is not None:
        row["train/acc"] = accuracy
    if step.grad_norm is not None:
        row["grad_norm"] = step.grad_norm.item()  # of the window's last step, before clipping
    if (mfu := speed.mfu(rate, env.world_size)) is not None:
        row["mfu"] = mfu
    if progress.skipped_steps:
        row["train/skipped_steps"] = progress.skipped_steps
    return row


def non_finite(value: float, step: int, epoch: int, rank: int) -> UserError:
    return UserError(
        f"non-finite loss ({value}) at step {step} (epoch {epoch + 1}) on rank {rank}: "
        "lower optim.lr, set trainer.grad_clip, or trainer.nonfinite=skip"
    )
