"""Every fix a message prints works when pasted (issue 66, item 7). FIXES lists the messages
that suggest an override or a command: how a bad command gets its line (in this process: the
gate, the launcher's checks, the function that says it), each suggestion as the line prints it,
and what must hold once it is pasted into the command it came from (shell-split, replacing the
override of the same key): it composes (Hydra's compose, as `python train.py` composes; a sweep's
as `python train.py -m` does) and, where the line came from a check, that check passes. A row
also fails when its line suggests an override the row does not paste: a new suggestion needs a
row of its own."""

from __future__ import annotations

import contextlib
import json
import logging
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from ddp_launcher.core.errors import UserError
from ddp_launcher.core.gate import NothingToDo, check_start, check_sweep
from omegaconf import OmegaConf

from tests.helpers import QUICK, compose, composed_train_config, train_composer


@dataclass
class Fix:
    """A message that suggests overrides. `command`: the bad command's overrides; `said(tmp)`:
    its line; `pastes`: each suggestion as printed; `holds(cfg, tmp)`: what the pasted command
    passes (None: composing is enough); `multirun`: the command is a sweep (`-m`)."""

    command: list[str]
    said: Callable[[Path], str]
    pastes: list[str]
    holds: Callable[[Any, Path], None] | None = None
    multirun: bool = False
    # tokens of the line that look like overrides but are no suggestion (placeholders, an
    # example of the key's own, a value being described)
    named: list[str] = field(default_factory=list)
    # the command's overrides a paste stands in for (besides those of its keys)
    replaces: list[str] = field(default_factory=list)


def key(override: str) -> str:
    return override.lstrip("+~").partition("=")[0]


def pasted(command: list[str], paste: str, replaces: list[str] = ()) -> list[str]:
    """The command with the suggestion pasted: shell-split, its keys replacing the command's
    (and the overrides it `replaces`)."""
    args = shlex.split(paste)
    keys = {key(a) for a in args}
    return [o for o in command if key(o) not in keys and o not in replaces] + args


# ------------------------------------------------------------------------- how the lines are had


def run_dir_of(tmp: Path, held: bool = False) -> Path:
    """The run dir of a row's command: a new one, or (`held`) one holding a failed run."""
    return tmp / ("held" if held else "run")


def gate_line(*overrides: str, held: bool = False) -> Callable[[Path], str]:
    """The gate's refusal of `python train.py <overrides>` (ddp_launcher/core/gate.py)."""

    def said(tmp: Path) -> str:
        prepare(tmp)
        run_dir = run_dir_of(tmp, held)
        cfg = composed_train_config(*QUICK, *(o.replace("{tmp}", str(tmp)) for o in overrides))
        with pytest.raises(UserError) as caught:
            check_start(cfg, run_dir, 1, sweep=False)
        return str(caught.value)

    return said


def gate_passes(cfg: Any, tmp: Path, held: bool = False) -> None:
    with contextlib.suppress(NothingToDo):  # (resume=auto on a completed run: one line, exit 0)
        check_start(cfg, run_dir_of(tmp, held), 1, sweep=False)


def held_gate_passes(cfg: Any, tmp: Path) -> None:
    gate_passes(cfg, tmp, held=True)


def prepare(tmp: Path) -> None:
    """What the lines' rows need on disk: a run dir holding a failed run (no checkpoint), a
    file that is no checkpoint, a checkpoint saved by another model (tmp/other/last.pt)."""
    if (tmp / "prepared").exists():
        return
    run_dir = run_dir_of(tmp, held=True)
    run_dir.mkdir(parents=True)
    (run_dir / "result.json").write_text(json.dumps({"status": "failed", "error": "x"}))
    (tmp / "notes.pt").write_text("not a checkpoint\n")
    save_other_checkpoint(tmp / "other")
    (tmp / "prepared").write_text("")


def save_other_checkpoint(run_dir: Path) -> None:
    """A checkpoint whose manifest says it was saved with model.hidden=32 (a fine-tune source)."""
    from components.checkpoint import Checkpointer
    from conf.checks import checkpoint_fit
    from tests.helpers import composed_train_config, training_state

    state, *_ = training_state(0)
    fit = checkpoint_fit(composed_train_config("model.hidden=32"))
    Checkpointer(run_dir, rank=0, keep=2, enabled=True, fit=fit).save(state, step=1, is_best=True)


def stderr_of(call: Callable[[], Any], capsys) -> str:
    with pytest.raises(SystemExit):
        call()
    return capsys.readouterr().err.strip()


# the basic sweep these rows start from, and its sweep dir under tmp
GRID = ["optim.lr=0.1,0.2", "trainer.max_epochs=1"]


def sweep_dir_of(tmp: Path) -> Path:
    return tmp / "sweep"


def multirun_config(tmp: Path, *overrides: str) -> Any:
    with train_composer() as composer:
        return composer.multirun(*overrides, f"hydra.sweep.dir={sweep_dir_of(tmp)}")


def sweep_ran(tmp: Path) -> None:
    """The sweep dir of GRID as a first launch left it: multirun.yaml and job #0's record."""
    sweep_dir = sweep_dir_of(tmp)
    if (sweep_dir / "multirun.yaml").exists():
        return
    (sweep_dir / "0").mkdir(parents=True)
    (sweep_dir / "0" / "launch.json").write_text("{}")
    OmegaConf.save(multirun_config(tmp, *GRID), sweep_dir / "multirun.yaml")


def sweep_line(tmp: Path) -> str:
    sweep_ran(tmp)
    with pytest.raises(UserError) as caught:
        check_sweep(multirun_config(tmp, *GRID))
    return str(caught.value)


def sweep_passes(cfg: Any, tmp: Path) -> None:
    from ddp_launcher.resume import check_sweeper

    sweep_ran(tmp)
    check_sweep(cfg)
    check_sweeper(cfg, bool(cfg.hydra.launcher.resume))


def stopped_line(tmp: Path) -> str:
    from ddp_launcher.lifecycle import stopped_line

    return stopped_line("SIGINT", sweep_dir_of(tmp))


def fail_fast_line(tmp: Path) -> str:
    from ddp_launcher.lifecycle import fail_fast_line

    failed = "job #1 (lr=0.2) failed: optim.lr=-1.0 is not valid: use a learning rate > 0"
    return fail_fast_line(failed, sweep_dir_of(tmp), user=True, again=False)


def resumed_sweep_passes(cfg: Any, tmp: Path) -> None:
    sweep_passes(cfg, tmp)
    assert cfg.hydra.launcher.resume is True
    assert str(cfg.hydra.sweep.dir) == str(sweep_dir_of(tmp))


def params_line(space: str, capsys_box: list) -> Callable[[Path], str]:
    from ddp_launcher.ranks.entry import check_sweeper_params

    def said(tmp: Path) -> str:
        argv = ["train.py", "hparams_search=digits_optuna", f"hydra.sweeper.params.{space}"]
        return stderr_of(lambda: check_sweeper_params(argv), capsys_box[0])

    return said


def space_holds(key_name: str) -> Callable[[Any, Path], None]:
    """The pasted search composes and the sweeper reads `key_name` as a distribution."""

    def holds(cfg: Any, tmp: Path) -> None:
        from ddp_launcher.sweeper.space import search_space

        arguments = [str(o) for o in cfg.hydra.overrides.task]
        space, _ = search_space(OmegaConf.to_container(cfg.hydra.sweeper.params), arguments)
        assert key_name in space, space

    return holds


def gpus_line(gpus: list[int], visible: list[str]) -> Callable[[Path], str]:
    def said(tmp: Path) -> str:
        from ddp_launcher.torchrun import TorchrunBackend, TorchrunLauncherConf

        with pytest.raises(UserError) as caught:
            TorchrunBackend(TorchrunLauncherConf(gpus=gpus), gpu_ids=visible, cores=[0])
        return str(caught.value)

    return said


def tee_line(tmp: Path) -> str:
    """hydra.launcher.tee=9, which torch's agent raised on in each job (a traceback)."""
    from ddp_launcher.torchrun import TorchrunBackend, TorchrunLauncherConf

    with pytest.raises(UserError) as caught:
        TorchrunBackend(TorchrunLauncherConf(tee="9"), gpu_ids=[], cores=[0])
    return str(caught.value)


def gpus_hold(visible: list[str]) -> Callable[[Any, Path], None]:
    def holds(cfg: Any, tmp: Path) -> None:
        from ddp_launcher.torchrun import TorchrunBackend, TorchrunLauncherConf

        TorchrunBackend(TorchrunLauncherConf.from_config(cfg.hydra.launcher), visible, [0])

    return holds


def oversubscribed_line(tmp: Path) -> str:
    """The warning of a 16-rank job on 2 cores (its line, from the launcher's log)."""
    from ddp_launcher.jobs import Job
    from ddp_launcher.torchrun import TorchrunBackend, TorchrunLauncherConf

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("ddp_launcher.torchrun")
    logger.addHandler(handler)
    try:
        backend = TorchrunBackend(TorchrunLauncherConf(), gpu_ids=[], cores=[0, 1])
        job = Job(0, [], tmp / "j", spec=None, nproc=16, in_sweep=False)
        backend.warn_oversubscribed(job, None)
    finally:
        logger.removeHandler(handler)
    (line,) = records
    return line


def oversubscribe_holds(cfg: Any, tmp: Path) -> None:
    from ddp_launcher.torchrun import TorchrunLauncherConf

    nproc = int(cfg.dist.nproc_per_node)
    assert nproc <= 2 or TorchrunLauncherConf.from_config(cfg.hydra.launcher).oversubscribe


def divergence_line(tmp: Path) -> str:
    from types import SimpleNamespace

    from components.divergence import DivergenceWatch

    progress = SimpleNamespace(first_train_loss=1.0, diverged_step=None)
    found = DivergenceWatch(progress, 0, 0.4, None).check(
        {"train/loss": 5.0, "step": 30, "epoch": 2, "lr": 0.4}
    )
    return "try " + " or ".join(found["try"])


def rank_line(fn: Callable[[], Any]) -> Callable[[Path], str]:
    def said(tmp: Path) -> str:
        with pytest.raises(UserError) as caught:
            fn()
        return str(caught.value)

    return said


def resolve_nccl() -> None:
    from components.distributed import resolve_backend

    resolve_backend("nccl", "auto")


def non_finite_line(tmp: Path) -> str:
    from components.train_step import non_finite

    return str(non_finite(float("nan"), 3, 0, 0))


def interrupted_lines(tmp: Path) -> str:
    from ddp_launcher.ranks.interrupt import INTERRUPTED

    return INTERRUPTED


def sweep_interrupted_line(tmp: Path) -> str:
    from ddp_launcher.ranks.interrupt import SWEEP_INTERRUPTED

    return SWEEP_INTERRUPTED


CAPSYS: list = [None]  # the running test's capsys (check_sweeper_params prints its line)

FIXES: dict[str, Fix] = {
    # item 1's values, said by the gate
    "optim.lr": Fix(["optim.lr=1e308"], gate_line("optim.lr=1e308"), ["optim.lr=0.1"], gate_passes),
    "seed": Fix(
        ["seed=1180591620717411303424"],
        gate_line("seed=1180591620717411303424"),
        ["seed=0"],
        gate_passes,
    ),
    "grad_clip": Fix(
        ["trainer.grad_clip=-1"],
        gate_line("trainer.grad_clip=-1"),
        ["trainer.grad_clip=1.0", "trainer.grad_clip=null"],
        gate_passes,
    ),
    "timeout_s": Fix(
        ["dist.timeout_s=0"], gate_line("dist.timeout_s=0"), ["dist.timeout_s=600"], gate_passes
    ),
    "step_timeout_s": Fix(
        ["dist.step_timeout_s=0"],
        gate_line("dist.step_timeout_s=0"),
        ["dist.step_timeout_s=300"],
        gate_passes,
    ),
    "batch_size": Fix(
        ["trainer.batch_size=64", "trainer.accumulate_grad_batches=3"],
        gate_line("trainer.batch_size=64", "trainer.accumulate_grad_batches=3"),
        ["trainer.batch_size=63"],
        gate_passes,
        named=["trainer.accumulate_grad_batches=3"],
    ),
    "target": Fix(
        ["trainer.target=99"], gate_line("trainer.target=99"), ["trainer.target=0.99"], gate_passes
    ),
    "stop_at_target": Fix(
        ["trainer.stop_at_target=true"],
        gate_line("trainer.stop_at_target=true"),
        ["trainer.target=0.99"],
        gate_passes,
    ),
    # start_over / resume
    "wandb.init_timeout_s": Fix(
        ["wandb.init_timeout_s=-1"],
        gate_line("wandb.init_timeout_s=-1"),
        ["wandb.init_timeout_s=60"],
        gate_passes,
    ),
    "resume=AUTO": Fix(["resume=AUTO"], gate_line("resume=AUTO"), ["resume=auto"], gate_passes),
    "resume and start_over": Fix(
        ["resume=auto", "start_over=true"],
        gate_line("resume=auto", "start_over=true"),
        ["start_over=false"],
        gate_passes,
    ),
    "a run dir holding a run": Fix(
        [], gate_line(held=True), ["resume=auto", "start_over=true"], held_gate_passes
    ),
    # the fine-tune lines: resume=<another run's checkpoint>
    "a checkpoint of another model": Fix(
        ["resume={tmp}/other/checkpoints/last.pt", "model.hidden=64"],
        gate_line("resume={tmp}/other/checkpoints/last.pt", "model.hidden=64"),
        ["resume=null"],
        gate_passes,
    ),
    "a file that is no checkpoint": Fix(
        ["resume={tmp}/notes.pt"],
        gate_line("resume={tmp}/notes.pt"),
        ["resume=null"],
        gate_passes,
    ),
    "a checkpoint dir": Fix(
        ["resume={tmp}/other", "model.hidden=32"],
        gate_line("resume={tmp}/other", "model.hidden=32"),
        ["resume={tmp}/other/checkpoints/last.pt", "resume=auto"],
        gate_passes,
    ),
    # a sweep's lines
    "the Optuna params form": Fix(
        ["hparams_search=digits_optuna", "hydra.sweeper.params.optim.lr=interval(0.1, 1)"],
        params_line("optim.lr=interval(0.1, 1)", CAPSYS),
        [
            "'optim.lr=interval(0.1, 1)'",
            """'hydra.sweeper.params={optim.lr: "interval(0.1, 1)"}'""",
        ],
        space_holds("optim.lr"),
        multirun=True,
        replaces=["hydra.sweeper.params.optim.lr=interval(0.1, 1)"],
    ),
    "the Optuna params form, quoted": Fix(
        [
            "hparams_search=digits_optuna",
            'hydra.sweeper.params.optim.lr_scaling=choice("linear","sqrt")',
        ],
        params_line('optim.lr_scaling=choice("linear","sqrt")', CAPSYS),
        [
            """'optim.lr_scaling=choice("linear","sqrt")'""",
            """'hydra.sweeper.params={optim.lr_scaling: "choice(\\"linear\\",\\"sqrt\\")"}'""",
        ],
        space_holds("optim.lr_scaling"),
        multirun=True,
        replaces=['hydra.sweeper.params.optim.lr_scaling=choice("linear","sqrt")'],
    ),
    "a sweep dir holding the sweep": Fix(
        [*GRID, "hydra.sweep.dir={tmp}/sweep"],
        sweep_line,
        ["hydra.launcher.resume=true", "start_over=true"],
        sweep_passes,
        multirun=True,
    ),
    "the sweep resume line": Fix(
        [*GRID],
        stopped_line,
        ["hydra.sweep.dir={tmp}/sweep hydra.launcher.resume=true"],
        resumed_sweep_passes,
        multirun=True,
    ),
    "fail_fast on a user error": Fix(
        [*GRID, "hydra.launcher.fail_fast=true"],
        fail_fast_line,
        [
            "hydra.sweep.dir={tmp}/sweep hydra.launcher.resume=true",
            "hydra.sweep.dir={tmp}/sweep hydra.launcher.resume=true hydra.launcher.fail_fast=false",
        ],
        resumed_sweep_passes,
        multirun=True,
        named=["lr=0.2", "optim.lr=-1.0"],  # (the job's values and its own error)
    ),
    "a resumed sweep with start_over": Fix(
        [*GRID, "hydra.launcher.resume=true", "start_over=true"],
        rank_line(lambda: None),  # (replaced below: needs the composed config)
        ["start_over=false"],
        sweep_passes,
        multirun=True,
    ),
    "Ctrl-C of a run": Fix([], interrupted_lines, ["resume=auto"], gate_passes),
    "Ctrl-C of a sweep": Fix(
        [*GRID], sweep_interrupted_line, ["hydra.launcher.resume=true"], None, multirun=True
    ),
    # gpus
    "gpus without a GPU": Fix(
        [*GRID, "hydra.launcher.gpus=[0,0]"],
        gpus_line([0, 0], []),
        ["hydra.launcher.gpus=null"],
        gpus_hold([]),
        multirun=True,
    ),
    "a GPU twice": Fix(
        [*GRID, "hydra.launcher.gpus=[0,0]"],
        gpus_line([0, 0], ["0", "1"]),
        ["hydra.launcher.gpus=[0]", "hydra.launcher.gpus=null"],
        gpus_hold(["0", "1"]),
        multirun=True,
    ),
    "a GPU beyond the visible ones": Fix(
        [*GRID, "hydra.launcher.gpus=[0,3]"],
        gpus_line([0, 3], ["0", "1"]),
        ["hydra.launcher.gpus=[0]", "hydra.launcher.gpus=null"],
        gpus_hold(["0", "1"]),
        multirun=True,
    ),
    "a tee torchrun does not take": Fix(
        [*GRID, "hydra.launcher.tee=9"],
        tee_line,
        ["hydra.launcher.tee=0:3"],
        gpus_hold([]),
        multirun=True,
    ),
    "more ranks than cores": Fix(
        ["dist.nproc_per_node=16"],
        oversubscribed_line,
        ["dist.nproc_per_node=2", "hydra.launcher.oversubscribe=true"],
        oversubscribe_holds,
    ),
    # said while it trains
    "diverging": Fix([], divergence_line, ["optim.lr=0.2", "trainer.grad_clip=1.0"], None),
    "a non-finite loss": Fix([], non_finite_line, ["trainer.nonfinite=skip"], None),
    "nccl without a GPU": Fix(
        ["dist.backend=nccl"], rank_line(resolve_nccl), ["dist.backend=gloo"], gate_passes
    ),
}


def resumed_with_start_over_line(tmp: Path) -> str:
    from ddp_launcher.resume import check_sweeper

    cfg = multirun_config(tmp, *GRID, "hydra.launcher.resume=true", "start_over=true")
    with pytest.raises(UserError) as caught:
        check_sweeper(cfg, True)
    return str(caught.value)


FIXES["a resumed sweep with start_over"].said = resumed_with_start_over_line

# What looks like an override in a line: key=value (a dotted key, a value up to a separator)
OVERRIDE = re.compile(r"(?<![\w.=/-])([+~]{0,2}[a-z_][\w]*(?:\.[\w]+)*=[^\s,;)'\"]+)")


@pytest.mark.parametrize("name", list(FIXES))
def test_every_suggested_fix_composes_when_pasted(name, tmp_path, capsys):
    CAPSYS[0] = capsys
    fix = FIXES[name]
    tmp = str(tmp_path)
    command = [o.replace("{tmp}", tmp) for o in fix.command]
    line = fix.said(tmp_path)
    pastes = [p.replace("{tmp}", tmp) for p in fix.pastes]
    for paste in pastes:
        assert paste in line, (paste, line)
    # every override the line suggests has its paste here (or is the command's own, or named)
    rest = line
    echo = OVERRIDE.match(line)  # the line opens with the bad value as it was read
    if echo is not None and key(echo.group(1)) in {key(o) for o in command}:
        rest = rest[echo.end() :]
    named = [n.replace("{tmp}", tmp) for n in fix.named]
    for text in sorted([*pastes, *command, *named], key=len, reverse=True):
        rest = rest.replace(text, " ")
    unlisted = [o for o in OVERRIDE.findall(rest) if "<" not in o]
    assert not unlisted, f"{name}: the line suggests {unlisted} with no paste test: {line}"
    for paste in pastes:
        overrides = pasted(command, paste, [r.replace("{tmp}", tmp) for r in fix.replaces])
        if fix.multirun:
            cfg = multirun_config(tmp_path, *overrides)
        else:
            prepare(tmp_path)
            cfg = composed_train_config(*QUICK, *overrides)
        if fix.holds is not None:
            fix.holds(cfg, tmp_path)


def test_the_paste_check_can_fail(tmp_path):
    """A suggestion that does not compose, and a line with a suggestion no row pastes, fail."""
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException):
        compose("train", tmp_path, *pasted([], "trainer.grad_clp=1.0"))
    line = "trainer.grad_clip=-1 is not valid: use trainer.grad_clip=1.0 or trainer.clip=2"
    rest = line.replace("trainer.grad_clip=-1", " ").replace("trainer.grad_clip=1.0", " ")
    assert OVERRIDE.findall(rest) == ["trainer.clip=2"]


def test_the_old_params_form_did_not_paste():
    """The mapping form 5f215d2 printed for a space holding quotes doubled them: pasted as
    printed, the shell splits it and Hydra does not parse it."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    space = 'choice("linear","sqrt")'
    old = f"""'hydra.sweeper.params={{optim.lr_scaling: "{space}"}}'"""
    (arg,) = shlex.split(old)
    with pytest.raises(HydraException):
        OverridesParser.create().parse_override(arg)
