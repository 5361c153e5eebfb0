"""Circuit Relay v2 on loopback: a relay (A), a target holding a reservation (B), a client (C).

The in-process tests use real TCP on 127.0.0.1 and py-libp2p's own protocol code; the pure tests
drive the reservation parsing and refresh arithmetic directly.
"""

from __future__ import annotations

from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass

import logging

import pytest
import trio
from libp2p.peer.id import ID
from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage, Limit, StopMessage
from libp2p.relay.circuit_v2.pb.circuit_pb2 import PeerId as CircuitPeerId
from libp2p.relay.circuit_v2.pb.circuit_pb2 import Reservation as PbReservation
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as HOP_PROTOCOL_ID
from libp2p.relay.circuit_v2.protocol import STOP_PROTOCOL_ID
from libp2p.relay.circuit_v2.protocol_buffer import StatusCode
from libp2p.relay.circuit_v2.utils import read_delimited_msg, write_delimited_msg
import multiaddr

from node.reach import relay
from node.config import NodeConfig
from node.context import NodeContext, RunningNode
from node.net.host import is_relayed, open_swarm_host
from node.identity import Identity
from node.reach.relay import (
    RelayClient,
    RelayError,
    RelayHop,
    call_reserve,
    circuit_addr,
    connect_addr,
    dial_via_relay,
    hop_limits,
    parse_reservation,
    refresh_delay,
    retry_delay,
    serve_relay_client,
    serve_relay_hop,
    split_circuit_addr,
)
from node.wire import RemoteProtocolError
from waiting import wait_for

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
ECHO = "/swarm/test-echo/1.0.0"
TEST_TIMEOUT_S = 60  # a hang guard: these steps take well under a second on an idle machine


@dataclass
class RelayNode(RunningNode):
    relay: RelayHop | RelayClient | None  # what the relay service handed back (None: no service)


@asynccontextmanager
async def open_node(tmp_path, name: str, service=None, **kw):
    """A host plus one relay service (or none)."""
    identity = Identity.generate()
    async with open_swarm_host(identity, LOOPBACK) as host:
        node = NodeContext(NodeConfig(listen=LOOPBACK), identity, host, tmp_path / name)
        async with trio.open_nursery() as nursery:
            api = None
            if service is not None:
                api = await nursery.start(lambda task_status: service(node, task_status=task_status, **kw))
            yield RelayNode(node, api)
            nursery.cancel_scope.cancel()


@asynccontextmanager
async def open_triangle(tmp_path, limits=None):
    """A = relay, B = target with a reservation on A, C = a plain client (no reservation)."""
    async with AsyncExitStack() as stack:
        a = await stack.enter_async_context(open_node(tmp_path, "a", serve_relay_hop, limits=limits))
        a_addr = a.host.listen_addrs()[0]
        # No hole punching: on loopback it would upgrade every circuit these tests look at.
        b = await stack.enter_async_context(open_node(tmp_path, "b", serve_relay_client, relays=[a_addr],
                                                      hole_punch=False))
        c = await stack.enter_async_context(open_node(tmp_path, "c", serve_relay_client, relays=[],
                                                      hole_punch=False))
        yield a, b, c, a_addr


async def echo_handler(stream) -> None:
    data = await stream.read(1024)
    await stream.write(data[::-1])
    await stream.close()


def connections(node: NodeContext, peer: NodeContext) -> list:
    return list(node.host.host.get_network().connections.get(ID.from_base58(peer.peer_id), []))


# ---------------------------------------------------------------------------------------------
# In-process, three hosts


async def test_client_reaches_target_only_through_relay(tmp_path, caplog):
    async with open_triangle(tmp_path) as (a, b, c, a_addr):
        b.host.set_handler(ECHO, echo_handler)
        # B advertises the circuit address through A.
        expected = circuit_addr(a_addr, b.peer_id)
        assert expected in b.relay.circuit_addrs()
        assert a.relay.reservation_count() == 1
        assert not c.host.is_connected(b.peer_id)

        with trio.fail_after(TEST_TIMEOUT_S):
            assert await connect_addr(c.host, expected) == b.peer_id  # C knows only the circuit address
            stream = await c.host.open_stream(b.peer_id, ECHO)
            await stream.write(b"through the relay")
            assert await stream.read(1024) == b"yaler eht hguorht"

        # Every connection C has to B, and B to C, runs over the circuit.
        c_to_b, b_to_c = connections(c, b), connections(b, c)
        assert c_to_b and all(is_relayed(conn) for conn in c_to_b)
        assert b_to_c and all(is_relayed(conn) for conn in b_to_c)
        assert "/p2p-circuit/" in str(c_to_b[0].get_transport_addresses()[0])
        # The relay counts the circuit it carries; the direct links are not relayed.
        assert a.relay.status()["circuits_active"] == 1
        # ...and the bytes: at least the echo both ways, plus the Noise/Yamux handshakes inside.
        assert a.relay.status()["circuit_bytes"] >= 2 * len(b"through the relay")
        assert not any(is_relayed(conn) for conn in connections(c, a))
        # A reservation or a circuit on the normal path logs no error anywhere.
        assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


async def test_dial_to_peer_without_reservation_is_refused(tmp_path):
    async with open_triangle(tmp_path) as (a, b, c, a_addr):
        with pytest.raises(RelayError, match="NO_RESERVATION") as e:
            await dial_via_relay(b.host, a_addr, c.peer_id)  # C holds no reservation on A
        assert e.value.status == StatusCode.NO_RESERVATION
        assert not b.host.is_connected(c.peer_id)


async def test_idle_circuit_is_reset_after_its_duration(tmp_path, monkeypatch):
    """py-libp2p alone leaves an idle circuit open past its duration (checked per read only)."""
    monkeypatch.setattr(relay, "CIRCUIT_DURATION_GRACE_S", 0)
    async with open_triangle(tmp_path, limits=hop_limits(duration_s=1)) as (a, b, c, a_addr):
        await dial_via_relay(c.host, a_addr, b.peer_id)
        assert c.host.is_connected(b.peer_id)
        await wait_for(lambda: not c.host.is_connected(b.peer_id))
        await wait_for(lambda: a.relay.status()["circuits_active"] == 0)
        assert a.relay.status()["connects_total"] == 1


async def test_reservation_is_for_the_sender_whatever_the_message_says(tmp_path):
    """A RESERVE naming another peer must not reserve a slot for that peer."""
    stranger = Identity.generate()
    async with open_node(tmp_path, "a", serve_relay_hop) as a, open_node(tmp_path, "x") as x:
        await x.host.connect(a.host.listen_addrs()[0])
        stream = await x.host.open_stream(a.peer_id, HOP_PROTOCOL_ID)
        msg = HopMessage(type=HopMessage.RESERVE, peer=CircuitPeerId(id=ID.from_base58(stranger.peer_id).to_bytes()))
        with trio.fail_after(TEST_TIMEOUT_S):
            await write_delimited_msg(stream, msg)
            resp = await read_delimited_msg(stream, HopMessage)
        assert resp.status == StatusCode.OK
        table = a.relay.protocol.resource_manager._reservations
        assert set(table) == {ID.from_base58(x.peer_id)}


async def test_slot_of_a_disconnected_reservation_holder_is_reused(tmp_path):
    async with (
        open_node(tmp_path, "a", serve_relay_hop, limits=hop_limits(reservations=1)) as a,
        open_node(tmp_path, "x") as x,
        open_node(tmp_path, "y") as y,
    ):
        a_addr = a.host.listen_addrs()[0]
        await call_reserve(x.host, a_addr)
        await x.host.disconnect(a.peer_id)
        await wait_for(lambda: not a.host.is_connected(x.peer_id))
        res = await call_reserve(y.host, a_addr)  # py-libp2p alone: RESOURCE_LIMIT_EXCEEDED for an hour
        assert res.relay_peer_id == a.peer_id
        assert a.relay.reservation_count() == 1


async def test_reservations_per_ip_are_capped(tmp_path):
    async with (
        open_node(tmp_path, "a", serve_relay_hop, max_reservations_per_ip=1) as a,
        open_node(tmp_path, "x") as x,
        open_node(tmp_path, "y") as y,
    ):
        a_addr = a.host.listen_addrs()[0]
        first = await call_reserve(x.host, a_addr)
        with pytest.raises(RemoteProtocolError, match="RESERVATION_REFUSED"):
            await call_reserve(y.host, a_addr)  # same 127.0.0.1
        assert (await call_reserve(x.host, a_addr)).relay_peer_id == first.relay_peer_id  # refresh is fine
        assert a.relay.status()["reservations_refused_per_ip"] == 1


async def test_target_refuses_relayed_connection_from_a_peer_it_has_no_reservation_on(tmp_path):
    async with open_triangle(tmp_path) as (a, b, c, a_addr):
        # C pretends to be a relay and offers B a connection from a made-up peer.
        await c.host.connect(b.host.listen_addrs()[0])
        stream = await c.host.open_stream(b.peer_id, STOP_PROTOCOL_ID)
        offer = StopMessage(type=StopMessage.CONNECT, peer=CircuitPeerId(id=ID.from_base58(c.peer_id).to_bytes()))
        with trio.fail_after(TEST_TIMEOUT_S):
            await write_delimited_msg(stream, offer)
            resp = await read_delimited_msg(stream, StopMessage)
        assert resp.status == StatusCode.PERMISSION_DENIED
        assert not any(is_relayed(conn) for conn in connections(b, c))


async def test_reservation_is_renewed_after_the_relay_connection_drops(tmp_path, monkeypatch):
    monkeypatch.setattr(relay, "CHECK_INTERVAL_S", 0.1)
    async with open_triangle(tmp_path) as (a, b, c, a_addr):
        held = b.relay.held[a.peer_id]
        first = held.reservation
        await b.host.disconnect(a.peer_id)
        # Identity, not equality: the relay may grant the same expiry again (resources.py:421-426).
        await wait_for(lambda: held.reservation is not None and held.reservation is not first)
        assert a.relay.reservation_count() == 1
        assert b.relay.circuit_addrs()


async def test_reservation_on_unreachable_relay_is_retried_not_fatal(tmp_path):
    dead = f"/ip4/127.0.0.1/tcp/9/p2p/{Identity.generate().peer_id}"
    async with open_node(tmp_path, "b", serve_relay_client, relays=[dead]) as b:
        client = b.relay
        assert client.circuit_addrs() == []
        (state,) = client.status()["relays"]
        assert not state["reserved"] and state["failures"] == 1 and state["last_error"]


# ---------------------------------------------------------------------------------------------
# Pure


RELAY = Identity.from_seed(b"r" * 32).peer_id
OTHER = Identity.from_seed(b"o" * 32).peer_id
NOW = 1_700_000_000


def reserve_ok(expire=NOW + 3600, addrs=(), status=StatusCode.OK, with_reservation=True) -> HopMessage:
    msg = HopMessage(type=HopMessage.STATUS, status=int(status), limit=Limit(duration=600, data=1 << 20))
    if with_reservation:
        msg.reservation.CopyFrom(PbReservation(expire=expire, addrs=[multiaddr.Multiaddr(a).to_bytes() for a in addrs]))
    return msg


def test_parse_reservation_keeps_only_the_relays_own_addresses():
    mine = f"/ip4/1.2.3.4/tcp/4001/p2p/{RELAY}"
    res = parse_reservation(
        reserve_ok(addrs=[mine, f"/ip4/6.6.6.6/tcp/1/p2p/{OTHER}", "/ip4/5.5.5.5/tcp/2", mine]), RELAY, NOW
    )
    assert res.relay_addrs == (mine,)
    assert (res.expire_unix, res.limit_duration_s, res.limit_bytes) == (NOW + 3600, 600, 1 << 20)


@pytest.mark.parametrize(
    "msg, reason",
    [
        (reserve_ok(status=StatusCode.RESERVATION_REFUSED), "relay-refused"),
        (reserve_ok(with_reservation=False), "relay-bad-reservation"),
        (reserve_ok(expire=NOW - 1), "relay-bad-reservation"),
        (HopMessage(type=HopMessage.CONNECT), "relay-unexpected-message"),
    ],
)
def test_parse_reservation_rejects(msg, reason):
    with pytest.raises(RemoteProtocolError) as e:
        parse_reservation(msg, RELAY, NOW)
    assert e.value.reason == reason


def test_refresh_and_retry_schedule():
    assert refresh_delay(NOW + 3600, NOW) == 1800
    assert refresh_delay(NOW + 4, NOW) == relay.MIN_REFRESH_S
    assert [retry_delay(n) for n in (1, 2, 3)] == [2.0, 4.0, 8.0]
    assert retry_delay(50) == relay.RETRY_MAX_S


def test_addresses_and_limits_are_checked():
    assert circuit_addr(f"/ip4/1.2.3.4/tcp/1/p2p/{RELAY}", OTHER) == f"/ip4/1.2.3.4/tcp/1/p2p/{RELAY}/p2p-circuit/p2p/{OTHER}"
    with pytest.raises(ValueError):
        circuit_addr("/ip4/1.2.3.4/tcp/1", OTHER)  # no relay peer id
    with pytest.raises(ValueError):
        circuit_addr(f"/ip4/1.2.3.4/tcp/1/p2p/{RELAY}", "not-a-peer-id")
    with pytest.raises(ValueError):
        hop_limits(duration_s=0)
    relay_addr = f"/ip4/1.2.3.4/tcp/1/p2p/{RELAY}"
    assert split_circuit_addr(circuit_addr(relay_addr, OTHER)) == (relay_addr, OTHER)
    assert split_circuit_addr(relay_addr) is None
    with pytest.raises(ValueError):
        split_circuit_addr(f"{relay_addr}/p2p-circuit")  # no target  # py-libp2p would read 0 as "unlimited"
