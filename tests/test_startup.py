"""Start fast: the processes that do not train import no torch (nor torchvision, nor W&B), and
jobs forked from the warm start's server (ddp_launcher/ranks/warm.py) train exactly as fresh
processes do."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import pytest
import torch

import tests.helpers as fx

HEAVY = ("torch", "torchvision", "wandb")


# Runs a command as `python ARGS...` would, and writes the top-level packages this process
# alone imported (not its children: the warm start's server and the ranks import torch) when
# it exits, to OUT.
OWN_IMPORTS = """
import atexit, runpy, sys
out, args = sys.argv[1], sys.argv[2:]
atexit.register(lambda: open(out, "w").write("\\n".join({m.split(".")[0] for m in sys.modules})))
if args[0] == "-c":
    exec(args[1])
elif args[0] == "-m":
    sys.argv = args[1:]
    runpy.run_module(args[1], run_name="__main__", alter_sys=True)
else:
    sys.argv = args
    runpy.run_path(args[0], run_name="__main__")
"""


def run_own_imports(*args: str, **env: str):
    """Runs `python <args>`; its `.imported` are the top-level packages that process imported
    (None: it did not get to say)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "imported"
        proc = fx.run([sys.executable, "-c", OWN_IMPORTS, str(out), *args], **env)
        proc.imported = set(out.read_text().split()) if out.exists() else None
    return proc


def test_the_import_report_is_read() -> None:
    """The check can fail: a process that imports torch is seen to."""
    proc = run_own_imports("-c", "import torch")
    assert "torch" in proc.imported


@pytest.mark.parametrize("flags", [["--help"], ["--cfg", "job"]])
def test_help_and_cfg_import_no_torch(flags: list[str]) -> None:
    proc = run_own_imports("train.py", *flags)
    assert proc.returncode == 0, fx.output(proc)
    assert not proc.imported & set(HEAVY)


@pytest.mark.slow
def test_a_two_rank_job_and_a_sweep_start_without_torch_in_their_own_process(
    tmp_path: Path,
) -> None:
    """`python train.py dist.nproc_per_node=2` only hands the job to its ranks; a sweep's
    launcher only starts jobs; the report only reads files: none imports torch or
    torchvision, and W&B only to record (off here)."""
    run_dir = tmp_path / "run"
    proc = run_own_imports(
        "train.py", "dist.nproc_per_node=2", *fx.QUICK, f"hydra.run.dir={run_dir}"
    )
    assert proc.returncode == 0, fx.output(proc)
    assert (run_dir / "checkpoints" / "best.pt").exists()
    assert not proc.imported & set(HEAVY)

    sweep_dir = tmp_path / "sweep"
    proc = run_own_imports("train.py", "-m", *fx.QUICK, "seed=1,2", f"hydra.sweep.dir={sweep_dir}")
    assert proc.returncode == 0, fx.output(proc)
    assert len(fx.summary_rows(sweep_dir)) == 2
    assert not proc.imported & set(HEAVY)
    assert (sweep_dir / "summary.png").exists()

    proc = run_own_imports("-m", "ddp_launcher.report", str(sweep_dir))
    assert proc.returncode == 0, fx.output(proc)
    assert not proc.imported & set(HEAVY)


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
    # --compare-python: every command is run by the interpreter given
    assert {cmd[0] for cmd in startup.commands(Path("/tmp"), "/venv/bin/python").values()} == {
        "/venv/bin/python"
    }


@pytest.mark.slow
def test_an_agent_that_ends_at_once_is_seen_to_end(tmp_path: Path) -> None:
    """ddp_launcher/warm.py: an agent forked from the warm start's server that ends at once (its
    working dir is gone) is seen to end, with its exit status."""
    from ddp_launcher.ranks.job_spec import AgentSpec
    from ddp_launcher.warm import WarmStart

    spec = AgentSpec(
        payload="job.pkl",
        failures="failures.json",
        nproc=1,
        nnodes=1,
        max_restarts=0,
        monitor_interval=0.1,
        log_dir=str(tmp_path),
        tee="0",
        line_prefix="",
        cwd=str(tmp_path / "gone"),
    )
    agent = WarmStart().start(spec)
    agent.join(timeout=120)
    assert agent.exitcode == 1


def test_the_agents_rendezvous_event_names_are_torchs() -> None:
    """ddp_launcher/ranks/agent.py's cheap get_method_name gives the name torch's own gives (the
    method
    `depth` frames up), also when the stack is too short."""
    from ddp_launcher.ranks.agent import cheap_rendezvous_event_names
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

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
