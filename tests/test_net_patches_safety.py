"""The safety patches of py-libp2p (node/net/patches/safety.py) over real loopback sockets: a
cancelled frame write, a stalled peer, or a peer sending past its window cannot break a node."""

from __future__ import annotations

import struct

import pytest
import trio
from hosts import ECHO, LOOPBACK, connected_hosts, echo
from libp2p.peer.id import ID
from libp2p.security.noise.io import NoiseTransportReadWriter
from libp2p.stream_muxer.yamux.yamux import FLAG_SYN, TYPE_PING, YAMUX_HEADER_FORMAT

from node.identity import Identity
from node.net.host import STREAM_ERRORS, open_swarm_host
from node.wire import read_frame, write_frame


async def test_a_write_cancelled_after_encryption_leaves_the_connection_usable(monkeypatch):
    """A deadline that expires between Noise's encrypt and the send used to burn a nonce the peer
    never saw: every later frame on the connection failed to decrypt and no stream could open."""
    async with connected_hosts(ECHO, echo) as (a, b):
        muxer = a.host.get_network().connections[ID.from_base58(b.peer_id)][0].muxed_conn
        scope = trio.CancelScope()
        encrypt = NoiseTransportReadWriter.encrypt

        def encrypt_then_cancel(self, data: bytes) -> bytes:
            monkeypatch.setattr(NoiseTransportReadWriter, "encrypt", encrypt)  # once
            scope.cancel()  # as if the caller's deadline passed right after the nonce was used
            return encrypt(self, data)

        monkeypatch.setattr(NoiseTransportReadWriter, "encrypt", encrypt_then_cancel)
        with scope:
            await muxer._write_frame(struct.pack(YAMUX_HEADER_FORMAT, 0, TYPE_PING, FLAG_SYN, 0, 7))
        assert scope.cancelled_caught
        with trio.fail_after(10):
            stream = await a.open_stream(b.peer_id, ECHO)
            await write_frame(stream, b"still in sync")
            assert await read_frame(stream) == b"still in sync"


async def test_a_frame_write_that_stalls_closes_the_connection_and_no_caller_can_cut_it_short(autojump_clock):
    """A frame's send is shielded from its caller's deadline (half a frame on the wire corrupts the
    connection) but bounded by its own: a peer that stops reading gets its connection closed."""
    from libp2p.stream_muxer.yamux.yamux import Yamux

    from node.net.patches.safety import FRAME_WRITE_LIMIT, CancelSafeFrames
    from node.net.patches.speed import QuickLock

    CancelSafeFrames.install()

    class Stuck:  # a secured connection whose peer never reads
        closed = False

        async def write(self, data: bytes) -> None:
            await trio.sleep_forever()

        async def close(self) -> None:
            self.closed = True

    muxer = Yamux.__new__(Yamux)
    muxer._write_lock, muxer.secured_conn = QuickLock(), Stuck()
    start = trio.current_time()
    with pytest.raises(trio.BrokenResourceError), trio.move_on_after(1):  # the caller's deadline passes first
        await muxer._write_frame(b"frame")
    assert muxer.secured_conn.closed, "a stalled write must close the connection"
    assert trio.current_time() - start >= FRAME_WRITE_LIMIT, "the caller's deadline cut the send short"


async def test_a_peer_sending_past_the_receive_window_is_cut_off_and_banned():
    """py-libp2p logged a peer that sent past a stream's receive window and buffered the bytes
    anyway, so a peer ignoring windows could grow our memory while a handler was not reading.
    Mallory writes raw DATA frames past the 256 KiB window of a stream whose handler never reads:
    the victim closes the connection, bans it through its peer table, and keeps serving others."""
    from libp2p.stream_muxer.yamux.yamux import DEFAULT_WINDOW_SIZE, TYPE_DATA

    from node.metrics import Metrics
    from node.peers import Peers
    from node.peers.service import MUXER_SOURCE
    from tests.waiting import wait_for

    never = trio.Event()

    async def hold(stream) -> None:  # reads nothing, so the window is never credited back
        await never.wait()

    async with connected_hosts("/test/hold/1", hold) as (mallory, victim):
        peers = Peers(victim, Metrics())
        victim.set_handler(ECHO, echo)
        stream = await mallory.open_stream(victim.peer_id, "/test/hold/1")
        muxed = stream.muxed_stream
        body = b"\x00" * 60_000
        for _ in range(DEFAULT_WINDOW_SIZE // len(body) + 1):  # one frame past the window
            header = struct.pack(YAMUX_HEADER_FORMAT, 0, TYPE_DATA, 0, muxed.stream_id, len(body))
            await muxed.conn._write_frame(header + body)  # what YamuxStream.write would wait to send
        await wait_for(lambda: mallory.peer_id not in victim.connected_peers(), what="mallory cut off")
        assert peers.is_banned(mallory.peer_id, MUXER_SOURCE)
        assert peers.app_score(mallory.peer_id) < 0
        async with open_swarm_host(Identity.generate(), LOOPBACK) as carol:
            await carol.connect(victim.listen_addrs()[0])
            reply = await carol.open_stream(victim.peer_id, ECHO)
            await write_frame(reply, b"still here")
            assert await read_frame(reply) == b"still here"
        never.set()


async def test_a_peer_within_the_window_is_never_cut_off():
    """The bound is the window itself: a peer sending exactly up to it, and on after each credit,
    keeps its connection (the same raw frames, with the handler reading)."""
    from libp2p.stream_muxer.yamux.yamux import DEFAULT_WINDOW_SIZE, TYPE_DATA

    got = bytearray()

    async def drain(stream) -> None:
        while len(got) < 2 * DEFAULT_WINDOW_SIZE:
            got.extend(await stream.read(1 << 20))
        await stream.write(b"k")

    async with connected_hosts("/test/drain/1", drain) as (a, b):
        stream = await a.open_stream(b.peer_id, "/test/drain/1")
        await stream.write(b"\x01" * DEFAULT_WINDOW_SIZE)  # all of the first window, honestly
        await stream.write(b"\x02" * DEFAULT_WINDOW_SIZE)  # waits for credit as it must
        with trio.fail_after(30):
            assert await stream.read(1) == b"k"
        assert a.peer_id in b.connected_peers()
    assert bytes(got) == b"\x01" * DEFAULT_WINDOW_SIZE + b"\x02" * DEFAULT_WINDOW_SIZE


async def test_a_frame_announcing_more_than_any_window_is_refused_before_its_body_is_read():
    """py-libp2p refuses a DATA frame longer than 16 MiB (its largest window) but reads any shorter
    one in full before the window is checked: on a stream granted 256 KiB a peer could have us
    assemble 16 MiB per connection. A frame longer than every window granted on the connection now
    closes it and bans the peer before its body is read (a timed-out body would close it too, but
    ban no one)."""
    from libp2p.stream_muxer.yamux.yamux import MAX_WINDOW_SIZE, TYPE_DATA

    from node.metrics import Metrics
    from node.peers import Peers
    from node.peers.service import MUXER_SOURCE
    from tests.waiting import wait_for

    async with connected_hosts(ECHO, echo) as (mallory, victim):
        peers = Peers(victim, Metrics())
        stream = await mallory.open_stream(victim.peer_id, ECHO)
        muxed = stream.muxed_stream
        header = struct.pack(YAMUX_HEADER_FORMAT, 0, TYPE_DATA, 0, muxed.stream_id, MAX_WINDOW_SIZE)
        chunk = b"\x00" * 60_000
        async with muxed.conn._write_lock:
            await muxed.conn.secured_conn.write(header)
            with trio.move_on_after(30):  # a guard only: the victim stops reading once it refuses
                try:
                    for _ in range(64):  # 3.7 MiB of the announced 16: far past the stream's 256 KiB window
                        await muxed.conn.secured_conn.write(chunk)
                except STREAM_ERRORS:
                    pass  # the victim closed the connection while we wrote: what is tested below
        await wait_for(lambda: mallory.peer_id not in victim.connected_peers(), what="mallory cut off")
        assert peers.is_banned(mallory.peer_id, MUXER_SOURCE)
