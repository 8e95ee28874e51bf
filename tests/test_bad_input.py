"""Bad input that was not yet one line (issue 44's table), through the real entry points:
`python train.py ...`, `python train.py dist.nproc_per_node=2 ...` and `python train.py -m ...`.
Each case asserts the exit status (2: the user's to fix), at most 3 console lines, no traceback,
and that the line names the file or key and the fix."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from ddp_launcher.core.errors import UserError
from omegaconf import open_dict
from PIL import Image

from tests.helpers import (
    QUICK,
    REPO,
    composed_train_config,
    make_imagefolder,
    output,
    read_json,
    run,
    run_env,
    sigint_as_in_a_terminal,
    train_cmd,
    train_in_process,
    wait_for_rows,
)
from tests.test_records import one_line_error

# An image folder run whose only console lines are its end (explicit augment and no lr scaling:
# dataset=imagefolder announces the recipe it picks, optim.lr_scaling its scaled lr).
FOLDER = [
    "dataset=imagefolder",
    "dataset.image_size=32",
    "augment=shift",
    "optim.lr_scaling=none",
    "trainer.batch_size=4",
]


def jpeg_bytes() -> bytes:
    path = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 255, (30, 40, 3), dtype=np.uint8))
    target = path / f"bad-input-{id(rng)}.jpg"
    image.save(target)
    data = target.read_bytes()
    target.unlink()
    return data


# What each kind of unreadable file holds.
BAD_FILES = {
    "empty.png": lambda: b"",
    "truncated.jpg": lambda: jpeg_bytes()[:300],
    "corrupt.png": lambda: b"\x89PNG\r\n\x1a\n" + b"not an image" * 20,
    "text.jpg": lambda: b"hello, not a JPEG\n",
}


def folder_with(root: Path, *bad: str) -> list[Path]:
    """An image folder (3 classes, 8 train and 2 val images each) plus the `bad` files in
    train/cat/ (BAD_FILES); their paths."""
    make_imagefolder(root, {"train": 8, "val": 2})
    paths = []
    for name in bad:
        path = root / "train" / "cat" / name
        path.write_bytes(BAD_FILES[name]())
        paths.append(path)
    return paths


# ---------------------------------------------------------------------------------------------
# an ImageFolder with one unreadable image: its path and the fix, on 1 and 2 ranks


@pytest.mark.slow
@pytest.mark.parametrize(
    "name,nproc",
    [
        ("empty.png", 1),
        ("truncated.jpg", 1),
        ("corrupt.png", 1),
        ("text.jpg", 1),
        pytest.param("truncated.jpg", 2, marks=pytest.mark.slow),
        pytest.param("empty.png", 2, marks=pytest.mark.slow),
    ],
)
def test_an_unreadable_image_is_one_line_naming_it(tmp_path, name, nproc):
    (bad,) = folder_with(tmp_path / "data", name)
    run_dir = tmp_path / "run"
    ranks = [f"dist.nproc_per_node={nproc}"] if nproc > 1 else []
    cmd = train_cmd(*QUICK, *FOLDER, f"dataset.root={tmp_path / 'data'}", *ranks)
    proc = run([*cmd, f"hydra.run.dir={run_dir}"], timeout=300)
    # On 2 ranks the launcher's line that the job started is not counted (a 1-rank run has
    # none): the rank that did not read the file says it stopped because another failed.
    started = (f": {nproc} rank(s)",)
    one_line_error(
        proc, str(bad), "remove or replace it", "skip_unreadable=true", not_counted=started
    )
    error = read_json(run_dir / "result.json")["error"]
    assert str(bad) in error and "gloo" not in error and "Connection" not in error, error


@pytest.mark.slow
def test_skip_unreadable_leaves_the_bad_images_out_in_one_warning(tmp_path):
    """dataset.skip_unreadable=true: each kind of unreadable file is left out, counted in one
    warning; the run trains on the rest and completes."""
    bad = folder_with(tmp_path / "data", *BAD_FILES)
    run_dir = tmp_path / "run"
    cmd = train_cmd(*QUICK, *FOLDER, f"dataset.root={tmp_path / 'data'}")
    proc = run([*cmd, "dataset.skip_unreadable=true", f"hydra.run.dir={run_dir}"])
    out = output(proc)
    assert proc.returncode == 0, out[-3000:]
    warnings = [line for line in out.splitlines() if "unreadable image(s)" in line]
    assert len(warnings) == 1 and f"left out {len(bad)} unreadable image(s)" in warnings[0], out
    assert read_json(run_dir / "result.json")["status"] == "completed"


# ---------------------------------------------------------------------------------------------
# a run's own bad input: the file or key named, on every way of starting the run


@pytest.mark.slow
def test_an_empty_class_folder_is_named(tmp_path):
    make_imagefolder(tmp_path / "data", {"train": 4, "val": 2})
    for image in (tmp_path / "data" / "train" / "emu").iterdir():
        image.unlink()
    cmd = train_cmd(*QUICK, *FOLDER, f"dataset.root={tmp_path / 'data'}")
    proc = run([*cmd, f"hydra.run.dir={tmp_path / 'run'}"])
    one_line_error(proc, "train/emu", "holds no image")


@pytest.mark.parametrize(
    "nproc", [1, pytest.param(2, marks=pytest.mark.slow)], ids=["1-rank", "2-ranks"]
)
def test_a_run_dir_that_cannot_be_written_is_one_line(tmp_path, nproc):
    (tmp_path / "a-file").write_text("")
    run_dir = tmp_path / "a-file" / "run"  # under a file: no dir can be made there
    ranks = [f"dist.nproc_per_node={nproc}"] if nproc > 1 else []
    proc = run(train_cmd(*QUICK, *ranks, f"hydra.run.dir={run_dir}"))
    one_line_error(proc, f"hydra.run.dir={run_dir} cannot be written", "writable")


@pytest.mark.slow
def test_a_run_dir_through_a_symlink_loop_is_one_line_naming_the_fix(tmp_path):
    """A run dir that is (or lies under) a link loop was the gate's catch-all line, a
    RuntimeError with "rerun with HYDRA_FULL_ERROR=1", naming no fix."""
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    for run_dir in (tmp_path / "a", tmp_path / "a" / "run"):
        proc = run(train_cmd(*QUICK, f"hydra.run.dir={run_dir}"))
        one_line_error(proc, f"hydra.run.dir={run_dir} cannot be written", "a loop", "writable")


@pytest.mark.parametrize(
    "entry",
    [
        ["train.py", "experiment=broken"],
        ["train.py", "-m", "experiment=broken"],
        ["eval.py", "+experiment=broken"],  # (eval.py's config has no experiment default)
        pytest.param(
            ["train.py", "dist.nproc_per_node=2", "experiment=broken"], marks=pytest.mark.slow
        ),
    ],
    ids=["run", "sweep", "eval", "2-ranks"],
)
def test_a_yaml_syntax_error_in_a_config_is_one_line_naming_the_file(tmp_path, entry):
    bad = tmp_path / "conf" / "experiment" / "broken.yaml"
    bad.parent.mkdir(parents=True)
    bad.write_text("trainer:\n  max_epochs: [1\n")
    script, *rest = entry
    dirs = [f"hydra.run.dir={tmp_path / 'run'}", f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    cmd = train_cmd("--config-dir", str(tmp_path / "conf"), *rest, *dirs)
    proc = run([*cmd[:1], script, *cmd[2:]])
    one_line_error(proc, f"config file {bad}, line 3 is not valid YAML", "fix the file")


# ---------------------------------------------------------------------------------------------
# a sweep's bad input: the launcher's and the sweeper's keys

SWEEP_BAD_INPUT = [
    (["hydra.launcher.max_parallel=0"], ["hydra.launcher.max_parallel=0", ">= 1"]),
    (["hydra.launcher.max_parallel=-3"], ["hydra.launcher.max_parallel=-3", ">= 1"]),
    (["hydra.launcher.retries=-1"], ["hydra.launcher.retries=-1", "0 (no retry) or more"]),
    # the elastic agent's own keys: each job's agent raised on them (a traceback, then
    # "see rank_logs", which was empty), took a negative restart count without a word, or
    # started every job to fail it on the launcher's world size
    (["hydra.launcher.tee=9"], ["hydra.launcher.tee=9", "hydra.launcher.tee=0:3"]),
    (["hydra.launcher.monitor_interval=0"], ["hydra.launcher.monitor_interval=0", "> 0"]),
    (["hydra.launcher.max_restarts=-3"], ["hydra.launcher.max_restarts=-3", "0 (no restart)"]),
    (["hydra.launcher.nproc_per_node=0"], ["hydra.launcher.nproc_per_node=0 is not valid"]),
    (["hydra.launcher.nnodes=0"], ["hydra.launcher.nnodes=0 is not valid"]),
    (
        ["hydra.sweep.dir={tmp}/a-file/sweep"],
        ["hydra.sweep.dir={tmp}/a-file/sweep cannot be written"],
    ),
    (
        ["hparams_search=digits_optuna", "hydra.sweeper.storage=sqlite:///{tmp}/no-dir/s.db"],
        ["hydra.sweeper.storage", "{tmp}/no-dir/s.db", "make its directory"],
    ),
    (
        ["hparams_search=digits_optuna", "hydra.sweeper.storage=journal:{tmp}/no-dir/s.log"],
        ["hydra.sweeper.storage", "{tmp}/no-dir/s.log", "make its directory"],
    ),
    (
        ["hparams_search=digits_optuna", "hydra.sweeper.storage=postgresql://u:pw@localhost/db"],
        ["hydra.sweeper.storage", "postgresql://u:***@localhost/db", "driver"],
    ),
    # issue 55: n_trials 0 or -1 ran no trial and exited 0; a pruner argument out of its range
    # and a key of hydra.sweeper.params set on its own were tracebacks
    (
        ["hparams_search=digits_optuna", "hydra.sweeper.n_trials=0"],
        ["hydra.sweeper.n_trials=0", "at least 1"],
    ),
    (
        ["hparams_search=digits_optuna", "hydra.sweeper.n_trials=-1"],
        ["hydra.sweeper.n_trials=-1", "at least 1"],
    ),
    (
        [
            "hparams_search=digits_optuna",
            "hydra.sweeper.pruner={{type: median, n_warmup_steps: -1}}",
        ],
        ["hydra.sweeper.pruner: median", "cannot be negative", "n_warmup_steps=-1"],
    ),
    (
        ["hparams_search=digits_optuna", "hydra.sweeper.params.optim.lr=interval(0.1, 1)"],
        ["hydra.sweeper.params.optim.lr", "'optim.lr=interval(0.1, 1)'", "conf/hparams_search/"],
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize("overrides,fragments", SWEEP_BAD_INPUT)
def test_bad_sweep_input_is_one_line_naming_the_key(tmp_path, overrides, fragments):
    if any("postgresql" in o for o in overrides):
        pytest.importorskip("optuna")
        if any(_importable(m) for m in ("psycopg2", "psycopg", "pg8000")):
            pytest.skip("a PostgreSQL driver is installed: the URL's driver is not missing")
    (tmp_path / "a-file").write_text("")
    overrides = [o.format(tmp=tmp_path) for o in overrides]
    if not any(o.startswith("hydra.sweep.dir=") for o in overrides):
        overrides.append(f"hydra.sweep.dir={tmp_path / 'sweep'}")
    proc = _sweep(overrides)
    one_line_error(proc, *(f.format(tmp=tmp_path) for f in fragments))
    assert "pw@" not in output(proc)  # a URL's password stays out of the console


@pytest.mark.slow
def test_resume_where_no_sweep_ran_says_it_starts_a_new_one(tmp_path):
    """hydra.launcher.resume=true also starts a sweep resumable (docs/fault-tolerance.md): on a
    sweep dir without earlier jobs (a new one, or a mistyped one) it says so, where it said
    "(resuming)"."""
    proc = _sweep(["hydra.launcher.resume=true", f"hydra.sweep.dir={tmp_path / 'typo'}"])
    out = output(proc)
    assert proc.returncode == 0, out[-3000:]
    assert "(resuming)" not in out and "no earlier jobs there, a new sweep" in out, out
    proc = _sweep(["hydra.launcher.resume=true", f"hydra.sweep.dir={tmp_path / 'typo'}"])
    assert "(resuming)" in output(proc) and "completed earlier, not run again" in output(proc)


@pytest.mark.slow
def test_an_agent_that_fails_before_any_rank_is_named_with_its_log(tmp_path):
    """A job whose torchrun agent fails before a rank starts (here its rendezvous store cannot
    be reached) fails with the agent's error and its log, not "see <job>/rank_logs" (which no
    rank wrote into)."""
    proc = _sweep(
        [
            "hydra.launcher.rdzv_endpoint=notahost",
            "hydra.launcher.rdzv_conf={timeout: 3, join_timeout: 3, read_timeout: 3}",
            f"hydra.sweep.dir={tmp_path / 'sweep'}",
        ]
    )
    error = read_json(tmp_path / "sweep" / "0" / "result.json")["error"]
    assert proc.returncode == 1 and "rank_logs" not in error, output(proc)[-3000:]
    assert "RendezvousConnectionError" in error and "agent.log" in error, error


def _sweep(overrides: list[str]):
    optuna = ["hydra.sweeper.n_trials=1"] if "hparams_search=digits_optuna" in overrides else []
    return run(train_cmd("-m", *QUICK, *optuna, *overrides), timeout=300)


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


# ---------------------------------------------------------------------------------------------
# Ctrl-C of a 2-rank run


@pytest.mark.slow
def test_ctrl_c_of_a_two_rank_run_is_recorded_as_interrupted(tmp_path):
    """SIGINT to the launcher of `python train.py dist.nproc_per_node=2` (Ctrl-C in its
    terminal): the ranks stop at a checkpoint, and the run is recorded `interrupted` (it was
    stopped by its user, not preempted), with resume=auto as the way on: not the sweep's
    hydra.launcher.resume=true."""
    run_dir = tmp_path / "run"
    cmd = train_cmd(
        "trainer.max_epochs=50",
        "wandb.mode=disabled",
        "trainer.progress_bar=false",
        "trainer.log_every_n_steps=2",
        "dist.nproc_per_node=2",
        f"hydra.run.dir={run_dir}",
    )
    launcher = subprocess.Popen(
        cmd,
        env=run_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=sigint_as_in_a_terminal,
    )
    try:
        wait_for_rows(run_dir / "metrics.jsonl", 3, launcher)
        launcher.send_signal(signal.SIGINT)
        out, _ = launcher.communicate(timeout=120)
    finally:
        launcher.kill()
        launcher.wait()
    assert launcher.returncode == 130, out[-3000:]
    assert "Traceback" not in out and "hydra.launcher.resume=true" not in out, out[-3000:]
    result = read_json(run_dir / "result.json")
    assert result["status"] == "interrupted", result
    assert result["error"].startswith("interrupted (Ctrl-C)") and "resume=auto" in result["error"]


# ---------------------------------------------------------------------------------------------
# plain `torchrun --nproc_per_node=2 train.py`: torch's agent reports the failure and exits 1
# with its own ChildFailedError traceback (torch/distributed/run.py's main re-raises it; no rank
# can change that). What train.py controls: rank 0 says the one line and exits 2, and no rank
# gives another reason (rank 1 said "already holds a failed run" when it read the result.json
# that rank 0 had just written for this same run).


@pytest.mark.slow
@pytest.mark.parametrize(
    "bad", ["trainer.batch_size=0", "trainer.max_epochs=-1", "trainer.label_smoothing=1.5"]
)
def test_a_user_error_under_plain_torchrun_is_rank_0s_one_line(tmp_path, bad):
    proc = run(train_cmd(*QUICK, bad, f"hydra.run.dir={tmp_path / 'r'}", nproc=2), timeout=300)
    out = output(proc)
    said = [line for line in out.splitlines() if bad in line and "ERROR" in line]
    rank_0 = [line.partition("[ERROR] - ")[2] for line in said if not line.startswith("[rank")]
    assert rank_0 and all(line.endswith(rank_0[0]) for line in said), out[-3000:]
    assert "exitcode  : 2" in out.partition("Root Cause")[2], out[-3000:]
    assert out.count("Traceback") == 1, out[-3000:]  # torchrun's own, no rank's
    for other in ("already holds", "not divisible", "Connection closed"):
        assert other not in out, (other, out[-3000:])


# ---------------------------------------------------------------------------------------------
# issue 55: values nothing checked, refused in one line naming the key and what it allows


@pytest.mark.parametrize("value", ["1.5", "1.0", "-0.1", "nan", "inf"])
def test_label_smoothing_outside_0_to_1_is_refused(tmp_path, value):
    """1.5 was F.cross_entropy's traceback; -0.1 and nan trained as 0 without a word."""
    with pytest.raises(UserError) as caught:
        train_in_process(tmp_path / "r", *QUICK, f"trainer.label_smoothing={value}")
    message = str(caught.value)
    assert message.startswith(f"trainer.label_smoothing={float(value)} is not valid"), message
    assert ">= 0 and < 1" in message


@pytest.mark.parametrize(
    "added, fragments",
    [
        (
            "+trainer.max_epoch=1",
            ["trainer.max_epoch is not a key of trainer", "trainer.max_epochs?"],
        ),
        ("+trainer.mixup.alpha=0.2", ["trainer.mixup.alpha is not", "trainer.mixup.mixup_alpha?"]),
        ("+seeed=1", ["seeed is not a key of the config", "did you mean seed?"]),
        ("+dataset.skip_unreadable=true", ["dataset.skip_unreadable is not a key of dataset"]),
        ("+optim.dampning=0.1", ["optim.dampning is not a key of optim", "optim.dampening?"]),
    ],
)
def test_a_key_a_schema_does_not_define_is_refused(tmp_path, added, fragments):
    """Hydra lets `+key=value` add a key to a typed node (the form its own error suggests for
    a misspelt key), which nothing then reads: the nearest real key is named."""
    with pytest.raises(UserError) as caught:
        train_in_process(tmp_path / "r", *QUICK, added)
    assert all(f in str(caught.value) for f in fragments), str(caught.value)


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["experiment=cifar10_resnet18"],
        ["experiment=digits_quick"],
        ["hparams_search=digits_optuna"],
        ["dataset=imagefolder", "dataset.root=/data", "augment=trivial_augment"],
        ["dataset=imagenet", "model=vit_b_16", "optim=adamw", "augment=rand_augment"],
        ["dataset=mnist", "optim=nadam", "augment=auto_augment"],
        ["dataset=fashion_mnist", "optim=adafactor"],
        ["dataset=cifar100", "model=convnext_tiny", "debug=profile"],
        ["dataset=fake", "debug=overfit", "+trainer.ema.decay=0.99"],
        ["+optim.dampening=0.1"],  # an argument of the optimizer (torch.optim.SGD)
        ["optim=adamw", "+optim.amsgrad=true"],
    ],
)
def test_the_shipped_configs_define_every_key_they_set(overrides):
    from conf.schema import check_keys

    check_keys(task_config(*overrides))


def task_config(*overrides: str):
    """train.py's config as its task gets it (no `hydra` node)."""
    cfg = composed_train_config(*overrides)
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg


def test_a_gpu_listed_twice_is_refused():
    """hydra.launcher.gpus=[0,0] gave two jobs one GPU."""
    from ddp_launcher.torchrun import TorchrunBackend, TorchrunLauncherConf

    with pytest.raises(UserError, match=r"hydra.launcher.gpus=\[0, 0\] names a GPU twice"):
        TorchrunBackend(TorchrunLauncherConf(gpus=[0, 0]), gpu_ids=["0", "1"], cores=[0, 1])
    backend = TorchrunBackend(TorchrunLauncherConf(gpus=[1, 0]), gpu_ids=["0", "1"], cores=[0])
    assert sorted(backend.gpus) == [0, 1]


@pytest.mark.slow
@pytest.mark.parametrize(
    "bad, fragments",
    [
        ("trainer.label_smoothing=1.5", ["trainer.label_smoothing=1.5 is not valid", "< 1"]),
        ("+trainer.max_epoch=1", ["trainer.max_epoch is not a key", "trainer.max_epochs?"]),
        ("+dataset.skip_unreadable=true", ["dataset.skip_unreadable is not a key of dataset"]),
    ],
)
def test_an_unchecked_value_is_one_line_from_train_py(tmp_path, bad, fragments):
    """Through the entry point: a 27-line traceback, a key ignored (exit 0), a 38-line
    traceback; now one line and exit 2."""
    proc = run(train_cmd(*QUICK, bad, f"hydra.run.dir={tmp_path / 'r'}"), timeout=300)
    one_line_error(proc, *fragments)


# ---------------------------------------------------------------------------------------------
# Ctrl-C in the first seconds: in the imports, Hydra's composition, `import torch`, the task's
# start. Each delay counts from the process's first import of yaml's C extension (Hydra's
# configs need it): the interpreter's own start comes before anything of the project runs.


def wait_for_the_project_to_run(proc: subprocess.Popen, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            if "/yaml/_yaml" in Path(f"/proc/{proc.pid}/maps").read_text():
                return
        except OSError:
            pass
        time.sleep(0.002)


def ctrl_c_at(delay: float, cmd: list[str]) -> tuple[subprocess.Popen, str, bool]:
    """`cmd` Ctrl-C'd `delay` s after it began its own imports: (its process, its output,
    whether it was still running when the signal was sent)."""
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=run_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=sigint_as_in_a_terminal,
    )
    try:
        wait_for_the_project_to_run(proc)
        time.sleep(delay)
        running = proc.poll() is None
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=180)
    finally:
        proc.kill()
        proc.wait()
    return proc, out, running


CTRL_C_DELAYS = (0.0, 0.1, 0.25, 0.5, 0.8, 1.2, 1.8, 2.6)


def test_a_ctrl_c_after_the_start_has_ended_keeps_its_exit_status():
    """A Ctrl-C that comes while a refused start's exit unwinds out of its main block (after
    the one line was said) leaves exit status 2, not a KeyboardInterrupt's death by SIGINT."""
    code = (
        "import os, signal, time\n"
        "from ddp_launcher.ranks.interrupt import ctrl_c_exits\n"
        "try:\n"
        "    with ctrl_c_exits():\n"
        "        raise SystemExit(2)\n"
        "finally:\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    time.sleep(0.2)\n"
    )
    proc = run([sys.executable, "-c", code], timeout=60)
    assert proc.returncode == 2, output(proc)


@pytest.mark.slow
def test_ctrl_c_in_the_first_seconds_is_interrupted(tmp_path):
    """Issue 55: a traceback (exit 1 or killed by SIGINT), OmegaConf's error (exit 1) or a C++
    abort from inside `import torch` (exit -6), depending on the moment. Now at every moment
    of the start: the one line and exit 130 (the run trains for 50 epochs: never done first)."""
    for delay in CTRL_C_DELAYS:
        cmd = train_cmd(
            "trainer.max_epochs=50",
            "wandb.mode=disabled",
            "trainer.progress_bar=false",
            f"hydra.run.dir={tmp_path / str(delay)}",
        )
        proc, out, _ = ctrl_c_at(delay, cmd)
        assert proc.returncode == 130, (delay, out[-3000:])
        assert "Traceback" not in out and "interrupted (Ctrl-C)" in out, (delay, out[-3000:])
        lines = [line for line in out.splitlines() if "[INFO]" not in line]
        assert lines == [
            "interrupted (Ctrl-C): rerun with resume=auto to continue from the last checkpoint"
        ], (delay, out[-3000:])


@pytest.mark.slow
def test_ctrl_c_before_a_sweep_starts_its_jobs_is_interrupted(tmp_path):
    """The same before a sweep's launcher runs (from then on its own handler stops the jobs
    and says how to resume: launch/tests/test_resume.py)."""
    for delay in CTRL_C_DELAYS[:4]:
        sweep_dir = tmp_path / str(delay)
        cmd = train_cmd("-m", *QUICK, "optim.lr=0.1,0.2", f"hydra.sweep.dir={sweep_dir}")
        proc, out, _ = ctrl_c_at(delay, cmd)
        assert proc.returncode == 130 and "Traceback" not in out, (delay, out[-3000:])
        assert out.strip().splitlines() == [
            "interrupted (Ctrl-C): rerun with hydra.launcher.resume=true to continue the sweep"
        ], (delay, out[-3000:])


@pytest.mark.slow
def test_an_interrupted_start_leaves_the_run_dir_as_it_was(tmp_path):
    """Ctrl-C while a start into a dir holding a completed run is being refused: whatever the
    moment, the run's records keep their bytes (train.log only grows)."""
    run_dir = tmp_path / "r"
    first = run(train_cmd(*QUICK, f"hydra.run.dir={run_dir}"), timeout=300)
    assert first.returncode == 0, output(first)[-3000:]
    kept = {
        path: path.read_bytes()
        for path in sorted(run_dir.rglob("*"))
        if path.is_file() and ".hydra" not in path.parts and path.name != "train.log"
    }
    log = (run_dir / "train.log").read_bytes()
    for delay in CTRL_C_DELAYS[:5]:
        proc, out, running = ctrl_c_at(delay, train_cmd(*QUICK, f"hydra.run.dir={run_dir}"))
        assert "Traceback" not in out, (delay, out[-3000:])
        # A start refused before the signal came: exit 2, as a start that is not interrupted.
        # A process still running may have said its refusal already (it is on its way out).
        refused = proc.returncode == 2 and "start_over=true" in out
        assert refused or (running and proc.returncode == 130), (delay, out[-3000:])
        assert {p: p.read_bytes() for p in kept} == kept, delay
        assert (run_dir / "train.log").read_bytes().startswith(log), delay
