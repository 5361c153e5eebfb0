"""The serving side of ``/swarm/shards/1.0.0``: one :class:`ServerSession` per peer downloading from us.

How this works
--------------
The shards service (node/shards/service.py) hands each inbound ``Hello`` for a version we hold,
complete or still downloading, to a session. The session sends our bitfield, then answers the
peer's requests from the :class:`VersionStore`: a piece is served as soon as it is verified, and
``Have`` is pushed to every open session at once (:meth:`ServerSession.push_have`), so a checkpoint
flows through relays like a pipeline. A session's one writer task sends its Haves, joined with the
next block in one stream write while the peer is downloading from us (alone when it is not): a
task, a lock and a Yamux/Noise write per session per piece were the largest CPU cost of our own
in a downloader (issue 16). Requests queue per session (bounded by
MAX_QUEUED_REQUESTS) and are served under the service's global cap (``max_serving``) and its
optional upload token bucket, both held by the :class:`Uploads` every session shares. For versions
we published, the version's :class:`SuperSeeder` decides which pieces this peer is shown
(:meth:`ServerSession.reveal`); the session reports what it decides to the service, which it sees
only as a :class:`SessionOwner` (node/shards/session_api.py).
"""

from __future__ import annotations

import logging
from collections import deque

import trio

from ..net.budget import StreamLimits
from ..wire import Message, RemoteProtocolError, decode, frame_parts, write_frame, write_parts
from .protocol import (
    BAD_RANGE,
    BUSY,
    MAX_BITFIELD,
    NOT_HELD,
    Bitfield,
    Cancel,
    Data,
    Hello,
    Have,
    Reject,
    Request,
    read_shards_message,
)
from .session_api import SessionOwner
from .store import VersionStore, bitfield_of, pieces_of
from .superseed import SuperSeeder
from .throttle import TokenBucket

log = logging.getLogger("node.shards.service")  # the sessions log as part of the service

# A Have with no block going to its peer waits this long for others to share its write: at N peers
# every verified piece is a Have to each, and alone each is a Yamux frame, a Noise message and a
# wake-up at the receiver. At ~8 pieces a second per downloader (32 MiB, 128 KiB pieces, 10 Mbit/s)
# that halves them; a piece is shown at most this much later.
HAVE_DELAY = 0.2
# Blocks queued by one peer go out together, up to this many bytes per write: a block alone ends in
# a Noise message of a few bytes (a 128 KiB block and its framing are 60 bytes more than two full
# messages), and each message costs an encryption, a send, and a read and wake-up at the peer.
SEND_BATCH = 512 * 1024
MAX_QUEUED_REQUESTS = 128  # per session; more is a flood (our own picker asks for <= 32)
# What a downloader sends us is small: the largest is a Hello with a whole bitfield.
MAX_INBOUND_FRAME = MAX_BITFIELD + 1024
# Inbound shards streams (node/net/budget.py): a downloader holds one session per version it
# fetches from us plus short manifest requests, so 16 per peer is plenty; 256 in all.
SERVER_LIMITS = StreamLimits(streams=256, streams_per_peer=16, frame_cap=MAX_INBOUND_FRAME,
                             buffer_bytes=64 * MAX_INBOUND_FRAME, buffer_per_peer=8 * MAX_INBOUND_FRAME)


class Uploads:
    """What every serving session shares: at most ``slots`` of them write at once, at the rate of
    the token bucket (the ``[shards]`` upload_rate; 0 = unlimited), and the bytes served are counted."""

    def __init__(self, slots: int, bucket: TokenBucket, served) -> None:
        self.slots = trio.Semaphore(slots)
        self.bucket = bucket
        self.served = served  # a metrics counter (node/metrics.py): inc(nbytes)

    async def pace(self, nbytes: int) -> None:
        """Wait until the bucket allows ``nbytes`` more to be sent (called holding a slot)."""
        wait = self.bucket.delay(nbytes, trio.current_time())
        if wait > 0:
            await trio.sleep(wait)


class ServerSession:
    """One inbound transfer session: a peer downloading a version from us. ``seeder`` is the
    version's super-seeder when we published it; ``uploads`` the limits shared by every session."""

    def __init__(self, owner: SessionOwner, stream, peer: str, vs: VersionStore, uploads: Uploads, *,
                 seeder: SuperSeeder | None = None, frames=None) -> None:
        self.owner, self.stream, self.peer, self.vs = owner, stream, peer, vs
        self.uploads = uploads
        self.frames = frames  # the stream's budgeted reader (node/net/reqres.py Frames); None: unbudgeted
        self.lock = trio.Lock()
        self.queue: deque[Request] = deque()
        self.wakeup = trio.Event()
        self.haves: list[int] = []  # verified since the bitfield, not yet told (see push_have)
        self.haves_due = 0.0  # when the oldest of them must go out, with or without a block
        self.seeder = seeder
        self.shown: set[int] = set()  # pieces advertised to this peer (super-seeding)
        self.written: dict[int, dict[int, int]] = {}  # super-seeding: piece -> {offset: length} written
        self.bitfield_sent = False

    def visible(self) -> set[int]:
        if self.seeder is None:
            return set(self.vs.verified)
        return self.shown

    def may_serve(self, piece: int) -> bool:
        return piece in self.vs.verified and (self.seeder is None or piece in self.shown)

    async def run(self, hello: Hello) -> None:
        n = self.vs.manifest.num_pieces
        later: list[tuple[str, int]] = []
        if self.seeder is not None:
            for peer, piece in self.seeder.on_bitfield(self.peer, pieces_of(hello.bitfield, n), trio.current_time()):
                if peer == self.peer:
                    self.shown.add(piece)  # goes out in the bitfield below
                else:
                    later.append((peer, piece))
        async with self.lock:  # reveals routed meanwhile wait, then go out as Have after this
            await write_frame(self.stream, Bitfield(bitfield=bitfield_of(self.visible(), n),
                                                    wants_haves=self.seeder is not None))
            self.bitfield_sent = True
        self.owner.route_reveals(self.vs.signed.root, later)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._serve_queue)
            if self.seeder is not None:
                nursery.start_soon(self._reveal_stalled)
            try:
                await self._read_loop()
            finally:
                nursery.cancel_scope.cancel()

    async def _next_message(self) -> Message | None:
        """The downloader's next message: a session may rest between them (no header deadline),
        but a frame once announced must arrive at the minimum rate and fit the byte budget."""
        if self.frames is None:
            return await read_shards_message(self.stream)
        data = await self.frames.read(strict=False, idle=None)
        return None if data is None else decode(data, MAX_INBOUND_FRAME)

    async def _read_loop(self) -> None:
        while True:
            msg = await self._next_message()
            if msg is None:
                return
            if isinstance(msg, Request):
                if len(self.queue) >= MAX_QUEUED_REQUESTS:
                    await self._send(Reject(piece=msg.piece, offset=msg.offset, reason=BUSY))
                    continue
                self.queue.append(msg)
                self.wakeup.set()
            elif isinstance(msg, Cancel):
                try:
                    self.queue.remove(Request(piece=msg.piece, offset=msg.offset, length=msg.length))
                except ValueError:
                    pass  # already sent: the cancel raced the data
            elif isinstance(msg, Have):
                if self.seeder is not None and msg.piece < self.vs.manifest.num_pieces:
                    log.debug("shards: %s has piece %d", self.peer[-8:], msg.piece)
                    reveals = self.seeder.on_have(self.peer, msg.piece, trio.current_time())
                    self.owner.route_reveals(self.vs.signed.root, reveals)
            else:
                raise RemoteProtocolError("unexpected", msg.TYPE)

    async def reveal(self, piece: int) -> None:
        """Super-seeding: show this peer one more piece."""
        async with self.lock:
            if piece in self.shown:
                return
            self.shown.add(piece)
            if self.bitfield_sent:  # else it goes out in the bitfield
                await write_frame(self.stream, Have(piece=piece))

    def _note_written(self, data: Data) -> None:
        """Super-seeding: once every byte of a revealed piece is written, the next may be revealed."""
        if self.seeder is None or data.piece not in self.shown:
            return
        blocks = self.written.setdefault(data.piece, {})
        blocks[data.offset] = len(data.data)
        if sum(blocks.values()) >= self.vs.manifest.piece_length(data.piece):
            del self.written[data.piece]
            log.debug("shards: wrote piece %d to %s", data.piece, self.peer[-8:])
            self.owner.route_reveals(self.vs.signed.root, self.seeder.on_sent(self.peer, data.piece, trio.current_time()))

    async def _reveal_stalled(self) -> None:
        """Super-seeding: pieces stuck at a slow first recipient are shown again after a while."""
        while True:
            await trio.sleep(self.seeder.stall_seconds / 4)
            self.owner.route_reveals(self.vs.signed.root, self.seeder.reveal(trio.current_time()))

    def push_have(self, piece: int) -> None:
        """We verified ``piece`` (a download in progress): the writer tells this peer with the next
        block it sends it, or within HAVE_DELAY if none goes. Queued even before the bitfield went
        out: it may have been read from the store before the piece verified, and a Have the
        bitfield already covered costs the peer nothing."""
        if self.seeder is None:
            if not self.haves:
                self.haves_due = trio.current_time() + HAVE_DELAY
                self.wakeup.set()  # the writer starts the clock
            self.haves.append(piece)

    async def _send(self, *msgs: Message) -> None:
        """Write the queued Haves and then ``msgs`` in one stream write."""
        queued = [Have(piece=p) for p in self.haves]
        self.haves.clear()
        frames = [part for m in (*queued, *msgs) for part in frame_parts(m)]
        if frames:
            async with self.lock:
                await write_parts(self.stream, frames)

    def _replies(self) -> list[Message]:
        """Answers to the requests at the head of the queue, up to SEND_BATCH bytes of blocks."""
        replies: list[Message] = []
        size = 0
        while self.queue and size < SEND_BATCH:
            req = self.queue.popleft()
            reply = self.reply_to(req) if self.may_serve(req.piece) else \
                Reject(piece=req.piece, offset=req.offset, reason=NOT_HELD)
            if reply is not None:
                replies.append(reply)
                size += len(reply.data) if isinstance(reply, Data) else 0
        return replies

    async def _serve_queue(self) -> None:
        uploads = self.uploads
        while True:
            while not self.queue:
                self.wakeup = trio.Event()
                if not self.haves:
                    await self.wakeup.wait()
                elif trio.current_time() >= self.haves_due:
                    await self._send()
                else:
                    with trio.move_on_at(self.haves_due):
                        await self.wakeup.wait()
            async with uploads.slots:
                replies = self._replies()
                blocks = [r for r in replies if isinstance(r, Data)]
                await uploads.pace(sum(len(b.data) for b in blocks))
                await self._send(*replies)
            for block in blocks:
                uploads.served.inc(len(block.data))
                self._note_written(block)

    def reply_to(self, req: Request) -> Message | None:
        """The answer to one request (tests subclass this to play a lying or silent peer)."""
        try:
            data = self.vs.read_block(req.piece, req.offset, req.length)
        except ValueError:
            return Reject(piece=req.piece, offset=req.offset, reason=BAD_RANGE)
        return Data(piece=req.piece, offset=req.offset, data=data)
