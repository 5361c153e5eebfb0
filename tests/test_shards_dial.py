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
from node.shards.testing import same_files, write_checkpoint

from swarmtest import node_config, open_nodes
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
