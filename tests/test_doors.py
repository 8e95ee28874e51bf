"""No door around the gate (issue 65, items 3 and 4): one job dir holds one job, and every dir a
start writes is checked as a dir. Through the real entry points, with the issue's commands:
a sweep whose subdir gives two jobs one dir, or does not resolve; eval.py into a training
run's folders; a sweep into a single run's dir; blank output dirs; on_drift=refuse on a resumed
sweep. Each is exit 2 and one line, and writes nothing.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pytest

from tests.helpers import QUICK, REPO, eval_cmd, output, read_json, run, train_cmd
from tests.test_gate_faults import tree


def one_line(proc, code: int = 2) -> str:
    """The process exited with `code`, having said one line (no traceback); that line."""
    out = output(proc)
    lines = [line for line in out.splitlines() if line.strip()]
    assert proc.returncode == code, out[-3000:]
    assert len(lines) == 1 and "Traceback" not in out, out[-3000:]
    return lines[0]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """One completed 1-epoch run (read, never written, by the tests below)."""
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    proc = run(train_cmd(*QUICK, f"hydra.run.dir={run_dir}"), timeout=300)
    assert proc.returncode == 0, output(proc)[-3000:]
    return run_dir


# ---------------------------------------------------------------------------------------------
# item 3: one job dir, one job


@pytest.mark.slow
@pytest.mark.parametrize("parallel", [2, 1])
def test_two_sweep_jobs_never_share_a_job_dir(tmp_path: Path, parallel: int) -> None:
    """`hydra.sweep.subdir=s${seed}` with optim.lr swept gives both jobs s0/: refused before
    any job starts, in one line naming both jobs and the dir; nothing written (with
    max_parallel=2 both ran in s0/ at once, with 1 job 1 started over job 0's run)."""
    sweep_dir = tmp_path / "sweep"
    cmd = train_cmd(
        "-m", "optim.lr=0.05,0.1", "trainer.max_epochs=1", "wandb.mode=disabled",
        "hydra.sweep.subdir=s${seed}", f"hydra.launcher.max_parallel={parallel}",
        f"hydra.sweep.dir={sweep_dir}",
    )  # fmt: skip
    line = one_line(run(cmd, timeout=300))
    assert "jobs #0 (optim.lr=0.05" in line and "#1 (optim.lr=0.1" in line, line
    assert f"{sweep_dir / 's0'}" in line and "hydra.sweep.subdir" in line, line
    assert not sweep_dir.exists()
    if parallel == 1:  # the dry run says so too
        assert "would share the job dir" in one_line(run([*cmd, "hydra.launcher.dry_run=true"]))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("subdir", "said"),
    [
        ("${model}", "hydra.sweep.subdir=${model} does not resolve to a dir name"),
        ("${hydra:runtime.choices.model}", "would share the job dir"),
    ],
)
def test_a_subdir_that_names_no_dir_per_job_is_one_line(
    tmp_path: Path, subdir: str, said: str
) -> None:
    """`${model}` (a node, no name) and `${hydra:runtime.choices.model}` (resolved as Hydra's
    run_job does: small_cnn for both jobs) were 83- and 114-line tracebacks: now one line each,
    and nothing written."""
    sweep_dir = tmp_path / "sweep"
    cmd = train_cmd(
        "-m", "optim.lr=0.05,0.1", *QUICK, f"hydra.sweep.subdir={subdir}",
        f"hydra.sweep.dir={sweep_dir}",
    )  # fmt: skip
    assert said in one_line(run(cmd, timeout=300))
    assert not sweep_dir.exists()


# ---------------------------------------------------------------------------------------------
# item 4: every dir a start writes is checked as a dir


@pytest.mark.slow
def test_a_run_or_an_evaluation_into_a_sweep_dir_is_refused(trained: Path, tmp_path: Path) -> None:
    """`python train.py hydra.run.dir=<a sweep dir>` was accepted: the run's records landed
    beside the sweep's jobs, its start_over then moved multirun.yaml and the job dirs into
    replaced/, and the sweep could not be resumed there. Refused in one line (eval.py too),
    the sweep dir byte-identical."""
    sweep_dir = tmp_path / "S"
    shutil.copytree(trained, sweep_dir / "0")
    (sweep_dir / "multirun.yaml").write_text("hydra:\n  mode: MULTIRUN\n")
    before = tree(sweep_dir)
    line = one_line(run(train_cmd(*QUICK, f"hydra.run.dir={sweep_dir}")))
    assert f"{sweep_dir} holds a sweep" in line, line
    line = one_line(run(eval_cmd(f"run={trained}", f"hydra.run.dir={sweep_dir}")))
    assert f"{sweep_dir} holds a sweep" in line and tree(sweep_dir) == before, line
    (sweep_dir / "multirun.yaml").unlink()  # its job dirs alone say it too
    before = tree(sweep_dir)
    line = one_line(run(train_cmd(*QUICK, f"hydra.run.dir={sweep_dir}", "start_over=true")))
    assert f"{sweep_dir} holds a sweep" in line and tree(sweep_dir) == before, line


@pytest.mark.slow
def test_eval_and_train_refuse_any_path_inside_a_training_run(
    trained: Path, tmp_path: Path
) -> None:
    """`python eval.py run=R hydra.run.dir=R/checkpoints` (also R/evals/x, R/replaced) was
    accepted, and the next resume=auto deleted what it wrote: refused in one line naming R,
    R byte-identical; so is a training run into R/checkpoints, and a sweep into R or inside
    it."""
    run_dir = tmp_path / "R"
    shutil.copytree(trained, run_dir)
    before = tree(run_dir)
    for inside in ("checkpoints", "evals/x", "replaced"):
        line = one_line(run(eval_cmd(f"run={run_dir}", f"hydra.run.dir={run_dir / inside}")))
        assert f"inside {run_dir}, which holds a training run" in line, line
        assert tree(run_dir) == before, inside
    line = one_line(run(train_cmd(*QUICK, f"hydra.run.dir={run_dir / 'checkpoints'}")))
    assert f"inside {run_dir}, which holds a training run" in line, line
    for sweep_dir, said in (
        (run_dir, "holds a training run of its own"),
        (run_dir / "s", "inside"),
    ):
        cmd = train_cmd("-m", *QUICK, "seed=1,2", f"hydra.sweep.dir={sweep_dir}")
        assert said in one_line(run(cmd, timeout=300))
    assert tree(run_dir) == before
    assert read_json(run_dir / "result.json")["status"] == "completed"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "key"),
    [
        (["hydra.run.dir=''"], "hydra.run.dir"),
        (["-m", "seed=1,2", "hydra.sweep.dir=''"], "hydra.sweep.dir"),
        (["-m", "seed=1,2", "hydra.sweep.dir='  '"], "hydra.sweep.dir"),
    ],
    ids=["run dir", "sweep dir", "blank sweep dir"],
)
def test_an_empty_output_dir_is_refused(tmp_path: Path, args: list[str], key: str) -> None:
    """An empty or blank `hydra.run.dir` / `hydra.sweep.dir` wrote into the current directory
    (the repository root, whose every later run then recorded a dirty tree): one line naming
    the key, nothing written there (here a scratch dir is the current directory)."""
    cmd = [sys.executable, str(REPO / "train.py"), *args, *QUICK]
    proc = run(cmd, timeout=300, cwd=tmp_path)
    assert re.search(rf"{re.escape(key)}=.* names no dir", one_line(proc))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_on_drift_refuse_on_a_resumed_sweep_writes_nothing(tmp_path: Path) -> None:
    """A resumed sweep whose unfinished job ran other code at its first attempt, with
    hydra.launcher.on_drift=refuse: exit 2, one line, and the sweep dir byte-identical,
    multirun.yaml and .launcher.lock included (docs/sweeps.md: nothing is written)."""
    sweep_dir = tmp_path / "sweep"
    cmd = train_cmd("-m", *QUICK, "seed=1", f"hydra.sweep.dir={sweep_dir}")
    first = run(cmd, timeout=300)
    assert first.returncode == 0, output(first)[-3000:]
    job = sweep_dir / "0"
    record = json.loads((job / "launch.json").read_text())
    record["attempts"][0]["code"]["commit"] = "0" * 40  # its first attempt: other code
    (job / "launch.json").write_text(json.dumps(record))
    (job / "result.json").unlink()  # and it did not finish
    before = tree(sweep_dir)
    refused = run([*cmd, "hydra.launcher.resume=true", "hydra.launcher.on_drift=refuse"])
    assert "on_drift=refuse: nothing was started" in one_line(refused)
    assert tree(sweep_dir) == before
