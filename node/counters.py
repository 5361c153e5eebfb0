"""Bytes this process moved over libp2p, for metrics, status and benchmarks to read.

py-libp2p counts no bytes: :mod:`node.net.patches.counting` wraps the TCP stream and the net
stream once per process and adds to the counts here; everyone else only reads them (node/metrics.py
exports them, the shards benchmarks report them). Process-wide: one node per process in normal
runs (in-process tests share the counts). Pure data: this module imports nothing of libp2p, so
metrics stay importable without the network stack.
"""

from __future__ import annotations


class TcpBytes:
    """Bytes this process moved over libp2p TCP connections (after Noise and Yamux framing), and
    the calls that moved them: a write is one Noise message, a read one ``recv`` (the reads of
    :class:`~node.net.patches.speed.WholeNoiseMessages`), so nearly one wake-up of the node.

    Where bytes trickle in through a slow link, a node's CPU follows its messages more than its bytes.
    """

    sent = 0
    received = 0
    calls = {"sent": 0, "received": 0}  # writes (Noise messages sent) and reads


class StreamBytes:
    """Payload bytes this process moved on libp2p streams, by protocol (before Yamux and Noise).

    The figure that says *which* protocol costs what (membership, gossipsub, ping, shards...);
    ``TcpBytes`` holds the total with framing.
    """

    sent: dict[str, int] = {}
    received: dict[str, int] = {}


class PubsubDrops:
    """Gossip messages and RPCs py-libp2p 0.8.1 dropped without a trace (a debug line at most), by
    (reason, topic), counted by :class:`~node.net.patches.counting.CountPubsubDrops`:

    * ``outbound-queue-full``: a peer's outbound RPC queue (32 RPCs, ``libp2p/pubsub/rpc_queue.py``)
      was full, so what we published or forwarded to it was never sent; ``outbound-oversized``: an
      RPC over the 1 MiB limit; ``outbound-peer-gone``: the peer's queue was already closed;
      ``outbound-no-queue``: gossipsub meant to send to a peer it has no queue for (yet). Counted per
      message and its topic; an RPC with no message (control, subscriptions) counts once, topic "".
    * ``subscription-full``: a message that passed validation found our subscription's channel
      (``SUBSCRIPTION_CHANNEL_SIZE``, 32) full, so our own reader never saw it (a warning line only).
    * ``score-gate``: a message from a forwarder scored below the publish threshold, dropped
      unvalidated; ``blacklisted``: from a blacklisted forwarder or author; ``cached-invalid``: its
      id had failed validation before, so it was dropped without asking our validator. These three
      are counted with topic "" (the topics are the sender's to name).
    """

    counts: dict[tuple[str, str], int] = {}

    @classmethod
    def add(cls, reason: str, topic: str = "", n: int = 1) -> None:
        cls.counts[(reason, topic)] = cls.counts.get((reason, topic), 0) + n

    @classmethod
    def total(cls, reason: str | None = None) -> int:
        return sum(n for (r, _t), n in cls.counts.items() if reason is None or r == reason)
