"""TrainingState owns the checkpoint format (load_state_dict(state_dict()) round-trips, on 1 and
2 ranks), says which component a resume lacks or no longer uses, and Checkpointer.restore
follows rank 0's choice on every rank (a rank without the file, or with a torn copy, gets rank
0's bytes). The 2-rank tests run in a real gloo group of two processes (tests/rank_pool.py)."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from components import checkpoint as ck
from components.ema import EMA
from components.monitor import Monitor
from tests.helpers import free_port, training_state


def round_trip(rank: int, world_size: int) -> dict:
    """state_dict(), scramble everything, load_state_dict(): what came back."""
    state, model, progress, window = training_state(1, rank)
    saved = state.state_dict()
    draw = torch.rand(3)  # what this rank's RNG gives next
    with torch.no_grad():
        model.weight.add_(1.0)
    state.shared["optimizer"].state.clear()
    progress.n, window.n = -1, -1
    torch.rand(100)
    state.load_state_dict(saved)
    again = state.state_dict()
    return {
        "world_size": saved["world_size"],
        "ranks": len(saved["ranks"]),
        "config": saved["config"],
        "weights": torch.equal(model.weight, saved["model"]["weight"]),
        "momentum": bool(state.shared["optimizer"].state_dict()["state"]),
        "progress": progress.n,
        "window": window.n,
        "rng": torch.equal(torch.rand(3), draw),
        "same_again": again["progress"] == saved["progress"]
        and all(torch.equal(again["model"][k], v) for k, v in saved["model"].items())
        and [ck.decode_rank_state(b)["window"] for b in again["ranks"]]
        == [ck.decode_rank_state(b)["window"] for b in saved["ranks"]],
    }


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.usefixtures("one_rank_group")
def test_state_dict_round_trips_on_one_rank():
    got = round_trip(0, 1)
    assert got == {
        "world_size": 1,
        "ranks": 1,
        "config": "seed: 1\n",
        "weights": True,
        "momentum": True,
        "progress": 1,
        "window": 10,
        "rng": True,
        "same_again": True,
    }


def _worker(rank: int, port: int, out: str, task: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        if task == "round_trip":
            result = round_trip(rank, 2)
        else:  # restore from `task`'s run dir per rank
            state, model, progress, window = training_state(2, rank)
            run_dir = Path(out, f"rank{rank}")
            used = ck.Checkpointer(run_dir, rank=rank).restore(state, "auto")
            result = {
                "used": used and used.name,
                "progress": progress.n,
                "weight": model.weight.flatten().tolist(),
                "window": window.n,
            }
        return result
    finally:
        dist.destroy_process_group()


def spawn(two_ranks, tmp_path: Path, task: str) -> list[dict]:
    """`task` on the two ranks of tests/rank_pool.py (a gloo group of two processes)."""
    return two_ranks.run(_worker, free_port(), str(tmp_path), task)


@pytest.mark.slow
def test_state_dict_round_trips_on_two_ranks(two_ranks, tmp_path):
    """Each rank gets its own window and RNG back; world size and config travel along."""
    got = spawn(two_ranks, tmp_path, "round_trip")
    for rank, result in enumerate(got):
        assert result == {
            "world_size": 2,
            "ranks": 2,
            "config": "seed: 1\n",
            "weights": True,
            "momentum": True,
            "progress": 1,
            "window": 10 + rank,
            "rng": True,
            "same_again": True,
        }, rank


def two_rank_checkpoint(tmp_path: Path) -> Path:
    """A 2-rank run's checkpoint at step 7 in rank 0's run dir (written as rank 0 writes it,
    with both ranks' own states)."""
    shared = training_state(1)[0].state_dict()
    ranks = [training_state(1, r)[0].state_dict()["ranks"][0] for r in (0, 1)]
    path = tmp_path / "rank0" / "checkpoints" / "step-00000007.pt"
    ck.atomic_save({**shared, "world_size": 2, "ranks": ranks}, path)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("copy", ["missing", "torn"])
def test_every_rank_resumes_from_rank0s_choice(two_ranks, tmp_path, copy):
    """Rank 1's run dir has no checkpoints, or a torn copy of rank 0's newest: both ranks
    resume from rank 0's step-7 file, rank 1 with its own per-rank state from it."""
    path = two_rank_checkpoint(tmp_path)
    mine = tmp_path / "rank1" / "checkpoints"
    mine.mkdir(parents=True)
    if copy == "torn":
        shutil.copy(ck.digest_path(path), mine)
        (mine / path.name).write_bytes(path.read_bytes()[:200])
    got = spawn(two_ranks, tmp_path, "restore")
    expected = training_state(1)[1].weight.flatten().tolist()
    assert [r["used"] for r in got] == [path.name] * 2
    assert [r["progress"] for r in got] == [1, 1]
    assert [r["weight"] for r in got] == [expected, expected]
    assert [r["window"] for r in got] == [10, 11]  # each rank its own


@pytest.mark.slow
def test_no_checkpoint_on_rank0_means_every_rank_starts_fresh(two_ranks, tmp_path):
    """Only rank 1 sees a checkpoint: rank 0 decides, so neither resumes (before, rank 1
    resumed alone and the first collective aborted)."""
    path = two_rank_checkpoint(tmp_path)
    shutil.move(path.parent, tmp_path / "rank1" / "checkpoints")
    got = spawn(two_ranks, tmp_path, "restore")
    assert [r["used"] for r in got] == [None, None]
    assert [r["progress"] for r in got] == [2, 2]


@pytest.mark.usefixtures("one_rank_group")
def test_a_component_on_one_side_only_is_one_line_naming_it(caplog):
    """A checkpoint without EMA, fp16 scale and monitor, resumed by a run that has them: one
    warning each, saying what happens (the EMA starts from the restored weights). The other
    way round: the checkpoint's EMA is named as unused."""
    torch.manual_seed(0)
    old_model = torch.nn.Linear(3, 2)
    old = ck.TrainingState(
        shared={"model": old_model, "scaler": torch.amp.GradScaler("cpu", enabled=False)},
        per_rank={},
    )
    ckpt = old.state_dict()
    model = torch.nn.Linear(3, 2)
    ema = EMA(model, 0.9)  # built from the fresh weights, before the resume
    state = ck.TrainingState(
        shared={
            "model": model,
            "scaler": torch.amp.GradScaler("cpu", enabled=True),
            "monitor": Monitor("val/acc", "max"),
            "ema": ema,
        },
        per_rank={},
        fresh={"ema": ("EMA starts from the restored weights", lambda: ema.restart_from(model))},
    )
    with caplog.at_level(logging.WARNING):
        state.load_state_dict(ckpt)
    lines = [r.getMessage() for r in caplog.records]
    assert "resume: the checkpoint has no ema: EMA starts from the restored weights" in lines
    assert any(x.startswith("resume: the checkpoint has no scaler: the fp16 loss") for x in lines)
    assert any(x.startswith("resume: the checkpoint has no monitor: ") for x in lines)
    assert len(lines) == 3, lines
    assert torch.equal(ema.module.weight, old_model.weight)  # the restored weights, not fresh

    caplog.clear()
    with caplog.at_level(logging.WARNING):
        old.load_state_dict(state.state_dict())
    lines = [r.getMessage() for r in caplog.records]
    assert "resume: the checkpoint has ema, which this run does not use" in lines
    assert "resume: the checkpoint has monitor, which this run does not use" in lines
    assert any("fp16 loss scale; this run has none" in x for x in lines)
    assert len(lines) == 3, lines
