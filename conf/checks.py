"""The experiment's own checks of a job's config, torch-free: what no schema type can say. The
gate (ddp_launcher.RunGate, named in conf/train.yaml's and conf/eval.yaml's hydra.callbacks)
runs them where a run starts, and the launchers for every sweep job before any starts: bad input is
one line naming the key and the fix (a UserError) before anything is written. It also asks
:func:`records` what a dir holds of this experiment's records (a training run, an evaluation):
the launcher package knows no file of them.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ddp_launcher import (
    CHECKPOINT_DIR,
    METRICS_FILE,
    NothingToDo,
    UserError,
    read_metrics,
    read_result,
    resume_choice,
)
from omegaconf import DictConfig, OmegaConf

from components.manifest import committed_entry, find_checkpoint, read_manifest, usable
from components.monitor import Monitor, check_target
from conf.schema import check_keys

PRECISIONS = ("auto", "32", "64", "bf16", "fp16")  # components/precision.py's
# What an evaluation's dir holds: eval.py's record (components/eval_record.py's EVAL_FILE: that
# module imports torch) and its log (conf/eval.yaml's hydra.job.name).
EVAL_RECORDS = ("eval.json", "eval.log")
DEVICES = ("auto", "cpu", "cuda")  # components/distributed.py's


def per_rank_batch(global_batch: int, world_size: int, accumulate: int = 1) -> int:
    """The micro-batch each rank runs: global batch / (world size x accumulation steps)."""
    parts = world_size * accumulate
    if accumulate < 1:
        raise UserError(f"trainer.accumulate_grad_batches={accumulate}: use a positive integer")
    if global_batch <= 0:
        raise UserError(f"trainer.batch_size={global_batch}: use a positive integer")
    if global_batch % parts:
        fix = max(parts, round(global_batch / parts) * parts)
        what = f"the world size {world_size}" + (
            f" x trainer.accumulate_grad_batches={accumulate}" if accumulate > 1 else ""
        )
        raise UserError(
            f"trainer.batch_size={global_batch} (the global batch) is not divisible by {what}: "
            f"use a multiple of {parts}, e.g. trainer.batch_size={fix}"
        )
    return global_batch // parts


def check_batch_size(config: DictConfig, world_size: int) -> None:
    """A job's global `trainer.batch_size` must split evenly over its ranks (and accumulation
    steps): checked before any rank starts, as in the ranks. Configs without a `trainer` node are
    not checked."""
    trainer = OmegaConf.select(config, "trainer")
    if not isinstance(trainer, DictConfig) or "batch_size" not in trainer:
        return
    accumulate = OmegaConf.select(trainer, "accumulate_grad_batches", default=1)
    per_rank_batch(int(trainer.batch_size), world_size, int(accumulate))


def check_train(cfg: DictConfig, world_size: int, run_dir: Path) -> None:
    """train.py's: the trainer's values, the batch over `world_size` ranks, the monitor, and a
    resume checkpoint that exists, is whole and fits this model."""
    tc = cfg.trainer
    check_keys(cfg)  # a `+key` no schema field reads: a typo
    check_batch_size(cfg, world_size)
    check_trainer(tc)
    Monitor(  # its own checks: mode, patience, min_delta, target
        tc.monitor.metric,
        tc.monitor.mode,
        tc.early_stopping.patience,
        tc.early_stopping.min_delta,
        target=tc.target,
    )
    check_resume(cfg, run_dir)
    check_init_from(cfg)


def records(path: Path) -> str | None:
    """What `path` holds of this experiment's records (the gate's `records` hook): "eval" for
    an evaluation (eval.json, or eval.py's log), "train" for a training run (its result.json, a
    metrics.jsonl row, a checkpoint), None for neither. The gate plans a start from it and
    refuses one into or inside another run's dir (eval.py never writes into a training run)."""
    path = Path(path)
    if any((path / name).is_file() for name in EVAL_RECORDS):
        return "eval"
    ckpt = path / CHECKPOINT_DIR
    if (
        read_result(path) is not None
        or read_metrics(path / METRICS_FILE)
        or (ckpt.is_dir() and any(ckpt.glob("*.pt")))
    ):
        return "train"
    return None


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
    check_target(tc.monitor.metric, tc.target)
    if tc.stop_at_target and tc.target is None:
        raise UserError(
            "trainer.stop_at_target=true needs a trainer.target: set one, e.g. trainer.target=0.99"
        )
    if tc.progress_every_s <= 0:
        raise UserError(f"trainer.progress_every_s={tc.progress_every_s}: use a positive number")
    smoothing = tc.label_smoothing  # (F.cross_entropy refuses > 1 in a traceback, trains < 0 as 0)
    if not (math.isfinite(smoothing) and 0.0 <= smoothing < 1.0):
        raise UserError(
            f"trainer.label_smoothing={smoothing} is not valid: use a number >= 0 and < 1 "
            "(0: none; 0.1 is common)"
        )
    for key, allowed in (("precision", PRECISIONS), ("device", DEVICES)):
        if str(tc[key]) not in allowed:
            raise UserError(
                f"trainer.{key}={tc[key]} is not valid: use {', '.join(allowed[:-1])} or "
                f"{allowed[-1]}"
            )


def checkpoint_fit(cfg: DictConfig) -> dict[str, Any]:
    """What a checkpoint records of its run (its manifest entry's `fit`) and a resume of it must
    match: the model and the optimizer whose state it holds."""
    return {
        "model": OmegaConf.to_container(cfg.model, resolve=True),
        "optim": OmegaConf.select(cfg, "optim._target_", default=None),
    }


def check_resume(cfg: DictConfig, run_dir: Path) -> None:
    """resume=<file>: a checkpoint file, whole; resume=<file> and resume=auto: one saved by a
    run this run's model and optimizer fit (where its manifest says what it was saved with)."""
    resume = resume_choice(cfg.resume, say=False)
    if resume is None:
        return
    if resume == "auto":
        entry = last_entry(run_dir)
        where = Path(run_dir) / CHECKPOINT_DIR / "last.pt"
    else:
        where = resume
        usable(where, "resume")
        check_own_checkpoint(where, run_dir)
        entry = committed_entry(where)
    differ = differences(entry.fit, checkpoint_fit(cfg)) if entry and entry.fit else []
    if differ:  # (without a record of its fit, the ranks' load checks it)
        raise UserError(
            f"checkpoint {where} does not fit this model/optimizer (saved with other "
            f"{', '.join(differ)}): resume with the config it was saved with, or resume=null"
        )
    if resume == "auto":
        check_more_to_do(cfg, run_dir)


def check_own_checkpoint(path: Path, run_dir: Path) -> None:
    """A resume file inside the run dir is one of its own checkpoints (in checkpoints/), or one
    an earlier start set aside (in replaced/): the gate continues the first and starts anew
    from the second; anything else there is neither."""
    try:
        inside = Path(path).resolve().relative_to(Path(run_dir).resolve())
    except ValueError:
        return  # another run's
    if inside.parts[:1] not in ((CHECKPOINT_DIR,), ("replaced",)):
        raise UserError(
            f"resume={path} is inside this run dir but not one of its checkpoints: pass "
            f"resume=<its {CHECKPOINT_DIR}/last.pt> or resume=auto to continue it, or copy the "
            "file out of the run dir"
        )


def check_init_from(cfg: DictConfig) -> None:
    """init_from=<checkpoint>: a whole checkpoint file whose model this run's is (where its
    manifest says what it was saved with); never together with resume=<file>."""
    init = OmegaConf.select(cfg, "init_from", default=None)
    if not init:
        return
    resume = resume_choice(cfg.resume, say=False)
    if resume is not None and resume != "auto":
        raise UserError(
            f"init_from={init} and resume={cfg.resume} both name a checkpoint: resume=<file> "
            "continues that run (optimizer, schedule, epochs, best), init_from=<file> starts a "
            "new run from its weights alone: pass one of them"
        )
    path = Path(str(init)).expanduser()
    usable(path, "init_from")
    entry = committed_entry(path)
    saved = (entry.fit or {}).get("model") if entry is not None else None
    ours = checkpoint_fit(cfg)["model"]
    differ = differences({"model": saved}, {"model": ours}) if saved is not None else []
    if differ:
        raise UserError(
            f"init_from={init} holds another model than this run's (saved with other "
            f"{', '.join(differ)}): pass the model it was trained with, or another checkpoint"
        )


def check_more_to_do(cfg: DictConfig, run_dir: Path) -> None:
    """resume=auto on a run that completed: NothingToDo (one line, nothing changes) unless it
    is asked for more epochs than it trained (and did not stop early or at its target)."""
    earlier = read_result(run_dir)
    if earlier is None or earlier.status != "completed":
        return
    own = earlier.app  # this experiment's part of result.json (components/metrics.py)
    done = own.get("epochs") or 0
    stopped = own.get("stopped_early") or own.get("stopped_at_target")
    if cfg.trainer.max_epochs > done and not stopped:
        return  # trained further: the schedule's change is said as it resumes
    why = (
        "it stopped early"
        if own.get("stopped_early")
        else f"trainer.max_epochs={cfg.trainer.max_epochs}"
    )
    if own.get("stopped_at_target"):
        why = "it stopped at its target"
    raise NothingToDo(
        f"{run_dir} holds a completed run ({done} epochs; {why}): nothing to continue, "
        "nothing changed; a larger trainer.max_epochs trains it further, start_over=true "
        "starts it over"
    )


def differences(saved: dict[str, Any], ours: dict[str, Any]) -> list[str]:
    """The keys (one level deep, dotted) whose values differ between two fits."""
    found = []
    for part in sorted(set(saved) | set(ours)):
        a, b = saved.get(part), ours.get(part)
        if isinstance(a, dict) and isinstance(b, dict):
            found += [f"{part}.{k}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        elif a != b:
            found.append(part)
    return found


def check_eval(cfg: DictConfig, world_size: int, run_dir: Path) -> None:
    """eval.py's: the checkpoint it names exists and is whole."""
    path = find_checkpoint(cfg.run, cfg.ckpt)
    usable(path, "ckpt")


def last_entry(run_dir: Path):
    """The manifest entry of the run dir's committed last.pt (None: none committed)."""
    manifest = read_manifest(Path(run_dir) / CHECKPOINT_DIR)
    return manifest.files[manifest.last] if manifest and manifest.last else None


def resume_point(cfg: DictConfig, run_dir: Path) -> str | None:
    """Where a job that continues in `run_dir` picks up (the dry run's `resume` column, asked
    through the gate's `progress` hook): the step and epoch of its committed checkpoint; None:
    none to continue from."""
    entry = last_entry(run_dir)
    return None if entry is None else f"step {entry.step} (epoch {entry.epochs})"
