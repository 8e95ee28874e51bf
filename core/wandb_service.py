"""One W&B service (wandb-core) for many runs, started before it is needed.

W&B's documented hand-off: a process whose environment has WANDB_SERVICE connects to that
service instead of starting its own (`wandb beta core start` prints such a token). We start
it with the function behind that command, without its detached mode, so the service ends with
the process that started it: the warm interpreter of a sweep (launch/ranks/warm.py: every job of the
sweep uses it), or a single run's own process, where it starts in a thread while torch imports
(`start_wandb_service(background=True)`; the run waits for it in :func:`wait_for_service`).

A failure here only costs the speed-up: wandb.init starts its own service as it always does.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

log = logging.getLogger(__name__)

SERVICE_ENV = "WANDB_SERVICE"
_starting: threading.Thread | None = None


def wandb_wanted(config: Any) -> bool:
    """Whether a run of this composed config logs to W&B (its `wandb.mode` is not disabled)."""
    from core.wandb_mode import resolve_wandb_mode

    try:
        return resolve_wandb_mode(config.wandb.mode) != "disabled"
    except Exception:  # noqa: BLE001 - no wandb node, or a bad mode the run itself reports
        return False


def start_wandb_service(background: bool = False) -> None:
    """Import the W&B modules a run imports, start wandb-core and put its token in this
    process's environment (children inherit it). `background`: the start (a process spawn and
    a wait for its port) runs in a thread while this one goes on to import torch; the imports
    stay in this thread (two threads importing at once can see half-made modules)."""
    global _starting
    if os.environ.get(SERVICE_ENV) or _starting is not None:
        return
    try:
        import wandb
        import wandb.sdk.launch.inputs.internal  # noqa: F401 - what wandb.init imports late
        from wandb.sdk.lib.service import service_process
    except Exception as e:  # noqa: BLE001 - wandb.init will say what is wrong
        log.debug("W&B not importable: %s", e)
        return
    settings = wandb.Settings()

    def start() -> None:
        try:
            service_process.start(settings).token.save_to_env()
        except Exception as e:  # noqa: BLE001 - wandb.init will start its own
            log.debug("W&B service not started early: %s", e)

    if not background:
        start()
        return
    _starting = threading.Thread(target=start, name="wandb-service", daemon=True)
    _starting.start()


def run_settings(wandb: Any, mode: str, init_timeout_s: float) -> Any:
    """The wandb.Settings of every run this project opens (a job's, a sweep's summary), for
    wandb.init in `mode`. No banner or footer: the run's own end line says where the run is.
    Off: W&B's own listing of the installed packages and its git capture (repro/ records
    both) and code saving (repro/git.diff has the changes). Offline, W&B is first set up in
    that mode (wandb.setup): otherwise its own usage telemetry, which it only sends online,
    still imports its HTTP exporters and starts two export threads in every run's process."""
    if mode != "online":
        wandb.setup(settings=wandb.Settings(mode=mode))
    return wandb.Settings(
        init_timeout=init_timeout_s,
        console="off",
        silent=True,
        x_save_requirements=False,
        disable_git=True,
        save_code=False,
    )


def wait_for_service() -> None:
    """Before wandb.init: let a service being started finish (else init starts a second)."""
    if _starting is not None:
        _starting.join()
