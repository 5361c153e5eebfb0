"""Patches of py-libp2p 0.8.1, each a change of one library behaviour we cannot configure away.

Three kinds, one module each:

* :mod:`.safety`: without these a peer, or an unlucky cancellation, can break a node
  (:class:`~.safety.CancelSafeFrames`, :class:`~.safety.KeptReceiveWindow`,
  :class:`~.safety.UrgentTopics`, and per host
  :func:`~.safety.guard_handlers`, :func:`~.safety.disable_auto_connect` and
  :func:`~.safety.shorten_negative_dial_cache`).
* :mod:`.speed`: each removes a measured cost per byte, message or wake-up (eleven of them).
* :mod:`.counting`: the byte counts py-libp2p does not keep, and the messages it drops silently,
  added to :mod:`node.counters`.

:func:`install_all` makes the process-wide ones, once per process (all its hosts share them), and
:func:`node.net.host.open_swarm_host` calls it and applies the per-host ones to the host it builds;
nothing else should need to. Nothing outside node/net/ imports this package
(tests/test_architecture.py): the rest of the node reads the byte counts from
:mod:`node.counters` and widens a stream's receive window through
:func:`node.net.host.widen_receive_window`. (The ping that reuses one stream per peer and survives a
cut round trip lives in :meth:`node.net.host.SwarmHost.ping`.)
"""

from __future__ import annotations

from .counting import CountPubsubDrops, CountStreamBytes, CountTcpBytes
from .safety import (
    CancelSafeFrames,
    HandlerErrors,
    KeptReceiveWindow,
    UrgentTopics,
    disable_auto_connect,
    guard_handlers,
    shorten_negative_dial_cache,
)
from .speed import (
    BatchedWindowCredit,
    ChunkedStreamBuffers,
    FewerYamuxPings,
    MessageReads,
    PeerRecordReuse,
    QuickLocks,
    SeenMessagesSpawnNothing,
    WholeFrameReads,
    WholeNoiseMessages,
    YamuxSends,
    YamuxSettingsOnce,
)

# Every process-wide patch, in the order open_swarm_host installed them by hand before this list.
# Some wrap the same py-libp2p method (KeptReceiveWindow and MessageReads: ``Yamux._read_data_body``;
# either order is correct, see MessageReads); a test checks that none is left out.
PATCHES = (
    CountTcpBytes,
    CountStreamBytes,
    CountPubsubDrops,  # before SeenMessagesSpawnNothing, which finds push_msg at its install
    UrgentTopics,  # after CountPubsubDrops: a push it lets through to a full queue is counted there
    CancelSafeFrames,
    QuickLocks,
    BatchedWindowCredit,
    WholeNoiseMessages,
    YamuxSends,
    ChunkedStreamBuffers,
    KeptReceiveWindow,
    MessageReads,
    WholeFrameReads,
    PeerRecordReuse,
    SeenMessagesSpawnNothing,
    FewerYamuxPings,
    YamuxSettingsOnce,
)

__all__ = ["PATCHES", "HandlerErrors", "KeptReceiveWindow", "UrgentTopics", "disable_auto_connect", "guard_handlers",
           "install_all", "shorten_negative_dial_cache"]


def install_all() -> None:
    """Install every patch of :data:`PATCHES` that this process has not installed yet."""
    for patch in PATCHES:
        patch.install()
