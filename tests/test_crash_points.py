"""Every crash point tried (issue 55, case 7): a SIGKILL at each named point of the checkpoint
save protocol and at each write of metrics.jsonl, result.json and the launch records
(ddp_launcher/core/fault_points.py's POINTS), of a rank or of the launcher, with 1 and 2 ranks; then
a resume, which must end as the uninterrupted run did: identical weights, each metrics row once,
result.json's best = the epoch whose bytes best.pt holds, and test metrics from those bytes.

Each case is one job of a sweep whose jobs are the same run (`seed=0,0,...`), killed where
`HYDRA_DDP_KILL_AT=<point>#<n>@<job>` says. Rank kills fail their job alone: one sweep, then one
resume. A launcher kill ends the sweep at one job's point: the sweep is resumed until it
completes, each resume continuing the killed job and running on to the next job's point.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from ddp_launcher.core.fault_points import POINTS

from components.checkpoint import load_checkpoint
from tests.helpers import assert_same_training, output, read_json, run, train_cmd, val_rows

# digits, 22 steps an epoch: saves at steps 8, 16, 22 (epoch 1: the first best), 24, 32, 40,
# 44 (epoch 2: a later best, and the final save); one step file kept beside the best
RUN = [
    "trainer.max_epochs=2",
    "trainer.checkpoint_every_n_steps=8",
    "trainer.keep_checkpoints=1",
    "trainer.log_every_n_steps=4",
    "trainer.progress_bar=false",
    "wandb.mode=disabled",
]
SAVE_POINTS = [p for p in POINTS if p.startswith("save.") and p != "save.best_linked"]
# every save point at the first best epoch's save (#3) and at the final, later best one (#7);
# best.pt's link at both best saves; a metrics row mid-run; the final result.json
CASES = [
    *(f"{point}#{n}" for point in SAVE_POINTS for n in (3, 7)),
    "save.best_linked#1",
    "save.best_linked#2",
    "metrics.row#7",
    "result.written#1",
]
# the launcher's writes of a job's launch.json: its attempt started, its agent recorded, ended
LAUNCHER_CASES = [*CASES, "launch.record#1", "launch.record#2", "launch.record#3"]
assert {c.partition("#")[0] for c in LAUNCHER_CASES} == set(POINTS)  # every point is tried


def sweep_cmd(sweep_dir: Path, jobs: int, nproc: int, *extra: str) -> list[str]:
    seeds = ",".join(["0"] * jobs)
    return train_cmd(
        "-m", *RUN, f"seed={seeds}", f"dist.nproc_per_node={nproc}",
        f"hydra.sweep.dir={sweep_dir}", *extra,
    )  # fmt: skip


@pytest.fixture(scope="module", params=[1, 2], ids=["1 rank", "2 ranks"])
def reference(request, tmp_path_factory) -> tuple[int, Path]:
    """The run, uninterrupted (a sweep of one job), and its world size."""
    nproc = request.param
    sweep_dir = tmp_path_factory.mktemp(f"reference{nproc}") / "sweep"
    proc = run(sweep_cmd(sweep_dir, 1, nproc), timeout=600)
    assert proc.returncode == 0, output(proc)[-3000:]
    job = sweep_dir / "0"
    val = [row["val/acc"] for row in val_rows(job)]
    assert len(val) == 2 and val[1] > val[0], val  # both epochs a new best: two best saves
    return nproc, job


def assert_resumed_like(job: Path, reference: Path, case: str) -> None:
    result = read_json(job / "result.json")
    assert result["status"] == "completed", (case, result)
    try:
        assert_same_training(job, reference)  # weights, and every row once
    except AssertionError as e:
        raise AssertionError(f"{case}: {e}") from None
    best = load_checkpoint(job / "checkpoints" / "best.pt")
    saved = (best["progress"]["epoch"], best["monitor"]["best_epoch"], best["monitor"]["best"])
    assert (result["value_epoch"], result["value_epoch"], result["value"]) == saved, case
    assert result["app"]["test"] == read_json(reference / "result.json")["app"]["test"], case


@pytest.mark.slow
def test_a_rank_killed_at_every_crash_point_resumes_exactly(reference, tmp_path: Path) -> None:
    nproc, ref = reference
    sweep_dir = tmp_path / "sweep"
    kill_at = ",".join(f"{case}@{job}" for job, case in enumerate(CASES))
    killed = run(sweep_cmd(sweep_dir, len(CASES), nproc), timeout=900, HYDRA_DDP_KILL_AT=kill_at)
    assert killed.returncode != 0, output(killed)[-3000:]
    for job, case in enumerate(CASES):  # each job was killed at its point
        first = read_json(sweep_dir / str(job) / "launch.json")["attempts"][0]
        assert first["status"] == "failed" and "SIGKILL" in first["error"], (case, first)
    resumed = run(
        sweep_cmd(sweep_dir, len(CASES), nproc, "hydra.launcher.resume=true"),
        timeout=900,
        HYDRA_DDP_KILL_AT=kill_at,
    )
    assert resumed.returncode == 0, output(resumed)[-5000:]
    for job, case in enumerate(CASES):
        assert_resumed_like(sweep_dir / str(job), ref, case)


@pytest.mark.slow
def test_the_launcher_killed_at_every_crash_point_resumes_exactly(
    reference, tmp_path: Path
) -> None:
    nproc, ref = reference
    sweep_dir = tmp_path / "sweep"
    kill_at = ",".join(f"{case}:launcher@{job}" for job, case in enumerate(LAUNCHER_CASES))
    cmd = sweep_cmd(sweep_dir, len(LAUNCHER_CASES), nproc, "hydra.launcher.resume=true")
    env = {"HYDRA_DDP_KILL_AT": kill_at, "HYDRA_DDP_KILL_ONCE_DIR": str(tmp_path)}
    for case in LAUNCHER_CASES:  # each start of the sweep ends at the next job's point
        proc = run(cmd, timeout=900, **env)
        assert proc.returncode == -9, (case, output(proc)[-3000:])  # SIGKILLed there
    proc = run(cmd, timeout=900, **env)
    assert proc.returncode == 0, output(proc)[-5000:]
    for job, case in enumerate(LAUNCHER_CASES):
        assert_resumed_like(sweep_dir / str(job), ref, case)
