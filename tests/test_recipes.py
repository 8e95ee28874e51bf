"""Training recipes from config: augmentation choices (both data paths), MixUp/CutMix, label
smoothing, EMA, optimizers and lr scaling, the monitored metric and early stopping, and stable
defaults for every shipped dataset config."""

from __future__ import annotations

import itertools
import math
import os

import pytest
import torch
import torch.nn.functional as F
from ddp_launcher.core.errors import UserError
from ddp_launcher.core.hydra_compat import VERSION_BASE
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from torchvision import datasets as tvd
from torchvision.transforms import v2

from components.checkpoint import load_checkpoint
from components.ema import EMA
from components.monitor import Monitor
from components.optim import param_groups, scaled_lr
from conf.schema import MixupConfig
from data import build_datasets, build_loaders
from data.fast import erase, erase_params
from data.mixing import BatchMix
from data.transforms import ERASE_RATIO, ERASE_SCALE, FastAugment, Recipe, train_transform
from tests import helpers as fx

CONF = fx.REPO / "conf"
CHOICES = sorted(p.stem for p in (CONF / "augment").glob("*.yaml"))
FAST = {"none", "shift", "crop_flip"}  # the choices the fast path runs itself
DEFAULT_AUGMENT = {
    "digits": "shift",
    "mnist": "none",  # chosen for the time to 99 % val (conf/dataset/mnist.yaml)
    "fashion_mnist": "none",  # chosen by measurement (conf/dataset/fashion_mnist.yaml)
    "cifar10": "crop_flip",
    "cifar100": "crop_flip",
    "fake": "none",
    "imagefolder": "random_resized_crop",
    "imagenet": "random_resized_crop",
}
QUICK = ["trainer.max_epochs=1", "wandb.mode=disabled", "trainer.batch_size=128"]
MIX = ["trainer.mixup.mixup_alpha=0.2", "trainer.mixup.cutmix_alpha=1.0"]


def choices(*overrides: str) -> dict:
    with initialize_config_dir(config_dir=str(CONF), **VERSION_BASE):
        cfg = compose("train", overrides=list(overrides), return_hydra_config=True)
    return dict(cfg.hydra.runtime.choices)


def ops(recipe: Recipe, name: str = "cifar10", size: int = 32) -> list[str]:
    return [type(t).__name__ for t in train_transform(name, size, recipe).transforms]


# ------------------------------------------------------------------------- configuration


def test_every_dataset_config_picks_its_default_augmentation():
    assert sorted(DEFAULT_AUGMENT) == sorted(p.stem for p in (CONF / "dataset").glob("*.yaml"))
    for dataset, augment in DEFAULT_AUGMENT.items():
        assert choices(f"dataset={dataset}")["augment"] == augment, dataset
    assert choices()["augment"] == "shift"  # the default job: digits


def test_every_dataset_config_picks_its_default_recipe_and_keys_override_it():
    """conf/recipe/<name>.yaml through the dataset config: MNIST and Fashion-MNIST train 3 and 5
    epochs at batch 256 warmed up for 0.2, in auto precision (bf16 where the hardware has it
    natively) and channels_last, the small CNN at [16, 32]
    with BatchNorm (their conf/dataset_model/ entries, for model=small_cnn only), label
    smoothing 0.1; the rest the
    trainer's 10 epochs at batch 64 (1 warm-up epoch); SGD's lr is 0.1 at the batch of 64,
    ImageNet's 0.1 per 256;
    MNIST, Fashion-MNIST and ImageFolder clip the gradient norm at 1.0 (chosen on seeds 0-4:
    docs/recipes.md)."""
    clipped = {"mnist", "fashion_mnist", "imagefolder"}
    epochs = {"mnist": 3, "fashion_mnist": 5}
    for dataset in DEFAULT_AUGMENT:
        cfg = compose_cfg(f"dataset={dataset}")
        assert cfg.trainer.grad_clip == (1.0 if dataset in clipped else None), dataset
        assert cfg.trainer.max_epochs == epochs.get(dataset, 10)
        short = dataset in epochs
        assert cfg.trainer.batch_size == (256 if short else 64)
        assert cfg.trainer.warmup_epochs == (0.2 if short else 1)
        assert cfg.trainer.label_smoothing == (0.1 if short else 0.0)
        assert (cfg.trainer.precision, cfg.trainer.channels_last) == (
            ("auto", True) if short else ("32", False)
        )
        assert (list(cfg.model.channels), cfg.model.batch_norm) == (
            ([16, 32], True) if short else ([32, 64], False)
        )
        lr = scaled_lr(cfg.optim.lr, cfg.optim.lr_scaling, 64, cfg.optim.base_batch_size)
        assert lr == pytest.approx(0.025 if dataset == "imagenet" else 0.1)  # 0.1 per 256
    # the model's part holds for small_cnn only; keys override it
    assert "channels" not in compose_cfg("dataset=mnist", "model=resnet18").model
    assert compose_cfg("dataset=mnist", "model.batch_norm=false").model.batch_norm is False
    assert compose_cfg("dataset=mnist", "trainer.max_epochs=2").trainer.max_epochs == 2
    assert compose_cfg("trainer.max_epochs=2", "dataset=mnist").trainer.max_epochs == 2
    assert compose_cfg("dataset=mnist", "trainer.grad_clip=null").trainer.grad_clip is None
    cifar = compose_cfg("experiment=cifar10_resnet18")  # an experiment's keys win
    assert cifar.trainer.max_epochs == 40 and cifar.optim.lr == 0.1


@pytest.mark.parametrize(
    "overrides",
    [
        ["dataset=cifar10", "augment=trivial_augment"],
        ["augment=trivial_augment", "dataset=cifar10"],  # the order does not matter
        ["experiment=cifar10_resnet18", "augment=trivial_augment"],
    ],
)
def test_augment_on_the_command_line_overrides_the_datasets_default(overrides):
    assert choices(*overrides)["augment"] == "trivial_augment"
    assert fx.recipe(*overrides).policy.__class__ is v2.TrivialAugmentWide


def test_choices_build_the_documented_v2_pipelines():
    base = ["ToImage", "ToDtype", "Normalize"]
    pad, flip = ["RandomCrop"], ["RandomHorizontalFlip"]
    expected = {
        "none": base,
        "shift": pad + base,
        "crop_flip": pad + flip + base,
        "random_resized_crop": ["RandomResizedCrop"] + flip + base,
        "trivial_augment": pad + flip + ["TrivialAugmentWide"] + base,
        "rand_augment": pad + flip + ["RandAugment"] + base,
        "auto_augment": pad + flip + ["AutoAugment"] + base,
    }
    assert sorted(expected) == CHOICES
    for choice, names in expected.items():
        assert ops(fx.recipe(f"augment={choice}")) == names, choice
    # ImageNet-style sets: the val geometry before a padded crop; none of it for resized crops
    assert ops(fx.recipe("augment=crop_flip"), "imagefolder", 64)[:3] == [
        "Resize",
        "CenterCrop",
        "RandomCrop",
    ]
    rrc_ops = ops(fx.recipe("augment=random_resized_crop"), "imagefolder", 64)
    assert rrc_ops[0] == "RandomResizedCrop"
    # parameters reach the transforms
    recipe = fx.recipe(
        "augment=rand_augment",
        "augment.policy.num_ops=3",
        "augment.policy.magnitude=12",
        "augment.random_erasing=0.25",
    )
    assert (recipe.policy.num_ops, recipe.policy.magnitude) == (3, 12)
    assert ops(recipe)[-1] == "RandomErasing"
    assert train_transform("cifar10", 32, recipe).transforms[-1].p == 0.25
    crop = train_transform("cifar10", 32, fx.recipe("augment=crop_flip")).transforms[0]
    assert list(crop.padding) == [4] * 4  # null: an eighth of the side
    rrc = fx.recipe("augment=random_resized_crop", "augment.scale=[0.5,1.0]")
    assert train_transform("imagenet", 64, rrc).transforms[0].scale == (0.5, 1.0)
    assert (
        fx.recipe("augment=auto_augment", "augment.policy.policy=cifar10").policy.policy.value
        == "cifar10"
    )


def test_a_users_own_v2_transforms_from_yaml():
    recipe = fx.recipe(
        "augment=none",
        "augment.transforms=[{_target_:torchvision.transforms.v2.RandomRotation,degrees:15},"
        "{_target_:torchvision.transforms.v2.ColorJitter,brightness:0.2}]",
    )
    assert ops(recipe)[:2] == ["RandomRotation", "ColorJitter"]
    assert recipe.transforms[0].degrees == [-15.0, 15.0]
    assert recipe.fast(32) is None and recipe.describe() == "RandomRotation, ColorJitter"
    with pytest.raises(UserError, match="not a transform"):
        Recipe(transforms=[{"degrees": 15}])


def test_which_recipes_the_fast_path_runs():
    expected = {
        "none": FastAugment(),
        "shift": FastAugment(4, False),
        "crop_flip": FastAugment(4, True),
    }
    for choice in CHOICES:
        assert fx.recipe(f"augment={choice}").fast(32) == expected.get(choice), choice
    erasing = fx.recipe("augment=crop_flip", "augment.random_erasing=0.3", "augment.padding=2")
    assert erasing.fast(32) == FastAugment(2, True, 0.3)
    assert not FastAugment().random and FastAugment(erasing=0.1).random


# ------------------------------------------------------------------------- the two data paths


@pytest.fixture(scope="module")
def digits():
    cfg = fx.dataset_cfg("digits")
    return lambda *overrides: build_datasets(cfg, seed=3, augment=fx.recipe(*overrides))


def test_a_recipe_the_fast_path_lacks_runs_on_dataloaders_and_says_so(digits, caplog):
    def loaders(splits):
        return build_loaders(
            splits, batch_size=8, eval_batch_size=8, rank=0, world_size=1, seed=0, fast=True
        )

    with caplog.at_level("INFO", logger="data.loaders"):
        assert loaders(digits("augment=crop_flip", "augment.random_erasing=0.5")).fast
        assert "fast data path off" not in caplog.text
        slow = loaders(digits("augment=trivial_augment"))
    assert not slow.fast
    (line,) = [r.message for r in caplog.records if "fast data path off" in r.message]
    assert "TrivialAugmentWide" in line and "using DataLoaders" in line
    slow.train_sampler.set_epoch(0)
    x, y = next(iter(slow.train))
    assert x.shape == (8, 1, 8, 8) and x.dtype == torch.float32 and y.shape == (8,)


@pytest.mark.parametrize("choice", CHOICES)
def test_every_choice_augments_a_sample_alike_on_one_and_two_ranks(digits, choice):
    """Step k's global batch holds the same augmented samples on 1 rank and on 2 (each path
    seeds every draw by (seed, epoch, index)): the data is world-size invariant."""
    splits = digits(f"augment={choice}", "augment.random_erasing=0.5")
    for fast in (True, False) if choice in FAST else (False,):

        def steps(world_size: int, rank: int, fast=fast) -> list[dict[int, torch.Tensor]]:
            ld = build_loaders(
                splits,
                batch_size=16 // world_size,
                eval_batch_size=8,
                rank=rank,
                world_size=world_size,
                seed=0,
                fast=fast,
            )
            assert ld.fast == fast
            ld.train_sampler.set_epoch(2)
            indices = ld.step_indices()[:3]
            batches = [x for x, _ in itertools.islice(ld.train, 3)]
            return [dict(zip(i, x, strict=True)) for i, x in zip(indices, batches, strict=True)]

        one, ranks = steps(1, 0), [steps(2, r) for r in (0, 1)]
        for k, batch in enumerate(one):
            both = {**ranks[0][k], **ranks[1][k]}
            assert batch.keys() == both.keys()
            assert all(torch.equal(batch[i], both[i]) for i in batch), (choice, fast, k)


def test_fast_erasing_draws_like_v2_random_erasing():
    """The fast path's erasing boxes follow v2.RandomErasing's distribution (its draws are its
    own): how often a box is drawn, its area, aspect, and where it lands."""
    n, side = 6000, 32
    boxes = erase_params(5, torch.zeros(n, dtype=torch.long), torch.arange(n), 0.5, side, side)
    torch.manual_seed(0)
    tv = v2.RandomErasing(p=1.0, scale=ERASE_SCALE, ratio=ERASE_RATIO)
    image = torch.zeros(3, side, side)
    theirs = []
    for _ in range(n):
        params = tv.make_params([image])
        theirs.append([params["i"], params["j"], params["h"], params["w"]])
    theirs = torch.tensor(theirs)
    erased = boxes[:, 2] > 0
    assert 0.47 < erased.float().mean() < 0.53  # p = 0.5
    ours = boxes[erased]

    def stats(b):
        area = (b[:, 2] * b[:, 3]).float() / side**2
        aspect = (b[:, 2].float() / b[:, 3].float()).log()
        centre = (b[:, 0] + b[:, 2] / 2).float() / side
        return torch.stack([area.mean(), area.std(), aspect.mean(), aspect.std(), centre.mean()])

    torch.testing.assert_close(stats(ours), stats(theirs), atol=0.02, rtol=0.05)
    assert ((ours[:, 0] + ours[:, 2]) <= side).all() and ((ours[:, 1] + ours[:, 3]) <= side).all()
    # and erase() zeroes exactly the box
    x = torch.ones(len(ours[:50]), 3, side, side)
    erase(x, ours[:50])
    assert torch.equal((x == 0).sum((1, 2, 3)), 3 * ours[:50, 2] * ours[:50, 3])


def test_fast_and_dataloader_paths_erase_alike(digits):
    """Both paths erase about p of the samples (to the normalised value 0), the rest intact."""
    shares, unaugmented = {}, digits("augment=none").train
    for fast in (True, False):
        splits = digits("augment=none", "augment.random_erasing=0.5")
        ld = build_loaders(
            splits,
            batch_size=len(splits.train) // 2,
            eval_batch_size=8,
            rank=0,
            world_size=1,
            seed=0,
            fast=fast,
        )
        assert ld.fast == fast
        ld.train_sampler.set_epoch(1)
        plain = torch.stack([unaugmented[i][0] for i in ld.step_indices()[0]])
        x, _ = next(iter(ld.train))
        changed = (x != plain).flatten(1).any(1)
        assert ((x == 0) | (x == plain)).all()  # erased pixels are 0, all others unchanged
        shares[fast] = changed.float().mean().item()
    assert all(0.4 < share < 0.6 for share in shares.values()), shares


# ------------------------------------------------------------------------- MixUp / CutMix


def mixer(**kwargs) -> BatchMix:
    return BatchMix(OmegaConf.structured(MixupConfig(**kwargs)), num_classes=4, seed=7)


def test_mixup_cutmix_soft_targets_seeded_by_epoch_and_batch():
    x = torch.rand(6, 3, 8, 8)
    y = torch.tensor([0, 1, 2, 3, 0, 1])
    mix = mixer(mixup_alpha=0.4, cutmix_alpha=1.0)
    x1, y1 = mix(x.clone(), y, epoch=2, batch=5)
    x2, y2 = mix(x.clone(), y, epoch=2, batch=5)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)  # a resumed run mixes the same
    assert y1.shape == (6, 4) and torch.allclose(y1.sum(1), torch.ones(6))
    others = [mix(x.clone(), y, epoch=2, batch=b)[1] for b in range(6, 12)]
    assert any(not torch.equal(y1, o) for o in others)
    # the caller's RNG stream is left alone
    torch.manual_seed(1)
    before = torch.rand(2)
    torch.manual_seed(1)
    mix(x.clone(), y, epoch=0, batch=0)
    assert torch.equal(torch.rand(2), before)
    # switch_prob: 1 -> always CutMix (a box of one image pasted: pixels from exactly 2 images;
    # the partner: the other half's sample, j + 3 of 6)
    cut = mixer(mixup_alpha=0.4, cutmix_alpha=1.0, switch_prob=1.0)
    xc, yc = cut(x.clone(), y, epoch=0, batch=3)
    from_self, from_prev = xc == x, xc == x.roll(3, 0)
    assert (from_self | from_prev).all()
    lam = from_self[0].float().mean()
    assert yc[0, y[0]] == pytest.approx(lam.item(), abs=1e-6)  # area-adjusted weight
    # prob 0 or both alphas 0: untouched, hard labels
    for off in (mixer(mixup_alpha=0.4, prob=0.0), mixer()):
        assert not off.enabled
        xo, yo = off(x, y, epoch=0, batch=0)
        assert xo is x and yo is y


def test_mix_pairs_are_the_same_at_any_world_size():
    """A global batch of 8 mixed on 1 rank, or split over 2 or 4 ranks as a DistributedSampler
    splits it (rank r: global positions r, r + W, ...): every sample gets the same partner,
    weight and box, so 1 rank == N ranks with mixing on."""
    x, y = torch.rand(8, 3, 6, 6), torch.arange(8) % 4
    for switch in (0.0, 1.0):  # MixUp, CutMix
        mix = mixer(mixup_alpha=0.4, cutmix_alpha=1.0, switch_prob=switch)
        x1, y1 = mix(x.clone(), y, epoch=1, batch=2)
        assert not torch.equal(x1, x)
        for world in (2, 4):
            for rank in range(world):
                xr, yr = mix(x[rank::world].clone(), y[rank::world], epoch=1, batch=2)
                assert torch.equal(xr, x1[rank::world]), (switch, world, rank)
                assert torch.equal(yr, y1[rank::world]), (switch, world, rank)


def test_soft_target_loss_is_the_mixed_cross_entropy():
    logits, y = torch.randn(5, 4), torch.tensor([0, 1, 2, 3, 0])
    lam, onehot = 0.3, F.one_hot(y, 4).float()
    soft = lam * onehot + (1 - lam) * onehot.roll(1, 0)
    mixed = lam * F.cross_entropy(logits, y) + (1 - lam) * F.cross_entropy(logits, y.roll(1, 0))
    torch.testing.assert_close(F.cross_entropy(logits, soft), mixed)
    smoothed = soft * 0.9 + 0.1 / 4
    torch.testing.assert_close(
        F.cross_entropy(logits, soft, label_smoothing=0.1),
        -(smoothed * logits.log_softmax(1)).sum(1).mean(),
    )


@pytest.mark.parametrize("fast", [True, False])
def test_mixup_runs_on_both_paths_without_a_hard_label_accuracy(tmp_path, fast):
    run_dir = tmp_path / "mix"
    fx.train_in_process(
        run_dir,
        *QUICK,
        *MIX,
        "trainer.label_smoothing=0.1",
        f"dataset.fast={str(fast).lower()}",
        "trainer.log_every_n_steps=2",
    )
    trains = fx.train_rows(run_dir)
    assert trains and all("train/acc" not in r for r in trains)
    assert all(math.isfinite(r["train/loss"]) and r["grad_norm"] > 0 for r in trains)
    plain = tmp_path / "plain"
    fx.train_in_process(
        plain, *QUICK, f"dataset.fast={str(fast).lower()}", "trainer.log_every_n_steps=2"
    )
    assert all(0 <= r["train/acc"] <= 1 for r in fx.train_rows(plain))
    assert fx.train_rows(plain)[0]["train/loss"] != trains[0]["train/loss"]


# ------------------------------------------------------------------------- every choice trains


@pytest.mark.slow  # trains every choice (about a minute on 2 cores)
@pytest.mark.parametrize("choice", CHOICES)
def test_every_augmentation_choice_trains(tmp_path, choice, caplog):
    with caplog.at_level("INFO"):
        fx.train_in_process(
            tmp_path / "r",
            *QUICK,
            f"augment={choice}",
            "trainer.max_epochs=3",
            "augment.random_erasing=0.25",
        )
    vals = fx.val_rows(tmp_path / "r")
    losses = [r["train/loss"] for r in fx.train_rows(tmp_path / "r")]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    # it learns (chance: 0.1; 33 steps of 8x8 digits under a strong recipe learn slowly)
    assert max(r["val/acc"] for r in vals) > 0.25
    assert ("fast data path off" in caplog.text) == (choice not in FAST)


# ------------------------------------------------------------------------- optimizers


def test_lr_scaling_and_parameter_groups():
    assert scaled_lr(0.1, "linear", 64, 256) == pytest.approx(0.025)
    assert scaled_lr(0.1, "sqrt", 64, 256) == pytest.approx(0.05)
    assert scaled_lr(0.1, "none", 64, 256) == 0.1
    with pytest.raises(UserError, match="optim.base_batch_size=0"):
        scaled_lr(0.1, "linear", 64, 0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Flatten(), torch.nn.Linear(4, 2)
    )
    decay, no_decay = param_groups(model, 0.05, decay_norm_and_bias=False)
    assert [p.ndim for p in decay["params"]] == [4, 2]
    assert [p.ndim for p in no_decay["params"]] == [1, 1, 1, 1] and no_decay["weight_decay"] == 0
    assert len(param_groups(model, 0.05, decay_norm_and_bias=True)) == 6  # one group
    assert len(param_groups(model, 0.0, decay_norm_and_bias=False)) == 6  # nothing to decay


@pytest.mark.slow  # trains every choice (about a minute on 2 cores)
@pytest.mark.parametrize("optim", sorted(p.stem for p in (CONF / "optim").glob("*.yaml")))
def test_every_optimizer_trains_digits(tmp_path, optim):
    run_dir = tmp_path / "r"
    fx.train_in_process(
        run_dir,
        "wandb.mode=disabled",
        f"optim={optim}",
        "trainer.max_epochs=3",
        "optim.nesterov=true" if optim == "sgd" else "seed=0",
    )
    vals, trains = fx.val_rows(run_dir), fx.train_rows(run_dir)
    assert vals[-1]["val/acc"] > 0.4 and all(math.isfinite(r["train/loss"]) for r in trains)
    assert trains[-1]["train/loss"] < trains[0]["train/loss"]
    ckpt = load_checkpoint(run_dir / "checkpoints" / "last.pt")
    groups = ckpt["optimizer"]["param_groups"]
    cfg = compose_cfg(f"optim={optim}")
    if cfg.optim.weight_decay:  # none for biases (and norm weights)
        assert [g["weight_decay"] for g in groups] == [cfg.optim.weight_decay, 0.0]
    factor = {"linear": 64 / 256, "sqrt": (64 / 256) ** 0.5}[cfg.optim.lr_scaling]
    assert groups[0]["initial_lr"] == pytest.approx(cfg.optim.lr * factor)
    if optim == "sgd":
        assert groups[0]["nesterov"] is True


def compose_cfg(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), **VERSION_BASE):
        return compose("train", overrides=list(overrides))


# ------------------------------------------------------------------------- EMA


def test_ema_is_the_exponential_average_every_n_steps():
    model = torch.nn.Linear(3, 2)
    ema = EMA(model, decay=0.9, every_n_steps=2)
    history = []
    for step in range(1, 7):
        with torch.no_grad():
            model.weight.add_(1.0)
        history.append(model.weight.detach().clone())
        ema.maybe_update(model, step)
    # updates after steps 2 (a copy), 4 and 6
    expected = history[1]
    for w in (history[3], history[5]):
        expected = 0.9 * expected + 0.1 * w
    torch.testing.assert_close(ema.module.weight, expected)
    assert int(ema.n_averaged) == 3


def test_ema_is_evaluated_checkpointed_and_can_be_monitored(tmp_path):
    run_dir = tmp_path / "ema"
    best = fx.train_in_process(
        run_dir,
        *QUICK,
        "trainer.max_epochs=2",
        "trainer.ema.decay=0.9",
        "trainer.monitor.metric=val_ema/acc",
    )
    vals = fx.val_rows(run_dir)
    assert all({"val_ema/acc", "val_ema/loss"} <= v.keys() for v in vals)
    assert best == max(v["val_ema/acc"] for v in vals)
    ckpt = load_checkpoint(run_dir / "checkpoints" / "last.pt")
    assert int(ckpt["ema"]["n_averaged"]) == ckpt["progress"]["step"]
    averaged, last = ckpt["ema"]["module.classifier.4.weight"], ckpt["model"]["classifier.4.weight"]
    assert averaged.shape == last.shape and not torch.equal(averaged, last)


# ------------------------------------------------------------------------- monitor, early stopping


def test_monitor_best_and_patience():
    acc = Monitor("val/acc", "max", patience=2, min_delta=0.05)
    seen = []
    for epoch, value in enumerate([0.5, 0.52, 0.6, 0.61, 0.62, 0.9], 1):
        seen.append((acc.update(epoch, {"val/acc": value, "val/loss": 1.0}), acc.should_stop))
    # best: any improvement; patience: improvements by more than min_delta over 0.6
    assert seen == [
        (True, False),
        (True, False),
        (True, False),
        (True, False),
        (True, True),
        (True, False),
    ]
    loss = Monitor("val/loss", "min")
    assert [
        loss.update(e, {"val/loss": v}) for e, v in enumerate([2.0, 1.0, 1.5, float("nan")])
    ] == [True, True, False, False]
    assert (loss.best, loss.best_epoch, loss.should_stop) == (1.0, 1, False)
    restored = Monitor("val/loss", "min")
    restored.load_state_dict(loss.state_dict())
    assert restored.state_dict() == loss.state_dict()
    with pytest.raises(UserError, match="metric=val/top9 .* use one of val/loss$"):
        Monitor("val/top9", "max").update(1, {"val/loss": 1.0, "epoch": 1})


def test_monitor_min_picks_best_pt_and_is_returned(tmp_path):
    run_dir = tmp_path / "min"
    best = fx.train_in_process(
        run_dir,
        *QUICK,
        "trainer.max_epochs=3",
        "trainer.monitor.metric=val/loss",
        "trainer.monitor.mode=min",
    )
    vals = fx.val_rows(run_dir)
    losses = [v["val/loss"] for v in vals]
    result = fx.read_json(run_dir / "result.json")
    assert (result["metric"], result["direction"]) == ("val/loss", "min")
    assert best == result["value"] == min(losses)
    assert result["value_epoch"] == 1 + losses.index(min(losses))
    assert result["app"]["best_val_acc"] == max(v["val/acc"] for v in vals)
    best_ckpt = load_checkpoint(run_dir / "checkpoints" / "best.pt")
    assert best_ckpt["progress"]["epoch"] == result["value_epoch"]
    assert best_ckpt["monitor"]["best"] == min(losses)


def _agree_worker(rank: int, port: int) -> list[bool]:
    import torch.distributed as dist

    from components.distributed import rank0_decides

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        decisions = [
            rank0_decides(rank == 0, torch.device("cpu")),
            rank0_decides(rank == 1, torch.device("cpu")),
        ]
        return decisions
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_rank0_decides_for_every_rank(two_ranks):
    """Early stopping's agreement: whatever a rank's own view, every rank takes rank 0's."""
    got = two_ranks.run(_agree_worker, fx.free_port())
    assert got == [[True, False]] * 2


# ------------------------------------------------------------------------- params and FLOPs


def test_params_and_flops_in_result_and_wandb_config(tmp_path):
    run_dir = tmp_path / "r"
    fx.train_in_process(run_dir, "trainer.max_epochs=1", "wandb.mode=offline")
    result = fx.read_json(run_dir / "result.json")
    # SmallCNN on 8x8 digits: conv 1->32, conv 32->64, 2x2x64 -> 128 -> 10
    assert result["app"]["params"] == (32 * 9 + 32) + (64 * 32 * 9 + 64) + (256 * 128 + 128) + (
        128 * 10 + 10
    )
    convs = 2 * (8 * 8 * 32 * 9 + 4 * 4 * 64 * 32 * 9)  # multiply-adds x 2
    assert result["app"]["flops_per_sample"] == convs + 2 * (256 * 128 + 128 * 10)
    (wb,) = fx.offline_runs(run_dir)
    assert wb.config["run"]["params"] == result["app"]["params"]
    assert wb.config["run"]["flops_per_sample"] == result["app"]["flops_per_sample"]


# ------------------------------------------------------------------------- stable defaults


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    """Every dataset config's files, generated: MNIST/Fashion-MNIST and CIFAR (uniform noise,
    real formats), an ImageFolder and an ImageNet layout of learnable 32 px class patterns."""
    root = tmp_path_factory.mktemp("data")
    # 1600: 5 steps an epoch at MNIST's and Fashion-MNIST's batch of 256 (3 epochs: 15 rows)
    fx.make_mnist(root, "MNIST", n_train=1600, n_test=100)
    fx.make_mnist(root, "FashionMNIST", n_train=1600, n_test=100)
    sums = {
        10: fx.make_cifar(root, classes=10, n_per_batch=128)[1],
        100: fx.make_cifar(root, classes=100, n_per_batch=640)[1],
    }
    fx.make_pattern_images(root / "folder", [f"c{i}" for i in range(10)], {"train": 64, "val": 16})
    fx.make_imagenet(root / "imagenet", per_split={"train": 64, "val": 16})
    return root, sums


# The images' own size, or 32 px for the resized sets (their default 224 makes the small CNN a
# 25M-parameter model: slow on a CPU, and a user's small ImageFolder sets it anyway). Slow: 3
# epochs of 8 configs (about 1.5 min on 2 cores).
@pytest.mark.slow
@pytest.mark.parametrize("dataset", sorted(DEFAULT_AUGMENT))
def test_every_dataset_config_trains_stably_at_its_defaults(
    tmp_path, generated, dataset, monkeypatch
):
    root, sums = generated
    for classes, cls in ((10, tvd.CIFAR10), (100, tvd.CIFAR100)):
        for attr, value in sums[classes].items():
            monkeypatch.setattr(cls, attr, value)
    where = {"imagefolder": root / "folder", "imagenet": root / "imagenet"}.get(dataset, root)
    extra = (
        ["dataset.image_size=32", "dataset.num_workers=0"]
        if dataset in ("imagefolder", "imagenet")
        else []
    )
    if dataset == "fake":
        extra = ["dataset.size=320"]
    run_dir = tmp_path / dataset
    root_override = [] if dataset in ("digits", "fake") else [f"dataset.root={where}"]
    fx.train_in_process(
        run_dir,
        f"dataset={dataset}",
        *root_override,
        *extra,
        "trainer.max_epochs=3",
        "trainer.log_every_n_steps=1",
        "wandb.mode=disabled",
    )
    losses = [r["train/loss"] for r in fx.train_rows(run_dir)]
    classes = {"cifar100": 100, "imagenet": 10}.get(dataset, 10)
    assert len(losses) >= 15
    # no divergence: every step's loss finite and below 1.5 x the loss of guessing
    assert all(math.isfinite(x) for x in losses) and max(losses) < 1.5 * math.log(classes)
    if dataset in ("digits", "imagefolder", "imagenet"):  # learnable data: it learns
        assert fx.val_rows(run_dir)[-1]["val/acc"] > 0.5
        assert losses[-1] < 0.9 * losses[0]
    print(
        f"{dataset}: train/loss {losses[0]:.3f} -> {losses[-1]:.3f} (max {max(losses):.3f}), "
        f"val/acc {fx.val_rows(run_dir)[-1]['val/acc']:.3f}"
    )


# ------------------------------------------------------------------------- 2 ranks


@pytest.mark.slow
def test_two_ranks_augment_like_one_and_mix_on_both(two_ranks, tmp_path):
    """A DataLoader-path recipe (TrivialAugment + erasing) draws per sample, so 2 ranks train
    the 1-rank run's weights; MixUp/CutMix + EMA + label smoothing runs on 2 ranks too."""
    recipe = [*QUICK, "augment=trivial_augment", "augment.random_erasing=0.25", "seed=4"]
    fx.train_in_process(tmp_path / "one", *recipe)
    two_ranks.train(tmp_path / "two", *recipe)
    one_w, two_w = fx.weights(tmp_path / "one"), fx.weights(tmp_path / "two")
    for key in one_w:
        torch.testing.assert_close(one_w[key], two_w[key], rtol=1e-4, atol=1e-5, msg=key)
    mixed = tmp_path / "mixed"
    two_ranks.train(
        mixed,
        *QUICK,
        *MIX,
        "trainer.ema.decay=0.99",
        "trainer.label_smoothing=0.1",
        "trainer.log_every_n_steps=2",
    )
    assert all("train/acc" not in r for r in fx.train_rows(mixed))
    assert "val_ema/acc" in fx.val_rows(mixed)[-1]


@pytest.mark.slow
def test_early_stopping_every_rank_stops_at_the_same_epoch(two_ranks, tmp_path):
    """val/acc must improve by more than 0.5 each epoch: after epoch 1 it cannot, so with
    patience 1 both ranks stop after epoch 2 and the job ends cleanly (a rank that went on
    would wait in a collective until the step timeout)."""
    run_dir = tmp_path / "r"
    stopping = [
        "trainer.max_epochs=6",
        "wandb.mode=disabled",
        "trainer.early_stopping.patience=1",
        "trainer.early_stopping.min_delta=0.5",
        "dist.step_timeout_s=60",
    ]
    two_ranks.train(run_dir, *stopping)
    assert [v["epoch"] for v in fx.val_rows(run_dir)] == [1, 2]
    result = fx.read_json(run_dir / "result.json")
    assert result["app"]["stopped_early"] is True and result["app"]["epochs"] == 2
    assert "early stopping before epoch 3" in (run_dir / "train.log").read_text()
    # resuming a stopped run trains no further
    two_ranks.train(run_dir, *stopping, "resume=auto")
    assert [v["epoch"] for v in fx.val_rows(run_dir)] == [1, 2]
    assert os.path.exists(run_dir / "checkpoints" / "best.pt")


# ------------------------------------------------------------------------- imagefolder


@pytest.mark.parametrize(
    "size, overrides, expected, said",
    [
        (32, [], "shift", "the small-image recipe, augment=shift"),
        (64, [], "shift", "the small-image recipe, augment=shift"),
        (65, [], "random_resized_crop", "ImageNet's recipe, augment=random_resized_crop"),
        (224, [], "random_resized_crop", "ImageNet's recipe, augment=random_resized_crop"),
        (32, ["augment=random_resized_crop"], "random_resized_crop", None),  # asked for
        (32, ["augment.scale=[0.5,1.0]"], "random_resized_crop", None),  # its key tuned
        (32, ["augment=crop_flip"], "crop_flip", None),
    ],
)
def test_imagefolder_picks_its_default_recipe_by_image_size(size, overrides, expected, said):
    from hydra.core.hydra_config import HydraConfig

    from conf.folder_recipe import folder_augment
    from data.transforms import build_recipe

    given = ["dataset=imagefolder", "dataset.root=x", f"dataset.image_size={size}", *overrides]
    cfg = fx.composed_train_config(*given)
    HydraConfig.instance().set_config(cfg)
    augment, line = folder_augment(cfg)
    chosen, composed = build_recipe(augment), fx.recipe(f"augment={expected}", *overrides)
    assert (chosen.crop, chosen.padding, chosen.flip) == (
        composed.crop,
        composed.padding,
        composed.flip,
    )
    assert tuple(chosen.scale) == tuple(composed.scale)
    if said is None:
        assert line is None
    else:
        assert said in line and f"at {size} px" in line and "augment=<choice>" in line
    # no other dataset's recipe depends on its data
    cfg = fx.composed_train_config("dataset=cifar10")
    HydraConfig.instance().set_config(cfg)
    assert folder_augment(cfg) == (cfg.augment, None)


@pytest.mark.slow  # two ranks of train.py on a 32 px image folder (about 30 s on 2 cores)
def test_imagefolder_run_says_its_recipe_first_and_trains_with_it(tmp_path):
    import subprocess

    fx.make_pattern_images(tmp_path / "folder", ["a", "b", "c"], {"train": 32, "val": 8})
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        fx.train_cmd(
            "dataset=imagefolder",
            f"dataset.root={tmp_path / 'folder'}",
            "dataset.image_size=32",
            "dataset.num_workers=0",
            "dist.nproc_per_node=2",
            "trainer.max_epochs=1",
            "trainer.batch_size=16",
            "wandb.mode=disabled",
            f"hydra.run.dir={run_dir}",
        ),
        cwd=fx.REPO,
        env=fx.run_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert "the small-image recipe, augment=shift" in lines[0], lines[:3]
    assert sum("small-image recipe" in line for line in lines) == 1  # said once, not per rank
    composed = OmegaConf.load(run_dir / ".hydra" / "config.yaml")
    assert composed.augment.crop == "resized"  # the dataset config's choice, as composed
    trained = OmegaConf.create(load_checkpoint(run_dir / "checkpoints" / "last.pt")["config"])
    assert (trained.augment.crop, trained.augment.flip) == ("pad", False)  # what trained
    assert len(fx.val_rows(run_dir)) == 1
