"""Rank 0's record of a run: metrics.jsonl, result.json and the W&B run.

Every other rank gets a RunLogger that does nothing, so train.py calls it unconditionally.
W&B problems never stop training: init has a timeout, and a failure is a warning.
"""

from __future__ import annotations

import json
import logging
import netrc
import os
import platform
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
RESULT_FILE = "result.json"


def wandb_credentials_exist() -> bool:
    """Whether W&B could log in without prompting: WANDB_API_KEY or a netrc entry for its host."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


def resolve_wandb_mode(mode: str) -> str:
    if mode == "auto":
        return "online" if wandb_credentials_exist() else "offline"
    if mode not in ("online", "offline", "disabled"):
        raise ValueError(f"wandb.mode={mode} is not valid: use auto, online, offline or disabled")
    return mode


def git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=5,
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def run_facts(world_size: int, per_rank_batch: int, device: torch.device) -> dict[str, Any]:
    """Derived facts stored beside the config so every W&B run says how it was run."""
    return {
        "world_size": world_size,
        "per_rank_batch_size": per_rank_batch,
        "device_type": device.type,
        "git_commit": git_commit(),
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "gpu_name": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "hostname": platform.node(),
    }


def wandb_group_and_name(group: str | None, name: str | None) -> tuple[str | None, str | None]:
    """Defaults from Hydra: a sweep's jobs share one group (the experiment's name, else the sweep
    dir's timestamp); a run is named by its overrides (`model=resnet18,optim.lr=0.1`)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return group, name
    hc = HydraConfig.get()
    experiment = hc.runtime.choices.get("experiment")
    if group is None and hc.mode == RunMode.MULTIRUN:
        stamp = "_".join(Path(hc.sweep.dir).parts[-2:])
        group = f"{experiment or 'sweep'}-{stamp}"
    elif group is None:
        group = experiment
    if name is None:
        name = hc.job.override_dirname or None
        if name and hc.mode == RunMode.MULTIRUN:
            name = f"{hc.job.num}:{name}"
    return group, name


class RunLogger:
    """Rank 0's metrics.jsonl and W&B run. On resume, rows the earlier attempt already logged
    (same step, same kind) are not logged again: a resumed run recomputes them identically, so
    metrics.jsonl and the W&B history keep every step exactly once."""

    def __init__(
        self,
        run_dir: Path,
        cfg: DictConfig,
        *,
        enabled: bool,
        facts: dict[str, Any],
        resuming: bool = False,
        wandb_run_id: str | None = None,
    ):
        self.enabled = enabled
        self.run_dir = run_dir
        self.metrics_path = run_dir / METRICS_FILE
        self.wandb = None
        self.logged: set[tuple[int, str]] = set()
        if not enabled:
            return
        earlier = self._rows_already_logged() if resuming else []
        self.logged = {(row["step"], self._kind(row)) for row in earlier}
        # Line-buffered, so a killed run keeps every row it logged.
        self._file = open(self.metrics_path, "a", buffering=1)  # noqa: SIM115 - closed in finish()
        self._init_wandb(cfg, facts, wandb_run_id)
        if earlier and self.wandb is not None:
            self._replay_into_wandb(earlier)

    @staticmethod
    def _kind(row: dict[str, Any]) -> str:
        return "val" if "val/acc" in row else "train"

    def _rows_already_logged(self) -> list[dict[str, Any]]:
        """Every whole row of metrics.jsonl; a line torn by a kill is dropped from the file."""
        if not self.metrics_path.exists():
            return []
        kept, rows = [], []
        for line in self.metrics_path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
            kept.append(line)
        tmp = self.metrics_path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(f"{line}\n" for line in kept))
        os.replace(tmp, self.metrics_path)
        return rows

    def _replay_into_wandb(self, rows: list[dict[str, Any]]) -> None:
        """A killed process loses what W&B had not yet flushed; metrics.jsonl (line-buffered)
        has it all. Online, W&B says where its history ends (`starting_step`) and we send the
        rest; offline there is no such answer, so this attempt's run gets the whole history
        (`wandb sync` keeps the first copy of a step, so nothing is doubled)."""
        start = self.wandb.starting_step if not self.wandb.settings._offline else 0
        missing = [row for row in rows if row["step"] >= start]
        for row in missing:
            self.wandb.log(row, step=row["step"])
        log.info("W&B: replayed %d row(s) from metrics.jsonl (steps >= %d)", len(missing), start)

    @property
    def wandb_run_id(self) -> str | None:
        return self.wandb.id if self.wandb is not None else None

    def _init_wandb(self, cfg: DictConfig, facts: dict[str, Any], run_id: str | None) -> None:
        w = cfg.wandb
        mode = resolve_wandb_mode(w.mode)
        if mode == "disabled":
            return
        try:
            import wandb

            config = OmegaConf.to_container(cfg, resolve=True)
            config["run"] = facts
            group, name = wandb_group_and_name(w.group, w.name)
            self.wandb = wandb.init(
                project=w.project,
                entity=w.entity,
                group=group,
                name=name,
                job_type=w.job_type,
                tags=list(w.tags),
                config=config,
                dir=str(self.run_dir),
                mode=mode,
                id=run_id,
                resume="allow" if run_id else None,
                settings=wandb.Settings(init_timeout=w.init_timeout_s, console="off"),
            )
            # Val metrics are plotted per epoch; val/acc's run summary is its best value.
            self.wandb.define_metric("epoch")
            self.wandb.define_metric("val/*", step_metric="epoch")
            self.wandb.define_metric("val/acc", step_metric="epoch", summary="max")
            log.info("W&B run %s (%s mode) in %s", self.wandb.id, mode, self.wandb.dir)
        except Exception as e:  # noqa: BLE001 - any W&B failure must leave training running
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            log.warning("W&B init failed, training goes on without it: %s", first[:200])
            self.wandb = None

    def log(self, row: dict[str, Any]) -> None:
        if not self.enabled or (row["step"], self._kind(row)) in self.logged:
            return
        self._file.write(json.dumps(row) + "\n")
        if self.wandb is not None:
            self.wandb.log(row, step=row["step"])

    def write_result(self, result: dict[str, Any]) -> None:
        if self.enabled:
            tmp = self.run_dir / f".{RESULT_FILE}.tmp"
            tmp.write_text(json.dumps(result, indent=2))
            os.replace(tmp, self.run_dir / RESULT_FILE)

    def finish(self, status: str) -> None:
        """Close the run; W&B shows failed runs as failed and preempted ones as preempted."""
        if not self.enabled:
            return
        self._file.close()
        if self.wandb is not None:
            try:
                if status == "preempted":
                    self.wandb.mark_preempting()
                self.wandb.finish(exit_code={"completed": 0, "preempted": 75}.get(status, 1))
            except Exception as e:  # noqa: BLE001
                log.warning("W&B finish failed: %s", e)
