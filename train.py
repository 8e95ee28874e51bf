"""Train an image classifier with DistributedDataParallel, configured by Hydra.

    python train.py [overrides]                   one process, or dist.nproc_per_node ranks
    torchrun --nproc_per_node=N train.py [...]    N ranks started by torchrun
    python train.py -m key=a,b                    a sweep: every job is a torchrun job

The story, in every rank: join the process group and pin this rank's device (`train`) ->
build the data (a DistributedSampler gives each rank its shard), the model, continue from a
checkpoint, wrap it in DDP (`build`) -> each epoch: set_epoch, train, validate exactly
(all-reduced), rank 0 saves (`fit`) -> evaluate best.pt on the held-out test split. Rank 0 writes
everything into the run dir; other ranks write nothing. Each helper is one module away:
components/ (services inside a rank), data/, models/, launch/ (how ranks and sweeps start).
eval.py evaluates a checkpoint later with the same pieces.

Why a build phase and a loop, not a Trainer class: the loop (`fit`) stays a flat function that
reads top to bottom like the seed lesson's, one screen long, every step named where it happens;
everything it needs is built once, in order, by `build` and handed over as one named object
(`Training`). A Trainer whose __init__ builds and whose fit() loops would spread the same
state over `self` and its methods, and a researcher editing the loop would read both.
"""

if __name__ == "__main__":  # `python train.py ...` (also each rank under plain torchrun)
    # Hydra composes conf/train.yaml first (--help, --cfg and config errors answer before torch
    # loads), then runs main() here, or in the dist.nproc_per_node ranks it starts.
    from ddp_launcher import entry_point

    from conf import TRUSTED_TARGETS

    entry_point(
        __file__,
        task="train:main",
        config_name="train",
        schema="conf.schema",
        trusted_targets=TRUSTED_TARGETS,  # the `_target_`s its configs may name
    )

import logging
import math
import os
import sys
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from ddp_launcher import (
    Pruned,
    TrialLink,
    UserError,
    process_age_s,
    pruner_for,
    rank_world_size,
    requeue_on_slurm,
)
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from components.checkpoint import (
    Checkpointer,
    TrainingState,
    init_weights,
    load_checkpoint,
    tensor_bytes,
)
from components.console import Console
from components.distributed import (
    DistEnv,
    broadcast_weights,
    data_barrier,
    gather_floats,
    init_distributed,
    rank0_decides,
    sync_batchnorm,
    tighten_timeout,
    wrap_ddp,
)
from components.divergence import DivergenceWatch
from components.ema import EMA, build_ema
from components.evaluation import evaluate
from components.loss_window import LossWindow
from components.metrics import RunLogger, run_facts
from components.monitor import Monitor, check_prune
from components.optim import build_optimizer, lr_schedule, warmup_steps
from components.precision import (
    grad_scaler,
    memory_format,
    model_dtype,
    precision_context,
    resolve_precision,
    warn_if_bf16_emulated,
)
from components.preemption import Preempted, StopRequest
from components.profiling import StepProfiler
from components.speed import Speed, model_facts, set_fp32_math
from components.train_step import Progress, TrainStep, train_row
from components.wandb_media import ValMedia
from conf.checks import checkpoint_fit, per_rank_batch
from conf.folder_recipe import folder_augment
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
from data.seeding import seed_rank
from data.transforms import build_recipe
from models import build_model

log = logging.getLogger("train")


def main(cfg: DictConfig) -> float | None:
    """Hydra's task function, in every rank; returns the monitored metric's best value
    (trainer.monitor: what sweepers optimise; never a test metric). A user error propagates to
    whoever runs the task, which reports it once; preemption exits with 75. (With
    dist.nproc_per_node=N, the process you started hands the job to N ranks before this
    file is imported: ddp_launcher.entry_point.)"""
    try:
        return train(cfg)
    except Pruned as e:  # the sweeper's pruner stopped the trial: a result, not an error
        return e.best
    except Preempted as e:
        log.warning("%s", e)
        if int(os.environ.get("RANK", "0")) == 0:
            requeue_on_slurm()
        sys.exit(e.exit_code)  # 75: "requeue me"


def train(cfg: DictConfig) -> float | None:
    """One run, in every rank; returns the monitored metric's best value."""
    tc = cfg.trainer
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    # The gate (ddp_launcher.RunGate with conf/checks.py) checked the settings and the run dir
    # where the run started, before anything was written.
    micro_batch = per_rank_batch(tc.batch_size, rank_world_size(), tc.accumulate_grad_batches)
    # `run`: rank 0's metrics.jsonl, W&B run and result.json, however the run ends; `env`: this
    # rank's place in the process group and its pinned device (GPU LOCAL_RANK).
    with (
        RunLogger(run_dir, enabled=int(os.environ.get("RANK", "0")) == 0) as run,
        init_distributed(cfg.dist, tc.device) as env,
    ):
        return fit(build(cfg, run, env, run_dir, micro_batch))


@dataclass
class Training:
    """Everything the loop needs, built in order by `build`."""

    cfg: DictConfig
    env: DistEnv
    run: RunLogger
    run_dir: Path
    splits: DataSplits
    loaders: Loaders  # train: this rank's shard (DistributedSampler); val/test: exact shards
    val_batches: FirstBatches
    steps_per_epoch: int
    samples_per_step: int  # this rank's samples per optimizer step (micro-batch x accumulation)
    model: torch.nn.Module  # the plain model: what checkpoints save and evaluation runs
    ddp_model: torch.nn.Module  # what trains: DDP-wrapped (and compiled where asked)
    ema: EMA | None
    step: TrainStep  # one optimizer step (forward, backward, update)
    progress: Progress
    window: LossWindow
    divergence: DivergenceWatch  # says once when the train loss climbs after the warm-up
    monitor: Monitor
    state: TrainingState  # everything a resume needs
    checkpoints: Checkpointer
    media: ValMedia
    speed: Speed
    console: Console
    trial: TrialLink | None  # rank 0's Optuna trial when the sweeper prunes (else None)


def build(
    cfg: DictConfig, run: RunLogger, env: DistEnv, run_dir: Path, micro_batch: int
) -> Training:
    """Data -> model -> optimizer and friends -> resume -> DDP wrap -> the W&B run."""
    tc = cfg.trainer
    torch.manual_seed(cfg.seed)  # the draws every rank shares: the initial weights
    torch.backends.cudnn.benchmark = tc.cudnn_benchmark  # autotune convolutions (GPU)
    # The recipe that trains, also in checkpoints and W&B (imagefolder's depends on its size);
    # trainer.precision=auto: bf16 where this hardware has it natively, else 32 (one log line);
    # precision 32 in TF32 where the GPU has it (trainer.tf32; the run's facts say which).
    cfg.augment = folder_augment(cfg)[0]
    tc.precision = resolve_precision(tc.precision, env)
    fp32_math = set_fp32_math(tc.precision, env.device, tc.tf32)

    # Data: a DistributedSampler gives each rank its own shard of every epoch; validation counts
    # every sample exactly once across ranks; test is only touched after training.
    # Augmentation: the `augment` recipe (conf/augment/).
    splits = build_datasets(
        cfg.dataset,
        local_rank=env.local_rank,
        barrier=data_barrier(env),
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
    # SyncBatchNorm (dist.sync_batchnorm) first: the optimizer, EMA and compile see its layers.
    model = sync_batchnorm(build_model(cfg.model, splits), cfg.dist, env)
    model = model.to(env.device, model_dtype(tc), memory_format=memory_format(tc))
    size = model_facts(
        model,
        torch.zeros(1, splits.in_channels, splits.image_size, splits.image_size, device=env.device),
    )
    # From here each rank draws its own dropout and stochastic-depth masks (a resume restores
    # each rank's generators).
    seed_rank(cfg.seed, env.rank)
    optimizer = build_optimizer(cfg.optim, model, global_batch=tc.batch_size)
    scheduler = lr_schedule(optimizer, tc, steps_per_epoch)
    scaler = grad_scaler(tc.precision, env.device)
    warn_if_bf16_emulated(tc.precision, env.device)
    ema = build_ema(model, tc.ema)
    monitor = Monitor(
        tc.monitor.metric,
        tc.monitor.mode,
        tc.early_stopping.patience,
        tc.early_stopping.min_delta,
        target=tc.target,
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
        config=cfg,
        # A component the checkpoint lacks: what happens instead (one warning line each).
        fresh={"ema": ("EMA starts from the restored weights", lambda: ema.restart_from(model))},
    )
    checkpoints = Checkpointer(
        run_dir,
        rank=env.rank,
        keep=tc.keep_checkpoints,
        enabled=tc.save_checkpoints,
        fit=checkpoint_fit(cfg),  # what a resume must match (the gate checks it)
        on_save=run.checkpoint_saved,
        group=env.cpu_group,  # waits for a slow write on gloo, not under NCCL's watchdog
        timeout_s=env.timeout_s,
    )
    resumed = checkpoints.restore(state, cfg.resume)  # rank 0 chooses, every rank follows
    if resumed is not None:
        log.info("resumed from %s: epoch %d, step %d", resumed, progress.epoch + 1, progress.step)
        check_schedule_change(progress, tc, scheduler)
    if checkpoints.continued is not None:  # another run's checkpoint: a run of its own here
        progress.wandb_run_id = None
        if not checkpoints.continued.best:
            monitor.restart_best()
    elif resumed is None and cfg.init_from:  # fine-tuning: its weights, all else new
        init_weights(model, cfg.init_from, env.rank)
        if ema is not None:
            ema.restart_from(model)
    # Wrap in DDP (its hooks all-reduce the gradients during backward), then compile the
    # wrapped module: only then does dynamo's DDPOptimizer split the graph at DDP's bucket
    # boundaries, so buckets all-reduce while backward still runs. Checkpoints, the EMA and
    # evaluation keep using the plain `model` (its state_dict keys have no prefix).
    ddp_model = wrap_ddp(model, cfg.dist, env)
    if tc.compile:
        ddp_model = torch.compile(ddp_model)

    # The W&B run (and the panels of validation: per class, confusion matrix, fixed images).
    media = ValMedia(cfg, splits, loaders.val, env)
    facts = run_facts(
        env.world_size,
        micro_batch * tc.accumulate_grad_batches,
        env.device,
        tc.precision,
        fp32_math,
    )
    progress.wandb_run_id = run.open(
        cfg,
        {**facts, **size},
        resuming=resumed is not None,
        wandb_run_id=progress.wandb_run_id,
        model=model,
        monitor=monitor,
        epochs_done=progress.epoch,
        steps_done=progress.step,
    )
    progress.wandb_group, progress.wandb_name = run.wandb_group_name

    mix = BatchMix(tc.mixup, splits.num_classes, cfg.seed)
    step = TrainStep(ddp_model, model, optimizer, scheduler, scaler, env, tc, mix, ema)
    samples_per_step = micro_batch * tc.accumulate_grad_batches
    speed = Speed(
        env.device,
        tc.precision,
        flops_per_sample=3 * size["flops_per_sample"],
        conv_share=size["conv_flops_per_sample"] / max(size["flops_per_sample"], 1.0),
        samples_per_step=samples_per_step * env.world_size,
    )
    console = Console(
        env.is_main, bar=tc.progress_bar, every_s=tc.progress_every_s, max_epochs=tc.max_epochs
    )
    divergence = DivergenceWatch(
        progress, warmup_steps(tc, steps_per_epoch), cfg.optim.lr, tc.grad_clip
    )
    return Training(
        cfg=cfg,
        env=env,
        run=run,
        run_dir=run_dir,
        splits=splits,
        loaders=loaders,
        val_batches=val_batches,
        steps_per_epoch=steps_per_epoch,
        samples_per_step=samples_per_step,
        model=model,
        ddp_model=ddp_model,
        ema=ema,
        step=step,
        progress=progress,
        window=window,
        divergence=divergence,
        monitor=monitor,
        state=state,
        checkpoints=checkpoints,
        media=media,
        speed=speed,
        console=console,
        trial=trial,
    )


def fit(t: Training) -> float | None:
    """Train and validate each epoch, rank 0 saving; then test best.pt. Returns the monitored
    metric's best value."""
    cfg, env, run, progress, monitor = t.cfg, t.env, t.run, t.progress, t.monitor
    tc = cfg.trainer
    with (
        StopRequest(tc.preemption_check_every_n_steps, env.cpu_group) as stop,
        StepProfiler(tc.profile, t.run_dir, rank0=env.is_main, on_written=run.save_profile) as prof,
        torch.autograd.detect_anomaly() if tc.detect_anomaly else nullcontext(),
    ):
        for epoch in range(progress.epoch, tc.max_epochs):
            # Early stopping: rank 0 decides, every rank follows (also after a resume).
            if rank0_decides(monitor.should_stop, env.device):
                log.info("early stopping before epoch %d: %s", epoch + 1, monitor.describe_stop())
                run.stopped_early()
                break
            # trainer.stop_at_target: the target was reached (also before a resume).
            if tc.stop_at_target and rank0_decides(monitor.reached is not None, env.device):
                log.info(
                    "stopping at the target before epoch %d: %s",
                    epoch + 1,
                    monitor.describe_target(),
                )
                run.stopped_at_target()
                break
            progress.epoch = epoch
            # Every rank reshuffles the same way each epoch (and skips what a resumed
            # checkpoint already trained).
            t.loaders.train_sampler.set_epoch(epoch)
            t.loaders.train_sampler.skip(progress.step_in_epoch * t.samples_per_step)
            t.ddp_model.train()
            t.speed.memory.start("train")  # train rows' peak_mem_mb: this epoch's training's
            batches = iter(t.loaders.train)
            t.console.start_epoch(epoch + 1, t.steps_per_epoch, progress.step_in_epoch)
            while progress.step_in_epoch < t.steps_per_epoch:
                # A train row per log interval, and one for the epoch's last partial window.
                logged = (progress.step + 1) % tc.log_every_n_steps == 0 or (
                    progress.step_in_epoch + 1 == t.steps_per_epoch
                )
                # Forward, backward (DDP all-reduces the gradients), optimizer step.
                result = t.step(batches, progress, t.speed, logged=logged)
                if t.speed.step_done():
                    tighten_timeout(env)  # startup is over: a stuck collective fails fast now
                if result is None:
                    progress.skipped_steps += 1
                else:
                    t.window.add(*result)
                progress.step += 1
                progress.step_in_epoch += 1
                prof.step()
                row = train_row(progress, t.window, t.step, env, tc, t.speed) if logged else None
                if row is not None:
                    run.log(row)
                    if (found := t.divergence.check(row)) is not None:
                        run.diverged(found)
                t.console.step(row)
                if stop.agreed(progress.step):  # a stop signal on any rank: save, then exit 75
                    t.checkpoints.save(t.state, step=progress.step, is_best=False)
                    raise Preempted(
                        f"preempted at step {progress.step}: checkpoint saved; "
                        "rerun with resume=auto to continue exactly"
                    )
                if tc.checkpoint_every_n_steps and (
                    progress.step % tc.checkpoint_every_n_steps == 0
                ):
                    t.checkpoints.save(t.state, step=progress.step, is_best=False)

            # Validation: exact, every val sample counted once across ranks (all-reduced).
            samples = t.media.watch(epoch + 1)  # the fixed val images' predictions, if due
            t.speed.memory.start("val")
            val, result = validate(t, predictions=samples)
            progress.epoch, progress.step_in_epoch = epoch + 1, 0
            media = t.media.panels(epoch + 1, result, samples)
            run.epoch_validated(epoch + 1, progress.step, val, media=media)
            # best.pt: the best epoch by the monitored metric (the same on every rank).
            is_best = monitor.update(epoch + 1, val)
            # trainer.target: the first validation at it, timed from process start.
            if monitor.reach_target(epoch + 1, progress.step, process_age_s()):
                log.info("%s", monitor.describe_target())
                run.target_reached()
            t.console.end_epoch(
                val, monitor=monitor.metric, best=monitor.best, best_epoch=monitor.best_epoch
            )
            # Rank 0 writes the checkpoint; every rank adds its own state and waits.
            t.checkpoints.save(t.state, step=progress.step, is_best=is_best)
            # An Optuna trial with a pruner: rank 0 reports, every rank stops together.
            check_prune(t.trial, epoch + 1, val, monitor, env.device)

    run.trained(t.speed.first_step_s, gather_floats(t.speed.memory.run_peak()))
    if tc.test_after_fit and tc.save_checkpoints and monitor.best_epoch is not None:
        run.tested(progress.step, progress.epoch, test_best(t))
    return monitor.best


def validate(t: Training, predictions=None) -> tuple[dict, Any]:
    """The val/* (and val_ema/*) metrics over every val sample once across ranks, and the
    model's full result (for the W&B panels)."""
    tc, env, classes = t.cfg.trainer, t.env, t.splits.num_classes
    with precision_context(tc.precision, env.device):
        metrics = evaluate(t.model, t.val_batches, env.device, tc, classes, predictions=predictions)
        ema_metrics = (
            evaluate(t.ema.module, t.val_batches, env.device, tc, classes)
            if t.ema is not None and tc.ema.evaluate
            else None
        )
    metrics.all_reduce()  # every rank's sums and counts: each val sample once
    result = metrics.result()
    val = result.scalars("val")
    if ema_metrics is not None:
        ema_metrics.all_reduce()
        ema_val = ema_metrics.result().scalars("val_ema")
        val |= {k: v for k, v in ema_val.items() if not k.endswith("/count")}
    return val, result


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


def test_best(t: Training) -> dict:
    """test/* of best.pt on the test split, exact like validation ({} without either). Test
    picks nothing: best.pt and the sweepers' value come from val only."""
    splits, env, tc, model = t.splits, t.env, t.cfg.trainer, t.model
    if splits.test is None:
        log.info("this dataset has no test split: nothing to test")
        return {}
    if env.is_main:  # only rank 0's node is sure to have the file
        model.load_state_dict(load_checkpoint(t.checkpoints.best)["model"])
    t.checkpoints.wait_for_rank0(tensor_bytes(model.state_dict()))  # (a slow read: on gloo)
    broadcast_weights(model)
    with precision_context(tc.precision, env.device):
        test_loader = t.loaders.eval_loader("test")
        metrics = evaluate(model, test_loader, env.device, tc, splits.num_classes)
    metrics.all_reduce()
    test = metrics.result().scalars("test")
    log.info("best.pt on test: test/loss %.4f test/acc %.4f", test["test/loss"], test["test/acc"])
    return test
