"""A checkpoint announcement published right after a burst of bulk gossip reaches its peers (issue
45): py-libp2p sends to each peer through one first-in-first-out queue of 32 RPCs that refuses what
comes when full, so a trainer's ledger entries filled it and the announcement published after them
was dropped, to every peer at once. Real hosts on loopback."""

from __future__ import annotations

import trio
from libp2p.peer.id import ID

from node.counters import PubsubDrops
from node.identity import Identity
from node.net.host import open_swarm_host
from waiting import wait_for

URGENT = "/swarm/test/checkpoints/1"
BULK = "/swarm/test/ledger/1"
BURST = 100  # bulk messages published at once, far over the queue's 32
ROUNDS = 5


async def test_an_urgent_message_after_a_bulk_burst_is_sent_first_and_never_dropped():
    alice, bob = Identity.generate(), Identity.generate()
    got: dict[str, set[bytes]] = {URGENT: set(), BULK: set()}
    urgent_dropped = lambda: PubsubDrops.counts.get(("outbound-queue-full", URGENT), 0)  # noqa: E731
    async with open_swarm_host(bob, ["/ip4/127.0.0.1/tcp/0"]) as receiver, \
            open_swarm_host(alice, ["/ip4/127.0.0.1/tcp/0"]) as sender, trio.open_nursery() as nursery:
        for topic in (URGENT, BULK):
            sub = await receiver.pubsub.subscribe(topic)

            async def collect(sub=sub, into=got[topic]) -> None:
                while True:
                    into.add((await sub.get()).data)
            nursery.start_soon(collect)
        sender.make_urgent(URGENT)
        await sender.connect(receiver.listen_addrs()[0])
        bob_id = ID.from_base58(bob.peer_id)
        await wait_for(lambda: all(bob_id in sender.pubsub.peer_topics.get(t, ()) for t in (URGENT, BULK))
                       and bob_id in sender.pubsub.peer_queues, what="the sender knows the receiver's topics")
        before = urgent_dropped()
        for r in range(ROUNDS):
            for i in range(BURST):  # a trainer's ledger entries, then the step's announcement
                await sender.pubsub.publish(BULK, b"entry %d %d" % (r, i))
            await sender.pubsub.publish(URGENT, b"v%d" % r)
            await wait_for(lambda: b"v%d" % r in got[URGENT], what=f"announcement v{r} received")
        assert urgent_dropped() == before
        assert len(got[BULK]) < ROUNDS * BURST  # the bursts did overflow the queue: bulk was dropped
        nursery.cancel_scope.cancel()
