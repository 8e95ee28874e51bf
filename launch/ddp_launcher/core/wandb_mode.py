"""W&B's mode from the `wandb.mode` setting. Torch-free: the sweep process (ddp_launcher/report/)
decides with it whether to log the sweep-summary run.
"""

from __future__ import annotations

import netrc
import os
from typing import Any
from urllib.parse import urlparse

from ddp_launcher.core.errors import UserError


def wandb_credentials_exist() -> bool:
    """Whether W&B could log in without prompting: WANDB_API_KEY or a netrc entry for its host."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


def resolve_wandb_mode(mode: Any) -> str:
    """online / offline / disabled from a `wandb.mode` value (a string, or an enum of an app's
    typed config); `auto` is online when credentials exist, else offline."""
    mode = str(getattr(mode, "value", mode))
    if mode == "auto":
        return "online" if wandb_credentials_exist() else "offline"
    if mode not in ("online", "offline", "disabled"):
        raise UserError(f"wandb.mode={mode} is not valid: use auto, online, offline or disabled")
    return mode
