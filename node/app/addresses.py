"""Addresses another peer can dial, for ``swarm-node id`` and the status views.

A node that listens on ``/ip4/0.0.0.0/tcp/P`` accepts connections on every interface, but
``0.0.0.0`` itself cannot be dialed: printed as is it sends operators copying it into
``--bootstrap`` nowhere. Each wildcard address is expanded into one address per IPv4 interface
of this host (Linux: ``SIOCGIFADDR`` on each interface; elsewhere the address of the default
route), loopback last, with a note that a peer behind NAT is reached at its public address or
through ``--relay-via``.
"""

from __future__ import annotations

import socket
import struct
import sys

WILDCARD = "/ip4/0.0.0.0/"
NAT_NOTE = ("(listening on all interfaces; peers outside this network need your public address with a "
            "forwarded port, or --relay-via)")


def interface_ipv4() -> list[str]:
    """IPv4 addresses of this host's interfaces, loopback last; best effort, never raises."""
    found: list[str] = []
    if sys.platform.startswith("linux"):
        import fcntl

        SIOCGIFADDR = 0x8915
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for _, name in socket.if_nameindex():
                try:
                    raw = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
                except OSError:  # an interface without an IPv4 address
                    continue
                found.append(socket.inet_ntoa(raw[20:24]))
    if not found:
        try:  # the source address of the default route; a UDP connect sends nothing
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect(("192.0.2.1", 9))
                found.append(s.getsockname()[0])
        except OSError:
            pass
    ordered = sorted(dict.fromkeys(found), key=lambda a: a.startswith("127."))
    return ordered or ["127.0.0.1"]


def dialable(addrs: list[str], peer_id: str, interfaces: list[str] | None = None) -> tuple[list[str], bool]:
    """Each address with ``/p2p/<peer_id>`` and wildcards expanded: (addresses, any expanded)."""
    out: list[str] = []
    expanded = False
    for a in addrs:
        full = a if "/p2p/" in a else f"{a}/p2p/{peer_id}"
        if full.startswith(WILDCARD):
            expanded = True
            rest = full[len(WILDCARD):]
            ips = interface_ipv4() if interfaces is None else interfaces
            out += [f"/ip4/{ip}/{rest}" for ip in ips]
        else:
            out.append(full)
    return list(dict.fromkeys(out)), expanded
