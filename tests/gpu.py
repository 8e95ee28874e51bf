"""The machine's own GPUs, for the tests marked `gpu`: the suite hides them from itself and from
every process a test starts (tests/suite_plugin.py: pin_to_the_cpu), so a GPU test runs its GPU
work in a process given them back (`gpu_env`, `on_gpu`). No torch import: tests/suite_plugin.py
uses it."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import Any

MACHINE_CUDA_ENV = "HYDRA_DDP_TEST_MACHINE_CUDA_VISIBLE_DEVICES"  # the value before the suite's
MACHINE_GPUS_ENV = "HYDRA_DDP_TEST_MACHINE_GPUS"  # how many GPUs that value showed
UNSET = "<unset>"


def machine_gpus() -> int:
    """GPUs the machine showed before the suite hid them (0 outside a pytest run)."""
    return int(os.environ.get(MACHINE_GPUS_ENV, "0"))


def gpu_env(env: dict[str, str]) -> dict[str, str]:
    """`env` (e.g. tests/helpers.py's run_env()) with the machine's CUDA_VISIBLE_DEVICES back."""
    env = dict(env)
    machine = os.environ.get(MACHINE_CUDA_ENV, UNSET)
    if machine == UNSET:
        env.pop("CUDA_VISIBLE_DEVICES", None)
    else:
        env["CUDA_VISIBLE_DEVICES"] = machine
    return env


def _see_the_machines_gpus() -> None:
    machine = gpu_env(dict(os.environ))
    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    os.environ.update(machine)


def on_gpu(fn: Callable, *args: Any, timeout: float = 600) -> Any:
    """fn(*args) (fn importable: a module-level function) in a fresh interpreter that sees the
    machine's GPUs; its return value, or its exception raised here."""
    # The variable is read when CUDA starts, so it must be back before the child's first CUDA
    # call: the pool's initializer runs before any task.
    with ProcessPoolExecutor(
        1, mp_context=multiprocessing.get_context("spawn"), initializer=_see_the_machines_gpus
    ) as pool:
        return pool.submit(fn, *args).result(timeout=timeout)
