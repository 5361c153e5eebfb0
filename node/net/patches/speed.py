"""Speed patches of py-libp2p 0.8.1: each removes a cost per byte, per message or per wake-up that
the library pays and we measured (``bench/shards.py``, ``bench/stream_buffer.py``, py-spy).

* :class:`BatchedWindowCredit`: Yamux sends a window update after nearly every read; credit the
  sender once half the window is consumed, as go-yamux does.
* :class:`QuickLocks`: the locks py-libp2p takes for every read and write (TCP stream, Yamux
  connection and stream, net stream) yield to the scheduler even when free; make a free one not.
* :class:`PeerRecordReuse`: pubsub signs our peer record for every RPC it sends and verifies the
  sender's for every one it receives; reuse both while they are unchanged.
* :class:`SeenMessagesSpawnNothing`: pubsub starts a task for every gossip message it receives,
  duplicates included; check its seen cache first.
* :class:`FewerYamuxPings`: every connection pings from both ends every 30 s to tune its window;
  every 2 minutes is enough.
* :class:`YamuxSettingsOnce`: py-libp2p reads its Yamux tuning from the environment on every
  frame; read it once.
* :class:`YamuxSends`: size Yamux data frames to one Noise message each (py-libp2p's are 17 bytes
  too large, so every full frame went out as two), and wait for send window on an event instead
  of polling it every 10 ms.
* :class:`ChunkedStreamBuffers`: a Yamux stream's received bytes were copied into a ``bytearray``
  and out of it twice; keep the frames as they came and join a read's bytes once.
* :class:`WholeFrameReads`: a frame's body was read in as many pieces as had arrived, each copied
  again; wait until it is all buffered and read it once.
* :class:`WholeNoiseMessages`: wake the connection's reader once a Noise message is all there
  (``SO_RCVLOWAT``), not for every TCP segment of it.
* :class:`MessageReads`: a secured connection copied each Noise message's rest three times through
  a ``BytesIO``, and Yamux armed a timer for every frame body; keep the message, take a body
  already decrypted at once.

All are process-wide, installed by :func:`node.net.patches.install_all`.
"""

from __future__ import annotations

import collections
import socket
from typing import NamedTuple

import trio

from ...wire import Gather
from .patch import Patch


class BatchedWindowCredit(Patch):
    """Send a Yamux window update once half the receive window is consumed (py-libp2p 0.8.1).

    py-libp2p's ``YamuxStream._auto_tune_and_send_window_update`` runs after every read and, unless
    ``PY_YAMUX_RELEASE_ON_READ=0``, credits the bytes just read at once (its "partial slack" branch
    does the same whenever any credit is owed): one WINDOW_UPDATE frame, i.e. one Noise message,
    one ``send`` and one wake-up of the peer's reader, per read. A length-prefixed frame costs two
    reads or more (header, then body as it trickles in), so a receiver sent more window updates than
    data frames: 43,336 updates against 22,873 data frames in one downloader of ``bench/shards.py
    swarm --n 8`` (cProfile), ~20 % of its CPU time. go-yamux (``sendWindowUpdate``) credits only
    once the owed delta reaches half the window (its hysteresis) and so do we; the auto-tuning of
    the window (doubling within 4 RTTs, up to 16 MiB) is py-libp2p's, unchanged.
    """

    @classmethod
    def _patch(cls) -> None:
        from libp2p.stream_muxer.yamux.yamux import YamuxStream

        async def credit(self, *, bytes_read: int = 0) -> None:
            increment = 0
            async with self.window_lock:
                buffered = len(self.conn.stream_buffers.get(self.stream_id, b""))
                owed = self.target_recv_window - (self.recv_window + buffered)
                if owed > 0 and owed >= self._grow_threshold():
                    increment = self._grow_to_delta(buffered) + self._apply_autotune_epoch(buffered)
                    self._pending_recv_release = 0
            if increment > 0:
                await self.send_window_update(increment, skip_lock=True)

        YamuxStream._auto_tune_and_send_window_update = credit


class QuickLockStatistics(NamedTuple):
    locked: bool
    tasks_waiting: int


class QuickLock:
    """A lock whose acquire does not yield when the lock is free, and costs a flag test.

    trio's ``acquire`` is a full checkpoint: a free lock still costs one pass through the scheduler
    (``cancel_shielded_checkpoint``). py-libp2p takes about eleven of them per Noise message moved
    (``bench/shards.py overhead``: 75,800 acquisitions for 7,060 messages), and each pass is one
    more wake-up of the task. Wrapping ``trio.Lock``'s ``acquire_nowait`` removed the passes but
    still paid its owner bookkeeping (``current_task()``, a parking-lot breaker) on every take:
    ~4 % of the event loop's samples in ``overhead``. Here a free lock is a flag; a held one, or one
    with waiters, parks its caller in a ``ParkingLot`` and ``release`` hands the lock to the first
    parked task, first come first served, as trio does. There is no owner: py-libp2p's
    ``ReadWriteLock`` uses one of these as a semaphore of one that another task releases. What is
    lost is only the checkpoint's promise that the caller yields: every path that takes these locks
    goes on to a send, a receive or a wait, which yields unless its data is already there (a reader
    draining a stream's buffer then runs until the buffer is empty, as with any buffered read).
    """

    __slots__ = ("_held", "_lot")

    def __init__(self, lock=None) -> None:  # ``lock``: the trio lock or semaphore of one it replaces
        if lock is not None and (lock.locked() if isinstance(lock, trio.Lock) else lock.value == 0):
            raise RuntimeError("a QuickLock replaces a free lock only")
        self._held = False
        self._lot = trio.lowlevel.ParkingLot()

    async def acquire(self) -> None:
        if self._held or self._lot:
            await self._lot.park()  # woken holding it: release() hands it over
        else:
            self._held = True

    def release(self) -> None:
        if not self._held:
            raise RuntimeError("release of a QuickLock that is not held")
        if self._lot:
            self._lot.unpark()  # still held, now by the first waiter
        else:
            self._held = False

    def locked(self) -> bool:
        return self._held

    def statistics(self) -> QuickLockStatistics:
        return QuickLockStatistics(self._held, len(self._lot))

    async def __aenter__(self) -> None:
        await self.acquire()

    async def __aexit__(self, *exc) -> None:
        self.release()


class QuickLocks(Patch):
    """Swap the per-message locks of py-libp2p 0.8.1 for :class:`QuickLock` (or a semaphore of one
    wrapped the same way), by wrapping the constructors that make them.

    Counted per Noise message in ``bench/shards.py overhead``: the TCP stream's read and write
    locks, the Yamux connection's write lock and stream table lock, each stream's window lock and
    the read-write lock its writers take, and the net stream's state lock. Taken ~75,800 times to
    move 256 MiB; every other lock py-libp2p has is left as it is.
    """

    LOCKS = {
        ("libp2p.io.trio", "TrioTCPStream"): ("read_lock", "write_lock"),
        ("libp2p.stream_muxer.yamux.yamux", "Yamux"): ("_write_lock", "streams_lock"),
        ("libp2p.stream_muxer.yamux.yamux", "YamuxStream"): ("window_lock",),
        ("libp2p.network.stream.net_stream", "NetStream"): ("_state_lock",),
        ("libp2p.stream_muxer.rw_lock", "ReadWriteLock"): ("_readers_lock", "_writer_lock"),
    }

    @classmethod
    def _patch(cls) -> None:
        import importlib

        for (module, name), attrs in cls.LOCKS.items():
            klass = getattr(importlib.import_module(module), name)
            klass.__init__ = cls._wrap(klass.__init__, attrs)

    @staticmethod
    def _wrap(init, attrs: tuple[str, ...]):
        def quick_init(self, *args, **kwargs) -> None:
            init(self, *args, **kwargs)
            for attr in attrs:
                setattr(self, attr, QuickLock(getattr(self, attr)))

        return quick_init


class PeerRecordReuse(Patch):
    """Build our pubsub peer record once per 30 s, and verify each peer's once a minute while unchanged.

    py-libp2p 0.8.1 attaches our signed peer record to every pubsub RPC it sends and re-verifies the
    sender's on every RPC it receives (twice for gossipsub control messages). Building ours parses
    every listen address into a multiaddr (``host.get_addrs()``); checking theirs is one Ed25519
    verification and a peerstore update. For an idle relay at N=25 (``py-spy --gil``) that was 14 %
    of its CPU, for about twelve small RPCs a second. Now the record we send is rebuilt at most every
    :attr:`SEND_TTL` seconds (a peer's py-libp2p may learn of a change of our addresses that much
    later; our own membership records carry the addresses we dial by, and are republished at once),
    and a record received again byte for byte from the same peer within :attr:`VERIFY_TTL` seconds
    of verifying it is accepted without a second verification. Different bytes, or a record whose
    verification failed, go through py-libp2p's check as before, so a forged record is refused as it
    was. Re-consumed once per :attr:`VERIFY_TTL`, far inside the peerstore's 2 h TTL for it.
    """

    SEND_TTL = 30.0
    VERIFY_TTL = 60.0
    MAX_VERIFIED = 4096  # peers remembered per host; the oldest is forgotten first
    MODULES = ("libp2p.pubsub.pubsub", "libp2p.pubsub.gossipsub", "libp2p.pubsub.floodsub")

    @classmethod
    def _patch(cls) -> None:
        import importlib

        from libp2p.peer import peerstore
        from libp2p.pubsub import utils

        build, consume = peerstore.env_to_send_in_RPC, utils.maybe_consume_signed_record

        def env_to_send_in_RPC(host):
            now = trio.current_time()
            cached = host.__dict__.get("_record_to_send")
            if cached is None or now >= cached[1]:
                cached = (build(host), now + cls.SEND_TTL)
                host.__dict__["_record_to_send"] = cached
            return cached[0]

        def maybe_consume_signed_record(msg, host, peer_id) -> bool:
            if not msg.HasField("senderRecord"):
                return True
            record, now = msg.senderRecord, trio.current_time()
            verified = host.__dict__.setdefault("_records_verified", {})
            seen = verified.get(peer_id)
            if seen is not None and seen[0] == record and now < seen[1]:
                return True
            if not consume(msg, host, peer_id):
                return False
            verified.pop(peer_id, None)  # re-inserted last: the dict's order is oldest first
            if len(verified) >= cls.MAX_VERIFIED:
                verified.pop(next(iter(verified)))
            verified[peer_id] = (record, now + cls.VERIFY_TTL)
            return True

        for name in cls.MODULES:
            module = importlib.import_module(name)
            module.env_to_send_in_RPC = env_to_send_in_RPC
            module.maybe_consume_signed_record = maybe_consume_signed_record


class SeenMessagesSpawnNothing(Patch):
    """Drop a gossip message already seen before a task is made for it (py-libp2p 0.8.1).

    ``Pubsub.continuously_read_stream`` starts one service task per message received
    (``manager.run_task(self.push_msg, ...)``), and ``run_task`` finds the new task's parent by
    walking the whole task tree of the pubsub service. With a mesh of 9, eight of every nine
    copies of a message are duplicates that ``push_msg`` then drops at its seen-cache check. That
    check now runs before the task is made; what happens to each message is unchanged
    (``push_msg``'s earlier checks, the blacklists, also only drop it).
    """

    @classmethod
    def _patch(cls) -> None:
        from libp2p.pubsub.pubsub import Pubsub
        from libp2p.tools.anyio_service.trio_manager import TrioManager

        run_task, push_msg = TrioManager.run_task, Pubsub.push_msg

        def run_task_unless_seen(self, async_fn, *args, **kwargs) -> None:
            # pubsub calls run_task(self.push_msg, forwarder, msg)
            if getattr(async_fn, "__func__", None) is push_msg and async_fn.__self__._is_msg_seen(args[1]):
                return
            run_task(self, async_fn, *args, **kwargs)

        TrioManager.run_task = run_task_unless_seen


class FewerYamuxPings(Patch):
    """Measure a Yamux connection's round trip every 2 minutes instead of every 30 s.

    py-libp2p 0.8.1 pings every connection every ``RTT_MEASURE_INTERVAL`` seconds from each end,
    for its window auto-tuning: with ~20 connections, a ping and a pong sent and received every
    second or so by an idle node, each a Noise message and a wake-up. The first measurement, half a
    second after a connection opens, is kept, so a new connection's window tunes as before. The
    pings are not needed to keep idle connections alive: membership probes each connected member
    (one per second, round robin) and gossipsub's mesh carries records.
    """

    INTERVAL = 120.0

    @classmethod
    def _patch(cls) -> None:
        from libp2p.stream_muxer.yamux import yamux

        yamux.RTT_MEASURE_INTERVAL = cls.INTERVAL  # read by _measure_rtt_loop on every round


class YamuxSettingsOnce(Patch):
    """Read py-libp2p's ``PY_YAMUX_*`` tuning variables once per process, not on every frame.

    py-libp2p 0.8.1 looks up its Yamux tuning in ``os.environ`` each time it needs one: the data
    read timeout for every DATA frame received, the window-credit threshold for every read, the
    debug switch on every write (~19,000 look-ups, each a str encode and a dict probe, to move
    256 MiB). The variables are for its own perf harness; we never change them while running, so
    each function's first answer is kept.
    """

    FUNCTIONS = ("_py_yamux_env", "_py_yamux_env_set", "_perf_yamux_debug_enabled", "_yamux_disable_hysteresis",
                 "_yamux_release_on_read", "_yamux_batch_threshold_divisor", "_yamux_data_read_timeout")

    @classmethod
    def _patch(cls) -> None:
        import functools

        from libp2p.stream_muxer.yamux import yamux

        for name in cls.FUNCTIONS:  # each is looked up as a module global at every call
            setattr(yamux, name, functools.cache(getattr(yamux, name)))


class YamuxSends(Patch):
    """Two costs of ``YamuxStream.write`` in py-libp2p 0.8.1, per byte and per wake-up.

    * A data frame carries up to 65,524 bytes (64 KiB with its 12-byte header), but a Noise
      message's plaintext is at most 65,519 bytes, so Noise split every full frame into a message
      of 65,519 bytes and one of 17: twice the encryptions, sends, and reads and wake-ups at the
      peer for bulk data. Here a frame's body is at most 65,507 bytes (header included, one Noise
      message).
    * While the peer's window is used up (the normal state of a sender whose peer reads slower than
      it writes, i.e. every upload through a slow link), the write looped on ``trio.sleep(0.01)``:
      100 wake-ups a second per blocked stream, doing nothing. Here ``send_window`` and ``closed``
      are watched attributes and the write waits on an event they set when the window grows or the
      stream closes. py-libp2p's error after 5 s without a window update is kept.
    * Each frame's body was sliced from the written bytes (a copy) and then joined to its header (a
      second copy); it is sliced from a memoryview here, so only the join copies it.
    """

    @classmethod
    def _patch(cls) -> None:
        import struct

        from libp2p.security.noise.io import MAX_PLAINTEXT_LENGTH
        from libp2p.stream_muxer.exceptions import MuxedStreamError
        from libp2p.stream_muxer.yamux import yamux as Y

        frame_body = MAX_PLAINTEXT_LENGTH - Y.HEADER_SIZE

        def watched(name: str) -> property:
            key = "_watched_" + name

            def get(self):
                return self.__dict__[key]

            def set_(self, value) -> None:
                old = self.__dict__.get(key)
                self.__dict__[key] = value
                if old is not None and value > old:  # the window grew, or closed went True
                    grew = self.__dict__.get("_window_grew")
                    if grew is not None:
                        grew.set()

            return property(get, set_)

        Y.YamuxStream.send_window = watched("send_window")
        Y.YamuxStream.closed = watched("closed")

        async def write(self, data: bytes | Gather) -> None:
            if self.send_closed:
                raise MuxedStreamError("Stream is closed for sending")
            # Frame bodies are sliced from the parts as views (only the join with a header copies them).
            body = _Slices(data if isinstance(data, Gather) else (data,))
            total, sent = body.nbytes, 0
            while sent < total:
                frame = None
                while frame is None:
                    await self.rw_lock.acquire_write()  # writers of this stream, one frame each in turn
                    try:
                        if self.send_closed:
                            raise MuxedStreamError("Stream is closed for sending")
                        async with self.window_lock:
                            if self.closed:
                                raise MuxedStreamError("Stream is closed")
                            if self.send_window > 0:
                                n = min(self.send_window, frame_body, total - sent)
                                self.send_window -= n
                                frame = b"".join((struct.pack(Y.YAMUX_HEADER_FORMAT, 0, Y.TYPE_DATA, 0,
                                                              self.stream_id, n), *body.take(n)))
                    finally:
                        self.rw_lock.release_write()
                    if frame is None:
                        grew = self.__dict__["_window_grew"] = trio.Event()
                        if self.send_window > 0 or self.closed:  # changed before the event was in place
                            continue
                        with trio.move_on_after(5.0) as waited:
                            await grew.wait()
                        if waited.cancelled_caught:
                            raise MuxedStreamError("Timed out waiting for window update after 5 seconds.")
                await self.conn._write_frame(frame)
                sent += n

        Y.YamuxStream.write = write
        Y.YamuxStream.writes_gather = True  # node.wire.write_parts


class _Slices:
    """Consecutive byte ranges of a sequence of buffers, taken front to back as views (no copy)."""

    __slots__ = ("_parts", "_i", "_at", "nbytes")

    def __init__(self, parts) -> None:
        self._parts = [view for view in (memoryview(p).cast("B") for p in parts) if len(view)]
        self._i = self._at = 0
        self.nbytes = sum(len(view) for view in self._parts)

    def take(self, n: int) -> list[memoryview]:
        """The next ``n`` bytes (at most what is left), as views of the parts they lie in."""
        out = []
        while n and self._i < len(self._parts):
            part, at = self._parts[self._i], self._at
            k = min(n, len(part) - at)
            out.append(part[at:at + k])
            n -= k
            if at + k == len(part):
                self._i, self._at = self._i + 1, 0
            else:
                self._at = at + k
        return out


SMALL_CHUNK = 4096  # (StreamChunks) frame bodies below this are gathered, not kept one object each


class StreamChunks:
    """A Yamux stream's received bytes, kept as the frame bodies they came in (``ChunkedStreamBuffers``).

    Stands in for the ``bytearray`` py-libp2p 0.8.1 keeps per stream, with the few operations its
    Yamux code uses on it: ``extend``, ``len``, ``clear``, ``bytes(b)`` and ``bytes(b[:n])`` followed by
    ``del b[:n]``. A read's bytes are joined from the chunks once; a chunk taken in part stays
    behind as a view of its rest, not a copy. Bodies under ``SMALL_CHUNK`` are copied into a
    trailing bytearray instead of kept one object each, so tiny frames cannot multiply the memory
    a stream's window allows (a 1-byte ``bytes`` object costs 34 bytes, plus its slot).
    """

    __slots__ = ("_chunks", "_size")

    def __init__(self, data: bytes | bytearray = b"") -> None:
        self._chunks: collections.deque[bytes | bytearray | memoryview] = collections.deque()
        self._size = 0
        self.extend(data)

    def __len__(self) -> int:
        return self._size

    def extend(self, data: bytes | bytearray | memoryview) -> None:
        n = len(data)
        if not n:
            return
        self._size += n
        chunks = self._chunks
        if n < SMALL_CHUNK:
            # A peer may send 1-byte frames: kept one object each, the window's bytes would cost ~40
            # times their size in memory. Small bodies are copied into a trailing bytearray of ours.
            if chunks and type(chunks[-1]) is bytearray and len(chunks[-1]) < SMALL_CHUNK:
                chunks[-1] += data
            else:
                chunks.append(bytearray(data))
        else:
            # Only an immutable bytes object is kept as it is: a view or bytearray may be reused.
            chunks.append(data if type(data) is bytes else bytes(data))

    def clear(self) -> None:
        self._chunks.clear()
        self._size = 0

    def __bytes__(self) -> bytes:
        return self._front(self._size)

    def __getitem__(self, key: slice) -> bytes:
        """``b[:n]``: the first ``n`` bytes (left in place, as one chunk, for the ``del b[:n]`` that follows)."""
        return self._front(self._prefix(key))

    def __delitem__(self, key: slice) -> None:
        n = min(self._prefix(key), self._size)
        self._size -= n
        chunks = self._chunks
        while n:
            first = chunks[0]
            if len(first) <= n:
                chunks.popleft()
                n -= len(first)
            else:
                chunks[0] = memoryview(first)[n:]
                n = 0

    @staticmethod
    def _prefix(key: slice) -> int:
        if not (isinstance(key, slice) and key.start in (None, 0) and key.step is None and isinstance(key.stop, int)
                and key.stop >= 0):
            raise TypeError(f"StreamChunks supports b[:n] only, not {key!r}")  # a new py-libp2p use: our bug
        return key.stop

    def _front(self, n: int) -> bytes:
        """Make the first chunk hold exactly the first ``n`` bytes (at most all of them); return it."""
        n = min(n, self._size)
        chunks = self._chunks
        if not n:
            return b""
        first = chunks[0]
        if len(first) >= n:
            if len(first) == n and type(first) is bytes:
                return first
            view = memoryview(first)
            head = bytes(view[:n])
            if len(first) == n:
                chunks[0] = head
            else:
                chunks[0] = view[n:]
                chunks.appendleft(head)
            return head
        parts, got = [], 0
        while got < n:
            chunk = chunks.popleft()
            if got + len(chunk) > n:
                view, k = memoryview(chunk), n - got
                parts.append(view[:k])
                chunks.appendleft(view[k:])
                got = n
            else:
                parts.append(chunk)
                got += len(chunk)
        head = b"".join(parts)
        chunks.appendleft(head)
        return head


class _StreamChunksTable(dict):
    """``Yamux.stream_buffers``: every buffer stored in it becomes a :class:`StreamChunks`."""

    def __setitem__(self, stream_id: int, buffer) -> None:
        super().__setitem__(stream_id, buffer if isinstance(buffer, StreamChunks) else StreamChunks(buffer))


class ChunkedStreamBuffers(Patch):
    """Keep each Yamux stream's received bytes as the frames they came in (py-libp2p 0.8.1).

    py-libp2p appends every DATA frame's body to a per-stream ``bytearray`` (a copy) and serves a
    read of ``n`` bytes as ``bytes(buffer[:n])`` (two more: the slice, then the bytes) before
    ``del buffer[:n]``. Worse, a ``bytearray`` read from its front is copied whole whenever it must
    grow, and again when it falls below half its allocation: a downloader whose widened window
    (``widen_receive_window``) holds several MiB unread paid a copy of all of it every few frames
    (``bench/shards.py overhead``: ~10 % of the event loop's samples on the ``extend`` line alone;
    ``bench/stream_buffer.py``: 0.70 ms of CPU per MiB with 7 MiB unread, 0.07-0.09 here).
    Here the frames stay as received and a read joins its bytes once (:class:`StreamChunks`).
    """

    @classmethod
    def _patch(cls) -> None:
        from libp2p.stream_muxer.yamux.yamux import Yamux

        init = Yamux.__init__

        def chunked_init(self, *args, **kwargs) -> None:
            init(self, *args, **kwargs)
            table = _StreamChunksTable()
            for stream_id, buffer in self.stream_buffers.items():  # dict(...) would skip __setitem__
                table[stream_id] = buffer
            self.stream_buffers = table

        Yamux.__init__ = chunked_init


class WholeFrameReads(Patch):
    """Let a reader wait until a whole length-prefixed frame is buffered (``YamuxStream.until_buffered``).

    ``node.wire.read_frame`` read a frame's body with reads of whatever had arrived, each a join of
    buffered Yamux frames and a wake-up of the reading task, then joined the parts again: a 1 MiB
    block that came in 16 Noise messages was read in several pieces and copied twice. Waiting for
    all of it first makes it one read and one join. The wait is only for bytes the peer may send
    without a window update (that comes after a read), and for a frame of at most half the
    stream's window, so the sender goes on sending the next frame meanwhile; a longer frame is
    read as before. Meanwhile the stream's event wakes the reader only once the frame is all
    there or the stream can bring no more (:class:`_WakeWhenBuffered`), not for every Noise message.
    """

    @classmethod
    def _patch(cls) -> None:
        from libp2p.stream_muxer.yamux.yamux import YamuxStream

        async def until_buffered(self, n: int) -> None:
            conn, sid = self.conn, self.stream_id
            if n > self.target_recv_window // 2 or _WakeWhenBuffered.reached(self, n) or sid not in conn.stream_events:
                return
            waiter = conn.stream_events[sid] = _WakeWhenBuffered(self, n)
            try:
                await waiter.wait()
            finally:
                if conn.stream_events.get(sid) is waiter:
                    conn.stream_events[sid] = trio.Event()  # as py-libp2p's own read does after a wake-up

        YamuxStream.until_buffered = until_buffered


class _WakeWhenBuffered:
    """Stands in for a Yamux stream's ``trio.Event`` while :class:`WholeFrameReads` waits for ``n``
    bytes: py-libp2p sets the event for every frame that arrives and after every change of the
    stream's state (it changes the state first, in every path of 0.8.1), and the set is passed on
    only once the bytes are there or can no longer all come."""

    __slots__ = ("stream", "n", "event")

    def __init__(self, stream, n: int) -> None:
        self.stream, self.n, self.event = stream, n, trio.Event()

    @staticmethod
    def reached(stream, n: int) -> bool:
        """Is the wait for ``n`` buffered bytes over: they are there, or they can no longer all come
        without a read (a window update), or the stream or connection ended (the read says how)?"""
        conn = stream.conn
        buffer = conn.stream_buffers.get(stream.stream_id)
        return (buffer is None or len(buffer) >= n or len(buffer) + stream.recv_window < n or stream.recv_closed
                or stream.reset_received or stream.closed or conn.event_shutting_down.is_set())

    def set(self) -> None:
        if self.reached(self.stream, self.n):
            self.event.set()

    def is_set(self) -> bool:
        return self.event.is_set()

    async def wait(self) -> None:
        await self.event.wait()


# The largest SO_RCVLOWAT asked for: a whole Noise message (2-byte length, so at most 65535 bytes).
# Linux grows the socket's receive buffer to twice the low-water mark when needed (tcp_set_rcvlowat).
MAX_RCVLOWAT = 65535
# Bytes asked of the socket per read: whatever is there, up to four full Noise messages, so one
# recv (and one trio wake-up) can bring in several messages on a fast link.
READ_AHEAD = 4 * 65537


def _tcp_socket(conn):
    """The TCP socket under a py-libp2p raw connection (RawConnection -> TrioTCPStream ->
    trio.SocketStream), or None for any other (a relayed circuit rides on a libp2p stream)."""
    inner = getattr(getattr(conn, "stream", None), "stream", None)
    return inner.socket if isinstance(inner, trio.SocketStream) else None


def _set_mark(sock, n: int) -> bool:
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, n)
        return True
    except OSError:  # closed meanwhile: the read that follows fails or ends as before
        return False


async def fill_noise_message(conn, sock, ahead: bytearray, need: int) -> None:
    """Read from ``conn`` until ``ahead`` holds ``need`` bytes (a Noise message's prefix, or all of
    it), with ``sock``'s SO_RCVLOWAT set before each read to what is still missing: never more,
    or the read waits for bytes the peer will not send before we answer (WholeNoiseMessages)."""
    mark = 1
    try:
        while len(ahead) < need:
            want = min(need - len(ahead), MAX_RCVLOWAT)
            # A prefix, or the last byte or two of a body, come in one segment: no mark for them,
            # but one left from a partial read of this body must come down to 1.
            target = want if want > 2 else 1
            if target != mark and _set_mark(sock, target):
                mark = target
            chunk = await conn.read(max(READ_AHEAD, need - len(ahead)))
            if not chunk:
                from libp2p.io.exceptions import IncompleteReadError

                raise IncompleteReadError(f"connection closed with {need - len(ahead)} bytes of a "
                                          "Noise message missing")
            ahead += chunk
    finally:
        if mark != 1:
            _set_mark(sock, 1)


class WholeNoiseMessages(Patch):
    """Read each Noise message's body with ``SO_RCVLOWAT`` set to its length (py-libp2p 0.8.1).

    py-libp2p reads a Noise message (up to 64 KiB, one Yamux frame) with ``read_exactly``: one
    ``recv`` and one trio wake-up per batch of TCP segments that happens to be there. On a fast
    link that is a few per message; on a slow one bytes trickle in a segment at a time (1448 bytes
    every 1.2 ms at 10 Mbit/s), ~45 wake-ups per 64 KiB message, each a full pass through trio's
    scheduler. A plain stream cost 6x the CPU per MiB through a 10 Mbit/s link that it costs on
    loopback (``bench/shards.py swarm`` prints both). The body's length is known once its 2-byte
    prefix is read, and nothing can be done with part of it (it is decrypted whole), so asking
    the kernel to wake us only when it has the rest (or EOF, or an error) loses nothing. The mark
    is the bytes still missing, set before each read of the body (a mark above what the peer will
    send before it waits for us would never fire), and goes back to 1 before the next prefix. Set
    only after a first read, it let that read wake at the body's first segment: three wake-ups a
    message, not two (a plain stream through a 10 Mbit/s link: 0.031 -> 0.023 CPU-s per MiB).
    Linux only (elsewhere the option is missing and reads go as before).
    """

    @classmethod
    def _patch(cls) -> None:
        from libp2p.io.utils import read_exactly
        from libp2p.security.noise.io import NoisePacketReadWriter

        option = getattr(socket, "SO_RCVLOWAT", None)

        async def read_msg(self) -> bytes:
            conn = self.read_write_closer
            sock = _tcp_socket(conn) if option is not None else None
            if sock is None:
                return await read_exactly(conn, await self.next_msg_len())
            # On the connection, not on this reader: the handshake's reader and the transport's
            # are two objects over one connection, and bytes read ahead by one belong to the other.
            ahead = conn.__dict__.setdefault("_noise_read_ahead", bytearray())
            if len(ahead) < 2:
                await fill_noise_message(conn, sock, ahead, 2)
            end = 2 + int.from_bytes(ahead[:2], "big")
            if len(ahead) < end:
                await fill_noise_message(conn, sock, ahead, end)
            msg = bytes(ahead[2:end])
            del ahead[:end]
            return msg

        NoisePacketReadWriter.read_msg = read_msg


class MessageReads(Patch):
    """Serve reads of a secured connection from the Noise message last decrypted, without copying it
    into a ``BytesIO`` (py-libp2p 0.8.1), and read a Yamux frame's body from it without a timer.

    ``SecureSession`` kept the rest of a message by slicing it (a copy), writing that into a fresh
    ``BytesIO`` (a second) and serving reads with ``getbuffer()[..].tobytes()`` (a third). Yamux
    reads a frame's 12-byte header, then its body: one frame is one Noise message
    (:class:`YamuxSends`), so every data frame paid all three for its body. Here the message is
    kept as it came and a read of the rest of it is one slice.

    ``Yamux._read_data_body`` also armed a ``fail_after`` deadline around every body read (a cancel
    scope and a deadline registered and removed: ~4 % of the event loop in ``bench/shards.py
    overhead``). The deadline guards a peer that sends a header and then holds the body back; a
    body already decrypted cannot be held back, so it is taken at once and only a body still to
    come (a peer whose frames span Noise messages) goes through py-libp2p's read and its deadline.
    """

    @classmethod
    def _patch(cls) -> None:
        from libp2p.io.exceptions import ConnectionClosedError
        from libp2p.security.secure_session import SecureSession
        from libp2p.stream_muxer.yamux.yamux import Yamux

        def reset(self) -> None:
            self._msg, self._at = b"", 0

        def drain(self, n: int | None) -> bytes:
            msg, at = self._msg, self._at
            left = len(msg) - at
            if left <= 0:
                return b""
            take = left if n is None or n >= left else n
            out = msg if take == len(msg) else msg[at:at + take]
            if take == left:
                self._msg, self._at = b"", 0
            else:
                self._at = at + take
            return out

        def fill(self, msg: bytes) -> None:
            self._msg, self._at = msg, 0

        async def read(self, n: int | None = None) -> bytes:
            if n == 0:
                return b""
            out = drain(self, n)
            if out and (n is None or len(out) == n):
                return out
            if n is None:
                msg = await self.conn.read_msg()
                if msg == b"":
                    raise ConnectionClosedError("Connection closed")
                return msg
            parts, have = ([out] if out else []), len(out)
            while have < n:
                msg = await self.conn.read_msg()
                if msg == b"":  # closed: what was assembled, as py-libp2p does
                    if parts:
                        return b"".join(parts)
                    raise ConnectionClosedError("Connection closed")
                fill(self, msg)
                part = drain(self, n - have)
                parts.append(part)
                have += len(part)
            return parts[0] if len(parts) == 1 else b"".join(parts)

        read_body = Yamux._read_data_body

        async def read_data_body(self, length: int) -> bytes:
            conn = self.secured_conn
            # A body taken here is at most one Noise message (< 64 KiB), below every window, so this
            # skips no check of KeptReceiveWindow's bound (which wraps the same method) whichever
            # patch is installed first; a longer body goes through it.
            if isinstance(conn, SecureSession) and len(conn._msg) - conn._at >= length:
                return drain(conn, length)
            return await read_body(self, length)

        SecureSession._reset_internal_buffer = reset
        SecureSession._drain = drain
        SecureSession._fill = fill
        SecureSession.read = read
        Yamux._read_data_body = read_data_body
