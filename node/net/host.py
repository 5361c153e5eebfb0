"""The libp2p host every role runs: TCP, Noise only, Yamux, identify, ping, gossipsub.

py-libp2p 0.8.1 offers Noise, TLS, secio and plaintext unless told otherwise; we pass Noise alone,
so a peer that only speaks an unauthenticated or deprecated channel cannot connect at all.

GossipSub parameters (py-libp2p's defaults are far from the v1.1 spec; see REFERENCES.md):

===================  =======  =================================================================
parameter            value    why
===================  =======  =================================================================
D / D_low / D_high   6/4/12   the spec's values: ~log(N) hops for 10^4 peers, modest fan-out
heartbeat            1 s      spec value; py-libp2p's 120 s would leave meshes unrepaired for minutes
peer exchange        on       a pruned peer learns others, so a node joining via one bootstrap
                              peer still finds a mesh
gossip window/hist   3/5      spec values
seen TTL             120 s    spec value; longer than any record refresh, so no echo storms
max RPC size         1 MiB    py-libp2p's cap; our messages are capped far below (MAX_GOSSIP)
scoring              on       each message a topic validator refuses (P4) costs its forwarder 10,
                              decaying by 0.9 a heartbeat (up to 100 counted); below -80 the
                              forwarder's messages are dropped unvalidated, below -50 it gets no
                              gossip, below -100 its GRAFTs are refused (graylist), below -10 its
                              PX is not accepted. Validators refuse only what proves its forwarder
                              at fault; what an honest relay may pass on in good faith is let
                              through and dropped by the topic's owner (IGNORE)
===================  =======  =================================================================

Application messages are validated by topic validators installed by their owners (membership,
checkpoints, ledger) *before* py-libp2p forwards them, so garbage is neither stored nor relayed.
"""

from __future__ import annotations

import contextlib
import math
import secrets
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import multiaddr
import trio
from libp2p import new_host
from libp2p.crypto.ed25519 import Ed25519PrivateKey as Libp2pEd25519PrivateKey
from libp2p.crypto.keys import KeyPair
from libp2p.crypto.x25519 import create_new_key_pair as create_x25519_key_pair
from libp2p.exceptions import BaseLibp2pError
from libp2p.host.ping import ID as PING_PROTOCOL
from libp2p.host.ping import PING_LENGTH, PingService
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr
from libp2p.pubsub.gossipsub import GossipSub
from libp2p.pubsub.pubsub import Pubsub
from libp2p.pubsub.score import ScoreParams, TopicScoreParams
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.stream_muxer.yamux.yamux import YamuxStream
from libp2p.tools.anyio_service import background_trio_service

from .. import fds
from ..identity import Identity
from .ports import check_listen_ports
from .patches import (HandlerErrors, KeptReceiveWindow, UrgentTopics, disable_auto_connect, guard_handlers, install_all,
                      shorten_negative_dial_cache)


GOSSIPSUB_PROTOCOLS = ["/meshsub/1.1.0", "/meshsub/1.0.0"]
# Our own gossip payloads are capped well below py-libp2p's 1 MiB RPC cap.
MAX_GOSSIP = 64 * 1024

# Opening a stream on a connection to a peer that has since restarted with the same key can hang
# in py-libp2p; a bound keeps every caller (a shards session, a sync round) from waiting forever
# with that peer reserved. Generous: it may include a dial and a relay hop.
OPEN_STREAM_TIMEOUT = 10.0

# What opening or using a stream raises when the other side is gone, unreachable or too slow.
STREAM_ERRORS = (BaseLibp2pError, trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError, OSError)
# A TCP connection across a partition is closed by neither side and carries nothing until TCP
# retransmits, its backoff doubling up to minutes (issue 45's soak: 16-40 s after a heal). The kernel
# aborts one whose sent data (or keepalive probe) stays unacknowledged this long; a busy peer's
# kernel still acknowledges, so only an unreachable one trips it.
TCP_USER_TIMEOUT_S = 15.0
TCP_KEEPALIVE_IDLE_S = 5  # an idle connection is probed after this many seconds, then every as many
LISTENER_CLOSE_S = 2.0  # at most this long closing the listeners when a host stops
MAX_PENDING_INBOUND = 64  # inbound connections in their handshake at once (as rust-libp2p's max_pending_incoming)
MAX_KEPT_PING_STREAMS = 64  # one per peer we ping; SWIM probes only connected members (<= conn_high)
ADDRS_TTL = 10.0  # seconds our own addresses are reused for (SwarmHost._addrs_of)

StreamHandler = Callable[[object], Awaitable[None]]


@dataclass
class GossipParams:
    """gossipsub settings (see the module docstring for why each value)."""

    degree: int = 6
    degree_low: int = 4
    degree_high: int = 12
    heartbeat_interval: int = 1  # py-libp2p takes whole seconds
    gossip_window: int = 3
    gossip_history: int = 5
    seen_ttl: int = 120
    do_px: bool = True
    prune_back_off: int = 60
    invalid_message_weight: float = -10.0
    graylist_threshold: float = -100.0
    gossip_threshold: float = -50.0
    publish_threshold: float = -80.0
    accept_px_threshold: float = -10.0
    # py-libp2p's eclipse guard grafts peers of other IPs into a mesh on fewer than 3. Off: in 0.8.1
    # its grafts ignore prune backoff, so a lone peer of a new IP that prunes us is grafted again every
    # heartbeat, which gossipsub v1.1 peers score as misbehaviour (read in its code, not measured).
    eclipse_protection: bool = False


def to_libp2p_keypair(identity: Identity) -> KeyPair:
    priv = Libp2pEd25519PrivateKey.from_bytes(identity.private_bytes)
    return KeyPair(priv, priv.get_public_key())


def parse_multiaddr(text: str) -> multiaddr.Multiaddr:
    """Parse a multiaddr; ValueError with a readable message when it is not one."""
    try:
        return multiaddr.Multiaddr(text)
    except Exception as e:  # multiaddr raises several private types
        raise ValueError(f"not a multiaddr: {text!r} ({e})") from None


def is_relayed(conn) -> bool:
    """True when a py-libp2p connection (or a stream's muxed connection) runs over a relay circuit
    (its address says p2p-circuit)."""
    try:
        addrs = conn.get_transport_addresses() or []
    except Exception:
        return False
    return any("/p2p-circuit" in str(a) for a in addrs)


def remote_ip_of(endpoint) -> str | None:
    """The IP the TCP connection under a py-libp2p stream or muxed connection comes from (over a
    relay circuit, the relay's); None when it does not say."""
    try:
        addr = endpoint.get_remote_address()
    except Exception:  # closing under us, or a transport that does not say
        return None
    return str(addr[0]) if addr else None


def peer_info_of(addr: str) -> PeerInfo:
    """PeerInfo from ``/ip4/.../tcp/.../p2p/<id>``; ValueError if the /p2p part is missing."""
    try:
        return info_from_p2p_addr(parse_multiaddr(addr))
    except ValueError:
        raise
    except Exception as e:
        raise ValueError(f"multiaddr {addr!r} has no /p2p/<peer id> part ({e})") from None


@dataclass
class SwarmHost:
    """A running libp2p host with pubsub; the handle every service receives."""

    identity: Identity
    host: object  # libp2p IHost
    pubsub: Pubsub
    gossipsub: GossipSub
    ping_service: PingService
    handler_errors: HandlerErrors = field(default_factory=lambda: HandlerErrors())
    # gossipsub's application-specific score of a peer; node/peers sets it to its table's view.
    app_score: Callable[[str], float] = field(default=lambda peer_id: 0.0)
    # Told of a peer that broke the muxer's rules (``on_peer_fault(peer_id, reason)``) as its
    # connection is closed; node/peers sets it to score the peer (KeptReceiveWindow).
    on_peer_fault: Callable[[str, str], None] = field(default=lambda peer_id, reason: None)
    # protocol -> the inbound budget of its handler (node/net/reqres.py Inbound), for status
    inbound: dict[str, object] = field(default_factory=dict)
    _ping_streams: dict[str, object] = field(default_factory=dict)  # peer -> stream of its last good ping
    _addrs: dict[str, tuple[float, list[str]]] = field(default_factory=dict)  # kind -> (until, addrs)

    @property
    def peer_id(self) -> str:
        return self.identity.peer_id

    def listen_addrs(self) -> list[str]:
        """Full multiaddrs (with /p2p/<id>) we are listening on."""
        return self._addrs_of("listen", self.host.get_addrs)

    def transport_addrs(self) -> list[str]:
        """Listen addresses without the /p2p suffix (what a peer record advertises)."""
        return self._addrs_of("transport", self.host.get_transport_addrs)

    def _addrs_of(self, kind: str, addrs: Callable[[], list]) -> list[str]:
        """``addrs()`` as text, computed at most once per :data:`ADDRS_TTL` of trio time.

        py-libp2p rebuilds every multiaddr from the listening sockets on each call: 0.4 ms in an
        idle node (its code cold in the CPU's caches), and status, the membership tick and pubsub
        asked ~8 times a second. Listen addresses are fixed once the host listens; an address
        observed by peers (identify) is shown at most that much later. Peer records add relayed
        addresses to these uncached (``advertised_addrs``).
        """
        try:
            now = trio.current_time()
        except RuntimeError:  # outside trio: nothing to save
            return [str(a) for a in addrs()]
        until, text = self._addrs.get(kind, (-math.inf, []))
        if now >= until:
            text = [str(a) for a in addrs()]
            self._addrs[kind] = (now + ADDRS_TTL, text)
        return list(text)

    def connected_peers(self) -> list[str]:
        return [p.to_base58() for p in self.host.get_connected_peers()]

    def make_urgent(self, topic: str) -> None:
        """Send ``topic``'s gossip messages ahead of every other in each peer's outbound queue, making
        room in a full one (checkpoint announcements: :class:`~node.net.patches.UrgentTopics`)."""
        UrgentTopics.topics.add(topic)

    def direct_peers(self) -> list[str]:
        """Peers we hold at least one connection to that does not run over a relay circuit: only
        they see our real IP, and only they may carry bulk data (a circuit spends a relay's
        bandwidth and its per-circuit byte limit)."""
        out = []
        for pid, conns in self.host.get_network().connections.items():
            conns = conns if isinstance(conns, (list, tuple, set)) else [conns]
            if any(not is_relayed(c) for c in conns):
                out.append(pid.to_base58())
        return out

    def remote_ip(self, peer_id: str) -> str | None:
        """The IP our connection to ``peer_id`` comes from: the peer's own on a direct connection, the
        relay's on a relayed one (a circuit runs over our connection to the relay); None if none."""
        try:
            conns = self.host.get_network().connections.get(ID.from_base58(peer_id))
        except ValueError:
            return None
        conns = conns if isinstance(conns, (list, tuple, set)) else [conns] if conns else []
        ips = (remote_ip_of(conn.muxed_conn) for conn in sorted(conns, key=is_relayed))  # a direct one first
        return next((ip for ip in ips if ip), None)

    def is_connected(self, peer_id: str) -> bool:
        return ID.from_base58(peer_id) in self.host.get_network().connections

    async def connect(self, addr: str) -> str:
        """Dial a full multiaddr; returns the remote peer id."""
        info = peer_info_of(addr)
        await self.host.connect(info)
        return info.peer_id.to_base58()

    async def connect_peer(self, peer_id: str, addrs: list[str]) -> None:
        """Dial a peer by id at the given transport addresses."""
        info = PeerInfo(ID.from_base58(peer_id), [parse_multiaddr(a) for a in addrs])
        await self.host.connect(info)

    async def connect_direct(self, peer_id: str, addrs: list[str]) -> None:
        """Hold a direct connection to ``peer_id``, dialling the given transport addresses even
        while a relayed one is held: py-libp2p's connect returns at once on any connection, and
        only direct ones carry bulk data (:meth:`direct_peers`). Nothing is dialled when one is held."""
        if not self.is_connected(peer_id):
            await self.connect_peer(peer_id, addrs)
            return
        if peer_id in self.direct_peers():
            return
        pid = ID.from_base58(peer_id)
        failures = []
        for addr in addrs:
            try:
                await self.host.get_network().dial_addr(parse_multiaddr(addr), pid)
                return
            except Exception as e:  # libp2p raises many types for "could not connect"
                failures.append(f"{addr}: {e}")
        raise ConnectionError(f"no direct connection to {peer_id}: {'; '.join(failures) or 'no address'}")

    async def disconnect(self, peer_id: str) -> None:
        await self.host.disconnect(ID.from_base58(peer_id))

    async def ping(self, peer_id: str) -> float:
        """One round trip of the libp2p ping protocol, in seconds (raises on failure).

        The stream of the last good ping to the peer is kept and used again (the protocol allows
        any number of round trips on one stream): opening a stream costs a Yamux SYN, a multistream
        negotiation and a handler task on both sides, most of what an idle node's once-a-second SWIM
        probe cost. A kept stream the peer has closed meanwhile (its idle limit, a restart) fails at
        once and the ping is tried again on a fresh stream; a cancelled or failed ping resets its
        stream and keeps nothing. Not py-libp2p's ``PingService.ping``: it caches its stream per
        peer too, but a ping cancelled mid-flight (every probe timeout) leaves that stream cached
        with an echo still due, and the next ping raises TypeError, for that peer, for good.
        """
        kept = self._ping_streams.pop(peer_id, None)
        if kept is not None:
            try:
                return await self._ping_on(peer_id, kept)
            except STREAM_ERRORS:  # MuxedStreamEOF is a BaseLibp2pError, our ConnectionError an OSError
                pass  # closed by the peer while idle: a fresh stream says whether it is alive
        return await self._ping_on(peer_id, await self.open_stream(peer_id, PING_PROTOCOL))

    async def _ping_on(self, peer_id: str, stream) -> float:
        payload = secrets.token_bytes(PING_LENGTH)
        ok = False
        try:
            start = trio.current_time()
            await stream.write(payload)
            echoed = b""
            while len(echoed) < PING_LENGTH:
                chunk = await stream.read(PING_LENGTH - len(echoed))
                if not chunk:
                    raise ConnectionError("ping stream closed before the echo")
                echoed += chunk
            if echoed != payload:
                raise ConnectionError("ping echo differs from what was sent")
            ok = True
            return trio.current_time() - start
        finally:
            if ok and peer_id not in self._ping_streams and len(self._ping_streams) < MAX_KEPT_PING_STREAMS:
                self._ping_streams[peer_id] = stream
            else:  # even a cancelled ping closes its stream: an echo may still be on its way
                with trio.move_on_after(1, shield=True), contextlib.suppress(*STREAM_ERRORS):
                    await stream.reset()

    def forget_ping_streams(self, connected: set[str]) -> None:
        """Drop kept ping streams of peers we are no longer connected to (their streams are dead)."""
        for peer in [p for p in self._ping_streams if p not in connected]:
            del self._ping_streams[peer]

    def forget_departed(self, departed, now: float) -> int:
        """Drop from py-libp2p's peer store the peers ``departed`` (node/peers/departed.py) says
        were away long enough; our own entry stays. Returns how many were dropped."""
        store = self.host.get_peerstore()
        known = {p.to_base58(): p for p in store.peer_ids()}
        known.pop(self.peer_id, None)
        connected = {p.to_base58() for p in self.host.get_network().connections}
        gone = departed.due(known, connected, now)
        for peer in gone:
            store.clear_peerdata(known[peer])
        return len(gone)

    def set_handler(self, protocol: str, handler: StreamHandler) -> None:
        inbound = getattr(handler, "inbound", None)
        if inbound is not None:
            self.inbound[protocol] = inbound
        self.host.set_stream_handler(protocol, handler)

    async def open_stream(self, peer_id: str, protocol: str, timeout: float = OPEN_STREAM_TIMEOUT):
        """A new stream to ``peer_id``; trio.TooSlowError after ``timeout`` seconds."""
        with trio.fail_after(timeout):
            return await self.host.new_stream(ID.from_base58(peer_id), [protocol])

    def mesh_size(self, topic: str) -> int:
        """Peers in our gossipsub mesh for ``topic`` (between degree_low and degree_high when healthy)."""
        return len(self.gossipsub.mesh.get(topic, ()))


async def widen_receive_window(stream, size: int) -> None:
    """Let the peer send up to ``size`` bytes on ``stream`` before it waits for a window update.

    Yamux starts every stream at a 256 KiB window and py-libp2p grows it only when the window is
    used up within 4 round trips, which a link slower than 256 KiB per 4 RTTs never does: on a
    10 Mbit/s link a downloader granted credit (a WINDOW_UPDATE frame: a Noise message, a send
    and a wake-up of the peer's reader) for every 128 KiB it read, one per block, and a sender on
    loopback had one block in flight at a time. Where the application bounds what the peer sends
    (a download asks for its blocks), the window need not: one grant at the start opens it.
    Streams of other muxers are left as they are.
    """
    muxed = getattr(stream, "muxed_stream", None)
    if not isinstance(muxed, YamuxStream):
        return
    async with muxed.window_lock:
        grant = size - muxed.target_recv_window
        if grant <= 0:
            return
        muxed.target_recv_window = size
        muxed.recv_window += grant
    await muxed.send_window_update(grant)


def _score_params(p: GossipParams, app_score: Callable[[str], float]) -> ScoreParams:
    return ScoreParams(
        # py-libp2p 0.8.1 SUBTRACTS weight x count for invalid messages (score.py topic_score) where
        # the spec adds a negative weight: passed as is, the spec's -10 raised a refused message's
        # forwarder by 10 each (tests/test_pubsub_scoring.py). GossipParams keeps the spec's sign.
        p4_invalid_messages=TopicScoreParams(weight=-p.invalid_message_weight, cap=100.0, decay=0.9),
        p6_appl_slack_weight=1.0,
        publish_threshold=p.publish_threshold,
        gossip_threshold=p.gossip_threshold,
        graylist_threshold=p.graylist_threshold,
        accept_px_threshold=p.accept_px_threshold,
        app_specific_score_fn=lambda peer: app_score(peer.to_base58()),
    )


def guard_inbound(host) -> None:
    """Admit an inbound TCP connection only while fewer than ``MAX_PENDING_INBOUND`` are still in
    their Noise/Yamux handshake and the process keeps its descriptor reserve (node/fds.py); others
    are closed at once. py-libp2p bounds a handshake only in time (10 s), so silent connections held
    a descriptor each without limit (issue 42: running out ended the node).

    py-libp2p's inbound handler, once the upgrade is done, waits for the *swarm* to stop (the
    "intentional barrier" in ``Swarm._do_handle_inbound_connection``), not for the connection: each
    inbound connection a node ever accepted kept a task, and kept its place here, so the 65th of a
    node's life was refused (issue 45's soak: tasks grew by hundreds an hour under churn). So the
    upgrade is wrapped: a finished handshake frees its place, and the connection's close ends its
    handler."""
    fds.quiet_accept_errors()
    swarm = host.get_network()
    handshaking: set[int] = set()  # id() of the raw streams in their handshake
    holders: dict[int, trio.CancelScope] = {}  # raw stream -> the scope its handler runs in
    upgrade_raw = swarm.upgrade_inbound_raw_conn

    async def upgrade_until_closed(raw_conn, maddr):
        key = id(getattr(raw_conn, "stream", None))  # the stream ``admitted`` got
        if key not in holders:  # not from our TCP listeners (a relay circuit, a hole punch): callers await the upgrade
            return await upgrade_raw(raw_conn, maddr)
        try:
            muxed = await upgrade_raw(raw_conn, maddr)
        finally:
            handshaking.discard(key)
        await muxed.event_closed.wait()
        holders[key].cancel()  # ends the handler at the swarm's barrier, instead of at its stop
        return muxed

    swarm.upgrade_inbound_raw_conn = upgrade_until_closed
    for listener in swarm.listeners.values():
        upgrade = getattr(listener, "handler", None)  # TCP listeners; a relay's circuits have their own limits
        if upgrade is None:
            continue

        async def admitted(raw, upgrade=upgrade) -> None:
            if len(handshaking) >= MAX_PENDING_INBOUND or not fds.room_for_remote():
                await raw.close()
                return
            key = id(raw)
            handshaking.add(key)
            try:
                with trio.CancelScope() as holders[key]:
                    await upgrade(raw)  # returns when the upgrade failed; cancelled when the connection closes
            finally:
                handshaking.discard(key)
                del holders[key]

        listener.handler = admitted


def tcp_socket_of(raw_conn):
    """The socket under a py-libp2p raw connection (RawConnection -> TrioTCPStream -> SocketStream), or
    None for one that is not plain TCP (a relay circuit)."""
    return getattr(getattr(getattr(raw_conn, "stream", None), "stream", None), "socket", None)


def abort_when_unreachable(sock) -> None:
    """Let the kernel abort ``sock`` once the peer has not acknowledged for ``TCP_USER_TIMEOUT_S``,
    idle or not (Linux; elsewhere only keepalive, at the system's intervals)."""
    opts = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]
    for name, value in (("TCP_KEEPIDLE", TCP_KEEPALIVE_IDLE_S), ("TCP_KEEPINTVL", TCP_KEEPALIVE_IDLE_S),
                        ("TCP_USER_TIMEOUT", int(TCP_USER_TIMEOUT_S * 1000))):
        if hasattr(socket, name):
            opts.append((socket.IPPROTO_TCP, getattr(socket, name), value))
    for level, opt, value in opts:
        with contextlib.suppress(OSError):  # a socket already closed by the peer
            sock.setsockopt(level, opt, value)


def watch_links(host) -> None:
    """Every TCP connection of ``host``, dialled or accepted, gets :func:`abort_when_unreachable`
    before its handshake: a partition then ends its connections within ``TCP_USER_TIMEOUT_S``, and
    the membership service redials (the bootstrap peers too, node/gossip/connections.py)."""
    swarm = host.get_network()

    def watched(upgrade):
        async def upgrade_watched(raw_conn, *args, **kwargs):
            if (sock := tcp_socket_of(raw_conn)) is not None:
                abort_when_unreachable(sock)
            return await upgrade(raw_conn, *args, **kwargs)
        return upgrade_watched

    swarm.upgrade_inbound_raw_conn = watched(swarm.upgrade_inbound_raw_conn)
    swarm.upgrade_outbound_raw_conn = watched(swarm.upgrade_outbound_raw_conn)


@asynccontextmanager
async def open_swarm_host(
    identity: Identity,
    listen: list[str],
    gossip: GossipParams | None = None,
) -> AsyncIterator[SwarmHost]:
    """Start a host listening on ``listen`` with pubsub running; stop everything on exit."""
    gossip = gossip or GossipParams()
    install_all()
    keypair = to_libp2p_keypair(identity)
    noise = NoiseTransport(keypair, noise_privkey=create_x25519_key_pair().private_key)
    addrs = [parse_multiaddr(a) for a in listen]
    check_listen_ports(addrs)
    host = new_host(
        key_pair=keypair,
        sec_opt={NOISE_PROTOCOL_ID: noise},
        muxer_preference="YAMUX",
        listen_addrs=addrs,
    )
    disable_auto_connect(host)
    shorten_negative_dial_cache(host)
    handler_errors = HandlerErrors()
    inbound: dict[str, object] = {}  # py-libp2p's own handlers' stream counts, then our budgets
    guard_handlers(host, handler_errors, inbound)
    router = GossipSub(
        protocols=GOSSIPSUB_PROTOCOLS,
        degree=gossip.degree,
        degree_low=gossip.degree_low,
        degree_high=gossip.degree_high,
        heartbeat_interval=gossip.heartbeat_interval,
        gossip_window=gossip.gossip_window,
        gossip_history=gossip.gossip_history,
        do_px=gossip.do_px,
        prune_back_off=gossip.prune_back_off,
        score_params=_score_params(gossip, lambda peer_id: swarm_host.app_score(peer_id)),
        # It refuses no one: it grafts peers of new IPs into a mesh on fewer than 3 and prunes an
        # over-represented IP first; on loopback it has nothing to do (tests/test_gossip_eclipse.py).
        eclipse_protection_enabled=gossip.eclipse_protection,
        # Its rate limit (10 messages a second per forwarder and topic) counts our own publishes and a
        # relay's honest forwarding of many authors alike: a trainer's burst of ledger entries lost
        # all but ten and scored itself down. Floods are bounded where the sender is known: each
        # topic's validator checks signature, size and schema and budgets records per source
        # (node/net/budget.py), and peer scoring drops those who send what fails.
        spam_protection_enabled=False,
    )
    pubsub = Pubsub(host, router, seen_ttl=gossip.seen_ttl, max_inbound_rpc_size=1024 * 1024)
    # Receivers name a message by (author, seqno) and drop a name seen in the last seen_ttl. py-libp2p
    # starts the counter at the clock in whole seconds, one more per message: a node that published
    # more than one a second (a trainer: a ledger entry per batch) and restarted within a few
    # minutes began on numbers its last process had just used, and receivers dropped what it
    # published as duplicates (issue 45's soak: no node heard the trainer's v34-36, restarted 150 s
    # after its start). Nanoseconds, as go-libp2p: a restart begins past every number used before.
    pubsub.counter = time.time_ns()
    swarm_host = SwarmHost(identity, host, pubsub, router, PingService(host), handler_errors, inbound=inbound)
    KeptReceiveWindow.reporters[swarm_host.peer_id] = lambda peer, reason: swarm_host.on_peer_fault(peer, reason)
    try:
        async with host.run(addrs):
            watch_links(host)
            guard_inbound(host)
            async with background_trio_service(pubsub), background_trio_service(router):
                await pubsub.wait_until_ready()
                yield swarm_host
    finally:
        KeptReceiveWindow.reporters.pop(swarm_host.peer_id, None)
        await close_listeners(host)


async def close_listeners(host) -> None:
    """Stop listening. py-libp2p's TCP listener runs as a trio system task that the host's stop
    leaves running: a stopped host kept accepting connections on its port, and kept three tasks."""
    with trio.CancelScope(shield=True), trio.move_on_after(LISTENER_CLOSE_S):
        for listener in list(host.get_network().listeners.values()):
            await listener.close()

