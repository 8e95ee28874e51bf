"""Several hosts on this machine for the multi-node tests: Linux network namespaces, as a
cluster's nodes are, over one shared file system.

`make_hosts(n)` makes hosts `node1` ... `node<n>`: each a network namespace with its own
address (10.X.Y.<k>/24, a subnet no route of this machine uses) on an `eth0` that is one end of a
veth pair, and loopback. The other ends hang on a bridge in one more namespace (the switch),
which has no other link: no uplink, no NAT, no default route, so nothing a host sends can leave
the machine, and this machine's own interfaces are never touched. A process runs "on a host"
(:meth:`Hosts.command`) in the host's network namespace and in namespaces of its own: UTS (its
hostname is the host's name), mount (a hosts file that resolves every host is bind-mounted over
/etc/hosts) and PID (it and everything it starts die together). Each is started with
PR_SET_PDEATHSIG (`setpriv --pdeathsig KILL`) and `unshare --kill-child`: when the test process
dies, even by SIGKILL, every process it started on a host dies with it.

Every namespace is named `hddp-<pid of the test process>-<n>-<name>`: removing them
(:func:`remove_hosts`: kill what runs in them, delete them; the veths and the bridge go with
their namespaces) happens in a `finally`, and each new run first removes what a run whose
process is gone left behind (:func:`remove_leftovers`).

`hosts` (session fixture) makes two hosts for the whole run; it skips with one line (the run's
last line counts such skips, tests/suite_plugin.py) where namespaces cannot be made: not root, no
`ip`/`unshare`/`setpriv`, or the kernel refuses. `python -m tests.hosts 2` makes some by hand.
"""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

PREFIX = "hddp-"  # every namespace this module makes: hddp-<owner pid>-<n>-<name>
SKIP_REASON = "no test hosts"  # how every skip of a test that needs hosts starts
COMMANDS = ("ip", "nsenter", "unshare", "setpriv", "mount", "hostname")
NETNS_DIR = Path("/run/netns")  # where `ip netns add` names its namespaces
SWITCH = "switch"
NETWORKS = itertools.count()  # networks this process made: their names' second part


class HostsUnavailable(Exception):
    """Namespaces cannot be made here (a reason to skip, not a failure)."""


@dataclass(frozen=True)
class Host:
    name: str  # its hostname, as every host's /etc/hosts resolves it
    address: str
    netns: str


@dataclass
class Hosts:
    root: Path  # the hosts files
    hosts: list[Host]
    switch: str  # the namespace of the bridge

    @property
    def hosts_file(self) -> Path:
        """What every host sees as /etc/hosts: localhost and each host's name -> its address."""
        return self.root / "hosts"

    def loopback_hosts_file(self, host: Host) -> Path:
        """`host`'s /etc/hosts as Debian's installer writes it: its own name -> 127.0.1.1, the
        others -> their addresses. A program that binds to the address of its own hostname
        (gloo's default device) binds to loopback there."""
        return self.root / f"hosts.{host.name}.loopback"

    def command(self, host: Host, argv: list[str], hosts_file: Path | None = None) -> list[str]:
        """`argv` as a command that runs on `host` (see the module docstring). The command's
        process is `unshare`; it exits with argv's status; SIGKILL to it kills everything the
        command started (SIGTERM is ignored: :meth:`kill_all` stops a host). `nsenter --net`,
        not `ip netns exec`, which mounts a sysfs of the namespace over /sys and so hides
        /sys/fs/cgroup, which slurmd needs."""
        return [
            "nsenter",
            f"--net={NETNS_DIR / host.netns}",
            "setpriv",
            "--pdeathsig",
            "KILL",
            "--",
            "unshare",
            "--uts",
            "--mount",
            "--pid",
            "--fork",
            "--kill-child",
            "--mount-proc",
            "--",
            "sh",
            "-c",
            'hostname "$1" && mount --bind "$2" /etc/hosts && shift 2 && exec "$@"',
            "sh",
            host.name,
            str(hosts_file or self.hosts_file),
            *argv,
        ]

    def popen(self, host: Host, argv: list[str], hosts_file: Path | None = None, **kwargs):
        return subprocess.Popen(self.command(host, argv, hosts_file), **kwargs)

    def run(self, host: Host, argv: list[str], timeout: float = 60, **kwargs):
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run(self.command(host, argv), timeout=timeout, **kwargs)

    def pids(self, host: Host) -> list[int]:
        """Every process on `host` (in its network namespace)."""
        return netns_pids(host.netns)

    def kill_all(self, host: Host) -> list[int]:
        """SIGKILL every process on `host`, as a node that loses power; the pids killed."""
        return kill_netns(host.netns)


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")
    return proc


def netns_pids(netns: str) -> list[int]:
    proc = ip("netns", "pids", netns, check=False)
    return [int(p) for p in proc.stdout.split()] if proc.returncode == 0 else []


def kill_netns(netns: str, timeout: float = 10) -> list[int]:
    """SIGKILL every process in the namespace until none is left (one may fork meanwhile)."""
    killed: list[int] = []
    deadline = time.time() + timeout
    while (pids := netns_pids(netns)) and time.time() < deadline:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        killed += [p for p in pids if p not in killed]
        time.sleep(0.05)
    return killed


def owner_alive(netns: str) -> bool:
    """Whether the process that made the namespace `hddp-<pid>-...` still runs."""
    pid = netns[len(PREFIX) :].split("-", 1)[0]
    if not pid.isdigit():
        return True  # not one of ours: leave it
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def our_namespaces() -> list[str]:
    return sorted(p.name for p in NETNS_DIR.glob(f"{PREFIX}*")) if NETNS_DIR.is_dir() else []


def delete_netns(netns: str) -> None:
    kill_netns(netns)
    ip("netns", "delete", netns, check=False)


def remove_leftovers() -> list[str]:
    """Remove the namespaces (their processes, veths, bridges) of runs that are gone."""
    gone = [ns for ns in our_namespaces() if not owner_alive(ns)]
    for netns in gone:
        delete_netns(netns)
    return gone


def used_networks() -> list[ipaddress.IPv4Network]:
    """The IPv4 networks this machine has addresses in or routes to."""
    out = ip("-4", "-o", "addr", "show").stdout + ip("-4", "route", "show", "table", "all").stdout
    nets = []
    for word in out.split():
        with contextlib.suppress(ValueError):
            if "/" in word or word[0].isdigit():
                nets.append(ipaddress.ip_network(word, strict=False))
    return nets


def free_subnet() -> ipaddress.IPv4Network:
    """A /24 of 10.0.0.0/8 that overlaps nothing this machine uses (the hosts are isolated
    anyway; a subnet of its own keeps them from ever shadowing a real one)."""
    used = used_networks()
    start = os.getpid() % 250
    for i in range(250 * 4):
        x, y = 200 + (i // 250) % 50, (start + i) % 250 + 1
        net = ipaddress.ip_network(f"10.{x}.{y}.0/24")
        if not any(net.overlaps(u) for u in used if u.prefixlen > 0):
            return net
    raise HostsUnavailable("no free /24 in 10.200.0.0/14 for the test hosts")


def check_possible() -> None:
    """HostsUnavailable unless this process may make the namespaces a host needs."""
    if os.geteuid() != 0:
        raise HostsUnavailable("network namespaces need root: not root")
    missing = [c for c in COMMANDS if not shutil.which(c)]
    if missing:
        raise HostsUnavailable(f"{', '.join(missing)} missing (iproute2, util-linux)")
    probe = ["unshare", "--net", "--uts", "--mount", "--pid", "--fork", "true"]
    proc = subprocess.run(probe, capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise HostsUnavailable(f"namespaces refused: {proc.stderr.strip()}")


def make_hosts(n: int, root: Path) -> Hosts:
    """Hosts node1 ... node<n> on one bridge (see the module docstring); remove_hosts()
    removes them. HostsUnavailable when namespaces cannot be made here."""
    check_possible()
    remove_leftovers()
    tag = f"{PREFIX}{os.getpid()}-{next(NETWORKS)}-"
    subnet = free_subnet()
    hosts = Hosts(root, [], f"{tag}{SWITCH}")
    try:
        ip("netns", "add", hosts.switch)
        ip("-n", hosts.switch, "link", "add", "br0", "type", "bridge")
        ip("-n", hosts.switch, "link", "set", "br0", "up")
        for k in range(1, n + 1):
            host = Host(f"node{k}", str(subnet.network_address + k), f"{tag}node{k}")
            hosts.hosts.append(host)
            ip("netns", "add", host.netns)
            port = f"port{k}"
            ip("-n", hosts.switch, "link", "add", port, "type", "veth", "peer", "name", "eth0")
            ip("-n", hosts.switch, "link", "set", "eth0", "netns", host.netns)
            ip("-n", hosts.switch, "link", "set", port, "master", "br0", "up")
            ip("-n", host.netns, "addr", "add", f"{host.address}/{subnet.prefixlen}", "dev", "eth0")
            ip("-n", host.netns, "link", "set", "eth0", "up")
            ip("-n", host.netns, "link", "set", "lo", "up")
        write_hosts_files(hosts)
    except BaseException:
        remove_hosts(hosts)
        raise
    return hosts


def write_hosts_files(hosts: Hosts) -> None:
    hosts.root.mkdir(parents=True, exist_ok=True)
    local = "127.0.0.1 localhost\n::1 localhost ip6-localhost ip6-loopback\n"
    hosts.hosts_file.write_text(local + "".join(f"{h.address} {h.name}\n" for h in hosts.hosts))
    for me in hosts.hosts:
        others = "".join(f"{h.address} {h.name}\n" for h in hosts.hosts if h != me)
        hosts.loopback_hosts_file(me).write_text(f"{local}127.0.1.1 {me.name}\n{others}")


def remove_hosts(hosts: Hosts) -> None:
    """Kill every process on the hosts and delete their namespaces (the veths and the bridge
    go with them)."""
    for netns in [h.netns for h in hosts.hosts] + [hosts.switch]:
        if (NETNS_DIR / netns).exists():
            delete_netns(netns)


@contextlib.contextmanager
def hosts_network(n: int, root: Path) -> Iterator[Hosts]:
    hosts = make_hosts(n, root)
    try:
        yield hosts
    finally:
        remove_hosts(hosts)


@pytest.fixture(scope="session")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hosts]:
    """Two hosts for the whole run (node1, node2)."""
    try:
        made = make_hosts(2, tmp_path_factory.mktemp("hosts"))
    except HostsUnavailable as e:
        pytest.skip(f"{SKIP_REASON}: {e}")
    try:
        yield made
    finally:
        remove_hosts(made)


if __name__ == "__main__":
    with hosts_network(int(sys.argv[1]) if len(sys.argv) > 1 else 2, Path(tempfile.mkdtemp())) as h:
        for host in h.hosts:
            print(f"{host.name} {host.address}: " + " ".join(h.command(host, ["bash"])))
        print("Ctrl-C removes them")
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()
