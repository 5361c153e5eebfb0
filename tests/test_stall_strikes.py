"""Stalls that one network event causes are one strike; a peer that stalls again and again is banned.

Issue 45's hour-long soak: inference-7 cut four shards streams of the honest relay-5 within 0.2 s
while relay-5 was partitioned, and banned it for 600 s ("held a stream without sending" four
times); inference-8 did the same 12 s after its own start, busy loading its model while relay-5's
requests queued behind the checkpoint blocks relay-5 was sending it on the same connection. A
partition or one stalled connection stalls every stream on it at once: that is one piece of
evidence, not four. The tests: the pure rule (node/peers/table.py ``FaultRule.fold``), the trio
edge under MockClock, and two real hosts on loopback whose link a forwarder cuts and heals.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import trio
import trio.testing
from swarmtest import node_config, open_nodes
from waiting import wait_for

from libp2p.peer.id import ID

from node.config import ConfigError, RunConfig, build
from node.metrics import Metrics
from node.net.budget import StreamLimits, StreamsConfig
from node.net.reqres import Inbound, Refused
from node.peers import Peers
from node.peers.service import STALL_SOURCE
from node.peers.table import FaultRule, PeerTable
from node.shards.protocol import PROTOCOL as SHARDS_PROTOCOL
from node.status import STATUS_PROTOCOL, StatusRequest
from node.wire import RemoteProtocolError, write_frame

RULE = FaultRule(weight=10.0, strikes=3, window=600.0, ban_seconds=600.0, fold=10.0)


# ------------------------------------------------------------------ the pure rule


def test_faults_within_the_fold_window_are_one_strike():
    table = PeerTable({"streams": RULE})
    for t in (100.0, 100.03, 100.17, 100.18):  # inference-7's four stalls of relay-5 (15:27:05.779-.953)
        assert table.on_fault("relay", "streams", "stalled:shards", t) == []
    entry = table.peers["relay"]
    assert entry.strikes["streams"] == [100.0] and entry.faults == 4
    assert table.score("relay", 100.0) == -10.0  # one strike's weight, not four


def test_a_peer_that_stalls_continuously_is_banned_after_strikes_fold_windows():
    """Folding costs a staller nothing it could keep: one strike per window, banned at the third."""
    table = PeerTable({"streams": RULE})
    for t in range(20):  # a stall every second
        assert table.on_fault("evil", "streams", "stalled:shards", float(t)) == [], t
    assert table.peers["evil"].strikes["streams"] == [0.0, 10.0]
    actions = table.on_fault("evil", "streams", "stalled:shards", 20.0)
    assert [a.kind.value for a in actions] == ["ban", "disconnect"] and actions[0].until == 620.0


def test_bans_grow_from_first_ban_to_ban_seconds():
    rule = FaultRule(weight=1.0, strikes=1, ban_seconds=600.0, first_ban=60.0)
    table, now, lengths = PeerTable({"streams": rule}), 0.0, []
    for _ in range(6):
        actions = table.on_fault("p", "streams", "stalled:shards", now)
        lengths.append(actions[0].until - now)
        now = actions[0].until  # the ban ran out
    assert lengths == [60.0, 120.0, 240.0, 480.0, 600.0, 600.0]


def test_an_unread_excuse_covers_one_event_per_window():
    """Bytes we had not read excuse one event of a peer's stalls (its streams cut together, within
    ``fold``) per ``window``: a peer that keeps its connection busy at each deadline (uploading to us
    on another stream, pinging) buys no more than that; its next stalls strike (issue 45 review)."""
    table = PeerTable({"streams": RULE})
    assert all(table.excuse("p", "streams", t) for t in (100.0, 100.03, 109.9))  # one event: streams cut together
    assert not table.excuse("p", "streams", 110.0)  # a second event within the window: no excuse
    assert not table.excuse("p", "streams", 699.0)
    assert table.excuse("p", "streams", 700.0)  # a window after the excused event: a new one


def test_escalation_starts_over_after_a_window_quiet_since_the_last_ban():
    """An honest relay banned once (a link that failed thrice) is not banned for longer a week
    later: the ban count a rule keeps for a peer resets when ``window`` seconds pass between the
    end of its last ban and the first strike of the next (strikes older than that count for
    nothing either). A staller that comes back from its ban and stalls at once still escalates."""
    rule = FaultRule(weight=1.0, strikes=1, window=600.0, ban_seconds=600.0, first_ban=60.0)
    table = PeerTable({"streams": rule})
    assert table.on_fault("p", "streams", "r", 0.0)[0].until == 60.0
    assert table.on_fault("p", "streams", "r", 60.0)[0].until == 180.0  # back and stalling at once: 120 s
    assert table.on_fault("p", "streams", "r", 779.0)[0].until == 779.0 + 240.0  # 599 s quiet: 240 s
    week = 779.0 + 240.0 + 7 * 86400.0
    assert table.on_fault("p", "streams", "r", week)[0].until == week + 60.0  # a week quiet: 60 s again


def test_without_fold_every_fault_is_a_strike():
    table = PeerTable({"x": FaultRule(weight=1.0, strikes=2, window=60.0, ban_seconds=5.0)})
    assert table.on_fault("p", "x", "r", 1.0) == []
    assert table.on_fault("p", "x", "r", 1.0)  # two at one instant: banned


def test_fold_is_never_negative():
    with pytest.raises(ValueError, match="fold"):
        FaultRule(fold=-1.0)


def test_a_wrong_stall_fold_is_one_config_error():
    with pytest.raises(ConfigError, match=r"^streams: stall_fold: .*got -1"):
        build(StreamsConfig, {"stall_fold": -1.0}, "streams")
    with pytest.raises(ConfigError, match="below stall_window"):
        build(StreamsConfig, {"stall_fold": 60.0, "stall_window": 30.0}, "streams")


# ------------------------------------------------------------------ the trio edge, virtual time


class Silent:
    """A stream that never sends (the peer's bytes are held by a partition)."""

    async def read(self, n: int | None = None) -> bytes:
        await trio.sleep_forever()

    async def write(self, data: bytes) -> None:
        pass

    async def close(self) -> None:
        pass

    reset = close


class Sends(Silent):
    def __init__(self, data: bytes) -> None:
        self.data = data

    async def read(self, n: int | None = None) -> bytes:
        data, self.data = self.data[:n], self.data[n:]
        return data


LIMITS = StreamLimits(streams=32, streams_per_peer=8, frame_cap=100, buffer_bytes=3200, buffer_per_peer=800)


async def stall_streams(inbound: Inbound, peer: str, n: int) -> None:
    """``n`` silent streams of ``peer`` opened at once, each until the edge cuts it."""

    async def one() -> None:
        with pytest.raises(RemoteProtocolError, match="no frame header"):
            async with inbound.open(Silent(), peer) as frames:
                await frames.read()

    async with trio.open_nursery() as nursery:
        for _ in range(n):
            nursery.start_soon(one)


async def test_streams_stalled_by_one_partition_strike_once_and_the_peer_is_served_after(autojump_clock):
    peers = Peers(None, Metrics())
    inbound = Inbound("/p", LIMITS, config=StreamsConfig(header_timeout=5.0), peers=peers)
    start = trio.current_time()
    await stall_streams(inbound, "relay-5", 4)
    assert trio.current_time() - start == pytest.approx(5.0)
    assert inbound.budget.stalled == 4
    assert not peers.is_banned("relay-5", STALL_SOURCE)
    assert peers.table.peers["relay-5"].strikes[STALL_SOURCE] == [pytest.approx(start + 5.0)]
    async with inbound.open(Sends(b"\x00\x00\x00\x02hi"), "relay-5") as frames:  # the link healed
        assert await frames.read() == b"hi"


async def test_a_peer_that_stalls_in_one_event_after_another_is_still_banned(autojump_clock):
    peers = Peers(None, Metrics())
    cfg = StreamsConfig(header_timeout=5.0, stall_fold=10.0)
    inbound = Inbound("/p", LIMITS, config=cfg, peers=peers)
    for event in range(cfg.stall_strikes):
        if event:
            await trio.sleep(cfg.stall_fold)  # each event outside the previous one's fold window
        await stall_streams(inbound, "evil", 2)
    assert peers.is_banned("evil", STALL_SOURCE)
    assert len(peers.table.peers["evil"].strikes.get(STALL_SOURCE, [])) == 0  # spent by the ban
    with pytest.raises(Refused, match="banned"):
        async with inbound.open(Sends(b""), "evil"):
            pass


async def test_a_stall_ban_lasts_a_minute_first_and_longer_each_time_after(autojump_clock):
    """An honest relay whose link failed in three separate events is refused for a minute, not
    ten; a staller that comes back and stalls again is banned twice as long."""
    peers = Peers(None, Metrics())
    cfg = StreamsConfig(header_timeout=5.0)
    inbound = Inbound("/p", LIMITS, config=cfg, peers=peers)
    for ban in (cfg.stall_first_ban, 2 * cfg.stall_first_ban):
        for event in range(cfg.stall_strikes):
            if event:
                await trio.sleep(cfg.stall_fold)
            await stall_streams(inbound, "relay-5", 2)
        banned_at = trio.current_time()
        assert peers.is_banned("relay-5", STALL_SOURCE)
        assert not peers.is_banned("relay-5", STALL_SOURCE, now=banned_at + ban)
        assert peers.is_banned("relay-5", STALL_SOURCE, now=banned_at + ban - 1)
        await trio.sleep(ban)
        async with inbound.open(Sends(b"\x00\x00\x00\x02hi"), "relay-5") as frames:  # served again
            assert await frames.read() == b"hi"


class BusySilent(Silent):
    """A silent request stream whose connection always holds bytes we have not read at the
    deadline: the peer keeps it busy (an upload on another stream, pings) faster than our
    Noise+yamux reader decrypts, as a native sender can."""

    muxed_conn = SimpleNamespace(secured_conn=SimpleNamespace(high_watermark=65536, low_watermark=0))  # 64 KiB buffered


async def test_a_peer_that_keeps_its_connection_busy_while_stalling_is_struck_and_banned(autojump_clock):
    """Unread bytes excuse the first event only; the staller is struck for the next ones and
    banned, and refused after."""
    peers = Peers(None, Metrics())
    cfg = StreamsConfig(header_timeout=5.0)
    inbound = Inbound("/p", LIMITS, config=cfg, peers=peers)

    async def one() -> None:
        with pytest.raises(RemoteProtocolError, match="no frame header"):
            async with inbound.open(BusySilent(), "evil") as frames:
                await frames.read()

    for event in range(cfg.stall_strikes + 1):
        if event:
            await trio.sleep(cfg.stall_fold)
        async with trio.open_nursery() as nursery:
            for _ in range(4):
                nursery.start_soon(one)
    assert inbound.budget.stalled == 4 * (cfg.stall_strikes + 1)
    assert peers.is_banned("evil", STALL_SOURCE)
    with pytest.raises(Refused, match="banned"):
        async with inbound.open(BusySilent(), "evil"):
            pass


def test_a_wrong_stall_first_ban_is_one_config_error():
    with pytest.raises(ConfigError, match=r"^streams: stall_first_ban: .*got -5"):
        build(StreamsConfig, {"stall_first_ban": -5.0}, "streams")


# ------------------------------------------------------------------ real hosts, a real cut link


class Link:
    """A TCP forwarder on 127.0.0.1 in front of a node: :meth:`cut` holds every byte either way
    (a partition: nothing at all flows, the connection stays open), :meth:`heal` lets them on."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self.connections = 0
        self._healed = trio.Event()
        self._healed.set()

    def cut(self) -> None:
        self._healed = trio.Event()

    def heal(self) -> None:
        self._healed.set()

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started()
        await trio.serve_listeners(self._forward, listeners)

    async def _forward(self, client: trio.SocketStream) -> None:
        self.connections += 1
        async with client, await trio.open_tcp_stream("127.0.0.1", self.target_port) as server:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._pump, client, server, nursery.cancel_scope)
                nursery.start_soon(self._pump, server, client, nursery.cancel_scope)

    async def _pump(self, src, dst, scope: trio.CancelScope) -> None:
        try:
            while data := await src.receive_some(65536):
                await self._healed.wait()
                await dst.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        scope.cancel()


def tcp_port(addr: str) -> int:
    return int(re.search(r"/tcp/(\d+)", addr).group(1))


async def test_an_honest_relay_cut_off_with_streams_open_is_not_banned_and_is_served_after_the_heal(tmp_path):
    run = RunConfig(name="test")
    run.tables.update(streams={"header_timeout": 3.0})
    async with open_nodes([node_config(tmp_path, "worker", run=run)]) as (worker,):
        async with trio.open_nursery() as nursery:
            link = Link(tcp_port(worker.host.listen_addrs()[0]))
            await nursery.start(link.serve)
            relay_cfg = node_config(tmp_path, "relay", run=run,
                                    bootstrap=[f"/ip4/127.0.0.1/tcp/{link.port}/p2p/{worker.peer_id}"])
            async with open_nodes([relay_cfg]) as (relay,):
                budget = worker.host.inbound[SHARDS_PROTOCOL].budget
                streams = [await relay.host.open_stream(worker.peer_id, SHARDS_PROTOCOL) for _ in range(4)]
                await wait_for(lambda: budget.held_by(relay.peer_id)[0] == 4, what="four sessions admitted")
                link.cut()  # the relay's requests go out but are held: nothing reaches the worker
                for stream in streams:
                    await stream.write(b"\x00\x00\x00\x02hi")
                await wait_for(lambda: budget.held_by(relay.peer_id)[0] == 0, what="the four streams cut")
                assert budget.stalled == 4  # each at its deadline (a ban would have ended the last ones)
                assert link.connections == 1  # every stream rode the cut link
                assert not worker.peers.is_banned(relay.peer_id)
                assert len(worker.peers.table.peers[relay.peer_id].strikes[STALL_SOURCE]) == 1
                link.heal()
                assert await relay.host.ping(worker.peer_id) >= 0  # served again at once
                assert link.connections == 1
            nursery.cancel_scope.cancel()


def pause_reader(node, peer: str) -> trio.Event:
    """Stop ``node`` reading its connection from ``peer`` (its muxer's reads of the secure session
    wait) until the returned event is set: what a node whose loop is starved (inference-8 loading
    its model) does to every connection, while its timers still fire."""
    resume = trio.Event()
    [conn] = node.host.host.get_network().connections[ID.from_base58(peer)]
    session = conn.muxed_conn.secured_conn
    read = session.read

    async def paused(n: int | None = None) -> bytes:
        await resume.wait()
        return await read(n)

    session.read = paused
    return resume


async def test_streams_cut_while_we_had_not_read_the_peers_bytes_strike_no_one(tmp_path):
    """The relay sends its requests at once; the worker's own reader is what is late. Its streams
    are cut at their deadline (the slots come back), the relay is not struck, and once the worker
    reads again the relay is served."""
    run = RunConfig(name="test")
    run.tables.update(streams={"header_timeout": 3.0})
    cfgs = [node_config(tmp_path, n, run=run) for n in ("worker", "relay")]
    async with open_nodes(cfgs) as (worker, relay):
        budget = worker.host.inbound[SHARDS_PROTOCOL].budget
        streams = [await relay.host.open_stream(worker.peer_id, SHARDS_PROTOCOL) for _ in range(4)]
        status = await relay.host.open_stream(worker.peer_id, STATUS_PROTOCOL)
        await wait_for(lambda: budget.held_by(relay.peer_id)[0] == 4, what="four sessions admitted")
        resume = pause_reader(worker, relay.peer_id)
        await write_frame(status, StatusRequest())  # taken by the read the worker's muxer had begun
        for stream in streams:
            await stream.write(b"\x00\x00\x00\x02hi")
        await wait_for(lambda: budget.held_by(relay.peer_id)[0] == 0, what="the four streams cut")
        assert budget.stalled == 4 and budget.refused["stalled"] == 4
        entry = worker.peers.table.peers.get(relay.peer_id)
        assert entry is None or STALL_SOURCE not in entry.strikes, entry
        resume.set()
        assert await relay.host.ping(worker.peer_id) >= 0
