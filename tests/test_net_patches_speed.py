"""The speed patches of py-libp2p (node/net/patches/speed.py) over real loopback sockets: each cost
they remove stays removed, and every byte still arrives in order."""

from __future__ import annotations

import collections
import itertools
import struct

import hypothesis
import pytest
import trio
import trio.testing
from hosts import LOOPBACK, StepCount, connected_hosts, frame_sink, mib_sink
from libp2p.peer.id import ID
from libp2p.security.noise.io import NoiseTransportReadWriter
from libp2p.stream_muxer.yamux.yamux import FLAG_SYN, TYPE_PING, YAMUX_HEADER_FORMAT

from node.identity import Identity
from node.net.host import open_swarm_host, widen_receive_window
from node.wire import RemoteProtocolError, read_frame, write_frame


async def test_window_credit_is_sent_once_per_half_window_not_per_read(monkeypatch):
    """py-libp2p credited the Yamux window after nearly every read: a receiver of small frames (two
    reads each) sent more WINDOW_UPDATE frames than it got data frames. Batched as go-yamux does,
    the updates are about one per half window of bytes consumed, and every byte still arrives."""
    from libp2p.stream_muxer.yamux.yamux import YamuxStream

    updates = []
    send_update = YamuxStream.send_window_update

    async def counted(self, increment, skip_lock=False):
        updates.append(increment)
        await send_update(self, increment, skip_lock=skip_lock)

    monkeypatch.setattr(YamuxStream, "send_window_update", counted)
    frames, size = 2048, 4096  # 8 MiB in 4 KiB frames
    got = []
    async with connected_hosts("/test/sink/1", frame_sink(frames, got)) as (a, b):
        stream = await a.open_stream(b.peer_id, "/test/sink/1")
        with trio.fail_after(30):
            for k in range(frames):
                await write_frame(stream, k.to_bytes(4, "big") * (size // 4))
            assert await stream.read(1) == b"k"
    assert [f[:4] for f in got] == [k.to_bytes(4, "big") for k in range(frames)]
    half_windows = frames * size // (128 * 1024)  # the window starts at 256 KiB and only grows
    assert len(updates) <= half_windows + 8, f"{len(updates)} window updates for {frames} frames"


async def test_a_noise_message_arriving_a_segment_at_a_time_wakes_the_reader_a_few_times(monkeypatch):
    """On a slow link a 60 KiB Noise message arrives ~1.4 KB at a time; py-libp2p woke its reader
    (a recv and a pass through trio's scheduler) for each piece. With SO_RCVLOWAT set to what the
    message still lacks before each read, one read takes its body whole, and every byte still
    arrives in order."""
    from libp2p.io.trio import TrioTCPStream

    write, read = TrioTCPStream.write, TrioTCPStream.read
    reads: dict[int, int] = {}
    slow = {"on": False}

    async def trickle(self, data: bytes) -> None:  # a slow link: small segments, spaced out
        if not slow["on"]:
            return await write(self, data)
        for i in range(0, len(data), 1400):
            await write(self, data[i : i + 1400])
            await trio.sleep(0.0005)

    async def counted(self, n=None):
        reads[id(self)] = reads.get(id(self), 0) + 1
        return await read(self, n)

    monkeypatch.setattr(TrioTCPStream, "write", trickle)
    monkeypatch.setattr(TrioTCPStream, "read", counted)
    frames, size = 16, 60 * 1024
    got = []
    async with connected_hosts("/test/sink/1", frame_sink(frames, got)) as (a, b):
        stream = await a.open_stream(b.peer_id, "/test/sink/1")
        await trio.testing.wait_all_tasks_blocked()
        reads.clear()
        slow["on"] = True
        with trio.fail_after(30):
            for k in range(frames):
                await write_frame(stream, bytes([k]) * size)
            assert await stream.read(1) == b"k"
    assert got == [bytes([k]) * size for k in range(frames)]
    receiver = max(reads.values())  # the connection that took in the ~1 MiB
    # Two reads a message (its prefix, then its body once whole). Setting the mark only after a
    # first read of the body took three: that read woke at the first segment.
    assert receiver <= 2 * frames + 8, f"{receiver} reads for {frames} messages of {size} bytes"


class ScriptedSocket:
    """A connection and its socket for ``fill_noise_message``: each read returns the next scripted
    number of bytes, and records the low-water mark the socket had when it was made."""

    def __init__(self, chunks: list[int]) -> None:
        self.chunks = chunks
        self.mark = 1
        self.reads: list[tuple[int, int]] = []  # (mark at the read, bytes it returned)

    def setsockopt(self, level, option, value) -> None:
        self.mark = value

    async def read(self, n: int) -> bytes:
        size = self.chunks.pop(0)
        self.reads.append((self.mark, size))
        return b"x" * size


async def test_the_mark_never_exceeds_what_a_noise_message_still_lacks():
    """A body read in parts left the mark of an earlier part in place once only a byte or two were
    missing: the read then waited for a 32 KiB mark that the peer would never reach before we
    answered (a liar test's honest-looking seeder whose every block arrived 2 s late, as timeouts)."""
    from node.net.patches.speed import fill_noise_message

    need = 2 + 65535  # a whole Noise message: prefix and the largest body
    for chunks in ([32766, 32768, 1], [65534, 1], [60000, 5533, 2], [40000, 25534, 1]):
        conn = ScriptedSocket(list(chunks))
        ahead = bytearray(b"\xff\xff")  # its prefix was read
        await fill_noise_message(conn, conn, ahead, need)
        assert len(ahead) == 2 + sum(chunks)
        missing = need - 2
        for mark, size in conn.reads:
            assert mark <= max(missing, 1), f"a read with mark {mark} while {missing} bytes were due ({chunks})"
            missing -= size
        assert conn.mark == 1  # left for the next prefix


async def test_each_yamux_data_frame_is_one_noise_message(monkeypatch):
    """py-libp2p's full Yamux frame (64 KiB) was 17 bytes over a Noise message's plaintext limit, so
    bulk data went out as two Noise messages per frame (twice the encryptions, sends and wake-ups at
    the reader). Every frame must fit one message, and every byte still arrive in order."""
    sizes = noise_message_sizes(monkeypatch)
    payload, got, sink = mib_sink()
    async with connected_hosts("/test/sink/1", sink) as (a, b):
        stream = await a.open_stream(b.peer_id, "/test/sink/1")
        sizes.clear()
        with trio.fail_after(30):
            await stream.write(payload)
            assert await stream.read(1) == b"k"
    assert bytes(got) == payload
    assert_one_noise_message_per_full_frame(sizes, len(payload))


def noise_message_sizes(monkeypatch) -> list[int]:
    """The plaintext size of every Noise message written from now on."""
    sizes: list[int] = []
    write_msg = NoiseTransportReadWriter.write_msg

    async def recorded(self, msg: bytes, prefix_encoded: bool = False) -> None:
        sizes.append(len(msg))
        await write_msg(self, msg, prefix_encoded)

    monkeypatch.setattr(NoiseTransportReadWriter, "write_msg", recorded)
    return sizes


def assert_one_noise_message_per_full_frame(sizes: list[int], payload_bytes: int) -> None:
    from libp2p.security.noise.io import MAX_PLAINTEXT_LENGTH

    assert max(sizes) <= MAX_PLAINTEXT_LENGTH, f"a frame of {max(sizes)} bytes was split into two Noise messages"
    assert sum(s > 60_000 for s in sizes) >= payload_bytes // MAX_PLAINTEXT_LENGTH  # and frames stay large


async def test_yamux_reads_its_tuning_from_the_environment_once_not_per_frame(monkeypatch):
    """py-libp2p looked up its PY_YAMUX_* variables in os.environ for every frame and read (~19,000
    times for 256 MiB). Moving 1 MiB must not look up any, and the values are still its defaults."""
    import os

    from libp2p.stream_muxer.yamux import yamux

    lookups = []
    getenv = os.getenv

    def counted(name, default=None):
        if name.startswith("PY_YAMUX_"):
            lookups.append(name)
        return getenv(name, default)

    payload, got, sink = mib_sink()
    async with connected_hosts("/test/sink/1", sink) as (a, b):
        stream = await a.open_stream(b.peer_id, "/test/sink/1")
        await stream.write(b"x" * 10)  # every setting in use has been read once
        while len(got) < 10:
            await trio.sleep(0.01)
        got.clear()
        monkeypatch.setattr(os, "getenv", counted)
        with trio.fail_after(30):
            await stream.write(payload)
            assert await stream.read(1) == b"k"
    assert bytes(got) == payload
    assert lookups == []
    assert yamux._yamux_data_read_timeout() == 60.0 and yamux._yamux_batch_threshold_divisor() == 2


async def test_a_writer_waiting_for_send_window_sleeps_until_the_window_grows():
    """With the peer's window used up, py-libp2p's write polled the window every 10 ms (100 wake-ups
    a second per blocked stream: every upload through a slow link). The writer must stay asleep,
    whatever the wait, and go on when the reader reads."""
    read_now = trio.Event()
    got = bytearray()
    payload = b"x" * (1 << 20)  # four windows' worth

    async def lazy(stream) -> None:
        await read_now.wait()
        while len(got) < len(payload):
            got.extend(await stream.read(1 << 20))
        await stream.write(b"k")

    async with connected_hosts("/test/lazy/1", lazy) as (a, b):
        stream = await a.open_stream(b.peer_id, "/test/lazy/1")
        async def writer() -> None:
            await stream.write(payload)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(writer, name="writer")
            with trio.fail_after(30):
                while stream.muxed_stream.send_window > 0:  # until the window is used up and the writer waits
                    await trio.sleep(0.01)
            await trio.testing.wait_all_tasks_blocked()
            counter = StepCount("writer")
            trio.lowlevel.add_instrument(counter)
            await trio.sleep(0.2)  # any time at all: a polling writer wakes ~20 times in this one
            trio.lowlevel.remove_instrument(counter)
            assert counter.n == 0, f"the blocked writer woke {counter.n} times"
            read_now.set()
            with trio.fail_after(30):
                assert await stream.read(1) == b"k"
    assert len(got) == len(payload)


async def test_a_free_quick_lock_costs_no_pass_through_the_scheduler_and_a_held_one_is_taken_in_turn():
    """py-libp2p takes ~11 locks per Noise message; trio's acquire yields even when the lock is
    free. A QuickLock does not, and a held one is still handed to its waiters first come first served,
    a cancelled waiter dropping out without harm."""
    from node.net.patches.speed import QuickLock

    ran = []

    async def other() -> None:
        ran.append(True)

    lock = QuickLock()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(other)
        for _ in range(100):
            async with lock:
                pass
        assert not ran, "a free lock yielded to another task"
    order, scopes = [], {}

    async def waiter(name: str) -> None:
        with trio.CancelScope() as scopes[name]:
            async with lock:
                order.append(name)

    async with trio.open_nursery() as nursery:
        await lock.acquire()
        for name in ("b", "gone", "c"):
            nursery.start_soon(waiter, name)
            await trio.testing.wait_all_tasks_blocked()
        assert lock.statistics().tasks_waiting == 3
        scopes["gone"].cancel()
        await trio.testing.wait_all_tasks_blocked()
        assert lock.statistics().tasks_waiting == 2
        lock.release()
    assert order == ["b", "c"] and not lock.locked()


async def test_the_locks_of_each_message_are_quick_and_noise_reads_take_several_messages_at_once(monkeypatch):
    """Each Noise message took two reads (its 2-byte length, then its body) and about eleven lock
    passes through the scheduler. Messages already waiting in the socket now come in together, and
    every byte still arrives in order."""
    from libp2p.io.trio import TrioTCPStream

    from node.net.patches.speed import QuickLock

    read = TrioTCPStream.read
    reads: dict[int, int] = {}

    async def counted(self, n=None):
        reads[id(self)] = reads.get(id(self), 0) + 1
        return await read(self, n)

    monkeypatch.setattr(TrioTCPStream, "read", counted)
    frames, got = 200, []
    async with connected_hosts("/test/sink/1", frame_sink(frames, got)) as (a, b):
        stream = await a.open_stream(b.peer_id, "/test/sink/1")
        muxed = stream.muxed_stream
        assert all(isinstance(x, QuickLock) for x in (muxed.window_lock, muxed.conn._write_lock, muxed.conn.streams_lock,
                                                        stream._state_lock, muxed.rw_lock._writer_lock))
        await trio.testing.wait_all_tasks_blocked()
        reads.clear()
        with trio.fail_after(30):
            for k in range(frames):  # one Yamux frame, one Noise message each, with no wait between
                await write_frame(stream, bytes([k % 256]) * 100)
            assert await stream.read(1) == b"k"
    assert got == [bytes([k % 256]) * 100 for k in range(frames)]
    receiver = max(reads.values())
    assert receiver < frames, f"{receiver} reads for {frames} Noise messages"


async def test_a_peer_record_is_verified_once_while_unchanged_and_a_forged_one_is_still_refused(monkeypatch):
    """py-libp2p re-verified the sender's signed peer record on every pubsub RPC (one Ed25519 check
    and a peerstore update each). The same bytes from the same peer are now checked once per
    VERIFY_TTL; a record with one byte changed, or one sent by another peer, goes through the check."""
    from libp2p.peer import peerstore
    from libp2p.pubsub import pubsub as pubsub_module
    from libp2p.pubsub.pb import rpc_pb2

    async with connected_hosts() as (a, b):
        record, _ = peerstore.env_to_send_in_RPC(b.host)
        assert peerstore.env_to_send_in_RPC is not pubsub_module.env_to_send_in_RPC  # ours is installed
        store = a.host.get_peerstore()
        consumed = []
        consume_peer_record = store.consume_peer_record
        monkeypatch.setattr(store, "consume_peer_record", lambda env, ttl: consumed.append(1) or consume_peer_record(env, ttl))
        check = pubsub_module.maybe_consume_signed_record
        sender = ID.from_base58(b.peer_id)
        a.host.__dict__.pop("_records_verified", None)  # forget what b's first RPCs brought

        def rpc(raw: bytes):
            msg = rpc_pb2.RPC()
            msg.senderRecord = raw
            return msg

        assert all(check(rpc(record), a.host, sender) for _ in range(20))
        assert len(consumed) == 1
        forged = bytearray(record)
        forged[-1] ^= 1  # inside the signature
        assert not check(rpc(bytes(forged)), a.host, sender)
        assert not check(rpc(record), a.host, ID.from_base58(a.peer_id))  # b's record, claimed by another peer
        assert check(rpc_pb2.RPC(), a.host, sender)  # none sent: nothing to check
        assert len(consumed) == 1


async def test_our_peer_record_is_built_once_per_ttl_not_per_rpc(autojump_clock, monkeypatch):
    from libp2p.pubsub import gossipsub

    from node.net.patches.speed import PeerRecordReuse

    async with open_swarm_host(Identity.generate(), LOOPBACK) as a:
        calls = []
        get_addrs = a.host.get_addrs
        monkeypatch.setattr(a.host, "get_addrs", lambda: calls.append(1) or get_addrs())
        await trio.sleep(PeerRecordReuse.SEND_TTL)  # what start-up built has expired
        first = gossipsub.env_to_send_in_RPC(a.host)
        built = len(calls)
        assert built >= 1
        assert all(gossipsub.env_to_send_in_RPC(a.host) == first for _ in range(50))
        assert len(calls) == built
        await trio.sleep(PeerRecordReuse.SEND_TTL)
        gossipsub.env_to_send_in_RPC(a.host)
        assert len(calls) > built


async def test_a_gossip_message_already_seen_starts_no_task():
    """pubsub started one service task per message received, duplicates included (eight of nine
    copies with a mesh of 9), walking its whole task tree for each; a seen one now starts none."""
    from libp2p.pubsub.pb import rpc_pb2

    async with open_swarm_host(Identity.generate(), LOOPBACK) as a:
        pubsub, manager = a.pubsub, a.pubsub.manager
        msg = rpc_pb2.Message(from_id=ID.from_base58(a.peer_id).to_bytes(), seqno=b"\x00" * 7 + b"\x01",
                              data=b"x", topicIDs=["/test/none"])
        peer = ID.from_base58(Identity.generate().peer_id)
        before = manager._total_task_count
        manager.run_task(pubsub.push_msg, peer, msg)  # unseen: a task, as before
        assert manager._total_task_count == before + 1
        pubsub._mark_msg_seen(msg)
        manager.run_task(pubsub.push_msg, peer, msg)
        assert manager._total_task_count == before + 1


async def test_an_idle_connection_pings_for_its_round_trip_every_two_minutes_not_every_30_s(autojump_clock, monkeypatch):
    from libp2p.stream_muxer.yamux.yamux import Yamux

    pings = []

    async with connected_hosts():
        write_frame = Yamux._write_frame  # the hosts' own (CancelSafeFrames)

        async def counted(self, data: bytes, *args, **kwargs):
            if len(data) >= 12 and struct.unpack(YAMUX_HEADER_FORMAT, data[:12])[1] == TYPE_PING and data[3] & FLAG_SYN:
                pings.append(trio.current_time())
            return await write_frame(self, data, *args, **kwargs)

        monkeypatch.setattr(Yamux, "_write_frame", counted)
        await trio.sleep(600)  # ten minutes of trio's MockClock (autojump_clock), not of the wall
    assert 2 * 5 <= len(pings) <= 2 * 6  # each end: one after 0.5 s, then one per 120 s (21 per 600 s before)


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(hypothesis.strategies.lists(hypothesis.strategies.one_of(
    hypothesis.strategies.binary(max_size=40).map(lambda b: ("extend", b)),  # gathered (SMALL_CHUNK)
    hypothesis.strategies.tuples(hypothesis.strategies.binary(min_size=1, max_size=8),
                                 hypothesis.strategies.integers(1, 1200)).map(lambda t: ("extend", t[0] * t[1])),
    hypothesis.strategies.integers(0, 10_000).map(lambda n: ("take", n)),
    hypothesis.strategies.integers(0, 10_000).map(lambda n: ("drop", n)),
    hypothesis.strategies.just(("all", 0)),
), max_size=40))
def test_stream_chunks_read_as_a_bytearray_does(ops):
    """py-libp2p's Yamux code uses its per-stream buffer through extend, len, bytes(b), bytes(b[:n])
    and del b[:n]: StreamChunks answers each as the bytearray it replaces would."""
    from node.net.patches.speed import StreamChunks

    ref, chunks = bytearray(), StreamChunks()
    for op, arg in ops:
        if op == "extend":
            ref.extend(arg)
            chunks.extend(arg if len(arg) % 2 else bytearray(arg))
        elif op == "take":
            assert bytes(chunks[:arg]) == bytes(ref[:arg])
            del ref[:arg], chunks[:arg]
        elif op == "drop":
            del ref[:arg], chunks[:arg]
        else:
            assert bytes(chunks) == bytes(ref)
            ref.clear(), chunks.clear()
        assert len(chunks) == len(ref) and bool(chunks) == bool(ref)


def test_stream_chunks_keep_frames_uncopied_and_join_a_read_once():
    """A frame body is kept as the object received; a read that spans frames is one join, and a
    frame read in part stays behind as a view of its rest."""
    from node.net.patches.speed import StreamChunks

    first, second = bytes(range(256)) * 20, bytes(range(255, -1, -1)) * 20  # frames of 5,120 bytes
    chunks = StreamChunks()
    chunks.extend(first)
    chunks.extend(second)
    assert chunks._chunks[0] is first and chunks._chunks[1] is second
    assert chunks[:len(first)] is first  # a read of exactly one frame is that frame
    del chunks[:len(first)]
    head = chunks[:4]
    del chunks[:4]
    assert head == second[:4] and isinstance(chunks._chunks[0], memoryview)
    assert bytes(chunks) == second[4:]
    try:
        chunks[1:3]
    except TypeError:
        pass
    else:
        raise AssertionError("a slice py-libp2p does not use must fail loudly")


def test_tiny_frames_from_a_hostile_peer_are_gathered_not_kept_one_object_each():
    """A peer may fill a widened window with 1-byte DATA frames: kept one bytes object each, 8 MiB
    of them would hold ~40 times that in memory. Small bodies go into a few bytearrays instead."""
    import sys

    from node.net.patches.speed import SMALL_CHUNK, StreamChunks

    chunks = StreamChunks()
    for k in range(100_000):
        chunks.extend(bytes([k % 251]))
    assert len(chunks) == 100_000 and len(chunks._chunks) <= 100_000 // SMALL_CHUNK + 1
    held = sum(sys.getsizeof(c) for c in chunks._chunks)
    assert held < 2 * 100_000, f"{held} bytes held for 100,000 bytes received"
    chunks.extend(bytes(range(100)) * 700)  # a full frame after them is kept as it came
    assert bytes(chunks[:100_001])[-2:] == bytes([99_999 % 251, 0])
    del chunks[:100_001]
    assert bytes(chunks) == (bytes(range(100)) * 700)[1:]


async def test_yamux_stream_buffers_are_chunks_and_reads_of_any_size_get_every_byte():
    """Over real hosts: the stream's buffer is a StreamChunks, and 3 MiB written in one go arrive
    whole through reads of 4 bytes, of part of a frame and of several frames."""
    from node.net.patches.speed import StreamChunks

    payload = bytes(range(256)) * (3 << 12)
    done = trio.Event()

    async def sender(stream) -> None:
        await stream.write(payload)
        await done.wait()

    async with connected_hosts("/test/sender/1", sender) as (a, b):
        stream = await a.open_stream(b.peer_id, "/test/sender/1")
        await widen_receive_window(stream, 4 << 20)  # the whole payload can sit unread in the buffer
        muxed = stream.muxed_stream
        got, sizes = bytearray(), itertools.cycle([4, 1000, 70_000, 300_000])
        with trio.fail_after(30):
            while len(got) < len(payload):
                got.extend(await stream.read(min(next(sizes), len(payload) - len(got))))
        assert type(muxed.conn.stream_buffers[muxed.stream_id]) is StreamChunks
        done.set()
    assert got == payload


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(
    hypothesis.strategies.lists(hypothesis.strategies.integers(1, 300), min_size=1, max_size=12),
    hypothesis.strategies.lists(hypothesis.strategies.one_of(hypothesis.strategies.none(),
                                                             hypothesis.strategies.integers(1, 700)), max_size=20),
)
def test_a_secured_connection_reads_its_messages_as_one_byte_stream(sizes, reads):
    """MessageReads keeps the last Noise message and serves reads from it: ``read(n)`` gets the next
    ``n`` bytes across messages (fewer only at the end), ``read()`` the rest of the message or the
    next one, and nothing is lost or repeated."""
    from libp2p.io.exceptions import ConnectionClosedError
    from libp2p.security.secure_session import SecureSession

    from node.net.patches.speed import MessageReads

    MessageReads.install()
    counter = itertools.count()
    messages = [bytes(next(counter) % 251 for _ in range(n)) for n in sizes]

    class Conn:
        def __init__(self) -> None:
            self.left = list(messages)

        async def read_msg(self) -> bytes:
            return self.left.pop(0) if self.left else b""

    async def run() -> None:
        session = SecureSession.__new__(SecureSession)
        session.conn = Conn()
        session._reset_internal_buffer()
        stream, at = b"".join(messages), 0
        ends = list(itertools.accumulate(sizes))
        for n in reads:
            if at == len(stream):
                with pytest.raises(ConnectionClosedError):
                    await session.read(n)
                return
            got = await session.read(n)
            # read(): the rest of the message being read, or the next whole one: up to the next end
            assert got == (stream[at:next(e for e in ends if e > at)] if n is None else stream[at:at + n])
            at += len(got)

    trio.run(run)


async def test_a_frame_whose_body_comes_in_later_noise_messages_still_arrives_whole():
    """Our frames are one Noise message each, so a body is taken from the message its header came
    in; another implementation may send the header and the body apart, and the body in pieces."""
    from libp2p.stream_muxer.yamux.yamux import TYPE_DATA

    got = []

    async with connected_hosts("/test/sink/1", frame_sink(1, got)) as (a, b):
        stream = await a.open_stream(b.peer_id, "/test/sink/1")
        muxed = stream.muxed_stream
        body = struct.pack(">I", 3000) + bytes(range(250)) * 12  # one length-prefixed frame (node.wire)
        header = struct.pack(YAMUX_HEADER_FORMAT, 0, TYPE_DATA, 0, muxed.stream_id, len(body))
        async with muxed.conn._write_lock:
            for part in (header, body[:1000], body[1000:2500], body[2500:]):
                await muxed.conn.secured_conn.write(part)  # one Noise message each
        with trio.fail_after(30):
            assert await stream.read(1) == b"k"
    assert got == [bytes(range(250)) * 12]


def count_body_reads(monkeypatch) -> dict[tuple[int, int], list[int]]:
    """The sizes of each stream's Yamux reads that returned more than 4 bytes (bodies, not
    4-byte headers), by (id of the connection, stream id)."""
    from libp2p.stream_muxer.yamux.yamux import Yamux

    sizes: dict[tuple[int, int], list[int]] = collections.defaultdict(list)
    read_stream = Yamux.read_stream

    async def counted(self, stream_id: int, n: int = -1) -> bytes:
        data = await read_stream(self, stream_id, n)
        if len(data) > 4:
            sizes[(id(self), stream_id)].append(len(data))
        return data

    monkeypatch.setattr(Yamux, "read_stream", counted)
    return sizes


async def test_a_frame_is_read_in_one_piece_once_all_of_it_is_buffered(monkeypatch):
    """read_frame read a frame's body in as many reads as parts had arrived, and joined them again:
    a 1 MiB block in 16 Noise messages, two copies and several wake-ups. Here the sender stops
    half-way until the first half sits unread in our buffer: the body is still one read."""
    from tests.waiting import wait_for

    payload = bytes(range(256)) * 4096
    frame = len(payload).to_bytes(4, "big") + payload
    rest = trio.Event()

    async def sender(stream) -> None:
        await stream.write(frame[: 4 + len(payload) // 2])
        await rest.wait()
        await stream.write(frame[4 + len(payload) // 2:])
        await stream.read(1)

    reads = count_body_reads(monkeypatch)
    async with connected_hosts("/test/sender/1", sender) as (a, b):
        stream = await a.open_stream(b.peer_id, "/test/sender/1")
        await widen_receive_window(stream, 4 << 20)
        muxed = stream.muxed_stream
        sizes = reads[(id(muxed.conn), muxed.stream_id)]
        negotiation = len(sizes)  # multistream-select's lines on this stream
        got: list[bytes] = []
        steps = StepCount("reader")
        trio.lowlevel.add_instrument(steps)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: _append(got, read_frame(stream, 2 << 20)), name="reader")
            with trio.fail_after(30):  # a guard only
                await wait_for(lambda: len(muxed.conn.stream_buffers.get(muxed.stream_id, b"")) >= len(payload) // 2,
                               what="the first half buffered")
            assert sizes[negotiation:] == [] and not got  # half a frame is there, and nobody read it
            rest.set()
        trio.lowlevel.remove_instrument(steps)
        await stream.write(b"k")
    assert got == [payload] and sizes[negotiation:] == [len(payload)]
    # Woken once the frame was all there, not for each of its ~16 Noise messages: a step to start,
    # the header's, the body's wait, and the wake that read it (the header may need a wait of its own).
    assert steps.n <= 5, steps.n


async def _append(out: list, read) -> None:
    out.append(await read)


async def test_a_frame_longer_than_half_the_window_or_cut_short_is_read_as_before():
    """The wait is only for what the peer may send without credit, and for at most half a window
    (the sender keeps sending meanwhile): a longer frame is read in parts as before and arrives
    whole, and a frame cut off by the stream's end is the peer's truncation, not a hang."""
    payload = bytes(range(256)) * 1024  # 256 KiB: all of a default window, more than its half
    cut = trio.Event()

    async def sender(stream) -> None:
        await write_frame(stream, payload)
        await stream.write((100_000).to_bytes(4, "big") + b"x" * 50_000)
        await stream.close()
        await cut.wait()

    async with connected_hosts("/test/sender/1", sender) as (a, b):
        stream = await a.open_stream(b.peer_id, "/test/sender/1")
        with trio.fail_after(30):
            assert await read_frame(stream, 1 << 20) == payload
            with pytest.raises(RemoteProtocolError, match="truncated"):
                await read_frame(stream, 1 << 20)
        cut.set()


async def test_parts_written_as_one_arrive_joined_in_whole_noise_messages(monkeypatch):
    """write_parts hands a Yamux stream its parts without joining them first (a seeder's header
    and 1 MiB block): the bytes arrive as the join would, each frame still one Noise message, and
    the stream's byte count is the bytes, not the number of parts."""
    from node.counters import StreamBytes
    from node.wire import write_parts

    sizes = noise_message_sizes(monkeypatch)
    payload, got, sink = mib_sink()
    parts = [payload[:3], memoryview(payload)[3:70_000], bytearray(payload[70_000:70_001]), payload[70_001:]]
    async with connected_hosts("/test/parts/1", sink) as (a, b):
        stream = await a.open_stream(b.peer_id, "/test/parts/1")
        sent = StreamBytes.sent.get("/test/parts/1", 0)
        with trio.fail_after(30):
            await write_parts(stream, parts)
            assert await stream.read(1) == b"k"
        # The sink's b"k" counts too, under the same name, once its write returned (either side of here).
        assert StreamBytes.sent["/test/parts/1"] - sent - len(payload) in (0, 1)
    assert bytes(got) == payload
    assert_one_noise_message_per_full_frame(sizes, len(payload))
