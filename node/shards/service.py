"""The shards service: announce, download, verify, store and serve checkpoint versions.

How this works
--------------
:class:`ShardsService` owns the versions this node holds (the :class:`PieceStore`) and ties three
sessions together, each in its own module:

* **Serving** (node/shards/server.py, :class:`ServerSession`): the handler for
  ``/swarm/shards/1.0.0`` answers manifest requests here and hands transfer sessions for every
  version we hold, complete or still downloading, to a session; a piece is served as soon as it is
  verified, and ``Have`` is pushed to every open session at once, so a checkpoint flows through
  relays like a pipeline. Serving is capped globally (``max_serving``) and by the optional upload
  token bucket. For versions we published, a :class:`SuperSeeder` decides which pieces each
  downloader is shown.
* **Downloading** (node/shards/client.py, :class:`Download`): one per version, fed into the pure
  :class:`Picker`; verified pieces land in the :class:`VersionStore` and are announced to every
  serving session. Banned peers are disconnected.
* **Following** announcements (node/shards/announce.py) on ``/swarm/<run>/checkpoints/1``: a topic
  validator accepts only announcements signed by a trainer of this run; relays (``fetch="all"``)
  download every version, inference and validator nodes (``"newest"``) only the newest, the trainer
  (``"none"``) nothing. The manifest of a version to fetch comes over a stream, checked against
  the announced root.

API (handed back through ``task_status.started``; node/shards/api.py): ``publish(folder, version)``,
``wait_version(v)``, ``wait_newer(v)``, ``wait_announced(v)``, ``path_of(v)``, ``latest()``,
``versions_held()``, ``receipts()``. Verified bytes are credited in the ledger given at start.
Status in ``node.status["shards"]``.
"""

from __future__ import annotations

import logging
import random
from collections import OrderedDict
from pathlib import Path
from typing import Any

import trio

from ..ledger.api import LedgerAPI
from ..net.budget import STALLED
from ..net.reqres import Inbound, Refused, peer_of, reset
from ..peers import FaultRule
from ..wire import LocalProtocolError, RemoteProtocolError, decode, write_frame
from .announce import announce, fetch_manifest, fetch_policy, follow_announcements, reannounce_loop, validate_announce
from .client import Download, progress_bar
from .config import ShardsConfig
from .manifest import SignedManifest, build_manifest, sign_manifest
from .protocol import (
    BANNED,
    PROTOCOL,
    SOURCE,
    UNKNOWN_ROOT,
    Hello,
    ManifestReply,
    ManifestRequest,
    Reject,
)
from .server import MAX_INBOUND_FRAME, SERVER_LIMITS, ServerSession
from .store import PieceStore, StoreConflict, VersionStore
from .superseed import SuperSeeder
from .throttle import TokenBucket

log = logging.getLogger(__name__)

# Super-seeding (superseed.py), in bytes so that it holds for any piece size: what may be revealed
# and not yet written (at least 2 pieces), and what may be written and not yet reported (have)
# besides (at least 2 pieces). Measured in bench/shards.py swarm (N=8, 10 Mbit/s, 128 KiB pieces):
# from a reveal to our last byte of that piece took 0.3-0.7 s (the reveal and the request each wait
# behind ~0.1 s of queue on a busy link), from our last byte to the have 0.21 s (median) and up to
# 0.63 s (~0.8 MB at 10 Mbit/s). With room for only 2 pieces in each, the seed's link was busy 85 %
# of the time with 64 KiB pieces and 95 % with 128 KiB pieces; with these budgets 97 %.
SUPER_SEED_WRITING_BYTES = 512 << 10
SUPER_SEED_REPORT_BYTES = 1 << 20
MAX_RECEIPT_PAIRS = 4096  # (peer, manifest) pairs whose received bytes we remember


# --------------------------------------------------------------------------------------------
# The service


class ShardsService:
    """Everything about checkpoint versions on this node (API: node/shards/api.py)."""

    server_session_class = ServerSession

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
        self.server_sessions: dict[bytes, set[ServerSession]] = {}
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
        # Inbound streams: per-peer and total slots, header deadline, byte budget (node/net/budget.py).
        self.inbound = Inbound(PROTOCOL, SERVER_LIMITS, config=run.section("streams"), peers=node.peers,
                               metrics=node.metrics, source=SOURCE)
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
            async with self.inbound.open(stream, peer, wait=False) as frames:
                await self._serve_stream(stream, peer, frames)
        # except*: errors raised under the session's nursery arrive as exception groups.
        except* (LocalProtocolError, AssertionError):
            raise
        except* Refused as group:  # over the peer's share or no slot free: counted, the stream reset
            self.node.metrics.reject(SOURCE, group.exceptions[0].reason)
        except* RemoteProtocolError as group:
            if group.exceptions[0].reason != STALLED:  # a stall is counted and struck by Inbound
                self.node.metrics.reject(SOURCE, group.exceptions[0].reason)
            log.debug("shards: %s sent garbage: %s", peer[-8:], group.exceptions[0])
        except* Exception as group:  # resets, timeouts, closed connections: the peer left
            log.debug("shards: inbound session with %s ended: %r", peer[-8:], group.exceptions[0])
        finally:
            await reset(stream, shielded=True)

    def _budgeted_handler(self):
        """``handle_stream`` carrying its inbound budget (the host lists it in status)."""

        async def handle(stream) -> None:
            await self.handle_stream(stream)

        handle.inbound = self.inbound
        return handle

    async def _serve_stream(self, stream, peer: str, frames) -> None:
        """One admitted inbound stream: its first message (within the header deadline), then a
        manifest reply or a transfer session."""
        data = await frames.read()
        first = None if data is None else decode(data, MAX_INBOUND_FRAME)
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
            frames.answered()
            sess = self.server_session_class(self, stream, peer, vs, frames)
            self.server_sessions.setdefault(first.root, set()).add(sess)
            try:
                await sess.run(first)
            finally:
                self.server_sessions[first.root].discard(sess)
                if sess.seeder is not None:  # what it was shown may now go to others
                    self.route_reveals(first.root, sess.seeder.on_peer_gone(peer, trio.current_time()))
        elif first is not None:
            raise RemoteProtocolError("unexpected", first.TYPE)

    # ---------------------------------------------------------------------------------------
    # Announcements

    def _validate_announce(self, peer_id, msg) -> bool:
        return validate_announce(self.node, self.run_name, self.trainers, msg)

    async def _announce(self, signed: SignedManifest) -> None:
        await announce(self.node, signed)

    def _on_announce(self, version: int, root: bytes, source: str) -> None:
        self._note_announced(version, root, source)
        self._maybe_fetch(version)

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
                signed = await fetch_manifest(self.node, self.store, self.run_name, self.trainers,
                                              self.is_banned, version, root, source)
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
                with progress_bar(self.cfg, vs) as bar:
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
            host.set_handler(PROTOCOL, self._budgeted_handler())
            topic = self.node.topic("checkpoints")
            host.pubsub.set_topic_validator(topic, self._validate_announce, False)
            sub = await host.pubsub.subscribe(topic)
            nursery.start_soon(follow_announcements, sub, self.run_name, self.trainers, self._on_announce)
            nursery.start_soon(reannounce_loop, self.node, self.cfg.announce_interval, lambda: self.published)
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


async def serve_shards(node, ledger: LedgerAPI, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Run the shards service for ``node`` until cancelled (see the module docstring); hands back
    the :class:`ShardsService` once it serves. ``ledger`` is credited with verified bytes."""
    cfg = node.config.run.section("shards")
    await ShardsService(node, cfg, ledger).run(task_status=task_status)
