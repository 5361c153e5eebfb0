"""Where a connection comes from, as the fresh-identity pool counts it (node/rollouts/quota.py). Pure.

Keys are free and addresses are not: a worker that signs every batch with a new key still sends it
from its one address, so the pool is shared per address group rather than per key. The group is
the IPv4 address itself (a home or a cloud machine has one), an IPv6 address's /64 (one host is
normally handed a whole /64, so its addresses inside it are as free as keys), and nothing for
loopback: every node of a one-machine swarm (the demo, the tests) has the same loopback address,
and there each key counts for itself.
"""

from __future__ import annotations

import ipaddress

IPV6_GROUP_BITS = 64  # one host's share of IPv6 space (RFC 6177: end sites get /48-/64)


def address_group(ip: str | None) -> str | None:
    """The origin of a connection from ``ip``: a string naming its address group, or None where the
    address does not tell origins apart (loopback, unparseable, unknown)."""
    if not ip:
        return None
    try:
        addr = ipaddress.ip_address(ip.split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    if addr.is_loopback or addr.is_unspecified:
        return None
    if isinstance(addr, ipaddress.IPv4Address):
        return str(addr)
    net = ipaddress.IPv6Network((addr, IPV6_GROUP_BITS), strict=False)
    return str(net)
