"""The edge of the peer table: reports in, disconnects out, gossipsub's app score fed.

:class:`Peers` wraps a :class:`~node.peers.table.PeerTable` with the node's clock, metrics and
log, and queues the disconnects the table asks for; :func:`serve_peers` carries them out. Every
component reports remote faults through ``node.peers.report(...)``; the host reads
``node.peers.app_score`` for gossipsub scoring (node/net/host.py).
"""

from __future__ import annotations

import logging

import trio

from .table import Action, ActionKind, FaultRule, PeerTable

log = logging.getLogger(__name__)

MAX_QUEUED_DISCONNECTS = 256  # disconnects waiting for serve_peers; more are dropped (the ban holds)
DISCONNECT_TIMEOUT = 5.0
# Peers that hold inbound stream slots without sending (node/net/budget.py) are struck under one
# source, whatever the protocol: holding slots is the same fault everywhere.
STALL_SOURCE = "streams"
# A peer that breaks the muxer's rules (sends past a stream's receive window) is hostile or broken:
# its connection is already closed (node/net/patches/safety.py KeptReceiveWindow); one fault bans it.
MUXER_SOURCE = "muxer"
MUXER_RULE = FaultRule(weight=50.0, strikes=1, ban_seconds=3600.0)


class Peers:
    """The node's one owner of peer penalties (see node/peers/table.py for the rules)."""

    def __init__(self, host, metrics, table: PeerTable | None = None) -> None:
        self.host = host
        self.table = table or PeerTable()
        self._send, self._receive = trio.open_memory_channel[str](MAX_QUEUED_DISCONNECTS)
        self.dropped_disconnects = 0
        self._last_now = 0.0
        self.m_faults = metrics.counter("peer_faults_total", "Remote faults reported to the peer table",
                                        ["source", "reason"])
        self.m_bans = metrics.counter("peer_bans_total", "Bans given by the peer table", ["source"])
        metrics.gauge("peers_tracked", "Peers in the score table").set_function(lambda: len(self.table.peers))
        metrics.gauge("peers_banned", "Peers under an active ban").set_function(self._count_banned)
        if host is not None:
            host.app_score = self.app_score
            host.on_peer_fault = self.muxer_fault
            self.set_rule(MUXER_SOURCE, MUXER_RULE)

    def _now(self) -> float:
        """trio's clock; outside trio (the metrics scrape thread) the last time read inside it."""
        try:
            self._last_now = trio.current_time()
        except RuntimeError:
            pass
        return self._last_now

    def _count_banned(self) -> int:
        """For the scrape thread: copies, as the trio thread may change the table meanwhile."""
        now = self._last_now
        return sum(any(b.until > now for b in list(e.bans.values())) for e in list(self.table.peers.values()))

    def set_rule(self, source: str, rule: FaultRule) -> None:
        self.table.set_rule(source, rule)

    def report(self, peer: str, source: str, reason: str, now: float | None = None) -> list[Action]:
        """A remote fault by ``peer`` seen by ``source``; carries out what the table decides."""
        if not peer:
            return []
        self.m_faults.labels(source=source, reason=reason).inc()
        now = self._now() if now is None else now
        return self._carry_out(self.table.on_fault(peer, source, reason, now), now)

    def strike_stalled(self, peer: str, protocol: str, now: float | None = None) -> list[Action]:
        """``peer`` held a slot of ``protocol`` without sending in time (its stream is cut by the
        caller): one strike under :data:`STALL_SOURCE`, whose rule (set by the stream layer from
        ``[streams]``) bans and disconnects a repeat offender."""
        return self.report(peer, STALL_SOURCE, f"stalled:{protocol}", now)

    def muxer_fault(self, peer: str, reason: str) -> list[Action]:
        """``peer`` broke the muxer's rules; the host has closed its connection (see MUXER_RULE)."""
        return self.report(peer, MUXER_SOURCE, reason)

    def ban(self, peer: str, source: str, reason: str, seconds: float, now: float | None = None) -> list[Action]:
        """A ban decided outside the table (a ledger penalty entry) for ``seconds`` from now."""
        now = self._now() if now is None else now
        return self._carry_out(self.table.ban(peer, source, reason, now + seconds, now), now)

    def is_banned(self, peer: str, source: str | None = None, now: float | None = None) -> bool:
        return self.table.is_banned(peer, self._now() if now is None else now, source)

    def app_score(self, peer: str) -> float:
        """gossipsub's application-specific score (P5) for ``peer``."""
        return self.table.app_score(peer, self._now())

    def status(self) -> dict:
        out = self.table.snapshot(self._now())
        out["dropped_disconnects"] = self.dropped_disconnects
        return out

    def _carry_out(self, actions: list[Action], now: float) -> list[Action]:
        for a in actions:
            if a.kind is ActionKind.BAN:
                self.m_bans.labels(source=a.source).inc()
                log.warning("peers: banned %s for %.0fs (%s: %s)", a.peer, a.until - now, a.source, a.reason)
            elif a.kind is ActionKind.DISCONNECT and self.host is not None:
                try:
                    self._send.send_nowait(a.peer)
                except trio.WouldBlock:
                    self.dropped_disconnects += 1
        return actions

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Carry out queued disconnects until cancelled."""
        task_status.started(self)
        async for peer in self._receive:
            with trio.move_on_after(DISCONNECT_TIMEOUT):
                try:
                    await self.host.disconnect(peer)
                except Exception as e:  # noqa: BLE001 — already gone, or libp2p's many error types
                    log.debug("peers: disconnect %s: %s", peer[-8:], e)


async def serve_peers(node, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Run the node's peer table edge (``node.peers``) until cancelled."""
    node.status["peers"] = node.peers.status
    await node.peers.serve(task_status=task_status)
