"""Inbound stream budgets: the pure accounting (node/net/budget.py) and its trio edge (node/net/reqres.py
``Inbound`` / ``RequestResponse.handler``) on in-memory streams under trio's MockClock, so every deadline
is exact virtual time and nothing sleeps."""

from __future__ import annotations

import struct

import pytest
import trio
import trio.testing

from node.net.budget import (
    BUSY,
    BYTES,
    OVERSIZED,
    PEER_BYTES,
    PEER_STREAMS,
    Budget,
    StreamLimits,
    StreamsConfig,
    limits,
)
from node.dbthread import StoreClosed
from node.net.reqres import Inbound, Refused, RequestResponse, raw
from node.peers import Peers
from node.peers.service import STALL_SOURCE
from node.metrics import Metrics
from node.wire import RemoteProtocolError


def lim(**kw) -> StreamLimits:
    base = dict(streams=4, streams_per_peer=2, frame_cap=100, buffer_bytes=300, buffer_per_peer=200)
    base.update(kw)
    return StreamLimits(**base)


# ------------------------------------------------------------------ pure accounting


def test_per_peer_limits_must_be_below_the_totals():
    with pytest.raises(ValueError):
        lim(streams_per_peer=4)
    with pytest.raises(ValueError):
        lim(buffer_per_peer=300)
    with pytest.raises(ValueError):
        lim(frame_cap=201)  # a largest frame must fit one peer's share
    derived = limits(16, 1000)
    assert derived.streams_per_peer == 4 and derived.buffer_per_peer < derived.buffer_bytes


def test_one_peer_never_takes_every_slot():
    b = Budget(lim())
    assert b.admit("evil") is None and b.start()
    assert b.admit("evil") is None and b.start()
    assert b.admit("evil") == PEER_STREAMS  # its share is 2 of 4
    assert b.admit("honest") is None and b.start()  # a slot is left for someone else
    assert b.held_by("evil") == (2, 0)
    b.stop()
    b.leave("evil")
    assert b.admit("evil") is None
    assert b.refused[PEER_STREAMS] == 1


def test_total_slots_then_busy():
    b = Budget(lim())
    for peer in ("a", "a", "b", "b"):
        assert b.admit(peer) is None and b.start()
    assert b.admit("c") is None
    assert not b.start()  # admitted, but every slot is taken: it waits or is refused
    assert b.refuse_busy() == BUSY
    assert b.peak_served == 4


def test_bytes_are_reserved_before_the_body_and_bounded_per_peer_and_in_total():
    b = Budget(lim())
    assert b.reserve("a", 101) == OVERSIZED
    assert b.reserve("a", 100) is None and b.reserve("a", 100) is None
    assert b.reserve("a", 1) == PEER_BYTES  # its 200 are held
    assert b.reserve("b", 100) is None
    assert b.reserve("c", 1) == BYTES  # 300 held in all
    assert b.reserved == 300 and b.peak_peer_reserved == 200
    b.release("a", 100)
    assert b.reserve("c", 100) is None
    assert b.peak_reserved == 300
    with pytest.raises(AssertionError):
        b.release("c", 101)  # our bug: releasing what was never held


def test_deadlines_are_functions_of_the_time_given():
    cfg = StreamsConfig(header_timeout=3.0, min_body_rate=1000.0, body_grace=1.0)
    assert cfg.header_deadline(10.0) == 13.0
    assert cfg.body_deadline(5000, 10.0) == 16.0


# ------------------------------------------------------------------ the trio edge


class MemStream:
    """One end of an in-memory byte stream with the libp2p stream methods reqres uses."""

    def __init__(self, end, peer: str) -> None:
        self.end, self.peer = end, peer
        self.closed = False

    async def read(self, n: int | None = None) -> bytes:
        return await self.end.receive_some(n)

    async def write(self, data: bytes) -> None:
        await self.end.send_all(data)

    async def close(self) -> None:
        self.closed = True
        await self.end.aclose()

    reset = close


def pair(peer: str) -> tuple[MemStream, MemStream]:
    left, right = trio.testing.memory_stream_pair()
    return MemStream(left, peer), MemStream(right, "server")


def frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def peers_table() -> Peers:
    return Peers(None, Metrics())


async def test_a_silent_stream_is_cut_at_the_header_deadline_and_struck(autojump_clock):
    peers = peers_table()
    cfg = StreamsConfig(header_timeout=3.0, stall_strikes=2, stall_fold=3.0)  # each stall its own event
    inbound = Inbound("/p", lim(), config=cfg, peers=peers)
    client, server = pair("evil")
    start = trio.current_time()
    with pytest.raises(RemoteProtocolError) as e:
        async with inbound.open(server, "evil") as frames:
            await frames.read()
    assert e.value.reason == "stalled"
    assert trio.current_time() - start == pytest.approx(3.0)
    assert inbound.budget.stalled == 1 and inbound.budget.held_by("evil") == (0, 0)
    assert peers.table.peers["evil"].strikes[STALL_SOURCE] == [pytest.approx(start + 3.0)]
    # A second stall reaches stall_strikes: the peer is banned from every budgeted protocol.
    with pytest.raises(RemoteProtocolError):
        async with inbound.open(pair("evil")[1], "evil") as frames:
            await frames.read()
    assert peers.is_banned("evil", STALL_SOURCE)
    with pytest.raises(Refused, match="banned"):
        async with inbound.open(pair("evil")[1], "evil"):
            pass


async def test_a_deadline_our_own_loop_noticed_late_cuts_the_stream_but_strikes_no_one(mock_clock):
    """Our loop blocked across the deadline (a checkpoint save on a busy machine): the peer's bytes
    may have waited unread, so it is not struck; an honest worker was banned for ten minutes so."""
    peers = peers_table()
    cfg = StreamsConfig(header_timeout=3.0, stall_strikes=1)
    inbound = Inbound("/p", lim(), config=cfg, peers=peers)

    async def read_silent() -> None:
        with pytest.raises(RemoteProtocolError) as e:
            async with inbound.open(pair("slow")[1], "slow") as frames:
                await frames.read()
        assert e.value.reason == "stalled"

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read_silent)
        await trio.testing.wait_all_tasks_blocked()
        mock_clock.jump(10.0)  # the loop comes back 7 s after the deadline
    assert inbound.budget.stalled == 1
    assert "slow" not in peers.table.peers and not peers.is_banned("slow", STALL_SOURCE)

    async with trio.open_nursery() as nursery:  # the same silence met on time is struck
        nursery.start_soon(read_silent)
        await trio.testing.wait_all_tasks_blocked()
        mock_clock.jump(3.0)
    assert peers.is_banned("slow", STALL_SOURCE)


async def test_a_body_below_the_minimum_rate_is_a_stall(autojump_clock):
    peers = peers_table()
    cfg = StreamsConfig(header_timeout=3.0, min_body_rate=1024.0, body_grace=1.0)
    inbound = Inbound("/p", lim(frame_cap=4096, buffer_per_peer=8192, buffer_bytes=16384), config=cfg, peers=peers)
    client, server = pair("slow")
    await client.write(struct.pack(">I", 4096) + b"x" * 100)  # announces 4 KiB, sends 100 bytes
    start = trio.current_time()
    with pytest.raises(RemoteProtocolError) as e:
        async with inbound.open(server, "slow") as frames:
            await frames.read()
    assert e.value.reason == "stalled"
    assert trio.current_time() - start == pytest.approx(1.0 + 4096 / 1024.0)
    assert inbound.budget.reserved == 0 and inbound.budget.peak_reserved == 4096


async def test_a_frame_over_the_peers_byte_share_is_refused_before_its_body_is_read(autojump_clock):
    inbound = Inbound("/p", lim(), config=StreamsConfig())
    held = []
    c1, s1 = pair("a")
    await c1.write(frame(b"y" * 100))
    async with inbound.open(s1, "a") as f1:
        held.append(await f1.read())
        c2, s2 = pair("a")
        await c2.write(frame(b"z" * 100))
        async with inbound.open(s2, "a") as f2:
            held.append(await f2.read())
            assert inbound.budget.held_by("a") == (2, 200)
            f1.answered()  # our reply went out: its bytes are free again
            assert inbound.budget.held_by("a") == (2, 100)
    assert inbound.budget.reserved == 0 and inbound.budget.held_by("a") == (0, 0)


async def test_streams_wait_for_a_slot_and_get_it_when_one_frees(autojump_clock):
    inbound = Inbound("/p", lim(streams=2, streams_per_peer=1), config=StreamsConfig())
    order = []

    async def hold(peer: str, until: trio.Event) -> None:
        async with inbound.open(pair(peer)[1], peer):
            order.append(peer)
            await until.wait()

    release = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(hold, "a", release)
        nursery.start_soon(hold, "b", trio.Event())
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(hold, "c", trio.Event())
        await trio.testing.wait_all_tasks_blocked()
        assert sorted(order) == ["a", "b"] and inbound.budget.held_by("c") == (1, 0)
        with pytest.raises(Refused, match="busy"):
            async with inbound.open(pair("d")[1], "d", wait=False):
                pass
        release.set()
        await trio.testing.wait_all_tasks_blocked()
        assert sorted(order) == ["a", "b", "c"]
        nursery.cancel_scope.cancel()
    assert inbound.budget.served == 0 and inbound.budget.streams_of == {}


async def test_a_protocol_handler_serves_an_honest_peer_while_another_hogs_its_share(autojump_clock):
    """The attack on /swarm/status/1.0.0 in miniature: one peer's silent streams take only its
    share; an honest request is answered at once, before the hog's header deadline."""
    peers = peers_table()
    cfg = StreamsConfig(header_timeout=10.0)
    answered = []

    async def answer(peer: str, data: bytes) -> bytes:
        answered.append((peer, trio.current_time()))
        return b"ok:" + data

    handle = RequestResponse("/p", raw(100), None, 5.0, limits=lim()).handler(answer, peers=peers, streams=cfg,
                                                                             metrics=Metrics())
    async with trio.open_nursery() as nursery:
        hogs = []
        for _ in range(6):
            client, server = pair("hog")
            server.end.peer = "hog"
            hogs.append(client)
            nursery.start_soon(handle, _Named(server, "hog"))
        await trio.testing.wait_all_tasks_blocked()
        assert handle.inbound.budget.held_by("hog") == (2, 0)  # 4 of the 6 refused at once
        start = trio.current_time()
        client, server = pair("honest")
        nursery.start_soon(handle, _Named(server, "honest"))
        await client.write(frame(b"hi"))
        reply = await client.read(100)
        assert reply == frame(b"ok:hi")
        assert answered == [("honest", start)]  # no virtual time passed: it never waited on the hog
        assert handle.inbound.budget.held_by("hog") == (2, 0)  # the hog's streams are still open
        await trio.testing.wait_all_tasks_blocked()
    # The hog's two streams were cut at the header deadline together: one event, one strike.
    assert handle.inbound.budget.stalled == 2
    assert peers.is_banned("hog", STALL_SOURCE) is False  # 1 strike < 3
    assert len(peers.table.peers["hog"].strikes[STALL_SOURCE]) == 1


class _Named:
    """A MemStream whose remote peer id reqres can read (``stream.muxed_conn.peer_id``)."""

    def __init__(self, stream: MemStream, peer: str) -> None:
        self._s = stream
        self.muxed_conn = type("Conn", (), {"peer_id": type("Id", (), {"to_base58": lambda _self: peer})()})()

    def __getattr__(self, name):
        return getattr(self._s, name)


async def test_a_frame_announced_over_the_cap_is_garbage_before_its_body(autojump_clock):
    peers = peers_table()
    inbound = Inbound("/p", lim(), config=StreamsConfig(), peers=peers)
    client, server = pair("big")
    await client.write(struct.pack(">I", 2**31))  # a 2 GiB header, no body
    with pytest.raises(RemoteProtocolError) as e:
        async with inbound.open(server, "big") as frames:
            await frames.read()
    assert e.value.reason == "oversized"
    assert inbound.budget.peak_reserved == 0 and inbound.budget.stalled == 0


async def test_a_request_met_by_a_closing_store_resets_the_stream_and_blames_no_one(autojump_clock):
    """A node stopping while a handler writes (a batch spooled, a verdict stored) must not raise
    into libp2p's connection task nor strike the honest sender: the stream is reset, and the
    sender tries again later or elsewhere."""
    peers, metrics = peers_table(), Metrics()

    async def answer(peer: str, data: bytes) -> bytes:
        raise StoreClosed("the store is closing: the node is stopping")

    handle = RequestResponse("/p", raw(100), None, 5.0, limits=lim(), source="p").handler(answer, peers=peers,
                                                                                         metrics=metrics)
    client, server = pair("w")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(handle, _Named(server, "w"))
        await client.write(frame(b"batch"))
        assert await client.read(100) == b""  # reset, no reply
    assert server.closed and metrics.rejections() == {"p/stopping": 1}
    assert "w" not in peers.table.peers or not any(peers.table.peers["w"].strikes.values())
