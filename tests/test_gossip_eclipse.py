"""gossipsub's eclipse protection is a host setting (issue 44, item 8), off by default: py-libp2p
0.8.1's diversity grafts ignore prune backoff (node/net/host.py GossipParams).

It was hard-coded off in node/net/host.py because "loopback swarms put every peer on one IP; the
eclipse guard would refuse them all". py-libp2p's guard refuses no one: each heartbeat it grafts
peers of new IPs into a mesh whose peers sit on fewer than ``min_mesh_diversity_ips`` (3) IPs, and
it prunes an over-represented IP first. On loopback no peer brings a new IP, so it does nothing
there, and the tests run with what production runs either way.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from libp2p.peer.id import ID
from libp2p.pubsub.gossipsub import GossipSub
from libp2p.pubsub.score import ScoreParams

from node.identity import Identity
from node.net.host import GOSSIPSUB_PROTOCOLS, GossipParams, open_swarm_host

LOOPBACK = "/ip4/127.0.0.1/tcp/0"


@pytest.mark.parametrize("params, enabled", [(None, False), (GossipParams(eclipse_protection=True), True)])
async def test_the_setting_reaches_the_router(params, enabled):
    async with open_swarm_host(Identity.generate(), [LOOPBACK], params) as host:
        assert host.gossipsub.eclipse_protection_enabled is enabled


def diversity_grafts(mesh_ips: list[str], other_ip: str) -> list[ID]:
    """What the guard grafts into a mesh of peers on ``mesh_ips`` when one more topic peer, on
    ``other_ip``, is outside it (py-libp2p's heartbeat step, fed a peer table)."""
    router = GossipSub(GOSSIPSUB_PROTOCOLS, 6, 4, 12, score_params=ScoreParams(), eclipse_protection_enabled=True)
    mesh = [ID(bytes([i + 1]) * 34) for i in range(len(mesh_ips))]
    outside = ID(b"\xff" * 34)
    for peer, ip in [*zip(mesh, mesh_ips), (outside, other_ip)]:
        router.scorer.add_peer_ip(peer, ip)
    router.mesh["t"] = set(mesh)
    router.pubsub = SimpleNamespace(peer_topics={"t": {*mesh, outside}})
    return router._ensure_mesh_diversity("t")


def test_on_one_ip_the_guard_has_nothing_to_do():
    assert diversity_grafts(["127.0.0.1"] * 4, "127.0.0.1") == []


def test_off_one_ip_it_grafts_a_peer_of_a_new_ip():
    """The other side of the test above: the guard is live, not inert."""
    assert diversity_grafts(["192.0.2.1"] * 4, "198.51.100.7") == [ID(b"\xff" * 34)]
