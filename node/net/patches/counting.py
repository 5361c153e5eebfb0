"""The patches that count what py-libp2p does not, adding to :mod:`node.counters`: bytes (the first
host wraps ``TrioTCPStream.read/write`` and ``NetStream.read/write`` once) and the gossip messages
and RPCs pubsub drops silently (:class:`CountPubsubDrops`)."""

from __future__ import annotations

from ...wire import Gather
from ...counters import PubsubDrops, StreamBytes, TcpBytes
from .patch import Patch


class CountTcpBytes(Patch):
    """Add every TCP read and write of libp2p to :class:`~node.counters.TcpBytes`."""

    @classmethod
    def _patch(cls) -> None:
        from libp2p.io.trio import TrioTCPStream

        def count(stream, direction: str, n: int) -> None:
            setattr(TcpBytes, direction, getattr(TcpBytes, direction) + n)
            TcpBytes.calls[direction] += 1

        _count_io(TrioTCPStream, count)


def _count_io(stream_cls, count) -> None:
    """Wrap ``stream_cls.write`` and ``.read`` so each call reports ``count(stream, "sent"|"received", n)``."""
    write, read = stream_cls.write, stream_cls.read

    async def counted_write(self, data: bytes | Gather) -> None:
        await write(self, data)
        count(self, "sent", data.nbytes if isinstance(data, Gather) else len(data))

    async def counted_read(self, n: int | None = None) -> bytes:
        data = await read(self, n)
        count(self, "received", len(data))
        return data

    stream_cls.write, stream_cls.read = counted_write, counted_read


class CountStreamBytes(Patch):
    """Add every libp2p stream's reads and writes to :class:`~node.counters.StreamBytes`, by protocol."""

    @classmethod
    def _patch(cls) -> None:
        from libp2p.network.stream.net_stream import NetStream

        def count(stream, direction: str, n: int) -> None:
            by_protocol = getattr(StreamBytes, direction)
            key = str(stream.get_protocol() or "negotiating")
            by_protocol[key] = by_protocol.get(key, 0) + n

        _count_io(NetStream, count)


def message_topics(rpc) -> list[str]:
    """The topic of each message an RPC carries (its first), or [""] for an RPC without one."""
    return [m.topicIDs[0] if m.topicIDs else "" for m in rpc.publish] or [""]


class CountPubsubDrops(Patch):
    """Count in :class:`~node.counters.PubsubDrops` each gossip message or RPC py-libp2p 0.8.1 drops
    with no more than a debug or warning line: a full or closed per-peer outbound queue, an RPC
    over the size limit, a send to a peer with no queue, a full subscription channel, and the
    messages ``push_msg`` drops before our validators see them (score gate, blacklist, a cached
    failed validation). What is dropped is unchanged; only counted (issue 45: the trainer's
    checkpoint announcements reached no node for minutes and nothing said where they went).

    Installed before :class:`~.speed.SeenMessagesSpawnNothing`, which recognises ``push_msg`` by
    the function it finds at its own install."""

    @classmethod
    def _patch(cls) -> None:
        import time

        from libp2p.peer.id import ID
        from libp2p.pubsub import gossipsub, pubsub, rpc_queue

        push = rpc_queue.RpcQueue.push

        def counted_push(self, rpc, priority: bool = False) -> bool:
            ok = push(self, rpc, priority)
            if not ok:
                for topic in message_topics(rpc):
                    PubsubDrops.add("outbound-peer-gone" if self.closed else "outbound-queue-full", topic)
            return ok

        rpc_queue.RpcQueue.push = counted_push

        drop_rpc = rpc_queue.drop_rpc

        def counted_drop_rpc(peer_id, rpc) -> None:
            if rpc.ByteSize() > rpc_queue.DefaultMaxMessageSize:  # a full queue was counted at its push
                for topic in message_topics(rpc):
                    PubsubDrops.add("outbound-oversized", topic)
            drop_rpc(peer_id, rpc)

        for module in (rpc_queue, pubsub, gossipsub):  # each imported the function by name
            module.drop_rpc = counted_drop_rpc

        send_rpc = gossipsub.GossipSub.send_rpc

        def counted_send_rpc(self, peer_id, rpc, priority: bool = False) -> None:
            if self.pubsub is not None and peer_id not in self.pubsub.peer_queues:
                for topic in message_topics(rpc):
                    PubsubDrops.add("outbound-no-queue", topic)
            send_rpc(self, peer_id, rpc, priority)

        gossipsub.GossipSub.send_rpc = counted_send_rpc

        notify = pubsub.Pubsub.notify_subscriptions

        def counted_notify(self, msg) -> None:
            for topic in msg.topicIDs:
                channel = self.subscribed_topics_send.get(topic) if topic in self.topic_ids else None
                if channel is not None:
                    stats = channel.statistics()
                    if stats.current_buffer_used >= stats.max_buffer_size:
                        PubsubDrops.add("subscription-full", topic)
            notify(self, msg)

        pubsub.Pubsub.notify_subscriptions = counted_notify

        push_msg = pubsub.Pubsub.push_msg

        def dropped_by_push_msg(self, forwarder, msg) -> str | None:
            """The reason ``push_msg`` will drop ``msg`` before our validators, in its own order."""
            if self.is_peer_blacklisted(forwarder) or self.is_peer_blacklisted(ID(msg.from_id)):
                return "blacklisted"
            if self._is_msg_seen(msg):
                return None  # a duplicate: the normal fate of most copies, not a loss
            scorer = getattr(self.router, "scorer", None)
            if scorer is not None and not scorer.allow_publish(forwarder, list(msg.topicIDs)):
                return "score-gate"
            cached = self.validation_cache.cache.get(self._msg_id_constructor(msg))
            if cached is not None and not cached.is_valid and time.time() - cached.timestamp <= self.validation_cache.ttl:
                return "cached-invalid"
            return None

        async def counted_push_msg(self, msg_forwarder, msg) -> None:
            if (reason := dropped_by_push_msg(self, msg_forwarder, msg)) is not None:
                PubsubDrops.add(reason)
            await push_msg(self, msg_forwarder, msg)

        pubsub.Pubsub.push_msg = counted_push_msg
