"""What py-libp2p's pubsub drops without a trace is counted (node/counters.py ``PubsubDrops``) and
exported (``swarm_pubsub_dropped_total``, the status's ``traffic.pubsub_dropped``): issue 45's soak
lost the trainer's checkpoint announcements for minutes and no log or metric said where. Real hosts
on loopback; the counts are process-wide, so each test reads the change it caused."""

from __future__ import annotations

import trio
from libp2p.peer.id import ID

from node.counters import PubsubDrops
from node.identity import Identity
from node.metrics import Metrics
from node.net.host import open_swarm_host
from waiting import wait_for

TOPIC = "/swarm/test/checkpoints/1"


async def _joined(sender, receiver_identity: Identity) -> None:
    await wait_for(lambda: ID.from_base58(receiver_identity.peer_id) in sender.pubsub.peer_topics.get(TOPIC, ())
                   and ID.from_base58(receiver_identity.peer_id) in sender.pubsub.peer_queues,
                   what="the sender knows the receiver subscribes and holds a queue for it")


async def test_a_full_subscription_channel_counts_each_message_it_drops():
    """A subscriber that reads nothing holds 32 messages (SUBSCRIPTION_CHANNEL_SIZE); every later
    one is dropped with a warning line only, and now counted under its topic."""
    alice, bob = Identity.generate(), Identity.generate()
    before = PubsubDrops.counts.get(("subscription-full", TOPIC), 0)
    sent = 40
    async with open_swarm_host(bob, ["/ip4/127.0.0.1/tcp/0"]) as receiver, \
            open_swarm_host(alice, ["/ip4/127.0.0.1/tcp/0"]) as sender:
        await receiver.pubsub.subscribe(TOPIC)  # never read; the sender publishes without subscribing
        await sender.connect(receiver.listen_addrs()[0])
        await _joined(sender, bob)
        queue = sender.pubsub.peer_queues[ID.from_base58(bob.peer_id)]
        for i in range(sent):  # one at a time: none is lost on the sender's side
            await sender.pubsub.publish(TOPIC, b"m%d" % i)
            await wait_for(lambda: len(queue) == 0, what="the sender's queue to the receiver drained")
        held = receiver.pubsub.subscribed_topics_send[TOPIC].statistics().max_buffer_size
        await wait_for(lambda: PubsubDrops.counts.get(("subscription-full", TOPIC), 0) - before == sent - held,
                       what=f"{sent - held} messages counted dropped at the full subscription")
        assert Metrics().totals()["pubsub_dropped"]["subscription-full"] >= sent - held


async def test_a_full_outbound_queue_counts_each_message_it_drops():
    """A burst published faster than the per-peer sending task runs overflows the peer's outbound
    queue (32 RPCs): each message that never leaves is counted, so what the receiver got and what
    was counted dropped add up to what was published."""
    alice, bob = Identity.generate(), Identity.generate()
    before = PubsubDrops.counts.get(("outbound-queue-full", TOPIC), 0)
    burst = 200
    got: set[bytes] = set()
    async with open_swarm_host(bob, ["/ip4/127.0.0.1/tcp/0"]) as receiver, \
            open_swarm_host(alice, ["/ip4/127.0.0.1/tcp/0"]) as sender, trio.open_nursery() as nursery:
        inbox = await receiver.pubsub.subscribe(TOPIC)

        async def collect() -> None:
            while True:
                got.add((await inbox.get()).data)
        nursery.start_soon(collect)
        await sender.connect(receiver.listen_addrs()[0])
        await _joined(sender, bob)
        for i in range(burst):
            await sender.pubsub.publish(TOPIC, b"m%d" % i)
        dropped = lambda: PubsubDrops.counts.get(("outbound-queue-full", TOPIC), 0) - before  # noqa: E731
        await wait_for(lambda: len(got) + dropped() == burst,
                       what="every message published either received or counted dropped")
        assert dropped() > 0, "the burst was meant to overflow the queue"
        body = Metrics().render().decode()
        assert f'swarm_pubsub_dropped_total{{reason="outbound-queue-full",topic="{TOPIC}"}}' in body
        nursery.cancel_scope.cancel()
