"""The shards service: announce, download, verify, store and serve checkpoint versions.

How this works
--------------
* **Serving** (:class:`_ServerSession`): a handler for ``/swarm/shards/1.0.0`` answers manifest
  requests and transfer sessions for every version we hold, complete or still downloading: a piece
  is served as soon as it is verified, and ``Have`` is pushed to every open session at once, so a
  checkpoint flows through relays like a pipeline. Requests queue per session (bounded) and are
  served under a global cap (``max_serving``) and the optional upload token bucket. For versions we
  published, a :class:`SuperSeeder` decides which pieces each downloader is shown.
* **Downloading** (:class:`Download`): one per version. It opens a session to every connected peer
  (up to ``max_peers``), feeds what they say into the pure :class:`Picker`, sends the requests and
  cancels the picker decides, assembles blocks in memory, hash-checks each piece, writes it to the
  :class:`VersionStore` and tells everyone ``Have``. Banned peers are disconnected.
* **Following** announcements on ``/swarm/<run>/checkpoints/1``: a topic validator accepts only
  announcements signed by a trainer of this run; relays (``fetch="all"``) download every version,
  inference and validator nodes (``"newest"``) only the newest, the trainer (``"none"``) nothing.

API (handed back through ``task_status.started``; node/shards/api.py): ``publish(folder, version)``,
``wait_version(v)``, ``wait_newer(v)``, ``wait_announced(v)``, ``path_of(v)``, ``latest()``,
``versions_held()``, ``receipts()``. Verified bytes are credited in the ledger given at start.
Status in ``node.status["shards"]``.
"""

from __future__ import annotations

import logging
import math
import random
import sys
from collections import OrderedDict, deque
from pathlib import Path
from typing import Any

import trio
from libp2p.peer.id import ID

from ..hashes import digest
from ..net.reqres import peer_of
from ..peers import FaultRule
from ..wire import (
    LocalProtocolError,
    Message,
    RemoteProtocolError,
    TRANSPORT_FAILURES,
    decode,
    encode,
    read_frame,
    seal,
    write_frame,
)
from ..ledger.api import LedgerAPI
from .config import ShardsConfig
from .manifest import SignedManifest, build_manifest, open_manifest, root_id, sign_manifest
from .picker import Actions, Picker, PickerParams
from .protocol import (
    ANNOUNCE_DOMAIN,
    BAD_RANGE,
    BANNED,
    BUSY,
    MAX_SHARDS_FRAME,
    NOT_HELD,
    PROTOCOL,
    UNKNOWN_ROOT,
    Announce,
    Bitfield,
    Cancel,
    Data,
    Hello,
    Have,
    ManifestReply,
    ManifestRequest,
    Reject,
    Request,
    open_announce,
)
from .store import PieceStore, StoreConflict, VersionStore, bitfield_of, pieces_of
from .superseed import SuperSeeder
from .throttle import TokenBucket

log = logging.getLogger(__name__)

MAX_QUEUED_REQUESTS = 128  # per session; more is a flood (our own picker asks for <= 32)
MAX_OUTBOX = 512  # messages waiting to be written on one download session
FIRST_MESSAGE_TIMEOUT = 10.0  # seconds a new stream may stay silent
RESCAN_INTERVAL = 1.0  # seconds between looks for new peers to download from
RETRY_PEER_AFTER = 5.0  # seconds before a peer that refused a session is asked again
# An unresponsive peer is asked again after RETRY_PEER_AFTER, doubled at each drop up to ban_seconds:
# a silent liar costs a few timeouts per back-off, a peer that was only starved is not lost for good.
MANIFEST_RETRY = 2.0
# Super-seeding (superseed.py), in bytes so that it holds for any piece size: what may be revealed
# and not yet written (at least 2 pieces), and what may be written and not yet reported (have)
# besides (at least 2 pieces). Measured in bench/shards.py swarm (N=8, 10 Mbit/s, 128 KiB pieces):
# from a reveal to our last byte of that piece took 0.3-0.7 s (the reveal and the request each wait
# behind ~0.1 s of queue on a busy link), from our last byte to the have 0.21 s (median) and up to
# 0.63 s (~0.8 MB at 10 Mbit/s). With room for only 2 pieces in each, the seed's link was busy 85 %
# of the time with 64 KiB pieces and 95 % with 128 KiB pieces; with these budgets 97 %.
SUPER_SEED_WRITING_BYTES = 512 << 10
SUPER_SEED_REPORT_BYTES = 1 << 20
SOURCE = "shards"  # metrics label for rejections, fault source in the peer table
MAX_RECEIPT_PAIRS = 4096  # (peer, manifest) pairs whose received bytes we remember


def fetch_policy(cfg: ShardsConfig, role: str) -> str:
    if cfg.fetch != "auto":
        return cfg.fetch
    return {"relay": "all", "trainer": "none"}.get(role, "newest")


async def _send(stream, lock: trio.Lock, msg: Message) -> None:
    async with lock:  # one frame at a time: concurrent writers would interleave bytes
        await write_frame(stream, msg)


async def _read(stream) -> Message | None:
    data = await read_frame(stream, MAX_SHARDS_FRAME)
    return None if data is None else decode(data, MAX_SHARDS_FRAME)


# --------------------------------------------------------------------------------------------
# Serving


class _ServerSession:
    """One inbound transfer session: a peer downloading a version from us."""

    def __init__(self, svc: "ShardsService", stream, peer: str, vs: VersionStore) -> None:
        self.svc, self.stream, self.peer, self.vs = svc, stream, peer, vs
        self.lock = trio.Lock()
        self.queue: deque[Request] = deque()
        self.wakeup = trio.Event()
        self.seeder = svc.superseeders.get(vs.signed.root)
        self.shown: set[int] = set()  # pieces advertised to this peer (super-seeding)
        self.written: dict[int, dict[int, int]] = {}  # super-seeding: piece -> {offset: length} written
        self.bitfield_sent = False

    def visible(self) -> set[int]:
        if self.seeder is None:
            return set(self.vs.verified)
        return self.shown

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
            await write_frame(self.stream, Bitfield(bitfield=bitfield_of(self.visible(), n)))
            self.bitfield_sent = True
        self.svc.route_reveals(self.vs.signed.root, later)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._serve_queue)
            if self.seeder is not None:
                nursery.start_soon(self._reveal_stalled)
            try:
                await self._read_loop()
            finally:
                nursery.cancel_scope.cancel()

    async def _read_loop(self) -> None:
        while True:
            msg = await _read(self.stream)
            if msg is None:
                return
            if isinstance(msg, Request):
                if len(self.queue) >= MAX_QUEUED_REQUESTS:
                    await _send(self.stream, self.lock, Reject(piece=msg.piece, offset=msg.offset, reason=BUSY))
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
                    self.svc.route_reveals(self.vs.signed.root, reveals)
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
            self.svc.route_reveals(self.vs.signed.root, self.seeder.on_sent(self.peer, data.piece, trio.current_time()))

    async def _reveal_stalled(self) -> None:
        """Super-seeding: pieces stuck at a slow first recipient are shown again after a while."""
        while True:
            await trio.sleep(self.seeder.stall_seconds / 4)
            self.svc.route_reveals(self.vs.signed.root, self.seeder.reveal(trio.current_time()))

    async def push_have(self, piece: int) -> None:
        """We verified ``piece`` (a download in progress): tell this peer at once."""
        if self.seeder is None:
            async with self.lock:
                if self.bitfield_sent:  # else the bitfield, read from the store, already has it
                    await write_frame(self.stream, Have(piece=piece))

    async def _serve_queue(self) -> None:
        svc = self.svc
        while True:
            while not self.queue:
                self.wakeup = trio.Event()
                await self.wakeup.wait()
            req = self.queue.popleft()
            if req.piece not in self.visible() or req.piece not in self.vs.verified:
                await _send(self.stream, self.lock, Reject(piece=req.piece, offset=req.offset, reason=NOT_HELD))
                continue
            async with svc.serve_slots:
                reply = self.reply_to(req)
                if reply is None:
                    continue
                if isinstance(reply, Data):
                    wait = svc.bucket.delay(len(reply.data), trio.current_time())
                    if wait > 0:
                        await trio.sleep(wait)
                await _send(self.stream, self.lock, reply)
            if isinstance(reply, Data):
                svc.m_served.inc(len(reply.data))
                self._note_written(reply)

    def reply_to(self, req: Request) -> Message | None:
        """The answer to one request (tests subclass this to play a lying or silent peer)."""
        try:
            data = self.vs.read_block(req.piece, req.offset, req.length)
        except ValueError:
            return Reject(piece=req.piece, offset=req.offset, reason=BAD_RANGE)
        return Data(piece=req.piece, offset=req.offset, data=data)


# --------------------------------------------------------------------------------------------
# Downloading


class _ClientSession:
    """One outbound transfer session: we download a version from ``peer``."""

    def __init__(self, peer: str, stream) -> None:
        self.peer = peer
        self.stream = stream
        self.outbox_send, self.outbox_recv = trio.open_memory_channel[Message](MAX_OUTBOX)
        self.cancel_scope = trio.CancelScope()

    def post(self, msg: Message) -> None:
        try:
            self.outbox_send.send_nowait(msg)
        except (trio.WouldBlock, trio.ClosedResourceError):
            pass  # a peer that does not read its stream loses messages; its requests time out

    async def write_loop(self) -> None:
        async for msg in self.outbox_recv:
            await write_frame(self.stream, msg)


class Download:
    """Fetch one version from the swarm into ``vs`` (see the module docstring)."""

    def __init__(self, svc: "ShardsService", vs: VersionStore) -> None:
        self.svc = svc
        self.vs = vs
        m = vs.manifest
        self.picker = Picker(
            [m.piece_length(i) for i in range(m.num_pieces)],
            PickerParams(
                block_size=min(svc.cfg.block_size, m.piece_size),
                request_timeout=svc.cfg.request_timeout,
                ban_seconds=svc.cfg.ban_seconds,
            ),
            have=set(vs.verified),
            rng=svc.rng,
        )
        self.sessions: dict[str, _ClientSession] = {}
        self.refused: dict[str, float] = {}  # peer -> time it refused a session
        self.backoff: dict[str, float] = {}  # peer -> seconds before asking it again after a drop
        self.buffers: dict[int, dict[int, bytes]] = {}
        self.changed = trio.Event()
        self.done = trio.Event()
        self.refetched_pieces = 0
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
            self._check_done()
            next_scan = -math.inf
            while not self.done.is_set():
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
        host = self.svc.node.host
        for peer in host.connected_peers():
            if len(self.sessions) >= self.svc.cfg.max_peers:
                return
            if peer in self.sessions or self.svc.is_banned(peer, now):
                continue
            if now - self.refused.get(peer, -math.inf) < self.backoff.get(peer, RETRY_PEER_AFTER):
                continue
            self.refused[peer] = now  # until it answers; cleared on a good session
            self.sessions[peer] = None  # type: ignore[assignment]  # reserved while dialing
            self._nursery.start_soon(self._session, peer)

    async def _session(self, peer: str) -> None:
        svc = self.svc
        sess: _ClientSession | None = None
        try:
            stream = await svc.node.host.open_stream(peer, PROTOCOL)
        except Exception as e:  # libp2p raises many types for "could not open a stream"
            log.debug("shards: no stream to %s: %s", peer[-8:], e)
            self.sessions.pop(peer, None)
            return
        sess = _ClientSession(peer, stream)
        self.sessions[peer] = sess
        try:
            with sess.cancel_scope:
                await write_frame(stream, Hello(root=self.root, bitfield=self.vs.bitfield()))
                with trio.fail_after(FIRST_MESSAGE_TIMEOUT):
                    first = await _read(stream)
                if isinstance(first, Reject) or first is None:
                    return
                if not isinstance(first, Bitfield):
                    raise RemoteProtocolError("unexpected", first.TYPE)
                self.refused.pop(peer, None)
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
            svc.node.metrics.reject(SOURCE, e.reason)
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

    async def _read_loop(self, sess: _ClientSession) -> None:
        n = self.vs.manifest.num_pieces
        while True:
            msg = await _read(sess.stream)
            if msg is None:
                return
            now = trio.current_time()
            if isinstance(msg, Data):
                self._on_data(sess.peer, msg, now)
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

    def _on_data(self, peer: str, msg: Data, now: float) -> None:
        if not 0 <= msg.piece < self.vs.manifest.num_pieces:
            self._apply(self.picker.on_misbehaved(peer, now, "bad-piece-index"))
            return
        keep, acts = self.picker.on_block(peer, msg.piece, msg.offset, len(msg.data), now)
        self._apply(acts)
        if not keep:
            return
        self.buffers.setdefault(msg.piece, {})[msg.offset] = msg.data
        if self.picker.piece_ready(msg.piece):
            self._finish_piece(msg.piece, now)

    def _finish_piece(self, piece: int, now: float) -> None:
        parts = self.buffers.pop(piece, {})
        data = b"".join(parts[o] for o in sorted(parts))
        contributors = self.picker.contributors(piece)
        blocks = {o: digest(b) for o, b in parts.items()} if self.picker.has_suspects(piece) or len(contributors) > 1 else None
        if self.vs.put_piece(piece, data):
            self.verified_at[piece] = (now, max(contributors, key=contributors.get, default=""))
            self._apply(self.picker.on_piece_verified(piece, now, blocks))
            for peer, nbytes in contributors.items():
                self.svc.credit(peer, self.root, nbytes)
            self.svc.on_piece_verified(self.vs, piece)
            for sess in self.sessions.values():
                if sess is not None:
                    sess.post(Have(piece=piece))
            self._check_done()
        else:
            self.refetched_pieces += 1
            self.svc.node.metrics.reject(SOURCE, "bad-piece")
            log.warning("shards: piece %d of v%d failed its hash (from %s)", piece, self.vs.version,
                        ",".join(p[-8:] for p in contributors))
            self._apply(self.picker.on_piece_failed(piece, now, blocks))

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
            self.svc.ban(peer, reason, trio.current_time())
            self._end_session(peer)
        for peer in acts.dropped:
            self.svc.node.metrics.reject(SOURCE, "unresponsive")
            self.backoff[peer] = min(2 * self.backoff.get(peer, RETRY_PEER_AFTER / 2), self.svc.cfg.ban_seconds)
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


# --------------------------------------------------------------------------------------------
# The service


class ShardsService:
    """Everything about checkpoint versions on this node (API: node/shards/api.py)."""

    server_session_class = _ServerSession

    def __init__(self, node, cfg: ShardsConfig, ledger: LedgerAPI) -> None:
        self.node = node
        self.cfg = cfg
        self.ledger = ledger  # credited with the verified bytes each peer sent us
        run = node.config.run
        self.run_name = run.name
        self.trainers = list(run.trainers)
        self.policy = fetch_policy(cfg, node.config.role)
        self.store = PieceStore(Path(node.data_dir) / "checkpoints", run.name, self.trainers, cfg.keep_versions)
        self.rng = random.Random()
        self.serving: dict[bytes, VersionStore] = {}
        self.superseeders: dict[bytes, SuperSeeder] = {}
        self.server_sessions: dict[bytes, set[_ServerSession]] = {}
        self.downloads: dict[int, Download] = {}
        self._download_scopes: dict[int, trio.CancelScope] = {}
        self.announced: dict[int, tuple[bytes, str]] = {}  # version -> (root, announcer)
        # Verified bytes per (peer, manifest root hex), for status and tests; the ledger holds the
        # durable count. Bounded: the least recently credited pair is forgotten first.
        self._receipts: OrderedDict[tuple[str, str], int] = OrderedDict()
        self._events: dict[int, trio.Event] = {}
        self._news = trio.Event()  # set (and replaced) when a version is announced or completed
        self._resumed: dict[int, VersionStore] = {}  # partial versions reopened at start
        self.published: SignedManifest | None = None
        self.serve_slots = trio.Semaphore(cfg.max_serving)
        self.bucket = TokenBucket(cfg.upload_rate, max(cfg.upload_rate / 10, 2 * cfg.block_size), trio.current_time())
        mt = node.metrics
        self.m_served = mt.counter("shards_served_bytes_total", "Checkpoint bytes served to peers")
        self.m_received = mt.counter("shards_verified_bytes_total", "Checkpoint bytes received and verified")
        self.m_bans = mt.counter("shards_bans_total", "Peers banned by the shards service", ["reason"])
        # The picker's smart ban has already counted the strikes: one report here is a ban.
        node.peers.set_rule(SOURCE, FaultRule(strikes=1, ban_seconds=cfg.ban_seconds))
        self.m_versions = mt.gauge("shards_versions_complete", "Complete checkpoint versions held")
        self._nursery: trio.Nursery | None = None

    # ---------------------------------------------------------------------------------------
    # Public API

    def latest(self) -> int | None:
        """The newest complete version held, or None."""
        done = self.store.complete_versions()
        return done[-1] if done else None

    def path_of(self, version: int) -> Path | None:
        """The model folder of a complete version (load it with transformers), else None."""
        return self.store.path_of(version)

    def versions_held(self) -> list[int]:
        return self.store.complete_versions()

    async def wait_version(self, version: int) -> Path:
        """Wait until ``version`` is complete here; returns its folder."""
        while (path := self.path_of(version)) is None:
            await self._events.setdefault(version, trio.Event()).wait()
        return path

    async def wait_newer(self, version: int | None) -> int:
        """Wait until a complete version newer than ``version`` (any, if None) is held; returns the newest."""
        while (latest := self.latest()) is None or (version is not None and latest <= version):
            await self._news.wait()
        return latest

    async def wait_announced(self, version: int) -> int:
        """Wait until a version newer than ``version`` is announced; returns the newest announced."""
        while not self.announced or max(self.announced) <= version:
            await self._news.wait()
        return max(self.announced)

    def receipts(self) -> dict[tuple[str, str], int]:
        """Verified bytes received, per (peer id, manifest root hex): what the ledger credits."""
        return dict(self._receipts)

    async def publish(self, folder: Path, version: int) -> SignedManifest:
        """Hash ``folder`` as ``version``, store it, seed it and announce it (trainer side)."""
        ident = self.node.identity
        if ident.peer_id not in self.trainers:
            raise PermissionError("this node is not a trainer of the run: peers would reject its manifests")
        manifest = await trio.to_thread.run_sync(build_manifest, Path(folder), self.run_name, version, self.cfg.piece_size)
        signed = sign_manifest(ident, manifest)
        await self.seed(folder, signed, super_seed=self.cfg.super_seed)
        self.published = signed
        await self._announce(signed)
        log.info("shards: published v%d (%d pieces, %d bytes, root %s)", version, manifest.num_pieces,
                 manifest.total_size, signed.root.hex()[:12])
        return signed

    async def seed(self, folder: Path, signed: SignedManifest, *, super_seed: bool = False) -> VersionStore:
        """Take a folder matching a trainer's manifest (e.g. copied out of band) and serve it."""
        vs = await trio.to_thread.run_sync(self.store.import_folder, Path(folder), signed)
        if super_seed:
            size = signed.manifest.piece_size
            writing = max(2, -(-SUPER_SEED_WRITING_BYTES // size))
            self.superseeders[signed.root] = SuperSeeder(
                signed.manifest.num_pieces, in_transit=writing, rng=self.rng,
                max_unreported=writing + max(2, -(-SUPER_SEED_REPORT_BYTES // size)))
        self._serve(vs)
        self._note_announced(signed.version, signed.root, signed.signer)
        self._version_complete(vs)
        return vs

    def fetch(self, version: int, root: bytes, source: str) -> None:
        """Download ``version`` (manifest root ``root``, first asked of ``source``) whatever the policy."""
        self._note_announced(version, root, source)
        if version not in self.downloads and self.path_of(version) is None:
            scope = trio.CancelScope()
            self._download_scopes[version] = scope
            self.downloads[version] = None  # type: ignore[assignment]  # reserved
            self._nursery.start_soon(self._fetch_version, version, scope)

    # ---------------------------------------------------------------------------------------
    # Bookkeeping used by sessions

    def is_banned(self, peer: str, now: float) -> bool:
        return self.node.peers.is_banned(peer, SOURCE, now)

    def ban(self, peer: str, reason: str, now: float) -> None:
        """Ban ``peer`` for ``cfg.ban_seconds`` (the peer table scores it down and disconnects it)."""
        if self.is_banned(peer, now):
            return
        self.m_bans.labels(reason=reason).inc()
        self.node.metrics.reject(SOURCE, reason)
        self.node.peers.report(peer, SOURCE, reason, now)

    def credit(self, peer: str, root: bytes, nbytes: int) -> None:
        """``peer`` supplied ``nbytes`` of a piece that verified: count it and tell the ledger,
        which batches these into signed receipts that credit the peer (node/ledger/sync.py)."""
        key = (peer, root.hex())
        self._receipts[key] = self._receipts.pop(key, 0) + nbytes
        while len(self._receipts) > MAX_RECEIPT_PAIRS:
            self._receipts.popitem(last=False)
        self.m_received.inc(nbytes)
        try:
            self.ledger.note_received(peer, root, nbytes, 1)
        except ValueError as e:  # a bad receipt is our bug, but must not stop a download
            log.error("shards: receipt refused by the ledger: %s", e)

    def on_piece_verified(self, vs: VersionStore, piece: int) -> None:
        for sess in list(self.server_sessions.get(vs.signed.root, ())):
            self._nursery.start_soon(_quietly, sess.push_have, piece)

    def route_reveals(self, root: bytes, reveals: list[tuple[str, int]]) -> None:
        """Send super-seeding reveals to the sessions of the peers they are for."""
        for peer, piece in reveals:
            log.debug("shards: reveal piece %d to %s", piece, peer[-8:])
            for sess in self.server_sessions.get(root, ()):
                if sess.peer == peer:
                    self._nursery.start_soon(_quietly, sess.reveal, piece)
                    break

    def _serve(self, vs: VersionStore) -> None:
        self.serving[vs.signed.root] = vs

    def _version_complete(self, vs: VersionStore) -> None:
        self.m_versions.set(len(self.store.complete_versions()))
        self._events.pop(vs.version, trio.Event()).set()
        self._tell_news()
        for v in self.store.prune(protect=set(self.downloads)):
            for root, held in list(self.serving.items()):
                if held.version == v:
                    held.close()
                    del self.serving[root]
                    self.superseeders.pop(root, None)

    def _note_announced(self, version: int, root: bytes, source: str) -> None:
        """Remember the first announcement of ``version``; followers learn of a newer one."""
        if version not in self.announced:
            self.announced[version] = (root, source)
            self._tell_news()

    def _tell_news(self) -> None:
        self._news.set()
        self._news = trio.Event()

    # ---------------------------------------------------------------------------------------
    # Inbound streams

    async def handle_stream(self, stream) -> None:
        peer = peer_of(stream)
        try:
            if self.is_banned(peer, trio.current_time()):
                await write_frame(stream, Reject(piece=-1, offset=0, reason=BANNED))
                return
            with trio.fail_after(FIRST_MESSAGE_TIMEOUT):
                first = await _read(stream)
            if isinstance(first, ManifestRequest):
                vs = self.serving.get(first.root)
                reply = ManifestReply(envelope=vs.signed.envelope) if vs else Reject(piece=-1, offset=0, reason=UNKNOWN_ROOT)
                await write_frame(stream, reply)
                await stream.close()
            elif isinstance(first, Hello):
                vs = self.serving.get(first.root)
                if vs is None:
                    await write_frame(stream, Reject(piece=-1, offset=0, reason=UNKNOWN_ROOT))
                    await stream.close()
                    return
                sess = self.server_session_class(self, stream, peer, vs)
                self.server_sessions.setdefault(first.root, set()).add(sess)
                try:
                    await sess.run(first)
                finally:
                    self.server_sessions[first.root].discard(sess)
                    if sess.seeder is not None:  # what it was shown may now go to others
                        self.route_reveals(first.root, sess.seeder.on_peer_gone(peer, trio.current_time()))
            elif first is not None:
                raise RemoteProtocolError("unexpected", first.TYPE)
        # except*: errors raised under the session's nursery arrive as exception groups.
        except* (LocalProtocolError, AssertionError):
            raise
        except* RemoteProtocolError as group:
            self.node.metrics.reject(SOURCE, group.exceptions[0].reason)
            log.debug("shards: %s sent garbage: %s", peer[-8:], group.exceptions[0])
        except* Exception as group:  # resets, timeouts, closed connections: the peer left
            log.debug("shards: inbound session with %s ended: %r", peer[-8:], group.exceptions[0])
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(1):
                try:
                    await stream.reset()
                except Exception:
                    pass

    # ---------------------------------------------------------------------------------------
    # Announcements

    def _validate_announce(self, peer_id, msg) -> bool:
        try:
            open_announce(msg.data, self.run_name, self.trainers)
            return True
        except RemoteProtocolError as e:
            self.node.metrics.reject(self.node.topic("checkpoints"), e.reason)
            return False

    async def _announce(self, signed: SignedManifest) -> None:
        m = signed.manifest
        env = seal(self.node.identity, ANNOUNCE_DOMAIN, Announce(
            run=m.run, version=m.version, root=signed.root, total_size=m.total_size, num_pieces=m.num_pieces))
        try:
            await self.node.host.pubsub.publish(self.node.topic("checkpoints"), encode(env))
        except Exception as e:  # no peers yet, etc.: the next re-announcement will do
            log.debug("shards: announce failed: %s", e)

    async def _reannounce_loop(self) -> None:
        while True:
            await trio.sleep(self.cfg.announce_interval)
            if self.published is not None:
                await self._announce(self.published)

    async def _follow(self, sub) -> None:
        while True:
            msg = await sub.get()
            try:
                sa = open_announce(msg.data, self.run_name, self.trainers)
            except RemoteProtocolError:
                continue  # the validator counted it
            a = sa.announce
            source = ID(msg.from_id).to_base58() if msg.from_id else sa.signer
            self._note_announced(a.version, a.root, source)
            self._maybe_fetch(a.version)

    def _maybe_fetch(self, version: int) -> None:
        if self.policy == "none" or version in self.downloads or self.path_of(version) is not None:
            return
        if version not in self.announced:
            return
        newest_known = max(self.announced)
        held = self.latest()
        if self.policy == "newest":
            if version < newest_known or (held is not None and version <= held):
                return
            for v, scope in list(self._download_scopes.items()):
                if v < version:
                    scope.cancel()  # an older version is no longer worth fetching
        elif held is not None and version < held - self.cfg.keep_versions:
            return
        root, source = self.announced[version]
        self.fetch(version, root, source)

    async def _fetch_version(self, version: int, scope: trio.CancelScope) -> None:
        try:
            with scope:
                root, source = self.announced[version]
                signed = await self._fetch_manifest(version, root, source)
                vs = self._resumed.pop(version, None)
                if vs is None or vs.signed.root != signed.root:
                    try:
                        vs = self.store.open_version(signed)
                    except StoreConflict as e:
                        log.warning("shards: %s", e)
                        return
                self._serve(vs)
                dl = Download(self, vs)
                self.downloads[version] = dl
                with _progress(self.cfg, vs) as bar:
                    if bar is not None:
                        self._nursery.start_soon(bar.follow, dl)
                    await dl.run()
                await trio.to_thread.run_sync(vs.finish)  # fsyncs the whole checkpoint: off the event loop
                log.info("shards: v%d complete in %.1fs (%d pieces re-fetched after bad hashes)",
                         version, trio.current_time() - dl.started, dl.refetched_pieces)
                self._version_complete(vs)
        finally:
            self.downloads.pop(version, None)
            self._download_scopes.pop(version, None)

    async def _fetch_manifest(self, version: int, root: bytes, source: str) -> SignedManifest:
        saved = self.store.saved_manifest(version)
        if saved is not None and saved.root == root:
            return saved
        while True:
            peers = [source] + [p for p in self.node.host.connected_peers() if p != source]
            for peer in peers:
                if self.is_banned(peer, trio.current_time()):
                    continue
                try:
                    with trio.fail_after(FIRST_MESSAGE_TIMEOUT):
                        return await self._call_manifest(peer, root)
                except RemoteProtocolError as e:
                    self.node.metrics.reject(SOURCE, e.reason)
                except (LocalProtocolError, AssertionError):
                    raise
                except Exception as e:  # unreachable peer, timeout, reset
                    log.debug("shards: manifest from %s: %s", peer[-8:], e)
            await trio.sleep(MANIFEST_RETRY)

    async def _call_manifest(self, peer: str, root: bytes) -> SignedManifest:
        stream = await self.node.host.open_stream(peer, PROTOCOL)
        try:
            await write_frame(stream, ManifestRequest(root=root))
            reply = await _read(stream)
            if isinstance(reply, Reject) or reply is None:
                raise RemoteProtocolError("no-manifest", reply.reason if reply else "eof")
            if not isinstance(reply, ManifestReply):
                raise RemoteProtocolError("unexpected", reply.TYPE)
            if root_id(reply.envelope.payload) != root:
                raise RemoteProtocolError("wrong-root", "manifest does not hash to the announced root")
            return open_manifest(reply.envelope, self.run_name, self.trainers)
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(1):
                try:
                    await stream.reset()
                except Exception:
                    pass

    # ---------------------------------------------------------------------------------------
    # Lifecycle

    def _load_held(self) -> list[SignedManifest]:
        """Serve every complete version on disk; return manifests of partial ones to resume."""
        partial = []
        for v in self.store.complete_versions():
            signed = self.store.saved_manifest(v)
            if signed is None:
                continue
            vs = VersionStore(self.store.folder_of(v), signed)
            vs._open(create=False)
            vs.verified = set(range(signed.manifest.num_pieces))  # COMPLETE was written after fsync
            self._serve(vs)
            self._note_announced(v, signed.root, signed.signer)
        for v in self.store.partial_versions():
            signed = self.store.saved_manifest(v)
            if signed is not None:
                # Resume now (re-hash what the log claims) so verified pieces are served at once.
                vs = self.store.open_version(signed)
                self._serve(vs)
                self._resumed[v] = vs
                partial.append(signed)
        return partial

    def status(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "held": self.versions_held(),
            "announced": sorted(self.announced)[-8:],
            "downloading": [d.status() for d in self.downloads.values() if d is not None],
            "serving_sessions": sum(len(s) for s in self.server_sessions.values()),
            "banned": sorted(p for p, bans in self.node.peers.table.bans(trio.current_time()).items() if SOURCE in bans),
        }

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        host = self.node.host
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            partial = self._load_held()
            self.m_versions.set(len(self.store.complete_versions()))
            host.set_handler(PROTOCOL, self.handle_stream)
            topic = self.node.topic("checkpoints")
            host.pubsub.set_topic_validator(topic, self._validate_announce, False)
            sub = await host.pubsub.subscribe(topic)
            nursery.start_soon(self._follow, sub)
            nursery.start_soon(self._reannounce_loop)
            for signed in partial:  # resume interrupted downloads
                self._note_announced(signed.version, signed.root, signed.signer)
            for signed in partial:
                self._maybe_fetch(signed.version)
            self.node.status["shards"] = self.status
            task_status.started(self)
            await trio.sleep_forever()


async def _quietly(fn, *args) -> None:
    """Run a best-effort push to one peer; its failure is that session's business."""
    try:
        await fn(*args)
    except (LocalProtocolError, AssertionError):
        raise
    except Exception:
        pass


class _progress:
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


async def serve_shards(node, ledger: LedgerAPI, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Run the shards service for ``node`` until cancelled (see the module docstring); hands back
    the :class:`ShardsService` once it serves. ``ledger`` is credited with verified bytes."""
    cfg = node.config.run.section("shards")
    await ShardsService(node, cfg, ledger).run(task_status=task_status)
