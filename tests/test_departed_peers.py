"""A long-running node forgets peers that left (issue 45): after peers come and go, nothing keyed by
their ids is left in py-libp2p's state that nobody reads (the auto-connector's disconnect times,
the peer store), while peers still connected keep working."""

from __future__ import annotations

import trio
from libp2p.peer.id import ID

from node.identity import Identity
from node.net.host import open_swarm_host
from node.peers.departed import Departed
from waiting import wait_for

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
VISITORS = 4


def test_a_peer_is_forgotten_once_it_was_away_for_the_whole_delay():
    d = Departed(forget_after=60.0)
    assert d.due(known={"a", "b"}, connected={"a"}, now=0.0) == []  # b first seen away at 0
    assert d.due(known={"a", "b"}, connected={"b"}, now=30.0) == []  # b back; a away from 30
    assert d.due(known={"a", "b"}, connected=set(), now=89.0) == []  # b away from 89
    assert d.due(known={"a", "b"}, connected=set(), now=90.0) == ["a"]
    assert d.due(known={"b"}, connected=set(), now=148.0) == []
    assert d.due(known={"b", "c"}, connected=set(), now=149.0) == ["b"]
    assert set(d.since) == {"c"}  # holds only peers still known: bounded by the peer store


async def test_peers_that_came_and_went_leave_nothing_behind_in_the_host():
    async with open_swarm_host(Identity.generate(), LOOPBACK) as home, \
            open_swarm_host(Identity.generate(), LOOPBACK) as stays:
        await stays.connect(home.listen_addrs()[0])
        gone = []
        for _ in range(VISITORS):
            async with open_swarm_host(Identity.generate(), LOOPBACK) as visitor:
                await visitor.connect(home.listen_addrs()[0])
                await wait_for(lambda: home.is_connected(visitor.peer_id), what="home sees the visitor")
                await visitor.ping(home.peer_id)
            gone.append(visitor.peer_id)
            await wait_for(lambda: not home.is_connected(gone[-1]), what="home saw the visitor leave")
        ids = {ID.from_base58(p) for p in gone}
        # py-libp2p's auto-connector (disabled: node/net/patches/safety.py) still recorded each
        # disconnect, in a map only its own disabled dialer prunes.
        assert not ids & set(home.host.get_network().auto_connector._recent_disconnects)
        store = home.host.get_peerstore()
        assert ids <= set(store.peer_ids())  # remembered until the sweep says they were away long enough
        departed = Departed(forget_after=600.0)
        now = trio.current_time()
        assert home.forget_departed(departed, now) == 0
        assert home.forget_departed(departed, now + 600.0) == VISITORS
        assert not ids & set(store.peer_ids())
        assert ID.from_base58(home.peer_id) in store.peer_ids()  # our own key stays
        assert ID.from_base58(stays.peer_id) in store.peer_ids()
        await stays.ping(home.peer_id)
        await home.ping(stays.peer_id)
