"""Daily use: debug presets, the console, complete records (metrics.jsonl, result.json).

In this process (world size 1) where no second rank is needed; the presets on 2 ranks and in a
sweep, and the console of real processes, are slow tests.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import fields
from pathlib import Path

import pytest
from ddp_launcher.core.errors import UserError
from ddp_launcher.core.run_dir import RunResult

from tests.helpers import (
    QUICK,
    REPO,
    offline_runs,
    output,
    read_json,
    run,
    train_cmd,
    train_in_process,
    train_rows,
    val_rows,
)

RESULT_KEYS = {f.name for f in fields(RunResult)} - {"extra"}


def assert_result_schema(run_dir: Path) -> dict:
    """result.json has every RunResult field, whoever wrote it and however the run ended."""
    result = read_json(run_dir / "result.json")
    assert result.keys() >= RESULT_KEYS, RESULT_KEYS - result.keys()
    return result


# ------------------------------------------------------------------------------ debug presets


def test_fast_dev_run_is_a_few_steps_and_writes_no_checkpoints_nor_wandb(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE")  # a user's default (auto): the preset turns W&B off
    run_dir = tmp_path / "r"
    train_in_process(run_dir, "debug=fast_dev_run")
    assert [r["step"] for r in train_rows(run_dir)] == [1, 2, 3]  # 3 steps, each logged
    (val,) = val_rows(run_dir)
    assert val["epoch"] == 1 and val["val/count"] == 180  # digits' val: one batch per rank
    assert not (run_dir / "checkpoints").exists() and not (run_dir / "wandb").exists()
    result = assert_result_schema(run_dir)
    assert result["status"] == "completed" and result["app"]["best_checkpoint"] is None
    assert result["app"]["test"] == {}  # no best.pt to test


def test_limits_take_counts_or_fractions(tmp_path):
    run_dir = tmp_path / "r"
    train_in_process(
        run_dir,
        *QUICK,
        "wandb.mode=disabled",
        "trainer.limit_train_batches=0.5",
        "trainer.limit_val_batches=1",
        "trainer.eval_batch_size=64",
        "trainer.log_every_n_steps=100",
    )
    # 1437 // 64 = 22 steps, half of them; the val batch of 64 (one rank)
    assert [r["step"] for r in train_rows(run_dir)] == [11]
    assert val_rows(run_dir)[0]["val/count"] == 64


def test_overfit_drives_the_train_loss_towards_zero(tmp_path):
    run_dir = tmp_path / "r"
    train_in_process(run_dir, "debug=overfit")
    losses = [r["train/loss"] for r in train_rows(run_dir)]
    assert len(losses) == 40  # 40 epochs of the same 2 batches, a row each epoch
    assert losses[-1] < 0.05 * losses[0], losses


def test_profile_writes_a_chrome_trace_and_the_operator_table(tmp_path):
    run_dir = tmp_path / "r"
    train_in_process(run_dir, "debug=profile", "wandb.mode=offline")
    trace = json.loads((run_dir / "profile" / "trace.json").read_text())
    steps = {e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("Profiler")}
    assert len(steps) == 5, steps  # the active window: 5 steps
    table = (run_dir / "profile" / "key_averages.txt").read_text()
    assert "ProfilerStep" in table and "aten::convolution_backward" in table
    (wb,) = offline_runs(run_dir)
    profiles = [a for a in wb.artifacts if a["type"] == "profile"]
    assert profiles and {Path(p).name for p in profiles[0]["paths"]} == {
        "trace.json",
        "key_averages.txt",
    }


def test_anomaly_detection_names_the_backward_op_of_a_nan(tmp_path):
    # Without the preset a NaN is our one-line non-finite error; with it, torch's anomaly mode
    # stops in backward and names the op.
    with pytest.raises(RuntimeError, match=r"Function '\w+Backward\d*' returned nan values"):
        train_in_process(
            tmp_path / "r",
            "debug=anomaly",
            "wandb.mode=disabled",
            "optim.lr=1e30",
            "trainer.nonfinite=skip",
        )


@pytest.mark.slow
def test_every_preset_in_a_sweep_of_2_rank_jobs(tmp_path):
    """All presets under torchrun (2 ranks each) and in one sweep: each job completes, trains
    its preset's steps, and writes its preset's files."""
    sweep_dir = tmp_path / "sweep"
    proc = run(
        train_cmd(
            "-m",
            "debug=fast_dev_run,overfit,profile,anomaly",
            "dist.nproc_per_node=2",
            "hydra.launcher.max_parallel=2",  # two jobs at a time: each job's files its own
            "wandb.mode=disabled",
            "trainer.max_epochs=1",
            "trainer.progress_bar=false",
            f"hydra.sweep.dir={sweep_dir}",
        ),
        timeout=900,
    )
    assert proc.returncode == 0, output(proc)[-4000:]
    jobs = {d.name: d for d in sweep_dir.iterdir() if d.name.isdigit()}
    steps = {}
    for d in jobs.values():
        overrides = (d / ".hydra" / "overrides.yaml").read_text()
        preset = re.search(r"debug=(\w+)", overrides).group(1)
        assert assert_result_schema(d)["status"] == "completed", d
        steps[preset] = [r["step"] for r in train_rows(d)]
    assert steps["fast_dev_run"] == [1, 2, 3]
    assert steps["overfit"] == [2] and steps["anomaly"][-1] == 20 and steps["profile"][-1] == 12
    (profile_job,) = [
        d for d in jobs.values() if "debug=profile" in (d / ".hydra" / "overrides.yaml").read_text()
    ]
    assert json.loads((profile_job / "profile" / "trace.json").read_text())["traceEvents"]


# ------------------------------------------------------------------------------ records


def test_every_step_is_in_metrics_jsonl_with_its_time(tmp_path):
    """A 1-epoch run of 5 steps (batch 256) logs its partial window; every row has time and
    elapsed_s; the windows cover every step once."""
    run_dir = tmp_path / "r"
    train_in_process(
        run_dir,
        *QUICK,
        "wandb.mode=disabled",
        "trainer.batch_size=256",
        "trainer.max_epochs=2",
        "trainer.log_every_n_steps=2",
    )
    # 1437 // 256 = 5 steps an epoch: windows end every 2nd step and at each epoch's end
    assert [r["step"] for r in train_rows(run_dir)] == [2, 4, 5, 6, 8, 10]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(r["time"] > 1.7e9 and r["elapsed_s"] >= 0 for r in rows)
    assert [r["elapsed_s"] for r in rows] == sorted(r["elapsed_s"] for r in rows)


def test_result_json_has_one_schema_for_completed_and_failed_runs(tmp_path):
    train_in_process(tmp_path / "ok", *QUICK, "wandb.mode=disabled")
    ok = assert_result_schema(tmp_path / "ok")
    assert ok["status"] == "completed" and ok["error"] is None and ok["value_epoch"] == 1
    assert (
        ok["app"]["best_checkpoint"] == "checkpoints/best.pt"
        and ok["app"]["test"]["test/count"] == 180
    )
    # a user error the run meets once started (one the gate sees leaves no record at all)
    missing = f"dataset.root={tmp_path / 'nowhere'}"
    with pytest.raises(UserError):
        train_in_process(
            tmp_path / "bad", *QUICK, "wandb.mode=disabled", "dataset=imagefolder", missing
        )
    bad = assert_result_schema(tmp_path / "bad")
    assert bad["status"] == "failed" and "nowhere" in bad["error"]
    assert bad.keys() == ok.keys()


def test_a_resume_with_another_length_says_what_happens_to_the_schedule(tmp_path, caplog):
    run_dir = tmp_path / "r"
    common = ["wandb.mode=disabled", "trainer.log_every_n_steps=100"]
    train_in_process(run_dir, *common, "trainer.max_epochs=2")
    with caplog.at_level(logging.WARNING, logger="train"):
        train_in_process(run_dir, *common, "trainer.max_epochs=4", "resume=auto")
    (line,) = [r.getMessage() for r in caplog.records if "planned" in r.getMessage()]
    assert line.startswith(
        "trainer.max_epochs=4, but the checkpoint's run planned 2: the "
        "cosine schedule now spans 4 epochs"
    )
    assert re.search(r"the lr goes from 0(\.0+)? to [0-9.e-]+ at step 44", line), line
    assert [v["epoch"] for v in val_rows(run_dir)] == [1, 2, 3, 4]


def test_without_a_tty_progress_is_a_plain_line(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="train"):
        train_in_process(
            tmp_path / "r", *QUICK, "wandb.mode=disabled", "trainer.progress_every_s=1e-9"
        )
    lines = [r.getMessage() for r in caplog.records if ": step " in r.getMessage()]
    assert len(lines) >= 20 and re.fullmatch(
        r"epoch 1/1: step \d+/22(, train/loss [0-9.e-]+, \d+ samples/s)?, epoch ends in .+",
        lines[-1],
    )
    epoch = [r.getMessage() for r in caplog.records if r.getMessage().startswith("epoch 1/1: tr")]
    assert len(epoch) == 1 and "val/acc" in epoch[0] and "best val/acc" in epoch[0]


# ------------------------------------------------------------------------------ the console


# The default job's console: tests/test_train.py's test_the_default_job. A sweep's (a line
# per job, then the table): launch/tests/test_launcher.py's test_sweep_console, on its 2x2 sweep.


# ------------------------------------------------------------------------------ bad input


def test_the_docs_list_every_bad_input_the_tests_check():
    """docs/debugging.md's "Bad input" section and tests/test_train.py's BAD_INPUTS table agree."""
    from tests.test_train import BAD_INPUTS

    page = (REPO / "docs" / "debugging.md").read_text()
    section = page[page.index("## Bad input") :]
    section = section[: section.index("\n## ", 1)] if "\n## " in section[1:] else section
    for overrides, _ in BAD_INPUTS:
        # (a path in this checkout is listed by its path in the repo: README.md)
        overrides = [o.replace(f"{REPO}/", "") for o in overrides]
        assert all(f"`{o}`" in section or o in section for o in overrides), overrides
