"""Circuit Relay v2: relays carry connections to peers that cannot be dialled directly (NAT).

How it works (libp2p spec ``relay/circuit-v2.md``):

* A **relay** (role ``relay``) runs the HOP service: ``/libp2p/circuit/relay/0.2.0/hop``.
* A node behind NAT can still dial *out*. It connects to a relay and sends ``RESERVE``; the relay
  keeps a slot for it (``RESERVATION_TTL_S``) and answers with its own public addresses. The node
  then advertises ``<relay addr>/p2p/<relay>/p2p-circuit/p2p/<self>`` (``circuit_addrs()``) and
  refreshes the reservation before it expires, over the connection it keeps open to the relay.
* A peer that wants to reach it dials the relay and sends ``CONNECT <target>``; the relay opens a
  ``/libp2p/circuit/relay/0.2.0/stop`` stream to the target over the target's own (outbound, so
  NAT-friendly) connection, and from then on pipes bytes between the two streams. The two ends run
  a full Noise + Yamux handshake *through* that pipe, so the relay sees only ciphertext and cannot
  impersonate either side: the peer id of a relayed connection is as authenticated as a direct one.
* Relays bound what they give away: reservations, circuits per reserved peer, bytes and seconds
  per circuit (constants below). A circuit past its limit is reset; the two peers redial.

This module wraps py-libp2p 0.8.1's implementation (``libp2p/relay/circuit_v2/``) and works
around its quirks, each citing the py-libp2p source line it depends on:

* relay side (:class:`_SwarmCircuitProtocol`): reservations are for the authenticated sender, not
  for any id the message names; slots of disconnected holders are freed; reservations per IP are
  capped; idle circuits are reset at their duration limit; our own EOF noise is not logged as
  an error;
* target side: relayed connections are accepted only from relays we reserved on;
* client side: our own RESERVE exchange (:func:`call_reserve`, keeps the relay's addresses) and
  refresh loop (:meth:`RelayClient.keep_reservations`, survives relay restarts), and
  :func:`connect_addr`, because py-libp2p's swarm never dials ``/p2p-circuit`` addresses itself.

Pure helpers (address building, reservation parsing, refresh scheduling) take their inputs,
including the time, as arguments.
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from dataclasses import dataclass, field

import multiaddr
import trio
from libp2p.peer.id import ID
from libp2p.relay.circuit_v2.config import RelayConfig, RelayRole
from libp2p.relay.circuit_v2.dcutr import DCUtRProtocol
from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage, StopMessage
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as HOP_PROTOCOL_ID
from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
from libp2p.relay.circuit_v2.protocol_buffer import StatusCode
from libp2p.relay.circuit_v2.resources import RelayLimits
from libp2p.relay.circuit_v2.transport import CircuitV2Transport
from libp2p.relay.circuit_v2.utils import read_delimited_msg, write_delimited_msg
from libp2p.tools.anyio_service import background_trio_service

from ..context import NodeContext
from ..identity import public_key_of
from ..net.host import SwarmHost, parse_multiaddr, remote_ip_of
from ..wire import RemoteProtocolError

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------
# Limits of the HOP service. go-libp2p's defaults (2 min, 128 KiB per circuit) assume a relay
# only bridges the seconds a hole punch takes. Our NAT'd peers keep dialling *out* for bulk data
# (checkpoint pieces, rollout uploads go to public peers), so a relay carries what others must
# initiate towards them: membership probes, gossip, small requests. These bounds keep one relay
# able to serve its whole reservation table at once without unbounded memory or bandwidth.

# How long one reservation lasts before the client must refresh it (the spec's and go-libp2p's 1 h).
RESERVATION_TTL_S = 3600
# Reserved peers one relay keeps at most (py-libp2p's cap is global, not per IP: resources.py:260).
MAX_RESERVATIONS = 128
# Reservations from one IP address: peer ids are free to mint, addresses are not. py-libp2p
# defines this very value (config.py:32, HopConfig) but never enforces it.
MAX_RESERVATIONS_PER_IP = 8
# Concurrent circuits towards one reserved peer; total circuits <= MAX_RESERVATIONS * this.
MAX_CIRCUITS_PER_PEER = 8
# A circuit is reset after this long; the peers redial (relay capacity turns over).
MAX_CIRCUIT_DURATION_S = 600
# Bytes one circuit may carry, both directions together (py-libp2p shares the budget: C3 fix).
MAX_CIRCUIT_BYTES = 16 * 1024 * 1024
# Extra seconds past MAX_CIRCUIT_DURATION_S before we reset an idle circuit ourselves.
CIRCUIT_DURATION_GRACE_S = 5

# Client side.
DIAL_TIMEOUT_S = 20  # a relayed dial = relay dial + HOP CONNECT + STOP + Noise + Yamux
RESERVE_TIMEOUT_S = 15  # one RESERVE round trip, connection to the relay included
REFRESH_FRACTION = 0.5  # refresh when half of the reservation's lifetime is left
MIN_REFRESH_S = 10.0  # never refresh more often than this (a relay granting tiny TTLs)
CHECK_INTERVAL_S = 10.0  # how often the keeper checks that the relay connection is still up
RETRY_BASE_S = 2.0  # first retry after a failed reservation; doubles per failure
RETRY_MAX_S = 120.0
MAX_RESERVATION_ADDRS = 16  # relay addresses we accept from one reservation (they are advertised)
MAX_RELAYS = 8  # relays a node reserves on at most
STOP_READ_TIMEOUT_S = 5  # wait for an unwanted STOP offer before refusing it


class RelayError(ConnectionError):
    """A relay operation failed (relay unreachable, refused, or timed out); the message says why.

    ``status`` is the relay's refusal code when there was one (e.g. ``NO_RESERVATION``: the target
    holds no reservation on that relay).
    """

    def __init__(self, message: str, status: StatusCode | None = None) -> None:
        super().__init__(message)
        self.status = status


# ---------------------------------------------------------------------------------------------
# Pure helpers


def hop_limits(
    *,
    reservations: int = MAX_RESERVATIONS,
    circuits_per_peer: int = MAX_CIRCUITS_PER_PEER,
    duration_s: int = MAX_CIRCUIT_DURATION_S,
    circuit_bytes: int = MAX_CIRCUIT_BYTES,
    reservation_ttl_s: int = RESERVATION_TTL_S,
) -> RelayLimits:
    """py-libp2p's limits object from our constants (tests pass smaller values)."""
    for name, v in (("reservations", reservations), ("circuits_per_peer", circuits_per_peer),
                    ("duration_s", duration_s), ("circuit_bytes", circuit_bytes),
                    ("reservation_ttl_s", reservation_ttl_s)):
        if v <= 0:  # py-libp2p reads 0 as "unlimited" for duration and bytes: never allowed here
            raise ValueError(f"relay limit {name} must be > 0, got {v}")
    return RelayLimits(
        duration=duration_s,
        data=circuit_bytes,
        max_circuit_conns=circuits_per_peer,
        max_reservations=reservations,
        reservation_ttl=reservation_ttl_s,
    )


def relay_peer_id_of(relay_addr: str) -> str:
    """The relay's peer id from its full multiaddr; ValueError if there is none."""
    addr = parse_multiaddr(relay_addr)
    if any(p.name == "p2p-circuit" for p in addr.protocols()):
        raise ValueError(f"{relay_addr!r} is already a circuit address, not a relay address")
    pid = addr.get_peer_id()
    if not pid:
        raise ValueError(f"relay address {relay_addr!r} needs a /p2p/<relay peer id> part")
    return str(pid)


def circuit_addr(relay_addr: str, target_peer_id: str) -> str:
    """``<relay addr>/p2p/<relay>/p2p-circuit/p2p/<target>``: how peers reach target via relay."""
    relay_peer_id_of(relay_addr)  # validates
    public_key_of(target_peer_id)  # raises ValueError for a non-Ed25519 / malformed id
    return f"{relay_addr}/p2p-circuit/p2p/{target_peer_id}"


def split_circuit_addr(addr: str) -> tuple[str, str] | None:
    """``(relay addr, target peer id)`` of a circuit address, or None for a direct address."""
    ma = parse_multiaddr(addr)
    text = str(ma)
    if "/p2p-circuit" not in text:
        return None
    relay_part, _, target_part = text.partition("/p2p-circuit")
    target = multiaddr.Multiaddr(target_part).get_peer_id() if target_part else None
    if not target:
        raise ValueError(f"circuit address {addr!r} needs /p2p-circuit/p2p/<target peer id>")
    relay_peer_id_of(relay_part)  # validates the relay part
    return relay_part, str(target)


@dataclass(frozen=True)
class Reservation:
    """A reservation a relay granted us (checked by :func:`parse_reservation`)."""

    relay_peer_id: str
    expire_unix: int  # absolute expiry (spec: Unix seconds)
    relay_addrs: tuple[str, ...]  # the relay's public addresses, each ending in /p2p/<relay>
    limit_duration_s: int  # 0 = the relay did not say
    limit_bytes: int


def parse_reservation(resp: HopMessage, relay_peer_id: str, now_unix: float) -> Reservation:
    """Check a relay's answer to RESERVE; RemoteProtocolError saying what was wrong.

    We read the message ourselves instead of py-libp2p's ``_make_reservation``, which keeps only
    the expiry and drops ``reservation.addrs`` (transport.py:855), the relay's own view of its
    public addresses: exactly what a NAT'd peer must advertise.
    """
    if resp.type != HopMessage.STATUS:
        raise RemoteProtocolError("relay-unexpected-message", f"type {resp.type} instead of STATUS")
    status = resp.status if resp.HasField("status") else StatusCode.UNUSED
    if status != StatusCode.OK:
        try:
            name = StatusCode(status).name
        except ValueError:
            name = str(status)
        raise RemoteProtocolError("relay-refused", name)
    if not resp.HasField("reservation"):
        raise RemoteProtocolError("relay-bad-reservation", "OK without a reservation")
    expire = int(resp.reservation.expire)
    if expire <= now_unix:
        raise RemoteProtocolError("relay-bad-reservation", f"expiry {expire} is in the past")
    addrs: list[str] = []
    for raw in list(resp.reservation.addrs)[:MAX_RESERVATION_ADDRS]:
        try:
            ma = multiaddr.Multiaddr(bytes(raw))
        except Exception:
            continue  # one unreadable address does not spoil the others
        text = str(ma)
        # Only addresses naming this relay: a relay cannot make us advertise someone else.
        if ma.get_peer_id() == relay_peer_id and "/p2p-circuit" not in text:
            addrs.append(text)
    limit = resp.limit if resp.HasField("limit") else None
    return Reservation(
        relay_peer_id=relay_peer_id,
        expire_unix=expire,
        relay_addrs=tuple(dict.fromkeys(addrs)),
        limit_duration_s=int(limit.duration) if limit is not None else 0,
        limit_bytes=int(limit.data) if limit is not None else 0,
    )


def refresh_delay(expire_unix: float, now_unix: float) -> float:
    """Seconds until we refresh a reservation expiring at ``expire_unix``."""
    return max(MIN_REFRESH_S, (expire_unix - now_unix) * REFRESH_FRACTION)


def retry_delay(failures: int) -> float:
    """Seconds before retrying a relay after ``failures`` consecutive failures (>= 1)."""
    return min(RETRY_MAX_S, RETRY_BASE_S * 2 ** max(0, failures - 1))


# ---------------------------------------------------------------------------------------------
# py-libp2p's protocol with our fixes


class _SwarmCircuitProtocol(CircuitV2Protocol):
    """py-libp2p's Circuit v2 protocol with three fixes and circuit counters.

    ``stop_from`` says which peers may hand us relayed connections (STOP streams).
    """

    def __init__(self, host, limits: RelayLimits | None, allow_hop: bool, stop_from,
                 max_reservations_per_ip: int = MAX_RESERVATIONS_PER_IP) -> None:
        super().__init__(host, limits, allow_hop=allow_hop)
        self._stop_from = stop_from
        self.max_reservations_per_ip = max_reservations_per_ip
        self._reservation_ip: dict[ID, str] = {}  # reserved peer -> IP it reserved from
        self.circuits_active = 0  # CONNECT requests being answered or relayed now
        self.connects_total = 0  # CONNECT requests received
        self.reservations_refused = 0
        self.circuit_bytes = 0  # bytes carried over circuits, both directions, since start

    async def _handle_reserve(self, stream, msg: HopMessage) -> None:
        # Fix 1: py-libp2p reserves for whatever peer id the RESERVE message names
        # (protocol.py:510-511), so one peer could fill the table with made-up ids or take a
        # victim's slot. The spec's RESERVE has no peer field: reserve for the authenticated
        # remote of the connection, as go/rust do.
        if msg.HasField("peer"):
            msg.ClearField("peer")
        peer = stream.muxed_conn.peer_id
        self._drop_dead_reservations()
        ip = remote_ip_of(stream)
        table = self.resource_manager._reservations
        if peer not in table and ip is not None:
            same_ip = sum(1 for p in table if self._reservation_ip.get(p) == ip)
            if same_ip >= self.max_reservations_per_ip:
                self.reservations_refused += 1
                log.info("relay: refused a reservation for %s: %d already from %s", peer, same_ip, ip)
                await self._send_status(stream, StatusCode.RESERVATION_REFUSED, "too many reservations from this IP")
                return
        await super()._handle_reserve(stream, msg)
        if peer in table and ip is not None:
            self._reservation_ip[peer] = ip

    def _drop_dead_reservations(self) -> None:
        # Fix 4: a reservation is only honoured while its holder stays connected
        # (resources.py:449 and :514), yet it keeps counting against max_reservations until its
        # TTL ends (resources.py:260), an hour by default: churning NAT'd peers would lock
        # everyone else out. Free the slots of expired or disconnected holders first.
        rm = self.resource_manager
        for peer, res in list(rm._reservations.items()):
            if res.is_expired() or not rm._is_peer_connected(peer):
                del rm._reservations[peer]
        for peer in list(self._reservation_ip):
            if peer not in rm._reservations:
                del self._reservation_ip[peer]

    async def _handle_connect(self, stream, msg: HopMessage) -> None:
        # Fix 2: py-libp2p checks a circuit's duration only when bytes arrive
        # (protocol.py:757 and :847), so an idle circuit outlives its limit, holds the target's
        # circuit slot, and the peers see a connection that fails on first use. We put a trio
        # deadline on the whole circuit and reset both streams when it passes.
        self.circuits_active += 1
        self.connects_total += 1
        try:
            with trio.move_on_after(self.limits.duration + CIRCUIT_DURATION_GRACE_S) as scope:
                await super()._handle_connect(stream, msg)
            if scope.cancelled_caught:
                log.info("relay: circuit %s -> %s reached its duration limit; reset",
                         stream.muxed_conn.peer_id, _peer_of(msg))
                await self._reset_circuit(stream, msg)
        finally:
            self.circuits_active -= 1

    async def _read_stream_with_retry(self, stream, *args, **kwargs):
        # Counter only: py-libp2p reads each chunk it relays here (protocol.py:860), and nowhere
        # else, so the sum is what our circuits carried (what the NAT test checks stays small).
        data = await super()._read_stream_with_retry(stream, *args, **kwargs)
        if data:
            self.circuit_bytes += len(data)
        return data

    async def _reset_circuit(self, stream, msg: HopMessage) -> None:
        # The cancelled relay loop leaves (source, destination) in _active_relays under the
        # destination id (protocol.py:722): reset the destination side too, if it is ours.
        dest = _peer_of(msg)
        entry = self._active_relays.get(dest) if dest is not None else None
        streams = [stream]
        if entry is not None and entry[0] is stream:
            streams.append(entry[1])
            del self._active_relays[dest]
        with trio.CancelScope(shield=True), trio.move_on_after(self.close_timeout):
            for s in streams:
                if s is not None:
                    with contextlib.suppress(Exception):
                        await s.reset()

    async def _handle_stop_stream(self, stream) -> None:
        # Fix 3: py-libp2p accepts a relayed connection from any peer that opens a STOP stream
        # ("nothing to validate target-side", protocol.py:418). Only relays we hold a reservation
        # on have a reason to: refuse the rest, so nobody can push unsolicited connections at us.
        relay = stream.muxed_conn.peer_id.to_base58()
        if not self._stop_from(relay):
            log.info("relay: refused a relayed connection offered by %s (no reservation there)", relay)
            # Read the offer first (bounded: 64 KiB, utils.py:31) so the refusal is an answer.
            with trio.move_on_after(STOP_READ_TIMEOUT_S), contextlib.suppress(Exception):
                await read_delimited_msg(stream, StopMessage)
            await self._send_stop_status(stream, StatusCode.PERMISSION_DENIED, "no reservation")
            await self._close_stream(stream)
            return
        await super()._handle_stop_stream(stream)


def _peer_of(msg: HopMessage) -> ID | None:
    try:
        return ID(msg.peer.id) if msg.HasField("peer") else None
    except Exception:
        return None


# ---------------------------------------------------------------------------------------------
# HOP service (relays)


class _HopEofFilter(logging.Filter):
    """Drop py-libp2p's ERROR line for a client that closes its HOP stream after one exchange.

    The HOP handler keeps reading further messages on a stream (protocol.py:334-351) and logs
    the end of stream as an error with an empty reason, once per reservation and refresh. Every
    other relay error still gets through.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not (msg.startswith("Error reading from hop stream from ") and msg.endswith(": "))


@dataclass
class RelayHop:
    """The HOP service's API object (handed back by :func:`serve_relay_hop`)."""

    protocol: _SwarmCircuitProtocol
    host: SwarmHost

    async def connect_addr(self, addr: str) -> str:
        """Connect to a full multiaddr, direct or circuit (:func:`connect_addr`)."""
        return await connect_addr(self.host, addr)

    def circuit_addrs(self) -> list[str]:
        """A relay takes no relayed connections itself: it is reached directly."""
        return []

    def reservation_count(self) -> int:
        # py-libp2p has no public counter; its table is RelayResourceManager._reservations
        # (resources.py:233). Expired entries linger until the next RESERVE cleans them.
        now = time.time()
        table = self.protocol.resource_manager._reservations
        return sum(1 for r in table.values() if r.expires_at >= now)

    def status(self) -> dict:
        limits = self.protocol.limits
        return {
            "role": "hop",
            "reservations": self.reservation_count(),
            "circuits_active": self.protocol.circuits_active,
            "connects_total": self.protocol.connects_total,
            "circuit_bytes": self.protocol.circuit_bytes,
            "reservations_refused_per_ip": self.protocol.reservations_refused,
            "limits": {
                "reservations": limits.max_reservations,
                "circuits_per_peer": limits.max_circuit_conns,
                "circuit_duration_s": limits.duration,
                "circuit_bytes": limits.data,
                "reservation_ttl_s": limits.reservation_ttl,
                "reservations_per_ip": self.protocol.max_reservations_per_ip,
            },
        }


async def serve_relay_hop(
    node: NodeContext,
    *,
    limits: RelayLimits | None = None,
    max_reservations_per_ip: int = MAX_RESERVATIONS_PER_IP,
    task_status=trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the Circuit Relay v2 HOP service until cancelled (the ``relay`` role)."""
    limits = limits or hop_limits()
    # A relay does not take relayed connections itself (no reservations of its own).
    protocol = _SwarmCircuitProtocol(node.host.host, limits, allow_hop=True, stop_from=lambda _: False,
                                     max_reservations_per_ip=max_reservations_per_ip)
    hop = RelayHop(protocol, node.host)
    m = node.metrics
    m.gauge("relay_reservations", "Peers holding a reservation on this relay").set_function(
        hop.reservation_count)
    m.gauge("relay_circuits_active", "Circuits this relay is carrying").set_function(
        lambda: protocol.circuits_active)
    quiet = _HopEofFilter()
    libp2p_log = logging.getLogger("libp2p.relay.circuit_v2.protocol")
    libp2p_log.addFilter(quiet)
    async with contextlib.AsyncExitStack() as stack:
        stack.callback(libp2p_log.removeFilter, quiet)
        await stack.enter_async_context(background_trio_service(protocol))
        await protocol.event_started.wait()  # handlers registered (protocol.py:184-190)
        node.status["relay"] = hop.status
        log.info("relay: HOP service on; %d reservations x %d circuits, %d s / %d bytes per circuit",
                 limits.max_reservations, limits.max_circuit_conns, limits.duration, limits.data)
        task_status.started(hop)
        await trio.sleep_forever()


# ---------------------------------------------------------------------------------------------
# Client side (every other role): STOP, reservations, relayed dials


async def call_reserve(host: SwarmHost, relay_addr: str) -> Reservation:
    """Connect to a relay and make (or refresh) our reservation there.

    Raises RelayError when the relay cannot be reached and RemoteProtocolError when it refuses
    or answers garbage.
    """
    relay = relay_peer_id_of(relay_addr)
    with trio.move_on_after(RESERVE_TIMEOUT_S) as scope:
        try:
            await host.connect(relay_addr)
            stream = await host.open_stream(relay, HOP_PROTOCOL_ID)
        except Exception as e:
            raise RelayError(f"relay {relay} unreachable: {e}") from None
        try:
            await write_delimited_msg(stream, HopMessage(type=HopMessage.RESERVE))
            try:
                resp = await read_delimited_msg(stream, HopMessage)
            except Exception as e:  # size cap (utils.py:31), parse error, EOF
                raise RemoteProtocolError("relay-bad-message", str(e)) from None
        finally:
            with contextlib.suppress(Exception):
                await stream.close()
        return parse_reservation(resp, relay, time.time())
    assert scope.cancelled_caught
    raise RelayError(f"relay {relay} did not answer RESERVE within {RESERVE_TIMEOUT_S} s")


@dataclass
class _Held:
    relay_addr: str
    reservation: Reservation | None = None
    refresh_at: float = 0.0  # trio time
    failures: int = 0
    last_error: str = ""


@dataclass
class RelayClient:
    """The client side's API object (handed back by :func:`serve_relay_client`; every non-relay role)."""

    host: SwarmHost
    my_peer_id: str
    given: tuple[str, ...] = ()  # the relays the role handed in (the run's relay_via): kept as they are
    held: dict[str, _Held] = field(default_factory=dict)  # relay peer id -> state
    dcutr: DCUtRProtocol | None = None  # hole punching (None: off)

    def has_reservation_on(self, relay_peer_id: str) -> bool:
        h = self.held.get(relay_peer_id)
        return h is not None and h.reservation is not None and h.reservation.expire_unix > time.time()

    async def connect_addr(self, addr: str) -> str:
        """Connect to a full multiaddr, direct or circuit (:func:`connect_addr`)."""
        return await connect_addr(self.host, addr)

    def circuit_addrs(self) -> list[str]:
        """Addresses others can reach us at through our relays (advertise them in peer records)."""
        out: list[str] = []
        for h in self.held.values():
            if h.reservation is None or h.reservation.expire_unix <= time.time():
                continue
            # The address we were told to use first, then those the relay reported.
            for base in (h.relay_addr, *h.reservation.relay_addrs):
                out.append(circuit_addr(base, self.my_peer_id))
        return list(dict.fromkeys(out))

    async def reserve_on(self, relay_addr: str) -> Reservation:
        """Make a reservation on ``relay_addr`` now and remember it (the keeper refreshes it)."""
        relay = relay_peer_id_of(relay_addr)
        h = self.held.get(relay)
        if h is None:
            if len(self.held) >= MAX_RELAYS:
                raise RelayError(f"already reserving on {MAX_RELAYS} relays")
            # From here on we accept STOP from this relay, so a dial racing our RESERVE works.
            h = self.held[relay] = _Held(relay_addr)
        try:
            res = await call_reserve(self.host, relay_addr)
        except (RelayError, RemoteProtocolError) as e:
            h.failures += 1
            h.last_error = str(e)
            h.refresh_at = trio.current_time() + retry_delay(h.failures)
            raise
        h.reservation, h.failures, h.last_error = res, 0, ""
        h.refresh_at = trio.current_time() + refresh_delay(res.expire_unix, time.time())
        return res

    def accepts_stop_from(self, relay_peer_id: str) -> bool:
        return relay_peer_id in self.held

    async def keep_reservations(self) -> None:
        """Refresh every reservation before it expires; redo it when the relay connection drops.

        py-libp2p's own refresher (transport.py:883) stops for good once a refresh fails and the
        old reservation expires, so we keep our own loop.
        """
        while True:
            now = trio.current_time()
            for relay, h in list(self.held.items()):
                if self.held.get(relay) is not h:
                    continue  # released (reachability found us public) while we refreshed another
                if h.reservation is not None and not self.host.is_connected(relay):
                    # A relay honours a reservation only while its holder stays connected
                    # (resources.py:449, :514): stop advertising it and reserve again now.
                    log.info("relay: connection to %s lost; reserving again", relay)
                    h.reservation, h.refresh_at = None, now
                if now >= h.refresh_at:
                    try:
                        await self.reserve_on(h.relay_addr)
                    except (RelayError, RemoteProtocolError) as e:
                        log.warning("relay: reservation on %s failed (%s); retry in %.0f s",
                                    relay, e, h.refresh_at - trio.current_time())
            await trio.sleep(CHECK_INTERVAL_S)

    def hole_punching(self) -> dict | None:
        """DCUtR counters: peers whose relayed connection became direct, attempts made."""
        if self.dcutr is None:
            return None
        return {"direct": len(self.dcutr._direct_connections),  # py-libp2p's own bookkeeping (dcutr.py:208)
                "attempts": sum(self.dcutr._hole_punch_attempts.values())}

    def status(self) -> dict:
        now_unix = time.time()
        return {
            "role": "client",
            "hole_punching": self.hole_punching(),
            "circuit_addrs": self.circuit_addrs(),
            "relays": [
                {
                    "relay": relay,
                    "reserved": h.reservation is not None and h.reservation.expire_unix > now_unix,
                    "expires_in_s": (int(h.reservation.expire_unix - now_unix) if h.reservation else None),
                    "failures": h.failures,
                    "last_error": h.last_error,
                }
                for relay, h in self.held.items()
            ],
        }


async def serve_relay_client(
    node: NodeContext,
    relays: list[str],
    *,
    hole_punch: bool = True,
    task_status=trio.TASK_STATUS_IGNORED,
) -> None:
    """Accept relayed connections and keep reservations on ``relays`` until cancelled; with
    ``hole_punch``, try to upgrade relayed connections to direct ones (py-libp2p's DCUtR, which
    drives an attempt for every relayed connection it sees and closes the circuit once a direct
    connection verifies).

    ``relays`` (full relay multiaddrs) are the run's ``relay_via``, handed in by the role's
    composition; an empty list means "directly reachable, or reachability will find relays": the
    STOP side still runs (it accepts only relays we reserved on, so it is inert), and nothing is
    reserved until dial-back (node/reach/dialback.py) finds us private.
    """
    relays = list(relays)
    if len(relays) > MAX_RELAYS:
        raise ValueError(f"relay_via: at most {MAX_RELAYS} relays, got {len(relays)}")
    client = RelayClient(node.host, node.peer_id, given=tuple(relays))
    for addr in relays:
        client.held[relay_peer_id_of(addr)] = _Held(addr)  # ValueError on a bad address
    protocol = _SwarmCircuitProtocol(node.host.host, None, allow_hop=False,
                                     stop_from=client.accepts_stop_from)
    async with contextlib.AsyncExitStack() as stack:
        await stack.enter_async_context(background_trio_service(protocol))
        await protocol.event_started.wait()  # STOP handler registered (protocol.py:186)
        if hole_punch:
            client.dcutr = DCUtRProtocol(node.host.host)
            await stack.enter_async_context(background_trio_service(client.dcutr))
            await client.dcutr.event_started.wait()
        nursery = await stack.enter_async_context(trio.open_nursery())
        # First reservations before "started", so a node that says it is ready is reachable.
        # A relay that is down does not block start-up: the keeper retries it.
        for addr in relays:
            try:
                await client.reserve_on(addr)
            except (RelayError, RemoteProtocolError) as e:
                log.warning("relay: reservation on %s failed at start: %s", addr, e)
        node.status["relay"] = client.status
        nursery.start_soon(client.keep_reservations)
        task_status.started(client)
        await trio.sleep_forever()


async def dial_via_relay(host: SwarmHost, relay_addr: str, target_peer_id: str) -> str:
    """Open a connection to ``target_peer_id`` through the relay; returns the circuit address.

    Afterwards ``host.open_stream(target_peer_id, proto)`` uses that connection. Raises
    RelayError when the relay is unreachable, the target holds no reservation there, or the
    handshake through the relay fails.
    """
    addr = circuit_addr(relay_addr, target_peer_id)
    # The transport's `protocol` argument is only used to build listeners (transport.py:965),
    # and the STOP role alone keeps dial() from reserving on every relay it dials through
    # (RelayRole.CLIENT does that: transport.py:398).
    transport = CircuitV2Transport(host.host, None, RelayConfig(roles=RelayRole.STOP))
    try:
        with trio.fail_after(DIAL_TIMEOUT_S):
            await host.connect(relay_addr)
            # dial() first looks up stored circuit addresses of the target and logs a warning
            # when the peerstore has never heard of it (transport.py:312); harmless.
            await transport.dial(parse_multiaddr(addr))
    except trio.TooSlowError:
        raise RelayError(f"relayed dial to {target_peer_id} timed out after {DIAL_TIMEOUT_S} s") from None
    except Exception as e:
        status = _status_in(str(e))
        why = status.name if status is not None else str(e)
        raise RelayError(f"relayed dial to {target_peer_id} via {relay_peer_id_of(relay_addr)} failed: {why}",
                         status) from None
    return addr


async def connect_addr(host: SwarmHost, addr: str) -> str:
    """Connect to a full multiaddr, direct or circuit; returns the remote peer id.

    py-libp2p's swarm drops every ``/p2p-circuit`` address before dialling (network/swarm.py:818-828),
    so ``host.connect`` cannot use the circuit addresses NAT'd peers advertise: route them here.
    """
    split = split_circuit_addr(addr)
    if split is None:
        return await host.connect(addr)
    relay_addr, target = split
    await dial_via_relay(host, relay_addr, target)
    return target


def _status_in(message: str) -> StatusCode | None:
    # transport.dial() wraps the relay's RelayConnectionError (which carries status_code) into a
    # plain ConnectionError holding only its text "... failed with status 204" (transport.py:444
    # and :490), so the code is recovered from the text.
    m = re.search(r"with status (?:StatusCode\.)?(\w+)", message)
    if m is None:
        return None
    code = m.group(1)
    try:
        return StatusCode(int(code)) if code.isdigit() else StatusCode[code]
    except (KeyError, ValueError):
        return None
