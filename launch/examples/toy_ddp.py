"""A toy DDP app on hydra-ddp-launcher: linear regression on synthetic tensors, gloo on CPU.

python toy_ddp.py dist.nproc_per_node=2                                one run, 2 ranks
python toy_ddp.py -m hydra/launcher=torchrun dist.nproc_per_node=1,2   a sweep
python toy_ddp.py hparams_search=lr                                    Optuna, pruning"""

if __name__ == "__main__":  # Hydra composes conf/toy.yaml before torch is imported
    from ddp_launcher import entry_point

    entry_point(__file__, task="toy_ddp:main", config_name="toy")

import json
from pathlib import Path

import ddp_launcher
import torch
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from torch.nn.functional import mse_loss


def main(cfg) -> float | None:
    """Hydra's task, in every rank: returns the best val/loss (what a sweeper minimises)."""
    world = ddp_launcher.rank_world_size()
    if cfg.batch_size % world:
        raise ddp_launcher.UserError(f"batch_size={cfg.batch_size}: use a multiple of {world}")
    if ddp_launcher.started_as_rank():  # torchrun's environment: MASTER_ADDR, RANK, ...
        dist.init_process_group(cfg.dist.backend)
    else:  # one process without torchrun: a world of one
        dist.init_process_group(cfg.dist.backend, store=dist.HashStore(), rank=0, world_size=1)
    rank, run_dir = dist.get_rank(), Path(HydraConfig.get().runtime.output_dir)
    try:
        status, (epoch, best, val) = "completed", fit(cfg, rank, world, run_dir)
    except ddp_launcher.Pruned as e:  # the sweeper's pruner stopped this trial: a result
        status, epoch, best, val = "pruned", e.epoch, e.best, e.value
    if rank == 0:  # result.json: its value is what the report and a resumed sweep read
        result = ddp_launcher.RunResult(status, value=best, metric="val/loss", direction="min")
        result.app = {"epochs": epoch, "last_val_loss": val}  # the app's own part
        ddp_launcher.write_result(run_dir, result)
    dist.destroy_process_group()
    return best


def fit(cfg, rank: int, world: int, run_dir: Path) -> tuple[int, float, float]:
    """Train from the last checkpoint; (epochs done, best val/loss, last val/loss)."""
    torch.manual_seed(cfg.seed)  # the same data in every rank; each trains on its own shard
    x = torch.randn(cfg.samples, cfg.features)
    y = x @ torch.randn(cfg.features, 1) + 0.1 * torch.randn(cfg.samples, 1)
    n_val, batch, shard = cfg.samples // 5, cfg.batch_size // world, cfg.samples * 4 // 5 // world
    x_mine, y_mine = x[rank * shard : (rank + 1) * shard], y[rank * shard : (rank + 1) * shard]
    model = torch.nn.Linear(cfg.features, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    ckpt, done = run_dir / ddp_launcher.CHECKPOINT_DIR / "last.pt", (0, float("inf"), None)
    if cfg.resume == "auto" and ckpt.exists():  # a resumed sweep's job goes on where it was
        saved = torch.load(ckpt, weights_only=True)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        done = saved["done"]
    ddp, trial = torch.nn.parallel.DistributedDataParallel(model), ddp_launcher.pruner_for(rank)
    for epoch in range(done[0] + 1, cfg.epochs + 1):
        for i in range(0, shard - batch + 1, batch):  # DDP all-reduces the gradients
            loss = mse_loss(ddp(x_mine[i : i + batch]), y_mine[i : i + batch])
            optimizer.zero_grad(), loss.backward(), optimizer.step()
        with torch.no_grad():  # every rank validates on all of the val part: the same value
            val = mse_loss(model(x[-n_val:]), y[-n_val:]).item()
        done = (epoch, min(val, done[1]), val)
        if rank == 0:  # rank 0 writes the run dir: a metrics row, the checkpoint (atomic)
            row = {"epoch": epoch, "step": epoch * (shard // batch), "val/loss": val}
            with open(run_dir / ddp_launcher.METRICS_FILE, "a") as f:
                f.write(json.dumps(row | {"train/loss": loss.item()}) + "\n")
            ckpt.parent.mkdir(exist_ok=True)
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
            torch.save(state | {"done": done}, ckpt.with_suffix(".tmp"))
            ckpt.with_suffix(".tmp").replace(ckpt)  # os.replace: atomic
        prune = torch.tensor(int(trial is not None and trial.should_prune(epoch, val)))
        dist.broadcast(prune, src=0)  # rank 0 asked its Optuna trial: every rank stops alike
        if prune.item():
            raise ddp_launcher.Pruned(epoch, val, done[1])
    return done
