"""components/: the services inside a rank, as units (no processes, no training).

Checkpoint files (digests, atomic writes, fallback, pruning, resume choice, one TrainingState
saving and restoring everything), the metrics log's de-duplication and W&B replay, world-size
rules, the error policy. Collectives run on a one-rank process group in this process.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import sys
import threading
import time
import warnings
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from ddp_launcher.core import world
from ddp_launcher.core.errors import (
    ReportUserError,
    UserError,
    describe,
    find_user_error,
    instantiate,
)
from ddp_launcher.core.gate import resume_choice
from ddp_launcher.core.run_dir import ATTEMPT_ENV, RunResult, read_result

from components import checkpoint as ck
from components import distributed
from components.loss_window import LossWindow
from components.metrics import RunLogger, ending, rows_to_replay
from components.preemption import Preempted
from conf import checks
from tests import faults
from tests.helpers import training_state


@pytest.fixture
def one_rank_group():
    """A one-rank gloo group in this process, as train.py makes for a single process."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


# ------------------------------------------------------------------------------ checkpoints


def save(path: Path, step: int) -> None:
    ck.atomic_save(
        {"model": {"w": torch.full((2,), float(step))}, "progress": {"step": step}}, path
    )


def test_digest_detects_corruption_and_truncation(tmp_path):
    path = tmp_path / "step-00000001.pt"
    save(path, 1)
    assert ck.verify(path) is None
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    assert "SHA-256 mismatch" in ck.verify(path)
    with pytest.raises(UserError, match="cannot be loaded"):
        ck.load_checkpoint(path)
    path.write_bytes(path.read_bytes()[:100])  # torn
    assert ck.verify(path) is not None


def test_latest_valid_skips_bad_newer_files_and_names_them(tmp_path, caplog):
    for step in (10, 20, 30):
        save(tmp_path / f"step-{step:08d}.pt", step)
    (tmp_path / "step-00000030.pt").write_bytes(b"torn")
    ck.digest_path(tmp_path / "step-00000020.pt").write_text("0" * 64 + "\n")  # wrong digest
    with caplog.at_level(logging.WARNING):
        path, state = ck.settle(tmp_path)
    assert path.name == "step-00000010.pt" and state["progress"]["step"] == 10
    assert "step-00000030.pt" in caplog.text and "step-00000020.pt" in caplog.text


def test_no_valid_checkpoint_is_a_user_error_and_none_is_a_fresh_start(tmp_path):
    assert ck.settle(tmp_path) is None
    (tmp_path / "step-00000005.pt").write_bytes(b"x" * 10)
    with pytest.raises(UserError, match="no valid checkpoint .* resume=null"):
        ck.settle(tmp_path)


def test_step_files_newest_first_ignoring_other_names(tmp_path):
    for name in ("step-00000009.pt", "step-00000010.pt", "step-2.pt", "last.pt", "x.pt"):
        (tmp_path / name).write_bytes(b"")
    assert [p.name for p in ck.step_files(tmp_path)] == [
        "step-00000010.pt",
        "step-00000009.pt",
        "step-2.pt",
    ]


def test_prune_plan_keeps_the_newest_and_the_best(tmp_path):
    paths = []
    for step in (50, 40, 30, 20, 10):  # newest first
        paths.append(tmp_path / f"step-{step:08d}.pt")
        paths[-1].write_bytes(str(step).encode())
    os.link(paths[3], tmp_path / "best.pt")  # step 20 is the best
    doomed = ck.prune_plan(paths, keep=2, best=tmp_path / "best.pt")
    assert [p.name for p in doomed] == ["step-00000030.pt", "step-00000010.pt"]
    assert ck.prune_plan(paths, keep=10, best=None) == []
    assert len(ck.prune_plan(paths, keep=0, best=tmp_path / "absent.pt")) == 5


def test_atomic_save_leaves_the_old_file_when_a_save_fails(tmp_path):
    path = tmp_path / "last.pt"
    save(path, 5)
    with pytest.raises(Exception):  # noqa: B017 - whatever torch.save raises
        ck.atomic_save({"model": lambda: None}, path)
    assert ck.load_checkpoint(path)["progress"]["step"] == 5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt", "last.pt.sha256"]


@pytest.mark.usefixtures("one_rank_group")
def test_a_crash_while_a_step_is_saved_again_never_leaves_it_beside_a_wrong_digest(
    tmp_path, monkeypatch
):
    """A step is saved again at its epoch's end (with its validation, after a stop there):
    killed as the new file is renamed into place, what is left of that step still verifies (it
    was a test_sigkill_during_saves failure), and last.pt keeps the committed step."""
    progress = SimpleNamespace(state_dict=lambda: {"step": 11}, load_state_dict=None)
    state = ck.TrainingState(
        shared={"model": torch.nn.Linear(2, 1), "progress": progress}, per_rank={}
    )
    checkpoints = ck.Checkpointer(tmp_path, rank=0, keep=2)
    checkpoints.save(state, step=11, is_best=False)
    folder = tmp_path / "checkpoints"
    path = folder / "step-00000011.pt"
    real_replace = os.replace

    def killed_before_the_file(src, dst):
        if Path(dst).name.startswith("step-00000011") and not Path(dst).name.endswith(".sha256"):
            raise KeyboardInterrupt  # stands in for the SIGKILL at that instant
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", killed_before_the_file)
    with pytest.raises(KeyboardInterrupt):
        checkpoints.save(state, step=11, is_best=False)
    monkeypatch.setattr(os, "replace", real_replace)
    assert not path.exists() or ck.verify(path) is None
    assert ck.verify(folder / "last.pt") is None
    assert ck.load_checkpoint(folder / "last.pt")["progress"]["step"] == 11
    assert not [p for p in folder.iterdir() if ".tmp-" in p.name]


@pytest.mark.usefixtures("one_rank_group")
def test_a_save_on_a_full_disk_names_a_fix_that_works(tmp_path, monkeypatch):
    """A save that does not fit said "free space ... or lower trainer.keep_checkpoints; the
    checkpoints already there are whole": a lower count cannot help (the new file is written
    before pruning) and, at the first save, there were none. It names what works and what a
    resume then does."""
    progress = SimpleNamespace(state_dict=lambda: {"step": 3}, load_state_dict=None)
    state = ck.TrainingState(
        shared={"model": torch.nn.Linear(2, 1), "progress": progress}, per_rank={}
    )
    checkpoints = ck.Checkpointer(tmp_path, rank=0, keep=2)
    real_fsync = os.fsync

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    for step, then in ((3, "no checkpoint was committed yet"), (6, "already there are whole")):
        if step == 6:
            monkeypatch.setattr(os, "fsync", real_fsync)
            checkpoints.save(state, step=3, is_best=False)  # one committed
        monkeypatch.setattr(os, "fsync", full)
        with pytest.raises(UserError) as caught:
            checkpoints.save(state, step=step, is_best=False)
        message = str(caught.value)
        assert "keep_checkpoints" not in message and then in message, message
        assert "free space on the disk of" in message, message


def test_a_warm_up_longer_than_the_run_is_said(caplog):
    """trainer.warmup_epochs=50 on a 1-epoch run was taken without a word: the lr never got
    past its warm-up. One warning; a warm-up within the run says nothing."""
    from components.optim import lr_schedule

    optimizer = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    for warmup, said in ((50.0, True), (1.0, False)):
        caplog.clear()
        tc = SimpleNamespace(max_epochs=1, warmup_epochs=warmup, lr_schedule="cosine")
        with caplog.at_level(logging.WARNING):
            lr_schedule(optimizer, tc, steps_per_epoch=10)
        assert ("longer than trainer.max_epochs=1" in caplog.text) is said, caplog.text


def test_checkpoint_with_pickled_code_is_refused(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"model": {}, "progress": {}, "x": Path("/")}, path)  # needs a class to load
    with pytest.raises(UserError, match="cannot be loaded"):
        ck.load_checkpoint(path)


def test_resume_choice(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    assert resume_choice(None) is None and resume_choice("null") is None
    assert resume_choice("auto") == "auto"
    assert resume_choice("~/x.pt") == Path("~/x.pt").expanduser()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # a restarted rank continues
    assert resume_choice(None) == "auto"
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")  # a requeued SLURM job continues
    assert resume_choice(None) == "auto"


@pytest.mark.usefixtures("one_rank_group")
def test_training_state_round_trip_through_a_checkpoint(tmp_path):
    """One object saves everything a resume needs and restores it, RNG included."""
    saved, model, _, _ = training_state(1)
    checkpoints = ck.Checkpointer(tmp_path, rank=0, keep=2)
    torch.manual_seed(123)
    checkpoints.save(saved, step=7, is_best=True)
    expected_draw = torch.rand(3)

    restored, other, progress, window = training_state(2)
    assert checkpoints.restore(restored, "auto") == tmp_path / "checkpoints" / "step-00000007.pt"
    for key, value in model.state_dict().items():
        assert torch.equal(other.state_dict()[key], value)
    assert restored.shared["optimizer"].state_dict()["state"]  # momentum buffers came back
    assert (progress.n, window.n) == (1, 10)
    assert torch.equal(torch.rand(3), expected_draw)  # this rank's RNG continues exactly
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == [
        "best.pt",
        "last.pt",
        "manifest.json",  # the commit: it names last.pt's and best.pt's step file and digest
        "step-00000007.pt",
        "step-00000007.pt.sha256",
    ]


class Box:
    """A component whose state is a dict (a run's progress, its monitor)."""

    def __init__(self, **state) -> None:
        self.state = dict(state)

    def state_dict(self) -> dict:
        return dict(self.state)

    def load_state_dict(self, state: dict) -> None:
        self.state = dict(state)


def run_state(step: int, epoch: int, best_epoch: int) -> ck.TrainingState:
    """A run's state at an epoch's end: `epoch` epochs done, its best at `best_epoch`."""
    progress = Box(step=step, epoch=epoch, step_in_epoch=0)
    monitor = Box(best=0.5, best_epoch=best_epoch)
    model = torch.nn.Linear(2, 1)
    return ck.TrainingState(
        shared={"model": model, "progress": progress, "monitor": monitor}, per_rank={}
    )


@pytest.mark.usefixtures("one_rank_group")
def test_another_runs_checkpoint_becomes_this_runs_first_commit(tmp_path, caplog):
    """resume=<another run's last.pt>: it and the step file of its best epoch become this
    dir's commit (best.pt there from the first step; one line names the run it continues);
    the other run is read, never written. A restart of this run (its own commits there) goes
    on from them, not back to the other run's. A copy without its run's manifest brings no
    best: the monitor's best restarts."""
    source, here = tmp_path / "source", tmp_path / "here"
    saving = ck.Checkpointer(source, rank=0)
    saving.save(run_state(10, 1, 1), step=10, is_best=True)
    saving.save(run_state(20, 2, 1), step=20, is_best=False)
    before = {p.name: p.read_bytes() for p in (source / "checkpoints").iterdir()}
    checkpoints = ck.Checkpointer(here, rank=0)
    with caplog.at_level(logging.INFO):
        used = checkpoints.restore(run_state(0, 0, 0), str(source / "checkpoints" / "last.pt"))
    assert used == source / "checkpoints" / "last.pt"
    assert checkpoints.continued == ck.Continued(source, True)
    assert f"continues run {source} from its step 20 (epoch 2)" in caplog.text
    folder = here / "checkpoints"
    manifest = ck.read_manifest(folder)
    assert (manifest.last, manifest.best) == ("step-00000020.pt", "step-00000010.pt")
    for name, step in ((ck.LAST, 20), (ck.BEST, 10)):
        assert ck.verify(folder / name) is None
        assert ck.load_checkpoint(folder / name)["progress"]["step"] == step
    assert {p.name: p.read_bytes() for p in (source / "checkpoints").iterdir()} == before

    checkpoints.save(run_state(30, 3, 1), step=30, is_best=False)  # this run trains on
    restarted = ck.Checkpointer(here, rank=0)
    used = restarted.restore(run_state(0, 0, 0), str(source / "checkpoints" / "last.pt"))
    assert used == folder / "step-00000030.pt" and restarted.continued is None

    copy = tmp_path / "elsewhere" / "copied.pt"
    copy.parent.mkdir()
    for suffix in ("", ".sha256"):
        name = f"step-00000020.pt{suffix}"
        (copy.parent / f"copied.pt{suffix}").write_bytes(
            (source / "checkpoints" / name).read_bytes()
        )
    third = ck.Checkpointer(tmp_path / "third", rank=0)
    third.restore(run_state(0, 0, 0), str(copy))
    assert third.continued == ck.Continued(copy.parent, False)  # its best is not there
    assert ck.read_manifest(tmp_path / "third" / "checkpoints").best is None


@pytest.mark.usefixtures("one_rank_group")
def test_saves_keep_the_newest_two_plus_the_best(tmp_path):
    state, *_ = training_state(1)
    checkpoints = ck.Checkpointer(tmp_path, rank=0, keep=2)
    for step, best in ((1, True), (2, False), (3, False), (4, False)):
        checkpoints.save(state, step=step, is_best=best)
    steps = [p.name for p in ck.step_files(tmp_path / "checkpoints")]
    assert steps == ["step-00000004.pt", "step-00000003.pt", "step-00000001.pt"]
    folder = tmp_path / "checkpoints"
    assert os.path.samefile(folder / "best.pt", folder / steps[2])
    assert os.path.samefile(folder / "last.pt", folder / steps[0])


@pytest.mark.usefixtures("one_rank_group")
@pytest.mark.parametrize("where", ["model", "optimizer"])
def test_a_checkpoint_with_non_finite_values_is_refused_before_anything_is_written(tmp_path, where):
    """Weights (or optimizer moments) that turned NaN or infinite since the last save: the save
    is one UserError naming what and where, nothing of it is written, and last.pt still holds
    the earlier, finite checkpoint (what resume=auto continues from)."""
    state, model, *_ = training_state(1)
    checkpoints = ck.Checkpointer(tmp_path, rank=0)
    checkpoints.save(state, step=1, is_best=True)
    folder = tmp_path / "checkpoints"
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    with torch.no_grad():
        if where == "model":
            model.weight[0, 1] = float("nan")
        else:
            next(iter(state.shared["optimizer"].state.values()))["momentum_buffer"][0] = float(
                "inf"
            )
    with pytest.raises(UserError) as e:
        checkpoints.save(state, step=2, is_best=False)
    assert str(e.value).startswith(f"non-finite values in the {where} at step 2 (epoch ")
    assert "trainer.grad_clip" in str(e.value)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before  # nothing written
    last = ck.load_checkpoint(folder / "last.pt")
    assert all(torch.isfinite(t).all() for t in last["model"].values())


@pytest.mark.usefixtures("one_rank_group")
def test_restore_into_a_different_model_is_one_user_error(tmp_path):
    state, *_ = training_state(1)
    checkpoints = ck.Checkpointer(tmp_path, rank=0)
    checkpoints.save(state, step=1, is_best=False)
    wrong = ck.TrainingState(shared={"model": torch.nn.Linear(4, 2)}, per_rank={})
    with pytest.raises(UserError, match="does not fit this model.*resume=null"):
        checkpoints.restore(wrong, "auto")


@pytest.mark.usefixtures("one_rank_group")
def test_per_rank_state_is_not_restored_across_world_sizes(tmp_path, caplog):
    state, *_ = training_state(1)
    ck.Checkpointer(tmp_path, rank=0).save(state, step=1, is_best=False)
    other, _, progress, window = training_state(2)
    with caplog.at_level(logging.WARNING):
        # as a rank of a 2-rank run would restore it
        last = ck.load_checkpoint(tmp_path / "checkpoints" / "last.pt")
        other.load_state_dict(last, rank=0, world_size=2)
    assert progress.n == 1 and window.n == 20  # shared restored, per-rank kept
    assert "world size 1: per-rank state not restored" in caplog.text


# ------------------------------------------------------------------------------ metrics log


def test_rows_to_replay_from_where_wandb_history_ends():
    rows = [{"step": s} for s in (10, 20, 20, 30)]
    assert rows_to_replay(rows, 20) == rows[1:]
    assert rows_to_replay(rows, 0) == rows
    assert rows_to_replay(rows, 31) == []


def test_ending_maps_each_way_a_run_ends():
    assert ending(None) == ("completed", None)
    assert ending(Preempted("preempted at step 3"))[0] == "preempted"
    assert ending(KeyboardInterrupt())[0] == "interrupted"
    assert ending(UserError("bad input: fix x")) == ("failed", "bad input: fix x")
    assert ending(RuntimeError("boom\nmore")) == ("failed", "RuntimeError: boom")


WANDB_OFF = SimpleNamespace(wandb=SimpleNamespace(mode="disabled"))


def test_resumed_log_keeps_every_step_once_and_drops_a_torn_line(tmp_path):
    first = [{"step": 10, "epoch": 1, "train/loss": 1.0}, {"step": 20, "epoch": 1, "val/acc": 0.5}]
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in first) + '{"step": 30, "tr'  # killed mid-line
    )
    with RunLogger(tmp_path, enabled=True) as run:
        run.open(WANDB_OFF, {}, resuming=True, wandb_run_id=None)
        run.log({"step": 10, "epoch": 1, "train/loss": 1.0})  # recomputed: not logged again
        run.log({"step": 20, "epoch": 1, "train/loss": 0.9})  # a train row at a val row's step
        run.log({"step": 20, "epoch": 1, "val/acc": 0.5})
        run.log({"step": 30, "epoch": 2, "train/loss": 0.8})
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], "val/acc" in r) for r in lines] == [
        (10, False),
        (20, True),
        (20, False),
        (30, False),
    ]
    assert read_result(tmp_path).status == "completed"


def test_run_logger_records_the_end_of_a_failed_run_and_reraises(tmp_path):
    with pytest.raises(UserError), RunLogger(tmp_path, enabled=True) as run:
        run.result.app["final_val_acc"] = 0.25
        raise UserError("trainer.max_epochs=0: use a positive number")
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["status"] == "failed" and result["error"].startswith("trainer.max_epochs=0")
    assert result["app"]["final_val_acc"] == 0.25 and result["wall_time_s"] >= 0
    with pytest.raises(UserError), RunLogger(tmp_path / "other", enabled=False):
        raise UserError("x")
    assert not (tmp_path / "other").exists()  # ranks other than 0 write nothing


@pytest.mark.usefixtures("one_rank_group")
def test_loss_window_mean_and_exact_state():
    window = LossWindow(torch.device("cpu"))
    for value, correct in ((1.0, 3), (2.0, 1), (4.5, 4)):  # of 4 samples each
        window.add(torch.tensor(value), torch.tensor(float(correct)), 4)
    saved = window.state_dict()
    other = LossWindow(torch.device("cpu"))
    other.load_state_dict(saved)
    assert other.mean_over_ranks() == (pytest.approx(2.5), pytest.approx(8 / 12))
    assert other.count == 0 and float(other.sum) == 0.0  # a new window starts
    other.add(torch.tensor(3.0))  # soft (mixed) labels: no accuracy
    assert other.mean_over_ranks() == (pytest.approx(3.0), None)


def test_run_result_keeps_unknown_keys():
    # a flat record (5f215d2's layout): its keys of the experiment's are kept, in its app part
    result = RunResult.from_json({"status": "completed", "best_val_acc": 0.5, "test/acc": 0.4})
    assert result.app["best_val_acc"] == 0.5 and result.to_json()["app"]["test/acc"] == 0.4
    # a newer writer's key beside the launcher's part is kept where it was
    newer = RunResult.from_json({**RunResult().to_json(), "test/acc": 0.4})
    assert newer.to_json()["test/acc"] == 0.4


# ------------------------------------------------------------------------------ world size


@pytest.mark.parametrize("value, expected", [("auto", None), ("1", 1), (8, 8), (" 2 ", 2)])
def test_parse_count_accepts_auto_and_positive_integers(value, expected):
    assert world.parse_count(value, "dist.nnodes") == expected


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5", ""])
def test_parse_count_names_the_key_and_the_fix(value):
    with pytest.raises(UserError, match=r"dist.nnodes=.* use dist.nnodes=auto or a positive"):
        world.parse_count(value, "dist.nnodes")


@pytest.mark.parametrize(
    "nproc, backend, gpus, expected",
    [
        ("auto", "auto", 0, (1, 1)),
        ("auto", "auto", 8, (8, 1)),
        ("auto", "gloo", 8, (1, 1)),
        ("2", "auto", 0, (2, 1)),
        ("4", "nccl", 8, (4, 1)),
    ],
)
def test_requested_world(nproc, backend, gpus, expected):
    cfg = SimpleNamespace(nproc_per_node=nproc, nnodes="auto", backend=backend)
    assert world.requested_world(cfg, gpus) == expected


def test_per_rank_batch_and_its_error():
    assert checks.per_rank_batch(64, 2) == 32 and checks.per_rank_batch(64, 2, 4) == 8
    with pytest.raises(UserError, match="trainer.batch_size=63 .* world size 2.*batch_size=64"):
        checks.per_rank_batch(63, 2)
    with pytest.raises(UserError, match="accumulate_grad_batches=0"):
        checks.per_rank_batch(64, 1, 0)


def test_started_as_rank():
    assert world.started_as_rank({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"})
    assert not world.started_as_rank({"RANK": "0"})


@pytest.mark.usefixtures("one_rank_group")
@pytest.mark.parametrize("public", [True, False])
def test_the_step_timeout_is_set_with_the_torch_at_hand(monkeypatch, public):
    """After the first step every rank lowers its collective timeout to dist.step_timeout_s:
    through torch.distributed.set_timeout (torch >= 2.14), or its private name before it
    (e.g. the torch 2.11 a GPU machine ships), never an AttributeError after step 1."""
    from datetime import timedelta

    from components.distributed import DistEnv, tighten_timeout

    asked = []
    real = dist.set_timeout if public else dist.distributed_c10d._set_pg_timeout

    def spy(timeout, group=None):
        asked.append(timeout)
        with warnings.catch_warnings():  # torch 2.14 deprecates the private name
            warnings.simplefilter("ignore", FutureWarning)
            real(timeout, group)

    if public:
        monkeypatch.setattr(dist, "set_timeout", spy)
    else:
        monkeypatch.delattr(dist, "set_timeout")
        monkeypatch.setattr(dist.distributed_c10d, "_set_pg_timeout", spy)
    env = DistEnv(0, 0, 2, 2, 1, "gloo", torch.device("cpu"), step_timeout_s=5)
    tighten_timeout(env)
    assert asked == [timedelta(seconds=5)]


# ------------------------------------------------------------------------------ errors


def test_user_errors_are_found_through_hydras_wrapping():
    with pytest.raises(Exception) as caught:
        instantiate(
            {"_target_": "models.torchvision.build_torchvision_model", "name": "nope"},
            num_classes=2,
            in_channels=3,
            image_size=32,
        )
    assert type(caught.value) is UserError  # re-raised as itself, not Hydra's wrapper
    wrapped = RuntimeError("outer")
    wrapped.__cause__ = UserError("inner: fix it")
    assert str(find_user_error(wrapped)) == "inner: fix it"
    assert describe(wrapped) == "inner: fix it" and describe(ValueError("v")) == "ValueError: v"


def test_report_user_error_only_in_a_plain_run(caplog):
    from hydra.core.utils import JobReturn, JobStatus
    from hydra.types import RunMode

    def job(status, value):
        ret = JobReturn()
        ret.status, ret._return_value = status, value
        return ret

    run_mode = SimpleNamespace(hydra=SimpleNamespace(mode=RunMode.RUN))
    sweep_mode = SimpleNamespace(hydra=SimpleNamespace(mode=RunMode.MULTIRUN))
    callback = ReportUserError()
    callback.on_job_end(run_mode, job(JobStatus.COMPLETED, 1.0))
    callback.on_job_end(run_mode, job(JobStatus.FAILED, RuntimeError("not the user's")))
    callback.on_job_end(sweep_mode, job(JobStatus.FAILED, UserError("the launcher's to say")))
    with caplog.at_level(logging.ERROR), pytest.raises(SystemExit) as exit_:
        callback.on_job_end(run_mode, job(JobStatus.FAILED, UserError("bad: fix it")))
    assert exit_.value.code == 2 and caplog.messages == ["bad: fix it"]


def test_a_rank_that_lost_its_peer_under_plain_torchrun_says_one_line(caplog, monkeypatch):
    """Under plain torchrun, rank 0 failing on a full disk at a save left rank 1 to print
    Hydra's 25-line traceback of its monitored_barrier ("Connection closed by peer"): it says
    one line and exits 1; rank 0 (whose own error it would be) is left to Hydra."""
    from hydra.core.utils import JobReturn, JobStatus
    from hydra.types import RunMode

    ret = JobReturn()
    ret.status = JobStatus.FAILED
    ret._return_value = RuntimeError("monitoredBarrier: Connection closed by peer [127.0.0.1]")
    run_mode = SimpleNamespace(hydra=SimpleNamespace(mode=RunMode.RUN))
    monkeypatch.setenv("RANK", "0")
    ReportUserError().on_job_end(run_mode, ret)
    monkeypatch.setenv("RANK", "1")
    with caplog.at_level(logging.ERROR), pytest.raises(SystemExit) as exit_:
        ReportUserError().on_job_end(run_mode, ret)
    assert exit_.value.code == 1
    assert caplog.messages == ["stopped: another rank failed first (its error says why)"]


def test_a_stall_fault_waits_at_its_step_until_a_signal_has_arrived(monkeypatch):
    """HYDRA_DDP_FAULT=stall@3: steps before it pass; step 3 waits until a signal reaches the
    process (its handler runs as usual), not for STALL_MAX_S; a signal that came after the
    first step but before the stall step ends the wait at once."""
    monkeypatch.setattr(faults, "FAULTS", [("stall", 3, None, None)])
    monkeypatch.setattr(faults, "STALL_MAX_S", 60.0)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.delenv(ATTEMPT_ENV, raising=False)
    received, stalled = [], threading.Event()

    def signal_until_returned() -> None:  # again and again: the first may come before the wait
        while not stalled.wait(0.2):
            os.kill(os.getpid(), signal.SIGUSR1)

    previous = signal.signal(signal.SIGUSR1, lambda signum, _frame: received.append(signum))
    sender = threading.Thread(target=signal_until_returned)
    loss = torch.tensor(1.0)
    try:
        assert faults.inject(2, 0, loss) is loss and not received
        started = time.monotonic()
        sender.start()
        assert faults.inject(3, 0, loss) is loss
        waited = time.monotonic() - started
        stalled.set()
        sender.join()
        during = list(received)  # the wait ended with a signal, not at once
        # the stop came before the stall step: no wait
        received.clear()
        assert faults.inject(2, 0, loss) is loss
        os.kill(os.getpid(), signal.SIGUSR1)
        early = time.monotonic()
        assert faults.inject(3, 0, loss) is loss
        waited_early = time.monotonic() - early
    finally:
        stalled.set()
        if sender.is_alive():
            sender.join()
        signal.signal(signal.SIGUSR1, previous)
    assert during and waited < faults.STALL_MAX_S
    assert received and waited_early < faults.STALL_MAX_S


# ------------------------------------------------------------------------------ GPU paths, faked
# What needs a GPU is faked (the device count, its name); everything else is the real code.


@pytest.fixture
def rank_env(monkeypatch):
    """This process as rank `local_rank` of a 2-rank node, as torchrun would start it."""

    def as_rank(local_rank: int) -> None:
        for key, value in {
            "RANK": str(local_rank),
            "LOCAL_RANK": str(local_rank),
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2",
        }.items():
            monkeypatch.setenv(key, value)

    return as_rank


def dist_cfg(**keys):
    from tests.helpers import composed_train_config

    cfg = composed_train_config().dist
    for key, value in keys.items():
        cfg[key] = value
    return cfg


def test_local_rank_beyond_the_visible_gpus_is_one_line_naming_cuda_visible_devices(
    monkeypatch, rank_env
):
    """One GPU per SLURM task (or torchrun starting more ranks than GPUs): LOCAL_RANK=1 sees
    one GPU. A user error before any CUDA call, not CUDA's "invalid device ordinal"."""
    from components.distributed import init_distributed

    rank_env(1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    monkeypatch.setattr(distributed, "visible_gpus", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: pytest.fail(f"set_device({i})"))
    with pytest.raises(UserError) as caught, init_distributed(dist_cfg(backend="nccl"), "auto"):
        pass
    message = str(caught.value)
    assert "\n" not in message and "LOCAL_RANK=1 of 2 ranks" in message, message
    assert "CUDA_VISIBLE_DEVICES='3'" in message and "at most 1 ranks per node" in message
    rank_env(0)  # its GPU is there, but rank 1's is not: it stops too, with the same line
    with (
        pytest.raises(UserError, match="LOCAL_RANK=0 of 2 ranks.*CUDA_VISIBLE_DEVICES='3'"),
        init_distributed(dist_cfg(backend="nccl"), "auto"),
    ):
        pass


def test_virtual_local_rank_gives_each_rank_its_one_gpu(monkeypatch, rank_env):
    """`torchrun --virtual-local-rank` (torch >= 2.14): every rank has LOCAL_RANK=0 and sees its
    one GPU as GPU 0. Its rank takes that GPU, whether the flag reached it as PET_* or only on
    its agent's command line; without the flag the same view is refused in one line that names
    the flag among the fixes, and a virtual rank that sees no GPU is told to make its own
    visible."""
    import subprocess

    rank_env(1)
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")
    monkeypatch.setattr(distributed, "visible_gpus", lambda: 1)
    monkeypatch.setenv("PET_VIRTUAL_LOCAL_RANK", "1")
    distributed.check_device_ordinal(0)
    monkeypatch.delenv("PET_VIRTUAL_LOCAL_RANK")
    agent = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)", "--virtual-local-rank"]
    )
    try:
        # (a rank starts long after its agent; a process just started shows an empty command
        # line until its exec is through: wait for it, as a rank would find it)
        cmdline = Path(f"/proc/{agent.pid}/cmdline")
        deadline = time.monotonic() + 30
        while not cmdline.read_bytes() and time.monotonic() < deadline:
            time.sleep(0.01)
        monkeypatch.setattr(distributed.os, "getppid", lambda: agent.pid)
        distributed.check_device_ordinal(0)
        monkeypatch.setattr(distributed, "visible_gpus", lambda: 0)
        with pytest.raises(UserError, match="sees 0 GPU.*make its GPU visible to this rank"):
            distributed.check_device_ordinal(0)
    finally:
        agent.kill()
        agent.wait()
    monkeypatch.setattr(distributed.os, "getppid", lambda: os.getpid())  # no flag
    monkeypatch.setattr(distributed, "visible_gpus", lambda: 1)
    with pytest.raises(UserError) as caught:
        distributed.check_device_ordinal(0)
    message = str(caught.value)
    assert "\n" not in message and "of 2 ranks" in message and "--virtual-local-rank" in message


@pytest.fixture
def fake_nccl(monkeypatch):
    """A machine with one GPU, faked: the process group calls torch.distributed would make
    are recorded ({name: (args, kwargs)}), none is made."""
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)  # a single process, not a rank torchrun started
    monkeypatch.setattr(distributed, "visible_gpus", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    calls: dict = {}

    def recorder(name, result=None):
        def call(*args, **kwargs):
            calls[name] = (args, kwargs)
            return result

        return call

    monkeypatch.setattr(dist, "init_process_group", recorder("init_process_group"))
    monkeypatch.setattr(dist, "new_group", recorder("new_group", "a gloo group"))
    monkeypatch.setattr(dist, "barrier", recorder("barrier"))
    return calls


def test_the_one_rank_group_binds_its_gpu_as_the_ranks_groups_do(fake_nccl):
    """`python train.py` on one GPU (the in-process group): init_process_group gets the rank's
    device as device_id, as under torchrun."""
    from components.distributed import init_distributed

    with init_distributed(dist_cfg(backend="auto"), "auto") as env:
        assert env.backend == "nccl" and env.device == torch.device("cuda", 0)
    args, kwargs = fake_nccl["init_process_group"]
    assert args == ("nccl",) and kwargs["world_size"] == 1
    assert kwargs["device_id"] == torch.device("cuda", 0)


def test_nccl_ranks_wait_for_the_data_on_a_gloo_group(fake_nccl):
    """Under NCCL the ranks wait for local rank 0's data on a gloo group made with the run's
    timeout (gloo raises at it; NCCL's watchdog would abort the process without a word)."""
    from components.distributed import data_barrier, init_distributed

    with init_distributed(dist_cfg(backend="nccl", timeout_s=42), "cuda") as env:
        data_barrier(env)()
    assert fake_nccl["new_group"] == ((), {"backend": "gloo", "timeout": timedelta(seconds=42)})
    assert fake_nccl["barrier"] == ((), {"group": "a gloo group"})


def test_device_cuda_with_gloo_is_a_user_error_even_where_gpus_are_visible(monkeypatch):
    from components.distributed import init_distributed

    monkeypatch.setattr(distributed, "visible_gpus", lambda: 2)
    gloo = dist_cfg(backend="gloo")
    with (
        pytest.raises(UserError, match="trainer.device=cuda with dist.backend=gloo.*device=cpu"),
        init_distributed(gloo, "cuda"),
    ):
        pass


def test_sync_batchnorm_on_gloo_is_a_user_error_before_the_process_group():
    from components.distributed import init_distributed

    cfg = dist_cfg(backend="gloo", sync_batchnorm=True)
    with (
        pytest.raises(UserError, match="dist.sync_batchnorm=true needs CUDA.*=false"),
        init_distributed(cfg, "cpu"),
    ):
        pass
    assert not dist.is_initialized()


def test_sync_batchnorm_converts_before_the_optimizer_takes_the_parameters():
    """train.py converts right after building the model: the optimizer (and EMA, compile) get
    the SyncBatchNorm model's own Parameter objects."""
    from components.distributed import DistEnv, sync_batchnorm
    from components.optim import build_optimizer
    from models import build_model
    from tests.helpers import composed_train_config

    cfg = composed_train_config("model.batch_norm=true", "dist.sync_batchnorm=true")
    splits = SimpleNamespace(num_classes=10, image_size=8, in_channels=1)
    env = DistEnv(0, 0, 2, 2, 1, "nccl", torch.device("cuda", 0))  # what a GPU rank has
    model = sync_batchnorm(build_model(cfg.model, splits), cfg.dist, env)
    syncs = [m for m in model.modules() if isinstance(m, torch.nn.SyncBatchNorm)]
    assert syncs and not any(type(m) is torch.nn.BatchNorm2d for m in model.modules())
    optimizer = build_optimizer(cfg.optim, model, global_batch=64)
    held = [p for group in optimizer.param_groups for p in group["params"]]
    assert sorted(map(id, held)) == sorted(id(p) for p in model.parameters())
    assert {id(m.weight) for m in syncs} <= set(map(id, held))
    # one rank: nothing to synchronise, the model is left as built
    single = DistEnv(0, 0, 1, 1, 1, "nccl", torch.device("cuda", 0))
    plain = build_model(cfg.model, splits)
    assert sync_batchnorm(plain, cfg.dist, single) is plain


def test_cuda_rng_states_of_more_gpus_than_visible_restore_what_fits_and_warn_once(
    monkeypatch, caplog
):
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, d="cuda": restored.append((d, s)))
    saved = [torch.full((8,), i, dtype=torch.uint8) for i in range(4)]  # a 4-GPU process's
    state = {**ck.rng_state(), "cuda": saved}
    with caplog.at_level(logging.WARNING, logger=ck.__name__):
        ck.set_rng_state(state)
    assert [d for d, _ in restored] == [0, 1]
    assert all(torch.equal(s, saved[d]) for d, s in restored)
    warnings = [r.getMessage() for r in caplog.records if "CUDA RNG" in r.getMessage()]
    assert len(warnings) == 1 and "4 GPUs but 2 are visible" in warnings[0], warnings
    restored.clear()
    caplog.clear()
    ck.set_rng_state({**state, "cuda": saved[:2]})  # as many as visible: all, no warning
    assert [d for d, _ in restored] == [0, 1] and not caplog.records


# MFU: (device name, precision, conv share, cuDNN TF32, matmul TF32) -> the peak used.
PEAK_CASES = [
    ("NVIDIA H100 80GB HBM3", "bf16", 1.0, True, False, 989e12),
    ("NVIDIA H100 PCIe", "bf16", 1.0, True, False, 756e12),  # not the SXM part's
    ("NVIDIA H100 NVL", "bf16", 0.0, True, False, 835e12),
    ("NVIDIA H200", "bf16", 0.5, True, False, 989e12),
    ("NVIDIA L40", "bf16", 1.0, True, False, 181e12),  # not the L4's 121e12
    ("NVIDIA L4", "bf16", 1.0, True, False, 121e12),
    ("NVIDIA L40S", "bf16", 1.0, True, False, 362e12),
    # precision 32: a conv net runs TF32 (cuDNN's default), matmuls FP32 (cuBLAS's default)
    ("NVIDIA A100-SXM4-80GB", "32", 1.0, True, False, 156e12),
    ("NVIDIA A100-SXM4-80GB", "32", 1.0, False, False, 19.5e12),
    ("NVIDIA A100-SXM4-80GB", "32", 0.0, True, False, 19.5e12),
    ("NVIDIA A100-SXM4-80GB", "32", 0.0, True, True, 156e12),
    # half the FLOPs at each peak: the time-weighted peak 2 / (1/156 + 1/19.5) T
    ("NVIDIA A100-SXM4-80GB", "32", 0.5, True, False, 2 / (1 / 156e12 + 1 / 19.5e12)),
    ("Tesla V100-SXM2-16GB", "32", 1.0, True, False, None),  # no TF32 on a V100
    ("Tesla V100-SXM2-16GB", "32", 1.0, False, False, 15.7e12),
    ("NVIDIA L4X", "bf16", 1.0, True, False, None),  # not listed: no MFU rather than a guess
]


@pytest.mark.parametrize("name, precision, conv_share, cudnn_tf32, matmul_tf32, peak", PEAK_CASES)
def test_peak_flops_match_the_device_exactly_and_the_math_that_runs(
    monkeypatch, name, precision, conv_share, cudnn_tf32, matmul_tf32, peak
):
    from components.speed import peak_flops

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", cudnn_tf32)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", matmul_tf32)
    found = peak_flops(torch.device("cuda", 0), precision, conv_share)
    assert found == (None if peak is None else pytest.approx(peak, rel=1e-9))


def test_conv_share_of_the_flops_is_counted(monkeypatch):
    """A conv net's FLOPs are mostly convolutions: Speed takes the conv peak for them."""
    from components.speed import Speed, model_facts
    from models import build_model
    from tests.helpers import composed_train_config

    cfg = composed_train_config()
    model = build_model(cfg.model, SimpleNamespace(num_classes=10, image_size=8, in_channels=1))
    facts = model_facts(model, torch.zeros(2, 1, 8, 8))
    convs = 9 * 2 * (1 * 32 * 8 * 8 + 32 * 64 * 4 * 4)  # 3x3 convs at 8x8 and 4x4, 2 per MAC
    assert facts["conv_flops_per_sample"] == convs < facts["flops_per_sample"]
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    share = facts["conv_flops_per_sample"] / facts["flops_per_sample"]
    speed = Speed(
        torch.device("cuda", 0), "32", samples_per_step=64, flops_per_sample=1e9, conv_share=share
    )
    assert 19.5e12 < speed.peak_flops < 156e12


# torch >= 2.9's fp32_precision settings: (backend, op) -> precision, as torch._C sets them
FP32_KEYS = [("generic", "all"), ("cuda", "all"), ("cuda", "matmul"), ("cuda", "conv")]


@pytest.fixture
def fp32_precision_restored():
    """torch's TF32 settings (legacy and fp32_precision) as they were before the test."""
    get, put = torch._C._get_fp32_precision_getter, torch._C._set_fp32_precision_setter
    matmul, cudnn = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    rnn = get("cuda", "rnn")
    saved = {key: get(*key) for key in FP32_KEYS}
    yield put
    torch.set_float32_matmul_precision(matmul)
    torch.backends.cudnn.allow_tf32 = cudnn
    for key, value in [*saved.items(), (("cuda", "rnn"), rnn)]:
        put(*key, value)
    assert {key: get(*key) for key in FP32_KEYS} == saved
    assert torch.backends.cudnn.allow_tf32 == cudnn  # readable the legacy way again


# fp32_precision settings made in order (torch >= 2.9) -> the math precision 32 runs in
# (convolutions, matmuls): "none" takes its parent's (cuda "all", then "generic"), and
# reading the legacy flags after any of these raises RuntimeError
FP32_CASES = [
    ([("cuda", "matmul", "tf32")], ("tf32", "tf32")),  # convolutions: TF32 by default
    ([("cuda", "conv", "ieee")], ("32", "32")),
    # matmuls: IEEE as set_float32_matmul_precision("highest") left them, until "none"
    ([("generic", "all", "tf32"), ("cuda", "conv", "none")], ("tf32", "32")),
    (
        [("generic", "all", "tf32"), ("cuda", "conv", "none"), ("cuda", "matmul", "none")],
        ("tf32", "tf32"),
    ),
    ([("cuda", "all", "ieee"), ("cuda", "conv", "none"), ("cuda", "matmul", "none")], ("32", "32")),
    ([("generic", "all", "tf32"), ("cuda", "all", "ieee"), ("cuda", "conv", "none")], ("32", "32")),
    ([("cuda", "matmul", "tf32"), ("cuda", "conv", "ieee")], ("32", "tf32")),
]


@pytest.mark.parametrize("settings, maths", FP32_CASES)
def test_mfu_follows_torchs_fp32_precision_settings(
    monkeypatch, fp32_precision_restored, settings, maths
):
    """With the fp32_precision API set (after the legacy one, too), MFU at precision 32 takes
    the math torch runs: TF32 or FP32 per convolutions and matmuls."""
    from components.speed import PEAK_FLOPS, Speed, math_precisions

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    torch.set_float32_matmul_precision("highest")  # the legacy API first, as a user might
    for backend, op, precision in settings:
        fp32_precision_restored(backend, op, precision)
    assert math_precisions("32") == maths
    assert math_precisions("bf16") == ("bf16", "bf16")
    peaks = [PEAK_FLOPS["A100"][math] for math in maths]
    speed = Speed(torch.device("cuda", 0), "32", 64, flops_per_sample=3e9, conv_share=0.25)
    assert speed.peak_flops == pytest.approx(1 / (0.25 / peaks[0] + 0.75 / peaks[1]), rel=1e-9)
    assert speed.mfu(1000.0, 2) == pytest.approx(3e9 * 1000 / (speed.peak_flops * 2), rel=1e-9)


@pytest.mark.parametrize(
    "capability, precision, tf32, maths",
    [
        ((8, 0), "32", True, ("tf32", "tf32")),  # A100: matmuls in TF32 too (torch: FP32)
        ((9, 0), "32", True, ("tf32", "tf32")),  # H100
        ((7, 0), "32", True, ("32", "32")),  # V100: no TF32, both FP32
        ((8, 0), "32", False, ("32", "32")),  # asked for full FP32
        ((8, 0), "32", None, ("tf32", "32")),  # torch's settings as they were: its defaults
        ((8, 0), "bf16", True, ("bf16", "bf16")),  # autocast: TF32 does not apply
    ],
)
def test_precision_32_runs_tf32_where_the_gpu_has_it_and_the_facts_say_so(
    monkeypatch, fp32_precision_restored, capability, precision, tf32, maths
):
    """trainer.tf32 (default true) on a GPU (its capability faked): TF32 for matmuls and
    convolutions where the GPU has it; the run's facts name the math, and MFU's peak follows."""
    from components.metrics import run_facts
    from components.speed import PEAK_FLOPS, Speed, set_fp32_math

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    cuda = torch.device("cuda", 0)
    math = set_fp32_math(precision, cuda, tf32)
    assert (math["conv_math"], math["matmul_math"]) == maths
    facts = run_facts(2, 32, torch.device("cpu"), precision, math)  # (the device: only its name)
    assert (facts["conv_math"], facts["matmul_math"]) == maths
    speed = Speed(cuda, precision, 64, flops_per_sample=3e9, conv_share=0.0)
    assert speed.peak_flops == PEAK_FLOPS["A100"][maths[1]]  # a matmul model: matmul's peak
    cpu = set_fp32_math("32", torch.device("cpu"), True)  # no TF32 on a CPU: nothing set
    assert cpu == {"conv_math": "32", "matmul_math": "32"}


def test_peak_memory_on_a_gpu_starts_anew_with_each_phase(monkeypatch):
    """On a GPU (torch.cuda's allocator mocked): each phase resets the allocator's peak
    (reset_peak_memory_stats), a train row reads its phase's, the run's peak is the largest."""
    from components.speed import PeakMemory

    allocator = {"peak": 0.0}
    resets = []
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d=None: allocator.get("peak", 0))
    monkeypatch.setattr(
        torch.cuda, "reset_peak_memory_stats", lambda d=None: (resets.append(d), allocator.clear())
    )
    memory = PeakMemory(torch.device("cuda", 1))
    seen = {}
    for phase, peak_mib in (("train", 900), ("val", 2500), ("train", 1000), ("test", 700)):
        memory.start(phase)
        allocator["peak"] = peak_mib * 2**20
        seen[phase] = memory.current()
    assert resets == [torch.device("cuda", 1)] * 4
    assert seen == {"train": 1000, "val": 2500, "test": 700}  # each phase's own
    assert memory.run_peak() == 2500


def test_mfu_is_left_out_when_torch_cannot_say_its_math(monkeypatch, caplog):
    """Settings torch cannot report: no MFU, one warning, and the run goes on."""
    from components.speed import Speed, peak_flops

    class Unreadable:
        def __getattr__(self, name):
            raise RuntimeError("mix of the legacy and new APIs")

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch.backends.cudnn, "conv", Unreadable())
    with caplog.at_level(logging.WARNING, logger="components.speed"):
        speed = Speed(torch.device("cuda", 0), "32", 64, flops_per_sample=3e9, conv_share=0.5)
    assert speed.peak_flops is None and speed.mfu(1000.0, 1) is None
    assert [r.getMessage() for r in caplog.records] == [
        "MFU left out: torch's TF32 settings could not be read (mix of the legacy and new APIs)"
    ]
    assert peak_flops(torch.device("cuda", 0), "bf16", 0.5) == 312e12  # autocast: no TF32 read


@pytest.mark.parametrize(
    "precision, device, native, warned",
    [
        ("bf16", "cuda", False, True),  # a V100 or T4
        ("bf16", "cuda", True, False),  # Ampere on
        ("fp16", "cuda", False, False),
        ("32", "cuda", False, False),
        ("bf16", "cpu", False, False),  # a CPU's bf16: trainer.precision=auto's business
    ],
)
def test_bf16_on_a_gpu_without_native_bf16_is_said(
    monkeypatch, caplog, precision, device, native, warned
):
    """trainer.precision=bf16 on a GPU that only emulates bf16 (faked): one warning line naming
    the GPU and the fix; nothing where bf16 is native or not asked for."""
    from components.precision import warn_if_bf16_emulated

    asked = []

    def is_bf16_supported(including_emulation: bool = True) -> bool:
        asked.append(including_emulation)
        return native or including_emulation  # torch emulates bf16 on every CUDA GPU

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", is_bf16_supported)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100-SXM2-16GB")
    with caplog.at_level(logging.WARNING, logger="components.precision"):
        assert warn_if_bf16_emulated(precision, torch.device(device, 0)) is warned
    assert asked == ([False] if precision == "bf16" and device == "cuda" else [])
    expected = (
        "trainer.precision=bf16 on Tesla V100-SXM2-16GB, which has no native bf16: torch "
        "emulates it (no tensor cores); use trainer.precision=fp16 (or 32) on this GPU"
    )
    assert [r.getMessage() for r in caplog.records] == ([expected] if warned else [])


# --- W&B's system charts: this process's GPUs ------------------------------------------------


class FakeNVML:
    """nvidia-ml-py's pynvml on a node of two GPUs, the second split into two MIG instances."""

    class NVMLError(Exception):
        pass

    GPUS = {0: ("GPU-1f2e3d4c-0000", []), 1: ("GPU-9a8b7c6d-1111", ["MIG-5e6f", "MIG-7a8b"])}

    def __init__(self):
        self.open = 0

    def nvmlInit(self):
        self.open += 1

    def nvmlShutdown(self):
        self.open -= 1

    def nvmlDeviceGetCount(self):
        return len(self.GPUS)

    def nvmlDeviceGetHandleByIndex(self, index):
        return ("gpu", index)

    def nvmlDeviceGetUUID(self, handle):
        kind, index, *slot = handle
        uuid, migs = self.GPUS[index]
        return (uuid if kind == "gpu" else migs[slot[0]]).encode()  # older pynvml: bytes

    def nvmlDeviceGetMaxMigDeviceCount(self, handle):
        if not self.GPUS[handle[1]][1]:
            raise self.NVMLError("Not Supported")
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle, slot):
        if slot >= len(self.GPUS[handle[1]][1]):
            raise self.NVMLError("Not Found")
        return ("mig", handle[1], slot)


@pytest.mark.parametrize(
    "visible, ids",
    [
        (None, None),  # every GPU
        ("", None),  # none: W&B takes an empty list for every GPU too
        ("2,5", [2, 5]),
        ("3,-1,4", [3]),  # CUDA stops at the first invalid entry
        ("GPU-9a8b,GPU-1f2e3d4c-0000", [1, 0]),  # UUIDs and prefixes of them, as CUDA takes
        ("MIG-7a8b,MIG-5e6f", [1]),  # two MIG instances of GPU 1
        ("GPU-", None),  # ambiguous: not CUDA's either
        ("GPU-ffff", None),  # not on this node
    ],
)
def test_wandb_charts_the_gpus_cuda_visible_devices_gives(monkeypatch, visible, ids):
    """x_stats_gpu_device_ids (NVML indices) of every run's settings follow CUDA_VISIBLE_DEVICES;
    UUIDs and MIG instances through NVML (faked), which is left closed."""
    import wandb
    from ddp_launcher.core.wandb_service import run_settings

    nvml = FakeNVML()
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert run_settings(wandb, "online", 60).x_stats_gpu_device_ids == ids
    assert nvml.open == 0


def test_wandb_charts_every_gpu_where_uuids_cannot_be_mapped(monkeypatch):
    """Without nvidia-ml-py a UUID has no NVML index to give: every GPU, as before."""
    from ddp_launcher.core.wandb_service import gpu_device_ids

    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-9a8b7c6d-1111")
    assert gpu_device_ids() is None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    assert gpu_device_ids() == [1, 0]


def test_an_offline_run_on_a_jobs_gpus_records_as_ever(tmp_path, monkeypatch):
    """train.py with W&B offline and CUDA_VISIBLE_DEVICES=1,3 (a packed job's GPUs; trained
    on the CPU here): the run's settings carry the GPUs' ids, and W&B records the run."""
    from components import metrics
    from tests.helpers import offline_runs, train_in_process

    made = []

    def recorded(*args):
        made.append(settings := run_settings(*args))
        return settings

    run_settings = metrics.wandb_settings
    monkeypatch.setattr(metrics, "wandb_settings", recorded)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,3")
    overrides = ("trainer.max_epochs=1", "trainer.device=cpu", "dist.backend=gloo")
    train_in_process(tmp_path / "run", *overrides, "wandb.mode=offline")
    assert [s.x_stats_gpu_device_ids for s in made] == [[1, 3]]
    (run,) = offline_runs(tmp_path / "run")
    assert run.exit_code == 0 and run.history and "val/acc" in run.summary


def test_requirements_lists_every_distribution_as_importlib_metadata_reads_it() -> None:
    """repro's requirements.txt (read from the METADATA headers only) equals the listing from
    importlib.metadata's full parse: one `Name==Version` per distribution, sorted, first wins."""
    from importlib import metadata

    from ddp_launcher.core.repro import requirements

    expected: dict[str, str] = {}
    for distribution in metadata.distributions():
        name = distribution.metadata["Name"]
        if name and name.lower() not in expected:
            expected[name.lower()] = f"{name}=={distribution.version}"
    lines = requirements().splitlines()
    assert lines == [line for _, line in sorted(expected.items())]
    assert len(lines) > 10
