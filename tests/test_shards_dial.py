"""A download short of ``max_peers`` direct peers dials public members (node/shards/peering.py,
``direct_peers_to_dial``), found in membership's view: real nodes (the core of every role:
ledger, shards, relay side, membership, dial-back) on loopback.

Membership here keeps one connection (``conn_low = 1``), so that nothing but the download dials:
the downloader holds only its connection to the origin, and learns of the other holder through
membership's records alone.
"""

from __future__ import annotations

from pathlib import Path

import trio

from node.config import RunConfig
from node.identity import load_or_create_identity
from node.shards.testing import open_shards_swarm, same_files, write_checkpoint

from swarmtest import node_config, open_nodes
from test_shards_swarm import reached_over_a_circuit
from waiting import wait_for

MiB = 1 << 20


async def test_a_download_dials_a_public_member_it_learned_of_through_membership(tmp_path: Path) -> None:
    origin, _ = load_or_create_identity(tmp_path / "o")
    run = RunConfig(name="test", trainers=[origin.peer_id], tables={
        "membership": {"conn_low": 1},
        # The origin's uplink is the narrow one, so a downloader that reaches the other holder uses it.
        "shards": {"upload_rate": MiB, "announce_interval": 0.5, "request_timeout": 2.0, "progress": False},
    })
    configs = [node_config(tmp_path, name, run=run) for name in ("o", "h", "d")]
    src = write_checkpoint(tmp_path / "ckpt", 4 * MiB, seed=3)
    with trio.fail_after(120):
        async with open_nodes(configs) as (o, h, d):
            await wait_for(lambda: h.peer_id in d.membership.members(), what="the downloader knows the holder")
            assert h.peer_id not in d.host.connected_peers()  # nobody dialled it
            signed = await o.shards.publish(src, 1)
            path = await d.shards.wait_version(1)
            assert same_files(src, path)
            received = {peer: n for (peer, root), n in d.shards.receipts().items() if root == signed.root.hex()}
            assert received.get(h.peer_id, 0) > 0, received
            assert h.peer_id in d.host.direct_peers()


class Members:
    """A membership view (node/shards/api.py MemberAddrs) of the given records."""

    def __init__(self, records: dict[str, tuple[str, list[str]]]) -> None:
        self.records = records  # peer id -> (reachability, addresses)

    def members(self) -> dict[str, str]:
        return {peer: "relay" for peer in self.records}

    def addrs_of(self, peer_id: str) -> list[str]:
        return self.records[peer_id][1]

    def reachability_of(self, peer_id: str) -> str:
        return self.records[peer_id][0]


async def test_a_download_dials_a_public_member_it_holds_only_a_relay_circuit_to(tmp_path: Path) -> None:
    """A NAT'd node's connections from public members are relay circuits (they dialled its relayed
    address), which carry no checkpoint bytes. Its download dials such a member's direct address all
    the same: the circuit no longer stands for a connection (py-libp2p's connect returned at once
    on any connection, so the dial did nothing and the member's upload was lost to it)."""
    src = write_checkpoint(tmp_path / "ckpt", 4 * MiB, seed=6)
    with trio.fail_after(90):
        async with open_shards_swarm() as swarm, trio.open_nursery() as services:
            r, _, t, d = await reached_over_a_circuit(swarm, services, tmp_path, upload_rate=MiB)
            d.shards.use_members(Members({t.peer_id: ("public", t.host.transport_addrs()),
                                          r.peer_id: ("public", r.host.transport_addrs())}))

            signed = await t.shards.publish(src, 3)
            assert same_files(src, await d.shards.wait_version(3))
            received = {peer: n for (peer, root), n in d.shards.receipts().items() if root == signed.root.hex()}
            assert received.get(t.peer_id, 0) > 0, received
            assert t.peer_id in d.host.direct_peers()
            services.cancel_scope.cancel()
