"""What a checkpoint says about the run that made it, for eval.py: which file, the config it was
trained with (plus a command line's overrides), its weights. Bad input is a one-line UserError
naming the setting to change."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from components.checkpoint import BEST, load_checkpoint
from components.errors import UserError, one_line
from components.run_dir import CHECKPOINT_DIR

# Keys of eval.py's own config, never taken into the trained config. `dist` too: the world
# size of an evaluation is its own, whatever the training run's was.
EVAL_KEYS = ("run", "ckpt", "split", "predictions", "dist", "hydra")


def find_checkpoint(run: str | None, ckpt: str | None) -> Path:
    """`ckpt=<file>`, else `run=<training run dir>`'s checkpoints/best.pt."""
    if ckpt:
        path = Path(ckpt).expanduser()
        if not path.is_file():
            raise UserError(f"ckpt={ckpt}: no such file: pass ckpt=<a checkpoint file>, or "
                            "run=<a training run dir>")  # fmt: skip
        return path
    if not run:
        raise UserError("which checkpoint? pass run=<a training run dir> (its best.pt) or "
                        "ckpt=<a checkpoint file>")  # fmt: skip
    run_dir = Path(run).expanduser()
    if not run_dir.is_dir():
        raise UserError(f"run={run}: no such run dir: pass run=<a training run dir> or "
                        "ckpt=<a checkpoint file>")  # fmt: skip
    path = run_dir / CHECKPOINT_DIR / BEST
    if not path.is_file():
        raise UserError(f"run={run} has no {CHECKPOINT_DIR}/{BEST} (no epoch finished): pass "
                        f"ckpt=<one of its checkpoints> or another run=")  # fmt: skip
    return path


def load_trained(path: Path) -> dict[str, Any]:
    """The checkpoint (weights_only=True), checked to carry the config it was trained with."""
    ckpt = load_checkpoint(path, key="ckpt")
    if not isinstance(ckpt.get("config"), str):
        raise UserError(f"checkpoint {path} carries no config (saved by an older version): "
                        "evaluate a checkpoint of a run trained since")  # fmt: skip
    return ckpt


def trained_config(ckpt: dict[str, Any], cfg: DictConfig, overrides: list[str]) -> DictConfig:
    """The config the checkpoint was trained with, with this command line's `overrides` on top:
    each overridden key takes its value from `cfg` (eval.py's composed config, where it was
    typed and checked), a group override (`model=...`) the whole group. `dist` is `cfg`'s."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    trained = OmegaConf.create(ckpt["config"])
    for override in OverridesParser.create().parse_overrides(overrides):
        key = override.key_or_group
        if key.split(".")[0].split("/")[0] in EVAL_KEYS or override.is_delete():
            continue
        value = OmegaConf.select(cfg, key, default=None)
        if value is None and OmegaConf.select(trained, key, default=None) is None:
            continue  # a package-global group (experiment=...): nothing of its own to take
        if isinstance(value, DictConfig):
            value = OmegaConf.to_container(value, resolve=True)
        OmegaConf.update(trained, key, copy.deepcopy(value), merge=False, force_add=True)
    trained.dist = OmegaConf.to_container(cfg.dist, resolve=True)
    return trained


def load_weights(model: torch.nn.Module, ckpt: dict[str, Any], path: Path) -> None:
    try:
        model.load_state_dict(ckpt["model"])
    except (RuntimeError, KeyError, ValueError, TypeError) as e:
        raise UserError(
            f"checkpoint {path} does not fit this model ({one_line(e)[:160]}): evaluate with "
            "the model it was trained with (drop the model overrides)"
        ) from None
