"""An app's entry (the public `ddp_launcher.entry_point`): ranks/entry.py's, with the launcher's
hand-off, so that `python app.py dist.nproc_per_node=N` starts N ranks (torchrun.py). Here, in
the launcher's side, because the rank's side imports nothing of the launcher."""

from __future__ import annotations

import importlib
import re
import sys
from collections.abc import Sequence
from pathlib import Path


def entry_point(
    script: str,
    task: str,
    config_name: str,
    schema: str | None = None,
    trusted_targets: Sequence[str] = (),
) -> None:
    """Run `conf/<config_name>.yaml` beside `script` with `task` ("module:function") as the
    job, in this process or in the ranks it starts (ranks/entry.py's entry_point). `schema`: a
    module to import first, which registers the config's typed schema with Hydra's
    ConfigStore. `trusted_targets`: the `_target_`s the app's configs may name beside the
    package's own ("my_pkg.*", "torch.optim.*": Hydra 1.4's execution whitelist, which every
    rank of every job runs under). A Ctrl-C however early is one line and exit 130
    (ranks/interrupt.py)."""
    from ddp_launcher.ranks.interrupt import RESUMABLE, ctrl_c_exits

    RESUMABLE[0] = continues_runs(Path(script).resolve().parent / "conf" / f"{config_name}.yaml")
    with ctrl_c_exits():
        from ddp_launcher.core.errors import UserError
        from ddp_launcher.core.host import check_host

        try:  # Linux, a torch at the floor: one line, before Hydra or torch start
            check_host()
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
            raise SystemExit(e.exit_code) from None
        from ddp_launcher.ranks.entry import entry_point as enter
        from ddp_launcher.torchrun import run_task_or_hand_off

        if schema is not None:
            importlib.import_module(schema)
        enter(
            script,
            task,
            config_name,
            hand_off=run_task_or_hand_off,
            trusted_targets=tuple(trusted_targets),
        )


def continues_runs(config_file: Path) -> bool:
    """Whether the app's primary config has a top-level `resume` key (an app whose Ctrl-C'd run
    continues with resume=auto; an evaluation's has none). Read as text: a Ctrl-C may come
    before anything can compose it."""
    try:
        return re.search(r"^resume:", config_file.read_text(), re.MULTILINE) is not None
    except OSError:
        return True
