"""One W&B service (wandb-core) for many runs, started before it is needed.

W&B's documented hand-off: a process whose environment has WANDB_SERVICE connects to that service
instead of starting its own (`wandb beta core start` prints such a token). We start it with the
function behind that command, without its detached mode, so the service ends with the process that
started it: the warm interpreter of a sweep (ddp_launcher/ranks/warm.py: every job of the sweep uses
it), or a single run's own process, where it starts in a thread while torch imports
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
    from ddp_launcher.core.wandb_mode import resolve_wandb_mode

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
    still imports its HTTP exporters and starts two export threads in every run's process.
    The system charts show this process's GPUs only (gpu_device_ids), not all of the node's."""
    if mode != "online":
        wandb.setup(settings=wandb.Settings(mode=mode))
    return wandb.Settings(
        init_timeout=init_timeout_s,
        console="off",
        silent=True,
        x_save_requirements=False,
        disable_git=True,
        save_code=False,
        x_stats_gpu_device_ids=gpu_device_ids(),
    )


def gpu_device_ids() -> list[int] | None:
    """The NVML indices of the GPUs CUDA_VISIBLE_DEVICES gives this process: W&B's GPU monitor
    reads the node's GPUs through NVML, which ignores the variable, and charts those whose
    NVML index x_stats_gpu_device_ids lists (wandb's gpu_stats: NvidiaGpu::get_metrics).
    None (every GPU): the variable unset or empty, or entries with no known NVML index."""
    from ddp_launcher.core.world import cuda_visible

    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    entries = cuda_visible(value) if value is not None else []
    if not entries:  # W&B takes an empty list for "every GPU" too
        return None
    if all(entry.isdigit() for entry in entries):
        # CUDA's ordinals as NVML's indices, as torch takes them (torch.cuda's
        # _get_nvml_device_index): the same order with CUDA_DEVICE_ORDER=PCI_BUS_ID, and with
        # CUDA's default too on a node of one GPU model (ties are ordered by PCI bus).
        return [int(entry) for entry in entries]
    return _nvml_indices(entries)


def _nvml_indices(entries: list[str]) -> list[int] | None:
    """GPU UUIDs (GPU-...) and MIG instances (MIG-...), or unique prefixes of them as CUDA
    takes them, as the NVML indices of their GPUs, read with nvidia-ml-py (pynvml) where it is
    installed. Without it, None: neither torch nor W&B has a public NVML binding to ask (torch
    reads UUIDs through a private ctypes helper, W&B's monitor is a Rust binary)."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            owners = []  # (UUID, NVML index of its GPU) for every GPU and MIG instance
            for index in range(pynvml.nvmlDeviceGetCount()):
                gpu = pynvml.nvmlDeviceGetHandleByIndex(index)
                owners.append((_text(pynvml.nvmlDeviceGetUUID(gpu)), index))
                for mig in _mig_devices(pynvml, gpu):
                    owners.append((_text(pynvml.nvmlDeviceGetUUID(mig)), index))
        finally:
            pynvml.nvmlShutdown()
    except pynvml.NVMLError as e:
        log.debug("NVML cannot map CUDA_VISIBLE_DEVICES to GPU indices: %s", e)
        return None
    indices: list[int] = []
    for entry in entries:
        matches = [index for uuid, index in owners if uuid.startswith(entry)]
        if len(matches) != 1:  # unknown or ambiguous: CUDA would not take it either
            return None
        if matches[0] not in indices:  # MIG instances of one GPU: that GPU once
            indices.append(matches[0])
    return indices


def _mig_devices(pynvml: Any, gpu: Any) -> list[Any]:
    try:
        slots = pynvml.nvmlDeviceGetMaxMigDeviceCount(gpu)
    except pynvml.NVMLError:  # no MIG on this GPU
        return []
    found = []
    for slot in range(slots):
        try:
            found.append(pynvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, slot))
        except pynvml.NVMLError:  # an empty slot
            continue
    return found


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value  # older pynvml gives bytes


def wait_for_service() -> None:
    """Before wandb.init: let a service being started finish (else init starts a second)."""
    if _starting is not None:
        _starting.join()


def wandb_settings(wandb: Any, mode: str, init_timeout_s: float) -> Any:
    """The public `ddp_launcher.wandb_settings`: what an app's rank passes to wandb.init as
    `settings` (run_settings), once the W&B service this process or its sweep started early is
    up (else wandb.init would start a second one)."""
    wait_for_service()
    return run_settings(wandb, mode, init_timeout_s)
