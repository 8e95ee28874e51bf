"""Fault tolerance with real processes: kill/resume bit-identity, elastic restarts, torn saves,
preemption, no hangs, non-finite losses.

Kill points are drawn at random per run; the seed is printed (and `FT_SEED=<seed>` replays it).

Tests about how the job is started and stopped (torchrun's agent, its restarts, a signal to it,
ranks without an agent) start their ranks with plain `torchrun train.py`. The others, about what
the ranks do (resume, world-size handover, non-finite losses), start 2 ranks with `python
train.py dist.nproc_per_node=2` (launch_cmd): the repo's launcher, whose ranks are forked from
one interpreter that imported torch, where torchrun's agent and each rank import it themselves.
"""

import json
import os
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from ddp_launcher import REQUEUE_EXIT_CODE

from components.checkpoint import load_checkpoint, step_files, verify
from tests.helpers import (
    IMPORT_PATH,
    OFFLINE,
    REPO,
    assert_same_training,
    offline_runs,
    output,
    run,
    run_env,
    train_cmd,
    wait_for_rows,
)

pytestmark = pytest.mark.slow

STEPS_PER_EPOCH = 11  # digits: 1437 training samples // global batch 128
EPOCHS = 2
TOTAL = STEPS_PER_EPOCH * EPOCHS
JOB = [
    "trainer.max_epochs=2",
    "trainer.batch_size=128",
    "trainer.log_every_n_steps=2",
    "trainer.checkpoint_every_n_steps=3",
    "trainer.progress_bar=false",
    "model.dropout=0.1",  # dropout draws from the RNG: its state must be restored too
    "seed=7",
]


@pytest.fixture(scope="module")
def rng():
    seed = int(os.environ.get("FT_SEED", random.SystemRandom().randrange(10**6)))
    print(f"\nfault-tolerance kill points drawn with FT_SEED={seed}")
    return random.Random(seed)


def launch_cmd(*overrides: str, nproc: int) -> list[str]:
    """`python train.py` on 1 rank; `python train.py dist.nproc_per_node=N` on N."""
    return train_cmd(*overrides, *([f"dist.nproc_per_node={nproc}"] if nproc > 1 else []))


def job(run_dir: Path, *extra: str) -> list[str]:
    return [*JOB, f"hydra.run.dir={run_dir}", *extra]


def job_with_wandb(run_dir: Path, *extra: str) -> list[str]:
    """A run whose W&B records assert_same_run checks (the references run without W&B)."""
    return job(run_dir, OFFLINE, *extra)


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_same_run(run_dir: Path, reference: Path) -> None:
    """Bit-identical final weights (and EMA weights), and the same metric rows: none missing,
    none twice."""
    assert_same_training(run_dir, reference)
    # W&B: one run id across attempts. The last attempt's run holds the whole history, each
    # step once (rows the killed attempt never flushed are replayed from metrics.jsonl); an
    # earlier attempt's file holds a prefix of it, which `wandb sync` de-duplicates by step.
    runs = offline_runs(run_dir)
    assert len({r.run_id for r in runs if r.run_id}) == 1
    expected = {}
    for r in rows(reference):
        expected[r["step"]] = expected.get(r["step"], False) or "val/acc" in r
    for attempt in runs:
        steps = [h["_step"] for h in attempt.history]
        assert len(steps) == len(set(steps)), "a W&B step was logged twice"
        assert set(steps) <= expected.keys()
    final = {h["_step"]: "val/acc" in h for h in runs[-1].history}
    assert final == expected


def uninterrupted(
    pool, root: Path, *extra: str, worlds: tuple[int, ...] = (1, 2)
) -> dict[int, Path]:
    """The job's uninterrupted runs on 1 and 2 ranks (`worlds`), by world size: references, run
    in the session's ranks (tests/rank_pool.py), not as processes of their own."""
    refs = {}
    for nproc in worlds:
        refs[nproc] = root / f"ranks{nproc}"
        pool.train(refs[nproc], *job(refs[nproc], *extra), world_size=nproc)
    return refs


@pytest.fixture(scope="module")
def reference(tmp_path_factory, two_ranks):
    return uninterrupted(two_ranks, tmp_path_factory.mktemp("reference"))


def kill_step(rng, where: str) -> int:
    if where == "epoch_boundary":
        return STEPS_PER_EPOCH + 1  # first step after the epoch-end checkpoint
    if where == "before_any_checkpoint":
        return 3  # after the first row (step 2), before the first checkpoint (step 3)
    # after the first checkpoint (step 3), strictly inside an epoch
    return rng.choice([s for s in range(5, TOTAL) if s % STEPS_PER_EPOCH not in (0, 1)])


# Each kill point and each world size once: at an epoch boundary on 1 rank here; mid-epoch on
# 2 ranks in test_killed_then_resumed_with_ema_and_mixup_equals_uninterrupted (the same kill
# and resume, with the recipe's state on top of the plain run's).
# Fixed kill points beside the drawn ones: before any checkpoint, after the first row (a
# restart from scratch must not append to the killed attempt's rows), on 1 and 2 ranks.
@pytest.mark.parametrize(
    "where,nproc",
    [("epoch_boundary", 1), ("before_any_checkpoint", 1), ("before_any_checkpoint", 2)],
)
def test_killed_then_resumed_equals_uninterrupted(tmp_path, reference, rng, where, nproc):
    checkpointed = where != "before_any_checkpoint"
    kill_and_resume(tmp_path / "run", kill_step(rng, where), nproc, checkpointed=checkpointed)
    assert_same_run(tmp_path / "run", reference[nproc])


def kill_and_resume(
    run_dir: Path, step: int, nproc: int, *extra: str, checkpointed: bool = True
) -> None:
    """The job killed at `step` (on the last rank), then resumed to the end (launch_cmd):
    from its checkpoint, or (not `checkpointed`) from the start, the killed rows dropped."""
    killed = run(
        launch_cmd(*job_with_wandb(run_dir, *extra), nproc=nproc),
        HYDRA_DDP_FAULT=f"kill@{step}:{nproc - 1}",
    )
    assert killed.returncode != 0, f"step {step}: the kill did not happen\n{output(killed)}"
    resumed = run(launch_cmd(*job_with_wandb(run_dir, *extra, "resume=auto"), nproc=nproc))
    assert resumed.returncode == 0, output(resumed)
    log = (run_dir / "train.log").read_text()
    assert ("resumed from" in log) if checkpointed else ("row(s) after step 0" in log)


# A training recipe with its own state and randomness: EMA weights, batch-level MixUp/CutMix
# seeded per batch, label smoothing, random erasing on the fast path.
RECIPE = [
    "trainer.ema.decay=0.9",
    "trainer.mixup.mixup_alpha=0.2",
    "trainer.mixup.cutmix_alpha=1.0",
    "trainer.label_smoothing=0.1",
    "augment.random_erasing=0.25",
]


@pytest.fixture(scope="module")
def recipe_reference(tmp_path_factory, two_ranks):
    return uninterrupted(
        two_ranks, tmp_path_factory.mktemp("recipe_reference"), *RECIPE, worlds=(2,)
    )


# On 2 ranks, killed mid-epoch: the recipe's state is saved by rank 0 as at 1 rank (test
# above: 1 rank, at an epoch boundary, no recipe).
def test_killed_then_resumed_with_ema_and_mixup_equals_uninterrupted(
    tmp_path, recipe_reference, rng
):
    kill_and_resume(tmp_path / "run", kill_step(rng, "mid_epoch"), 2, *RECIPE)
    assert_same_run(tmp_path / "run", recipe_reference[2])
    val_rows = [row for row in rows(tmp_path / "run") if "val/acc" in row]
    assert len(val_rows) == 2 and all("val_ema/acc" in row for row in val_rows)


def test_elastic_restart_after_a_killed_rank(tmp_path, reference, rng):
    step = kill_step(rng, "mid_epoch")
    run_dir = tmp_path / "run"
    cmd = train_cmd(*job_with_wandb(run_dir), nproc=2)
    cmd.insert(cmd.index("--standalone"), "--max-restarts=1")
    proc = run(cmd, HYDRA_DDP_FAULT=f"kill@{step}:1")
    assert proc.returncode == 0, output(proc)
    assert "restart 1 of the ranks: resuming" in output(proc)
    assert_same_run(run_dir, reference[2])


def test_sigkill_during_saves_never_leaves_a_wrong_checkpoint(tmp_path, reference, rng):
    run_dir = tmp_path / "run"
    # A checkpoint every step: most of the time is spent saving, so the kill lands in one.
    cmd = train_cmd(*job_with_wandb(run_dir, "trainer.checkpoint_every_n_steps=1"))
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=run_env(),
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 120
    while not step_files(run_dir / "checkpoints") and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(rng.uniform(0.0, 1.5))
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    for path in step_files(run_dir / "checkpoints"):
        assert verify(path) is None, f"{path.name} does not match its digest"
        load_checkpoint(path)
    resumed = run(train_cmd(*job_with_wandb(run_dir, "resume=auto")))
    assert resumed.returncode == 0, output(resumed)
    assert_same_run(run_dir, reference[1])


# No process boundary is tested here (the digest is checked when a run resumes from files on
# disk): the resumed run is train.py's on rank 0 of the session's ranks, as `python train.py`.
def test_corrupt_newest_checkpoint_falls_back_to_the_previous(tmp_path, reference, two_ranks):
    run_dir = tmp_path / "run"
    shutil.copytree(reference[1], run_dir)
    newest, previous = step_files(run_dir / "checkpoints")[:2]
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF  # a flipped bit still loads: only the digest can tell
    newest.write_bytes(bytes(data))
    start = two_ranks.log_size()
    # A run that fails raises here (RanksFailed, with the ranks' output).
    two_ranks.train(run_dir, *job(run_dir, "resume=auto", "trainer.max_epochs=3"), world_size=1)
    out = two_ranks.output(since=start)  # the console output of this run (rank 0's)
    assert f"skipped {newest.name} (SHA-256 mismatch" in out, out[-3000:]
    assert f"resumed from {previous}" in (run_dir / "train.log").read_text()


@pytest.mark.parametrize("nproc", [1, 2])
def test_sigterm_preemption_checkpoints_then_resumes_exactly(tmp_path, reference, nproc):
    run_dir = tmp_path / "run"
    launch = None if nproc == 1 else nproc
    # Check every step; the ranks wait at step 5 (after the second row) until the SIGTERM
    # reaches them, so that the stop lands before the run would end on its own.
    cmd = train_cmd(
        *job_with_wandb(run_dir, "trainer.preemption_check_every_n_steps=1"), nproc=launch
    )
    env = run_env(HYDRA_DDP_FAULT="stall@5")
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    wait_for_rows(run_dir / "metrics.jsonl", 2, proc, timeout=120)
    proc.send_signal(signal.SIGTERM)  # to `python train.py`, or to the torchrun agent
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0, out
    if nproc == 1:
        assert proc.returncode == REQUEUE_EXIT_CODE, out
    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "preempted", out
    last = load_checkpoint(run_dir / "checkpoints" / "last.pt")
    assert 0 < last["progress"]["step"] < TOTAL
    assert f"preempted at step {last['progress']['step']}" in out
    resumed = run(train_cmd(*job_with_wandb(run_dir, "resume=auto"), nproc=launch))
    assert resumed.returncode == 0, output(resumed)
    assert_same_run(run_dir, reference[nproc])


def test_a_raising_rank_takes_the_job_down_promptly(tmp_path):
    start = time.time()
    proc = run(train_cmd(*job(tmp_path / "run"), nproc=2), timeout=300, HYDRA_DDP_FAULT="raise@5:1")
    assert proc.returncode != 0
    assert "injected fault at step 5 on rank 1" in output(proc)
    assert time.time() - start < 300


def test_without_an_agent_the_other_rank_exits_within_the_timeout(tmp_path):
    """srun-style: two ranks from the environment, nobody to kill the survivor."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE="2",
        LOCAL_WORLD_SIZE="2",
        HYDRA_DDP_FAULT="raise@5:1",
    )
    run_dir = tmp_path / "run"
    cmd = train_cmd(*job(run_dir), "dist.step_timeout_s=20", "dist.timeout_s=120")
    ranks = [
        subprocess.Popen(
            cmd,
            cwd=REPO,
            env=run_env(**env, RANK=str(r), LOCAL_RANK=str(r)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in (0, 1)
    ]
    start = time.time()
    outs = [p.communicate(timeout=180)[0] for p in ranks]
    assert all(p.returncode != 0 for p in ranks), outs
    assert "injected fault at step 5 on rank 1" in outs[1]
    assert time.time() - start < 20 + 60  # the step timeout, plus shutdown slack


# A shared file system that writes a checkpoint slowly: every process started with this
# sitecustomize on PYTHONPATH takes SLOW_CHECKPOINT_WRITE_S seconds to fsync a step file (only
# rank 0 writes them), as a loaded NFS or Lustre mount takes to flush hundreds of MB.
SLOW_CHECKPOINT_WRITE = r"""
import os, re, time

_fsync = os.fsync


def _slow_fsync(fd):
    try:
        path = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        path = ""
    if re.search(r"/checkpoints/\.step-[0-9-]+\.pt\.tmp-[0-9]+$", path):
        time.sleep(float(os.environ["SLOW_CHECKPOINT_WRITE_S"]))
    _fsync(fd)


os.fsync = _slow_fsync
"""


def test_a_checkpoint_write_slower_than_the_step_timeout_is_waited_for(tmp_path):
    """2 ranks, each checkpoint taking 8 s to write, the step timeout 3 s: the other rank waits
    for rank 0's write on the gloo group (NCCL runs use DistEnv.cpu_group) under a timeout
    sized for the write, not under the step timeout (on NCCL, its watchdog's SIGABRT of every
    rank), and the run completes with its checkpoints."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SLOW_CHECKPOINT_WRITE)
    run_dir = tmp_path / "run"
    overrides = ["trainer.max_epochs=1", "trainer.limit_train_batches=4", "dist.step_timeout_s=3"]
    proc = run(
        launch_cmd(*job(run_dir, *overrides), nproc=2),
        timeout=300,
        SLOW_CHECKPOINT_WRITE_S="8",
        PYTHONPATH=os.pathsep.join([str(site), IMPORT_PATH]),
    )
    assert proc.returncode == 0, output(proc)
    assert json.loads((run_dir / "result.json").read_text())["status"] == "completed"
    saved = [p.name for p in step_files(run_dir / "checkpoints")]
    assert saved == ["step-00000004.pt", "step-00000003.pt"]  # step 3's, then the epoch's end


def test_nan_stops_naming_step_and_rank_or_is_skipped(tmp_path):
    proc = run(launch_cmd(*job(tmp_path / "stop"), nproc=2), HYDRA_DDP_FAULT="nan@3:1")
    assert proc.returncode != 0
    assert "non-finite loss (nan) at step 3 (epoch 1) on rank 1" in output(proc)
    skip_dir = tmp_path / "skip"
    proc = run(
        launch_cmd(*job(skip_dir, "trainer.nonfinite=skip"), nproc=2), HYDRA_DDP_FAULT="nan@3:1"
    )
    assert proc.returncode == 0, output(proc)
    logged = [r for r in rows(skip_dir) if "train/loss" in r]
    assert logged[-1]["train/skipped_steps"] == 1
    assert all(r["train/loss"] == r["train/loss"] for r in logged)  # no NaN reached the log


# Resuming at another world size. No dropout here: the model's own draws come from each rank's
# RNG, which a checkpoint from another world size cannot hand over; every draw of the data path
# (augment=shift's crops, MixUp/CutMix pairs, weights and boxes) depends on (seed, epoch, sample
# index or global batch) only.
ELASTIC_JOB = [
    *(x for x in JOB if not x.startswith("model.dropout")),
    "trainer.precision=64",  # float32 all-reduce rounding can flip a ReLU / max-pool tie
]
ELASTIC = {
    "shift": ["wandb.mode=disabled"],  # digits' default augmentation
    "mixup": [
        "wandb.mode=disabled",
        "trainer.mixup.mixup_alpha=0.2",
        "trainer.mixup.cutmix_alpha=1.0",
    ],
}


def elastic_job(run_dir: Path, recipe: str, *extra: str) -> list[str]:
    return [*ELASTIC_JOB, *ELASTIC[recipe], f"hydra.run.dir={run_dir}", *extra]


def elastic_cmd(run_dir: Path, recipe: str, nproc: int, *extra: str) -> list[str]:
    return launch_cmd(*elastic_job(run_dir, recipe, *extra), nproc=nproc)


@pytest.fixture(scope="module")
def elastic_reference(tmp_path_factory, two_ranks):
    """Each recipe's uninterrupted run on 1 rank (in the session's ranks, as `reference`)."""
    refs = {}
    for recipe in ELASTIC:
        refs[recipe] = tmp_path_factory.mktemp("elastic") / recipe
        two_ranks.train(refs[recipe], *elastic_job(refs[recipe], recipe), world_size=1)
    return refs


# Each direction and each recipe once: 2 -> 1 with MixUp/CutMix, 1 -> 2 with shift crops.
@pytest.mark.parametrize("before,after,recipe", [(2, 1, "mixup"), (1, 2, "shift")])
def test_resumed_at_another_world_size_ends_where_the_uninterrupted_run_ends(
    tmp_path, elastic_reference, rng, recipe, before, after
):
    run_dir, step = tmp_path / "run", kill_step(rng, "mid_epoch")
    killed = run(elastic_cmd(run_dir, recipe, before), HYDRA_DDP_FAULT=f"kill@{step}:{before - 1}")
    assert killed.returncode != 0, f"step {step}: the kill did not happen\n{output(killed)}"
    resumed = run(elastic_cmd(run_dir, recipe, after, "resume=auto"))
    assert resumed.returncode == 0, output(resumed)
    log = (run_dir / "train.log").read_text()
    assert "resumed from" in log and f"checkpoint from world size {before}" in log
    ref = load_checkpoint(elastic_reference[recipe] / "checkpoints" / "last.pt")
    got = load_checkpoint(run_dir / "checkpoints" / "last.pt")
    assert got["progress"]["step"] == ref["progress"]["step"] == TOTAL
    diff = max((ref["model"][k] - got["model"][k]).abs().max().item() for k in ref["model"])
    print(f"{recipe}: {before} -> {after} ranks, killed at step {step}: max |dw| {diff:.2e}")
    assert diff <= 1e-9  # float64 (ELASTIC_JOB): a correct handover ends ~1e-16 away
