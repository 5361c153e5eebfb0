"""The downloading side of ``/swarm/shards/1.0.0``: one :class:`Download` per version we fetch.

How this works
--------------
A download opens a :class:`ClientSession` to every directly connected peer (up to ``max_peers``;
never over a relay circuit, whose bandwidth is the relay's and whose bytes it caps), and short of
that many direct peers it dials public members from membership's view (node/shards/peering.py
says why: a NAT'd node's direct peers are only those it dialled itself); it feeds
what they say (bitfields, haves, data, rejects) into the pure :class:`Picker`, sends the requests
and cancels the picker decides, assembles blocks in memory, hash-checks each piece, writes it to
the :class:`VersionStore` and tells everyone ``Have`` through the shards service (which serves it
onward at once). Peers the picker convicts of bad data are banned through the service. The download
sees the service only as a :class:`SessionOwner` (node/shards/session_api.py) and reports to it.

A complete piece of ``THREAD_WRITE_BYTES`` or more is joined, hashed and written in a worker
thread, one piece at a time, while the event loop goes on reading and serving: SHA-256 and
``pwrite`` release the GIL, and a ``pwrite`` the kernel makes wait (dirty-page throttling, a slow
disk, memory touched for the first time: 3 ms per MiB measured on this project's VMs, 25 times the
usual) no longer stops every transfer of the node. Smaller pieces are written in the event loop: a
hand-off to a thread and back costs 130-200 us of CPU here, more than hashing and writing a 128 KiB
piece (~90 us), and a stall grows with the bytes written. At most ``WRITE_QUEUE`` complete pieces
wait; a session whose piece would be one more stops reading until there is room, so a slow disk
slows the senders instead of filling memory.
"""

from __future__ import annotations

import logging
import math
import sys
from typing import Any

import trio

from ..hashes import digest
from ..net.host import widen_receive_window
from ..wire import TRANSPORT_FAILURES, LocalProtocolError, Message, RemoteProtocolError, frame_of, write_frame
from .config import ShardsConfig
from .peering import direct_addrs, session_to_end, sessions_to_open
from .picker import Actions, Picker, PickerParams
from .protocol import (
    BUSY,
    FIRST_MESSAGE_TIMEOUT,
    PROTOCOL,
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
from .store import VersionStore, pieces_of

log = logging.getLogger("node.shards.service")  # the sessions log as part of the service

Parts = dict[int, bytes | memoryview]  # the blocks of one piece received so far, by offset

MAX_OUTBOX = 512  # messages waiting to be written on one download session
WRITE_QUEUE = 4  # complete pieces waiting to be written (memory: 4 pieces, 4 MiB by default)
THREAD_WRITE_BYTES = 512 << 10  # pieces this large are hashed and written in a worker thread
RESCAN_INTERVAL = 1.0  # seconds between looks for new peers to download from
RETRY_PEER_AFTER = 5.0  # seconds before a peer that refused a session is asked again
DIAL_TIMEOUT = 10.0  # seconds a dial of a public member may take
# An unresponsive peer is asked again after RETRY_PEER_AFTER, doubled at each drop up to ban_seconds:
# a silent liar costs a few timeouts per back-off, a peer that was only starved is not lost for good.


class ClientSession:
    """One outbound transfer session: we download a version from ``peer``."""

    def __init__(self, peer: str, stream) -> None:
        self.peer = peer
        self.stream = stream
        self.outbox_send, self.outbox_recv = trio.open_memory_channel[Message](MAX_OUTBOX)
        self.cancel_scope = trio.CancelScope()
        self.wants_haves = True  # the server's Bitfield says (only a super-seeder reads them)

    def post(self, msg: Message) -> None:
        try:
            self.outbox_send.send_nowait(msg)
        except (trio.WouldBlock, trio.ClosedResourceError):
            pass  # a peer that does not read its stream loses messages; its requests time out

    async def write_loop(self) -> None:
        """Write what is queued, every message waiting at the time in one stream write (the picker
        asks for blocks in bursts: one Yamux frame and Noise message for the burst, not each)."""
        async for msg in self.outbox_recv:
            frames = [frame_of(msg)]
            while True:
                try:
                    frames.append(frame_of(self.outbox_recv.receive_nowait()))
                except trio.WouldBlock:
                    break
            await self.stream.write(b"".join(frames))


class Download:
    """Fetch one version from the swarm into ``vs`` (see the module docstring)."""

    def __init__(self, owner: SessionOwner, vs: VersionStore) -> None:
        self.owner = owner
        self.vs = vs
        m = vs.manifest
        cfg = owner.cfg
        self.picker = Picker(
            [m.piece_length(i) for i in range(m.num_pieces)],
            PickerParams(
                block_size=min(cfg.block_size, m.piece_size),
                request_timeout=cfg.request_timeout,
                ban_seconds=cfg.ban_seconds,
            ),
            have=set(vs.verified),
            rng=owner.rng,
        )
        self.sessions: dict[str, ClientSession] = {}
        self.refused: dict[str, float] = {}  # peer -> time it refused a session
        self.backoff: dict[str, float] = {}  # peer -> seconds before asking it again after a drop
        # Public members dialled for this download (the owner's DialBook decides which), until the
        # rescan after their dial ended: in use (ShardsService.peers_in_use) until a session holds them.
        self.dialled: set[str] = set()
        self.buffers: dict[int, Parts] = {}
        # (piece, its blocks by offset, bytes each peer supplied) for the writer thread
        self._writes_send, self._writes_recv = trio.open_memory_channel[tuple[int, Parts, dict[str, int]]](
            WRITE_QUEUE)
        self.changed = trio.Event()
        self.done = trio.Event()
        self.refetched_pieces = 0
        self.failed: str | None = None  # why writing to disk failed (disk full, I/O error): the download stopped
        self.started = trio.current_time()
        # piece -> (time it verified, the peer that supplied most of it): how the pieces spread
        # (bench/shards.py prints first/last piece times from it). Bounded by the piece count.
        self.verified_at: dict[int, tuple[float, str]] = {}

    @property
    def root(self) -> bytes:
        return self.vs.signed.root

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._writer)
            self._check_done()
            next_scan = -math.inf
            while not self.done.is_set() and self.failed is None:
                now = trio.current_time()
                if now >= next_scan:
                    self._connect_new(now)
                    next_scan = now + RESCAN_INTERVAL
                self._apply(self.picker.poll(now))
                self.changed = trio.Event()
                wait = min(RESCAN_INTERVAL, max(0.0, self.picker.next_deadline() - now))
                with trio.move_on_after(wait):
                    await self.changed.wait()
            nursery.cancel_scope.cancel()

    def _check_done(self) -> None:
        if self.picker.complete and not self.done.is_set():
            self.done.set()

    def _connect_new(self, now: float) -> None:
        """Open sessions to the peers :func:`sessions_to_open` chooses (node/shards/peering.py says
        why in that order), and free a slot when a peer downloading from us waits for one."""
        announced = self.owner.announced.get(self.vs.version)
        source = announced[1] if announced is not None and announced[0] == self.root else None
        served = self.owner.downloaders_of(self.root)
        direct = self.owner.host.direct_peers()
        self._dial_public(direct, now)
        self.dialled &= self.owner.dials.dialling
        opened, waiting = sessions_to_open(direct, self.sessions, source, served,
                                           self.owner.cfg.max_peers, lambda p: self._may_dial(p, now),
                                           self.owner.rng)
        for peer in opened:
            self.refused[peer] = now  # until it answers; cleared on a good session
            self.sessions[peer] = None  # type: ignore[assignment]  # reserved while dialing
            self._nursery.start_soon(self._session, peer)
        if waiting:
            self._make_room(served, source)

    def _dial_public(self, direct: list[str], now: float) -> None:
        """Short of ``max_peers`` direct peers, dial the public members the owner's
        :class:`~node.shards.peering.DialBook` chooses (node/shards/peering.py says why and in
        which order). Their sessions open at a later rescan, once they are direct."""
        owner, members = self.owner, self.owner.members
        if members is None:  # membership does not run yet
            return
        owner.dials.note_direct(direct, now)
        chosen = owner.dials.to_dial(
            now, direct, owner.host.connected_peers(), members.members,
            lambda p: direct_addrs(p, members.addrs_of, members.reachability_of),
            lambda p: not owner.banned_anywhere(p, now), owner.cfg.max_peers, owner.rng)
        for peer, addrs in chosen:
            self.dialled.add(peer)
            self._nursery.start_soon(self._dial, peer, addrs)

    async def _dial(self, peer: str, addrs: list[str]) -> None:
        ok: bool | None = None  # stays None when the download ends (is cancelled) first
        try:
            with trio.fail_after(DIAL_TIMEOUT):
                await self.owner.host.connect_direct(peer, addrs)
            ok = True
        except Exception as e:  # libp2p raises many types for "could not connect"; asked again later
            ok = False
            log.debug("shards: dial of %s for v%d failed: %r", peer[-8:], self.vs.version, e)
        finally:
            self.owner.dials.on_result(peer, ok, trio.current_time())

    def _may_dial(self, peer: str, now: float) -> bool:
        if self.owner.is_banned(peer, now):
            return False
        return now - self.refused.get(peer, -math.inf) >= self.backoff.get(peer, RETRY_PEER_AFTER)

    def _make_room(self, served: set[str], source: str | None) -> None:
        """Every slot is taken and a peer downloading from us waits for one: end the session
        :func:`session_to_end` chooses, so that sessions pair up (node/shards/peering.py)."""
        held = [p for p, sess in self.sessions.items() if sess is not None]
        peer = session_to_end(held, source, served, self.picker.holds_all, self.picker.in_flight)
        if peer is not None:
            self._end_session(peer)

    async def _session(self, peer: str) -> None:
        sess: ClientSession | None = None
        try:
            stream = await self.owner.host.open_stream(peer, PROTOCOL)
        except Exception as e:  # libp2p raises many types for "could not open a stream"
            log.debug("shards: no stream to %s: %s", peer[-8:], e)
            self.sessions.pop(peer, None)
            return
        sess = ClientSession(peer, stream)
        self.sessions[peer] = sess
        try:
            with sess.cancel_scope:
                # What the peer sends us is what we asked for: at most max_depth blocks.
                params = self.picker.params
                await widen_receive_window(stream, params.max_depth * params.block_size)
                await write_frame(stream, Hello(root=self.root, bitfield=self.vs.bitfield()))
                with trio.fail_after(FIRST_MESSAGE_TIMEOUT):
                    first = await read_shards_message(stream)
                if isinstance(first, Reject) or first is None:
                    return
                if not isinstance(first, Bitfield):
                    raise RemoteProtocolError("unexpected", first.TYPE)
                self.refused.pop(peer, None)
                sess.wants_haves = first.wants_haves
                self.picker.on_bitfield(peer, pieces_of(first.bitfield, self.vs.manifest.num_pieces))
                self._poke()
                async with trio.open_nursery() as n:
                    n.start_soon(sess.write_loop)
                    await self._read_loop(sess)
                    n.cancel_scope.cancel()
        # except*: errors raised under the session's nursery arrive as exception groups.
        except* (LocalProtocolError, AssertionError):
            raise  # our bug: crash loudly
        except* RemoteProtocolError as group:
            e = group.exceptions[0]
            self.owner.reject(e.reason)
            # A peer killed mid-frame leaves a truncated stream: it left, it did not misbehave (a
            # ban here outlives it and shuts out its restart, which may hold the only copies).
            if e.reason not in TRANSPORT_FAILURES:
                self._apply(self.picker.on_misbehaved(peer, trio.current_time(), e.reason))
        except* Exception as group:  # connection lost, timeouts
            log.debug("shards: session with %s ended: %r", peer[-8:], group.exceptions[0])
        finally:
            self.refused[peer] = trio.current_time()  # do not redial a peer that just left at once
            self.sessions.pop(peer, None)
            self.picker.on_peer_gone(peer)
            self._drop_stale_buffers()
            with trio.CancelScope(shield=True), trio.move_on_after(1):
                try:
                    await stream.reset()
                except Exception:
                    pass
            self._poke()

    async def _read_loop(self, sess: ClientSession) -> None:
        n = self.vs.manifest.num_pieces
        while True:
            msg = await read_shards_message(sess.stream)
            if msg is None:
                return
            now = trio.current_time()
            if isinstance(msg, Data):
                if self._on_data(sess.peer, msg, now):
                    await self._write(msg.piece)
            elif isinstance(msg, Have):
                if msg.piece >= n:
                    raise RemoteProtocolError("bad-piece-index", str(msg.piece))
                self.picker.on_have(sess.peer, msg.piece)
            elif isinstance(msg, Reject):
                self.picker.on_reject(sess.peer, msg.piece, msg.offset, still_holds=msg.reason == BUSY)
            elif isinstance(msg, Bitfield):
                self.picker.on_bitfield(sess.peer, pieces_of(msg.bitfield, n))
            else:
                raise RemoteProtocolError("unexpected", msg.TYPE)
            self._poke()

    def _on_data(self, peer: str, msg: Data, now: float) -> bool:
        """Take a block; True when it completed its piece."""
        if not 0 <= msg.piece < self.vs.manifest.num_pieces:
            self._apply(self.picker.on_misbehaved(peer, now, "bad-piece-index"))
            return False
        kept, acts = self.picker.on_block(peer, msg.piece, msg.offset, len(msg.data), now)
        self._apply(acts)
        if not kept:
            return False
        parts = self.buffers.setdefault(msg.piece, {})
        if len(kept) == 1 and kept[0][1] == len(msg.data):
            parts[msg.offset] = msg.data
        else:  # a whole piece in one message: its blocks, as views of it (joined once, when written)
            view = memoryview(msg.data)
            for offset, n in kept:
                parts[offset] = view[offset - msg.offset:offset - msg.offset + n]
        return self.picker.piece_ready(msg.piece)

    async def _write(self, piece: int) -> None:
        job = (piece, self.buffers.pop(piece, {}), self.picker.contributors(piece))
        if self.vs.manifest.piece_length(piece) >= THREAD_WRITE_BYTES:
            # Waits while WRITE_QUEUE pieces are ahead of this one: this session stops reading meanwhile.
            await self._writes_send.send(job)
        else:
            await self._write_piece(*job, in_thread=False)  # no checkpoint on this path

    async def _writer(self) -> None:
        """Hash-check and write large pieces in a worker thread, one at a time, in arrival order."""
        async for job in self._writes_recv:
            await self._write_piece(*job, in_thread=True)

    async def _write_piece(self, piece: int, parts: Parts, contributors: dict[str, int],
                           in_thread: bool) -> None:
        try:
            if in_thread:
                ok = await trio.to_thread.run_sync(self._check_and_write, piece, parts, True)
            else:
                ok = self._check_and_write(piece, parts, False)
        except OSError as e:
            self.failed = f"writing piece {piece} to {self.vs.folder} failed: {e}"
            self._poke()
            return
        self._piece_checked(piece, parts, contributors, ok)

    def _check_and_write(self, piece: int, parts: Parts, in_thread: bool) -> bool:  # may run in a worker thread
        # A piece that came whole in one message is one part: hashed and written as it is. Joined,
        # it was one more copy of the piece, made holding the GIL that the event loop waits for.
        data = next(iter(parts.values())) if len(parts) == 1 else b"".join(parts[o] for o in sorted(parts))
        return self.vs.check_and_write(piece, data, writeback=in_thread)

    def _piece_checked(self, piece: int, parts: Parts, contributors: dict[str, int], ok: bool) -> None:
        now = trio.current_time()
        # Block digests convict a liar among several contributors (picker.on_piece_failed): they are
        # needed from a failed piece, and from the good copy of one that failed before. Not from
        # every good piece: that was a second SHA-256 pass over nearly every byte downloaded.
        def blocks() -> dict[int, bytes]:
            return {o: digest(b) for o, b in parts.items()}

        if ok:
            self.vs.mark_verified(piece)
            self.verified_at[piece] = (now, max(contributors, key=contributors.get, default=""))
            self._apply(self.picker.on_piece_verified(piece, now, blocks() if self.picker.has_suspects(piece) else None))
            for peer, nbytes in contributors.items():
                self.owner.credit(peer, self.root, nbytes)
            self.owner.on_piece_verified(self.vs, piece)
            for sess in self.sessions.values():
                if sess is not None and sess.wants_haves:
                    sess.post(Have(piece=piece))
            self._check_done()
        else:
            self.refetched_pieces += 1
            self.owner.reject("bad-piece")
            log.warning("shards: piece %d of v%d failed its hash (from %s)", piece, self.vs.version,
                        ",".join(p[-8:] for p in contributors))
            self._apply(self.picker.on_piece_failed(piece, now, blocks() if len(contributors) > 1 else None))
        self._poke()

    def _drop_stale_buffers(self) -> None:
        """Forget received blocks the picker no longer counts (their piece was reset)."""
        for piece in list(self.buffers):
            if piece not in self.picker.active:
                del self.buffers[piece]

    def _apply(self, acts: Actions) -> None:
        for r in acts.requests:
            sess = self.sessions.get(r.peer)
            if sess is not None:
                sess.post(Request(piece=r.piece, offset=r.offset, length=r.length))
        for c in acts.cancels:
            sess = self.sessions.get(c.peer)
            if sess is not None:
                sess.post(Cancel(piece=c.piece, offset=c.offset, length=c.length))
        for peer, reason in acts.banned:
            self.owner.ban(peer, reason, trio.current_time())
            self._end_session(peer)
        for peer in acts.dropped:
            self.owner.reject("unresponsive")
            self.backoff[peer] = min(2 * self.backoff.get(peer, RETRY_PEER_AFTER / 2), self.owner.cfg.ban_seconds)
            log.info("shards: %s unresponsive; asking it again in %.0fs", peer[-8:], self.backoff[peer])
            self._end_session(peer)
        if acts.banned or acts.cancels or acts.dropped:
            self._drop_stale_buffers()

    def _end_session(self, peer: str) -> None:
        sess = self.sessions.get(peer)
        if sess is not None:
            sess.cancel_scope.cancel()

    def _poke(self) -> None:
        self.changed.set()

    def status(self) -> dict[str, Any]:
        m = self.vs.manifest
        return {
            "version": m.version,
            "pieces": f"{len(self.vs.verified)}/{m.num_pieces}",
            "bytes": self.vs.verified_bytes,
            "total": m.total_size,
            "peers": len([s for s in self.sessions.values() if s is not None]),
            "endgame": self.picker.in_endgame,
        }


class progress_bar:
    """A rich progress bar for one download when stderr is a terminal (else nothing)."""

    def __init__(self, cfg: ShardsConfig, vs: VersionStore) -> None:
        self.enabled = cfg.progress and sys.stderr.isatty()
        self.vs = vs
        self.bar = None

    def __enter__(self):
        if not self.enabled:
            return None
        from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

        self.bar = Progress("[bold]checkpoint v{task.fields[v]}", BarColumn(), DownloadColumn(),
                            TransferSpeedColumn(), transient=True)
        self.bar.start()
        self.task = self.bar.add_task("dl", total=self.vs.manifest.total_size, v=self.vs.version)
        return self

    async def follow(self, dl: Download) -> None:
        while not dl.done.is_set():
            self.bar.update(self.task, completed=self.vs.verified_bytes)
            await trio.sleep(0.25)

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.stop()
