"""`hydra.launcher.dry_run=true` (ddp_launcher/preview.py) and `--cfg`/`--info` on a search config.

A dry run composes and checks every job of a sweep as its launch would and prints one row each,
in one process that imports no torch, writing nothing: a fresh sweep dir is not made, an
existing one stays byte for byte. Real processes: a 6-job grid of 1- and 2-rank jobs (torchrun
and, in launch/tests/test_slurm.py's one-node cluster, SLURM), a bad value in one job, the Optuna
sweeper's first batch, and a half-finished sweep (killed at a job's first checkpoint) whose
preview names the skipped, continued and fresh jobs, which the real resume then does.
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
from pathlib import Path

import pytest
from ddp_launcher.core.run_dir import read_launch_record

from tests.helpers import IMPORT_PATH, output, run, train_cmd
from tests.test_docs import COMMANDS

GRID = ["dist.nproc_per_node=1,2", "optim.lr=0.05,0.1,0.2"]
DRY = "hydra.launcher.dry_run=true"
RESUME = "hydra.launcher.resume=true"
QUICK = ["trainer.max_epochs=1", "trainer.progress_bar=false", "wandb.mode=disabled"]
# Every Python process of the command says when it starts and whether it had torch at its end.
PROBE = """\
import atexit, os, sys
_log = os.environ["PREVIEW_PROBE_LOG"]
with open(_log, "a") as f:
    f.write(f"start {os.getpid()}\\n")
def _report():
    with open(_log, "a") as f:
        f.write(f"end {os.getpid()} torch={'torch' in sys.modules}\\n")
atexit.register(_report)
"""


def probed(cmd: list[str], tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess, str]:
    """Run `cmd` with the probe in every Python process it starts; (process, the probe's log)."""
    probe = tmp_path / "probe"
    probe.mkdir(exist_ok=True)
    (probe / "sitecustomize.py").write_text(PROBE)
    log = tmp_path / "probe.log"
    log.unlink(missing_ok=True)
    proc = run(cmd, PYTHONPATH=f"{probe}:{IMPORT_PATH}", PREVIEW_PROBE_LOG=str(log), **env)
    return proc, log.read_text() if log.exists() else ""


def snapshot(root: Path) -> dict[str, str]:
    """Every path under `root` with its bytes' digest (dirs: "dir")."""
    return {
        str(p.relative_to(root)): "dir"
        if p.is_dir()
        else hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
    }


def table(out: str) -> dict[str, list[str]]:
    """The preview's rows by job number: {"3": [overrides, nodes x ranks, resources, ...]}."""
    found = {}
    for line in out.splitlines():
        m = re.match(r"^(\d+)  (.*)$", line)
        if m:
            found[m[1]] = [c.strip() for c in re.split(r"\s{2,}", m[2].strip())]
    return found


def assert_one_process_without_torch(probe_log: str) -> None:
    starts = re.findall(r"^start (\d+)$", probe_log, flags=re.M)
    ends = re.findall(r"^end (\d+) torch=(\w+)$", probe_log, flags=re.M)
    assert len(starts) == 1, probe_log  # the launcher alone: no rank, agent or warm start
    assert ends == [(starts[0], "False")], probe_log


@pytest.mark.slow
def test_dry_run_of_a_grid_prints_every_job_and_starts_nothing(tmp_path: Path) -> None:
    """6 jobs (1 and 2 ranks), 2 at a time: 6 rows with their world size, cores (the launcher's
    packing: 2 jobs at once, a slice each) and run dir; one process, no torch, no sweep dir."""
    sweep_dir = tmp_path / "sweep"
    cmd = train_cmd(
        "-m", DRY, f"hydra.sweep.dir={sweep_dir}", "hydra.launcher.max_parallel=2", *QUICK, *GRID
    )
    proc, probe_log = probed(cmd, tmp_path)
    out = output(proc)
    assert proc.returncode == 0, out
    rows = table(out)
    assert sorted(rows) == [str(n) for n in range(6)], out
    for num, (overrides, world, resources, run_dir) in rows.items():
        nproc = "1" if int(num) < 3 else "2"
        assert overrides.startswith(f"dist.nproc_per_node={nproc} optim.lr="), out
        assert world == f"1 x {nproc}" and run_dir == str(sweep_dir / num), out
        assert resources.startswith("CPU, cores "), out
    assert "6 job(s)" in out and "Traceback" not in out
    assert not sweep_dir.exists(), "a dry run made the sweep dir"
    assert_one_process_without_torch(probe_log)


@pytest.mark.slow
def test_a_bad_value_in_one_job_is_one_line_naming_it(tmp_path: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    cmd = train_cmd(
        "-m",
        DRY,
        f"hydra.sweep.dir={sweep_dir}",
        *QUICK,
        "optim.lr=0.1",
        "trainer.batch_size=32,64,-3",
    )
    proc = run(cmd)
    out = output(proc).strip()
    assert proc.returncode == 2, out
    assert len(out.splitlines()) == 1, out
    assert "job #2 " in out and "trainer.batch_size=-3" in out, out
    assert not sweep_dir.exists()


@pytest.mark.slow
def test_optuna_previews_its_first_batch(tmp_path: Path) -> None:
    """n_jobs=3: three trials asked from a throwaway study, one line saying the others depend on
    results; no study, no sweep dir; an existing sweep dir with a stored study stays as is."""
    sweep_dir = tmp_path / "search"
    cmd = train_cmd(
        "hparams_search=digits_optuna",
        DRY,
        f"hydra.sweep.dir={sweep_dir}",
        "hydra.sweeper.n_jobs=3",
        "hydra.launcher.max_parallel=3",
        *QUICK,
    )
    proc, probe_log = probed(cmd, tmp_path)
    out = output(proc)
    assert proc.returncode == 0, out
    rows = table(out)
    assert sorted(rows) == ["0", "1", "2"], out
    assert all("optim.lr=" in row[0] and "model.hidden=" in row[0] for row in rows.values())
    assert len({row[0] for row in rows.values()}) == 3, out  # three different trials
    assert re.search(r"^the next 17 trial\(s\) .* depend on the results", out, flags=re.M), out
    assert not sweep_dir.exists()
    assert_one_process_without_torch(probe_log)
    # the same command again: the same trials (the sampler's seed), asked from a new study
    again = run(cmd)
    assert table(output(again)) == rows


@pytest.mark.slow
def test_resume_preview_of_a_half_finished_sweep_is_what_resume_does(tmp_path: Path) -> None:
    """A 3-job sweep, one job at a time, killed (launcher and ranks) at job 1's first checkpoint
    commit: job 0 completed, job 1 holds a checkpoint, job 2 never started. The dry run with
    resume=true says skip / continue from step N / start fresh and changes no byte of the sweep
    dir; the real resume then runs exactly that."""
    sweep_dir = tmp_path / "sweep"
    cmd = train_cmd(
        "-m",
        f"hydra.sweep.dir={sweep_dir}",
        RESUME,
        *QUICK,
        "trainer.batch_size=64",
        "trainer.checkpoint_every_n_steps=5",
        "hydra.launcher.max_parallel=1",
        "optim.lr=0.05,0.1,0.2",
    )
    killed = run(cmd, HYDRA_DDP_KILL_AT="save.committed:launcher@1")
    assert killed.returncode != 0, output(killed)[-3000:]
    before = snapshot(sweep_dir)

    proc, probe_log = probed([*cmd, DRY], tmp_path)
    out = output(proc)
    assert proc.returncode == 0, out
    rows = table(out)
    assert rows["0"][-1] == "skip (completed)", out
    continued = re.fullmatch(r"continue from step (\d+) \(epoch 0\)", rows["1"][-1])
    assert continued, out
    assert rows["2"][-1] == "start fresh", out
    assert rows["0"][2] == "-" and rows["1"][2].startswith("CPU"), out
    assert snapshot(sweep_dir) == before, "a dry run changed the sweep dir"
    assert_one_process_without_torch(probe_log)

    attempts = {n: len(read_launch_record(sweep_dir / str(n)).attempts) for n in (0, 1)}
    resumed = run(cmd)
    assert resumed.returncode == 0, output(resumed)[-5000:]
    assert len(read_launch_record(sweep_dir / "0").attempts) == attempts[0]  # skipped
    job1 = read_launch_record(sweep_dir / "1").attempts
    assert len(job1) == attempts[1] + 1 and job1[-1].continued, job1
    log1 = (sweep_dir / "1" / "train.log").read_text()
    assert re.search(rf"resumed from \S+: epoch \d+, step {continued[1]}\b", log1), log1
    job2 = read_launch_record(sweep_dir / "2").attempts
    assert len(job2) == 1 and not job2[0].continued, job2
    assert "resumed from" not in (sweep_dir / "2" / "train.log").read_text()


SEARCHES = [c for c in COMMANDS if any(o.startswith("hparams_search=") for o in c.overrides)]


def test_the_docs_hold_search_commands() -> None:
    assert len(SEARCHES) >= 5, [c.where for c in SEARCHES]


@pytest.mark.slow
@pytest.mark.parametrize("command", SEARCHES, ids=[c.where for c in SEARCHES])
def test_cfg_job_on_a_documented_search_prints_its_config(command) -> None:
    """`python train.py --cfg job <a documented search>`: the jobs' config (YAML) and one line
    naming the dry run, exit 0; Hydra refused --cfg beside the search's multirun."""
    flags = ["-m"] if command.multirun else []
    proc = run([sys.executable, "train.py", *flags, "--cfg", "job", *command.overrides])
    assert proc.returncode == 0, output(proc)
    assert "Traceback" not in output(proc)
    assert re.search(r"^trainer:\n  ", proc.stdout, flags=re.M), proc.stdout[:2000]
    assert proc.stderr.strip().count("\n") == 0 and "dry_run=true" in proc.stderr, proc.stderr


@pytest.mark.slow
def test_info_on_a_search_config_answers() -> None:
    proc = run([sys.executable, "train.py", "--info", "defaults", "hparams_search=digits_optuna"])
    assert proc.returncode == 0 and "Traceback" not in output(proc), output(proc)
    assert "hparams_search/digits_optuna" in proc.stdout, proc.stdout


def test_dry_run_is_a_documented_command() -> None:
    """docs/sweeps.md's dry-run commands are composed by tests/test_docs.py."""
    dry = [c for c in COMMANDS if DRY in c.overrides]
    assert {c.where.split(":")[0] for c in dry} >= {"docs/sweeps.md"}, [c.where for c in dry]
    assert any(RESUME in c.overrides for c in dry)
    assert any(o.startswith("hparams_search=") for c in dry for o in c.overrides)
