"""The search space: Hydra's override grammar (`hydra.sweeper.params` and the sweep's arguments),
parsed by Hydra's own OverridesParser, to Optuna distributions, read as hydra-optuna-sweeper 1.3
reads it so that existing configs keep their meaning:

* `interval(a, b)`: FloatDistribution (IntDistribution with int bounds: `int(interval(a, b))`);
  `tag(log, interval(a, b))` on a log scale;
* `choice(x, y, ...)`: CategoricalDistribution; `range(a, b, step)`: IntDistribution (a float
  one with a float bound or step) with `b` included, as the plugin has it; shuffled: categorical;
* anything else (`key=value`): a fixed parameter, passed to every trial as is.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ddp_launcher.core.errors import UserError

CHOICE_TYPES = (str, int, float, bool, type(None))


def distribution(override: Any) -> Any:
    """The Optuna distribution of one parsed sweep override (hydra's Override)."""
    from hydra.core.override_parser.types import Transformer
    from optuna.distributions import (
        CategoricalDistribution,
        FloatDistribution,
        IntDistribution,
    )

    key, value = override.get_key_element(), override.value()

    def choices() -> list[Any]:
        items = list(override.sweep_iterator(transformer=Transformer.encode))
        for item in items:
            if not isinstance(item, CHOICE_TYPES):
                raise UserError(
                    f"hydra.sweeper.params.{key}: a choice holds str, int, float, bool or null "
                    f"values, not {type(item).__name__}: list plain values"
                )
        return items

    if override.is_choice_sweep():
        return CategoricalDistribution(choices())
    if override.is_range_sweep():
        if value.shuffle:
            return CategoricalDistribution(choices())
        if any(isinstance(x, float) for x in (value.start, value.stop, value.step)):
            return FloatDistribution(value.start, value.stop, step=value.step)
        return IntDistribution(int(value.start), int(value.stop), step=int(value.step))
    if override.is_interval_sweep():
        log = "log" in value.tags
        if isinstance(value.start, int) and isinstance(value.end, int):
            return IntDistribution(value.start, value.end, log=log)
        return FloatDistribution(value.start, value.end, log=log)
    raise UserError(
        f"hydra.sweeper.params.{key}: {override.get_value_element_as_str()} is no Optuna "
        "search space: use interval(a, b), int(interval(a, b)), tag(log, interval(a, b)), "
        "choice(...) or range(a, b, step)"
    )


def search_space(
    params: Mapping[str, Any] | None, arguments: Iterable[str]
) -> tuple[dict[str, Any], dict[str, str]]:
    """({key: distribution}, {key: fixed value}) from `hydra.sweeper.params` and the sweep's
    command-line arguments (which come later, so they win). A key both swept and fixed is
    fixed."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    lines = [f"{key}={value}" for key, value in (params or {}).items()] + list(arguments)
    space: dict[str, Any] = {}
    fixed: dict[str, str] = {}
    for override in OverridesParser.create().parse_overrides(lines):
        key = override.get_key_element()
        space.pop(key, None)
        fixed.pop(key, None)
        if override.is_sweep_override():
            space[key] = distribution(override)
        else:
            fixed[key] = override.get_value_element_as_str()
    return space, fixed


def trial_overrides(params: Mapping[str, Any], fixed: Mapping[str, str]) -> list[str]:
    """A trial's job overrides: its sampled values, then the fixed ones."""
    return [f"{key}={value}" for key, value in {**params, **fixed}.items()]
