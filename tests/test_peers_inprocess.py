"""The peer score table as gossipsub sees it, on one real node (loopback)."""

from __future__ import annotations

import trio
from libp2p.peer.id import ID

from node.identity import Identity
from swarmtest import node_config, open_nodes


def _app_score(node, peer: str) -> float:
    return node.host.gossipsub.scorer.params.app_specific_score_fn(ID.from_base58(peer))


async def test_a_ledger_sync_penalty_does_not_lift_a_shards_ban(tmp_path):
    """Issue 12's live bug: ``set_app_score`` overwrote, so ledger sync's -20 replaced a -1000 ban."""
    liar = Identity.generate().peer_id
    async with open_nodes([node_config(tmp_path, "a")]) as (a,):
        a.shards.ban(liar, "bad-piece", trio.current_time())
        assert _app_score(a, liar) <= -1000.0
        a.ledger._penalize(liar, "bad-link")
        assert _app_score(a, liar) <= -1000.0
