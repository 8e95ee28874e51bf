"""The gate fails closed (issue 65, items 1 and 2): every step of a start that writes into its
run dir (the dir, the lock, the set-aside, launch.json, `.hydra/`, the log) runs inside one
guard, so that any error there, of any type, is one line and exit 2, and the dir is
byte-identical after it (undone where the start had changed it); and the lock is only a lock.

The fault matrix runs in this process: RunGate.on_run_start, as Hydra calls it, with an OS
error injected (tests/os_faults.py) at each guarded step; a handful of cases run
`python train.py` for real, with the error injected by a sitecustomize.

    step (where the error strikes)        fresh dir  start_over on a completed run
    the run dir (mkdir)                      x
    the lock (.run.lock)                     x            x
    the set-aside: replaced/<time>                        x
    the set-aside: a move, mid-way                        x
    the launch record (launch.json)          x            x
    .hydra/ (mkdir)                          x            x
    .hydra/hydra.yaml (after config.yaml)    x            x
    the log (train.log)                      x            x
  x  errors: OSError (EIO), ENOSPC, EACCES, NotADirectoryError (ENOTDIR)

and a directory or a symlink in place of each file the start writes (a file or a symlink in
place of each dir it makes).
"""

from __future__ import annotations

import copy
import errno
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from ddp_launcher.core import gate as gate_module
from ddp_launcher.core import run_lock
from ddp_launcher.core.errors import UserError
from omegaconf import open_dict, read_write

from tests.helpers import QUICK, REPO, compose, output, read_json, run, run_env, train_cmd
from tests.os_faults import failing

LOCK = ".run.lock"


# ---------------------------------------------------------------------------------------------
# helpers


def tree(root: Path) -> dict[str, tuple]:
    """Everything under `root`: each file by its SHA-256, each dir, each symlink by its target
    (links are not followed)."""
    found: dict[str, tuple] = {}
    for here, dirs, files in os.walk(root, followlinks=False):
        for name in dirs + files:
            path = Path(here) / name
            rel = str(path.relative_to(root))
            if path.is_symlink():
                found[rel] = ("link", os.readlink(path))
            elif path.is_dir():
                found[rel] = ("dir",)
            else:
                found[rel] = ("file", hashlib.sha256(path.read_bytes()).hexdigest())
    return found


def completed_records(run_dir: Path) -> None:
    """What a completed 1-epoch run leaves (no training: the gate reads only these)."""
    (run_dir / ".hydra").mkdir(parents=True)
    for name in ("config.yaml", "hydra.yaml", "overrides.yaml"):
        (run_dir / ".hydra" / name).write_text(f"# the earlier run's {name}\n")
    (run_dir / "train.log").write_text("[train][INFO] - completed in 1.0 s\n")
    rows = [{"step": 2, "train/loss": 2.0}, {"step": 22, "epoch": 1, "val/acc": 0.5}]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = {"status": "completed", "epochs": 1, "best": 0.5, "best_epoch": 1}
    (run_dir / "result.json").write_text(json.dumps(result))
    (run_dir / "checkpoints").mkdir()
    (run_dir / "checkpoints" / "step-00000022.pt").write_bytes(b"weights" * 100)
    record = {"job_num": 0, "overrides": [], "attempts": [{"attempt": 1, "started": 1.0}]}
    (run_dir / "launch.json").write_text(json.dumps(record))


@functools.cache
def _config(*overrides: str):
    return compose("train", Path("/unused"), *QUICK, *overrides)


def config_for(run_dir: Path, *overrides: str):
    """train.py's composed config (hydra node included) for a start in `run_dir`."""
    cfg = copy.deepcopy(_config(*overrides))
    with read_write(cfg), open_dict(cfg):
        cfg.hydra.run.dir = str(run_dir)
        cfg.hydra.runtime.output_dir = str(run_dir)
    return cfg


def run_gate(cfg):
    """The RunGate Hydra instantiates from the config's hydra.callbacks."""
    from hydra.utils import instantiate

    return instantiate(cfg.hydra.callbacks.run_gate)


@pytest.fixture
def gate_lines(monkeypatch, caplog):
    """The gate's console lines in this process (its logging setup is Hydra's job's; here the
    records are caught as they are logged), and a fixed code state (no git process per run
    dir: drift is not what these tests check)."""
    monkeypatch.setattr(gate_module, "console_logging", lambda config: None)
    monkeypatch.setattr("ddp_launcher.drift.code_state", lambda *where: {"commit": "c"})
    monkeypatch.setenv(run_lock.HELD_ENV, "")  # (a start sets it for its ranks: undone after)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    caplog.set_level(logging.INFO)
    return caplog


def refused(caplog, start, code: int = 2) -> str:
    """`start()` ends in SystemExit(code) with one line said at ERROR (and nothing else said
    at WARNING or above); that line."""
    caplog.clear()
    with pytest.raises(SystemExit) as exit_:
        start()
    said = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert exit_.value.code == code, [r.getMessage() for r in said]
    assert len(said) == 1 and said[0].levelno == logging.ERROR, [r.getMessage() for r in said]
    line = said[0].getMessage()
    assert "\n" not in line and "Traceback" not in line, line
    return line


def release_locks() -> None:
    for key in list(run_lock._HELD):
        run_lock.release(Path(key))


# ---------------------------------------------------------------------------------------------
# the fault matrix: an OS error at each guarded step


ERRORS = {
    "OSError": errno.EIO,
    "ENOSPC": errno.ENOSPC,
    "EACCES": errno.EACCES,
    "NotADirectoryError": errno.ENOTDIR,
}
# step -> the fault's op and glob (under the run dir R), and the plans it strikes in
STEPS = {
    "run dir": ("mkdir", "{R}", ("fresh",)),
    "lock": ("open", "{R}/.run.lock", ("fresh", "start_over")),
    "set-aside dir": ("mkdir", "{R}/replaced*", ("start_over",)),
    "set-aside move": ("replace", "{R}/replaced/*/result.json", ("start_over",)),
    "launch record": ("open", "{R}/*launch.json*", ("fresh", "start_over")),
    ".hydra mkdir": ("mkdir", "{R}/.hydra", ("fresh", "start_over")),
    ".hydra file": ("open", "{R}/.hydra/*hydra.yaml*", ("fresh", "start_over")),
    "log": ("open", "{R}/train.log", ("fresh", "start_over")),
}
MATRIX = [
    pytest.param(plan, step, error, id=f"{plan}-{step}-{error}")
    for plan in ("fresh", "start_over")
    for step, (_, _, plans) in STEPS.items()
    if plan in plans
    for error in ERRORS
]


@pytest.mark.parametrize(("plan", "step", "error"), MATRIX)
def test_an_error_at_any_guarded_step_refuses_and_leaves_the_dir_as_it_was(
    tmp_path: Path, gate_lines, plan: str, step: str, error: str
) -> None:
    """Exit 2, one line naming the step's cause and a fix, and every file, dir and link under
    the run dir's parent as before (a fresh dir: not there at all); the start that follows
    without the fault goes through, so the undo left nothing in its way."""
    run_dir = tmp_path / "R"
    overrides = ("start_over=true",) if plan == "start_over" else ()
    if plan == "start_over":
        completed_records(run_dir)
    cfg = config_for(run_dir, *overrides)
    before = tree(tmp_path)
    op, glob, _ = STEPS[step]
    code = ERRORS[error]
    with failing(f"{errno.errorcode[code]}@{op}@{glob.format(R=run_dir)}"):
        line = refused(gate_lines, lambda: run_gate(cfg).on_run_start(config=cfg))
    assert tree(tmp_path) == before, line
    assert os.strerror(code) in line and str(run_dir) in line, line
    assert "choose another output dir" in line or "move it away" in line, line
    assert not run_lock._HELD
    run_gate(cfg).on_run_start(config=cfg)  # nothing left in the way
    release_locks()
    assert (run_dir / ".hydra" / "hydra.yaml").is_file() and (run_dir / "train.log").is_file()
    if plan == "start_over":
        (aside,) = (run_dir / "replaced").iterdir()
        assert {"result.json", "metrics.jsonl", "train.log"} <= {p.name for p in aside.iterdir()}


@pytest.mark.parametrize("error", [ValueError("a bug in a hook"), KeyboardInterrupt()])
def test_any_exception_in_a_guarded_step_is_undone(
    tmp_path: Path, gate_lines, monkeypatch, error: BaseException
) -> None:
    """Not only OS errors: an exception of any type in a guarded step (here the app's
    attempts record, after the set-aside) is undone; any other error is one line and exit 2,
    never Hydra's warning; Ctrl-C is undone and goes on as Ctrl-C."""
    from ddp_launcher.resume import RunAttempts

    run_dir = tmp_path / "R"
    completed_records(run_dir)
    cfg = config_for(run_dir, "start_over=true")
    before = tree(tmp_path)

    def fails(*args, **kwargs):
        raise error

    monkeypatch.setattr(RunAttempts, "open", staticmethod(fails))
    if isinstance(error, KeyboardInterrupt):
        with pytest.raises(KeyboardInterrupt):
            run_gate(cfg).on_run_start(config=cfg)
    else:
        line = refused(gate_lines, lambda: run_gate(cfg).on_run_start(config=cfg))
        assert "ValueError: a bug in a hook" in line and "launch.json" in line, line
    assert tree(tmp_path) == before
    assert not run_lock._HELD


def test_a_run_dir_another_rank_makes_meanwhile_is_a_start_like_any_other(
    tmp_path: Path, gate_lines, monkeypatch
) -> None:
    """Under plain torchrun every rank's Hydra makes the run dir (its run_job, exist_ok) while
    rank 0's gate checks the start: a dir made between the gate's look and its mkdir goes
    through (it was "the start failed making the run dir: File exists", exit 2, on a 4-rank
    torchrun run); a file made there is refused as before, and left as it is."""
    mkdir = Path.mkdir
    peer: dict = {}

    def made_by_a_peer_first(self, *args, **kwargs):
        if self == peer.get("dir") and not os.path.lexists(self):
            peer["make"](self)
        return mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", made_by_a_peer_first)
    peer.update(dir=tmp_path / "R", make=os.mkdir)
    cfg = config_for(tmp_path / "R")
    run_gate(cfg).on_run_start(config=cfg)
    release_locks()
    assert (tmp_path / "R" / ".hydra" / "hydra.yaml").is_file()
    assert (tmp_path / "R" / "train.log").is_file()

    peer.update(dir=tmp_path / "S", make=lambda path: path.write_text("not a dir"))
    cfg = config_for(tmp_path / "S")
    line = refused(gate_lines, lambda: run_gate(cfg).on_run_start(config=cfg))
    assert "making the run dir" in line and os.strerror(errno.EEXIST) in line, line
    assert (tmp_path / "S").read_text() == "not a dir"
    assert not run_lock._HELD


def test_an_undo_that_fails_keeps_the_earlier_run_whole_and_says_where(
    tmp_path: Path, gate_lines
) -> None:
    """The log cannot be opened, and then the undo cannot move result.json back: the earlier
    run stays whole in replaced/<time>/ (every file as it was), and the one line says where."""
    run_dir = tmp_path / "R"
    completed_records(run_dir)
    old = tree(run_dir)
    cfg = config_for(run_dir, "start_over=true")
    real_replace = os.replace

    def replace(src, dst, **kwargs):  # back into the run dir: refused for result.json
        if Path(dst) == run_dir / "result.json":
            raise OSError(errno.EACCES, os.strerror(errno.EACCES), str(dst))
        return real_replace(src, dst, **kwargs)

    with failing(f"ENOSPC@open@{run_dir}/train.log"):
        os.replace = replace
        try:
            line = refused(gate_lines, lambda: run_gate(cfg).on_run_start(config=cfg))
        finally:
            os.replace = real_replace
    (aside,) = (run_dir / "replaced").iterdir()
    assert f"the earlier run is whole in {aside}" in line, line
    assert tree(aside) == old  # (launch.json too: a single run's attempts move with it)
    assert sorted(p.name for p in run_dir.iterdir()) == ["replaced"]
    assert not run_lock._HELD


# ---------------------------------------------------------------------------------------------
# what stands where the start writes


FILES = [LOCK, "launch.json", ".hydra/config.yaml", ".hydra/hydra.yaml", ".hydra/overrides.yaml"]
FILES += ["train.log"]
DIRS = ["replaced", ".hydra"]
IN_PLACE = [
    *(pytest.param(name, kind, id=f"{name}-{kind}") for name in FILES for kind in ("dir", "link")),
    *(pytest.param(name, kind, id=f"{name}-{kind}") for name in DIRS for kind in ("file", "link")),
]


@pytest.mark.parametrize(("name", "kind"), IN_PLACE)
def test_a_dir_or_a_symlink_where_the_start_writes_is_refused_and_never_written_through(
    tmp_path: Path, gate_lines, name: str, kind: str
) -> None:
    """start_over=true on a completed run with a directory or a symlink (to a file or dir
    outside the run dir) in place of a file the start writes, or a file or symlink in place of
    a dir it makes: exit 2, one line naming the path, nothing changed, the link's target
    included."""
    run_dir = tmp_path / "R"
    completed_records(run_dir)
    path = run_dir / name
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "notes.txt").write_text("a user's own file\n")
    if kind == "dir":
        path.mkdir()
    elif kind == "file":
        path.write_text("")
    else:
        path.symlink_to(outside / "notes.txt" if name in FILES else outside)
    cfg = config_for(run_dir, "start_over=true")
    before = tree(tmp_path)
    line = refused(gate_lines, lambda: run_gate(cfg).on_run_start(config=cfg))
    assert str(path) in line and "move it away" in line, line
    assert tree(tmp_path) == before


def test_a_lock_symlink_or_hard_link_never_changes_its_target(tmp_path: Path) -> None:
    """run_lock.acquire on a run dir whose .run.lock is a symlink (to a user's file, or
    dangling) or a hard link to a user's file: a UserError naming it; the user's file keeps its
    bytes and no file appears where a dangling link points."""
    users = tmp_path / "users.txt"
    users.write_text("precious\n")
    for n, make in enumerate(
        (
            lambda p: p.symlink_to(users),
            lambda p: p.symlink_to(tmp_path / "nowhere"),
            lambda p: os.link(users, p),
        )
    ):
        run_dir = tmp_path / f"r{n}"
        run_dir.mkdir()
        make(run_dir / LOCK)
        with pytest.raises(UserError, match=r"\.run\.lock is (a symlink|a hard link)"):
            run_lock.acquire(run_dir, "a test")
        assert users.read_text() == "precious\n" and not (tmp_path / "nowhere").exists()
        assert run_lock.holder(run_dir) is None
    assert not run_lock._HELD


# ---------------------------------------------------------------------------------------------
# a file system without flock


def test_without_flock_a_start_is_refused_unless_the_key_it_names_is_set(
    tmp_path: Path, gate_lines
) -> None:
    """flock fails (ENOLCK, as on NFS without it): one line naming the opt-out key, exit 2,
    the dir not made; that very key, pasted, composes and starts without a lock, and says so
    in the run's log (on_job_start: Hydra's job logging, train.log)."""
    run_dir = tmp_path / "R"
    cfg = config_for(run_dir)
    with failing(f"ENOLCK@flock@{run_dir}/.run.lock"):
        line = refused(gate_lines, lambda: run_gate(cfg).on_run_start(config=cfg))
        assert not run_dir.exists()
        key = re.search(r"(hydra\.\S+=false) starts without a lock", line)
        assert key is not None, line
        unlocked = config_for(run_dir, key.group(1))
        gate = run_gate(unlocked)
        gate.on_run_start(config=unlocked)
    assert not (run_dir / LOCK).exists() and not run_lock._HELD
    gate_lines.clear()
    gate.on_job_start(config=unlocked)
    said = [r.getMessage() for r in gate_lines.records]
    assert any(key.group(1) in s and "is not locked" in s for s in said), said


# ---------------------------------------------------------------------------------------------
# the held-marker is honoured only by the process tree that took the lock


def test_the_held_marker_counts_only_in_the_tree_of_the_process_holding_the_lock(
    tmp_path: Path, monkeypatch
) -> None:
    """HYDRA_DDP_RUN_DIR_HELD naming a run dir held by another process (the old form, the
    path alone; the new form with a pid that is not this process's ancestor, or another host)
    counts for nothing; the marker this process's own lock hands its children counts in them."""
    run_dir = tmp_path / "R"
    run_dir.mkdir()
    code = (
        "import sys, time; from ddp_launcher.core import run_lock; "
        "run_lock.acquire(sys.argv[1], 'a test'); print('held', flush=True); time.sleep(600)"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", code, str(run_dir)],
        cwd=REPO,
        env=run_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        host = socket.gethostname()
        for value in (
            str(run_dir.resolve()),
            f"{holder.pid} {host} {run_dir.resolve()}",
            f"{os.getpid()} {host} {run_dir.resolve()}",
            f"{os.getpid()} elsewhere {run_dir.resolve()}",
        ):
            monkeypatch.setenv(run_lock.HELD_ENV, value)
            assert not run_lock.held_for_me(run_dir), value
            with pytest.raises(UserError, match=f"is in use by pid {holder.pid} "):
                run_lock.acquire(run_dir, "a second start")
    finally:
        holder.kill()
        holder.wait()
    mine = tmp_path / "mine"
    mine.mkdir()
    run_lock.acquire(mine, "a test")
    try:
        env = {**run_env(), **run_lock.child_env(mine)}
        check = "import sys; from ddp_launcher.core import run_lock as r; print(r.held_for_me(sys.argv[1]))"  # noqa: E501
        child = subprocess.run(
            [sys.executable, "-c", check, str(mine)],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert child.stdout.strip() == "True", output(child)
    finally:
        run_lock.release(mine)


# ---------------------------------------------------------------------------------------------
# the real path: `python train.py` (slow: a completed run to start over on)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """One completed 1-epoch run, copied by each test that starts over on it."""
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    proc = run(train_cmd(*QUICK, f"hydra.run.dir={run_dir}"), timeout=300)
    assert proc.returncode == 0, output(proc)[-3000:]
    return run_dir


def copy_of(trained: Path, where: Path) -> Path:
    shutil.copytree(trained, where, symlinks=True)
    return where


def one_line(proc, code: int = 2) -> str:
    out = output(proc)
    lines = [line for line in out.splitlines() if line.strip()]
    assert proc.returncode == code, out[-3000:]
    assert len(lines) == 1 and "Traceback" not in out and "Warning" not in out, out[-3000:]
    return lines[0]


@pytest.mark.slow
def test_the_issues_starts_are_refused_through_train_py(trained: Path, tmp_path: Path) -> None:
    """Through `python train.py ... start_over=true` on a completed run: `touch
    <run>/replaced` (NotADirectoryError in the set-aside, a warning and the run overwritten in
    place before), ENOSPC injected in the set-aside's moves, a directory as `.run.lock` (two
    starts both passed) and as `launch.json`: each is exit 2, one line, the dir byte-identical."""
    cases = {
        "replaced a file": (lambda r: (r / "replaced").touch(), {}),
        "ENOSPC in the set-aside": (
            lambda r: None,
            {"HYDRA_DDP_OS_FAULT": "ENOSPC@replace@*/replaced/*"},
        ),
        "lock a dir": (lambda r: (r / LOCK).mkdir(), {}),
        "launch.json a dir": (
            lambda r: ((r / "launch.json").unlink(), (r / "launch.json").mkdir()),
            {},
        ),
    }
    for n, (name, (prepare, env)) in enumerate(cases.items()):
        run_dir = copy_of(trained, tmp_path / f"r{n}")
        prepare(run_dir)
        before = tree(run_dir)
        cmd = train_cmd("trainer.max_epochs=1", "start_over=true", f"hydra.run.dir={run_dir}")
        line = one_line(run(cmd, timeout=300, **env))
        assert str(run_dir) in line, (name, line)
        assert tree(run_dir) == before, name
        assert read_json(run_dir / "result.json")["status"] == "completed"


@pytest.mark.slow
def test_an_inherited_held_marker_does_not_pass_a_held_run_dir(
    trained: Path, tmp_path: Path
) -> None:
    """A second start_over run with HYDRA_DDP_RUN_DIR_HELD naming the held dir in its
    environment (as a shell inheriting it would have) is refused, naming the holder; the
    first run's rows stay."""
    run_dir = copy_of(trained, tmp_path / "r")
    code = (
        "import sys, time; from ddp_launcher.core import run_lock; "
        "run_lock.acquire(sys.argv[1], 'a test'); print('held', flush=True); time.sleep(600)"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", code, str(run_dir)],
        cwd=REPO,
        env=run_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        before = tree(run_dir)
        cmd = train_cmd(*QUICK, "start_over=true", f"hydra.run.dir={run_dir}")
        proc = run(cmd, timeout=300, HYDRA_DDP_RUN_DIR_HELD=str(run_dir.resolve()))
        assert f"is in use by pid {holder.pid} " in one_line(proc)
        assert tree(run_dir) == before
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.slow
def test_without_flock_the_pasted_key_runs_and_the_log_says_so(tmp_path: Path) -> None:
    """`python train.py` where flock fails (injected: ENOLCK): exit 2, one line naming the
    key; the same command with that key pasted completes, without a lock file, and train.log
    says it ran unlocked."""
    run_dir = tmp_path / "r"
    fault = {"HYDRA_DDP_OS_FAULT": f"ENOLCK@flock@{run_dir}/.run.lock"}
    cmd = train_cmd(*QUICK, f"hydra.run.dir={run_dir}")
    line = one_line(run(cmd, timeout=300, **fault))
    key = re.search(r"(hydra\.\S+=false) starts without a lock", line)
    assert key is not None and not run_dir.exists(), line
    proc = run([*cmd, key.group(1)], timeout=300, **fault)
    assert proc.returncode == 0, output(proc)[-3000:]
    assert read_json(run_dir / "result.json")["status"] == "completed"
    assert not (run_dir / LOCK).exists()
    log = (run_dir / "train.log").read_text()
    assert f"{key.group(1)}: {run_dir} is not locked" in log, log[-2000:]
