"""Evaluate a trained checkpoint, or predict on a folder of images, configured by Hydra.

    python eval.py run=<training run dir>            its best.pt on the test split
    python eval.py ckpt=<file> split=val             any checkpoint; split=train|val|test
    python eval.py run=<dir> split=<folder>          predictions on unlabeled images
    python eval.py run=<dir> dist.nproc_per_node=2   2 ranks (torchrun), every sample once
    python eval.py -m run=<a>,<b> split=val,test     a sweep: every job a torchrun job

A checkpoint carries the config it was trained with: the model and data are rebuilt from it,
with this command line's overrides on top (e.g. dataset.root=... on another machine). The
story, in every rank: find the checkpoint -> join the process group -> build the data ->
rebuild the model and load the weights -> evaluate this rank's exact shard -> all-reduce ->
rank 0 writes eval.json, confusion_matrix.png (and predictions.csv) into this evaluation's own
run dir, a W&B run (job_type=eval) in the training run's group, and result.json (the launcher's
record: its value the split's accuracy, which a sweep's report ranks by). Validation in train.py
computes its metrics with the same code (components/evaluation.py).
"""

if __name__ == "__main__":  # `python eval.py ...`: Hydra first, torch only when a job runs
    from ddp_launcher import entry_point

    from conf import TRUSTED_TARGETS

    entry_point(
        __file__,
        task="eval:main",
        config_name="eval",
        schema="conf.schema",
        trusted_targets=TRUSTED_TARGETS,  # the `_target_`s its configs may name
    )


import logging
import math
import os
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

import conf.schema  # noqa: F401 - registers the typed config schema with Hydra
from components.distributed import data_barrier, init_distributed
from components.eval_record import EvalRecord, EvalReport
from components.evaluation import Predictions, evaluate
from components.manifest import find_checkpoint
from components.precision import memory_format, precision_context, resolve_precision
from components.trained import load_trained, load_weights, trained_config
from data import ImageFiles, build_datasets, eval_loader, loader_options, sample_positions
from data.datasets import SPLITS
from models import build_model

log = logging.getLogger("eval")


def main(cfg: DictConfig) -> float | None:
    """Hydra's task function; returns the split's top-1 accuracy (None for a folder)."""
    # (With dist.nproc_per_node=N, ddp_launcher/torchrun.py's run_task_or_hand_off has handed
    # this to N ranks.)
    return evaluate_checkpoint(cfg)


def evaluate_checkpoint(cfg: DictConfig) -> float | None:
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    path = find_checkpoint(cfg.run, cfg.ckpt)
    ckpt = load_trained(path)
    trained = trained_config(ckpt, cfg, list(HydraConfig.get().overrides.task))
    tc, split = trained.trainer, str(cfg.split)
    record = EvalRecord(out_dir, enabled=int(os.environ.get("RANK", "0")) == 0)
    with init_distributed(cfg.dist, tc.device) as env:
        tc.precision = resolve_precision(tc.precision, env)  # auto: this machine's choice
        splits = build_datasets(
            trained.dataset, local_rank=env.local_rank, barrier=data_barrier(env), seed=trained.seed
        )
        # A split of the dataset, or (any other value) a folder of unlabeled images.
        folder = (
            None
            if split in SPLITS
            else ImageFiles(split, splits.eval_transform, splits.in_channels, splits.image_size)
        )
        dataset = folder or splits.eval_set(split)
        model = build_model(trained.model, splits)
        load_weights(model, ckpt, path)
        model = model.to(env.device, memory_format=memory_format(tc))
        loader = eval_loader(
            splits,
            split,
            dataset=folder,
            batch_size=math.ceil(tc.eval_batch_size / env.world_size),
            **loader_options(
                trained.dataset,
                rank=env.rank,
                world_size=env.world_size,
                seed=trained.seed,
                device=env.device,
            ),
        )
        predictions = Predictions(splits.num_classes) if cfg.predictions or folder else None
        with precision_context(tc.precision, env.device):
            metrics = evaluate(
                model,
                loader,
                env.device,
                tc,
                splits.num_classes,
                labelled=folder is None,
                predictions=predictions,
            )
        metrics.all_reduce()  # every rank's sums and counts: each sample once
        result = metrics.result() if folder is None else None
        rows = predictions.gather(sample_positions(loader)) if predictions else None

    if result is not None:
        log.info(
            "%s on %s: loss %.4f acc %.4f acc5 %.4f ece %.4f (%d samples)",
            path,
            split,
            result.loss,
            result.acc,
            result.acc5,
            result.ece,
            result.count,
        )
    report = EvalReport(
        split=split,
        checkpoint=str(path.resolve()),
        world_size=env.world_size,
        train_wandb_run_id=ckpt["progress"].get("wandb_run_id"),
    )
    record.save(report, result, splits.classes, rows, dataset)
    record.log_wandb(
        trained, ckpt["progress"], report, result, label=split if folder is None else "predict"
    )
    record.write_result(report)
    return result.acc if result is not None else None
