"""The entry point of an app's script (`python app.py`), in the process you start and in every
rank something else starts (plain `torchrun app.py`, `srun python app.py`). Hydra composes first, so
`--help`, `--cfg` and a config that does not compose answer before torch is imported.
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from ddp_launcher.core.errors import UserError, find_user_error
from ddp_launcher.core.hydra_compat import (
    MULTIRUN_FLAGS,
    VERSION_BASE,
    dry_run_as_multirun,
    execution_whitelist,
    search_as_multirun,
    yaml_errors_as_user_errors,
)
from ddp_launcher.core.run_dir import process_start_time
from ddp_launcher.ranks.bootstrap import OTHER_RANK_OVERRIDES, run_task
from ddp_launcher.ranks.interrupt import hydra_keeps_ctrl_c

# Set while an app runs through entry_point: its search path gets the package's config groups
# for such apps (hydra/job_logging=other_ranks: hydra_plugins/hydra_ddp_launcher/searchpath.py)
ENTERED = False

INFO_FLAGS = {  # Hydra's flags that print and exit: no run dir for the ranks to agree on
    "--help",
    "-h",
    "--hydra-help",
    "--version",
    "--cfg",
    "-c",
    "--info",
    "-i",
    "--shell-completion",
    "-sc",
    "--resolve",
    "-p",
    "--package",
}


def entry_point(
    script: str,
    task: str,
    config_name: str,
    hand_off: Callable[[str, Any], Any] | None = None,
    trusted_targets: Sequence[str] = (),
) -> None:
    """Run `conf/<config_name>.yaml`, composed from the command line, with the task function
    `task` ("module:function") as its job. The script calls this before its own imports; a
    launcher pickles the task function by reference, so its ranks import the script alike.
    The script calls it inside ddp_launcher/ranks/interrupt.py's ctrl_c_exits (Ctrl-C: one line).
    `trusted_targets`: the `_target_`s the app's configs may name beside the package's own
    (Hydra 1.4's execution whitelist, core/hydra_compat.py)."""
    import hydra

    global ENTERED
    ENTERED = True
    check_sweeper_params(sys.argv)
    argv = search_as_multirun(sys.argv)
    sys.argv = prepare_argv(dry_run_as_multirun(argv))
    yaml_errors_as_user_errors()
    hydra_keeps_ctrl_c()
    conf = Path(script).resolve().parent / "conf"
    if {"--help", "-h"} & set(sys.argv[1:]):
        print_help(conf, config_name, [a for a in sys.argv[1:] if not a.startswith("-")])
        raise SystemExit(0)
    # `hand_off(task, cfg)` decides where the task runs (ddp_launcher/torchrun.py's
    # run_task_or_hand_off: here, or in the N ranks it starts) before anything imports the task's
    # module.
    task_function = functools.partial(hand_off or run_task, task)
    # Hydra reads the config path and the job's name from the task function's module; the job
    # name is set in the config (hydra.job.name), the config path is the script's conf/.
    task_function.__module__ = __name__
    main = hydra.main(
        config_path=str(conf),
        config_name=config_name,
        **VERSION_BASE,
        **execution_whitelist(trusted_targets),
    )
    try:
        main(task_function)()
    except SystemExit as e:  # Hydra prints a task's error, then sys.exit(1) in its except block
        user_error = find_user_error(e.__context__) if e.code == 1 else None
        if user_error is not None:
            raise SystemExit(user_error.exit_code) from None
        raise
    raise SystemExit(0)


def print_help(conf: Path, config_name: str, overrides: list[str]) -> None:
    """`--help`: conf/hydra/help/'s template with conf/'s groups (not Hydra's) and the composed
    config. Hydra's --help deep-copies its config repository once per group: seconds."""
    import string

    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf, open_dict

    with initialize_config_dir(config_dir=str(conf), **VERSION_BASE):
        cfg = compose(config_name, overrides=overrides, return_hydra_config=True)
    template = cfg.hydra.help.template
    with open_dict(cfg):
        del cfg["hydra"]
    groups = sorted(
        f"{folder.relative_to(conf)}: {', '.join(sorted(p.stem for p in folder.glob('*.yaml')))}"
        for folder in conf.rglob("*")
        if folder.is_dir()
        and "hydra" not in folder.relative_to(conf).parts
        and any(folder.glob("*.yaml"))
    )
    print(
        string.Template(template).safe_substitute(
            APP_CONFIG_GROUPS="\n".join(groups),
            CONFIG=OmegaConf.to_yaml(cfg),
            FLAGS_HELP="",
            HYDRA_CONFIG_GROUPS="",
        )
    )


SWEEPER_PARAM = re.compile(r"^[+~]{0,2}hydra\.sweeper\.params\.([^=]+)(?:=(.*))?$")


def check_sweeper_params(argv: list[str]) -> None:
    """`hydra.sweeper.params.<key>=<space>` on the command line: Hydra reads the dots of a key
    such as optim.lr as nesting (and refuses a sweep of its own config), so it ends in one line
    naming the forms that work."""
    for arg in argv[1:]:
        found = SWEEPER_PARAM.match(arg)
        if found:
            key, space = found.group(1), found.group(2) or "<space>"
            # each form quoted for a shell and, inside the mapping, for Hydra's grammar: pasted
            # as printed, it composes (a space holding quotes of its own doubled them before)
            mapping = shlex.quote(f"hydra.sweeper.params={{{key}: {hydra_quoted(space)}}}")
            print(
                f"error: {arg}: a key of hydra.sweeper.params cannot be set on its own (the "
                f"dots of {key} read as nesting): give the space as a sweep argument, "
                f"{shlex.quote(f'{key}={space}')}, as {mapping}, or in a search config "
                "(conf/hparams_search/)",
                file=sys.stderr,
            )
            raise SystemExit(UserError.exit_code)


def hydra_quoted(text: str) -> str:
    """`text` as one double-quoted value of Hydra's override grammar (its own quotes and
    backslashes escaped)."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def prepare_argv(argv: list[str]) -> list[str]:
    """The command line each rank of a plain torchrun (or srun) run hands to Hydra, which
    resolves `${now:}` per process: ranks started in different seconds would get different run
    dirs (hydra #2070), so they pin `now` to one agreed instant; ranks other than 0 get
    OTHER_RANK_OVERRIDES."""
    if "RANK" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return argv
    if MULTIRUN_FLAGS & set(argv):
        from ddp_launcher.core.app_command import app_command

        print(
            "error: -m/--multirun under torchrun would start a sweep in every rank: run "
            f"`{app_command()} -m ...` instead (each sweep job is started with torchrun)",
            file=sys.stderr,
        )
        raise SystemExit(UserError.exit_code)
    if INFO_FLAGS & set(argv):
        return argv
    pin_now(agreed_start_time())
    if int(os.environ["RANK"]) != 0:
        argv = [*argv, *OTHER_RANK_OVERRIDES]
    return argv


def pin_now(timestamp: float) -> None:
    """Make Hydra's `${now:...}` resolve to `timestamp` here: Hydra's resolver (re-registered at
    every start) calls `datetime.now()` on hydra.core.utils's `datetime` name, which we swap."""
    import hydra.core.utils

    fixed = datetime.fromtimestamp(timestamp)

    class _RunStart(datetime):
        @classmethod
        def now(cls, tz=None):  # noqa: ARG003 - same signature as datetime.now
            return fixed

    hydra.core.utils.datetime = _RunStart


def agreed_start_time() -> float:
    """The start instant of this run, the same in every rank, on every node, after restarts."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        import torch.distributed as dist

        # The elastic agent hosts a TCPStore at MASTER_ADDR:MASTER_PORT for its workers; the
        # first rank 0 of the run publishes its start time and restarted workers reuse it.
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=timedelta(seconds=120),
        )
        key = f"hydra_ddp/start_time/{os.environ.get('TORCHELASTIC_RUN_ID', 'none')}"
        if int(os.environ["RANK"]) == 0:
            value = store.compare_set(key, "", repr(time.time()))
        else:
            value = store.get(key)
        return float(value.decode() if isinstance(value, bytes) else value)
    # Without an agent store (srun, hand-set env://) the ranks of one node share a parent
    # process (srun's step daemon): its start time is common to them.
    return process_start_time(os.getppid())
