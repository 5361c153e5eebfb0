"""A node restarted with its identity is heard again at once: its gossip messages are not taken for
the ones its previous process sent (issue 45's hour-long soak: the trainer's v34-36 after t=150 s)."""

from __future__ import annotations

import trio
from libp2p.peer.id import ID

from node.identity import Identity
from node.net.host import open_swarm_host
from waiting import wait_for

TOPIC = "/swarm/test/checkpoints/1"


async def test_a_restarted_publisher_is_not_dropped_as_a_duplicate_of_its_previous_process():
    """gossipsub names a message by (author, seqno), and receivers drop a name they saw in the last
    two minutes. py-libp2p starts the seqno counter at the clock in whole seconds and adds one per
    message, so a node that published more than one message a second (a trainer: a ledger entry
    per batch, an announcement per step) and restarted within minutes began on numbers its previous
    process had used a moment before, and every receiver dropped what it published as duplicates:
    no node heard of the checkpoints the trainer published in its first 25 s."""
    author, listener = Identity.generate(), Identity.generate()
    burst = 30  # far more messages than seconds this test takes to restart the author
    got: set[bytes] = set()
    async with open_swarm_host(listener, ["/ip4/127.0.0.1/tcp/0"]) as receiver, trio.open_nursery() as nursery:
        inbox = await receiver.pubsub.subscribe(TOPIC)

        async def collect() -> None:
            while True:
                got.add((await inbox.get()).data)
        nursery.start_soon(collect)
        for life, count in (("first process", burst), ("restarted", 1)):
            async with open_swarm_host(author, ["/ip4/127.0.0.1/tcp/0"]) as sender:
                await sender.connect(receiver.listen_addrs()[0])
                await wait_for(lambda: ID.from_base58(listener.peer_id) in sender.pubsub.peer_topics.get(TOPIC, ()),
                               what=f"{life}: the author knows the receiver subscribes")
                sent = {b"%s %d" % (life.encode(), i) for i in range(count)}
                for data in sorted(sent):
                    await sender.pubsub.publish(TOPIC, data)
                # A message dropped as a duplicate never comes: only the hang guard ends this wait.
                await wait_for(lambda: sent <= got, what=f"{life}: every message the author published")
            await wait_for(lambda: author.peer_id not in receiver.connected_peers()
                           and ID.from_base58(author.peer_id) not in receiver.pubsub.peers, what="the first process gone")
        nursery.cancel_scope.cancel()
