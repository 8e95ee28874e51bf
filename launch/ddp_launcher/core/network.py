"""Which network interface gloo listens on in a job that spans nodes (torch-free).

gloo listens on the interfaces GLOO_SOCKET_IFNAME names; unset, on the address this node's
hostname resolves to, or on 127.0.0.1 when that one cannot be bound (torch's
ProcessGroupGloo::createDefaultDevice). Where the hostname resolves to a loopback address, as
Debian's installer writes it into /etc/hosts (`127.0.1.1 <hostname>`), gloo listens where no
other node reaches it and the job waits until its connect timeout. So a rank of a multi-node job
with GLOO_SOCKET_IFNAME unset takes :func:`gloo_interface`: the interface of its route to
MASTER_ADDR; on MASTER_ADDR's own node (its route is loopback), the interface of its hostname's
address, else its only interface that is up besides loopback, else gloo's own choice and a
warning naming the interfaces. NCCL picks its own interfaces (NCCL_SOCKET_IFNAME); a NCCL job's
gloo group (its waits and flags on the host) takes this one too.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import socket
import struct
from pathlib import Path

GLOO_IFNAME_ENV = "GLOO_SOCKET_IFNAME"
# Linux ioctls (<linux/sockios.h>, <net/if.h>): an interface's IPv4 address and flags.
SIOCGIFADDR, SIOCGIFFLAGS = 0x8915, 0x8913
IFF_UP, IFF_LOOPBACK = 0x1, 0x8
IF_INET6 = Path("/proc/net/if_inet6")  # the IPv6 addresses: hex address, index, ..., name


def interface_addresses() -> dict[str, list[str]]:
    """The addresses of each interface that is up and not loopback (Linux). Python's standard
    library has no getifaddrs() (psutil, which wraps it, is not a dependency): the interfaces'
    names come from if_nameindex(), their IPv4 address and flags from the SIOCGIF* ioctls, their
    IPv6 addresses from /proc/net/if_inet6, as `ip addr` reads them."""
    found: dict[str, list[str]] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                flags = struct.unpack_from("H", fcntl.ioctl(s.fileno(), SIOCGIFFLAGS, request), 16)
            except OSError:
                continue
            if not flags[0] & IFF_UP or flags[0] & IFF_LOOPBACK:
                continue
            found[name] = []
            with contextlib.suppress(OSError):  # no IPv4 address
                packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, request)[20:24]
                found[name].append(socket.inet_ntoa(packed))
    with contextlib.suppress(OSError):
        for line in IF_INET6.read_text().splitlines():
            fields = line.split()
            if len(fields) == 6 and fields[5] in found:
                found[fields[5]].append(str(ipaddress.IPv6Address(bytes.fromhex(fields[0]))))
    return {name: addresses for name, addresses in found.items() if addresses}


def is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address.split("%")[0]).is_loopback


def resolve(host: str) -> list[str]:
    """The addresses `host` resolves to here (none when it does not)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return []
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def source_address(host: str) -> str | None:
    """The local address the kernel sends from to reach `host` (a UDP socket's connect()
    chooses the route and sends nothing), or None when it is not reachable."""
    for address in resolve(host):
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            try:
                s.connect((address, 9))
            except OSError:
                continue
            return str(s.getsockname()[0])
    return None


def owner(interfaces: dict[str, list[str]], address: str) -> str | None:
    return next((name for name, held in interfaces.items() if address in held), None)


def gloo_interface(master_addr: str, hostname: str | None = None) -> tuple[str | None, str]:
    """The interface a rank of a multi-node job should have gloo listen on (see the module
    docstring), and why; None (and a warning's text) where there is no better choice than
    gloo's own."""
    interfaces = interface_addresses()
    source = source_address(master_addr)
    if source is not None and not is_loopback(source):
        return owner(interfaces, source), f"its route to MASTER_ADDR={master_addr}"
    # MASTER_ADDR is this node and reached over loopback (or every node is this machine):
    # which interface the other nodes reach it on cannot be read from a route here.
    hostname = hostname or socket.gethostname()
    addresses = resolve(hostname)
    for address in addresses:
        if not is_loopback(address) and (name := owner(interfaces, address)):
            return name, f"the address of this node's name {hostname}"
    if len(interfaces) == 1:
        return next(iter(interfaces)), "this node's only interface up besides loopback"
    shown = ", ".join(f"{n} ({' '.join(a)})" for n, a in interfaces.items()) or "none"
    return None, (
        f"this node's name {hostname} resolves to {', '.join(addresses) or 'nothing'}: unless "
        "every rank runs on this machine, gloo listens out of the other nodes' reach there; "
        f"set {GLOO_IFNAME_ENV} to the interface they reach it on (this node's: {shown})"
    )
