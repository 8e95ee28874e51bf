"""Ctrl-C is one line and exit 130 on every path (issue 66, item 4): SIGINT to the whole process
group, as a terminal sends it, at a few moments of each start: N ranks through the warm start
(whose forkserver printed a 30-47-line KeyboardInterrupt traceback of its imports after the
launcher's line), a sweep (70 lines, exit 1), an Optuna search, eval.py (which was told to
resume=auto), and plain torchrun's rank 0. One rank's moments are tests/test_bad_input.py's."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.helpers import REPO, frames_in_repo, read_json, run_env, train_cmd

LONG = ["trainer.max_epochs=50", "wandb.mode=disabled", "trainer.progress_bar=false"]
RUN = "interrupted (Ctrl-C): rerun with resume=auto to continue from the last checkpoint"
SWEEP = "interrupted (Ctrl-C): rerun with hydra.launcher.resume=true to continue the sweep"


def in_a_terminal() -> None:
    """preexec_fn: SIGINT as a terminal has it (tests/helpers.py), in a process group of its
    own that the test signals whole, as a terminal signals its foreground group."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.setpgrp()


def ctrl_c(
    cmd: list[str],
    after: str,
    delay: float,
    timeout: float = 180,
    signum: int = signal.SIGINT,
    group: bool = True,
) -> tuple[int, str]:
    """Start `cmd`, wait until its output says `after` (a line fragment; "" for the first
    moment the project runs), then `delay` s, then SIGINT its whole process group (or send
    `signum` to the group, or with group=False to the started process alone, as a scheduler
    or `kill` does): (exit status, output)."""
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=run_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=in_a_terminal,
    )
    lines: list[str] = []
    seen = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if after and after in line:
                seen.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        if after:
            seen.wait(timeout=120)
        else:
            wait_for_yaml(proc)
        time.sleep(delay)
        (os.killpg if group else os.kill)(proc.pid, signum)
        proc.wait(timeout=timeout)
        reader.join(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, "".join(lines)


def wait_for_yaml(proc: subprocess.Popen, timeout: float = 30) -> None:
    """Until the process has begun the project's own imports (yaml's C extension: Hydra)."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            if "/yaml/_yaml" in Path(f"/proc/{proc.pid}/maps").read_text():
                return
        except OSError:
            pass
        time.sleep(0.002)


def said(out: str) -> list[str]:
    """The output's lines less the logged ones (`[date][logger][LEVEL] - ...`, `[rankN]: `)."""
    return [line for line in out.strip().splitlines() if not line.startswith("[")]


@pytest.mark.slow
def test_ctrl_c_of_n_ranks_through_the_warm_start_is_one_line(tmp_path):
    """From the moment the job starts: the warm start's server imports torch for a few seconds,
    then the agent forks the ranks, which train. At each moment: the launcher's one line, exit
    130 (once the ranks ran, the agent added torch's "death signal" warning and its own
    "torchrun: stopped by SIGTERM")."""
    for delay in (0.0, 1.5, 6.0):
        cmd = train_cmd(*LONG, "dist.nproc_per_node=2", f"hydra.run.dir={tmp_path / str(delay)}")
        code, out = ctrl_c(cmd, ": 2 rank(s)", delay)
        assert code == 130 and "Traceback" not in out, (delay, out[-3000:])
        assert said(out) == [RUN], (delay, out[-3000:])


@pytest.mark.slow
def test_sigterm_or_sighup_of_n_ranks_stops_them_as_preemption(tmp_path):
    """SIGTERM (a scheduler's preemption) or SIGHUP (a dropped session) sent to the process
    of `python train.py dist.nproc_per_node=2` while its ranks train: they stop at an agreed
    step with a checkpoint, result.json says `preempted`, and the launcher ends with one line
    naming the resume and exit 75, as a 1-rank run does (it died of the signal, 143/129, with
    no line, no checkpoint of its own and no result.json)."""
    for signum in (signal.SIGTERM, signal.SIGHUP):
        run_dir = tmp_path / signum.name
        cmd = train_cmd(
            *LONG,
            "dist.nproc_per_node=2",
            "trainer.checkpoint_every_n_steps=5",
            f"hydra.run.dir={run_dir}",
        )
        code, out = ctrl_c(cmd, "epoch 1/", 0.5, signum=signum, group=False)
        assert code == 75 and "Traceback" not in out, (signum, out[-3000:])
        assert read_json(run_dir / "result.json")["status"] == "preempted", out[-3000:]
        assert (run_dir / "checkpoints" / "manifest.json").exists()
        line = (
            f"preempted ({signum.name}): rerun with resume=auto and hydra.run.dir={run_dir} "
            "to continue from the last checkpoint"
        )
        assert [x for x in out.splitlines() if "rerun with" in x][-1].endswith(line), out


@pytest.mark.slow
def test_ctrl_c_of_a_sweep_and_of_an_optuna_search_is_one_line(tmp_path):
    """Once the launcher runs (its `sweep dir` line): it stops the jobs, says how to resume in
    one line and exits 130 (a sweep exited 1 in 70 lines: its forkserver's traceback, and
    Hydra's HYDRA_FULL_ERROR line after the launcher's)."""
    for name, extra in (
        ("grid", ["-m", "optim.lr=0.1,0.2"]),
        ("optuna", ["hparams_search=digits_optuna", "hydra.sweeper.n_trials=2"]),
    ):
        sweep_dir = tmp_path / name
        cmd = train_cmd(*extra, *LONG, f"hydra.sweep.dir={sweep_dir}")
        code, out = ctrl_c(cmd, "sweep dir", 1.0)
        assert code == 130 and "Traceback" not in out, (name, out[-3000:])
        assert "HYDRA_FULL_ERROR" not in out, (name, out[-3000:])
        line = (
            "the sweep was stopped (SIGINT): its running jobs stopped and are recorded in their "
            f"job dirs; rerun the same command with hydra.sweep.dir={sweep_dir} "
            "hydra.launcher.resume=true to continue it"
        )
        assert said(out) == [line], (name, out[-3000:])


@pytest.mark.slow
def test_ctrl_c_of_eval_is_one_line_without_a_resume(tmp_path):
    """eval.py has nothing to resume: it was told to rerun with resume=auto."""
    import torch

    from components.checkpoint import atomic_save

    ckpt = tmp_path / "best.pt"
    atomic_save({"model": {"w": torch.ones(1)}}, ckpt)  # (whole: the gate lets it through)
    for delay in (0.2, 1.5):
        cmd = train_cmd(f"ckpt={ckpt}", f"hydra.run.dir={tmp_path / str(delay)}", script="eval.py")
        code, out = ctrl_c(cmd, "", delay)
        assert code == 130 and "Traceback" not in out, (delay, out[-3000:])
        assert said(out) == ["interrupted (Ctrl-C): rerun the same command to run it again"], (
            delay,
            out[-3000:],
        )


@pytest.mark.slow
def test_ctrl_c_under_plain_torchrun_is_rank_0s_one_line(tmp_path):
    """torchrun forwards SIGINT to its ranks: rank 0 says the one line (once: no other rank
    does) and no rank prints a traceback; torchrun's agent then reports its own SignalException
    (torch/distributed/run.py's main: no rank can change that)."""
    run_dir = tmp_path / "r"
    cmd = train_cmd(*LONG, "trainer.log_every_n_steps=2", f"hydra.run.dir={run_dir}", nproc=2)
    code, out = ctrl_c(cmd, "lr 0.1", 2.0)
    assert code != 0, out[-3000:]
    assert out.count(RUN) == 1, out[-3000:]
    assert not frames_in_repo(out), out[-3000:]  # no rank's traceback
