"""Is a port ours to listen on? Checked before a node starts, so a taken port is one line and exit 2
rather than a traceback or, worse, a second listener: py-libp2p's listeners set SO_REUSEPORT
(DCUtR dials out from the listen port), so a second node on a taken port would listen beside the
first and the kernel would split dials between two peer ids (issue 39)."""

from __future__ import annotations

import errno
import socket

import multiaddr


class PortUnavailable(Exception):
    """A port the node must listen on cannot be had; its message is the one line the node stops with
    (a mistake in the set-up: exit 2, like a bad run file)."""


def check_port_free(host: str, port: int, flag: str) -> None:
    """PortUnavailable when ``host:port`` cannot be listened on: another socket listens there (also on
    the wildcard address), or the address is not this host's. The probe sets SO_REUSEADDR only, so
    a closed connection's TIME_WAIT does not count but any listener does, libp2p's included. Port 0
    (pick a free one) needs no check."""
    if not port:
        return
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise PortUnavailable(f"{flag}: {host}:{port} is in use by another process; "
                                      "stop it or pick another port") from None
            raise PortUnavailable(f"{flag}: cannot listen on {host}:{port}: {e.strerror or e}") from None


def check_listen_ports(addrs: list[multiaddr.Multiaddr]) -> None:
    """PortUnavailable naming the address when one of ``addrs``' TCP ports cannot be listened on."""
    for addr in addrs:
        protocols = [p.name for p in addr.protocols()]
        if "tcp" in protocols and protocols[0] in ("ip4", "ip6"):
            check_port_free(addr.value_for_protocol(protocols[0]), int(addr.value_for_protocol("tcp")), "--listen")
