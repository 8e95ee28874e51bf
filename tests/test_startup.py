"""Start fast: the processes that do not train import no torch (nor torchvision, nor W&B), and
jobs forked from one warm interpreter (launch/ranks/warm.py) train exactly as fresh processes do."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

import tests.helpers as fx

HEAVY = ("torch", "torchvision", "wandb")
REPORT_IMPORTS = {"matplotlib", "scipy"}  # the sweep report's figure and t quantiles


def imported(stderr: str) -> set[str]:
    """Top-level packages a process imported, from its `-X importtime` report."""
    found = set()
    for line in stderr.splitlines():
        match = re.match(r"import time:\s+\d+ \|\s+\d+ \| (\s*)([\w.]+)$", line)
        if match:
            found.add(match.group(2).split(".")[0])
    return found


def timed(*args: str, **env: str):
    """`python -X importtime <args>`: only this process reports (children run without it)."""
    return fx.run([sys.executable, "-X", "importtime", *args], **env)


def test_the_import_report_is_read() -> None:
    """The check can fail: a process that imports torch is seen to."""
    proc = timed("-c", "import torch")
    assert "torch" in imported(proc.stderr)


@pytest.mark.parametrize("flags", [["--help"], ["--cfg", "job"]])
def test_help_and_cfg_import_no_torch(flags: list[str]) -> None:
    proc = timed("train.py", *flags)
    assert proc.returncode == 0, fx.output(proc)
    assert not imported(proc.stderr) & set(HEAVY)


@pytest.mark.slow
def test_a_two_rank_job_and_a_sweep_start_without_torch_in_their_own_process(
    tmp_path: Path,
) -> None:
    """`python train.py dist.nproc_per_node=2` only hands the job to its ranks; a sweep's
    launcher only starts jobs; the report only reads files: none imports torch or
    torchvision, and W&B only to record (off here)."""
    run_dir = tmp_path / "run"
    proc = timed("train.py", "dist.nproc_per_node=2", *fx.QUICK, f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, fx.output(proc)
    assert (run_dir / "checkpoints" / "best.pt").exists()
    assert not imported(proc.stderr) & set(HEAVY)

    sweep_dir = tmp_path / "sweep"
    proc = timed("train.py", "-m", *fx.QUICK, "seed=1,2", f"hydra.sweep.dir={sweep_dir}")
    assert proc.returncode == 0, fx.output(proc)
    assert len(fx.summary_rows(sweep_dir)) == 2
    assert not imported(proc.stderr) & set(HEAVY)
    # Its report was forked from the warm interpreter, which had imported what it needs.
    assert (sweep_dir / "summary.png").exists() and not imported(proc.stderr) & REPORT_IMPORTS

    proc = timed("-m", "launch.report", str(sweep_dir))
    assert proc.returncode == 0, fx.output(proc)
    assert not imported(proc.stderr) & set(HEAVY)


@pytest.mark.slow
def test_jobs_forked_from_one_warm_interpreter_equal_fresh_processes(tmp_path: Path) -> None:
    """Two jobs of one sweep (forked from its one warm interpreter, one after the other) end
    with the weights and metrics of the same two runs each started as a new process."""
    job = ["trainer.max_epochs=2", "wandb.mode=disabled", "trainer.progress_bar=false"]
    sweep_dir = tmp_path / "sweep"
    proc = fx.run(fx.train_cmd("-m", *job, "seed=3,4", f"hydra.sweep.dir={sweep_dir}"))
    assert proc.returncode == 0, fx.output(proc)
    warm = {(sweep_dir / n / ".torchrun" / "job.json").read_text() for n in "01"}
    assert len(warm) == 2  # two jobs, each its own rank 0
    for num, seed in enumerate((3, 4)):
        fresh = tmp_path / f"fresh{seed}"
        proc = fx.run(fx.train_cmd(*job, f"seed={seed}", f"hydra.run.dir={fresh}"))
        assert proc.returncode == 0, fx.output(proc)
        forked = sweep_dir / str(num)
        got, want = fx.weights(forked), fx.weights(fresh)
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want)
        clock = ("time", "elapsed_s")
        assert [{k: v for k, v in r.items() if k not in clock} for r in fx.val_rows(forked)] == [
            {k: v for k, v in r.items() if k not in clock} for r in fx.val_rows(fresh)
        ]


def test_the_startup_benchmark_reads_fixed_costs_and_ratios_from_medians() -> None:
    """docs/bench/startup.py: a job's fixed cost is its 1-epoch wall minus one epoch ((3-epoch wall
    - 1-epoch wall) / 2); a sweep's cost is per job; two trees give a ratio column."""
    from docs.bench import startup

    medians = dict.fromkeys(startup.commands(Path("/tmp")), 1.0)
    medians.update({"floor": 3.0, "1 rank, 1 epoch": 5.0, "1 rank, 3 epochs": 6.0})
    medians.update({"sweep 1-rank": 20.0})
    figures = startup.figures(medians)
    assert figures["python train.py: fixed cost"] == 4.5
    assert figures[f"{startup.SWEEP_1}-job sweep of 1-rank jobs: per job"] == 2.0
    text = startup.table([Path("new"), Path("old")], [medians, {**medians, "floor": 1.5}])
    assert "python train.py: fixed cost | 4.50 (+1.50) | 4.50 (+3.00) | 1.00" in text


def test_an_agent_that_ends_at_once_is_seen_to_end() -> None:
    """launch/warm.py: the warm interpreter's "started" and "ended" lines for one agent may
    arrive in one read; the agent's handle still gets its exit status (no wait forever)."""
    import socket
    from types import SimpleNamespace

    from launch.warm import WarmInterpreter

    warm = WarmInterpreter()
    ours, theirs = socket.socketpair()
    warm.conn = ours
    warm.process = SimpleNamespace(poll=lambda: None, terminate=lambda: None, wait=lambda: 0)
    theirs.sendall(b'{"id": 1, "pid": 42}\n{"pid": 42, "exit": 3}\n')
    agent = warm.start(["--nproc-per-node=1"], {}, None)
    assert (agent.pid, agent.poll()) == (42, 3)
    warm.close()
    theirs.close()


def test_the_agents_rendezvous_event_names_are_torchs() -> None:
    """launch/ranks/agent.py's cheap get_method_name gives the name torch's own gives (the method
    `depth` frames up), also when the stack is too short."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    from launch.ranks.agent import cheap_rendezvous_event_names

    torchs = dynamic_rendezvous.get_method_name
    try:
        cheap_rendezvous_event_names()
        cheap = dynamic_rendezvous.get_method_name
        assert cheap is not torchs

        def record(name_of) -> str:
            return name_of()  # depth 2: the caller of `record`

        def some_rendezvous_method() -> tuple[str, str]:
            return record(torchs), record(cheap)

        theirs, ours = some_rendezvous_method()
        assert ours == theirs == "some_rendezvous_method"
        assert cheap(depth=10_000) == torchs(depth=10_000) == "no_method_name"
        assert cheap(depth=0) == "get_method_name" == torchs(depth=0)
    finally:
        dynamic_rendezvous.get_method_name = torchs
