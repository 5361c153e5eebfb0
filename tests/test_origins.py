"""Address groups the fresh-identity pool is shared by (node/net/origins.py, issue 42 hole 3)."""

from __future__ import annotations

import pytest

from node.net.origins import address_group


@pytest.mark.parametrize("ip, group", [
    ("203.0.113.7", "203.0.113.7"),  # IPv4: the address itself
    ("10.9.0.2", "10.9.0.2"),  # a private address is a distinct machine of the operator's network
    ("::ffff:203.0.113.7", "203.0.113.7"),  # IPv4 reached over an IPv6 socket: the same origin
    ("2001:db8:1:2::5", "2001:db8:1:2::/64"),  # IPv6: one host's /64
    ("2001:db8:1:2:ffff::9", "2001:db8:1:2::/64"),
    ("fe80::1%eth0", "fe80::/64"),
    ("127.0.0.1", None), ("127.3.0.1", None), ("::1", None),  # one machine: keys count for themselves
    ("0.0.0.0", None), ("", None), (None, None), ("not an address", None),
])
def test_address_groups(ip, group):
    assert address_group(ip) == group


def test_a_host_making_ipv6_addresses_stays_in_one_group():
    assert len({address_group(f"2001:db8:0:7::{i:x}") for i in range(1, 1000)}) == 1
