"""Values and datasets refused before the run dir opens (issue 66, items 1 and 3): what trained
wrongly without a word, or failed in a traceback after the run dir opened, is one line from the
app's gate checks (conf/checks.py, data/image_tree.py), run where a start is checked
(ddp_launcher/core/gate.py's check_start), before anything is written. In this process: a
compose and the gate, no training."""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

import pytest
import torch
from ddp_launcher.core.errors import UserError
from ddp_launcher.core.gate import check_start

from tests.helpers import QUICK, compose, composed_train_config, make_imagefolder


def refusal(run_dir: Path, *overrides: str) -> str:
    """The gate's one line for `python train.py <overrides>` (fails the test if it passes; the
    config composed once per override list: the checks read the run dir they are given)."""
    cfg = composed_train_config(*QUICK, *overrides)
    with pytest.raises(UserError) as caught:
        check_start(cfg, run_dir, 1, sweep=False)
    message = str(caught.value)
    assert "\n" not in message, message
    return message


def passes(run_dir: Path, *overrides: str) -> None:
    check_start(composed_train_config(*QUICK, *overrides), run_dir, 1, sweep=False)


# (overrides, what the line says): each was a traceback or a silent accept on 5f215d2
REFUSED = [
    # 44-line traceback (the linear scaling made it inf; torch cannot hand it to float32)
    (
        ["optim.lr=1e308"],
        ["optim.lr=1e+308", "at most 1e+30 after optim.lr_scaling", "e.g. optim.lr=0.1"],
    ),
    (["optim.lr=inf"], ["optim.lr=inf", "at most 1e+30"]),
    (["optim.lr=nan"], ["optim.lr=nan", "a learning rate > 0"]),
    (["optim=adamw", "optim.lr=-1e-3"], ["optim.lr=-0.001", "e.g. optim.lr=0.001"]),
    (["optim.momentum=nan"], ["optim.momentum=nan is not a number"]),
    # 31-line traceback in torch.manual_seed
    (
        ["seed=1180591620717411303424"],
        ["seed=1180591620717411303424 is out of range", "to 4294967295"],
    ),
    (["seed=-1"], ["seed=-1 is out of range", "from 0 to 4294967295"]),
    # 44-line traceback converting NaN to a sample count
    (["dataset.val_fraction=nan"], ["dataset.val_fraction=nan is out of range", "0.01 and 0.99"]),
    (["dataset.test_fraction=inf"], ["dataset.test_fraction=inf is out of range"]),
    (
        ["dataset=mnist", "dataset.root=/nonexistent", "dataset.val_fraction=0"],
        ["dataset.val_fraction=0.0 is out of range"],
    ),
    # trained with flipped gradients: loss 384, val/acc 0.10
    (["trainer.grad_clip=-1"], ["trainer.grad_clip=-1.0 is not valid", "trainer.grad_clip=null"]),
    (["trainer.grad_clip=0"], ["trainer.grad_clip=0.0 is not valid"]),
    (["trainer.grad_clip=nan"], ["trainer.grad_clip=nan is not valid"]),
    # "timed out after 0ms", exit 1 (on 2 ranks)
    (["dist.timeout_s=0"], ["dist.timeout_s=0 is not valid", ">= 1", "dist.timeout_s=600"]),
    (["dist.step_timeout_s=0"], ["dist.step_timeout_s=0 is not valid", "or null"]),
    (["trainer.warmup_epochs=nan"], ["trainer.warmup_epochs=nan is not valid"]),
    (["trainer.mixup.prob=nan"], ["trainer.mixup.prob=nan is out of range"]),
    (["trainer.ema.decay=nan"], ["trainer.ema.decay=nan must be in (0, 1)"]),
    (["augment=none", "augment.random_erasing=nan"], ["augment.random_erasing=nan"]),
    (["trainer.limit_train_batches=0.0"], ["trainer.limit_train_batches=0.0 is not valid"]),
    # trained as if unset (found by this issue's own probes)
    (["trainer.nonfinite=ignore"], ["trainer.nonfinite=ignore is not valid: use error or skip"]),
    (["trainer.progress_every_s=nan"], ["trainer.progress_every_s=nan: use a positive number"]),
    (["wandb.init_timeout_s=-1"], ["wandb.init_timeout_s=-1.0 is not valid", "> 0"]),
    # resume: "checkpoint AUTO does not exist", no hint of auto
    (["resume=AUTO"], ["resume=AUTO is none of auto, null", "did you mean resume=auto?"]),
    (["resume=true"], ["did you mean resume=auto?"]),
    (["resume=nul"], ["did you mean resume=null?"]),
    # start_over lost silently, and the line then told you to pass start_over=true
    (
        ["resume=auto", "start_over=true"],
        ["resume=auto and start_over=true contradict each other", "start_over=false"],
    ),
]


@pytest.mark.parametrize("overrides, fragments", REFUSED, ids=[" ".join(o) for o, _ in REFUSED])
def test_a_bad_value_is_refused_before_the_run_dir_opens(tmp_path, overrides, fragments):
    message = refusal(tmp_path / "r", *overrides)
    assert all(f in message for f in fragments), message
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(
    "overrides",
    [
        ["optim.lr=1e12"],  # trains: a non-finite loss named with its step (docs/debugging.md)
        ["optim.lr=1e29", "trainer.batch_size=2560"],  # 1e30 after scaling: the bound itself
        ["trainer.grad_clip=0.5"],
        ["seed=4294967295"],
        ["dist.timeout_s=1", "dist.step_timeout_s=null"],
        ["trainer.limit_train_batches=1.0", "trainer.limit_val_batches=2"],
        ["trainer.mixup.mixup_alpha=0.2", "trainer.ema.decay=0.999"],
    ],
)
def test_values_at_their_bounds_pass(tmp_path, overrides):
    passes(tmp_path / "r", *overrides)


# ---------------------------------------------------------------------------------------------
# a file that is not a checkpoint: "(101)", or torch's weights_only paragraph cut mid-sentence


def not_checkpoints(root: Path) -> dict[str, Path]:
    root.mkdir()
    files = {
        "text": root / "notes.pt",
        "random": root / "random.pt",
        "zip": root / "other.zip.pt",
        "truncated zip": root / "pk.pt",
    }
    files["text"].write_text("not a checkpoint\n")
    files["random"].write_bytes(os.urandom(4096))
    with zipfile.ZipFile(files["zip"], "w") as archive:
        archive.writestr("a.txt", "hello")
    files["truncated zip"].write_bytes(b"PK\x03\x04" + b"garbage" * 10)
    return files


@pytest.mark.parametrize("kind", ["text", "random", "zip", "truncated zip"])
def test_a_file_that_is_not_a_checkpoint_is_said_to_be_none(tmp_path, kind):
    import hashlib

    path = not_checkpoints(tmp_path / "files")[kind]
    # with its digest beside it (as if whole): the file itself is the problem
    path.with_name(path.name + ".sha256").write_text(hashlib.sha256(path.read_bytes()).hexdigest())
    message = refusal(tmp_path / "r", f"resume={path}")
    assert message.startswith(f"checkpoint {path} cannot be loaded: it is no torch.save archive")
    assert "resume=null" in message and "101" not in message and "Weights only" not in message


def test_a_real_checkpoint_still_passes(tmp_path):
    """The archive check reads torch.save's own format."""
    from components.checkpoint import atomic_save
    from components.manifest import is_torch_archive

    path = tmp_path / "state.pt"
    atomic_save({"model": {"w": torch.ones(2)}}, path)
    assert is_torch_archive(path)


# ---------------------------------------------------------------------------------------------
# item 3: the image folder's tree, before the run dir opens (3 lines and a failed run dir)


def folder(root: Path) -> Path:
    make_imagefolder(root, {"train": 3, "val": 1})
    return root


FOLDER = ["dataset=imagefolder", "dataset.image_size=32"]


def test_a_link_back_into_the_dataset_is_refused_before_the_run_dir_opens(tmp_path):
    root = folder(tmp_path / "data")
    (root / "train" / "cat" / "loop").symlink_to("..")
    message = refusal(tmp_path / "r", *FOLDER, f"dataset.root={root}")
    assert message.startswith(f"the link {root}/train/cat/loop -> {root}/train leads back"), message
    assert not (tmp_path / "r").exists()


def test_a_folder_reached_twice_is_refused(tmp_path):
    root = folder(tmp_path / "data")
    (tmp_path / "more").mkdir()
    (root / "train" / "cat" / "a").symlink_to(tmp_path / "more")
    (root / "train" / "cat" / "b").symlink_to(tmp_path / "more")
    message = refusal(tmp_path / "r", *FOLDER, f"dataset.root={root}")
    assert "read already through another link" in message, message


def test_an_emptied_class_is_refused_before_the_run_dir_opens(tmp_path):
    root = folder(tmp_path / "data")
    for image in (root / "train" / "emu").iterdir():
        image.unlink()
    message = refusal(tmp_path / "r", *FOLDER, f"dataset.root={root}")
    assert message.startswith(f"class folder train/emu of {root} holds no image"), message
    assert not (tmp_path / "r").exists()


def test_a_class_left_without_a_readable_image_under_skip_unreadable_is_refused(tmp_path):
    root = folder(tmp_path / "data")
    for image in (root / "val" / "dog").iterdir():
        image.write_bytes(b"")  # (a file each: without skip_unreadable a run names the first)
    skip = "dataset.skip_unreadable=true"
    message = refusal(tmp_path / "r", *FOLDER, f"dataset.root={root}", skip)
    assert message.startswith(f"class folder val/dog of {root} holds no readable image"), message
    assert "dataset.skip_unreadable=true" in message
    passes(tmp_path / "r", *FOLDER, f"dataset.root={root}")  # (named by the run, later)


def test_imagenet_and_a_sound_folder(tmp_path):
    """dataset=imagenet's train/ and val/ are walked too; a sound tree, and a link to a folder
    elsewhere (followed once, as torchvision does), pass."""
    root = folder(tmp_path / "data")
    (tmp_path / "elsewhere").mkdir()
    (root / "train" / "cat" / "more").symlink_to(tmp_path / "elsewhere")
    passes(tmp_path / "r", *FOLDER, f"dataset.root={root}")
    for image in (root / "val" / "cat").iterdir():
        image.unlink()
    message = refusal(tmp_path / "r", "dataset=imagenet", f"dataset.root={root}")
    assert "class folder val/cat" in message, message


def test_the_image_extensions_are_torchvisions():
    from torchvision.datasets.folder import IMG_EXTENSIONS

    from data.image_tree import IMG_EXTENSIONS as OURS

    assert set(OURS) == set(IMG_EXTENSIONS)


def test_the_checks_import_no_torch():
    """conf/checks.py runs in the launcher's process too (the gate): no torch, no PIL there."""
    import subprocess
    import sys

    from tests.helpers import REPO, run_env

    code = "import conf.checks, sys; print('torch' in sys.modules, 'PIL' in sys.modules)"
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=run_env(), capture_output=True, text=True
    )
    assert proc.stdout.split() == ["False", "False"], proc.stdout + proc.stderr


def test_eval_refuses_a_zero_timeout_before_its_dir_opens(tmp_path):
    cfg = compose("eval", tmp_path / "e", "dist.timeout_s=0", "ckpt=/nowhere/best.pt")
    with pytest.raises(UserError, match=r"^dist.timeout_s=0 is not valid: use a number of sec"):
        check_start(cfg, tmp_path / "e", 1, sweep=False)
    assert not (tmp_path / "e").exists()


def test_the_gate_walks_the_tree_as_the_dataset_does(tmp_path):
    """data/image_tree.py's walk (the gate's) is the one data/catalog.py builds the dataset with
    (the run's): the same files on a tree with a link to a folder elsewhere, the same refusal
    of a link back in and of a folder reached twice."""
    from data import catalog, image_tree
    from data.catalog import looks_readable as data_readable

    root = folder(tmp_path / "data")
    (tmp_path / "elsewhere" / "deep").mkdir(parents=True)
    (tmp_path / "elsewhere" / "deep" / "x.png").write_bytes(b"")
    (root / "train" / "cat" / "more").symlink_to(tmp_path / "elsewhere")
    guarded = image_tree.guarded_dirs(str(root))
    top = str(root / "train" / "cat")
    assert image_tree.walk_once(top, guarded) == catalog.walk_once(top, guarded)
    for image in [*(root / "train" / "cat").glob("*.png"), tmp_path / "elsewhere/deep/x.png"]:
        assert image_tree.looks_readable(str(image)) == data_readable(str(image))
    for name, target in (("loop", ".."), ("again", tmp_path / "elsewhere")):
        (root / "train" / "cat" / name).symlink_to(target)
        said = []
        for walk in (image_tree.walk_once, catalog.walk_once):
            with pytest.raises(UserError) as caught:
                walk(top, guarded)
            said.append(str(caught.value))
        assert said[0] == said[1], said
        (root / "train" / "cat" / name).unlink()
