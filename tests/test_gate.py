"""Records by construction (issue 55, cases 1-6): one gate before any write
(ddp_launcher/core/gate.py), one holder per run dir (ddp_launcher/core/run_lock.py), nothing
overwritten in place. Through the real entry points: `python train.py`, `python train.py
dist.nproc_per_node=2`, `python eval.py`, sweeps. A refused or no-op start leaves the dir
byte-identical: every file, `.hydra/`, train.log, the
launcher's files and multirun.yaml included."""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import (
    QUICK,
    REPO,
    eval_cmd,
    output,
    read_json,
    run,
    run_env,
    train_cmd,
    wait_for_rows,
)

LOCK = ".run.lock"


def snapshot(root: Path) -> dict[str, str]:
    """Every file under `root` (hidden ones, logs and the launcher's too) by its SHA-256."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def completed(run_dir: Path, *overrides: str, nproc: int = 1) -> None:
    world = [f"dist.nproc_per_node={nproc}"] if nproc > 1 else []
    proc = run(train_cmd(*QUICK, *world, f"hydra.run.dir={run_dir}", *overrides), timeout=300)
    assert proc.returncode == 0, output(proc)[-3000:]
    assert read_json(run_dir / "result.json")["status"] == "completed"


def one_line(proc, code: int, *fragments: str) -> str:
    """The process exited with `code` in at most 3 console lines, no traceback, saying each of
    `fragments`; its output."""
    out = output(proc)
    assert proc.returncode == code, out[-3000:]
    assert len(out.strip().splitlines()) <= 3 and "Traceback" not in out, out[-3000:]
    for fragment in fragments:
        assert fragment in out, (fragment, out[-3000:])
    return out


def holding(path: Path) -> subprocess.Popen:
    """Another process holding `path` as a run dir (ddp_launcher/core/run_lock.py), until it is
    killed."""
    code = (
        "import sys, time; from ddp_launcher.core import run_lock; "
        "run_lock.acquire(sys.argv[1], 'a test'); print('held', flush=True); time.sleep(600)"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", code, str(path)],
        cwd=REPO,
        env=run_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline().strip() == "held"
    return holder


# ---------------------------------------------------------------------------------------------
# case 1: one holder per run dir


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_a_second_start_on_a_held_run_dir_is_refused_and_a_dead_holder_taken_over(
    tmp_path: Path, nproc: int
) -> None:
    """Two starts on one run dir: the second is one line naming the first (pid, host), exit 2,
    and changes nothing; once the first is SIGKILLed, its stale lock is taken over with one
    line and the run continues."""
    run_dir = tmp_path / "r"
    world = [f"dist.nproc_per_node={nproc}"] if nproc > 1 else []
    first = subprocess.Popen(
        train_cmd(
            *QUICK,
            *world,
            "trainer.max_epochs=3",
            "trainer.log_every_n_steps=2",
            f"hydra.run.dir={run_dir}",
        ),  # fmt: skip
        cwd=REPO,
        env=run_env(HYDRA_DDP_FAULT="stall@4"),  # rank(s) wait at step 4 for a signal
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        wait_for_rows(run_dir / "metrics.jsonl", 1, first)  # step 2's: it waits at step 4
        before = snapshot(run_dir)
        second = run(
            train_cmd(*QUICK, "seed=2", "optim.lr=0.2", f"hydra.run.dir={run_dir}"), timeout=300
        )
        one_line(second, 2, f"is in use by pid {first.pid} on {socket.gethostname()}")
        assert snapshot(run_dir) == before
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # the launcher and its ranks, as a lost node
        first.wait()
    assert (run_dir / LOCK).read_text().startswith(f"pid {first.pid} ")  # left behind
    again = run(train_cmd(*QUICK, *world, f"hydra.run.dir={run_dir}", "resume=auto"), timeout=300)
    assert again.returncode == 0, output(again)[-3000:]
    assert f"took over the lock of pid {first.pid} on {socket.gethostname()}" in output(again)
    assert read_json(run_dir / "result.json")["status"] == "completed"
    assert not (run_dir / LOCK).exists()  # a run that ended leaves none


@pytest.mark.slow
def test_eval_and_sweep_jobs_are_held_too(tmp_path: Path) -> None:
    """An evaluation's dir and a sweep job's dir held by another process: eval.py is refused
    in one line, exit 2; the sweep's job fails alone, with that line, and nothing of it is
    written."""
    trained = tmp_path / "trained"
    completed(trained)
    eval_dir, sweep_dir = tmp_path / "eval", tmp_path / "sweep"
    for held in (eval_dir, sweep_dir / "0"):
        held.mkdir(parents=True)
    holders = [holding(eval_dir), holding(sweep_dir / "0")]
    try:
        evaluated = run(eval_cmd(f"run={trained}", f"hydra.run.dir={eval_dir}"), timeout=300)
        one_line(evaluated, 2, f"is in use by pid {holders[0].pid}")
        assert sorted(p.name for p in eval_dir.iterdir()) == [LOCK]
        swept = run(
            train_cmd("-m", *QUICK, "seed=1,2", f"hydra.sweep.dir={sweep_dir}"), timeout=300
        )
        assert swept.returncode == 2, output(swept)[-3000:]
        out = output(swept)
        assert "#0 failed" in out and f"is in use by pid {holders[1].pid}" in out, out[-3000:]
        assert sorted(p.name for p in (sweep_dir / "0").iterdir()) == [LOCK]
        assert read_json(sweep_dir / "1" / "result.json")["status"] == "completed"
    finally:
        for holder in holders:
            holder.kill()
            holder.wait()


# ---------------------------------------------------------------------------------------------
# cases 2-5: a refused or no-op start changes nothing; what a start replaces moves whole


@pytest.mark.slow
def test_refused_and_no_op_starts_leave_the_run_dir_byte_identical(tmp_path: Path) -> None:
    """Case 3: resume=auto on a completed run (also with a smaller trainer.max_epochs) changes
    nothing and says so, exit 0. Case 4: a refused start_over=true moves nothing. Case 5: a
    refused restart of a killed run (no result.json) and eval.py into a training run dir
    rewrite neither .hydra/ nor anything else."""
    run_dir = tmp_path / "r"
    completed(run_dir, "trainer.max_epochs=2")
    before = snapshot(run_dir)
    for overrides in (["resume=auto"], ["resume=auto", "trainer.max_epochs=1"]):
        proc = run(train_cmd(*QUICK, f"hydra.run.dir={run_dir}", *overrides), timeout=300)
        one_line(proc, 0, "holds a completed run", "nothing to continue")
        assert snapshot(run_dir) == before, overrides
    # plain torchrun: rank 1 ends too, rather than wait for rank 0 at the rendezvous
    plain = run(train_cmd(*QUICK, f"hydra.run.dir={run_dir}", "resume=auto", nproc=2), timeout=300)
    said = output(plain)
    assert plain.returncode == 0 and said.count("holds a completed run") == 1, said[-3000:]
    assert snapshot(run_dir) == before
    refused = run(
        train_cmd(*QUICK, f"hydra.run.dir={run_dir}", "start_over=true", "trainer.max_epochs=0"),
        timeout=300,
    )
    one_line(refused, 2, "trainer.max_epochs=0 is not valid")
    evaluated = run(eval_cmd(f"run={run_dir}", f"hydra.run.dir={run_dir}"), timeout=300)
    one_line(evaluated, 2, "holds a training run", "eval.py writes into a dir of its own")
    assert snapshot(run_dir) == before

    killed = tmp_path / "killed"
    proc = run(
        train_cmd(*QUICK, "trainer.max_epochs=2", f"hydra.run.dir={killed}"),
        timeout=300,
        HYDRA_DDP_FAULT="kill@30",  # after epoch 1's checkpoint, before any result.json
    )
    assert proc.returncode != 0 and not (killed / "result.json").exists()
    before = snapshot(killed)
    restarted = run(train_cmd(*QUICK, f"hydra.run.dir={killed}"), timeout=300)
    one_line(restarted, 2, "already holds a run that left no result", "resume=auto")
    assert snapshot(killed) == before  # .hydra/hydra.yaml included


@pytest.mark.slow
def test_what_a_start_replaces_moves_whole_into_replaced(tmp_path: Path) -> None:
    """Case 2: resume=<another run's checkpoint> into a dir holding a completed run moves that
    run whole (.hydra/ and train.log too) into replaced/<time>/ before it starts. Case 5:
    start_over=true keeps the old .hydra/; eval.py run again into its dir moves the earlier
    evaluation aside."""
    donor, run_dir = tmp_path / "donor", tmp_path / "r"
    completed(donor, "trainer.max_epochs=2")
    completed(run_dir, "seed=1")
    old = snapshot(run_dir)
    resumed = run(
        train_cmd(
            *QUICK,
            "trainer.max_epochs=2",
            f"hydra.run.dir={run_dir}",
            f"resume={donor}/checkpoints/step-00000022.pt",
        ),
        timeout=300,
    )
    assert resumed.returncode == 0, output(resumed)[-3000:]
    (aside,) = (run_dir / "replaced").iterdir()
    assert snapshot(aside) == old  # whole, byte for byte
    assert "starts another run's trajectory here: the earlier run is now in" in output(resumed)
    assert read_json(run_dir / "result.json")["app"]["epochs"] == 2

    second = snapshot(run_dir)
    started_over = run(
        train_cmd(*QUICK, f"hydra.run.dir={run_dir}", "start_over=true"), timeout=300
    )
    assert started_over.returncode == 0, output(started_over)[-3000:]
    newest = max((run_dir / "replaced").iterdir(), key=lambda p: p.name)
    kept = snapshot(newest)
    assert kept == {k: v for k, v in second.items() if not k.startswith("replaced/")}
    assert ".hydra/hydra.yaml" in kept and "train.log" in kept

    eval_dir = tmp_path / "e"
    for _ in range(2):
        proc = run(eval_cmd(f"run={run_dir}", f"hydra.run.dir={eval_dir}"), timeout=300)
        assert proc.returncode == 0, output(proc)[-3000:]
    (earlier,) = (eval_dir / "replaced").iterdir()
    assert {"eval.json", ".hydra/hydra.yaml", "eval.log"} <= set(snapshot(earlier))
    assert "eval.py again in" in output(proc)


# ---------------------------------------------------------------------------------------------
# case 6: a sweep's records


@pytest.mark.slow
def test_a_refused_sweep_leaves_multirun_yaml_and_start_over_starts_it_over(
    tmp_path: Path,
) -> None:
    """A resume with other overrides is refused before the sweeper rewrites multirun.yaml; a
    plain rerun is refused naming start_over=true, and start_over=true then starts every job
    over, each old run kept in its replaced/."""
    sweep_dir = tmp_path / "sweep"
    grid = ["seed=1,2", f"hydra.sweep.dir={sweep_dir}"]
    first = run(train_cmd("-m", *QUICK, *grid), timeout=300)
    assert first.returncode == 0, output(first)[-3000:]
    before = snapshot(sweep_dir)
    other = run(
        train_cmd("-m", *QUICK, *grid, "optim.lr=0.2", "hydra.launcher.resume=true"), timeout=300
    )
    one_line(other, 2, "holds another sweep", "optim.lr=0.2")
    plain = run(train_cmd("-m", *QUICK, *grid), timeout=300)
    one_line(plain, 2, "already holds this sweep's jobs", "start_over=true")
    assert snapshot(sweep_dir) == before
    over = run(train_cmd("-m", *QUICK, *grid, "start_over=true"), timeout=300)
    assert over.returncode == 0, output(over)[-3000:]
    for job in ("0", "1"):
        (aside,) = (sweep_dir / job / "replaced").iterdir()
        old = {k.partition("/")[2]: v for k, v in before.items() if k.startswith(f"{job}/")}
        del old["launch.json"]  # the job's attempts stay in place: this is its next one
        assert snapshot(aside) == old
        assert read_json(sweep_dir / job / "result.json")["status"] == "completed"
