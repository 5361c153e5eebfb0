"""Safety patches of py-libp2p 0.8.1: without them a peer, or an unlucky cancellation, can break a node.

* :class:`CancelSafeFrames`: a Yamux frame write cancelled between encrypt and send corrupts the
  Noise stream for good; make it all-or-nothing.
* :class:`KeptReceiveWindow`: a peer could send past a stream's receive window and have it
  buffered anyway; close its connection and report it.
* :class:`UrgentTopics`: a burst of bulk gossip (ledger entries) filled a peer's outbound queue and
  the checkpoint announcement published after it was dropped; messages of urgent topics now go
  first and make room.
* :func:`disable_auto_connect`: the swarm's own auto-connector fights our connection manager.
* :func:`shorten_negative_dial_cache`: a peer back from a restart stayed undialable for 60 s.
* :func:`guard_handlers`: an exception escaping any stream handler tears down the whole host
  (:class:`HandlerErrors` counts them; :class:`StreamCount` caps the streams of py-libp2p's own
  handlers, which have no budget of ours).

The first three are process-wide (:func:`node.net.patches.install_all`); the others are applied to
each host by :func:`node.net.host.open_swarm_host`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

from ...counters import PubsubDrops
from ..budget import Budget, StreamLimits
from .counting import message_topics
from .patch import Patch

log = logging.getLogger(__name__)


# A Yamux frame write that has not finished after this long means the peer stopped reading; the
# connection is closed, as part of a frame may already be on the wire. Frames are at most one
# stream window (256 KiB): 15 s allows links down to ~140 kbit/s, and bounds how long a shielded
# write can hold up a node's shutdown.
FRAME_WRITE_LIMIT = 15.0


class CancelSafeFrames(Patch):
    """Make each Yamux frame write all-or-nothing under cancellation (py-libp2p 0.8.1).

    py-libp2p writes a frame in the caller's task: Noise encrypts it (using up the next nonce), then
    sends it. A caller cancelled between the two (any ``fail_after`` around a stream write whose
    deadline passes at that moment) leaves a nonce the peer will never see, and every later frame on
    the connection fails to decrypt ("Failed authentication of message", seen a few times a minute
    in the demo's logs); cancelled during the send, half a frame is left on the wire. Here the
    write lock is still taken cancellably (nothing is written yet), the encrypt-and-send is shielded,
    and a send that stalls past FRAME_WRITE_LIMIT closes the connection instead of corrupting it.
    """

    @classmethod
    def _patch(cls) -> None:
        from libp2p.stream_muxer.yamux.yamux import Yamux

        async def write_frame(self, data: bytes) -> None:
            async with self._write_lock:
                # One scope, shielded from outside and cancelled by its own deadline: two nested
                # ones (shield, then move_on_after) cost ~4 % of the event loop in ``overhead``.
                with trio.CancelScope(shield=True, deadline=trio.current_time() + FRAME_WRITE_LIMIT) as stalled:
                    await self.secured_conn.write(data)
                if stalled.cancelled_caught:
                    with trio.CancelScope(shield=True, deadline=trio.current_time() + 5):
                        await self.secured_conn.close()
                    raise trio.BrokenResourceError(f"frame write stalled for {FRAME_WRITE_LIMIT:.0f} s")
            # The send itself yielded; only a cancellation that arrived meanwhile is still owed.
            await trio.lowlevel.checkpoint_if_cancelled()

        Yamux._write_frame = write_frame


class UrgentTopics(Patch):
    """Gossip messages of the topics in :attr:`topics` jump each peer's outbound queue, and a full
    queue drops a bulk RPC to take one rather than the message itself (py-libp2p 0.8.1).

    py-libp2p sends to each peer through one queue of 32 RPCs (``rpc_queue.py``), first in first out
    for messages, and a full queue refuses what comes next with a debug line. A trainer publishes a
    ledger entry per batch and then the step's checkpoint announcement, and forwards everyone's
    entries and gossip control through the same queues: on a busy machine its sending tasks fell
    behind, each burst filled the queues, and the announcement, last in line, was the message
    dropped, to every peer at once (issue 45's soak: v164-v178 reached no node or few for ~100 s
    after a restart; an in-process experiment with a 40-entry burst lost all 20 announcements).
    An announcement is ~250 bytes once a version and lost for good (the next re-announcement is
    ``announce_interval`` away); a ledger entry dropped here is caught up by the ledger's own sync.

    An RPC counts as urgent when every message it carries is of an urgent topic (a forwarded
    announcement at a relay too). It goes to the priority side of the queue, which is sent first;
    when the queue is full, its newest bulk RPC is dropped to make room (counted in
    :class:`~node.counters.PubsubDrops` as ``outbound-queue-full`` under its topics). A queue full of
    urgent RPCs still refuses the next one: the queue stays bounded at its 32.
    """

    topics: set[str] = set()  # process-wide: one node per process in normal runs

    @classmethod
    def _patch(cls) -> None:
        from libp2p.pubsub import rpc_queue

        push = rpc_queue.RpcQueue.push

        def push_urgent_first(self, rpc, priority: bool = False) -> bool:
            if not rpc.publish or not all(t in cls.topics for m in rpc.publish for t in m.topicIDs):
                return push(self, rpc, priority)
            queue = self._queue
            if not self.closed and len(queue) >= queue.max_size and queue._non_priority:
                for topic in message_topics(queue._non_priority.pop()):
                    PubsubDrops.add("outbound-queue-full", topic)
            return push(self, rpc, True)

        rpc_queue.RpcQueue.push = push_urgent_first


class ReceiveWindowExceeded(Exception):
    """A peer sent a Yamux stream more than the receive window we granted it."""


class KeptReceiveWindow(Patch):
    """Close the connection of a peer that sends past a Yamux stream's receive window, and report
    it (py-libp2p 0.8.1).

    py-libp2p counts each DATA frame against the stream's ``recv_window`` and, when a peer overruns
    it, logs "peer exceeded receive window", sets the window to 0 and keeps the bytes anyway: a
    peer that ignores windows can grow a stream's buffer without bound while our handler is not
    reading (a slow disk, a full queue), whatever the buffer is made of. The window is the memory
    bound of every stream; no honest sender crosses it (go-yamux closes the session with a
    protocol error when one does). Here ``recv_window`` refuses to go below 0: the host's
    :attr:`~node.net.host.SwarmHost.on_peer_fault` hears of the peer (node/peers bans it), the
    frame's handling stops with an error, the connection's read loop stops after that frame, and
    the connection is closed with its buffers dropped.

    The window is charged only once a frame's body is in memory, and py-libp2p reads any body up to
    16 MiB (its largest window) before that: on a stream granted 256 KiB a peer could have us
    assemble 16 MiB per connection. So a body longer than every window granted on the connection
    (a new stream's default included) is refused the same way before any of it is read. What one
    frame can hold past a window is thus bounded by the largest window granted, as memory is.
    """

    # Local peer id -> the host's fault callback (one per open host; tests run several in one process).
    reporters: dict[str, Callable[[str, str], None]] = {}

    @classmethod
    def _patch(cls) -> None:
        from libp2p.network.connection.exceptions import RawConnError
        from libp2p.stream_muxer.yamux.yamux import DEFAULT_WINDOW_SIZE, Yamux, YamuxStream

        class Overrun(ReceiveWindowExceeded, RawConnError):
            pass

        def overrun(muxer, what: str) -> Overrun:
            """Mark ``muxer`` for closing and report its peer once; the error to raise."""
            peer = str(muxer.peer_id)
            if not muxer.__dict__.get("_window_overrun"):
                muxer._window_overrun = True
                muxer.event_shutting_down.set()  # handle_incoming reads no frame after this one
                report = cls.reporters.get(str(muxer.secured_conn.get_local_peer()))
                if report is not None:
                    report(peer, "receive-window-exceeded")
            return Overrun(f"peer {peer} {what}")

        def get(self) -> int:
            return self._kept_recv_window

        def set_window(self, value: int) -> None:
            if value < 0:
                raise overrun(self.conn, f"sent {-value} bytes past stream {self.stream_id}'s receive window")
            self._kept_recv_window = value

        read_body = Yamux._read_data_body

        async def read_bounded_body(self, length: int) -> bytes:
            if length > DEFAULT_WINDOW_SIZE and length > max((s.recv_window for s in self.streams.values()), default=0):
                raise overrun(self, f"announced a {length}-byte frame, more than any window granted")
            return await read_body(self, length)

        handle_incoming = Yamux.handle_incoming

        async def handle_then_close(self) -> None:
            try:
                await handle_incoming(self)
            finally:
                # py-libp2p's handler of a DATA frame's errors only marks that stream closed.
                if self.__dict__.get("_window_overrun") and not self.event_closed.is_set():
                    with trio.CancelScope(shield=True):
                        await self._cleanup_on_error()

        YamuxStream.recv_window = property(get, set_window)
        Yamux._read_data_body = read_bounded_body
        Yamux.handle_incoming = handle_then_close


def disable_auto_connect(host) -> None:
    """Leave dialing to our connection manager (node/gossip/connections.py).

    py-libp2p's swarm runs its own auto-connector, which dials peers from the peerstore until it has
    about 200 connections (the midpoint of its 100/300 watermarks), periodically and after every
    disconnect. Above our ``conn_high`` the two fought: we pruned, it redialled at once. At N = 50
    on one machine that churn (each dial a Noise handshake, identify and gossipsub set-up) kept the
    CPU saturated and the swarm never converged.

    The swarm still tells the disabled connector of each disconnect, which it keeps by peer in a map
    that only its own dialer prunes: a node kept every peer that ever left (issue 45). Not recorded.
    """

    async def no_dial() -> None:
        return None

    connector = host.get_network().auto_connector
    connector.maybe_connect = no_dial
    connector.record_disconnect = lambda peer_id: None


# How long py-libp2p refuses to dial a peer whose every address just failed (its default: 60 s).
NEGATIVE_DIAL_TTL_S = 2.0


def shorten_negative_dial_cache(host) -> None:
    """A peer back from a restart is dialled again within :data:`NEGATIVE_DIAL_TTL_S` (issue 45).

    Once every address of a peer failed, py-libp2p's swarm fails each dial to it at once for 60 s,
    a second backoff on top of our dialers' own (node/gossip/connections.py, the outbox's, the
    gate's). A validator killed and restarted in 18 s thus stayed undialable by the trainer
    ("recently failed all addresses (negative cache)") and judged its first batch 60 s after the
    trainer's last failed hand-off (hour soak, t=2230 s), and workers could not dial a restarted
    trainer. Kept short, the cache still turns a burst of dials to a dead peer into one.
    """
    host.get_network()._negative_peer_cache._ttl = NEGATIVE_DIAL_TTL_S


class HandlerErrors:
    """Counts of stream handlers that failed, by protocol and exception type (for metrics/status)."""

    def __init__(self) -> None:
        self.counts: dict[tuple[str, str], int] = {}

    def add(self, protocol: str, exc: BaseException) -> None:
        key = (protocol, type(exc).__name__)
        self.counts[key] = self.counts.get(key, 0) + 1


# py-libp2p's own handlers (identify, gossipsub, ...) have no budget of ours: their streams are
# at least counted and capped per peer and in total (py-libp2p alone allows 256 per connection, and
# a peer may open several connections). The relay's hop/stop streams are left to its own limits.
OTHER_STREAMS = StreamLimits(streams=1024, streams_per_peer=32, frame_cap=0, buffer_bytes=1, buffer_per_peer=0)
UNCAPPED_PREFIXES = ("/libp2p/circuit/relay/",)


class StreamCount:
    """A per-protocol stream cap for a handler without an inbound budget of its own; ``budget``
    counts its streams (node/net/budget.py; no deadlines or bytes: we do not parse its frames)."""

    def __init__(self) -> None:
        self.budget = Budget(OTHER_STREAMS)

    def take(self, peer: str) -> bool:
        """A slot for a new stream of ``peer``, or False (refused and counted)."""
        if self.budget.admit(peer) is not None:
            return False
        if not self.budget.start():
            self.budget.refuse_busy()
            self.budget.leave(peer)
            return False
        return True

    def give_back(self, peer: str) -> None:
        self.budget.stop()
        self.budget.leave(peer)


def _peer_of(stream) -> str:
    try:
        return stream.muxed_conn.peer_id.to_base58()
    except AttributeError:
        return ""


def guard_handlers(host, errors: HandlerErrors, counts: dict | None = None) -> None:
    """Make every stream handler of ``host`` unable to crash the node.

    py-libp2p runs stream handlers inside the connection's nursery, and that nursery inside the
    swarm service that ``host.run`` waits on: an exception escaping any handler tears down the
    whole host. Its own pubsub handler lets a protobuf ``DecodeError`` escape (pubsub.py,
    ``stream_handler`` catches only StreamError/ParseError/IncompleteReadError), so one peer
    sending a malformed gossip RPC could stop us. We wrap the handlers already registered and
    every one registered later: a failing handler is logged, counted and its stream reset.
    A handler without an inbound budget of ours (``handler.inbound``, node/net/reqres.py) also gets
    a :class:`StreamCount` (in ``counts`` by protocol): a peer over its share is reset at once.
    """
    muxer = host.get_mux()

    def guard(protocol, handler):
        if handler is None or getattr(handler, "_guarded", False):
            return handler
        count = None
        if getattr(handler, "inbound", None) is None and not str(protocol).startswith(UNCAPPED_PREFIXES):
            count = StreamCount()
            if counts is not None:
                counts[str(protocol)] = count

        async def guarded(stream) -> None:
            peer = _peer_of(stream)
            if count is not None and not count.take(peer):
                try:
                    await stream.reset()
                except Exception:
                    pass
                return
            try:
                await handler(stream)
            except Exception as exc:  # the remote's bytes or a library bug: never fatal
                errors.add(str(protocol), exc)
                log.info("stream handler failed", extra={"protocol": str(protocol), "error": type(exc).__name__})
                try:
                    await stream.reset()
                except Exception:
                    pass
            finally:
                if count is not None:
                    count.give_back(peer)

        guarded._guarded = True
        return guarded

    for protocol, handler in list(muxer.handlers.items()):
        muxer.handlers[protocol] = guard(protocol, handler)
    original = host.set_stream_handler

    def set_stream_handler(protocol, handler):
        return original(protocol, guard(protocol, handler))

    host.set_stream_handler = set_stream_handler
