"""Train an image classifier with DistributedDataParallel, configured by Hydra.

    python train.py [overrides]                   one process, or dist.nproc_per_node ranks
    torchrun --nproc_per_node=N train.py [...]    N ranks started by torchrun
    python train.py -m key=a,b                    a sweep: every job is a torchrun job

The story: set up the process group -> build data -> build the model (and continue from a
checkpoint) -> train and validate each epoch -> save checkpoints. Rank 0 writes everything into
the run dir; other ranks write nothing.
"""

import logging
import math
import os
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import hydra
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig
from tqdm import tqdm

import conf.schema  # noqa: F401 - registers the typed config schema with Hydra
from components import faults
from components.checkpoint import Checkpointer, decode_rank_state, load_for_resume, set_rng_state
from components.distributed import (
    DistEnv,
    gather_floats,
    init_distributed,
    per_rank,
    requested_world,
    started_by_launcher,
    tighten_timeout,
    wrap_ddp,
)
from components.errors import UserError
from components.metrics import RunLogger, run_facts
from components.preemption import Preempted, StopRequest, cpu_group, requeue_on_slurm
from components.speed import (
    StepTimer,
    memory_format,
    peak_flops,
    peak_memory_mb,
    precision_context,
    process_age_s,
    train_flops_per_sample,
)
from data import build_datasets, build_loaders

log = logging.getLogger("train")


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float:
    """Hydra's task function; returns the best val/acc (what sweepers optimise)."""
    try:
        if not started_by_launcher() and requested_world(cfg.dist) != (1, 1):
            from launch.torchrun import run_in_torchrun

            return run_in_torchrun(cfg, train)  # `train` below, in each of the N ranks
        return train(cfg)
    except Preempted as e:
        log.warning("%s", e)
        if int(os.environ.get("RANK", "0")) == 0:
            requeue_on_slurm()
        sys.exit(e.exit_code)


@dataclass
class TrainState:
    """Where training stands: everything besides model/optimizer/scheduler a resume needs."""

    epoch: int = 0  # the epoch in progress (or the next one to run)
    step: int = 0  # optimizer steps so far
    step_in_epoch: int = 0  # batches of `epoch` already trained: the sampler's position
    best_val_acc: float = 0.0
    loss_sum: float = 0.0  # the train-loss window since the last logged row (a tensor in-epoch)
    loss_count: int = 0
    skipped_steps: int = 0  # non-finite updates skipped (trainer.nonfinite=skip)


@dataclass
class Loop:
    """What one training step needs besides the data: built once in train()."""

    model: torch.nn.Module  # what runs the batches: DDP-wrapped and/or compiled
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler  # a no-op unless trainer.precision=fp16
    trainer: DictConfig
    env: DistEnv
    logger: RunLogger
    save: Callable[..., None]
    stop: StopRequest
    flops_per_sample: float | None = None  # for MFU, on GPU
    first_step_s: float | None = None  # process age at the end of its first step


def train(cfg: DictConfig) -> float:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    started = time.time()
    with init_distributed(cfg.dist, cfg.trainer.device) as env:
        torch.manual_seed(cfg.seed)
        accumulate = cfg.trainer.accumulate_grad_batches
        micro_batch = per_rank(cfg.trainer.batch_size, env.world_size, accumulate)
        autocast = precision_context(cfg.trainer.precision, env.device)

        # Data: each rank reads its own shard; validation counts every sample exactly once.
        splits = build_datasets(
            cfg.dataset, local_rank=env.local_rank, barrier=dist.barrier, seed=cfg.seed
        )
        loaders = build_loaders(
            splits,
            batch_size=micro_batch,
            eval_batch_size=math.ceil(cfg.trainer.eval_batch_size / env.world_size),
            rank=env.rank,
            world_size=env.world_size,
            seed=cfg.seed,
            num_workers=cfg.dataset.num_workers,
            pin_memory=env.device.type == "cuda",
            fast=cfg.dataset.fast,
            device=env.device,
        )
        steps_per_epoch = len(loaders.train) // accumulate
        if steps_per_epoch == 0:
            raise UserError(
                f"trainer.batch_size={cfg.trainer.batch_size} exceeds the training set "
                f"({len(splits.train)} samples): lower trainer.batch_size"
            )

        # Model, optimizer, schedule; then continue from a checkpoint if there is one to use.
        model = instantiate(
            cfg.model,
            num_classes=splits.num_classes,
            in_channels=splits.in_channels,
            image_size=splits.image_size,
        ).to(env.device, memory_format=memory_format(cfg.trainer))
        optimizer = instantiate(cfg.optim)(model.parameters())
        scheduler = lr_schedule(optimizer, cfg.trainer, steps_per_epoch)
        scaler = torch.amp.GradScaler(env.device.type, enabled=cfg.trainer.precision == "fp16")
        state, wandb_run_id = TrainState(), None
        resumed = load_for_resume(resume_setting(cfg.resume), run_dir)
        if resumed is not None:
            state, wandb_run_id = restore(*resumed, model, optimizer, scheduler, scaler, env)
        # Compile before the DDP wrap; checkpoints keep saving the plain `model`.
        runner = wrap_ddp(torch.compile(model) if cfg.trainer.compile else model, cfg.dist, env)

        logger = RunLogger(
            run_dir,
            cfg,
            enabled=env.is_main,
            facts=run_facts(env.world_size, micro_batch * accumulate, env.device),
            resuming=resumed is not None,
            wandb_run_id=wandb_run_id,
        )
        checkpointer = Checkpointer(run_dir, env.is_main, keep=cfg.trainer.keep_checkpoints)

        def save(is_best: bool = False) -> None:
            checkpointer.save(
                {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(),
                    "scaler": scaler.state_dict(),
                    **asdict(state),
                    "loss_sum": None,  # per rank, below
                    "wandb_run_id": logger.wandb_run_id,
                    "world_size": env.world_size,
                },
                is_best=is_best,
                rank_local={"loss_sum": float(state.loss_sum)},  # each rank's own window
            )

        stop = StopRequest(cfg.trainer.preemption_check_every_n_steps, cpu_group(env.backend))
        loop = Loop(runner, optimizer, scheduler, scaler, cfg.trainer, env, logger, save, stop)
        result = {"status": "failed", "error": None, "best_val_acc": None, "final_val_acc": None,
                  "final_val_loss": None, "samples_per_s": None}  # fmt: skip
        throughput = []
        try:
            for epoch in range(state.epoch, cfg.trainer.max_epochs):
                state.epoch = epoch
                loaders.train_sampler.set_epoch(epoch)
                loaders.train_sampler.skip(state.step_in_epoch * accumulate * micro_batch)
                throughput += train_one_epoch(loop, loaders.train, state, steps_per_epoch)
                with autocast:
                    val = evaluate(model, loaders.val, env.device, cfg.trainer)
                state.epoch, state.step_in_epoch = epoch + 1, 0
                logger.log({"step": state.step, "epoch": epoch + 1, **val})
                log.info(
                    "epoch %d/%d step %d val/loss %.4f val/acc %.4f",
                    epoch + 1, cfg.trainer.max_epochs, state.step, val["val/loss"], val["val/acc"],
                )  # fmt: skip
                is_best = val["val/acc"] > state.best_val_acc
                state.best_val_acc = max(state.best_val_acc, val["val/acc"])
                save(is_best=is_best)
                result.update(final_val_acc=val["val/acc"], final_val_loss=val["val/loss"])
            result.update(
                status="completed",
                best_val_acc=state.best_val_acc,
                time_to_first_step_s=loop.first_step_s,
                peak_memory_mb_per_rank=gather_floats(peak_memory_mb(env.device)),
            )
            return state.best_val_acc
        except Preempted:
            result["status"] = "preempted"
            raise
        except BaseException as e:
            result["error"] = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise
        finally:
            stop.restore_default_handlers()
            result.update(
                wall_time_s=round(time.time() - started, 3),
                samples_per_s=sum(throughput) / len(throughput) if throughput else None,
            )
            logger.write_result(result)
            logger.finish(result["status"])


def train_one_epoch(loop: Loop, loader, state: TrainState, steps: int) -> list[float]:
    """Train the rest of this rank's shard of `state.epoch`. Returns the samples/s measured."""
    env, cfg = loop.env, loop.trainer
    device, accumulate, every = env.device, cfg.accumulate_grad_batches, cfg.log_every_n_steps
    autocast = precision_context(cfg.precision, device)
    loop.model.train()
    # The window's loss is summed on the device (no host sync) and kept in `state` so that a
    # checkpoint taken mid-window resumes it exactly.
    state.loss_sum = loss_sum = torch.tensor(float(state.loss_sum), device=device)
    rates, timer, batches = [], StepTimer(), iter(loader)
    show_bar = env.is_main and cfg.progress_bar and sys.stdout.isatty()
    bar = tqdm(total=steps, initial=state.step_in_epoch, desc=f"epoch {state.epoch + 1}",
               disable=not show_bar, leave=False)  # fmt: skip
    while state.step_in_epoch < steps:
        # One optimizer step = `accumulate` micro-batches; DDP all-reduces on the last only.
        loop.optimizer.zero_grad(set_to_none=True)
        step_loss = torch.zeros((), device=device)
        for micro in range(accumulate):
            with timer.waiting_for_data():
                x, y = next(batches)
            x = x.to(device, non_blocking=True, memory_format=memory_format(cfg))
            y = y.to(device, non_blocking=True)
            last = micro == accumulate - 1
            with nullcontext() if last or not env.is_distributed else loop.model.no_sync():
                with autocast:
                    loss = F.cross_entropy(loop.model(x), y)
                loss = faults.inject(state.step + 1, env.rank, loss)
                # On CPU this check is free; on GPU it waits for the log step (no host sync).
                if cfg.nonfinite == "error" and device.type == "cpu" and not torch.isfinite(loss):
                    raise_non_finite(loss, state.step + 1, state.epoch, env)
                loop.scaler.scale(loss / accumulate).backward()
            step_loss += loss.detach() / accumulate
        if loop.flops_per_sample is None and device.type == "cuda":
            plain = getattr(loop.model, "module", loop.model)
            loop.flops_per_sample = train_flops_per_sample(plain, x)
        if optimizer_step(loop):
            loss_sum += step_loss
            state.loss_count += 1
        else:
            state.skipped_steps += 1
        loop.scheduler.step()
        state.step += 1
        state.step_in_epoch += 1
        timer.step_done()
        bar.update(1)
        if loop.first_step_s is None:
            loop.first_step_s = round(process_age_s(), 3)
            tighten_timeout(env)  # startup is over: a stuck collective should now fail fast
        if state.step % every == 0:
            rates.append(log_window(loop, state, loss_sum, timer, len(x)))
        if loop.stop.agreed(state.step):
            loop.save()
            raise Preempted(
                f"preempted at step {state.step}: checkpoint saved; "
                "rerun with resume=auto to continue exactly"
            )
        if cfg.checkpoint_every_n_steps and state.step % cfg.checkpoint_every_n_steps == 0:
            loop.save()
    bar.close()
    state.loss_sum = float(loss_sum)
    return rates


def optimizer_step(loop: Loop) -> bool:
    """Unscale (fp16), clip, step. False when `trainer.nonfinite=skip` skipped the update:
    the gradients are all-reduced, so every rank sees the same norm and skips the same step."""
    cfg = loop.trainer
    if cfg.grad_clip or cfg.nonfinite == "skip":
        loop.scaler.unscale_(loop.optimizer)  # clip the true gradients, not the scaled ones
        norm = torch.nn.utils.clip_grad_norm_(loop.model.parameters(), cfg.grad_clip or math.inf)
        if cfg.nonfinite == "skip" and not torch.isfinite(norm):
            loop.scaler.update()
            return False
    loop.scaler.step(loop.optimizer)
    loop.scaler.update()
    return True


def log_window(loop: Loop, state: TrainState, loss_sum, timer: StepTimer, micro: int) -> float:
    """One all-reduce per log interval, not per step: the loss is the mean over ranks."""
    env = loop.env
    totals = torch.stack([loss_sum, torch.tensor(float(state.loss_count), device=env.device)])
    dist.all_reduce(totals)  # SUM (gloo has no AVG)
    mean_loss = (totals[0] / totals[1].clamp(min=1)).item()
    if loop.trainer.nonfinite == "error" and not math.isfinite(mean_loss):
        raise_non_finite(mean_loss, state.step, state.epoch, env)
    seconds, wait_pct, steps = timer.window()
    rate = steps * micro * loop.trainer.accumulate_grad_batches * env.world_size / seconds
    row = {"step": state.step, "epoch": state.epoch + 1, "train/loss": mean_loss,
           "lr": loop.scheduler.get_last_lr()[0], "samples_per_s": rate,
           "step_time_ms": 1000 * seconds / max(steps, 1), "data_wait_pct": wait_pct,
           "peak_mem_mb": peak_memory_mb(env.device)}  # fmt: skip
    peak = peak_flops(env.device, loop.trainer.precision)
    if loop.flops_per_sample and peak:
        row["mfu"] = loop.flops_per_sample * rate / (peak * env.world_size)
    if state.skipped_steps:
        row["train/skipped_steps"] = state.skipped_steps
    loop.logger.log(row)
    loss_sum.zero_()
    state.loss_count = 0
    timer.reset()
    return rate


def raise_non_finite(loss, step: int, epoch: int, env: DistEnv):
    value = loss.item() if torch.is_tensor(loss) else loss
    raise UserError(
        f"non-finite loss ({value}) at step {step} (epoch {epoch + 1}) on rank {env.rank}: "
        "lower optim.lr, set trainer.grad_clip, or trainer.nonfinite=skip"
    )


@torch.no_grad()
def evaluate(model, loader, device, trainer_cfg) -> dict:
    """Exact full-set metrics: every val sample counted once across ranks, (sum, count) reduced."""
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count
    for x, y in loader:
        x = x.to(device, non_blocking=True, memory_format=memory_format(trainer_cfg))
        y = y.to(device, non_blocking=True)
        logits = model(x)
        totals[0] += F.cross_entropy(logits.float(), y, reduction="sum").double()
        totals[1] += (logits.argmax(1) == y).sum()
        totals[2] += len(y)
    dist.all_reduce(totals)
    loss_sum, correct, count = totals.tolist()
    return {"val/loss": loss_sum / count, "val/acc": correct / count, "val/count": int(count)}


def lr_schedule(optimizer, trainer_cfg, steps_per_epoch: int):
    """Linear warm-up, then cosine decay to 0 (or constant), stepped once per optimizer step."""
    total = max(1, steps_per_epoch * trainer_cfg.max_epochs)
    warmup = int(trainer_cfg.warmup_epochs * steps_per_epoch)
    if trainer_cfg.lr_schedule not in ("cosine", "constant"):
        raise UserError(f"trainer.lr_schedule={trainer_cfg.lr_schedule}: use cosine or constant")

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if trainer_cfg.lr_schedule == "constant":
            return 1.0
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def resume_setting(resume: str | None) -> str | None:
    """A restarted job continues from its run dir's checkpoints: after torchrun restarted the
    ranks (--max-restarts) or SLURM requeued the job."""
    for var, what in (("TORCHELASTIC_RESTART_COUNT", "of the ranks"),
                      ("SLURM_RESTART_COUNT", "of the SLURM job")):  # fmt: skip
        if resume is None and int(os.environ.get(var) or 0) > 0:
            log.warning("restart %s %s: resuming from the latest checkpoint", os.environ[var], what)
            return "auto"
    return resume


def restore(path: Path, ckpt: dict, model, optimizer, scheduler, scaler, env: DistEnv):
    try:
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        if ckpt.get("scaler"):
            scaler.load_state_dict(ckpt["scaler"])
    except (RuntimeError, KeyError, ValueError) as e:
        first = str(e).strip().splitlines()[0][:160]
        raise UserError(
            f"checkpoint {path} does not fit this model/optimizer ({first}): "
            "resume with the config it was saved with, or resume=null"
        ) from None
    state = TrainState(**{k: ckpt[k] for k in TrainState.__dataclass_fields__ if k in ckpt})
    ranks = ckpt.get("ranks") or []
    if len(ranks) == env.world_size:
        mine = decode_rank_state(ranks[env.rank])
        set_rng_state(mine["rng"])
        state.loss_sum = mine["loss_sum"]
    else:
        log.warning("checkpoint from world size %d: per-rank state not restored", len(ranks))
        state.loss_sum, state.loss_count = 0.0, 0
    log.info("resumed from %s: epoch %d, step %d", path, state.epoch + 1, state.step)
    return state, ckpt.get("wandb_run_id")


if __name__ == "__main__":
    from launch.rank import entry_point

    entry_point(main)
