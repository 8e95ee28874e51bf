"""Records that stay true (issue 44): no rerun, restart or refused start changes what a run
wrote, and a run dir holds one trajectory, each step once. Through the real entry points:
`python train.py ...`, `python train.py dist.nproc_per_node=2 ...`, `python eval.py ...`."""

from __future__ import annotations

import errno
import json
import os
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
from ddp_launcher.core.errors import UserError
from ddp_launcher.core.run_dir import read_launch_record

from components.checkpoint import load_checkpoint, step_files
from tests.helpers import (
    OFFLINE,
    QUICK,
    assert_same_training,
    offline_runs,
    output,
    read_json,
    run,
    summary_rows,
    train_cmd,
    train_in_process,
)

# digits: 22 optimizer steps per epoch at the default batch; a row every 2 steps
JOB = ["trainer.max_epochs=2", "trainer.log_every_n_steps=2", "trainer.progress_bar=false"]
# Launcher files that every start rewrites or adds (its hand-off files, torchrun's per-rank
# logs): not the run's records. train.log is a log: it only grows.
LAUNCHER_FILES = (".torchrun", "rank_logs")


def launch(*overrides: str, nproc: int = 1) -> list[str]:
    return train_cmd(*overrides, *([f"dist.nproc_per_node={nproc}"] if nproc > 1 else []))


def snapshot(run_dir: Path) -> dict[str, bytes]:
    """Every file of the run dir but the launcher's and train.log, by relative path."""
    return {
        str(p.relative_to(run_dir)): p.read_bytes()
        for p in sorted(run_dir.rglob("*"))
        if p.is_file()
        and p.name != "train.log"
        and p.relative_to(run_dir).parts[0] not in LAUNCHER_FILES
    }


def steps_once(run_dir: Path) -> list[tuple[int, str]]:
    """metrics.jsonl's (step, kind) keys; asserts each is there once."""
    keys = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        keys.append(
            (row["step"], "val" if "val/acc" in row else "test" if "test/acc" in row else "train")
        )
    assert len(keys) == len(set(keys)), f"a step twice in {run_dir}: {keys}"
    return keys


# Case 1 (a refused resume: a bad setting; a checkpoint that does not fit) and case 3 (a rerun
# without resume): exit 2, one line naming the fix, and the run dir's files byte-identical.
REFUSED = [
    (["trainer.max_epochs=-1", "resume=auto"], "trainer.max_epochs=-1"),
    (["resume=auto", "model.hidden=64"], "does not fit"),
    ([], "resume=auto to continue it"),
]


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_a_refused_start_changes_nothing_in_the_run_dir(tmp_path, nproc):
    run_dir = tmp_path / "r"
    done = run(launch(*QUICK, f"hydra.run.dir={run_dir}", nproc=nproc), timeout=300)
    assert done.returncode == 0, output(done)[-3000:]
    before, log = snapshot(run_dir), (run_dir / "train.log").read_bytes()
    assert read_json(run_dir / "result.json")["status"] == "completed"
    for overrides, fragment in REFUSED:
        proc = run(launch(*QUICK, f"hydra.run.dir={run_dir}", *overrides, nproc=nproc), timeout=300)
        assert proc.returncode == 2, (overrides, output(proc)[-3000:])
        assert fragment in output(proc), (overrides, output(proc)[-3000:])
        after = snapshot(run_dir)
        assert after.keys() == before.keys(), (overrides, after.keys() ^ before.keys())
        changed = [name for name in before if after[name] != before[name]]
        assert not changed, (overrides, changed)
        assert (run_dir / "train.log").read_bytes().startswith(log)  # nothing of it lost


def run_ok(*overrides: str, **env: str) -> None:
    proc = run(train_cmd(*overrides), timeout=300, **env)
    assert proc.returncode == 0, output(proc)[-3000:]


def killed_before_any_checkpoint(run_dir: Path) -> None:
    """Case 2: SIGKILLed at step 5, after the rows of steps 2 and 4, before any checkpoint;
    then resume=auto starts from scratch in the same W&B run."""
    proc = run(train_cmd(*JOB, OFFLINE, f"hydra.run.dir={run_dir}"), HYDRA_DDP_FAULT="kill@5")
    assert proc.returncode != 0 and (run_dir / "metrics.jsonl").read_text().count("\n") == 2
    assert not list((run_dir / "checkpoints").glob("*.pt"))
    run_ok(*JOB, OFFLINE, f"hydra.run.dir={run_dir}", "resume=auto")
    folders = {p.name.rsplit("-", 1)[1] for p in (run_dir / "wandb").glob("offline-run-*")}
    assert len(folders) == 1, f"a second W&B run: {folders}"  # each attempt's folder: its id
    assert {r.run_id for r in offline_runs(run_dir) if r.run_id} <= folders


def fell_back_to_an_older_checkpoint(run_dir: Path) -> None:
    """Case 4: the newest checkpoint is damaged; resume=auto falls back to epoch 1's and trains
    on with another schedule (3 epochs): the rows after epoch 1 are the new trajectory's."""
    run_ok(*JOB, f"hydra.run.dir={run_dir}")
    newest = step_files(run_dir / "checkpoints")[0]
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))
    run_ok(*JOB, f"hydra.run.dir={run_dir}", "resume=auto", "trainer.max_epochs=3")
    assert [key for key in steps_once(run_dir) if key[1] == "test"] == [(66, "test")]


def rerun_with_resume_auto(run_dir: Path) -> None:
    """A completed run rerun with resume=auto: it continues (nothing left to train)."""
    run_ok(*JOB, f"hydra.run.dir={run_dir}")
    run_ok(*JOB, f"hydra.run.dir={run_dir}", "resume=auto")


def started_over(run_dir: Path) -> None:
    """Case 3's explicit way: start_over=true keeps the old run in replaced/<time>/."""
    run_ok(*JOB, f"hydra.run.dir={run_dir}", "seed=1")
    old = (run_dir / "metrics.jsonl").read_bytes()
    run_ok(*JOB, f"hydra.run.dir={run_dir}", "start_over=true")
    (aside,) = (run_dir / "replaced").iterdir()
    assert (aside / "metrics.jsonl").read_bytes() == old
    assert (aside / "checkpoints" / "last.pt").is_file()


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("reference") / "r"
    run_ok(*JOB, f"hydra.run.dir={run_dir}")
    return run_dir


@pytest.mark.slow
@pytest.mark.parametrize(
    "restart", [killed_before_any_checkpoint, rerun_with_resume_auto, started_over]
)
def test_every_step_once_after_each_kind_of_restart(tmp_path, reference, restart):
    """Each kind of restart ends with the uninterrupted run's rows, each step once."""
    run_dir = tmp_path / "r"
    restart(run_dir)
    steps_once(run_dir)
    assert_same_training(run_dir, reference)


@pytest.mark.slow
def test_a_fallback_resume_drops_the_abandoned_trajectory(tmp_path):
    run_dir = tmp_path / "r"
    fell_back_to_an_older_checkpoint(run_dir)
    assert [k for k in steps_once(run_dir) if k[1] == "val"] == [
        (22, "val"),
        (44, "val"),
        (66, "val"),
    ]


@contextmanager
def failing_checkpoint_writes(monkeypatch, error: int, at: int):
    """The `at`-th step checkpoint write fails with OSError `error` (a full disk, a read-only
    dir: root ignores permissions, so the error is raised where the file is staged)."""
    from components import checkpoint

    real, count = checkpoint.atomic_path, []

    @contextmanager
    def staged(path, **kwargs):
        if checkpoint.STEP_FILE.match(path.name):
            count.append(path.name)
            if len(count) == at:
                raise OSError(error, os.strerror(error))
        with real(path, **kwargs) as tmp:
            yield tmp

    monkeypatch.setattr(checkpoint, "atomic_path", staged)
    yield
    monkeypatch.setattr(checkpoint, "atomic_path", real)


def test_after_a_failed_save_the_records_name_the_weights_that_are_there(tmp_path, monkeypatch):
    """Case 5: the disk fills at epoch 3's save, epoch 3 being the best so far: result.json
    says what best.pt holds (epoch 2's best), not what was never written."""
    run_dir = tmp_path / "r"
    with (
        failing_checkpoint_writes(monkeypatch, errno.ENOSPC, at=3),
        pytest.raises(UserError, match="No space left"),
    ):
        train_in_process(run_dir, "trainer.max_epochs=3", "wandb.mode=disabled")
    result = read_json(run_dir / "result.json")
    best = load_checkpoint(run_dir / "checkpoints" / "best.pt")["monitor"]
    assert (
        result["status"] == "failed" and result["app"]["best_checkpoint"] == "checkpoints/best.pt"
    )
    assert (
        (result["value"], result["value_epoch"])
        == (best["best"], best["best_epoch"])
        == (
            result["value"],
            2,
        )
    )


def test_a_read_only_checkpoint_dir_is_named_as_such(tmp_path, monkeypatch):
    with (
        failing_checkpoint_writes(monkeypatch, errno.EROFS, at=1),
        pytest.raises(UserError) as caught,
    ):
        train_in_process(tmp_path / "r", *QUICK)
    assert "Read-only file system" in str(caught.value) and "writable" in str(caught.value)
    assert "free space" not in str(caught.value)


def one_line_error(proc, *fragments: str, not_counted: tuple[str, ...] = ()) -> None:
    """Exit status 2, at most 3 console lines (but those holding one of `not_counted`), no
    traceback and no Hydra hint after ours (issue 66), each of `fragments` said."""
    out = output(proc)
    lines = [line for line in out.strip().splitlines() if not any(n in line for n in not_counted)]
    assert proc.returncode == 2, out[-3000:]
    assert len(lines) <= 3 and "Traceback" not in out, out[-3000:]
    assert "HYDRA_FULL_ERROR" not in out, out[-3000:]
    for fragment in fragments:
        assert fragment in out, (fragment, out[-3000:])


@pytest.mark.slow
def test_a_checkpoint_without_its_digest_is_refused(tmp_path):
    """Case 6: eval.py and resume refuse a checkpoint without its .sha256 in one line (a
    damaged one would load and give nonsense)."""
    run_dir = tmp_path / "r"
    run_ok(*QUICK, f"hydra.run.dir={run_dir}")
    best = tmp_path / "copy" / "best.pt"  # best.pt taken away without its digest
    best.parent.mkdir()
    shutil.copy(run_dir / "checkpoints" / "best.pt", best)
    evaluated = run(train_cmd(f"ckpt={best}", f"hydra.run.dir={tmp_path / 'e'}", script="eval.py"))
    one_line_error(evaluated, "best.pt.sha256", "ckpt=")
    resumed = run(train_cmd(*QUICK, f"hydra.run.dir={tmp_path / 'r2'}", f"resume={best}"))
    one_line_error(resumed, "best.pt.sha256", "resume=")


# Bad input that was a wrong reason: now one line naming the key and the fix.
BAD_INPUT = [
    (["trainer.batch_size=0"], ["trainer.batch_size=0", "positive"]),
    (["resume={tmp}"], ["is a directory", "checkpoints/last.pt"]),
    # a dir that is no run's: its hint named {tmp}/checkpoints/last.pt, which is not there
    (["resume={tmp}"], ["without checkpoints/last.pt", "resume=<a run dir>/checkpoints/last.pt"]),
]


@pytest.mark.parametrize("overrides,fragments", BAD_INPUT)
def test_bad_input_is_one_line_naming_the_key(tmp_path, overrides, fragments):
    overrides = [o.format(tmp=tmp_path) for o in overrides]
    proc = run(train_cmd(*QUICK, f"hydra.run.dir={tmp_path / 'r'}", *overrides))
    one_line_error(proc, *fragments)
    assert "not divisible" not in output(proc) and "does not exist" not in output(proc)


# `python train.py dist.nproc_per_node=2` printed 13 lines for a user error on b2beecb (the
# message 4 times, torch's agent ProcessExitedException lines).
@pytest.mark.slow
def test_a_user_error_on_two_ranks_is_one_line(tmp_path):
    bad = ["trainer.max_epochs=-1", f"hydra.run.dir={tmp_path / 'r'}"]
    one_line_error(run(launch(*QUICK, *bad, nproc=2), timeout=300), "trainer.max_epochs=-1")


# ---------------------------------------------------------------------------------------------
# records written by 5f215d2
#
# tests/data/records_5f215d2: what 5f215d2 left, the release whose result.json was one flat
# mapping (the experiment's fields beside the launcher's: best, monitor, mode, best_val_acc, ...).
# Made in a worktree of 5f215d2 (its launch/ first on PYTHONPATH, OMP_NUM_THREADS=1, on CPU):
#   python train.py trainer.max_epochs=2 <OLD_ARGS> hydra.run.dir=<out>/run
#   python train.py -m trainer.max_epochs=3 <OLD_ARGS> optim.lr=0.05,0.1 \
#       hydra.sweep.dir=<out>/sweep &
#   # SIGKILL that launcher's process group once <out>/sweep/1/checkpoints/step-*.pt exists
# then copied without what neither a resume nor the report reads (repro/, rank_logs/,
# .torchrun/job.pkl; of the completed job 0 its checkpoints and .torchrun/, so that a resume
# takes its value from its result.json). Their records name the worktree where they ran; the
# tests run them from another dir.
OLD_RECORDS = Path(__file__).parent / "data" / "records_5f215d2"
OLD_ARGS = [
    "trainer.batch_size=32",
    "model.channels=[8,16]",
    "model.hidden=32",
    "trainer.log_every_n_steps=4",
    "trainer.checkpoint_every_n_steps=5",
    "trainer.progress_bar=false",
    "wandb.mode=disabled",
]


@pytest.mark.slow
def test_a_run_of_5f215d2_is_done_and_then_resumes_further(tmp_path):
    """A completed 2-epoch run 5f215d2 recorded (its flat result.json): resume=auto with the
    same 2 epochs has nothing to do (its epochs and status read from the old record), and with
    3 epochs it continues from its last checkpoint: its rows kept, one epoch more, a result.json
    in today's layout whose value is the best of all three epochs."""
    run_dir = tmp_path / "run"
    shutil.copytree(OLD_RECORDS / "run", run_dir)
    old = read_json(run_dir / "result.json")
    assert "app" not in old and old["monitor"] == "val/acc" and old["epochs"] == 2  # as written
    old_rows = (run_dir / "metrics.jsonl").read_text().splitlines()

    same = run(
        train_cmd(*OLD_ARGS, "trainer.max_epochs=2", "resume=auto", f"hydra.run.dir={run_dir}")
    )
    assert same.returncode == 0, output(same)[-3000:]
    assert "holds a completed run (2 epochs; trainer.max_epochs=2)" in output(same), output(same)
    assert read_json(run_dir / "result.json") == old  # nothing changed

    further = run(
        train_cmd(*OLD_ARGS, "trainer.max_epochs=3", "resume=auto", f"hydra.run.dir={run_dir}")
    )
    assert further.returncode == 0, output(further)[-3000:]
    assert "resumed from" in (run_dir / "train.log").read_text()
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert lines[: len(old_rows)] == old_rows  # (up to its last checkpoint, its test row too)
    vals = [json.loads(line) for line in lines if '"val/acc"' in line]
    assert [v["epoch"] for v in vals] == [1, 2, 3]
    result = read_json(run_dir / "result.json")
    assert (result["status"], result["metric"], result["direction"]) == (
        "completed",
        "val/acc",
        "max",
    )
    assert result["value"] == max(v["val/acc"] for v in vals)
    assert vals[result["value_epoch"] - 1]["val/acc"] == result["value"]
    assert result["app"]["epochs"] == 3 and result["summary"] == result["app"]["test"]
    assert "monitor" not in result and "best_val_acc" not in result  # the app's, in its part


@pytest.mark.slow
def test_a_sweep_of_5f215d2_reports_and_resumes(tmp_path):
    """A 2-job sweep 5f215d2 recorded, its launcher killed in job 1: the report ranks it by each
    job's value (job 0's from its flat result.json), resumed with its command line job 0 is not
    run again (its value, from that record, goes to the sweeper; its files keep their bytes)
    and job 1 continues from its checkpoint to completion; the report then lists both
    completed, each with its value, the epoch it was reached at and its last val metrics."""
    sweep_dir = tmp_path / "sweep"
    shutil.copytree(OLD_RECORDS / "sweep", sweep_dir)
    done, killed = sweep_dir / "0", sweep_dir / "1"
    old = read_json(done / "result.json")
    kept = {name: (done / name).read_bytes() for name in ("result.json", "metrics.jsonl")}
    assert not (killed / "result.json").exists()

    report = run([sys.executable, "-m", "ddp_launcher.report", str(sweep_dir)])
    assert report.returncode == 0, output(report)
    assert "ranked by best val/acc (max)" in report.stdout.splitlines()[0], report.stdout
    table = {r["job"]: r for r in summary_rows(sweep_dir)}
    assert float(table["0"]["best"]) == old["best"] and table["0"]["best_epoch"] == str(
        old["best_epoch"]
    )
    assert float(table["0"]["last val/acc"]) == old["final"]["val/acc"]
    assert table["0"]["status"] == "completed" and table["1"]["status"] != "completed"

    cmd = train_cmd("-m", "trainer.max_epochs=3", *OLD_ARGS, "optim.lr=0.05,0.1")
    resumed = run([*cmd, f"hydra.sweep.dir={sweep_dir}", "hydra.launcher.resume=true"])
    out = output(resumed)
    assert resumed.returncode == 0, out[-5000:]
    (line,) = [line for line in out.splitlines() if "completed earlier, not run again" in line]
    assert line.startswith("[") and "#0 " in line and f"(value {old['best']})" in line, line
    assert {name: (done / name).read_bytes() for name in kept} == kept
    assert [a.status for a in read_launch_record(killed).attempts] == ["interrupted", "completed"]
    assert "resumed from" in (killed / "train.log").read_text()
    new = read_json(killed / "result.json")
    assert new["status"] == "completed" and new["app"]["epochs"] == 3

    table = {r["job"]: r for r in summary_rows(sweep_dir)}
    assert [table[n]["status"] for n in "01"] == ["completed", "completed"]
    assert [float(table[n]["best"]) for n in "01"] == [old["best"], new["value"]]
    assert table["1"]["best_epoch"] == str(new["value_epoch"]) and table["1"]["attempts"] == "2"
    assert float(table["1"]["last val/acc"]) == new["app"]["final"]["val/acc"]
    assert [r["job"] for r in summary_rows(sweep_dir)] == sorted(
        "01", key=lambda n: -float(table[n]["best"])
    )
