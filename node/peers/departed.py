"""Forgetting peers that left: py-libp2p's peer store keeps every peer it ever heard of.

How this works: py-libp2p 0.8.1 writes a peer's addresses, key, protocols and signed record into
its peer store on each connection and never removes them (its own sweep, ``start_cleanup_task``,
is started by nobody; the 1000-peer cap is enforced only by that sweep). A relay or trainer that
sees peers come and go for weeks holds all of them (issue 45). :class:`Departed` remembers since
when each known peer has been without a connection and names those away for ``forget_after``
seconds; :func:`serve_forgetting` asks it every :data:`SWEEP_S` and has the host drop them
(``SwarmHost.forget_departed``). A peer that comes back is dialled at the addresses our membership
table holds (node/gossip), never at peer-store ones, so forgetting costs nothing; its next
connection writes its entry again.

Pure: ``now`` is an argument.
"""

from __future__ import annotations

from collections.abc import Iterable, Set

import trio

FORGET_AFTER_S = 600.0  # a peer without a connection this long is dropped from the peer store
SWEEP_S = 60.0  # how often the peer store is looked through


class Departed:
    """Since when each known peer has had no connection; :meth:`due` names those to forget."""

    def __init__(self, forget_after: float = FORGET_AFTER_S) -> None:
        self.forget_after = forget_after
        self.since: dict[str, float] = {}  # known peer without a connection -> first seen so

    def due(self, known: Iterable[str], connected: Set[str], now: float) -> list[str]:
        """The peers of ``known`` away for ``forget_after`` seconds (sorted). Only peers in ``known``
        are remembered, so this holds no more than the peer store does."""
        since, out = {}, []
        for peer in known:
            if peer in connected:
                continue
            first = self.since.get(peer, now)
            if now - first >= self.forget_after:
                out.append(peer)
            else:
                since[peer] = first
        self.since = since
        return sorted(out)


async def serve_forgetting(host, departed: Departed | None = None) -> None:
    """Drop departed peers from ``host``'s peer store every :data:`SWEEP_S` until cancelled."""
    departed = departed or Departed()
    while True:
        await trio.sleep(SWEEP_S)
        host.forget_departed(departed, trio.current_time())
