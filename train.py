"""Train an image classifier with DistributedDataParallel, configured by Hydra.

    python train.py [overrides]                   one process, or dist.nproc_per_node ranks
    torchrun --nproc_per_node=N train.py [...]    N ranks started by torchrun
    python train.py -m key=a,b                    a sweep: every job is a torchrun job

The story, in every rank: join the process group (one device per rank) -> build the data (each
rank reads its own shard) -> build the model, continue from a checkpoint, wrap it in DDP ->
train and validate each epoch -> rank 0 saves checkpoints -> evaluate best.pt on the held-out
test split. Rank 0 writes everything into the run dir; other ranks write nothing. Each helper is
one module away: components/ (services inside a rank), data/, models/, launch/ (how ranks and
sweeps start). eval.py evaluates a checkpoint later with the same pieces.
"""

if __name__ == "__main__":  # `python train.py ...` (also each rank under plain torchrun)
    # Hydra composes conf/train.yaml first: --help, --cfg and config errors come back before
    # the imports below load torch; then it imports this file as `train` and runs main().
    import conf.schema  # noqa: F401 - registers the typed config schema with Hydra
    from launch.rank import entry_point

    entry_point(__file__, task="train:main", config_name="train")

import logging
import math
import os
import sys
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from components import faults
from components.checkpoint import Checkpointer, TrainingState, load_checkpoint
from components.console import Console
from components.distributed import (
    DistEnv,
    broadcast_weights,
    gather_floats,
    init_distributed,
    rank0_decides,
    tighten_timeout,
    wrap_ddp,
)
from components.ema import build_ema
from components.errors import UserError
from components.evaluation import evaluate
from components.metrics import LossWindow, RunLogger, run_facts
from components.monitor import Monitor
from components.optim import build_optimizer, lr_schedule
from components.precision import grad_scaler, memory_format, precision_context
from components.preemption import Preempted, StopRequest, cpu_group, requeue_on_slurm
from components.profiling import StepProfiler
from components.pruning import Pruned, check_prune, pruner_for
from components.speed import Speed, model_facts, peak_memory_mb
from components.wandb_media import ValMedia
from components.world import (
    per_rank_batch,
    rank_world_size,
    requested_world,
    started_as_rank,
    visible_gpus,
)
from data import (
    DataSplits,
    FirstBatches,
    Loaders,
    build_datasets,
    build_loaders,
    limited,
    loader_options,
)
from data.mixing import BatchMix
from data.transforms import build_recipe
from models import build_model

log = logging.getLogger("train")


def main(cfg: DictConfig) -> float | None:
    """Hydra's task function; returns the monitored metric's best value (trainer.monitor: what
    sweepers optimise; never a test metric). A user error propagates to whoever runs the task,
    which reports it once; preemption exits with 75."""
    try:
        if not started_as_rank() and requested_world(cfg.dist, visible_gpus()) != (1, 1):
            from launch.torchrun import run_in_torchrun

            return run_in_torchrun(cfg, train)  # `train` below, in each of the N ranks
        return train(cfg)
    except Pruned as e:  # the sweeper's pruner stopped the trial: a result, not an error
        return e.best
    except Preempted as e:
        log.warning("%s", e)
        if int(os.environ.get("RANK", "0")) == 0:
            requeue_on_slurm()
        sys.exit(e.exit_code)  # 75: "requeue me"


@dataclass
class Progress:
    """Where training stands (saved in every checkpoint, with the W&B run that records it)."""

    epoch: int = 0  # the epoch in progress (or the next one to run)
    step: int = 0  # optimizer steps so far
    step_in_epoch: int = 0  # batches of `epoch` already trained: the sampler's position
    best_val_acc: float = 0.0  # whatever the monitor is (result.json's best_val_acc)
    skipped_steps: int = 0  # non-finite updates skipped (trainer.nonfinite=skip)
    max_epochs: int | None = None  # what the run planned (its lr schedule's length)
    wandb_run_id: str | None = None
    wandb_group: str | None = None  # eval.py puts its W&B run in this group
    wandb_name: str | None = None

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)


def train(cfg: DictConfig) -> float | None:
    """One run, in every rank; returns the monitored metric's best value."""
    tc = cfg.trainer
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    # `run`: rank 0's metrics.jsonl, W&B run and result.json, however the run ends.
    with RunLogger(run_dir, enabled=int(os.environ.get("RANK", "0")) == 0) as run:
        # Settings every rank checks alike before any of them joins the process group.
        micro_batch = per_rank_batch(tc.batch_size, rank_world_size(), tc.accumulate_grad_batches)
        check_trainer(tc)
        # `env`: this rank's place in the process group and its device (GPU LOCAL_RANK, nccl).
        with init_distributed(cfg.dist, tc.device) as env:
            return fit(cfg, run, env, run_dir, micro_batch)


def fit(cfg: DictConfig, run: RunLogger, env: DistEnv, run_dir: Path, micro_batch: int):
    """Data -> model (and resume) -> DDP -> train and validate each epoch -> test best.pt."""
    tc = cfg.trainer
    torch.manual_seed(cfg.seed)

    # Data: a DistributedSampler gives each rank its own shard of every epoch; validation counts
    # every sample exactly once across ranks; test is only touched after training.
    # Augmentation: the `augment` recipe (conf/augment/).
    splits = build_datasets(
        cfg.dataset,
        local_rank=env.local_rank,
        barrier=dist.barrier,
        seed=cfg.seed,
        augment=build_recipe(cfg.augment),
    )
    loaders = build_loaders(
        splits,
        batch_size=micro_batch,
        eval_batch_size=math.ceil(tc.eval_batch_size / env.world_size),
        shuffle=tc.overfit_batches is None,  # overfitting: the same batches every epoch
        **loader_options(
            cfg.dataset, rank=env.rank, world_size=env.world_size, seed=cfg.seed, device=env.device
        ),
    )
    steps_per_epoch = epoch_steps(
        len(loaders.train) // tc.accumulate_grad_batches, tc, len(splits.train)
    )
    val_batches = FirstBatches(
        loaders.val, limited(len(loaders.val), tc.limit_val_batches, "trainer.limit_val_batches")
    )

    # Model, optimizer, schedule, EMA, monitor; everything a resume needs is one TrainingState.
    model = build_model(cfg.model, splits).to(env.device, memory_format=memory_format(tc))
    size = model_facts(
        model,
        torch.zeros(1, splits.in_channels, splits.image_size, splits.image_size, device=env.device),
    )
    optimizer = build_optimizer(cfg.optim, model, global_batch=tc.batch_size)
    scheduler = lr_schedule(optimizer, tc, steps_per_epoch)
    scaler = grad_scaler(tc.precision, env.device)
    ema = build_ema(model, tc.ema)
    monitor = Monitor(
        tc.monitor.metric, tc.monitor.mode, tc.early_stopping.patience, tc.early_stopping.min_delta
    )
    progress, window = Progress(max_epochs=tc.max_epochs), LossWindow(env.device)
    trial = pruner_for(env.rank)  # rank 0's Optuna trial when the sweeper prunes (else None)
    state = TrainingState(
        shared={
            "model": model,
            "optimizer": optimizer,
            "scheduler": scheduler,
            "scaler": scaler,
            "progress": progress,
            "monitor": monitor,
            **({"ema": ema} if ema is not None else {}),
        },
        per_rank={"loss_window": window},
    )
    checkpoints = Checkpointer(
        run_dir,
        rank=env.rank,
        world_size=env.world_size,
        keep=tc.keep_checkpoints,
        config=cfg,
        enabled=tc.save_checkpoints,
        on_save=run.checkpoint_saved,
    )
    resumed = checkpoints.restore(state, cfg.resume)
    if resumed is not None:
        log.info("resumed from %s: epoch %d, step %d", resumed, progress.epoch + 1, progress.step)
        check_schedule_change(progress, tc, scheduler)
    # Compile, then wrap in DDP: its hooks all-reduce the gradients during backward.
    # Checkpoints keep saving the plain `model`.
    ddp_model = wrap_ddp(torch.compile(model) if tc.compile else model, cfg.dist, env)

    # The W&B run (and the panels of validation: per class, confusion matrix, fixed images).
    media = ValMedia(cfg, splits, loaders.val, env)
    facts = run_facts(env.world_size, micro_batch * tc.accumulate_grad_batches, env.device)
    progress.wandb_run_id = run.open(
        cfg,
        {**facts, **size},
        resuming=resumed is not None,
        wandb_run_id=progress.wandb_run_id,
        model=model,
    )
    progress.wandb_group, progress.wandb_name = run.wandb_group_name
    run.result.monitor, run.result.mode = monitor.metric, monitor.mode
    if resumed is not None and progress.epoch:  # what the earlier attempts reached
        run.result.epochs, run.result.best_val_acc = progress.epoch, progress.best_val_acc
        run.result.best, run.result.best_epoch = monitor.best, monitor.best_epoch
        run.result.best_checkpoint = "checkpoints/best.pt" if monitor.best_epoch else None
    run.result.params, run.result.flops_per_sample = size["params"], size["flops_per_sample"]

    step = TrainStep(
        ddp_model,
        model,
        optimizer,
        scheduler,
        scaler,
        env,
        tc,
        BatchMix(tc.mixup, splits.num_classes, cfg.seed),
        ema,
    )
    speed = Speed(
        env.device,
        tc.precision,
        flops_per_sample=3 * size["flops_per_sample"],
        samples_per_step=micro_batch * tc.accumulate_grad_batches * env.world_size,
    )
    console = Console(
        env.is_main, bar=tc.progress_bar, every_s=tc.progress_every_s, max_epochs=tc.max_epochs
    )
    with (
        StopRequest(tc.preemption_check_every_n_steps, cpu_group(env.backend)) as stop,
        StepProfiler(tc.profile, run_dir, rank0=env.is_main, on_written=run.save_profile) as prof,
        torch.autograd.detect_anomaly() if tc.detect_anomaly else nullcontext(),
    ):
        for epoch in range(progress.epoch, tc.max_epochs):
            # Early stopping: rank 0 decides, every rank follows (also after a resume).
            if rank0_decides(monitor.should_stop, env.device):
                log.info(
                    "early stopping before epoch %d: %s has not improved by more than %g "
                    "for %d epochs (best %.4f at epoch %s)",
                    epoch + 1,
                    monitor.metric,
                    monitor.min_delta,
                    monitor.stale,
                    monitor.best,
                    monitor.best_epoch,
                )
                run.result.stopped_early = True
                break
            progress.epoch = epoch
            # Every rank reshuffles the same way each epoch (and skips what a resumed
            # checkpoint already trained).
            loaders.train_sampler.set_epoch(epoch)
            loaders.train_sampler.skip(
                progress.step_in_epoch * micro_batch * tc.accumulate_grad_batches
            )
            ddp_model.train()
            batches = iter(loaders.train)
            console.start_epoch(epoch + 1, steps_per_epoch, progress.step_in_epoch)
            while progress.step_in_epoch < steps_per_epoch:
                # A train row per log interval, and one for the epoch's last partial window.
                logged = (
                    progress.step + 1
                ) % tc.log_every_n_steps == 0 or progress.step_in_epoch + 1 == steps_per_epoch
                result = step(batches, progress, speed, logged=logged)
                if speed.step_done():
                    tighten_timeout(env)  # startup is over: a stuck collective fails fast now
                if result is None:
                    progress.skipped_steps += 1
                else:
                    window.add(*result)
                progress.step += 1
                progress.step_in_epoch += 1
                prof.step()
                row = None
                if logged:
                    row = train_row(progress, window, step, env, tc, speed)
                    run.log(row)
                    run.result.samples_per_s = speed.mean_rate()
                console.step(row)
                if stop.agreed(progress.step):
                    checkpoints.save(state, step=progress.step, is_best=False)
                    raise Preempted(
                        f"preempted at step {progress.step}: checkpoint saved; "
                        "rerun with resume=auto to continue exactly"
                    )
                if tc.checkpoint_every_n_steps and (
                    progress.step % tc.checkpoint_every_n_steps == 0
                ):
                    checkpoints.save(state, step=progress.step, is_best=False)

            # Validation: exact, every val sample counted once across ranks.
            samples = media.watch(epoch + 1)  # the fixed val images' predictions, if due
            with precision_context(tc.precision, env.device):
                metrics = evaluate(
                    model, val_batches, env.device, tc, splits.num_classes, predictions=samples
                )
                ema_metrics = (
                    evaluate(ema.module, val_batches, env.device, tc, splits.num_classes)
                    if ema is not None and tc.ema.evaluate
                    else None
                )
            metrics.all_reduce()  # every rank's sums and counts: each val sample once
            result = metrics.result()
            val = result.scalars("val")
            if ema_metrics is not None:
                ema_metrics.all_reduce()
                val |= {
                    k: v
                    for k, v in ema_metrics.result().scalars("val_ema").items()
                    if not k.endswith("/count")
                }
            progress.epoch, progress.step_in_epoch = epoch + 1, 0
            run.log(
                {"step": progress.step, "epoch": epoch + 1, **val},
                media=media.panels(epoch + 1, result, samples),
            )
            progress.best_val_acc = max(progress.best_val_acc, val["val/acc"])
            # best.pt: the best epoch by the monitored metric (the same on every rank).
            is_best = monitor.update(epoch + 1, val)
            console.end_epoch(
                val, monitor=monitor.metric, best=monitor.best, best_epoch=monitor.best_epoch
            )
            # Rank 0 writes the checkpoint; every rank adds its own state and waits.
            checkpoints.save(state, step=progress.step, is_best=is_best)
            run.record_epoch(
                epoch + 1,
                val,
                best=monitor.best,
                best_epoch=monitor.best_epoch,
                best_val_acc=progress.best_val_acc,
                saved=tc.save_checkpoints,
            )
            # An Optuna trial with a pruner: rank 0 reports, every rank stops together.
            check_prune(trial, epoch + 1, val, monitor, env.device)

    run.result.time_to_first_step_s = speed.first_step_s
    run.result.peak_memory_mb_per_rank = gather_floats(peak_memory_mb(env.device))
    if tc.test_after_fit and tc.save_checkpoints and monitor.best_epoch is not None:
        run.result.test = test_best(model, checkpoints, splits, loaders, env, tc)
        if run.result.test:
            run.log(
                {
                    "step": progress.step,
                    "epoch": progress.epoch,
                    "best_epoch": monitor.best_epoch,
                    **run.result.test,
                }
            )
    return monitor.best


def check_trainer(tc: DictConfig) -> None:
    """Trainer settings no schema type can check: one line naming the key and the fix."""
    for key in (
        "max_epochs",
        "log_every_n_steps",
        "eval_batch_size",
        "keep_checkpoints",
        "preemption_check_every_n_steps",
        "overfit_batches",
        "checkpoint_every_n_steps",
    ):
        value = tc[key]
        if value is not None and value < 1:
            raise UserError(f"trainer.{key}={value} is not valid: use an integer >= 1")
    if tc.progress_every_s <= 0:
        raise UserError(f"trainer.progress_every_s={tc.progress_every_s}: use a positive number")


def epoch_steps(available: int, tc: DictConfig, train_size: int) -> int:
    """Optimizer steps per epoch: the full batches of this rank's shard, or fewer where
    trainer.limit_train_batches / overfit_batches ask."""
    if available == 0:
        raise UserError(
            f"trainer.batch_size={tc.batch_size} exceeds the training set "
            f"({train_size} samples): lower trainer.batch_size"
        )
    steps = limited(available, tc.limit_train_batches, "trainer.limit_train_batches")
    return min(steps, tc.overfit_batches) if tc.overfit_batches else steps


def check_schedule_change(progress: Progress, tc: DictConfig, scheduler) -> None:
    """Resuming with another trainer.max_epochs reshapes the lr schedule mid-run: say so."""
    planned = progress.max_epochs
    if planned is None or planned == tc.max_epochs:
        return
    before = scheduler.get_last_lr()[0]  # restored: the old schedule's lr at this step
    after = scheduler.lr_lambdas[0](progress.step) * scheduler.base_lrs[0]  # the new one's
    log.warning(
        "trainer.max_epochs=%d, but the checkpoint's run planned %d: the %s schedule "
        "now spans %d epochs, so the lr goes from %.4g to %.4g at step %d",
        tc.max_epochs,
        planned,
        tc.lr_schedule,
        tc.max_epochs,
        before,
        after,
        progress.step,
    )
    progress.max_epochs = tc.max_epochs


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
            x = x.to(device, non_blocking=True, memory_format=memory_format(tc))
            y = y.to(device, non_blocking=True)
            # MixUp/CutMix seeded by (seed, epoch, batch index): the same on resume.
            x, y = self.mix(x, y, progress.epoch, progress.step_in_epoch * accumulate + micro)
            last = micro == accumulate - 1
            with nullcontext() if last or not env.is_distributed else self.model.no_sync():
                with self.autocast:
                    logits = self.model(x)
                    loss = F.cross_entropy(logits, y, label_smoothing=tc.label_smoothing)
                loss = faults.inject(progress.step + 1, env.rank, loss)
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
        "peak_mem_mb": peak_memory_mb(env.device),
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


def test_best(
    model, checkpoints: Checkpointer, splits: DataSplits, loaders: Loaders, env: DistEnv, tc
) -> dict:
    """test/* of best.pt on the test split, exact like validation ({} without either). Test
    picks nothing: best.pt and the sweepers' value come from val only."""
    if splits.test is None:
        log.info("this dataset has no test split: nothing to test")
        return {}
    if env.is_main:  # only rank 0's node is sure to have the file
        model.load_state_dict(load_checkpoint(checkpoints.best)["model"])
    broadcast_weights(model)
    with precision_context(tc.precision, env.device):
        metrics = evaluate(model, loaders.eval_loader("test"), env.device, tc, splits.num_classes)
    metrics.all_reduce()
    test = metrics.result().scalars("test")
    log.info("best.pt on test: test/loss %.4f test/acc %.4f", test["test/loss"], test["test/acc"])
    return test
