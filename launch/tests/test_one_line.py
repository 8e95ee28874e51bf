"""One line means one line (issue 66): the launcher's errors without Hydra's HYDRA_FULL_ERROR
line and with their own exit status (fail_fast included), `--info`/`--cfg` on every search and
experiment config, ranks beyond a job's cores said in one warning line, the dry run's real core
slice, a GPU list that can be pasted, a full disk in one line, and report --aggregate naming
the keys it knows. In this process where it can be; the few real launches are marked slow."""

from __future__ import annotations

import errno
import logging
import re
import shutil
import sys
from pathlib import Path

import pytest
from ddp_launcher.core.errors import UserError

from tests.helpers import QUICK, REPO, compose, output, run, train_cmd

# ---------------------------------------------------------------------------------------------
# item 6: Hydra's HYDRA_FULL_ERROR line never follows one of our errors


def reported(error: BaseException, capsys) -> tuple[int, str]:
    """(exit status, stderr) of `error` raised through Hydra's run_and_report as the entry point
    has it (ddp_launcher/ranks/interrupt.py's wrapper)."""
    import hydra._internal.utils as hydra_utils
    from ddp_launcher.ranks.interrupt import hydra_keeps_ctrl_c

    hydra_keeps_ctrl_c()

    def fail() -> None:
        raise error

    with pytest.raises(SystemExit) as caught:
        hydra_utils.run_and_report(fail)
    return caught.value.code, capsys.readouterr().err


def test_our_errors_are_one_line_without_hydras_hint(capsys):
    """The Optuna sweeper's refusals reach Hydra's run_and_report (it instantiates the sweeper):
    its message, a blank line, "Set the environment variable HYDRA_FULL_ERROR=1 ...", exit 1."""
    from ddp_launcher.jobs import SweepStopped
    from hydra.errors import InstantiationException

    code, err = reported(UserError("hydra.sweeper.n_trials=0: at least 1"), capsys)
    assert (code, err) == (2, "hydra.sweeper.n_trials=0: at least 1\n")
    wrapped = InstantiationException("Error in call to target 'OptunaSweeper':\nUserError(...)")
    wrapped.__cause__ = UserError("hydra.sweeper.direction=up: use minimize or maximize")
    code, err = reported(wrapped, capsys)
    assert (code, err) == (2, "hydra.sweeper.direction=up: use minimize or maximize\n")
    stopped = SweepStopped("the sweep was stopped (SIGINT): ...")
    stopped.exit_code = 130
    assert reported(stopped, capsys) == (130, "the sweep was stopped (SIGINT): ...\n")
    # a sweep's failed job, as Hydra's sweeper raises it at the end: exit 2 for a user error
    from ddp_launcher.jobs import JobFailed

    failed = JobFailed("job #0 (lr=-1): optim.lr=-1.0 is not valid")
    failed.__cause__ = UserError("optim.lr=-1.0 is not valid")
    assert reported(failed, capsys) == (2, "job #0 (lr=-1): optim.lr=-1.0 is not valid\n")
    assert reported(JobFailed("job #1 (lr=1): rank 0 was killed"), capsys)[0] == 1
    code, err = reported(OSError(errno.ENOSPC, "No space left on device", "/full/x/y.yaml"), capsys)
    assert code == 2 and err.startswith("no space left on the disk of /full/x for y.yaml"), err
    # Hydra's own errors, and unexpected ones, are Hydra's to print as before
    code, err = reported(ValueError("not ours"), capsys)
    assert code == 1 and "ValueError: not ours" in err


# ---------------------------------------------------------------------------------------------
# item 6: --info and --cfg on every search and experiment option, and on the docs' configs


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (REPO / "conf" / group).glob("*.yaml"))


INTROSPECTION = [
    *(
        (["train.py", f"hparams_search={name}", *flag], "train")
        for name in options("hparams_search")
        for flag in (["--info"], ["--cfg", "job"], ["--info", "config"])
    ),
    *((["train.py", f"experiment={name}", "--info"], "train") for name in options("experiment")),
    (["train.py", "-m", "hparams_search=digits_optuna", "--info"], "train"),
    (["train.py", "--cfg", "job", "hparams_search=digits_optuna"], "train"),
    (["eval.py", "--info"], "eval"),
    (["eval.py", "--cfg", "job"], "eval"),
    (["train.py", "--config-dir", "data/example/conf", "dataset=shapes", "--info"], "train"),
]


@pytest.fixture
def logging_restored():
    """Hydra configures logging (handlers on this test's captured streams): put it back."""
    loggers = [logging.root, *logging.root.manager.loggerDict.values()]
    saved = [(lg, lg.handlers[:], lg.level) for lg in loggers if isinstance(lg, logging.Logger)]
    yield
    for lg, handlers, level in saved:
        lg.handlers[:] = handlers
        lg.setLevel(level)


@pytest.mark.parametrize("argv, config", INTROSPECTION, ids=[" ".join(a) for a, _ in INTROSPECTION])
def test_info_and_cfg_work_on_every_search_and_experiment(
    argv, config, monkeypatch, capsys, logging_restored
):
    """`hparams_search=digits_optuna --info` was "invalid choice", exit 2: the hydra.mode=RUN
    the entry point appended became --info's argument."""
    from ddp_launcher.ranks.entry import entry_point

    import conf.schema  # noqa: F401 - registers the schema, as the scripts' schema= does

    monkeypatch.chdir(REPO)
    monkeypatch.setattr(sys, "argv", list(argv))
    with pytest.raises(SystemExit) as caught:
        entry_point(str(REPO / argv[0]), task=f"{config}:main", config_name=config)
    out, err = capsys.readouterr()
    assert caught.value.code == 0, out + err
    assert "invalid choice" not in err and "error" not in err.lower(), err
    assert out.strip(), err


# ---------------------------------------------------------------------------------------------
# item 6: exit 2 through fail_fast, and a resumed fail_fast sweep names the way past


@pytest.mark.slow
def test_fail_fast_on_a_user_error_exits_2_and_a_resume_names_the_way_past(tmp_path):
    """Job #0's value is refused by its gate: fail_fast stopped the sweep with exit 1, and a
    resume ran the same job first, stopped again, and said nothing of how past it."""
    sweep_dir = tmp_path / "sweep"
    cmd = train_cmd(
        "-m",
        *QUICK,
        "trainer.grad_clip=-1,1",
        "hydra.launcher.fail_fast=true",
        f"hydra.sweep.dir={sweep_dir}",
    )
    for attempt, extra in enumerate(([], ["hydra.launcher.resume=true"])):
        proc = run([*cmd, *extra], timeout=300)
        out = output(proc)
        assert proc.returncode == 2, (attempt, out[-3000:])
        assert "Traceback" not in out and "HYDRA_FULL_ERROR" not in out, out[-3000:]
        said = [line for line in out.splitlines() if line.startswith("hydra.launcher.fail_fast:")]
        assert len(said) == 1, out[-3000:]
        assert "a user error fails the same way every time" in said[0], said
        assert "hydra.launcher.fail_fast=false to run the other jobs past it" in said[0], said
    assert not (sweep_dir / "1").exists()  # no job started after it


# ---------------------------------------------------------------------------------------------
# item 2: ranks beyond a job's cores


def oversubscribed(backend, nproc: int, cpus, in_sweep: bool = True) -> list[str]:
    from ddp_launcher.jobs import Job

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("ddp_launcher.torchrun")
    logger.addHandler(handler)
    try:
        job = Job(3, [], Path("j"), spec=None, nproc=nproc, in_sweep=in_sweep)
        backend.warn_oversubscribed(job, cpus)
    finally:
        logger.removeHandler(handler)
    return records


def test_ranks_beyond_the_cores_are_one_warning_line():
    """`dist.nproc_per_node=16` on 2 cores (and 64 from the launcher) got not a word."""
    from ddp_launcher.torchrun import TorchrunBackend, TorchrunLauncherConf

    backend = TorchrunBackend(TorchrunLauncherConf(), gpu_ids=[], cores=[0, 1])
    (line,) = oversubscribed(backend, 16, None)
    assert line.startswith("#3: 16 ranks on 2 core(s) (0-1): the ranks share cores"), line
    assert "hydra.launcher.oversubscribe=true silences this" in line
    assert oversubscribed(backend, 16, None) == []  # once per kind of job
    (line,) = oversubscribed(backend, 64, [1], in_sweep=False)
    assert line.startswith("64 ranks on 1 core(s) (1)"), line
    assert oversubscribed(backend, 2, None) == []  # as many as cores: nothing to say
    quiet = TorchrunBackend(TorchrunLauncherConf(oversubscribe=True), gpu_ids=[], cores=[0])
    assert oversubscribed(quiet, 16, None) == []


def test_the_dry_run_shows_the_real_core_slice():
    """16-rank jobs showed "cores all" (or "cores 0"), whatever the machine had."""
    from ddp_launcher.jobs import Job
    from ddp_launcher.torchrun import TorchrunBackend, TorchrunLauncherConf

    backend = TorchrunBackend(TorchrunLauncherConf(), gpu_ids=[], cores=[0, 1, 2, 3])
    job = Job(0, [], Path("j"), spec=None, nproc=16)
    assert backend.preview_resources(job, ([], None)) == "CPU, cores 0-3 (16 ranks > 4 cores)"
    job.nproc = 2
    assert backend.preview_resources(job, ([], [2, 3])) == "CPU, cores 2-3"


def test_the_silencing_key_composes(tmp_path):
    cfg = compose("train", tmp_path, "dist.nproc_per_node=16", "hydra.launcher.oversubscribe=true")
    assert cfg.hydra.launcher.oversubscribe is True


# ---------------------------------------------------------------------------------------------
# item 7's gpus: "use numbers from 0 to -1" on a machine without GPUs


def test_gpus_without_a_gpu_says_there_is_none():
    from ddp_launcher.torchrun import TorchrunBackend, TorchrunLauncherConf

    with pytest.raises(UserError) as caught:
        TorchrunBackend(TorchrunLauncherConf(gpus=[0, 0]), gpu_ids=[], cores=[0])
    message = str(caught.value)
    assert "no GPU is visible here" in message and "hydra.launcher.gpus=null" in message
    assert "-1" not in message, message
    with pytest.raises(UserError, match=r"e.g. hydra.launcher.gpus=\[0,1\],"):
        TorchrunBackend(TorchrunLauncherConf(gpus=[0, 1, 1]), gpu_ids=["0", "1"], cores=[0])


# ---------------------------------------------------------------------------------------------
# item 5: a full disk, in this process (tests/test_full_disk.py fills a real one)


def test_a_start_on_a_full_disk_is_refused_naming_the_bytes(tmp_path, monkeypatch):
    from ddp_launcher.core import disk, errors
    from ddp_launcher.core.run_dir import check_writable

    cfg = compose("train", tmp_path / "run", *QUICK)
    check_writable(cfg, "hydra.run.dir")  # room enough here
    for module in (disk, errors):  # (check_room reads it, the line says it)
        monkeypatch.setattr(module, "free_bytes", lambda path: 8192)
    with pytest.raises(UserError) as caught:
        check_writable(cfg, "hydra.run.dir")
    message = str(caught.value)
    assert message.startswith(f"no space left on the disk of {tmp_path} for a start in "), message
    assert re.search(r"\(needs \d+\.\d KiB, 8\.0 KiB free there\)", message), message
    assert message.endswith("or choose another hydra.run.dir") and not (tmp_path / "run").exists()


def test_a_full_disk_anywhere_is_a_user_error():
    from ddp_launcher.core.errors import find_user_error

    error = RuntimeError("wrapped")
    error.__cause__ = OSError(errno.EDQUOT, "Disk quota exceeded", "/data/run/.hydra/config.yaml")
    found = find_user_error(error)
    assert found is not None and found.exit_code == 2
    assert str(found).startswith("no space left on the disk of /data/run/.hydra for config.yaml")


def test_a_disk_out_of_inodes_says_so(monkeypatch):
    """ENOSPC with bytes free (no inode left: many small files) said "no space left ... (needs
    more, 164.0 KiB free there): free space there", a line that contradicts itself and names
    the wrong fix."""
    from ddp_launcher.core import errors

    monkeypatch.setattr(errors, "free_inodes", lambda path: 0, raising=False)
    monkeypatch.setattr(errors, "free_bytes", lambda path: 164 * 1024)
    full = OSError(errno.ENOSPC, "No space left on device", "/data/run/metrics.jsonl")
    message = str(errors.find_user_error(full))
    assert message.startswith("no inode left on the disk of /data/run for metrics.jsonl"), message
    assert "164.0 KiB free" in message and "remove files there" in message, message


# ---------------------------------------------------------------------------------------------
# report --aggregate: an unknown key was ignored without a word


def test_report_aggregate_names_the_keys_it_knows(tmp_path, capsys):
    from ddp_launcher.report.__main__ import main, unknown_keys

    sweep_dir = tmp_path / "sweep"
    shutil.copytree(REPO / "tests" / "data" / "sweep_b2beecb", sweep_dir)
    before = sorted(p.name for p in sweep_dir.iterdir())
    assert main([str(sweep_dir), "--aggregate", ",,optim.lr,nope"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("error: --aggregate nope: not a key the sweep's jobs set"), err
    assert "optim.lr" in err.partition("the keys they set: ")[2], err
    assert sorted(p.name for p in sweep_dir.iterdir()) == before  # nothing written
    assert unknown_keys(sweep_dir, ["optim.lr", "+model.hidden"]) is None
    assert unknown_keys(sweep_dir, ["seed"]) is None  # the default: no error without seeds


# ---------------------------------------------------------------------------------------------
# a config that does not compose: one line naming the fix, exit 2 (Hydra's own message was
# several lines: OmegaConf's full_key/object_type block, the options one per line, the config
# search path, the HYDRA_FULL_ERROR hint; exit 1)

TOY = Path(__file__).resolve().parents[1] / "examples" / "toy_ddp.py"


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, line",
    [
        (["lrr=0.1"], "lrr: the config has no such key: did you mean lr?"),
        (
            ["dist.nproc_per_nod=2"],
            "dist.nproc_per_nod: the config has no such key: did you mean dist.nproc_per_node?",
        ),
        (
            ["width=3"],
            "width: the config has no such key: "
            f"`python {TOY.name} --cfg job` prints the keys it has",
        ),
        (
            ["hparams_search=nope"],
            "hparams_search=nope: hparams_search has no option nope: use one of lr",
        ),
        (
            ["-m", "hydra/launcher=torchrn", "seed=1,2"],
            "hydra/launcher=torchrn: hydra/launcher has no option torchrn: use one of basic, "
            "ddp_slurm, ddp_torchrun, slurm, torchrun",
        ),
        (
            ["-m", "hydra.launcher.max_parallel=two", "seed=1,2"],
            "hydra.launcher.max_parallel=two: Value 'two' of type 'str' could not be converted "
            "to Integer",
        ),
        (
            ["--config-dir", "/nonexistent/conf"],
            "Additional config directory '/nonexistent/conf' not found: give --config-dir (or "
            "hydra.searchpath) a folder that exists",
        ),
    ],
    ids=["typo", "nested typo", "no near key", "no such option", "launcher option", "type", "dir"],
)
def test_a_config_that_does_not_compose_is_one_line(tmp_path, args, line) -> None:
    """The example app with a misspelt key, an option its group lacks, a value of the wrong
    type: one line naming the fix (the nearest key, the options, the type), exit 2, nothing
    written; HYDRA_FULL_ERROR=1 still shows Hydra's whole message."""
    out_dirs = [f"hydra.run.dir={tmp_path / 'run'}", f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    proc = run([sys.executable, TOY.name, *args, *out_dirs], cwd=TOY.parent, timeout=120)
    assert proc.returncode == 2, output(proc)
    assert output(proc).strip() == line, output(proc)
    assert not (tmp_path / "run").exists() and not (tmp_path / "sweep").exists()
    full = run(
        [sys.executable, TOY.name, *args, *out_dirs],
        cwd=TOY.parent,
        timeout=120,
        HYDRA_FULL_ERROR="1",
    )
    assert full.returncode == 1 and "Traceback" in output(full), output(full)
