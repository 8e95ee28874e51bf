"""Typed schema of the training config, registered in Hydra's ConfigStore.

Every YAML under conf/ extends one of these dataclasses (its first defaults entry), so a
typo'd key or a wrong type fails at composition with Hydra's own error. One dataclass per
config group, mirroring the code that consumes it.
"""

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf


@dataclass
class TorchvisionModelConfig:
    """Any torchvision classification model by name (models/torchvision.py)."""

    _target_: str = "models.torchvision.build_torchvision_model"
    name: str = MISSING
    # 3x3 stride-1 first conv and no max-pool: keeps 32x32 (or smaller) inputs from being
    # downsampled to nothing by an ImageNet stem.
    small_input_stem: bool = False


@dataclass
class SmallCNNConfig:
    """A small CNN for 8x8 digits / 28x28 MNIST-sized inputs (models/small_cnn.py)."""

    _target_: str = "models.small_cnn.SmallCNN"
    channels: list[int] = field(default_factory=lambda: [32, 64])
    hidden: int = 128
    dropout: float = 0.0
    batch_norm: bool = False


@dataclass
class DatasetConfig:
    """A dataset by `_target_` (data/datasets.py): a function returning a data.DataSource.
    Every key but the loader's two below is an argument of that function."""

    _target_: str = MISSING
    # DataLoader workers per rank: auto (this rank's share of the cores, less the one it trains on:
    # data/loaders.py's data_workers) or an integer >= 0 (0: load in the rank itself)
    num_workers: str = "auto"
    # Sets held in memory (digits, MNIST family, CIFAR) as one uint8 tensor on the training
    # device, batches built with tensor ops (data/fast.py); false: the DataLoader path.
    fast: bool = True


@dataclass
class TorchvisionDatasetConfig(DatasetConfig):
    """mnist, fashion_mnist, cifar10, cifar100 (data/catalog.py): the official test set is
    test; val is carved from the training set."""

    root: str = "${oc.env:HYDRA_DDP_DATA,data_cache}"
    download: bool = False
    val_fraction: float = 0.1  # of the training set, stratified by class, fixed seed


@dataclass
class ImageFolderDatasetConfig(DatasetConfig):
    """imagenet and imagefolder (data/catalog.py): image files, resized to image_size."""

    root: str = MISSING
    download: bool = False  # never possible; kept so that asking for it names the fix
    image_size: int = 224
    val_fraction: float = 0.1  # carved from train where the set has no val split of its own
    # true: leave out files that are not readable images (empty, no image header, cut short),
    # counted in one warning; false: such a file stops the run naming it
    skip_unreadable: bool = False


@dataclass
class DigitsDatasetConfig(DatasetConfig):
    """scikit-learn's digits (data/catalog.py), partitioned into train/val/test."""

    val_fraction: float = 0.1  # of all 1797 scans, stratified by class, fixed seed
    test_fraction: float = 0.1


@dataclass
class FakeDatasetConfig(DatasetConfig):
    """torchvision FakeData (data/catalog.py): random images, size // 5 each for val/test."""

    size: int = 1000
    image_size: int = 32
    num_classes: int = 10


@dataclass
class AugmentConfig:
    """A train augmentation recipe (data/transforms.py Recipe), built by instantiate. Order:
    crop -> flip -> policy -> transforms -> normalise -> random erasing. Each dataset config
    picks a default choice (conf/dataset/*.yaml); `augment=<choice>` overrides it."""

    _target_: str = "data.transforms.Recipe"
    _convert_: str = "all"
    crop: str = "none"  # none | pad (padded random crop) | resized (RandomResizedCrop)
    padding: int | None = None  # pad: pixels on every side; null: image side // 8 (>= 1)
    scale: list[float] = field(default_factory=lambda: [0.08, 1.0])  # resized: area fraction
    ratio: list[float] = field(default_factory=lambda: [0.75, 4 / 3])  # resized: aspect
    flip: bool = False  # horizontal flip with probability 1/2
    policy: Any = None  # an automatic policy: a v2 transform config (schema/augment/policy)
    transforms: list[Any] = field(default_factory=list)  # your own v2 transforms (_target_)
    random_erasing: float = 0.0  # probability of v2.RandomErasing (timm's --reprob)


@dataclass
class TrivialAugmentConfig:
    _target_: str = "torchvision.transforms.v2.TrivialAugmentWide"
    num_magnitude_bins: int = 31


@dataclass
class RandAugmentConfig:
    _target_: str = "torchvision.transforms.v2.RandAugment"
    num_ops: int = 2
    magnitude: int = 9  # of num_magnitude_bins (timm's rand-m9)
    num_magnitude_bins: int = 31


@dataclass
class AutoAugmentConfig:
    _target_: str = "data.transforms.auto_augment"
    policy: str = "imagenet"  # imagenet | cifar10 | svhn


@dataclass
class DistConfig:
    """World size and process group (components/distributed.py)."""

    # "auto" or a positive integer. Under torchrun, auto takes the environment's values and an
    # explicit value must match it. In a sweep, auto takes the launcher's own key
    # (hydra.launcher.nproc_per_node=2, torchrun's name) and an explicit value wins over it;
    # where neither says, auto means every visible GPU (1 on CPU).
    nproc_per_node: str = "auto"
    nnodes: str = "auto"
    backend: str = "auto"  # auto | nccl | gloo
    # The launcher's key: auto | cpu | cuda; cpu runs the ranks on the CPU (auto: 1 of them, no
    # GPU reserved). conf/dist/*.yaml set it from trainer.device, which the ranks train on.
    device: str = "auto"
    timeout_s: int = 600
    # Collective timeout once the first step is done (startup, downloads and compilation are
    # slow; a stuck step should fail fast). null keeps timeout_s.
    step_timeout_s: int | None = 300
    sync_batchnorm: bool = False
    find_unused_parameters: bool = False
    gradient_as_bucket_view: bool = True
    static_graph: bool = False
    bucket_cap_mb: float = 25.0
    # DDP even for a single rank (otherwise skipped: nothing to synchronise): checks DDP's
    # reducer, and compile's DDPOptimizer, on one GPU (docs/bench/gpu.py).
    force_ddp: bool = False


@dataclass
class OptimConfig:
    """A torch.optim optimizer (instantiated as a partial over parameter groups) plus the
    recipe keys components/optim.py reads itself (lr_scaling, base_batch_size,
    decay_norm_and_bias); every other key is the optimizer's own argument."""

    _target_: str = MISSING
    _partial_: bool = True
    lr: float = 0.1  # at base_batch_size; scaled to the global batch by lr_scaling
    weight_decay: float = 0.0
    # The lr used is lr x (trainer.batch_size / base_batch_size) (linear), its square root
    # (sqrt), or lr as given (none).
    lr_scaling: str = "linear"
    base_batch_size: int = 256
    # false: no weight decay on norm weights and biases (every parameter with ndim <= 1), as
    # timm does; true: weight decay on every parameter.
    decay_norm_and_bias: bool = False


@dataclass
class SGDConfig(OptimConfig):
    _target_: str = "torch.optim.SGD"
    momentum: float = 0.9
    nesterov: bool = False


@dataclass
class AdamWConfig(OptimConfig):
    _target_: str = "torch.optim.AdamW"
    lr: float = 1e-3
    weight_decay: float = 0.01
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8


@dataclass
class NAdamConfig(AdamWConfig):
    """NAdam; decoupled_weight_decay=true is NAdamW."""

    _target_: str = "torch.optim.NAdam"
    lr: float = 2e-3
    momentum_decay: float = 4e-3
    decoupled_weight_decay: bool = True


@dataclass
class AdafactorConfig(OptimConfig):
    """Adafactor: factored second moments (memory ~ rows + columns per matrix)."""

    _target_: str = "torch.optim.Adafactor"
    lr: float = 1e-2
    weight_decay: float = 0.0
    beta2_decay: float = -0.8
    d: float = 1.0  # update clipping threshold


@dataclass
class MixupConfig:
    """Batch-level MixUp / CutMix (torchvision.transforms.v2), soft targets; both alphas 0: off."""

    mixup_alpha: float = 0.0  # Beta(alpha, alpha) mixing weight; 0: no MixUp
    cutmix_alpha: float = 0.0  # 0: no CutMix
    prob: float = 1.0  # probability that a batch is mixed at all
    switch_prob: float = 0.5  # with both alphas > 0: probability of CutMix instead of MixUp


@dataclass
class EmaConfig:
    """Exponential moving average of the weights (torch.optim.swa_utils.AveragedModel)."""

    decay: float | None = None  # e.g. 0.999; null: off
    every_n_steps: int = 1  # update the average every N optimizer steps
    evaluate: bool = True  # also validate the EMA weights each epoch (val_ema/* metrics)


@dataclass
class MonitorConfig:
    """The metric that picks best.pt, the value returned to sweepers and the sweep summary's
    ranking: any validation metric (val/acc, val/loss, val_ema/acc, ...)."""

    metric: str = "val/acc"
    mode: str = "max"  # max: higher is better | min: lower is better


@dataclass
class EarlyStoppingConfig:
    """Stop when the monitored metric has not improved by more than min_delta for `patience`
    validations in a row; rank 0's decision is broadcast, so every rank stops together."""

    patience: int | None = None  # null: off
    min_delta: float = 0.0


@dataclass
class ProfileConfig:
    """torch.profiler over train steps (components/profiling.py): skip `wait`, warm up for
    `warmup`, record `active` steps, once."""

    wait: int = 2
    warmup: int = 2
    active: int = 5
    record_shapes: bool = False
    profile_memory: bool = False


@dataclass
class TrainerConfig:
    max_epochs: int = 10
    batch_size: int = 64  # GLOBAL batch; each rank takes batch_size / world size
    eval_batch_size: int = 256  # global
    log_every_n_steps: int = 10
    device: str = "auto"  # auto | cpu | cuda
    grad_clip: float | None = None
    # 32 | 64 | bf16 | fp16 (autocast; a GradScaler for fp16 only) | auto: bf16 where this
    # machine's GPU or CPU has it natively, else 32 (components/precision.py; one log line)
    precision: str = "32"
    # Micro-batches per optimizer step; DDP syncs gradients on the last one only (no_sync).
    # trainer.batch_size stays the global batch per optimizer step.
    accumulate_grad_batches: int = 1
    channels_last: bool = False
    compile: bool = False  # torch.compile the DDP-wrapped model (DDPOptimizer: overlap)
    # cuDNN tries each convolution's algorithms on its first input shape and keeps the fastest
    # (torch.backends.cudnn.benchmark). On: a run's shapes are fixed (one image size, full
    # train batches), so the search is paid once, in the first step. GPU only.
    cudnn_benchmark: bool = True
    # precision=32 on a GPU with TF32 (compute capability 8.0+): true runs matmuls and
    # convolutions in TF32 (torch's default: convolutions only), false both in full FP32, null
    # leaves torch's settings as set before the run. The run's facts say which (matmul_math).
    tf32: bool | None = True
    lr_schedule: str = "cosine"  # cosine | constant, stepped per optimizer step
    warmup_epochs: float = 1.0  # linear warm-up from ~0 to the lr, then the schedule
    label_smoothing: float = 0.0  # of the train loss (F.cross_entropy's label_smoothing)
    mixup: MixupConfig = field(default_factory=MixupConfig)
    ema: EmaConfig = field(default_factory=EmaConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    early_stopping: EarlyStoppingConfig = field(default_factory=EarlyStoppingConfig)
    # A value of the monitored metric (trainer.monitor; null: off): the first validation at it
    # is recorded with the seconds from process start and the step (result.json's `target`,
    # the W&B summary's target/*, the sweep summary's column); stop_at_target=true then ends
    # the run there, as its last epoch would (checkpoint saved, best.pt tested).
    target: float | None = None
    stop_at_target: bool = False
    progress_bar: bool = True  # rank 0 only, and only when stdout is a TTY
    # Without a TTY (SLURM logs, files): a plain progress line every this many seconds.
    progress_every_s: float = 30.0
    # Debugging (conf/debug/): train/validate on part of each epoch (a count of optimizer
    # steps / of each rank's val batches, or a fraction in (0, 1]; null: all of it);
    # overfit_batches: the same first N batches every epoch, unshuffled; save_checkpoints=false
    # writes none (and skips test_after_fit); profile: torch.profiler over a window of steps;
    # detect_anomaly: torch.autograd's anomaly detection (slow: names the op of a NaN/inf).
    limit_train_batches: Any = None
    limit_val_batches: Any = None
    overfit_batches: int | None = None
    save_checkpoints: bool = True
    profile: ProfileConfig | None = None
    detect_anomaly: bool = False
    # Checkpoint every N optimizer steps (null: at each epoch end only, which always happens).
    checkpoint_every_n_steps: int | None = None
    keep_checkpoints: int = 2  # newest step checkpoints kept (best.pt is kept besides)
    nonfinite: str = "error"  # error: stop naming step and rank | skip: skip that update
    # How often ranks agree on a pending SIGTERM/SIGUSR1 (a tiny all-reduce on CPU).
    preemption_check_every_n_steps: int = 10
    # After the last epoch, evaluate best.pt on the dataset's test split (exact, all ranks):
    # test/* in metrics.jsonl, W&B and result.json. Nothing is ever chosen on test.
    test_after_fit: bool = True


class WandbMode(Enum):
    """auto: online when W&B credentials exist (WANDB_API_KEY or ~/.netrc), else offline."""

    auto = "auto"
    online = "online"
    offline = "offline"
    disabled = "disabled"


class CheckpointPolicy(Enum):
    """Which checkpoints become W&B artifacts (components/wandb_media.py). best (default): the
    one you evaluate or deploy, uploaded only when val improves (often early, rarely late),
    never the mid-epoch ones; all: one upload per checkpoint saved; last: one upload, at the
    end; none: for very large models, or an offline run with little room in W&B's staging dir
    (each logged checkpoint is copied there until `wandb sync`)."""

    none = "none"
    best = "best"  # best.pt whenever it changes, aliases best + latest
    last = "last"  # the newest checkpoint once, when the run ends
    all = "all"  # every checkpoint saved: epoch ends, checkpoint_every_n_steps, preemption


class WatchMode(Enum):
    """wandb.watch: histograms of rank 0's gradients and/or parameters every log step."""

    off = "off"
    gradients = "gradients"
    parameters = "parameters"
    all = "all"


@dataclass
class WandbConfig:
    # An enum, so `wandb.mode=onlin` fails at composition. conf/wandb/default.yaml takes
    # WANDB_MODE / WANDB_PROJECT / WANDB_ENTITY from the environment when they are set.
    mode: WandbMode = WandbMode.auto
    project: str = "hydra-ddp"
    entity: str | None = None
    group: str | None = None
    name: str | None = None
    job_type: str = "train"
    tags: list[str] = field(default_factory=list)
    # wandb.init waits at most this long; past it training goes on without W&B.
    init_timeout_s: float = 60.0
    # Per-class accuracy (table + bar plot), the confusion matrix and the val/samples image
    # table every N epochs and at the last (0: never), from the exact distributed validation.
    media_every_n_epochs: int = 1
    # Val images in val/samples: a fixed subset, the same in every epoch and run (0: none).
    num_images: int = 32
    log_checkpoints: CheckpointPolicy = CheckpointPolicy.best
    watch: WatchMode = WatchMode.off


@dataclass
class TrainConfig:
    model: Any = MISSING
    dataset: Any = MISSING  # typed by each choice's own schema (a user's may have none)
    # Chosen by each dataset config's defaults list (`- /augment@_global_.augment: <choice>`);
    # `augment=<choice>` overrides it. A dataset config without one: no augmentation.
    augment: AugmentConfig = field(default_factory=AugmentConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    optim: Any = MISSING
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    seed: int = 0
    # null: start fresh; auto: continue from <run dir>/checkpoints/last.pt if it exists;
    # a path: continue from that checkpoint file (another run's: a run of its own here that
    # continues that run's training state: optimizer, schedule, epoch count, best).
    resume: str | None = None
    # A checkpoint whose weights a new run starts from (fine-tuning): new optimizer, lr
    # schedule, epoch count and best; resume=auto in the same dir continues this run itself.
    init_from: str | None = None
    # A run dir holds one run: rerunning one that holds a run without resume is refused, unless
    # start_over=true, which moves the old run into <run dir>/replaced/<time>/ and starts anew.
    start_over: bool = False


def open_node() -> Any:
    """An empty node that takes any key: eval.py's `model.*` / `dataset.*` overrides can only
    be checked against the checkpoint's own config (components/trained.py)."""
    node = OmegaConf.create({})
    OmegaConf.set_struct(node, False)
    return node


@dataclass
class EvalConfig:
    """eval.py: the training groups (only what the command line overrides is taken; the rest
    comes from the checkpoint's own config), plus what to evaluate."""

    model: Any = field(default_factory=open_node)
    dataset: Any = field(default_factory=open_node)
    dist: DistConfig = field(default_factory=DistConfig)  # the evaluation's own world size
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    run: str | None = None  # a training run dir: evaluates its checkpoints/best.pt
    ckpt: str | None = None  # a checkpoint file (instead of run=)
    split: str = "test"  # train | val | test, or a folder of images (predictions only)
    predictions: bool = False  # also write predictions.csv (always for a folder)


HYDRA_KEYS = ("_target_", "_partial_", "_convert_", "_recursive_", "_args_")


def check_keys(cfg: Any, path: str = "") -> None:
    """Every key of a typed node of `cfg` (one a schema dataclass above made) is one of that
    dataclass's fields, or an argument its `_target_` takes (optim.dampening for SGD): Hydra
    lets `+key=value` add any key to a node (it opens the node for it), which a typed node
    would otherwise carry unread, or hand to a target that fails on it in a traceback. A
    misspelt key is a UserError naming the nearest real key."""
    import dataclasses
    import difflib

    from omegaconf import DictConfig, ListConfig

    if isinstance(cfg, ListConfig):
        if not cfg._is_none() and not cfg._is_missing():
            for i in range(len(cfg)):
                check_keys(cfg._get_node(i), f"{path}[{i}]")
        return
    if not isinstance(cfg, DictConfig) or cfg._is_none() or cfg._is_missing():
        return
    schema = OmegaConf.get_type(cfg)
    fields = (
        [f.name for f in dataclasses.fields(schema)] if dataclasses.is_dataclass(schema) else []
    )
    own = [str(k) for k in cfg if path or str(k) != "hydra"]  # (Hydra's node of a job's config)
    extra = [k for k in own if k not in fields and k not in HYDRA_KEYS]
    arguments = target_arguments(cfg) if fields and extra else None
    for key in extra:
        if arguments is None or key in arguments:
            continue  # a key the target takes (or any key: **kwargs, an unknown target)
        from ddp_launcher import UserError

        known = list(dict.fromkeys([*fields, *sorted(arguments)]))
        where = f"{path} ({schema.__name__})" if path else f"the config ({schema.__name__})"
        near = difflib.get_close_matches(key, known, n=1)
        fix = (
            f"did you mean {path + '.' if path else ''}{near[0]}?"
            if near
            else f"remove it (its keys: {', '.join(k for k in fields if k[0] != '_')})"
        )
        raise UserError(f"{path + '.' if path else ''}{key} is not a key of {where}: {fix}")
    for key in own:
        check_keys(cfg._get_node(key), f"{path}.{key}" if path else str(key))


def target_arguments(node: Any) -> set[str] | None:
    """The keyword arguments `node`'s `_target_` takes: set() without a target; None when it
    takes any (**kwargs) or cannot be imported (where it is instantiated, that is said)."""
    import inspect

    target = node.get("_target_") if "_target_" in node else None
    if not target:
        return set()
    from hydra.utils import get_object

    try:
        parameters = inspect.signature(get_object(str(target))).parameters.values()
    except Exception:  # noqa: BLE001 - not importable, or no signature: not this check's
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    return {p.name for p in parameters}


def register_configs() -> None:
    """Schemas live in the `schema` group; each YAML names its own as `/schema/<group>/<name>`."""
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    cs.store(name="eval_schema", node=EvalConfig)
    for group, name, node in (
        ("model", "torchvision", TorchvisionModelConfig),
        ("model", "small_cnn", SmallCNNConfig),
        ("dataset", "dataset", DatasetConfig),
        ("dataset", "torchvision", TorchvisionDatasetConfig),
        ("dataset", "image_folder", ImageFolderDatasetConfig),
        ("dataset", "digits", DigitsDatasetConfig),
        ("dataset", "fake", FakeDatasetConfig),
        ("augment", "augment", AugmentConfig),
        ("augment/policy", "trivial_augment", TrivialAugmentConfig),
        ("augment/policy", "rand_augment", RandAugmentConfig),
        ("augment/policy", "auto_augment", AutoAugmentConfig),
        ("dist", "dist", DistConfig),
        ("optim", "sgd", SGDConfig),
        ("optim", "adamw", AdamWConfig),
        ("optim", "nadam", NAdamConfig),
        ("optim", "adafactor", AdafactorConfig),
        ("trainer", "trainer", TrainerConfig),
        ("wandb", "wandb", WandbConfig),
    ):
        cs.store(group=f"schema/{group}", name=name, node=node)


register_configs()
