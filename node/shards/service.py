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
  the announced root. Gossip can lose announcements (issue 45's soak): a node told that a newer
  version exists (``want_version``, by the inference service whose trainer's acks say so) asks a
  connected peer for its newest manifest when none was announced within ``announce_interval``
  (node/shards/catchup.py).

The sessions (and the delta part, node/shards/deltasync.py) see the service only through
node/shards/session_api.py, rust-libp2p's split of a behaviour (this service, all peers) from its
handlers (one per connection): they read a few things, ask a few questions and report events
(a piece verified, bytes to credit, a peer to ban, a message refused, reveals to route).

Data at rest is checked before it is trusted (issue 14):

* **Complete versions are re-verified at start**, in the background (``_recheck_held``: newest
  first, pieces hashed in a worker thread at ``recheck_rate`` bytes/s), so start is not blocked.
  Serving is per piece: a piece is served once it has passed, as during a download, because a
  downloader hash-checks every piece and would ban a seeder that sends damaged bytes. Loading is
  per version: until every piece has passed, the version is not *held* (``latest``, ``path_of``,
  ``wait_version`` do not return it), since a model loaded from a half-checked folder could read a
  changed tensor. Pieces that fail are marked missing and fetched again from peers before they are
  served; a node whose fetch policy is ``"none"`` (the trainer, which publishes from its own
  folders) drops the version instead.
* **A damaged manifest** (undecodable, or no longer signed by a trainer of the run) drops the
  version from the versions held with one log line; the root recorded in ``COMPLETE`` lets the
  fetch policy get it again.
* **No checkpoint with a NaN or an infinity is held** (node/shards/finite.py): a downloaded version
  is checked once assembled, a re-verified one once all its pieces passed, before it counts as held.
  A refused version is deleted, no longer served, and its root is not fetched again, even though a
  trainer signed it (a bug or a stolen trainer key). Its pieces may have been served onward while it
  was still downloading (pieces are checked against the manifest only); every downloader checks
  again, so nobody loads it.

API (handed back through ``task_status.started``; node/shards/api.py): ``publish(folder, version)``,
``want_version(v)``, ``wait_version(v)``, ``wait_newer(v)``, ``wait_announced(v)``, ``path_of(v)``, ``latest()``,
``versions_held()``, ``receipts()``. Verified bytes are credited in the ledger given at start.
Status in ``node.status["shards"]``.
"""

from __future__ import annotations

import contextlib
import logging
import random
from collections import OrderedDict
from pathlib import Path
from typing import Any

import trio

from ..ledger.api import LedgerAPI
from ..net.budget import STALLED, StreamsConfig
from ..net.host import is_relayed
from ..net.reqres import Inbound, Refused, peer_of, reset
from ..peers import FaultRule
from ..steptime import PhaseTimes
from ..wire import TRANSPORT_FAILURES, LocalProtocolError, RemoteProtocolError, decode, write_frame
from .announce import (
    announce,
    call_newest,
    fetch_manifest,
    fetch_policy,
    follow_announcements,
    reannounce_loop,
    validate_announce,
)
from .catchup import NEWEST, AnswerBudget, CatchUp
from .api import MemberAddrs
from .client import Download, progress_bar
from .config import ShardsConfig, ShardsSections
from .finite import non_finite_in_folder
from .deltasync import DeltaSync
from .manifest import SignedManifest, build_manifest, sign_manifest
from .peering import DialBook
from .protocol import (
    BANNED,
    BUSY,
    FIRST_MESSAGE_TIMEOUT,
    NONE_NEWER,
    NOT_HELD,
    PROTOCOL,
    PROTOCOL_BY_VERSION,
    RELAYED,
    SOURCE,
    UNKNOWN_ROOT,
    Hello,
    ManifestReply,
    ManifestRequest,
    NewestRequest,
    Reject,
)
from .server import MAX_INBOUND_FRAME, SERVER_LIMITS, ServerSession, Uploads
from .store import PieceStore, StoreConflict, VersionStore
from .superseed import SuperSeeder
from .throttle import TokenBucket

log = logging.getLogger(__name__)

# Fault source, in the peer table, of garbage sent to our serving side (the picker's convictions of
# bad pieces are SOURCE, one report a ban; garbage counts strikes: [shards] garbage_strikes).
GARBAGE_SOURCE = "shards-garbage"
GARBAGE_WEIGHT = 10.0  # score points one piece of garbage costs its sender, before any ban
MAX_RECEIPT_PAIRS = 4096  # (peer, manifest) pairs whose received bytes we remember
MAX_REFUSED_ROOTS = 256  # manifest roots refused for non-finite values, remembered so they are not refetched
RECHECK_CHUNK_BYTES = 8 << 20  # bytes of pieces hashed per worker-thread call when re-verifying at start
FIRST_CONTACT_POLL_S = 0.5  # how often a node with no connection yet looks for its first peer to ask
NEWEST_ANSWERS = 64  # NewestRequests answered per announce_interval, all peers together (catchup.py)


# --------------------------------------------------------------------------------------------
# The service


class ShardsService:
    """Everything about checkpoint versions on this node (API: node/shards/api.py)."""

    server_session_class = ServerSession
    deltas_class = DeltaSync  # tests swap in a publisher of bad deltas

    def __init__(self, node, cfg: ShardsConfig, ledger: LedgerAPI, streams: StreamsConfig) -> None:
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
        # Complete on disk, not yet re-verified since start (see the module docstring): not held yet.
        self._rechecking: dict[int, VersionStore] = {}
        self._damaged_manifests: dict[int, bytes | None] = {}  # found at start: version -> root from COMPLETE
        self._refused: OrderedDict[bytes, str] = OrderedDict()  # root -> why (non-finite values)
        self.published: SignedManifest | None = None
        self.members: MemberAddrs | None = None  # membership's view, once it runs (use_members)
        self.dials = DialBook(node.peer_id)  # dials of public members by our downloads (peering.py)
        # Inbound streams: per-peer and total slots, header deadline, byte budget (node/net/budget.py).
        self.inbound = Inbound(PROTOCOL, SERVER_LIMITS, config=streams, peers=node.peers,
                               metrics=node.metrics, source=SOURCE)
        mt = node.metrics
        # Shared by every serving session: max_serving slots, the optional upload token bucket.
        bucket = TokenBucket(cfg.upload_rate, max(cfg.upload_rate / 10, 2 * cfg.block_size), trio.current_time())
        self.uploads = Uploads(cfg.max_serving, bucket,
                               mt.counter("shards_served_bytes_total", "Checkpoint bytes served to peers"))
        self.m_received = mt.counter("shards_verified_bytes_total", "Checkpoint bytes received and verified")
        self.m_bans = mt.counter("shards_bans_total", "Peers banned by the shards service", ["reason"])
        # The picker's smart ban has already counted the strikes: one report here is a ban.
        node.peers.set_rule(SOURCE, FaultRule(strikes=1, ban_seconds=cfg.ban_seconds))
        node.peers.set_rule(GARBAGE_SOURCE, FaultRule(weight=GARBAGE_WEIGHT, strikes=cfg.garbage_strikes,
                                                      window=cfg.garbage_window, ban_seconds=cfg.ban_seconds))
        self.m_versions = mt.gauge("shards_versions_complete", "Complete checkpoint versions held")
        self.phases = PhaseTimes(mt.phase_seconds())  # transfer seconds per version fetched (node/steptime.py)
        self.m_damaged = mt.counter("shards_damaged_pieces_total", "Pieces on disk that failed their re-check at start")
        self._nursery: trio.Nursery | None = None
        self.deltas = self.deltas_class(self, node, self.store)  # versions as deltas (node/shards/deltasync.py)
        # A version known to exist but never announced here is asked for (node/shards/catchup.py).
        self.catchup = CatchUp(cfg.announce_interval)
        self._wanted = trio.Event()  # set (and replaced) when catch-up is asked for
        self.newest_answers = AnswerBudget(cfg.announce_interval / 2, NEWEST_ANSWERS, cfg.announce_interval)

    # ---------------------------------------------------------------------------------------
    # Public API

    def latest(self) -> int | None:
        """The newest complete version held, or None."""
        done = self.versions_held()
        return done[-1] if done else None

    def path_of(self, version: int) -> Path | None:
        """The model folder of a complete version (load it with transformers), else None."""
        return None if version in self._rechecking else self.store.path_of(version)

    def versions_held(self) -> list[int]:
        """Complete versions, oldest first, but for those whose re-check at start is not finished."""
        return [v for v in self.store.complete_versions() if v not in self._rechecking]

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

    def want_version(self, version: int, exact: bool = False) -> None:
        """A version ``version`` or newer exists (a trainer's ack said so): if no announcement of
        one arrives within a re-announcement period, ask a peer for its newest manifest; ``exact``
        (a validator holding a batch of ``version``): for that version's, unless it is announced."""
        if self.policy != "none":
            self.catchup.want(version, trio.current_time(), exact)
            self._wanted.set()
            self._wanted = trio.Event()

    async def publish(self, folder: Path, version: int) -> SignedManifest:
        """Hash ``folder`` as ``version``, store it, seed it and announce it (trainer side)."""
        ident = self.node.identity
        if ident.peer_id not in self.trainers:
            raise PermissionError("this node is not a trainer of the run: peers would reject its manifests")
        manifest = await trio.to_thread.run_sync(build_manifest, Path(folder), self.run_name, version, self.cfg.piece_size)
        signed = sign_manifest(ident, manifest)
        await self.seed(folder, signed, super_seed=self.cfg.super_seed)
        await self.deltas.publish(signed)
        self.published = signed  # only now: a re-announcement made before would lack the delta
        await self._announce(signed)
        log.info("shards: published v%d (%d pieces, %d bytes, root %s)", version, manifest.num_pieces,
                 manifest.total_size, signed.root.hex()[:12])
        return signed

    async def seed(self, folder: Path, signed: SignedManifest, *, super_seed: bool = False) -> VersionStore:
        """Take a folder matching a trainer's manifest (e.g. copied out of band) and serve it."""
        # The copy we hold of this version is replaced: its re-check and any re-fetch stop.
        self._rechecking.pop(signed.version, None)
        if (scope := self._download_scopes.get(signed.version)) is not None:
            scope.cancel()
        vs = await trio.to_thread.run_sync(self.store.import_folder, Path(folder), signed)
        if super_seed:
            self.add_superseeder(signed)
        self.serve(vs)
        self._note_announced(signed.version, signed.root, signed.signer)
        self._version_complete(vs)
        return vs

    def add_superseeder(self, signed: SignedManifest) -> None:
        """Serve the version (or delta) ``signed`` super-seeded: pieces revealed a few at a time."""
        self.superseeders[signed.root] = SuperSeeder.for_pieces(signed.manifest.num_pieces,
                                                                signed.manifest.piece_size, self.rng)

    def fetch(self, version: int, root: bytes, source: str) -> None:
        """Download ``version`` (manifest root ``root``, first asked of ``source``) whatever the policy."""
        self._note_announced(version, root, source)
        if root in self._refused or version in self._rechecking:  # the re-check fetches what it finds missing
            return
        if version not in self.downloads and self.path_of(version) is None:
            scope = trio.CancelScope()
            self._download_scopes[version] = scope
            self.downloads[version] = None  # type: ignore[assignment]  # reserved
            self._nursery.start_soon(self._fetch_version, version, scope)

    # ---------------------------------------------------------------------------------------
    # Bookkeeping used by sessions

    def is_banned(self, peer: str, now: float) -> bool:
        peers = self.node.peers
        return peers.is_banned(peer, SOURCE, now) or peers.is_banned(peer, GARBAGE_SOURCE, now)

    def banned_anywhere(self, peer: str, now: float) -> bool:
        """Banned by any part of the node (muxer, stream budgets, membership, ledger, us): a peer we
        only meet on a connection it opened is ours to judge, but one we would dial is not to be
        dialled while anyone bans it."""
        return self.node.peers.is_banned(peer, None, now)

    def ban(self, peer: str, reason: str, now: float) -> None:
        """Ban ``peer`` for ``cfg.ban_seconds`` (the peer table scores it down and disconnects it)."""
        if self.is_banned(peer, now):
            return
        self.m_bans.labels(reason=reason).inc()
        self.reject(reason)
        self.node.peers.report(peer, SOURCE, reason, now)

    def credit(self, peer: str, root: bytes, nbytes: int) -> None:
        """``peer`` supplied ``nbytes`` of a piece that verified: count it and tell the ledger,
        which batches these into signed receipts that credit the peer (node/ledger/service.py)."""
        key = (peer, root.hex())
        self._receipts[key] = self._receipts.pop(key, 0) + nbytes
        while len(self._receipts) > MAX_RECEIPT_PAIRS:
            self._receipts.popitem(last=False)
        self.m_received.inc(nbytes)
        try:
            self.ledger.note_received(peer, root, nbytes, 1)
        except ValueError as e:  # a bad receipt is our bug, but must not stop a download
            log.error("shards: receipt refused by the ledger: %s", e)

    def downloaders_of(self, root: bytes) -> set[str]:
        """The peers downloading version ``root`` from us."""
        return {sess.peer for sess in self.server_sessions.get(root, ())}

    def use_members(self, members: MemberAddrs) -> None:
        """Membership's view, handed in once membership runs (it starts after us: its record lists
        the versions we hold). From then on a download short of direct peers dials public members."""
        self.members = members

    def peers_in_use(self) -> set[str]:
        """The peers our running downloads chose: their sessions (those being opened too) and their
        dials in flight, the delta download's included (``max_peers`` sessions a download, and the
        dial book's dials). Membership's connection manager does not prune these (a download short
        of direct peers dialled some of them: pruned, it lost them). The peers downloading from us
        are not among them: they chose themselves, and a crowd of keys each resting in a session
        (no deadline) would, protected, leave membership only the honest peers to prune (an
        eclipse; review of issue 46)."""
        out: set[str] = set()
        for dl in [*self.downloads.values(), *self.deltas.running]:
            if dl is not None:
                out.update(dl.sessions, dl.dialled)
        return out

    def on_piece_verified(self, vs: VersionStore, piece: int) -> None:
        """Tell every peer downloading ``vs`` from us that we now serve ``piece``, but those that
        told us they hold it already (BitTorrent's have suppression): with rarest first about half
        of them, each spared a frame and a wake-up."""
        dl = self.downloads.get(vs.version)
        known = dl.picker if dl is not None and dl.root == vs.signed.root else None
        for sess in list(self.server_sessions.get(vs.signed.root, ())):
            if known is None or not known.peer_has(sess.peer, piece):
                sess.push_have(piece)

    def route_reveals(self, root: bytes, reveals: list[tuple[str, int]]) -> None:
        """Send super-seeding reveals to the sessions of the peers they are for."""
        for peer, piece in reveals:
            log.debug("shards: reveal piece %d to %s", piece, peer[-8:])
            for sess in self.server_sessions.get(root, ()):
                if sess.peer == peer:
                    self._nursery.start_soon(_quietly, sess.reveal, piece)
                    break

    def reject(self, reason: str) -> None:
        """A peer's message was refused for ``reason``: counted under the shards source."""
        self.node.metrics.reject(SOURCE, reason)

    @property
    def host(self):
        """The node's host (node/net/host.py), which sessions open streams on."""
        return self.node.host

    def serve(self, vs: VersionStore) -> None:
        """Serve ``vs`` (a version or a delta) from now on: each piece once it is verified."""
        self.serving[vs.signed.root] = vs

    def stop_serving(self, root: bytes) -> VersionStore | None:
        """Serve ``root`` no more; returns the store that was served, if any (the caller closes it)."""
        return self.serving.pop(root, None)

    def _version_complete(self, vs: VersionStore) -> None:
        self.m_versions.set(len(self.versions_held()))
        self._events.pop(vs.version, trio.Event()).set()
        self._tell_news()
        for v in self.store.prune(protect=set(self.downloads) | set(self._rechecking)):
            for root, held in list(self.serving.items()):
                if held.version == v:
                    held.close()
                    del self.serving[root]
                    self.superseeders.pop(root, None)
        self.deltas.prune(self.downloads)

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
            self.reject(group.exceptions[0].reason)
        except* RemoteProtocolError as group:
            e = group.exceptions[0]
            if e.reason != STALLED:  # a stall is counted and struck by Inbound
                self.reject(e.reason)
            log.debug("shards: %s sent garbage: %s", peer[-8:], e)
            # A peer cut off mid-frame left (it did not lie); a stall is struck by Inbound already.
            if e.reason not in TRANSPORT_FAILURES and e.reason != STALLED:
                self.node.peers.report(peer, GARBAGE_SOURCE, e.reason, trio.current_time())
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
        elif isinstance(first, NewestRequest):
            await write_frame(stream, self._newest_reply(peer, first.above, first.version))
            await stream.close()
        elif isinstance(first, Hello):
            vs = self.serving.get(first.root)
            # Pieces never ride a relay circuit: it spends the relay's bandwidth and its per-circuit
            # byte limit, which the circuit's membership traffic needs. Manifests (a few KB) may.
            refusal = RELAYED if is_relayed(stream.muxed_conn) else UNKNOWN_ROOT if vs is None else None
            if refusal is not None:
                await write_frame(stream, Reject(piece=-1, offset=0, reason=refusal))
                await stream.close()
                return
            frames.answered()
            sess = self.server_session_class(self, stream, peer, vs, self.uploads,
                                             seeder=self.superseeders.get(first.root), frames=frames)
            self.server_sessions.setdefault(first.root, set()).add(sess)
            try:
                await sess.run(first)
            finally:
                self.server_sessions[first.root].discard(sess)
                if sess.seeder is not None:  # what it was shown may now go to others
                    self.route_reveals(first.root, sess.seeder.on_peer_gone(peer, trio.current_time()))
        elif first is not None:
            raise RemoteProtocolError("unexpected", first.TYPE)

    def _newest_reply(self, peer: str, above: int, version: int = NEWEST) -> ManifestReply | Reject:
        """The manifest of the newest version held, if newer than ``above`` (of ``version`` when one
        is named, if we saved its manifest), within the refusal budget."""
        if not self.newest_answers.admit(peer, trio.current_time()):
            self.reject(BUSY)
            return Reject(piece=-1, offset=0, reason=BUSY)
        if version != NEWEST:
            signed = self.store.saved_manifest(version)
            return ManifestReply(envelope=signed.envelope) if signed else Reject(piece=-1, offset=0, reason=NOT_HELD)
        v = self.latest()
        signed = self.store.saved_manifest(v) if v is not None and v > above else None
        return ManifestReply(envelope=signed.envelope) if signed else Reject(piece=-1, offset=0, reason=NONE_NEWER)

    # ---------------------------------------------------------------------------------------
    # Announcements

    def _validate_announce(self, peer_id, msg) -> bool:
        return validate_announce(self.node, self.run_name, self.trainers, msg)

    async def _announce(self, signed: SignedManifest) -> None:
        await announce(self.node, signed, self.deltas.published_offer(signed.version))

    def _on_announce(self, version: int, root: bytes, source: str, delta: tuple[int, bytes] | None = None) -> None:
        self.deltas.note_offer(version, delta)
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

    def _newest_known(self) -> int | None:
        """The newest version announced or held."""
        return max([*self.announced, *self.versions_held()], default=None)

    async def _catch_up(self) -> None:
        """Ask for the newest manifest when a wanted version was not announced in time (catchup.py)."""
        if self.policy != "none":
            await self._ask_at_first_contact()
        while True:
            at = self.catchup.due_at(self._newest_known(), trio.current_time(), self._present())
            if at is None:
                await self._wanted.wait()
                continue
            await trio.sleep_until(at)
            if self.catchup.due_at(self._newest_known(), trio.current_time(), self._present()) is not None:
                await self._ask_newest()

    async def _ask_at_first_contact(self) -> None:
        """A node that fetches checkpoints asks its first peer for the newest manifest at once: it
        would otherwise learn of it from the next announcement only, up to a period after it joined
        (a restarted node, from the next one above the versions it holds)."""
        while not self._catch_up_candidates():
            await trio.sleep(FIRST_CONTACT_POLL_S)
        await self._ask_newest()

    def _present(self) -> set[int]:
        """Every version announced or held."""
        return {*self.announced, *self.versions_held()}

    def _catch_up_candidates(self) -> list[str]:
        """Connected peers to ask for the newest manifest: trainers first, then relays, then the rest."""
        now = trio.current_time()
        roles = self.members.members() if self.members is not None else {}
        order = {"trainer": 0, "relay": 1}
        peers = [p for p in self.node.host.connected_peers() if not self.is_banned(p, now)]
        return sorted(peers, key=lambda p: (0 if p in self.trainers else 1 + order.get(roles.get(p, ""), 1), p))

    async def _ask_newest(self) -> None:
        known = self._newest_known()
        asked = self.catchup.what_to_ask()
        peer = self.catchup.pick(self._catch_up_candidates(), trio.current_time())
        if peer is None:
            return
        signed = None
        try:
            with trio.fail_after(FIRST_MESSAGE_TIMEOUT):
                signed = await call_newest(self.node.host, peer, -1 if known is None else known,
                                           self.run_name, self.trainers, asked)
        except RemoteProtocolError as e:
            self.reject(e.reason)
            log.debug("shards: newest manifest from %s: %s", peer[-8:], e)
        except (LocalProtocolError, AssertionError):
            raise
        except Exception as e:  # unreachable peer, timeout, reset
            log.debug("shards: newest manifest from %s: %s", peer[-8:], e)
        self.catchup.answered(None if signed is None else signed.version, asked)
        if signed is None:
            return
        if asked != NEWEST:  # a validator's batch needs it, newest or not: fetched whatever the policy
            log.info("shards: v%d learnt by asking %s for it (its announcement never arrived)", asked, peer[-8:])
            self.fetch(signed.version, signed.root, peer)
            return
        log.info("shards: v%d learnt by asking %s for its newest manifest (%s)", signed.version, peer[-8:],
                 "at first contact" if self.catchup.wanted is None
                 else f"no announcement of v{self.catchup.wanted} or newer arrived")
        self._note_announced(signed.version, signed.root, peer)
        self._maybe_fetch(signed.version)

    async def _fetch_version(self, version: int, scope: trio.CancelScope) -> None:
        started = trio.current_time()
        try:
            with scope:
                root, source = self.announced[version]
                signed = await fetch_manifest(self.node, self.store, self.run_name, self.trainers,
                                              self.is_banned, version, root, source)
                vs = self._resumed.pop(version, None)
                if vs is None or vs.signed.root != signed.root:
                    # A stopped download of it (a full disk) left its store open and served: go on with it.
                    vs = self.serving.get(signed.root)
                if vs is None:
                    try:
                        vs = self.store.open_version(signed)
                    except StoreConflict as e:
                        log.warning("shards: %s", e)
                        return
                    except OSError as e:  # a full disk ended the node here (issue 45's soak): the next announcement retries
                        log.error("shards: v%d: cannot create its store (%s); the download stopped (it resumes at "
                                  "the next announcement or start)", version, e.strerror or e)
                        return
                self.serve(vs)
                await self.deltas.fill(vs)  # from a delta against a version we hold, when offered
                dl = Download(self, vs)
                self.downloads[version] = dl
                with progress_bar(self.cfg, vs) as bar:
                    if bar is not None:
                        self._nursery.start_soon(bar.follow, dl)
                    await dl.run()
                if dl.failed is not None:
                    log.error("shards: v%d: %s; the download stopped (it resumes at the next announcement or start)",
                              version, dl.failed)
                    return
                problems = await trio.to_thread.run_sync(non_finite_in_folder, vs.folder, _files(vs))
                if problems:
                    await self._refuse(vs, problems)
                    return
                try:
                    await trio.to_thread.run_sync(vs.finish)  # fsyncs the whole checkpoint: off the event loop
                except OSError as e:  # disk full: as a failed download
                    log.error("shards: v%d: cannot finish it (%s); the download stopped (it resumes at the next "
                              "announcement or start)", version, e.strerror or e)
                    return
                log.info("shards: v%d complete in %.1fs (%d pieces re-fetched after bad hashes)",
                         version, trio.current_time() - dl.started, dl.refetched_pieces)
                self.phases.add("transfer", trio.current_time() - started)  # manifest to the last piece synced
                self._version_complete(vs)
        finally:
            self.downloads.pop(version, None)
            self._download_scopes.pop(version, None)

    # ---------------------------------------------------------------------------------------
    # Lifecycle

    def _load_held(self) -> list[SignedManifest]:
        """Open every complete version on disk for its re-check (nothing of it served yet) and drop
        those whose manifest is damaged; return manifests of partial ones to resume."""
        partial, unopened = [], set()
        for v in self.store.complete_versions():
            signed = self.store.saved_manifest(v)
            if signed is None:
                self._drop_damaged_manifest(v)
                continue
            vs = VersionStore(self.store.folder_of(v), signed)
            try:
                vs.reopen()
            except OSError as e:  # a file replaced by a directory, a full disk that cannot recreate one
                log.error("shards: v%d: cannot open it (%s); no longer held (its pieces are fetched "
                          "again when it is announced)", v, e.strerror or e)
                with contextlib.suppress(OSError):
                    self.store.demote(v)
                unopened.add(v)
                continue
            self._rechecking[v] = vs
            self.serve(vs)  # with no piece verified yet: each is served once it passes
            self._note_announced(v, signed.root, signed.signer)
        for v in self.store.partial_versions():
            signed = self.store.saved_manifest(v)
            if signed is not None and v not in unopened:
                # Resume now (re-hash what the log claims) so verified pieces are served at once.
                try:
                    vs = self.store.open_version(signed)
                except OSError as e:
                    log.error("shards: v%d: cannot resume it (%s); fetched again when it is announced",
                              v, e.strerror or e)
                    continue
                self.serve(vs)
                self._resumed[v] = vs
                partial.append(signed)
        self.deltas.load_held()
        return partial

    def _drop_damaged_manifest(self, version: int) -> None:
        """A complete version whose saved manifest is unreadable or not signed by a trainer of the
        run: no longer held (its files stay, as a partial version without a manifest)."""
        self._damaged_manifests[version] = self.store.complete_root(version)
        self.store.forget_manifest(version)

    def _refetch_damaged_manifests(self) -> None:
        """Fetch the versions dropped for a damaged manifest, by the root kept in COMPLETE, when the
        fetch policy wants them; one log line each."""
        for version, root in sorted(self._damaged_manifests.items()):
            if root is not None:
                self._note_announced(version, root, self.trainers[0] if self.trainers else "")
                self._maybe_fetch(version)
            log.warning("shards: v%d dropped from the versions held: its manifest on disk (%s) is damaged or not "
                        "signed by a trainer of this run%s", version,
                        self.store.folder_of(version) / ".shards" / "manifest",
                        "; fetching it again" if version in self.downloads else "")
        self._damaged_manifests.clear()

    async def _recheck_held(self) -> None:
        """Re-verify the complete versions opened at start, newest first (what a node loads)."""
        for v in sorted(self._rechecking, reverse=True):
            vs = self._rechecking.get(v)
            if vs is not None:
                await self._recheck_version(vs)

    async def _before_recheck_chunk(self, vs: VersionStore) -> None:
        """Called before each chunk of a re-check is hashed (tests hold the re-check here)."""

    async def _recheck_version(self, vs: VersionStore) -> None:
        """Hash every piece of ``vs`` again, serving each that passes; then hold the version, or fetch
        the pieces that failed (or drop it, with fetch policy "none")."""
        m, v = vs.manifest, vs.version
        bad: list[int] = []
        nxt = 0
        while nxt < m.num_pieces:
            chunk, size = [], 0
            while nxt < m.num_pieces and (not chunk or size < RECHECK_CHUNK_BYTES):
                chunk.append(nxt)
                size += m.piece_length(nxt)
                nxt += 1
            await self._before_recheck_chunk(vs)
            if self._rechecking.get(v) is not vs:  # replaced meanwhile (re-published): its own copy is checked
                if self.serving.get(vs.signed.root) is not vs:
                    vs.close()
                return
            t0 = trio.current_time()
            try:
                good = await trio.to_thread.run_sync(vs.check_pieces, chunk)
            except OSError as e:  # an unreadable disk region: those pieces are missing like damaged ones
                log.warning("shards: v%d: reading pieces %d-%d for their re-check failed: %s", v, chunk[0], chunk[-1], e)
                good = []
            for piece in good:
                vs.verified.add(piece)
                self.on_piece_verified(vs, piece)
            bad += sorted(set(chunk) - set(good))
            pause = size / self.cfg.recheck_rate - (trio.current_time() - t0) if self.cfg.recheck_rate else 0.0
            await trio.sleep(max(0.0, pause))
        if self._rechecking.get(v) is not vs:
            return
        if not bad:
            problems = await trio.to_thread.run_sync(non_finite_in_folder, vs.folder, _files(vs))
            if self._rechecking.pop(v, None) is not vs:
                return
            if problems:
                await self._refuse(vs, problems)
                return
            log.debug("shards: v%d re-verified (%d pieces)", v, m.num_pieces)
            self._version_complete(vs)
            return
        del self._rechecking[v]
        self.m_damaged.inc(len(bad))
        if self.policy == "none":
            log.warning("shards: v%d: %d of %d pieces on disk failed their re-check; dropped (fetch policy none)",
                        v, len(bad), m.num_pieces)
            self._unserve(vs)
            await trio.to_thread.run_sync(self.store.remove, v)
            self._tell_news()
            return
        log.warning("shards: v%d: %d of %d pieces on disk failed their re-check (pieces %s); fetching them again "
                    "before they are served", v, len(bad), m.num_pieces, ",".join(map(str, bad[:8])))
        await trio.to_thread.run_sync(vs.mark_incomplete)
        self._resumed[v] = vs
        self.fetch(v, vs.signed.root, vs.signed.signer)

    def _unserve(self, vs: VersionStore) -> None:
        """Stop serving ``vs`` (sessions still open on it get NOT_HELD for every request) and close it."""
        root = vs.signed.root
        if self.serving.get(root) is vs:
            del self.serving[root]
        self.superseeders.pop(root, None)
        vs.verified = set()
        vs.close()

    async def _refuse(self, vs: VersionStore, problems: list[str]) -> None:
        """A version with a non-finite value: log it, delete it, never hold, serve or fetch it again."""
        v, root = vs.version, vs.signed.root
        self._refused[root] = problems[0]
        while len(self._refused) > MAX_REFUSED_ROOTS:
            self._refused.popitem(last=False)
        self.reject("non-finite-checkpoint")
        log.error("shards: v%d (manifest %s, signed by trainer %s) refused: %s; it is not loaded, served or fetched "
                  "again", v, root.hex()[:12], vs.signed.signer, "; ".join(problems))
        self._unserve(vs)
        await trio.to_thread.run_sync(self.store.remove, v)
        self._tell_news()

    def status(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "held": self.versions_held(),
            "rechecking": sorted(self._rechecking),
            "refused": len(self._refused),
            "announced": sorted(self.announced)[-8:],
            "catch_up": self.catchup.status(),
            "downloading": [d.status() for d in self.downloads.values() if d is not None],
            "serving_sessions": sum(len(s) for s in self.server_sessions.values()),
            "banned": sorted(p for p, bans in self.node.peers.table.bans(trio.current_time()).items()
                             if SOURCE in bans or GARBAGE_SOURCE in bans),
            "phases_s": self.phases.status(),
        }

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        host = self.node.host
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            partial = self._load_held()
            self.m_versions.set(len(self.versions_held()))
            host.set_handler(PROTOCOL, self._budgeted_handler())
            host.set_handler(PROTOCOL_BY_VERSION, self._budgeted_handler())  # one budget for both
            topic = self.node.topic("checkpoints")
            host.make_urgent(topic)  # never dropped behind bulk gossip (issue 45: net/patches/safety.py)
            host.pubsub.set_topic_validator(topic, self._validate_announce, False)
            sub = await host.pubsub.subscribe(topic)
            nursery.start_soon(follow_announcements, sub, self.run_name, self.trainers, self._on_announce)
            nursery.start_soon(reannounce_loop, self.node, self.cfg.announce_interval, lambda: self.published,
                               self.deltas.published_offer)
            for signed in partial:  # resume interrupted downloads
                self._note_announced(signed.version, signed.root, signed.signer)
            for signed in partial:
                self._maybe_fetch(signed.version)
            self._refetch_damaged_manifests()
            nursery.start_soon(self._recheck_held)
            nursery.start_soon(self._catch_up)
            self.node.status["shards"] = self.status
            task_status.started(self)
            await trio.sleep_forever()


def _files(vs: VersionStore) -> list[str]:
    return [f.name for f in vs.manifest.files]


async def _quietly(fn, *args) -> None:
    """Run a best-effort push to one peer; its failure is that session's business."""
    try:
        await fn(*args)
    except (LocalProtocolError, AssertionError):
        raise
    except Exception:
        pass


async def serve_shards(node, sections: ShardsSections, ledger: LedgerAPI, *,
                       task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Run the shards service for ``node`` until cancelled (see the module docstring); hands back
    the :class:`ShardsService` once it serves. ``sections``: the run's ``[shards]`` table, the
    ``[grpo]`` staleness bounds that set how many versions are kept, and the stream budgets;
    ``ledger`` is credited with verified bytes."""
    await ShardsService(node, sections.kept(), ledger, sections.streams).run(task_status=task_status)
