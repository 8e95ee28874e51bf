"""train.py end to end: config, entry points, outputs, W&B, checkpoints, resume, bad input.

Runs are real processes (python train.py / torchrun, gloo, offline W&B) on scikit-learn's
digits, the default dataset.
"""

import json
import logging
import os
import re
import shutil
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from ddp_launcher.core.errors import UserError
from ddp_launcher.core.hydra_compat import VERSION_BASE
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import conf.schema  # noqa: F401 - registers the schema for compose()
from components.checkpoint import load_checkpoint
from tests.helpers import (
    OFFLINE,
    QUICK,
    REPO,
    RUN_DIR_ENTRIES,
    frames_in_repo,
    offline_runs,
    output,
    read_json,
    rows,
    run,
    summary_rows,
    train_cmd,
    train_in_process,
    train_rows,
    val_rows,
)

CONF = REPO / "conf"
GROUPS = ["model", "dataset", "augment", "dist", "optim", "trainer", "wandb"]


def only_error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "ERROR" in line or line.startswith("error")]


# ------------------------------------------------------------------------------ configuration


def composition_error(config_dir: Path, overrides: list[str]) -> str:
    """Hydra's error (with its cause) when composing fails; the test fails if it does not."""
    with (
        initialize_config_dir(config_dir=str(config_dir), **VERSION_BASE),
        pytest.raises(Exception) as failure,  # Hydra's own error types vary
    ):
        compose("train", overrides=overrides)
    return f"{failure.value}\n{failure.value.__cause__}"


@pytest.mark.parametrize(
    "group,choice",
    [(g, p.stem) for g in GROUPS for p in sorted((CONF / g).glob("*.yaml"))],
)
def test_every_group_choice_composes(group, choice):
    with initialize_config_dir(config_dir=str(CONF), **VERSION_BASE):
        cfg = compose("train", overrides=[f"{group}={choice}"])
    # every choice is typed by its schema (so typos and wrong types fail at composition)
    assert OmegaConf.get_type(cfg[group]).__module__ == "conf.schema"


@pytest.mark.parametrize(
    "choice",
    [f"experiment={p.stem}" for p in sorted((CONF / "experiment").glob("*.yaml"))]
    + [f"hparams_search={p.stem}" for p in sorted((CONF / "hparams_search").glob("*.yaml"))],
)
def test_experiments_and_search_spaces_compose(choice):
    with initialize_config_dir(config_dir=str(CONF), **VERSION_BASE):
        cfg = compose("train", overrides=[choice], return_hydra_config=True)
    assert cfg.hydra.runtime.choices[choice.split("=")[0]] == choice.split("=")[1]


@pytest.mark.parametrize(
    "override,message",
    [
        ("trainer.max_epoch=3", "Could not override 'trainer.max_epoch'"),
        ("trainer.max_epochs=abc", "could not be converted to Integer"),
        ("model.nme=x", "Could not override 'model.nme'"),
        ("augment.flip=maybe", "is not a valid bool"),
        ("trainer.target=high", "could not be converted to Float"),
    ],
)
def test_typo_or_wrong_type_fails_at_composition(override, message):
    assert message in composition_error(CONF, [override])


@pytest.mark.parametrize(
    "group_file,line,message",
    [
        ("trainer/default.yaml", "max_epoch: 3", "Key 'max_epoch' not in 'TrainerConfig'"),
        ("dist/default.yaml", "sync_batchnorm: maybe", "is not a valid bool"),
    ],
)
def test_typo_in_a_yaml_fails_at_composition(tmp_path, group_file, line, message):
    conf_copy = tmp_path / "conf"
    shutil.copytree(CONF, conf_copy)
    with open(conf_copy / group_file, "a") as f:
        f.write(f"{line}\n")
    assert message in composition_error(conf_copy, ["model=resnet18"])


@pytest.mark.slow
def test_help_lists_config_groups_and_cfg_job_prints_config():
    help_out = run(train_cmd("--help"), timeout=60)
    assert help_out.returncode == 0
    for group in GROUPS:
        assert f"\n{group}: " in help_out.stdout
    assert "model: " in help_out.stdout and "resnet18" in help_out.stdout
    job = run(train_cmd("--cfg", "job", "trainer.max_epochs=7"), timeout=60)
    assert job.returncode == 0
    assert OmegaConf.create(job.stdout).trainer.max_epochs == 7


@pytest.mark.slow
def test_shell_completion():
    script = run(train_cmd("-sc", "install=bash"), timeout=60)
    assert script.returncode == 0 and "hydra_bash_completion" in script.stdout
    query = run(train_cmd("-sc", "query=bash"), timeout=60, COMP_LINE="python train.py model=res")
    assert set(query.stdout.split()) == {"model=resnet18", "model=resnet50"}


# ------------------------------------------------------------------------------ real runs


# FakeData with an odd validation set (size // 5 = 129): 2 ranks cannot split it evenly.
FAKE_ODD = ["dataset=fake", "dataset.size=645", "dataset.image_size=8"]
N_VAL = 129


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """The same 2-epoch job on 1 rank (in this process) and 2 ranks (torchrun)."""
    root = tmp_path_factory.mktemp("runs")
    common = [*QUICK, OFFLINE, *FAKE_ODD, "trainer.max_epochs=2", "seed=3"]
    train_in_process(root / "one", *common)
    # ${now:} with microseconds: without the rank agreement every rank picks its own dir.
    two = run(train_cmd(*common, f"hydra.run.dir={root / 'two'}/${{now:%H-%M-%S-%f}}", nproc=2))
    assert two.returncode == 0, output(two)
    (two_dir,) = (root / "two").iterdir()
    return root / "one", two_dir, two


@pytest.mark.slow
def test_the_default_job(tmp_path):
    """`python train.py` as the README's first command runs it: >= 90 % val/acc in 10 epochs,
    a line per epoch and one at the end (at most 20 lines), no W&B banner."""
    run_dir = tmp_path / "default"
    proc = run(train_cmd(f"hydra.run.dir={run_dir}", "wandb.mode=offline"))
    assert proc.returncode == 0, output(proc)
    vals = val_rows(run_dir)
    assert len(vals) == 10  # the default config trains 10 epochs
    assert vals[-1]["val/acc"] >= 0.90
    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "completed"
    assert result["app"]["best_val_acc"] == max(v["val/acc"] for v in vals)
    # It does not diverge: no warning, nothing recorded (components/divergence.py).
    assert result["app"]["diverged"] is None
    assert "diverging" not in output(proc)

    lines = [line for line in output(proc).splitlines() if line.strip()]
    assert len(lines) <= 20, "\n".join(lines)
    assert sum(bool(re.search(r"epoch \d+/10: train/loss", x)) for x in lines) == 10
    last = lines[-1].split(" - ", 1)[1]
    assert last.startswith("completed in ")
    assert f"best val/acc {result['value']:.4f} (epoch {result['value_epoch']})" in last
    assert f"run dir {run_dir}" in last and str(run_dir / "checkpoints" / "best.pt") in last
    (wb,) = offline_runs(run_dir)
    assert f"wandb sync {wb.path.parent}" in last
    assert "wandb:" not in output(proc)  # no W&B banner or footer


@pytest.mark.slow
def test_two_ranks_share_one_run_dir_written_by_rank_zero(two_runs):
    _, run_dir, proc = two_runs
    # exactly one dir, holding only what rank 0 writes
    names = {p.name for p in run_dir.iterdir()}
    assert names == RUN_DIR_ENTRIES
    assert {p.name for p in (run_dir / ".hydra").iterdir()} == {
        "config.yaml",
        "hydra.yaml",
        "overrides.yaml",
    }
    log = (run_dir / "train.log").read_text()
    assert "epoch 2/2" in log and "[rank1]" not in log
    # metrics.jsonl: the documented keys, all-reduced val metrics over the full val set
    all_rows = rows(run_dir)
    train_rows = [r for r in all_rows if "train/loss" in r]
    keys = {"step", "epoch", "lr", "samples_per_s"}
    assert train_rows and all(keys <= r.keys() for r in train_rows)
    vals = val_rows(run_dir)
    assert [v["epoch"] for v in vals] == [1, 2]
    assert all(0.0 <= v["val/acc"] <= 1.0 and "val/loss" in v for v in vals)
    assert all(v["val/count"] == N_VAL for v in vals)  # every sample once, no padding
    # checkpoints: rank 0's, loadable with weights_only=True, holding the run's state
    last = load_checkpoint(run_dir / "checkpoints" / "last.pt")
    assert last["progress"]["epoch"] == 2 and last["progress"]["step"] == vals[-1]["step"]
    assert last["world_size"] == 2 and len(last["ranks"]) == 2
    assert {"model", "optimizer", "scheduler", "scaler", "progress"} <= last.keys()
    assert (run_dir / "checkpoints" / "best.pt").exists()
    # one W&B run (rank 0's), with the history of metrics.jsonl
    (wb,) = offline_runs(run_dir)
    assert wb.run_id == last["progress"]["wandb_run_id"] and wb.exit_code == 0
    assert len(wb.history) == len({r["step"] for r in all_rows})
    assert wb.config["run"]["world_size"] == 2 and wb.config["run"]["per_rank_batch_size"] == 32
    assert wb.config["trainer"]["max_epochs"] == 2


@pytest.mark.slow
def test_each_rank_draws_its_own_dropout_masks_from_the_same_initial_weights(tmp_path):
    """2 ranks (gloo), dropout 0.5, each rank's first training forward recorded
    (tests/rank_probe.py): the same initial weights (drawn from the run's seed, before DDP),
    but each rank's own dropout mask; with one seed for every rank, rank 1 would drop what rank
    0 drops for the same local sample."""
    log = tmp_path / "probe.jsonl"
    overrides = [
        "model._target_=tests.rank_probe.small_cnn",
        "model.dropout=0.5",
        "trainer.limit_train_batches=2",
        "trainer.limit_val_batches=1",
        "trainer.test_after_fit=false",
        f"hydra.run.dir={tmp_path / 'r'}",
    ]
    proc = run(train_cmd(*QUICK, *overrides, nproc=2), timeout=300, RANK_PROBE_LOG=str(log))
    assert proc.returncode == 0, output(proc)
    ranks = sorted(
        (json.loads(line) for line in log.read_text().splitlines()), key=lambda r: r["rank"]
    )
    assert [r["rank"] for r in ranks] == [0, 1]
    assert ranks[0]["weights"] == ranks[1]["weights"]  # drawn from the run's seed
    assert ranks[0]["mask"] != ranks[1]["mask"]  # each rank's own draw


@pytest.mark.slow
def test_world_size_invariance(two_runs):
    one_dir, two_dir, _ = two_runs
    one = load_checkpoint(one_dir / "checkpoints" / "last.pt")["model"]
    two = load_checkpoint(two_dir / "checkpoints" / "last.pt")["model"]
    assert one.keys() == two.keys()
    for key in one:
        torch.testing.assert_close(one[key], two[key], rtol=1e-4, atol=1e-5, msg=key)
    # and the run really trained: weights moved away from a fresh model's
    assert any(not torch.equal(one[k], two[k]) or one[k].abs().sum() > 0 for k in one)


@pytest.mark.slow
def test_resume_auto_continues_from_last(two_runs, tmp_path):
    one_dir, _, _ = two_runs
    run_dir = tmp_path / "resumed"
    shutil.copytree(one_dir, run_dir)
    before = rows(run_dir)
    run_id = load_checkpoint(run_dir / "checkpoints" / "last.pt")["progress"]["wandb_run_id"]
    proc = run(
        train_cmd(
            *QUICK,
            OFFLINE,
            "trainer.max_epochs=3",
            f"hydra.run.dir={run_dir}",
            "resume=auto",
            *FAKE_ODD,
            "seed=3",
        )
    )
    assert proc.returncode == 0, output(proc)
    assert "resumed from" in (run_dir / "train.log").read_text()
    after = rows(run_dir)
    assert after[: len(before)] == before  # nothing written before is lost
    assert [v["epoch"] for v in val_rows(run_dir)] == [1, 2, 3]
    steps = [r["step"] for r in after if "train/loss" in r]
    assert steps == sorted(set(steps))  # no duplicated steps
    assert load_checkpoint(run_dir / "checkpoints" / "last.pt")["progress"]["epoch"] == 3
    # the same W&B run continues
    assert {r.run_id for r in offline_runs(run_dir)} == {run_id}


# ------------------------------------------------------------------------------ bad input

# Every bad input a run can be given, and what its one-line error must say (in this process:
# train(cfg) raises the UserError that the process would report).
BAD_INPUTS = [
    (
        ["model=torchvision", "model.name=resnet_nope"],
        ["unknown torchvision classification model 'resnet_nope'", "did you mean"],
    ),
    (["dist.backend=nccl"], ["dist.backend=nccl needs a CUDA GPU", "gloo"]),
    (["dist.backend=mpi"], ["dist.backend=mpi is not valid", "auto, nccl or gloo"]),
    (["trainer.device=tpu"], ["trainer.device=tpu is not valid"]),
    (
        ["trainer.device=cuda", "dist.backend=gloo"],
        ["trainer.device=cuda with dist.backend=gloo would train on the CPU", "trainer.device=cpu"],
    ),
    (
        ["model.batch_norm=true", "dist.sync_batchnorm=true"],
        ["dist.sync_batchnorm=true needs CUDA ranks", "use dist.sync_batchnorm=false"],
    ),
    (["optim.lr=1e12"], ["non-finite loss", "at step", "optim.lr"]),
    # (the gate refuses it before the optimizer could: issue 66, a learning rate > 0)
    (["optim.lr=-0.1"], ["optim.lr=-0.1", "use a learning rate > 0", "e.g. optim.lr=0.1"]),
    (["optim.lr_scaling=cubic"], ["optim.lr_scaling=cubic is not valid", "linear"]),
    (["optim=adamw", "optim.betas=[0.9,2.0]"], ["Invalid beta parameter", "optim"]),
    # a list shorter than the optimizer reads: its IndexError was a traceback
    (["optim=adamw", "optim.betas=[]"], ["optim.betas=[]", "fix optim.*"]),
    (["augment=crop_flip", "augment.crop=zoom"], ["augment.crop=zoom is not valid"]),
    (["augment=none", "augment.random_erasing=1.5"], ["augment.random_erasing=1.5"]),
    (["augment=rand_augment", "augment.policy.num_ops=-1"], ["augment: ", "fix augment.*"]),
    (
        ["augment=auto_augment", "augment.policy.policy=mnist"],
        ["augment.policy.policy=mnist is not valid", "cifar10"],
    ),
    (["trainer.mixup.mixup_alpha=-1"], ["trainer.mixup.mixup_alpha=-1.0 is out of range"]),
    (["trainer.ema.decay=1.5"], ["trainer.ema.decay=1.5 must be in (0, 1)"]),
    (["trainer.monitor.mode=maximum"], ["trainer.monitor.mode=maximum is not valid"]),
    (["trainer.monitor.metric=val/acx"], ["trainer.monitor.metric=val/acx", "val/acc"]),
    (["trainer.early_stopping.patience=0"], ["trainer.early_stopping.patience=0"]),
    (["trainer.precision=fp8"], ["trainer.precision=fp8 is not valid", "bf16"]),
    (["trainer.lr_schedule=step"], ["trainer.lr_schedule=step", "cosine or constant"]),
    (["trainer.batch_size=4096"], ["exceeds the training set", "lower trainer.batch_size"]),
    (["trainer.accumulate_grad_batches=0"], ["trainer.accumulate_grad_batches=0"]),
    (
        ["trainer.batch_size=64", "trainer.accumulate_grad_batches=3"],
        [
            "trainer.batch_size=64 (the global batch) is not divisible by the world size 1 x "
            "trainer.accumulate_grad_batches=3"
        ],
    ),
    (["dist.nproc_per_node=two"], ["dist.nproc_per_node=two is not valid", "auto or a positive"]),
    (
        ["dataset=mnist", "dataset.root=/nonexistent/mnist"],
        ["/nonexistent/mnist", "dataset.download=true"],
    ),
    # one class trained to loss 0 and accuracy 1 without a word
    (["dataset=fake", "dataset.num_classes=1"], ["dataset.num_classes=1", "at least 2 classes"]),
    # a file as the root: its "not found" named dataset.download=true, which cannot work
    (
        ["dataset=mnist", f"dataset.root={REPO / 'README.md'}", "dataset.download=true"],
        [f"dataset.root={REPO / 'README.md'} is a file, not a folder"],
    ),
    (
        ["dataset=imagefolder", f"dataset.root={REPO / 'README.md'}"],
        [f"dataset.root={REPO / 'README.md'} is a file, not a folder"],
    ),
    (["dataset=imagefolder"], ["dataset imagefolder needs dataset.root", "point dataset.root at"]),
    (["dataset.val_fraction=1.5"], ["dataset.val_fraction=1.5 is out of range"]),
    (["resume=/nonexistent/last.pt"], ["/nonexistent/last.pt does not exist", "resume="]),
    (["model=torchvision"], ["model.name is required", "model.name="]),
    (["trainer.max_epochs=0"], ["trainer.max_epochs=0 is not valid", "integer >= 1"]),
    (["trainer.log_every_n_steps=0"], ["trainer.log_every_n_steps=0 is not valid"]),
    (
        ["trainer.limit_train_batches=-1"],
        ["trainer.limit_train_batches=-1 is not valid", "a fraction in (0, 1]"],
    ),
    (["trainer.limit_val_batches=1.5"], ["trainer.limit_val_batches=1.5 is not valid"]),
    (["trainer.overfit_batches=0"], ["trainer.overfit_batches=0 is not valid"]),
    (["trainer.progress_every_s=0"], ["trainer.progress_every_s=0", "positive"]),
    (
        ["trainer.monitor.metric=val/f1"],
        ["trainer.monitor.metric=val/f1 is not a validation metric", "val/acc"],
    ),
    (["trainer.monitor.mode=up"], ["trainer.monitor.mode=up is not valid", "max or min"]),
    (
        ["trainer.target=99"],
        ["trainer.target=99", "outside val/acc's range", "e.g. trainer.target=0.99"],
    ),
    (["trainer.target=nan"], ["trainer.target=nan is not a number", "val/acc"]),
    (["trainer.stop_at_target=true"], ["trainer.stop_at_target=true needs a trainer.target"]),
]


def assert_clean_failure(proc, *fragments: str):
    text = output(proc)
    assert proc.returncode != 0, text
    # no traceback through our code (torchrun's agent prints its own failure report, from a
    # venv that may be inside the checkout: frames_in_repo leaves those out)
    assert not frames_in_repo(text), text
    assert any(all(f in line for f in fragments) for line in text.splitlines()), text


@pytest.mark.parametrize("overrides, fragments", BAD_INPUTS)
def test_bad_input_is_one_user_error_and_recorded(tmp_path, overrides, fragments):
    """One line naming the fix. What the gate (ddp_launcher/core/gate.py) finds before a start
    writes
    anything leaves nothing written; what only the run finds is recorded in result.json."""
    run_dir = tmp_path / "r"
    with pytest.raises(UserError) as caught:
        train_in_process(run_dir, *QUICK, *overrides)
    message = str(caught.value)
    assert "\n" not in message and all(f in message for f in fragments), message
    if refused_at_the_gate(run_dir, *QUICK, *overrides) == message:
        assert not run_dir.exists()
    else:
        result = json.loads((run_dir / "result.json").read_text())
        assert result["status"] == "failed" and result["error"] == message


def refused_at_the_gate(run_dir: Path, *overrides: str) -> str | None:
    """The gate's refusal of this start (ddp_launcher/core/gate.py: the app's checks, the run
    dir), if any."""
    from ddp_launcher.core.gate import check_start

    from tests.helpers import compose

    try:
        check_start(compose("train", run_dir, *overrides), run_dir, 1, sweep=False)
    except UserError as e:
        return str(e)
    return None


@pytest.mark.slow
def test_a_user_error_is_one_line_and_exit_status_2(tmp_path):
    proc = run(train_cmd(*QUICK, f"hydra.run.dir={tmp_path / 'r'}", "optim.lr=1e12"), timeout=180)
    assert proc.returncode == 2, output(proc)
    assert not frames_in_repo(output(proc)), output(proc)  # no traceback
    assert only_error_lines(output(proc)) == [
        line for line in output(proc).splitlines() if "non-finite loss" in line
    ]
    assert len(only_error_lines(output(proc))) == 1
    assert "non-finite loss" in (tmp_path / "r" / "train.log").read_text()


@pytest.mark.parametrize(
    "overrides, fragments",
    [
        (["dataset=nope"], ["Could not find 'dataset/nope'", "digits"]),
        (["trainer.max_epochs=abc"], ["'abc'", "Integer"]),
        (["wandb.mode=onlin"], ["'onlin'", "auto, online, offline, disabled"]),
    ],
)
def test_unknown_choice_and_wrong_type_fail_at_composition(tmp_path, overrides, fragments):
    text = composition_error(CONF, overrides)
    assert all(f in text for f in fragments), text


def test_wandb_environment_is_honoured(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    train_in_process(tmp_path / "off", *QUICK[:1], "trainer.log_every_n_steps=100")
    assert not (tmp_path / "off" / "wandb").exists()  # no offline run written
    # an explicit override wins over the environment
    train_in_process(tmp_path / "on", *QUICK, OFFLINE, "trainer.log_every_n_steps=100")
    assert len(offline_runs(tmp_path / "on")) == 1
    monkeypatch.setenv("WANDB_MODE", "bogus")
    env_value = r"wandb.mode: from '\$\{oc.env:WANDB_MODE,auto\}': Invalid value 'bogus'"
    with pytest.raises(UserError, match=env_value):
        train_in_process(tmp_path / "bad", *QUICK[:1])


def test_full_disk_while_saving_is_one_error_and_resume_continues(tmp_path, monkeypatch):
    import errno

    from components import checkpoint

    run_dir, writes = tmp_path / "r", []
    real_write = checkpoint.atomic_path  # every checkpoint file a save writes is staged by it

    @contextmanager
    def disk_fills_at_the_second_checkpoint(path, **kwargs):
        writes.append(path.name)
        if sum(checkpoint.STEP_FILE.match(name) is not None for name in writes) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        with real_write(path, **kwargs) as tmp:
            yield tmp

    monkeypatch.setattr(checkpoint, "atomic_path", disk_fills_at_the_second_checkpoint)
    common = ["trainer.max_epochs=2", "trainer.progress_bar=false", "wandb.mode=disabled"]
    with pytest.raises(UserError, match=r"cannot write checkpoint .*step-00000044.pt \(No space"):
        train_in_process(run_dir, *common)
    assert json.loads((run_dir / "result.json").read_text())["status"] == "failed"
    (saved,) = sorted((run_dir / "checkpoints").glob("step-*.pt"))
    assert load_checkpoint(saved)["progress"]["epoch"] == 1  # the earlier checkpoint is whole
    monkeypatch.setattr(checkpoint, "atomic_path", real_write)
    train_in_process(run_dir, *common, "resume=auto")
    assert load_checkpoint(run_dir / "checkpoints" / "last.pt")["progress"]["epoch"] == 2
    assert [v["epoch"] for v in val_rows(run_dir)] == [1, 2]


def test_weights_that_turn_nan_at_a_save_step_never_reach_a_checkpoint(tmp_path, monkeypatch):
    """As on a GPU, where the loss is read only at log steps (no host sync per step): the
    update of step 4 turns a weight NaN, and step 4 saves (checkpoint_every_n_steps=2) before
    any loss shows it. The save refuses with the non-finite error; the committed checkpoints
    (step 2's) hold finite weights, so resume=auto never continues from NaN."""
    from components import train_step

    real_step = train_step.TrainStep.optimizer_step
    steps = []

    def update_then_nan_at_step_4(self, log_step):
        updated = real_step(self, log_step)
        steps.append(updated)
        if len(steps) == 4:
            with torch.no_grad():
                next(self.plain_model.parameters()).view(-1)[0] = float("nan")
        return updated

    monkeypatch.setattr(train_step.TrainStep, "optimizer_step", update_then_nan_at_step_4)
    run_dir = tmp_path / "r"
    with pytest.raises(UserError) as e:
        train_in_process(
            run_dir,
            *QUICK,
            "trainer.checkpoint_every_n_steps=2",
            "trainer.log_every_n_steps=100",
        )
    saved = sorted((run_dir / "checkpoints").glob("*.pt"))
    assert {p.name for p in saved} >= {"last.pt", "step-00000002.pt"}
    for path in saved:
        assert all(torch.isfinite(t).all() for t in load_checkpoint(path)["model"].values()), path
    assert load_checkpoint(run_dir / "checkpoints" / "last.pt")["progress"]["step"] == 2
    assert str(e.value).startswith("non-finite values in the model at step 4 (epoch 1)")


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="Linux's peak reset")
def test_peak_memory_is_reset_for_each_phase(tmp_path, monkeypatch):
    """Each epoch's training and its validation each start a new peak (on the CPU the resident
    set's; on a GPU torch.cuda.reset_peak_memory_stats): a validation that holds 384 MiB more
    than training does shows in result.json's peak, not in the next epoch's train rows'
    peak_mem_mb."""
    import train

    extra_mib = 384
    real_evaluate = train.evaluate

    def evaluate_holding_more_memory(*args, **kwargs):
        held = torch.ones(extra_mib * 2**20 // 4)  # written: resident
        try:
            return real_evaluate(*args, **kwargs)
        finally:
            del held

    monkeypatch.setattr(train, "evaluate", evaluate_holding_more_memory)
    run_dir = tmp_path / "r"
    train_in_process(run_dir, *QUICK[1:], "trainer.max_epochs=2", "trainer.log_every_n_steps=5")
    second = [r["peak_mem_mb"] for r in train_rows(run_dir) if r["epoch"] == 2]
    (run_peak,) = read_json(run_dir / "result.json")["app"]["peak_memory_mb_per_rank"]
    assert second and max(second) < run_peak - 0.8 * extra_mib, (second, run_peak)


def test_non_finite_loss_keeps_what_was_written(tmp_path):
    run_dir = tmp_path / "nan"
    with pytest.raises(UserError, match="non-finite loss"):
        train_in_process(run_dir, *QUICK, OFFLINE, "optim.lr=1e12", "trainer.log_every_n_steps=1")
    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "failed" and "non-finite loss" in result["error"]
    (wb,) = offline_runs(run_dir)
    assert wb.exit_code == 1  # the W&B run shows as failed


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides,fragments",
    [
        (["trainer.batch_size=63"], ["trainer.batch_size=63", "not divisible", "world size 2"]),
        (["dist.nproc_per_node=4"], ["dist.nproc_per_node=4", "torchrun started 2"]),
        # on b2beecb: torch's ValueError traceback from the first SyncBatchNorm forward
        (
            ["model.batch_norm=true", "dist.sync_batchnorm=true"],
            ["dist.sync_batchnorm=true needs CUDA ranks", "dist.sync_batchnorm=false"],
        ),
    ],
)
def test_bad_input_two_ranks_exit_without_hanging(tmp_path, overrides, fragments):
    proc = run(
        train_cmd(*QUICK, f"hydra.run.dir={tmp_path / 'r'}", *overrides, nproc=2), timeout=180
    )
    assert_clean_failure(proc, *fragments)


def test_corrupt_checkpoint_is_one_user_error_and_loses_nothing(tmp_path):
    run_dir = tmp_path / "r"
    (run_dir / "checkpoints").mkdir(parents=True)
    bad = run_dir / "checkpoints" / "last.pt"
    bad.write_bytes(b"not a checkpoint" * 10)
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "epoch": 1, "train/loss": 1.0}\n')
    with pytest.raises(UserError, match=f"no valid checkpoint in {bad.parent}.*last.pt.*resume="):
        train_in_process(run_dir, *QUICK, "resume=auto")
    with pytest.raises(UserError, match=f"{bad} cannot be loaded.*resume="):
        train_in_process(run_dir, *QUICK, f"resume={bad}")
    assert bad.read_bytes() == b"not a checkpoint" * 10
    assert (run_dir / "metrics.jsonl").read_text() == '{"step": 1, "epoch": 1, "train/loss": 1.0}\n'


@pytest.mark.slow
def test_wandb_init_failure_is_a_warning(tmp_path):
    run_dir = tmp_path / "r"
    home = tmp_path / "home"
    home.mkdir()
    proc = run(
        train_cmd(
            "trainer.max_epochs=1",
            "trainer.progress_bar=false",
            "wandb.mode=online",
            "wandb.init_timeout_s=30",
            f"hydra.run.dir={run_dir}",
        ),
        timeout=240,
        HOME=str(home),
        NETRC=str(home / ".netrc"),
    )
    assert proc.returncode == 0, output(proc)
    assert "W&B init failed, training goes on without it" in output(proc)
    assert len(val_rows(run_dir)) == 1
    assert json.loads((run_dir / "result.json").read_text())["status"] == "completed"


@pytest.mark.slow
def test_ctrl_c_is_interrupted_with_one_line(tmp_path):
    import signal
    import subprocess

    from tests.helpers import run_env, sigint_as_in_a_terminal, wait_for_rows

    run_dir = tmp_path / "r"
    proc = subprocess.Popen(
        train_cmd(
            "trainer.max_epochs=50",
            "wandb.mode=disabled",
            "trainer.progress_bar=false",
            f"hydra.run.dir={run_dir}",
        ),
        cwd=REPO,
        env=run_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=sigint_as_in_a_terminal,
    )
    wait_for_rows(run_dir / "metrics.jsonl", 3, proc)
    proc.send_signal(signal.SIGINT)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 130, out
    assert "Traceback" not in out and out.count("interrupted (Ctrl-C)") == 1, out
    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "interrupted"


# ------------------------------------------------------------------------------ wandb agent

# What `wandb agent` sets for each run it starts (wandb/wandb_agent.py): the run id, the sweep
# id, and a file with the run's parameters (the keys its sweep varies).
AGENT_RUN_ID = "agentrun01"


def agent_env(tmp_path: Path, **params: object) -> dict:
    path = tmp_path / "sweep-params.yaml"
    path.write_text(
        "wandb_version: 1\n"
        + "".join(f"{key}:\n  value: {value}\n" for key, value in params.items())
    )
    return {
        "WANDB_SWEEP_ID": "sweep01",
        "WANDB_RUN_ID": AGENT_RUN_ID,
        "WANDB_SWEEP_PARAM_PATH": str(path),
        "WANDB_PROJECT": "agent-project",
    }


@pytest.mark.slow
def test_wandb_agent_run_is_rank_0s_and_other_ranks_stay_silent(tmp_path):
    """`wandb agent` runs `python train.py <args>` with its run id in the environment; with
    dist.nproc_per_node=2 train.py starts its ranks itself: rank 0 logs into the agent's run
    (named by the swept values), rank 1 touches no W&B at all."""
    run_dir = tmp_path / "r"
    env = agent_env(tmp_path, **{"optim.lr": 0.05})
    proc = run(
        train_cmd(
            *QUICK, OFFLINE, "optim.lr=0.05", "dist.nproc_per_node=2", f"hydra.run.dir={run_dir}"
        ),
        **env,
    )
    assert proc.returncode == 0, output(proc)[-5000:]
    (wb,) = offline_runs(run_dir)
    assert wb.run_id == AGENT_RUN_ID and wb.exit_code == 0
    assert wb.name == "lr=0.05" and wb.config["swept"] == {"lr": 0.05}
    assert wb.config["optim.lr"] == 0.05  # the agent's parameters, as W&B loads them
    assert any("val/acc" in h for h in wb.history)
    assert json.loads((run_dir / "result.json").read_text())["wandb_run_id"] == AGENT_RUN_ID
    assert len(list(run_dir.rglob("offline-run-*"))) == 1
    rank1 = list(run_dir.glob("rank_logs/*/attempt_*/1/*.log"))
    assert rank1 and not any("wandb" in p.read_text().lower() for p in rank1), rank1


def test_wandb_agent_run_wins_over_a_checkpoints_run(tmp_path, monkeypatch):
    """A run resumed under the agent logs into the agent's run (W&B would ignore the
    checkpoint's id anyway), with the earlier epochs replayed from metrics.jsonl."""
    run_dir = tmp_path / "r"
    train_in_process(run_dir, *QUICK, OFFLINE)
    (first,) = offline_runs(run_dir)
    for key, value in agent_env(tmp_path, seed=0).items():
        monkeypatch.setenv(key, value)
    train_in_process(run_dir, *QUICK, OFFLINE, "trainer.max_epochs=2", "resume=auto")
    runs = {r.run_id: r for r in offline_runs(run_dir)}
    assert set(runs) == {first.run_id, AGENT_RUN_ID}
    agent = runs[AGENT_RUN_ID]
    assert [h["epoch"] for h in agent.history if "val/acc" in h] == [1, 2]
    assert json.loads((run_dir / "result.json").read_text())["wandb_run_id"] == AGENT_RUN_ID
    last = load_checkpoint(run_dir / "checkpoints" / "last.pt")
    assert last["progress"]["wandb_run_id"] == AGENT_RUN_ID


def test_a_diverging_run_says_so_once_and_records_it(tmp_path, caplog):
    """digits at optim.lr=8 (20x the recipe's): the train loss climbs past 1.5x its first
    window's after the warm-up, but stays finite. One warning line names the step, the lr and
    the overrides to try; result.json and the W&B run's summary record it."""
    run_dir = tmp_path / "run"
    with caplog.at_level(logging.WARNING, logger="train"):
        train_in_process(run_dir, OFFLINE, "trainer.max_epochs=3", "optim.lr=8")
    warnings = [r.getMessage() for r in caplog.records if r.getMessage().startswith("diverging:")]
    assert len(warnings) == 1, warnings
    found = read_json(run_dir / "result.json")["app"]["diverged"]
    assert found is not None
    train = {r["step"]: r for r in train_rows(run_dir)}
    row = train[found["step"]]  # the logged window that crossed the line
    first = train[min(train)]
    assert found["train/loss"] == row["train/loss"] > 1.5 * first["train/loss"]
    assert found["first_train/loss"] == first["train/loss"]
    assert found["lr"] == row["lr"] and found["epoch"] == row["epoch"]
    # after the warm-up (1 epoch); every earlier window after warm-up stayed below the line
    steps_per_epoch = max(r["step"] for r in train.values() if r["epoch"] == 1)
    assert found["step"] > steps_per_epoch
    assert all(
        r["train/loss"] <= 1.5 * first["train/loss"]
        for s, r in train.items()
        if steps_per_epoch < s < found["step"]
    )
    assert found["try"] == ["optim.lr=4", "trainer.grad_clip=1.0"]
    (message,) = warnings
    assert f"step {found['step']}" in message and "optim.lr=4" in message
    (wb,) = offline_runs(run_dir)
    assert wb.summary["train/diverged_step"] == found["step"]
    assert wb.summary["train/diverged_lr"] == found["lr"]


# ------------------------------------------------------------------------------ trainer.target


@pytest.mark.slow
def test_target_records_when_the_metric_first_reached_it(tmp_path):
    """digits with trainer.target=0.9: result.json and the W&B summary record the first
    validation at >= 0.9 (its epoch and step, the seconds from process start on the same clock
    as time_to_first_step_s); the run goes on to its last epoch."""
    run_dir = tmp_path / "run"
    started = time.time()
    proc = run(train_cmd(f"hydra.run.dir={run_dir}", OFFLINE, "trainer.target=0.9"))
    ran_s = time.time() - started
    assert proc.returncode == 0, output(proc)
    result = read_json(run_dir / "result.json")
    vals = val_rows(run_dir)
    first = next(v for v in vals if v["val/acc"] >= 0.9)
    target = result["target"]
    assert target["value"] == 0.9 and target["metric"] == "val/acc" and target["mode"] == "max"
    assert target["epoch"] == first["epoch"] and target["reached_at_step"] == first["step"]
    assert target["reached_value"] == first["val/acc"]
    # after the first step, before the process ended
    assert result["app"]["time_to_first_step_s"] < target["reached_at_s"] < ran_s
    assert result["app"]["epochs"] == len(vals) == 10 and result["app"]["stopped_at_target"] is None
    assert f"val/acc reached the target 0.9 ({first['val/acc']:.4f}) at epoch" in output(proc)
    (wb,) = offline_runs(run_dir)
    assert wb.summary["target/reached_at_step"] == first["step"]
    assert wb.summary["target/reached_at_s"] == target["reached_at_s"]


def test_stop_at_target_ends_the_run_as_its_last_epoch_would(tmp_path):
    """trainer.stop_at_target=true: the run ends after the first validation at the target,
    completed, with its checkpoint saved and best.pt tested."""
    run_dir = tmp_path / "run"
    train_in_process(
        run_dir,
        *QUICK,
        "trainer.max_epochs=10",
        "trainer.target=0.9",
        "trainer.stop_at_target=true",
    )
    result = read_json(run_dir / "result.json")
    vals = val_rows(run_dir)
    reached = result["target"]["epoch"]
    assert reached is not None and reached < 10
    assert [v["epoch"] for v in vals] == list(range(1, reached + 1))
    assert vals[-1]["val/acc"] >= 0.9 > max(v["val/acc"] for v in vals[:-1])
    assert result["status"] == "completed" and result["app"]["stopped_at_target"] is True
    assert result["app"]["epochs"] == reached and result["app"]["test"]["test/acc"] > 0
    last = load_checkpoint(run_dir / "checkpoints" / "last.pt")
    assert last["progress"]["epoch"] == reached
    assert last["progress"]["step"] == result["target"]["reached_at_step"]


def test_an_unreached_target_leaves_its_record_empty_and_does_not_stop(tmp_path):
    run_dir = tmp_path / "run"
    train_in_process(
        run_dir, *QUICK, "trainer.max_epochs=2", "trainer.target=1.0", "trainer.stop_at_target=true"
    )
    result = read_json(run_dir / "result.json")
    assert result["app"]["epochs"] == 2 and result["app"]["stopped_at_target"] is None
    assert max(v["val/acc"] for v in val_rows(run_dir)) < 1.0
    assert result["target"] == {
        "value": 1.0,
        "metric": "val/acc",
        "mode": "max",
        "reached_at_s": None,
        "reached_at_step": None,
        "epoch": None,
        "reached_value": None,
    }
    no_target = tmp_path / "none"
    train_in_process(no_target, *QUICK)
    assert read_json(no_target / "result.json")["target"] is None


@pytest.mark.slow
def test_the_sweep_summary_has_a_column_of_the_time_to_target(tmp_path):
    """`python train.py -m seed=0,1 trainer.target=0.9`: "time to 90 %" is one column of the
    sweep's summary (each job's result.json record)."""
    sweep_dir = tmp_path / "sweep"
    proc = run(
        train_cmd(
            "-m",
            "seed=0,1",
            "trainer.target=0.9",
            "trainer.max_epochs=4",
            "wandb.mode=disabled",
            f"hydra.sweep.dir={sweep_dir}",
        )
    )
    assert proc.returncode == 0, output(proc)
    table = {r["seed"]: r for r in summary_rows(sweep_dir)}
    assert set(table) == {"0", "1"}
    for job in ("0", "1"):
        target = read_json(sweep_dir / job / "result.json")["target"]
        row = table[str(target_seed(sweep_dir / job))]
        assert target["reached_at_s"] is not None
        assert float(row["target_reached_at_s"]) == target["reached_at_s"]
        assert int(float(row["target_reached_at_step"])) == target["reached_at_step"]
    assert "s to val/acc>=0.9" in (sweep_dir / "summary.md").read_text()


def target_seed(job_dir: Path) -> int:
    return next(
        int(o.split("=")[1])
        for o in OmegaConf.load(job_dir / ".hydra" / "overrides.yaml")
        if o.startswith("seed=")
    )
