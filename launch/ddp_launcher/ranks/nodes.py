"""A rank's view of the other nodes of its job (torchrun's or slurm_task.py's WORLD_SIZE and
LOCAL_WORLD_SIZE): which network interface gloo listens on, and which node a failed collective
lost. Public as `ddp_launcher.choose_gloo_interface` and `ddp_launcher.lost_node`: an app's rank
calls the first before it joins its process group, the second with a collective's error.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
from datetime import timedelta
from typing import Any

from hydra.errors import CompactHydraException

from ddp_launcher.core.network import (
    GLOO_IFNAME_ENV,
    gloo_interface,
    interface_addresses,
    is_loopback,
)
from ddp_launcher.core.world import started_as_rank

log = logging.getLogger(__name__)

# NCCL's own choice where the app left it unset: how a rank learns that a collective failed.
NCCL_ERROR_HANDLING_ENV = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
# 2 (CleanUpOnly): NCCL's watchdog aborts the communicators and the failed collective raises in
# the rank, which can say which node went. torch's default (3, SkipCleanUp) ends the process
# with SIGABRT from the watchdog's thread: no error of its own, no line.
NCCL_RAISES = "2"


def spans_nodes() -> bool:
    """Whether this rank's job runs on more than one node."""
    world_size = int(os.environ.get("WORLD_SIZE") or 1)
    return started_as_rank() and world_size > int(os.environ.get("LOCAL_WORLD_SIZE") or world_size)


def choose_gloo_interface() -> None:
    """Before a rank joins its process group, in a job that spans nodes: GLOO_SOCKET_IFNAME,
    unless set, is the interface the other nodes reach this one on (ddp_launcher/core/network.py),
    not gloo's default, the address of this node's hostname, which may be a loopback address.
    It serves a NCCL job's gloo group too; NCCL's failed collectives raise (NCCL_RAISES)."""
    if not spans_nodes():
        return
    os.environ.setdefault(NCCL_ERROR_HANDLING_ENV, NCCL_RAISES)
    if os.environ.get(GLOO_IFNAME_ENV):
        return
    name, why = gloo_interface(os.environ["MASTER_ADDR"])
    if name is None:
        if why:
            log.warning("%s", why)
        return
    os.environ[GLOO_IFNAME_ENV] = name
    log.info("gloo listens on %s: %s (%s chooses another)", name, why, GLOO_IFNAME_ENV)


class LostNode(CompactHydraException):
    """A collective lost its connections to the ranks of another node: they died or the node
    went down. One line (not the user's to fix: a launcher may retry it)."""


# A gloo pair's error names its peer: "Read error [10.0.0.2]:4711: Connection reset by peer".
PEER_ADDRESS = re.compile(r"\[([0-9A-Fa-f.:]+)\]:\d+")
LOST_CONNECTION = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")
# NCCL's errors when a peer's process or its network went (ncclRemoteError, an aborted
# communicator, the watchdog's timeout): they name no peer.
NCCL_LOST = (
    "remote process exited or there was a network error",
    "ncclRemoteError",
    "NCCL communicator was aborted",
    "Watchdog caught collective operation timeout",
)
# Where a rank that lost another node says which, for the ranks of its node that only see it go.
LOST_NODE_KEY = "hydra_ddp/lost_node"
LOST_NODE_WAIT_S = 3.0


def lost_node(error: BaseException, cpu_group: Any = None) -> LostNode | None:
    """A LostNode for a collective's error that lost another node of a job that spans nodes;
    None for any other error (or a job on one node). A gloo error names its peer; NCCL's do
    not, so a NCCL error is followed by one barrier on the job's gloo group (`cpu_group`),
    whose error names the node that went."""
    if not spans_nodes():
        return None
    text = str(error)
    if cpu_group is not None and any(w in text for w in NCCL_LOST):
        try:
            import torch.distributed as dist

            dist.barrier(group=cpu_group)
        except RuntimeError as probe:  # (torch's DistBackendError is one)
            return lost_node(probe)
        return None
    match = PEER_ADDRESS.search(text)
    if match is None or not any(w in text for w in LOST_CONNECTION):
        return None
    address = match.group(1)
    own = {a for held in interface_addresses().values() for a in held}
    if is_loopback(address) or address in own:
        where = told_lost_node()
        if where is None:
            return None  # a peer on this node failed: its own error says why
    else:
        try:
            where = f"{socket.gethostbyaddr(address)[0]} ({address})"
        except OSError:
            where = address
        tell_lost_node(where)
    # (worded so that ddp_launcher/core/errors.py's lost_a_peer does not take it for a rank
    # that only lost a peer: this is the cause the launcher reports)
    return LostNode(
        f"lost node {where}: the connections to its ranks broke, they died or the node went "
        "down; the run continues from its last checkpoint with resume=auto"
    )


def job_store() -> Any:
    """The store of the default process group (still served while its host lives), or None.
    torch has no public getter for the store init_process_group made (env://)."""
    import torch.distributed as dist

    try:
        store = dist.distributed_c10d._get_default_store()
        store.set_timeout(timedelta(seconds=LOST_NODE_WAIT_S))
    except (ValueError, RuntimeError):
        return None
    return store


def tell_lost_node(where: str) -> None:
    store = job_store()
    with contextlib.suppress(RuntimeError):  # (torch's DistStoreError is one)
        if store is not None:
            store.set(LOST_NODE_KEY, where)


def told_lost_node() -> str | None:
    """The node another rank found lost, if one says so within LOST_NODE_WAIT_S."""
    store = job_store()
    try:
        if store is not None:
            store.wait([LOST_NODE_KEY])
            return store.get(LOST_NODE_KEY).decode()
    except RuntimeError:
        pass
    return None
