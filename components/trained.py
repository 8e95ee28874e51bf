"""What a checkpoint says about the run that made it, for eval.py: which file, the config it was
trained with (plus a command line's overrides), its weights. Bad input is a one-line UserError
naming the setting to change."""

from __future__ import annotations

import dataclasses
from enum import Enum
from pathlib import Path
from typing import Any

import torch
from ddp_launcher import UserError, one_line
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, ValidationError

from components.checkpoint import load_checkpoint
from data.datasets import LOADER_KEYS

# Keys of eval.py's own config, never taken into the trained config. `dist` too: the world
# size of an evaluation is its own, whatever the training run's was.
EVAL_KEYS = ("run", "ckpt", "split", "predictions", "dist", "hydra")


def load_trained(path: Path) -> dict[str, Any]:
    """The checkpoint (weights_only=True), checked to carry the config it was trained with."""
    ckpt = load_checkpoint(path, key="ckpt")
    if not isinstance(ckpt.get("config"), str):
        raise UserError(
            f"checkpoint {path} carries no config (saved by an older version): "
            "evaluate a checkpoint of a run trained since"
        )
    return ckpt


def trained_config(ckpt: dict[str, Any], cfg: DictConfig, overrides: list[str]) -> DictConfig:
    """The config the checkpoint was trained with, with this command line's `overrides` on top.

    eval.py's own config (`cfg`) holds each override as Hydra parsed it. A group choice
    (`model=resnet18`) replaces the whole group, checked against its schema; any other key must
    exist in the trained config (else it is a typo; `+key=` adds one) and keep its type.
    `dist` is always `cfg`'s: the world size of an evaluation is its own.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    trained = OmegaConf.create(ckpt["config"])
    parsed = [
        o
        for o in OverridesParser.create().parse_overrides(overrides)
        if o.key_or_group.split(".")[0].split("/")[0] not in EVAL_KEYS
    ]
    groups = {
        o.key_or_group
        for o in parsed
        if "." not in o.key_or_group
        and isinstance(OmegaConf.select(cfg, o.key_or_group), DictConfig)
    }
    for group in groups:
        trained[group] = _checked_group(group, cfg[group])
    for o in parsed:
        key = o.key_or_group
        if key.split(".")[0] in groups:
            continue  # in its chosen group already
        parent, _, leaf = key.rpartition(".")
        node = OmegaConf.select(trained, parent) if parent else trained
        if o.is_delete():
            if isinstance(node, DictConfig) and leaf in node:
                del node[leaf]
            continue
        addable = o.is_add() or (parent == "dataset" and leaf in LOADER_KEYS)  # any dataset's
        if not isinstance(node, DictConfig) or (leaf not in node and not addable):
            known = ", ".join(sorted(node)) if isinstance(node, DictConfig) else "none"
            raise UserError(
                f"{key} is not in the config the checkpoint was trained with "
                f"(keys there: {known}): fix the spelling, or add it with "
                f"+{key}="
            )
        new = OmegaConf.select(cfg, key)
        new = OmegaConf.to_container(new, resolve=True) if OmegaConf.is_config(new) else new
        OmegaConf.update(
            trained, key, _same_type(key, node.get(leaf), new), merge=False, force_add=True
        )
    trained.dist = OmegaConf.to_container(cfg.dist, resolve=True)
    return trained


def _checked_group(group: str, node: DictConfig) -> dict:
    """A group chosen on the command line, checked against its schema (eval.py's model and
    dataset nodes take any key, so Hydra could not check them)."""
    schema = OmegaConf.get_type(node)
    plain = OmegaConf.to_container(node, resolve=True)
    if dataclasses.is_dataclass(schema):
        try:
            OmegaConf.merge(OmegaConf.structured(schema), plain)
        except (ConfigKeyError, ValidationError) as e:
            raise UserError(f"{group}: {one_line(e)}: fix the override") from None
    return plain


def _same_type(key: str, old: Any, new: Any) -> Any:
    """`new` as the type of the trained value `old` (a UserError where it cannot be)."""
    if isinstance(new, Enum):  # a choice of the schema (wandb.mode): its name, as in YAML
        new = new.name
    if old is None or new is None:
        return new
    if isinstance(old, str):
        return new if isinstance(new, str) else str(new)
    if isinstance(old, bool) == isinstance(new, bool) and isinstance(new, int | float):
        if isinstance(old, bool | float):
            return type(old)(new)
        if isinstance(old, int) and float(new).is_integer():
            return int(new)
    if isinstance(old, list | dict) and isinstance(new, type(old)):
        return new
    raise UserError(
        f"{key}={new!r} does not fit the trained config's {key}: {old!r} "
        f"({type(old).__name__}): give a {type(old).__name__}"
    )


def load_weights(model: torch.nn.Module, ckpt: dict[str, Any], path: Path) -> None:
    try:
        model.load_state_dict(ckpt["model"])
    except (RuntimeError, KeyError, ValueError, TypeError) as e:
        raise UserError(
            f"checkpoint {path} does not fit this model ({' '.join(str(e).split())[:200]}): "
            "evaluate with the model it was trained with (drop the model overrides)"
        ) from None
