"""Continuing another run and fine-tuning from it (issue 65, item 5), with the commands
docs/fault-tolerance.md shows, run as written (from a scratch dir, so that outputs/ is its own)
with a short schedule added: `resume=<another run's checkpoint>` into a new dir continues that
run's training state and completes with its own best.pt and test metrics, saying which run it
continues, also when no epoch it trains beats that run's best (it ended "best.pt does not
exist", exit 2); `init_from=<checkpoint>` starts a new run from its weights alone.
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, output, read_json, run, val_rows
from tests.test_gate_faults import tree

DOC = REPO / "docs" / "fault-tolerance.md"
SHORT = ["trainer.max_epochs=2", "wandb.mode=disabled", "trainer.progress_bar=false"]


def record(run_dir: Path) -> dict:
    """result.json's fields, whoever owns them: one flat mapping, or the launcher's part with
    the app's (`app`) beside it (its best epoch: `value_epoch`)."""
    data = read_json(run_dir / "result.json")
    flat = {**data, **(data.get("app") or {})}
    flat.setdefault("best_epoch", data.get("value_epoch"))
    return flat


def documented(fragment: str) -> list[str]:
    """The command of docs/fault-tolerance.md that contains `fragment`, as its words (its
    trailing comment dropped)."""
    found = [
        line for line in DOC.read_text().splitlines()
        if line.startswith("python train.py") and fragment in line
    ]  # fmt: skip
    assert len(found) == 1, (fragment, found)
    return shlex.split(found[0], comments=True)


def run_documented(words: list[str], cwd: Path, *extra: str):
    """`python train.py ...` as documented, from `cwd`, with `extra` overrides (a key given
    twice: its last value)."""
    assert words[:2] == ["python", "train.py"], words
    overrides = {w.partition("=")[0]: w for w in [*words[2:], *extra]}
    cmd = [sys.executable, str(REPO / "train.py"), *overrides.values()]
    return run(cmd, cwd=cwd, timeout=600)


@pytest.mark.slow
def test_the_documented_continue_and_fine_tune_commands_complete(tmp_path: Path) -> None:
    """A 2-epoch run (the docs' first command); the docs' `resume=.../best.pt` into
    outputs/finetune at the same max_epochs (nothing left to train: best.pt and the test must
    come from the run it continues), then once more with a third epoch; the docs' `init_from=`
    command: its weights, a new count of epochs from 1; each completes with its best.pt and
    test metrics. A model that does not fit, and init_from with resume=<file>, are one line."""
    source = run_documented(
        documented("outputs/my-run trainer.checkpoint_every_n_steps"), tmp_path, *SHORT
    )
    assert source.returncode == 0, output(source)[-3000:]
    my_run = tmp_path / "outputs" / "my-run"
    first = record(my_run)
    assert first["status"] == "completed" and first["epochs"] == 2
    untouched = tree(my_run)

    cont = documented("resume=outputs/my-run/checkpoints/best.pt")
    proc = run_documented(cont, tmp_path, *SHORT)
    out = output(proc)
    assert proc.returncode == 0, out[-3000:]
    line = next(x for x in out.splitlines() if "continues run" in x)
    assert re.search(r"resume=outputs/my-run/checkpoints/best.pt continues run \S*my-run ", line)
    finetune = tmp_path / "outputs" / "finetune"
    result = record(finetune)
    assert result["status"] == "completed", result
    assert result["best_epoch"] == first["best_epoch"] and result["test"], result
    assert result["test"] == first["test"]  # the same best.pt, tested again
    assert (finetune / "checkpoints" / "best.pt").is_file()

    further = tmp_path / "outputs" / "further"
    proc = run_documented(
        cont, tmp_path, *SHORT, "trainer.max_epochs=3", f"hydra.run.dir={further}"
    )
    assert proc.returncode == 0, output(proc)[-3000:]
    result = record(further)
    assert result["status"] == "completed" and result["epochs"] == 3 and result["test"], result
    assert [r["epoch"] for r in val_rows(further)] == [3]  # it trained epoch 3 alone

    tune = documented("init_from=outputs/my-run/checkpoints/best.pt")
    proc = run_documented(tune, tmp_path, *SHORT, "trainer.max_epochs=1")
    out = output(proc)
    assert proc.returncode == 0, out[-3000:]
    assert "init_from=outputs/my-run/checkpoints/best.pt: the weights of" in out, out[-3000:]
    tuned = tmp_path / "outputs" / "tuned"
    result = record(tuned)
    assert result["status"] == "completed" and result["epochs"] == 1 and result["test"], result
    (row,) = val_rows(tuned)
    assert row["epoch"] == 1 and row["val/acc"] > val_rows(my_run)[0]["val/acc"], row

    for extra, said in (
        (["model.hidden=64", "hydra.run.dir=outputs/other"], "holds another model"),
        (["resume=outputs/my-run/checkpoints/last.pt", "hydra.run.dir=outputs/x"], "both name"),
    ):
        proc = run_documented(tune, tmp_path, *SHORT, *extra)
        lines = [x for x in output(proc).splitlines() if x.strip()]
        assert proc.returncode == 2 and len(lines) == 1 and said in lines[0], output(proc)
    assert tree(my_run) == untouched  # read, never written
