"""The experiment's own checks of a job's config, torch-free: what no schema type can say. The
gate (ddp_launcher.RunGate, named in conf/train.yaml's and conf/eval.yaml's hydra.callbacks)
runs them where a run starts, and the launchers for every sweep job before any starts: bad input is
one line naming the key and the fix (a UserError) before anything is written. It also asks
:func:`records` what a dir holds of this experiment's records (a training run, an evaluation):
the launcher package knows no file of them.
"""

from __future__ import annotations

import difflib
import functools
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
from data.image_tree import check_image_tree

PRECISIONS = ("auto", "32", "64", "bf16", "fp16")  # components/precision.py's
# What an evaluation's dir holds: eval.py's record (components/eval_record.py's EVAL_FILE: that
# module imports torch) and its log (conf/eval.yaml's hydra.job.name).
EVAL_RECORDS = ("eval.json", "eval.log")
DEVICES = ("auto", "cpu", "cuda")  # components/distributed.py's
SCALINGS = ("none", "linear", "sqrt")  # components/optim.py's
NONFINITE = ("error", "skip")  # components/train_step.py's
# The largest lr an optimizer may be handed (optim.lr after lr_scaling to the global batch).
# float32 weights end at 3.4e38, and the lr is multiplied further on its way into an update (the
# warm-up's and schedule's factors are <= 1, but Adam's bias correction divides by up to
# 1 - beta1, x10 at 0.9, and weight decay multiplies it): 1e30 leaves them eight orders of
# magnitude. (1e12 trains, as a non-finite loss named with its step; 1e308 overflowed in a
# traceback: x the linear scaling's batch ratio it is inf, and torch cannot hand it to a
# float32 kernel.)
MAX_LR = 1e30
SEED_LIMIT = 2**32  # numpy's generators (data/seeding.py, DataLoader workers) take no more
# What resume= slips were meant to be (resume=AUTO, resume=true): resume=auto
RESUME_WORDS = ("auto", "null")
MEANT_AUTO = ("true", "yes", "on", "last", "latest", "1")


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
    check_values(cfg)
    Monitor(  # its own checks: mode, patience, min_delta, target
        tc.monitor.metric,
        tc.monitor.mode,
        tc.early_stopping.patience,
        tc.early_stopping.min_delta,
        target=tc.target,
    )
    check_resume(cfg, run_dir)
    check_init_from(cfg)
    check_dataset(cfg.dataset)


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
    if not (math.isfinite(tc.progress_every_s) and tc.progress_every_s > 0):
        raise UserError(f"trainer.progress_every_s={tc.progress_every_s}: use a positive number")
    if tc.nonfinite not in NONFINITE:  # (another word neither stopped nor skipped a NaN update)
        raise UserError(f"trainer.nonfinite={tc.nonfinite} is not valid: use error or skip")
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


def check_values(cfg: DictConfig) -> None:
    """The values a run would otherwise take into training, or fail on in a traceback after
    its run dir opened: one line each, naming the key and what it takes."""
    tc = cfg.trainer
    clip = tc.grad_clip
    if clip is not None and not (math.isfinite(clip) and clip > 0):  # (-1 flipped gradients)
        raise UserError(
            f"trainer.grad_clip={clip} is not valid: use a gradient norm > 0 (e.g. "
            "trainer.grad_clip=1.0), or trainer.grad_clip=null for no clipping"
        )
    check_lr(cfg.optim, tc.batch_size)
    if not (math.isfinite(tc.warmup_epochs) and tc.warmup_epochs >= 0):
        raise UserError(
            f"trainer.warmup_epochs={tc.warmup_epochs} is not valid: use a number of epochs "
            ">= 0 (0: no warm-up)"
        )
    seed = cfg.seed
    if not 0 <= seed < SEED_LIMIT:
        raise UserError(
            f"seed={seed} is out of range: use an integer from 0 to {SEED_LIMIT - 1} "
            "(numpy's generators take no more), e.g. seed=0"
        )
    check_fractions(cfg)
    check_timeouts(cfg)
    wait = OmegaConf.select(cfg, "wandb.init_timeout_s", default=None)
    if wait is not None and not (math.isfinite(wait) and wait > 0):
        raise UserError(
            f"wandb.init_timeout_s={wait} is not valid: use a number of seconds > 0, e.g. "
            "wandb.init_timeout_s=60"
        )
    check_start_over(cfg)


def check_timeouts(cfg: DictConfig) -> None:
    """dist.timeout_s (and step_timeout_s, unless null) at least a second: 0 failed the first
    collective ("timed out after 0ms", exit 1)."""
    for key, example in (("timeout_s", 600), ("step_timeout_s", 300)):
        value = OmegaConf.select(cfg, f"dist.{key}", default=None)
        if value is None:
            continue
        if not value >= 1:
            raise UserError(
                f"dist.{key}={value} is not valid: use a number of seconds >= 1 (a collective "
                f"that takes longer fails), e.g. dist.{key}={example}"
                + (", or null to keep dist.timeout_s" if key == "step_timeout_s" else "")
            )


def check_lr(optim: DictConfig, global_batch: int) -> None:
    """optim.lr: a finite number > 0 whose value after lr_scaling (what the optimizer gets) is
    at most MAX_LR; every other number of optim.* finite (NaN passes torch's own checks)."""
    lr, scaling = optim.get("lr"), str(optim.get("lr_scaling", "none"))
    for key in optim:
        value = optim[key]
        values = list(value) if OmegaConf.is_list(value) else [value]
        if any(isinstance(v, float) and not math.isfinite(v) for v in values) and key != "lr":
            raise UserError(f"optim.{key}={value} is not a number: use a finite value")
    if lr is None or scaling not in SCALINGS:
        return  # (the optimizer's own checks, and components/optim.py's, say what is wrong)
    base = optim.get("base_batch_size", global_batch) or global_batch
    ratio = global_batch / base if base > 0 else 1.0
    factor = {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(max(ratio, 0.0))}[scaling]
    used = lr * factor  # (inf where it overflows)
    if math.isfinite(lr) and lr > 0 and used <= MAX_LR:
        return
    scaled = f" ({scaling}-scaled to the global batch {global_batch}: {used:g})" * (factor != 1)
    raise UserError(
        f"optim.lr={lr}{scaled} is not valid: use a learning rate > 0 and at most {MAX_LR:g} "
        "after optim.lr_scaling (beyond, the schedule's and the optimizer's arithmetic "
        f"overflows float32), e.g. optim.lr={default_lr(optim):g}"
    )


def default_lr(optim: DictConfig) -> float:
    """The optimizer's own default lr in conf/schema.py (0.1: SGD's), for a message's example."""
    import dataclasses

    schema = OmegaConf.get_type(optim)
    if dataclasses.is_dataclass(schema):
        for f in dataclasses.fields(schema):
            if f.name == "lr" and isinstance(f.default, float):
                return f.default
    return 0.1


# (key, low, high, low included, high included, the line's fix): fractions, probabilities and
# other bounded numbers (the messages of data/, components/ where they are used, said earlier)
MIXUP = "is out of range: alphas >= 0, probabilities in [0, 1]"  # data/mixing.py's
HOLDOUT = "is out of range: use a fraction between 0.01 and 0.99"  # data/datasets.py's
BOUNDED = (
    ("dataset.val_fraction", 0, 1, False, False, HOLDOUT),
    ("dataset.test_fraction", 0, 1, False, False, HOLDOUT),
    ("trainer.mixup.mixup_alpha", 0, math.inf, True, False, MIXUP),
    ("trainer.mixup.cutmix_alpha", 0, math.inf, True, False, MIXUP),
    ("trainer.mixup.prob", 0, 1, True, True, MIXUP),
    ("trainer.mixup.switch_prob", 0, 1, True, True, MIXUP),
    ("augment.random_erasing", 0, 1, True, True, "must be in [0, 1]"),
    ("trainer.ema.decay", 0, 1, False, False, "must be in (0, 1), e.g. 0.999, or null"),
)


def check_fractions(cfg: DictConfig) -> None:
    """Fractions, probabilities and other bounded numbers finite and in their range (NaN
    compares False to every bound: it trained as if unset, or failed converting to a sample
    count in a traceback)."""
    for key, low, high, with_low, with_high, fix in BOUNDED:
        value = OmegaConf.select(cfg, key, default=None)
        if value is None or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        above = value >= low if with_low else value > low
        below = value <= high if with_high else value < high
        if not (not math.isnan(value) and above and below):
            raise UserError(f"{key}={value} {fix}")
    val = OmegaConf.select(cfg, "dataset.val_fraction", default=None)
    test = OmegaConf.select(cfg, "dataset.test_fraction", default=None)
    if val is not None and test is not None and float(val) + float(test) > 0.9:
        raise UserError(  # (data/catalog.py's digits: train keeps >= ~18 scans per class)
            f"dataset.val_fraction={val} + dataset.test_fraction={test} leave too few "
            "training scans: keep their sum <= 0.9"
        )
    for key in ("trainer.limit_train_batches", "trainer.limit_val_batches"):
        check_limit(OmegaConf.select(cfg, key, default=None), key)


def check_limit(limit: Any, key: str) -> None:
    """A trainer.limit_* setting: null, a count >= 1 or a fraction in (0, 1]."""
    if limit is None:
        return
    count = isinstance(limit, int) and not isinstance(limit, bool) and limit >= 1
    fraction = isinstance(limit, float) and 0 < limit <= 1
    if not (count or fraction):
        raise UserError(
            f"{key}={limit} is not valid: use null, a count >= 1 or a fraction in (0, 1]"
        )


def check_start_over(cfg: DictConfig) -> None:
    """resume=auto continues the run dir's run; start_over=true starts it over: never both."""
    if str(cfg.get("resume")) == "auto" and cfg.get("start_over"):
        raise UserError(
            "resume=auto and start_over=true contradict each other (continue the run dir's run, "
            "or start it over there): drop one, e.g. start_over=false to continue it"
        )


def check_dataset(dataset: DictConfig) -> None:
    """An image folder's tree (dataset=imagefolder, imagenet), as its ranks would read it:
    checked here, before the run dir opens (data/image_tree.py: links back into the dataset,
    class folders without an image, or without a readable one under skip_unreadable)."""
    target = str(dataset.get("_target_", ""))
    if target not in ("data.catalog.imagefolder", "data.catalog.imagenet"):
        return
    if "root" not in dataset or OmegaConf.is_missing(dataset, "root") or not dataset.root:
        return  # (the dataset says it needs a root, naming the key)
    root = dataset.root
    splits = ("train", "val") if target.endswith("imagenet") else ("train", "val", "test")
    checked_tree(str(root), splits, bool(dataset.get("skip_unreadable", False)))


@functools.lru_cache(maxsize=8)
def checked_tree(root: str, splits: tuple[str, ...], skip_unreadable: bool) -> None:
    """check_image_tree once per tree in this process: a sweep's launcher checks each job
    before it starts, and its jobs mostly share one dataset (ImageNet's walk lists 1.3 M files).
    A tree found bad raises, and is not remembered."""
    check_image_tree(root, splits, skip_unreadable=skip_unreadable)


def meant_resume(resume: str | Path) -> str | None:
    """What a `resume` that is not a file was meant to be (resume=AUTO, resume=true: auto;
    resume=nul: null), or None: a path, said missing where it is checked."""
    if resume == "auto" or Path(resume).exists() or len(Path(resume).parts) > 1:
        return None
    word = str(resume).lower()
    if word in MEANT_AUTO:
        return "auto"
    near = difflib.get_close_matches(word, RESUME_WORDS, n=1, cutoff=0.6)
    return near[0] if near and Path(resume).suffix != ".pt" else None


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
    meant = meant_resume(resume)
    if meant is not None:
        raise UserError(
            f"resume={cfg.resume} is none of auto, null or an existing checkpoint file: did you "
            f"mean resume={meant}?"
        )
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
    """eval.py's: the checkpoint it names exists and is whole, the eval dir is not the training
    run it evaluates (whatever that dir holds yet); its own world's timeouts and batch."""
    check_timeouts(cfg)
    batch = cfg.trainer.eval_batch_size  # (0 was torch's split_size traceback mid-evaluation)
    if batch < 1:
        raise UserError(f"trainer.eval_batch_size={batch} is not valid: use an integer >= 1")
    if cfg.run and Path(str(cfg.run)).resolve() == Path(run_dir).resolve():
        raise UserError(
            f"{run_dir} holds a training run: eval.py writes into a dir of its own, never "
            "into a training run: drop hydra.run.dir or choose another one"
        )
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
