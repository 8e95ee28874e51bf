"""A real one-node SLURM cluster for the tests: Debian's slurm-wlm and munge, started as root.

`slurm_cluster` (session fixture) installs the packages when they are missing (as root, with
apt-get; HYDRA_DDP_INSTALL_SLURM=0 forbids it, and the SLURM tests skip), writes a
slurm.conf for this machine (its real CPUs and memory, proctrack/linuxproc, task/affinity
binding each task to its cores as clusters that bind CPUs do, select/cons_tres,
SlurmUser=root, JobRequeue=1) into a temp dir that also holds every state, spool, log and pid
file, starts munged (its own socket and key), slurmctld and slurmd on free
ports, waits until `sinfo` shows the node idle, and stops all three afterwards. Nothing outside
the temp dir is touched besides the package installation: commands reach this cluster through
`SLURM_CONF` (`cluster.env`), so another cluster on the machine is not disturbed.

The fixture skips (with the reason) when not root, when SLURM is missing and installing it is
forbidden, or when apt cannot install the packages; the run's last line says how many SLURM
tests skipped, why, and how to run them (tests/suite_plugin.py).
Standalone, for poking at it by hand: `python -m tests.slurm_cluster` starts one and waits.

`slurm_two_nodes` (session fixture) is a two-node cluster on tests/hosts.py's hosts: a slurmd on
each host (NodeName = the host's name, NodeAddr = its address), slurmctld and munged on the
first host (munged's socket is a file every host sees, as its key would be on a cluster).
Commands reach it from the first host, the cluster's login node (`cluster.run`: the launcher
and sbatch run there). Its daemons die with the test process, as everything on a host does. It
skips when the hosts or the cluster cannot be had.
"""

from __future__ import annotations

import fcntl
import functools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.helpers import free_port

if TYPE_CHECKING:
    from tests.hosts import Hosts

COMMANDS = (
    "munged",
    "slurmctld",
    "slurmd",
    "sbatch",
    "srun",
    "squeue",
    "sinfo",
    "scontrol",
    "scancel",
)
PACKAGES = ("slurm-wlm", "munge")
INSTALL_ENV = "HYDRA_DDP_INSTALL_SLURM"  # =0: the fixture must not apt-get install PACKAGES
SKIP_REASON = "no SLURM test cluster"  # how every skip of a SLURM test starts
# A requeued job may start once its old credentials have expired (AuthInfo cred_expire, 120 s
# by default; a requeued job waits cred_expire + 1 s): 5 s here, the least SLURM accepts (below
# it falls back to 120 s), and a scheduler that looks every second, keep requeue tests short.
CRED_EXPIRE_S = 5


class ClusterUnavailable(Exception):
    """The cluster cannot be had on this machine (a reason to skip, not a failure)."""


@dataclass
class SlurmCluster:
    root: Path
    node: str
    cpus: int
    memory_mb: int
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    # How a command reaches the cluster: as it is, or on the login host (tests/hosts.py)
    login: Callable[[list[str]], list[str]] | None = None
    hosted: set[str] = field(default_factory=set)  # daemons started on a host

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """What a process needs to talk to this cluster (pass to subprocesses)."""
        return {"SLURM_CONF": str(self.conf)}

    def run(self, *cmd: str, timeout: float = 60, cwd: Path | None = None, **env: str):
        """Run a command against this cluster (extra keyword arguments: environment)."""
        return subprocess.run(
            self.login(list(cmd)) if self.login else cmd,
            env={**os.environ, **env, **self.env},
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def node_state(self) -> str:
        """The nodes' state ("idle"), or their states ("allocated idle")."""
        proc = self.run("sinfo", "--noheader", "--Node", "--format=%T")
        return " ".join(sorted(set(proc.stdout.split()))) if proc.returncode == 0 else ""

    def job_ids(self) -> list[str]:
        proc = self.run("squeue", "--noheader", "--array", "--format=%i")
        return proc.stdout.split() if proc.returncode == 0 else []

    def wait_until_idle(self, timeout: float = 120) -> None:
        """No jobs left and the node idle (jobs of one test never overlap the next test's)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if not self.job_ids() and self.node_state() == "idle":
                return
            time.sleep(0.2)
        raise AssertionError(f"cluster not idle after {timeout} s: {self.job_ids()}\n{self.logs()}")

    def logs(self, lines: int = 30) -> str:
        out = []
        for path in sorted(self.root.glob("log/*.log")):
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            out += [f"--- {path.name}", *tail]
        return "\n".join(out)


def install() -> None:
    """apt-get install the packages when a command is missing, unless INSTALL_ENV=0 forbids
    it; ClusterUnavailable then, or if it fails. One install at a time: both clusters' fixtures
    may start at once, on two xdist workers, and apt-get fails on a held dpkg lock."""
    lock = Path(tempfile.gettempdir()) / "hydra-ddp-slurm-install.lock"
    with open(lock, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        install_unlocked()


def install_unlocked() -> None:
    missing = [c for c in COMMANDS if not shutil.which(c)]
    if not missing:
        return
    if os.environ.get(INSTALL_ENV) == "0":
        raise ClusterUnavailable(
            f"SLURM is not installed ({', '.join(missing)} missing) and {INSTALL_ENV}=0 "
            f"forbids installing {' '.join(PACKAGES)}"
        )
    if not shutil.which("apt-get"):
        raise ClusterUnavailable("SLURM is not installed and there is no apt-get to install it")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    cmd = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]
    proc = None
    for step in ([], ["apt-get", "update", "-q"]):  # the package lists may be stale or absent
        if step:
            subprocess.run(step, env=env, capture_output=True, text=True, timeout=600)
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if proc.returncode == 0 and all(shutil.which(c) for c in COMMANDS):
            return
    tail = " | ".join((proc.stdout + proc.stderr).strip().splitlines()[-3:]) if proc else ""
    raise ClusterUnavailable(f"apt-get could not install {' '.join(PACKAGES)}: {tail}")


def node_hardware() -> tuple[int, int, str]:
    """(CPUs, RealMemory MB, the topology part of `slurmd -C`) of this machine."""
    out = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, timeout=60).stdout
    line = next((x for x in out.splitlines() if x.startswith("NodeName=")), "")
    fields = dict(item.split("=", 1) for item in line.split() if "=" in item)
    cpus = int(fields.get("CPUs", os.cpu_count() or 1))
    memory = int(fields.get("RealMemory", 1024))
    keep = ("CPUs", "Boards", "SocketsPerBoard", "CoresPerSocket", "ThreadsPerCore")
    topology = " ".join(f"{k}={fields[k]}" for k in keep if k in fields) or f"CPUs={cpus}"
    return cpus, memory, topology


def write_config(root: Path, nodes: dict[str, str], topology: str, memory_mb: int) -> None:
    """slurm.conf for `nodes` (name -> address), each with this machine's CPUs and memory;
    slurmctld on the first node's address."""
    for sub in ("state", "spool", "log", "munge", *(f"spool/{n}" for n in nodes)):
        (root / sub).mkdir(parents=True, exist_ok=True)
    os.chmod(root / "munge", 0o755)
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    os.chmod(key, 0o600)
    first = next(iter(nodes))
    node_lines = "\n".join(
        f"NodeName={name} NodeAddr={address} {topology} RealMemory={memory_mb} State=UNKNOWN"
        for name, address in nodes.items()
    )
    (root / "slurm.conf").write_text(
        f"""\
# Test cluster (tests/slurm_cluster.py): every path is under {root}
ClusterName=hydra-ddp-test
SlurmctldHost={first}({nodes[first]})
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/munge.socket,cred_expire={CRED_EXPIRE_S}
StateSaveLocation={root}/state
# %n: the node's name (each slurmd its own, on a file system they share)
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
# Each task bound to its cores (sched_setaffinity): it runs on the CPUs its srun asked for
TaskPlugin=task/affinity
TaskPluginParam=Cores
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=1
JobRequeue=1
ReturnToService=2
MpiDefault=none
SwitchType=switch/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MinJobAge=600
KillWait=10
InactiveLimit=0
{node_lines}
PartitionName=debug Nodes={",".join(nodes)} Default=YES MaxTime=INFINITE State=UP
"""
    )


def start(root: Path, hosts: Hosts | None = None) -> SlurmCluster:
    """Install if needed, configure and start munged, slurmctld and slurmd; wait until every
    node is idle. With `hosts`, one node per host (see the module docstring)."""
    if os.geteuid() != 0:
        raise ClusterUnavailable("the SLURM test cluster runs its daemons as root: not root")
    install()
    cpus, memory, topology = node_hardware()
    if hosts is None:
        node = socket.gethostname().split(".")[0]
        nodes, login = {node: "127.0.0.1"}, None
    else:
        nodes = {h.name: h.address for h in hosts.hosts}
        node, first = hosts.hosts[0].name, hosts.hosts[0]
        login = functools.partial(hosts.command, first)
    write_config(root, nodes, topology, memory)
    cluster = SlurmCluster(root, node, cpus, memory, login=login)
    env = {**os.environ, **cluster.env}
    munge = root / "munge"

    def daemon(name: str, *cmd: str, on: str | None = None) -> None:
        """Start a daemon here, or on host `on` (tests/hosts.py)."""
        argv = list(cmd)
        if on is not None and hosts is not None:
            argv = hosts.command(next(h for h in hosts.hosts if h.name == on), argv)
            cluster.hosted.add(name)
        log = open(root / "log" / f"{name}.out", "wb")  # noqa: SIM115 - the daemon's lifetime
        cluster.procs[name] = subprocess.Popen(
            argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )

    try:
        daemon(
            "munged",
            "munged",
            "--foreground",
            "--force",
            f"--socket={munge}/munge.socket",
            f"--key-file={munge}/munge.key",
            f"--pid-file={munge}/munged.pid",
            f"--seed-file={munge}/munged.seed",
            f"--log-file={root}/log/munged.log",
            on=node if hosts else None,
        )
        wait_for(lambda: (munge / "munge.socket").exists(), 30, "munged", cluster)
        ctld = ("slurmctld", "-D", "-c", "-i", "-f", str(cluster.conf))
        daemon("slurmctld", *ctld, on=node if hosts else None)
        wait_for(lambda: cluster.run("scontrol", "ping").returncode == 0, 60, "slurmctld", cluster)
        for name in nodes:
            slurmd = ("slurmd", "-D", "-N", name, "-f", str(cluster.conf))
            daemon("slurmd" if hosts is None else f"slurmd-{name}", *slurmd, on=name)
        wait_for(lambda: cluster.node_state() == "idle", 90, "idle nodes", cluster)
    except BaseException:
        stop(cluster)
        raise
    return cluster


def wait_for(ready, timeout: float, what: str, cluster: SlurmCluster) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        dead = [n for n, p in cluster.procs.items() if p.poll() is not None]
        if dead:
            break
        if ready():
            return
        time.sleep(0.3)
    else:
        dead = []
    outs = "\n".join(
        f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}"
        for p in sorted((cluster.root / "log").glob("*.out"))
    )
    raise RuntimeError(
        f"SLURM test cluster: no {what} after {timeout} s"
        f"{' (exited: ' + ', '.join(dead) + ')' if dead else ''}\n{cluster.logs()}\n{outs}"
    )


def stop(cluster: SlurmCluster) -> None:
    """Cancel what is left, then stop the daemons we started (slurmds first)."""
    if "slurmctld" in cluster.procs and cluster.procs["slurmctld"].poll() is None:
        ids = cluster.job_ids()
        if ids:
            cluster.run("scancel", *ids)
            deadline = time.time() + 30
            while cluster.job_ids() and time.time() < deadline:
                time.sleep(0.5)
    slurmds = [name for name in cluster.procs if name.startswith("slurmd")]
    for name in (*slurmds, "slurmctld", "munged"):
        proc = cluster.procs.get(name)
        if proc is None or proc.poll() is not None:
            continue
        # One on a host is the host's `unshare`, which ignores SIGTERM: SIGKILL ends it and all
        # it started (tests/hosts.py); its state dies with the temp dir.
        proc.send_signal(signal.SIGKILL if name in cluster.hosted else signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    try:
        cluster = start(tmp_path_factory.mktemp("slurm"))
    except ClusterUnavailable as e:
        pytest.skip(f"{SKIP_REASON}: {e}")
    try:
        yield cluster
    finally:
        stop(cluster)


@pytest.fixture(scope="session")
def slurm_two_nodes(
    hosts: Hosts, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SlurmCluster]:
    """Two nodes, one on each of the session's hosts (see the module docstring)."""
    try:
        cluster = start(tmp_path_factory.mktemp("slurm_two_nodes"), hosts)
    except ClusterUnavailable as e:
        pytest.skip(f"{SKIP_REASON}: {e}")
    try:
        yield cluster
    finally:
        stop(cluster)


@pytest.fixture
def idle_cluster(slurm_cluster: SlurmCluster) -> SlurmCluster:
    """The cluster with no job of an earlier test still in it."""
    slurm_cluster.wait_until_idle()
    return slurm_cluster


if __name__ == "__main__":
    root = Path(tempfile.mkdtemp(prefix="slurm-"))
    cluster = start(root)
    print(f"SLURM test cluster up: export SLURM_CONF={cluster.conf}   (Ctrl-C stops it)")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        stop(cluster)
    sys.exit(0)
