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
