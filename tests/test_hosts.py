"""tests/hosts.py's hosts: separate machines on one isolated bridge, removed whatever happens.

No training here: each test takes a second or two (as root; skipped elsewhere).
"""

from __future__ import annotations

import ipaddress
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.helpers import IMPORT_PATH, REPO
from tests.hosts import (
    SKIP_REASON,
    Hosts,
    HostsUnavailable,
    check_possible,
    hosts_network,
    netns_pids,
    our_namespaces,
    remove_leftovers,
)

pytest_plugins = ["tests.hosts"]


@pytest.fixture
def can_make_hosts() -> None:
    try:
        check_possible()
    except HostsUnavailable as e:
        pytest.skip(f"{SKIP_REASON}: {e}")


def root_links() -> list[str]:
    out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return sorted(line.split(":")[1].strip() for line in out.splitlines())


ECHO_SERVER = """\
import socket, sys
with socket.create_server(("", int(sys.argv[1]))) as server:
    print("listening", flush=True)
    conn, (peer, _) = server.accept()
    with conn:
        conn.sendall(f"{socket.gethostname()} saw {peer}".encode())
"""
CLIENT = """\
import socket, sys
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10) as s:
    print(s.recv(200).decode())
"""


def test_hosts_are_machines_of_their_own_on_one_isolated_bridge(hosts: Hosts) -> None:
    """Each host: its own hostname, a hosts file that resolves every host, its address on eth0,
    a route to the bridge's subnet and none other, only its own processes. node2 reaches node1
    by name, and node1 sees node2's address; this machine's own address is out of reach."""
    node1, node2 = hosts.hosts
    script = "hostname; getent hosts node1 node2; ip -o -4 addr show; ip -4 route; ls /proc"
    for host in hosts.hosts:
        proc = hosts.run(host, ["sh", "-c", script])
        assert proc.returncode == 0, proc.stderr
        lines = proc.stdout.splitlines()
        assert lines[0] == host.name
        assert [line.split() for line in lines[1:3]] == [
            [node1.address, "node1"],
            [node2.address, "node2"],
        ]
        addresses = [line.split()[1] + " " + line.split()[3] for line in lines if " inet " in line]
        assert addresses == ["lo 127.0.0.1/8", f"eth0 {host.address}/24"], lines
        subnet = ipaddress.ip_network(f"{host.address}/24", strict=False)
        routes = [line for line in lines if " dev " in line]
        assert len(routes) == 1 and routes[0].startswith(f"{subnet} dev eth0"), routes
        pids = sorted(int(x) for x in lines if x.isdigit())
        assert pids[0] == 1 and len(pids) <= 3, pids  # sh, ls (and nothing of the machine's)
    server = hosts.popen(
        node1, [sys.executable, "-c", ECHO_SERVER, "4711"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout.readline().strip() == "listening"
        client = hosts.run(node2, [sys.executable, "-c", CLIENT, "node1", "4711"])
        assert client.stdout.strip() == f"node1 saw {node2.address}", client.stderr
    finally:
        server.kill()
        server.wait()
    machine = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True)
    outside = next(
        w.split("/")[0]
        for w in machine.stdout.split()
        if "/" in w and w[0].isdigit() and not w.startswith("127.")
    )
    blocked = hosts.run(node1, [sys.executable, "-c", CLIENT, outside, "22"])
    assert blocked.returncode != 0 and "unreachable" in blocked.stderr, blocked.stderr


def test_hosts_and_their_processes_are_removed_after_a_failure(
    can_make_hosts: None, tmp_path: Path
) -> None:
    """Three hosts, a process left running on each, and an exception: afterwards neither the
    namespaces (with their veths and bridge) nor the processes exist, and this machine's own
    links are as they were."""
    links = root_links()
    with pytest.raises(RuntimeError, match="a test failed"), hosts_network(3, tmp_path) as hosts:
        made = [h.netns for h in hosts.hosts] + [hosts.switch]
        assert set(made) <= set(our_namespaces()) and len(hosts.hosts) == 3
        assert root_links() == links  # nothing of it in this machine's namespace
        for host in hosts.hosts:
            hosts.popen(host, ["sleep", "300"])
        assert all(hosts.pids(h) for h in hosts.hosts)
        raise RuntimeError("a test failed")
    assert not set(made) & set(our_namespaces())
    assert root_links() == links


KILLED_RUN = """\
import subprocess, sys, time
from pathlib import Path
from tests.hosts import make_hosts
hosts = make_hosts(2, Path(sys.argv[1]))
for host in hosts.hosts:  # a process on each host, and one that it starts
    hosts.popen(host, ["sh", "-c", "sleep 300 & sleep 301"])
while not all(len(hosts.pids(h)) >= 3 for h in hosts.hosts):
    time.sleep(0.05)
print(" ".join(h.netns for h in hosts.hosts), hosts.switch, flush=True)
time.sleep(300)
"""


def test_a_killed_run_leaves_no_process_and_the_next_run_removes_its_hosts(
    can_make_hosts: None, tmp_path: Path
) -> None:
    """A test process SIGKILLed while its hosts run processes: those die with it (each was
    started with PR_SET_PDEATHSIG, in a PID namespace of its own); its namespaces stay until
    the next run removes them, as it removes every namespace of a run whose process is gone."""
    script = tmp_path / "killed_run.py"
    script.write_text(textwrap.dedent(KILLED_RUN))
    proc = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "hosts")],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": IMPORT_PATH},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        namespaces = proc.stdout.readline().split()
        assert len(namespaces) == 3, "the run made no hosts"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    deadline = time.time() + 30
    while any(netns_pids(ns) for ns in namespaces) and time.time() < deadline:
        time.sleep(0.05)
    assert not any(netns_pids(ns) for ns in namespaces), "processes outlived the killed run"
    assert set(namespaces) <= set(our_namespaces())  # its namespaces stay...
    remove_leftovers()  # ...until the next run starts (make_hosts)
    assert not set(namespaces) & set(our_namespaces())
