"""Train an image classifier with DistributedDataParallel, configured by Hydra.

    python train.py [overrides]                   one process, or dist.nproc_per_node ranks
    torchrun --nproc_per_node=N train.py [...]    N ranks started by torchrun
    python train.py -m key=a,b                    a sweep: every job is a torchrun job

The story: set up the process group -> build data -> build the model -> train and validate each
epoch -> save checkpoints. Rank 0 writes everything into the run dir; other ranks write nothing.
"""

import logging
import math
import sys
import time
from pathlib import Path

import hydra
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

import conf.schema  # noqa: F401 - registers the typed config schema with Hydra
from data import build_datasets, build_loaders
from launch import rundir
from launch.checkpoint import (
    Checkpointer,
    decode_rng_state,
    load_checkpoint,
    resume_path,
    set_rng_state,
)
from launch.distributed import DistEnv, init_distributed, requested_world, started_by_launcher
from launch.errors import UserError, find_user_error
from launch.metrics import RunLogger, run_facts

log = logging.getLogger("train")


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float:
    """Hydra's task function; returns the best val/acc (what sweepers optimise)."""
    try:
        if not started_by_launcher() and requested_world(cfg.dist) != (1, 1):
            from launch.torchrun import run_in_torchrun

            return run_in_torchrun(cfg, train)  # `train` below, in each of the N ranks
        return train(cfg)
    except Exception as e:
        user_error = find_user_error(e)
        if user_error is None:
            raise
        log.error("%s", user_error)  # the user's to fix: one line, no traceback
        sys.exit(user_error.exit_code)


def train(cfg: DictConfig) -> float:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    started = time.time()
    with init_distributed(cfg.dist, cfg.trainer.device) as env:
        torch.manual_seed(cfg.seed)
        batch_size = per_rank(cfg.trainer.batch_size, env.world_size)

        # Data: each rank reads its own shard; validation counts every sample exactly once.
        splits = build_datasets(
            cfg.dataset, local_rank=env.local_rank, barrier=dist.barrier, seed=cfg.seed
        )
        loaders = build_loaders(
            splits,
            batch_size=batch_size,
            eval_batch_size=math.ceil(cfg.trainer.eval_batch_size / env.world_size),
            rank=env.rank,
            world_size=env.world_size,
            seed=cfg.seed,
            num_workers=cfg.dataset.num_workers,
            pin_memory=env.device.type == "cuda",
        )
        if len(loaders.train) == 0:
            raise UserError(
                f"trainer.batch_size={cfg.trainer.batch_size} exceeds the training set "
                f"({len(splits.train)} samples): lower trainer.batch_size"
            )

        # Model, optimizer, schedule; then continue from a checkpoint if asked to.
        model = instantiate(
            cfg.model,
            num_classes=splits.num_classes,
            in_channels=splits.in_channels,
            image_size=splits.image_size,
        ).to(env.device)
        optimizer = instantiate(cfg.optim)(model.parameters())
        scheduler = lr_schedule(optimizer, cfg.trainer, len(loaders.train))
        progress = {"epoch": 0, "step": 0, "best_val_acc": 0.0, "wandb_run_id": None}
        ckpt_path = resume_path(cfg.resume, run_dir)
        if ckpt_path is not None:
            progress = restore(ckpt_path, model, optimizer, scheduler, env)
        ddp_model = wrap_ddp(model, cfg.dist, env)

        logger = RunLogger(
            run_dir,
            cfg,
            enabled=env.is_main,
            facts=run_facts(env.world_size, batch_size, env.device),
            resume_step=progress["step"] if ckpt_path is not None else None,
            wandb_run_id=progress["wandb_run_id"],
        )
        checkpointer = Checkpointer(run_dir, env.is_main)
        result = {"status": "failed", "error": None, "best_val_acc": None, "final_val_acc": None,
                  "final_val_loss": None, "samples_per_s": None}  # fmt: skip
        throughput = []
        try:
            best, step = progress["best_val_acc"], progress["step"]
            for epoch in range(progress["epoch"], cfg.trainer.max_epochs):
                loaders.train_sampler.set_epoch(epoch)
                step, rates = train_one_epoch(
                    ddp_model, loaders.train, optimizer, scheduler, cfg.trainer, env, logger,
                    epoch=epoch, step=step,
                )  # fmt: skip
                throughput += rates
                val = evaluate(model, loaders.val, env.device)
                logger.log({"step": step, "epoch": epoch + 1, **val})
                log.info(
                    "epoch %d/%d step %d val/loss %.4f val/acc %.4f",
                    epoch + 1, cfg.trainer.max_epochs, step, val["val/loss"], val["val/acc"],
                )  # fmt: skip
                is_best = val["val/acc"] > best
                best = max(best, val["val/acc"])
                checkpointer.save(
                    {
                        "model": model.state_dict(),
                        "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(),
                        "epoch": epoch + 1,
                        "step": step,
                        "best_val_acc": best,
                        "wandb_run_id": logger.wandb_run_id,
                        "world_size": env.world_size,
                    },
                    is_best=is_best,
                )
                result.update(final_val_acc=val["val/acc"], final_val_loss=val["val/loss"])
            result.update(status="completed", best_val_acc=best)
            return best
        except BaseException as e:
            result["error"] = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise
        finally:
            result.update(
                wall_time_s=round(time.time() - started, 3),
                samples_per_s=sum(throughput) / len(throughput) if throughput else None,
            )
            logger.write_result(result)
            logger.finish(exit_code=0 if result["status"] == "completed" else 1)


def per_rank(global_batch: int, world_size: int) -> int:
    if global_batch <= 0 or global_batch % world_size:
        fix = max(world_size, round(global_batch / world_size) * world_size)
        raise UserError(
            f"trainer.batch_size={global_batch} (the global batch) is not divisible by the world "
            f"size {world_size}: use a multiple of {world_size}, e.g. trainer.batch_size={fix}"
        )
    return global_batch // world_size


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


def restore(path: Path, model, optimizer, scheduler, env: DistEnv) -> dict:
    state = load_checkpoint(path)
    try:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
    except (RuntimeError, KeyError, ValueError) as e:
        first = str(e).strip().splitlines()[0][:160]
        raise UserError(
            f"checkpoint {path} does not fit this model/optimizer ({first}): "
            "resume with the config it was saved with, or resume=null"
        ) from None
    rng = state.get("rng") or []
    if len(rng) == env.world_size:
        set_rng_state(decode_rng_state(rng[env.rank]))
    log.info("resumed from %s: epoch %d, step %d", path, state["epoch"], state["step"])
    return state


def wrap_ddp(model, dist_cfg, env: DistEnv):
    if not env.is_distributed:
        return model  # one rank: nothing to synchronise
    if dist_cfg.sync_batchnorm:
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return DDP(
        model,
        device_ids=[env.local_rank] if env.device.type == "cuda" else None,
        find_unused_parameters=dist_cfg.find_unused_parameters,
        gradient_as_bucket_view=dist_cfg.gradient_as_bucket_view,
        static_graph=dist_cfg.static_graph,
        bucket_cap_mb=dist_cfg.bucket_cap_mb,
    )


def train_one_epoch(model, loader, optimizer, scheduler, trainer_cfg, env, logger, *, epoch, step):
    """One pass over this rank's shard. Returns the global step and the samples/s measured."""
    model.train()
    device, every = env.device, trainer_cfg.log_every_n_steps
    loss_sum = torch.zeros((), device=device)
    window, rates, tic = 0, [], time.perf_counter()
    show_bar = env.is_main and trainer_cfg.progress_bar and sys.stdout.isatty()
    for x, y in tqdm(loader, desc=f"epoch {epoch + 1}", disable=not show_bar, leave=False):
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        loss = F.cross_entropy(model(x), y)
        if device.type == "cpu" and not torch.isfinite(loss):  # free on CPU; GPU checks per log
            raise_non_finite(loss, step + 1, epoch, env)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if trainer_cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), trainer_cfg.grad_clip)
        optimizer.step()
        scheduler.step()
        step += 1
        loss_sum += loss.detach()
        window += 1
        if step % every == 0:
            # One all-reduce per log interval, not per step: the loss is the mean over ranks.
            mean_loss = loss_sum / (window * env.world_size)
            dist.all_reduce(mean_loss)  # SUM: gloo has no AVG
            if not torch.isfinite(mean_loss):
                raise_non_finite(mean_loss, step, epoch, env)
            rate = window * len(x) * env.world_size / (time.perf_counter() - tic)
            rates.append(rate)
            logger.log({"step": step, "epoch": epoch + 1, "train/loss": mean_loss.item(),
                        "lr": scheduler.get_last_lr()[0], "samples_per_s": rate})  # fmt: skip
            loss_sum.zero_()
            window, tic = 0, time.perf_counter()
    return step, rates


def raise_non_finite(loss, step: int, epoch: int, env: DistEnv):
    raise UserError(
        f"non-finite loss ({loss.item()}) at step {step} (epoch {epoch + 1}) on rank {env.rank}: "
        "lower optim.lr or set trainer.grad_clip"
    )


@torch.no_grad()
def evaluate(model, loader, device) -> dict:
    """Exact full-set metrics: every val sample counted once across ranks, (sum, count) reduced."""
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        logits = model(x)
        totals[0] += F.cross_entropy(logits, y, reduction="sum").double()
        totals[1] += (logits.argmax(1) == y).sum()
        totals[2] += len(y)
    dist.all_reduce(totals)
    loss_sum, correct, count = totals.tolist()
    return {"val/loss": loss_sum / count, "val/acc": correct / count, "val/count": int(count)}


if __name__ == "__main__":
    sys.argv = rundir.prepare_argv(sys.argv)
    main()
