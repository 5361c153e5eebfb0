"""The ledger service: the API other roles append through, gossip of new entries, anti-entropy sync.

How this works
--------------
* :class:`LedgerService` owns the replica (:class:`~node.ledger.chain.Ledger`, in memory) and the
  database (:class:`~node.ledger.store.LedgerStore`). Every entry, ours or a peer's, goes
  parse -> ``Ledger.check`` -> ``LedgerStore.commit`` -> ``Ledger.apply``; nothing is stored or
  forwarded before it is checked. One lock (``_store_lock``) is held from the check through the
  commit and the apply, so trio tasks never interleave inside one ingest or append.
* Gossip: new entries are published on ``/swarm/<run>/ledger/1``. A synchronous topic validator
  parses each message (size, schema, canonical bytes, signature) and runs the chain check before
  py-libp2p forwards it; rejected messages are counted and feed gossipsub's P4 penalty. Entries that
  arrive ahead of a gap are valid (forwarded) but not stored; they trigger a sync with the peer that
  published them.
* Anti-entropy on ``/swarm/ledger/1.1.0`` (pull, as in Demers et al., "Epidemic algorithms for
  replicated database maintenance", PODC 1987): every ``sync_interval`` (jittered) the node picks a
  random connected peer, both send their per-author heads (:class:`SyncHello`; the messages are in
  node/ledger/messages.py), and the caller asks for equivocation evidence it lacks, then for
  missing ranges in bounded batches
  (:class:`RangeRequest`, at most ``sync_batch`` entries and :data:`MAX_REPLY_BYTES` per reply). The
  answering side, seeing the caller's heads, schedules a pull of its own from the caller when the
  caller has something it lacks (push-pull), so a healed partition converges in one round trip each way.
* SQLite writes run in a worker thread, one at a time (node/dbthread.py): a durable commit of our
  own entry waits for an fsync, and the event loop must keep answering probes meanwhile. Each is one
  short transaction (one entry, or one batch of at most ``sync_batch``). Queries (ranges for sync
  answers, the conflicting entry of an equivocation) read the store's WAL reader on the trio thread,
  which never waits for the writer; a range is read under ``_store_lock``, so it holds everything
  the replica has applied.
* Receipts: downloaders call :meth:`LedgerService.note_received` per verified piece; the service
  adds them up and appends one ``receipts`` entry per ``receipt_interval``.
* Cuts (node/ledger/cut.py; the run-time rules are node/ledger/cutsync.py's): the run's cutter makes
  and adopts a trainer-signed cut every ``cut_every`` entries its replica took in; a sync session's
  caller that sees a newer cut in the answerer's hello fetches it in pages before any range, and adopts
  it under ``_store_lock`` (checked against its own history where it can, refused and logged as a fraud
  proof where it disagrees). Adopting swaps in the rebased replica and drops the entries at or below
  the cut's heads from the store in one transaction; the replica's storage then follows the number of
  authors and the entries since the cut, not the run's length.
* Versions (node/ledger/messages.py): sessions that may carry cuts go on ``/swarm/ledger/1.1.0``; a node
  of the release before cuts speaks ``1.0.0`` only and would refuse a hello naming a cut and score its
  sender down. So ``1.0.0`` is still served (by the same handler and budget: a hello without cut fields,
  no cut pages; a range below our cut is answered with no entries, as for any range we lack), and a
  caller falls back to it when the peer refuses ``1.1.0`` at negotiation, remembering such a peer for
  :data:`LEGACY_MEMORY` seconds (one refused negotiation per peer and period, not one per session: py-libp2p
  logs each as an error). A session on ``1.0.0`` neither names nor takes a cut.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import functools
import logging
import random
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

import trio
from libp2p.exceptions import BaseLibp2pError

from .. import hashes
from ..dbthread import DbThread
from ..net.budget import StreamLimits, StreamsConfig
from ..net.reqres import CallFailure, FailureKind, RequestResponse, messages, open_call
from ..peers import FaultRule
from ..wire import (
    MAX_FRAME,
    TRANSPORT_FAILURES,
    LocalProtocolError,
    Message,
    RemoteProtocolError,
)
from .api import LedgerError
from .chain import Evidence, Ledger, Outcome
from .config import LedgerConfig
from .cut import OpenedCut, ledger_from_cut, make_cut, open_cut, rebase, sign_cut
from .cutsync import CutPages, cutter_of, page_count, page_of, refusal
from .entries import (
    GENESIS,
    MAX_RECEIPT_ITEMS,
    Body,
    Penalty,
    ReceiptItem,
    Receipts,
    SignedEntry,
    check_receipt,
    make_entry,
    parse_entry,
)
from .messages import (
    MAX_AUTHORS,
    MAX_REPLY_BYTES,
    PROTOCOL,
    PROTOCOL_CUTS,
    CutPage,
    CutPageRequest,
    EvidenceReply,
    EvidenceRequest,
    RangeReply,
    RangeRequest,
    SyncHello,
)
from .store import LedgerStore, StoreFull, open_ledger_store, rebuild

log = logging.getLogger(__name__)

MAX_REQUESTS_PER_STREAM = 1024  # requests one sync session may make; the next session continues
VALIDATED_CACHE = 1024  # gossip entries parsed by the validator, awaiting the receive loop
SYNC_HINTS = 16  # queued "sync with this peer soon" requests; extra hints are dropped
MAX_PENDING_RECEIPTS = 4 * MAX_RECEIPT_ITEMS  # (peer, manifest) pairs waiting for the next flush
MAX_TRACKED_PEERS = 4096  # peers remembered for penalties and last-sync times (oldest dropped)
# Opening a stream normally takes milliseconds. py-libp2p 0.8.1 can keep a dead connection to a
# peer that restarted with the same key and try to open streams on it, which then hang; a short
# bound keeps one such peer from stalling anti-entropy for a whole sync_timeout.
STREAM_OPEN_TIMEOUT = 5.0
# The sync protocols a node offers as a caller, the one it prefers first, and serves (module docstring).
SYNC_PROTOCOLS = (PROTOCOL_CUTS, PROTOCOL)
LEGACY_MEMORY = 600.0  # seconds a peer that refused PROTOCOL_CUTS is called on PROTOCOL directly
# Set in the task serving a stream on PROTOCOL (the session of a node of the release before cuts).
_ON_LEGACY = contextvars.ContextVar("ledger_sync_on_legacy", default=False)
SYNC_WEIGHT = 20.0  # score points a peer loses per invalid entry it sends over sync (decaying)
BAN_SOURCE = "ledger"  # bans from penalty entries, as the peer table lists them
MAX_SYNC_SESSIONS = 32  # sync sessions answered at once; more wait
# Inbound sync sessions (node/net/budget.py): one peer holds at most 4 sessions (honest peers hold
# 1-2: ours with them and their push-pull) and 2 frames' worth of unfinished bytes (a SyncHello of
# MAX_AUTHORS heads is ~2.6 MiB); all peers together 8 frames, 32 MiB.
SYNC_LIMITS = StreamLimits(streams=MAX_SYNC_SESSIONS, streams_per_peer=4, frame_cap=MAX_FRAME,
                           buffer_bytes=8 * MAX_FRAME, buffer_per_peer=2 * MAX_FRAME)
# Reasons that are the sending peer's fault on a sync stream (as opposed to, e.g., our clock).
# "author-quota" too: a session takes the trusted authors' ranges first (_call_sync), so we know every
# trusted entry the peer had, and an honest peer stores no receipts beyond what those allow.
_SENDER_FAULTS = {"wrong-run", "unauthorized", "bad-link", "unrequested", "author-quota"}

# Gossip refusals that prove whoever sends the entry at fault: the entry alone shows it (the run's
# trainers and validators are the same for every node). Those judged against our chain are the
# author's fault only, a relay whose chain differs (a gap: it has not seen the entries before; a fork
# whose evidence has not reached it) forwards them in good faith; "future-timestamp" (our clock) and
# "author-quota" (the receipts our chain allows) prove no one at fault.
_GOSSIP_FORWARDER_FAULTS = {"wrong-run", "unauthorized"}
_GOSSIP_AUTHOR_FAULTS = {"equivocator", "bad-link", "time-regress"}


def _forwarder_at_fault(reason: str, forwarder: str, author: str) -> bool:
    """Whether a gossip entry refused for ``reason`` proves ``forwarder`` misbehaved (REJECT)."""
    return reason in _GOSSIP_FORWARDER_FAULTS or (reason in _GOSSIP_AUTHOR_FAULTS and forwarder == author)


# A session is a SyncHello, then up to MAX_REQUESTS_PER_STREAM range or evidence requests, each
# answered by the reply of its own type; its deadlines are [ledger] sync_timeout (set when served).
# Served on both protocols by one handler and budget; faults are counted under PROTOCOL on either.
SYNC: RequestResponse = RequestResponse(PROTOCOL_CUTS, messages(SyncHello, RangeRequest, EvidenceRequest, CutPageRequest),
                                        None, LedgerConfig.sync_timeout, limits=SYNC_LIMITS,
                                        per_stream=1 + MAX_REQUESTS_PER_STREAM, source=PROTOCOL)


@dataclass
class IngestReport:
    """What happened to a batch of incoming entries."""

    accepted: int = 0
    duplicates: int = 0
    gaps: list[str] = field(default_factory=list)  # authors we are behind on
    equivocations: int = 0
    rejected: collections.Counter = field(default_factory=collections.Counter)  # reason -> count


class LedgerService:
    """The ledger of one node, handed back by :func:`serve_ledger` (node/ledger/api.py: what others use).

    API for other roles: :meth:`append` (async), :meth:`note_received` (sync, batched),
    :meth:`totals`, :meth:`digest`, :meth:`status`.
    """

    def __init__(
        self,
        node,
        store: LedgerStore,
        config: LedgerConfig,
        wall_clock: Callable[[], float] = time.time,
        rng: random.Random | None = None,
        streams: StreamsConfig | None = None,
    ) -> None:
        self.node = node
        self.store = store
        self.config = config
        self.streams = streams or StreamsConfig()  # the sync handler's per-peer stream budgets (serve_ledger: the run's)
        self.topic = node.topic("ledger")
        self._wall_clock = wall_clock
        self._rng = rng or random.Random()
        run = node.config.run
        self.ledger = self._empty_replica()
        self._cut_raw: bytes | None = None  # the signed cut the replica is based on (served to peers in pages)
        self._bases: dict[str, int] = {}  # every author's head at that cut: the store holds its entries above
        self._since_cut = 0  # entries stored above the last cut (load counts the store's)
        self._cut_due = trio.Event()
        self._thread_reader = threading.local()  # .store: a worker thread's own reader (_in_thread)
        self.is_cutter = node.peer_id == cutter_of(run.trainers)  # cuts every cut_every entries when that is > 0
        self.cuts = collections.Counter()  # "made" / "adopted" / "refused" / ...
        # Hashes of trainer-signed cuts our history contradicts: not fetched and replayed again each session
        # (only cuts that opened with a trainer's signature get here, so peers cannot fill it).
        self._refused_cuts: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self.protocols = SYNC_PROTOCOLS  # offered as a caller, preferred first, and served
        self._legacy_until: collections.OrderedDict[str, float] = collections.OrderedDict()  # peer -> trio time
        self.rejections: collections.Counter = collections.Counter()  # "source/reason" -> count
        self.accepted: collections.Counter = collections.Counter()  # source -> entries accepted
        self._append_lock = trio.Lock()
        self._committing = 0  # entries of the ingest batch whose commit is in flight
        # Entries and evidence the replica took in that a full disk kept out of the store; committed
        # before anything else once there is room (bounded by the replica they are part of).
        self._unstored: list[SignedEntry] = []
        self._unstored_evidence: list[Evidence] = []
        self._pending: dict[tuple[str, int], SignedEntry] = {}  # the ingest batch the replica took in, not yet stored
        self._store_lock = trio.Lock()  # check -> commit -> apply (or a range read) without interleaving
        self.db = DbThread()  # the store's writes, off the event loop
        self._validated: collections.OrderedDict[bytes, SignedEntry] = collections.OrderedDict()
        self._hint_send, self._hint_recv = trio.open_memory_channel[str](SYNC_HINTS)
        self._receipts: dict[tuple[str, bytes], list[int]] = {}
        self._receipts_full = trio.Event()
        self._own_head_confirmed = False
        self._request_id = 0
        # Bad sync data costs a peer SYNC_WEIGHT points per offence (decaying); ledger bans are
        # listed in the peer table for status, enforced at intake by ban_of (no disconnect here).
        node.peers.set_rule(PROTOCOL, FaultRule(weight=SYNC_WEIGHT))
        node.peers.set_rule(BAN_SOURCE, FaultRule(disconnect=False))
        self.syncs = collections.Counter()  # "ok" / "failed" sessions as caller
        self.last_sync: dict[str, float] = {}  # peer -> wall time of the last completed session
        m = node.metrics
        self._m_entries = m.gauge("ledger_entries", "Entries in the local ledger replica")
        self._m_accepted = m.counter("ledger_accepted_total", "Ledger entries accepted", ["source"])
        self._m_flagged = m.gauge("ledger_flagged_authors", "Authors caught equivocating")

    def now_ms(self) -> int:
        return int(self._wall_clock() * 1000)

    def _empty_replica(self) -> Ledger:
        run = self.node.config.run
        return Ledger(run.name, run.trainers, run.validators, int(self.config.max_clock_skew * 1000),
                      self.config.limits(), history=self._entries)

    # ---------------------------------------------------------------- start-up

    async def load(self) -> dict[str, tuple[int, str]]:
        """Verify each author's stored tail, drop a broken one, and rebuild the replica."""
        problems = self.store.verify_tail(self.config.tail_verify)
        for author, (seq, reason) in problems.items():
            dropped = await self.db.run(self.store.truncate, author, seq)
            log.warning("ledger: %s's stored chain broken at seq %d (%s); dropped %d entries", author, seq, reason, dropped)
            self._reject("store", reason)
        for author, (seq, reason) in rebuild(self.store, self.ledger).items():  # from the newest stored cut on
            log.warning("ledger: stored %s not loaded from seq %d (%s)", author, seq, reason)
            self._reject("store", reason)
            if not author.startswith("evidence:"):
                await self.db.run(self.store.truncate, author, seq)  # peers re-supply it; a chain must stay contiguous
                problems[author] = (seq, reason)
        newest = self.store.latest_cut()
        self._cut_raw = newest[2] if newest else None
        self._bases = {a: seq for a, (seq, _h) in self.store.bases().items()}
        # Counted from what the store holds above the cut, not from this process's start: a cutter
        # restarted more often than every cut_every entries would never cut.
        self._since_cut = self.store.count()
        if self.is_cutter and self.config.cut_every and self._since_cut >= self.config.cut_every:
            self._cut_due.set()
        now = self.now_ms()
        for ban in self.ledger.bans(now).values():
            self.node.peers.ban(ban.peer, BAN_SOURCE, f"{ban.reason} (by {ban.by[-8:]})", (ban.until_ms - now) / 1000)
        self._update_gauges()
        return problems

    # ---------------------------------------------------------------- API

    async def append(self, body: Body) -> SignedEntry:
        """Sign, store durably, apply and publish a new entry of ours. LedgerError if refused."""
        async with self._append_lock:
            await self._confirm_own_head()
            me = self.node.peer_id
            head = self.ledger.head_of(me)
            prev = self.ledger.hash_at(me, head) if head else GENESIS
            # Never before our own head's time: the chain rules refuse time going backwards.
            last = self.ledger.last_time_ms(me)
            se = make_entry(self.node.identity, self.ledger.run, head + 1, prev, max(self.now_ms(), last), body)
            async with self._store_lock:
                decision = self.ledger.check(se, self.now_ms())
                if decision.outcome is not Outcome.ACCEPT:
                    raise LedgerError(f"cannot append {body.TYPE}: {decision.reason or decision.outcome.value}")
                # Durable before anyone can see it.
                try:
                    await self.db.run(functools.partial(self.store.commit, [se], durable=True))
                except StoreFull as e:
                    raise LedgerError(f"cannot append {body.TYPE}: {e}") from None
                self.ledger.apply(decision)
                self._took_in(1)
            self._list_bans([se], self.now_ms())
            self._m_accepted.labels(source="local").inc()
            self.accepted["local"] += 1
            self._update_gauges()
        try:
            await self.node.host.pubsub.publish(self.topic, se.raw)
            self.node.metrics.messages_out.labels(topic=self.topic).inc()
        except BaseLibp2pError as e:  # anti-entropy will carry it instead
            log.info("ledger: publishing seq %d failed (%s); peers will sync it", se.seq, e)
        return se

    async def _confirm_own_head(self) -> None:
        """Before our first append after start, pull once from a connected peer.

        A node that lost its database (or restored an old one) but whose entries peers still hold
        would otherwise sign a second, different entry for a seq it already used: an equivocation.
        One sync round first brings our own log back. With no peer connected we go ahead: there is
        nobody to learn from, and the risk only exists for a node whose disk lost committed data.
        """
        if self._own_head_confirmed:
            return
        self._own_head_confirmed = True
        connected = [p for p in self.node.host.connected_peers() if p != self.node.peer_id]
        if connected:
            await self.sync_with(self._rng.choice(connected))

    def note_received(self, peer: str, manifest_id: bytes, nbytes: int, pieces: int = 1) -> None:
        """Record verified bytes received from ``peer`` (batched into one receipt per interval).

        Called by the shard downloader for every verified piece; cheap, never blocks. ValueError for
        arguments that could never make a valid receipt (a caller's bug).
        """
        check_receipt(peer, manifest_id, nbytes, pieces)
        if peer == self.node.peer_id or nbytes == 0:
            return
        key = (peer, manifest_id)
        acc = self._receipts.get(key)
        if acc is None:
            if len(self._receipts) >= MAX_PENDING_RECEIPTS:
                self._reject("receipts", "backlog-full")
                return
            acc = self._receipts[key] = [0, 0]
        acc[0] += nbytes
        acc[1] += pieces
        if len(self._receipts) >= MAX_RECEIPT_ITEMS:
            self._receipts_full.set()

    async def flush_receipts(self) -> SignedEntry | None:
        """Append one receipts entry with up to MAX_RECEIPT_ITEMS pending pairs (None if none)."""
        if not self._receipts:
            return None
        if self.ledger.receipts_left(self.node.peer_id) == 0:
            # Our log holds all the receipts our standing allows (node/ledger/chain.py): peers would
            # refuse more, and the bytes would not count. Drop them; the allowance grows with the run.
            self._reject("receipts", "author-quota")
            log.info("ledger: %d receipts not recorded: this node's receipt allowance is used up",
                     len(self._receipts))
            self._receipts.clear()
            return None
        keys = sorted(self._receipts)[:MAX_RECEIPT_ITEMS]
        items = tuple(
            ReceiptItem(peer=p, manifest_id=m, nbytes=self._receipts[(p, m)][0], pieces=self._receipts[(p, m)][1])
            for p, m in keys
        )
        for k in keys:
            del self._receipts[k]
        return await self.append(Receipts(items=items))

    def totals(self, peer: str | None = None) -> dict[str, dict[str, int]]:
        return self.ledger.totals(peer)

    def digest(self) -> bytes:
        return self.ledger.digest()

    def ban_of(self, peer: str):
        """The active ban on ``peer`` from any trainer's or validator's penalty entry, or None."""
        return self.ledger.ban_of(peer, self.now_ms())

    def accepted_samples(self, peer: str) -> int:
        """Samples of ``peer``'s rollouts trainers recorded as trained (node/rollouts/quota.py's history)."""
        return self.ledger.accepted_samples(peer)

    def stored_entries(self) -> int:
        """Entries in the replica that are also in the database (not the batch being committed)."""
        return len(self.ledger) - sum(self._bases.values()) - self._committing - len(self._unstored)

    def status(self) -> dict:
        """For ``swarm-node status``."""
        me, now = self.node.peer_id, self.now_ms()
        return {
            "entries": self.stored_entries(),
            "authors": len(self.ledger.authors()),
            "own_seq": self.ledger.head_of(me),
            # The trainers' and validators' heads as this replica holds them: how far behind their
            # writers the replicas are, while they write (bench/soak.py's replication lag).
            "trusted_heads": {a: self.ledger.head_of(a) for a in sorted(self.ledger.trusted)},
            "digest": self.ledger.digest().hex()[:16],
            "flagged": self.ledger.flagged(),
            "bans": {p: {"seconds_left": round((b.until_ms - now) / 1000), "reason": b.reason, "by": b.by}
                     for p, b in self.ledger.bans(now).items()},
            "accepted": dict(self.accepted),
            "rejected": dict(self.rejections),
            "syncs": dict(self.syncs),
            "pending_receipts": len(self._receipts),
            "cut": self.ledger.cut_number,
            "cuts": dict(self.cuts),
        }

    # ---------------------------------------------------------------- ingest (all inputs)

    async def ingest(self, items: Iterable[bytes | SignedEntry], source: str) -> IngestReport:
        """Check and store incoming entries; one transaction for the batch. Never raises for bad input."""
        async with self._store_lock:
            return await self._ingest_locked(items, source)

    async def _ingest_locked(self, items: Iterable[bytes | SignedEntry], source: str) -> IngestReport:
        report = IngestReport()
        pending: list[SignedEntry] = []
        self._pending = pending_by_key = {}
        evidence: list[Evidence] = []
        now = self.now_ms()
        for item in items:
            try:
                se = item if isinstance(item, SignedEntry) else parse_entry(item)
            except RemoteProtocolError as e:
                report.rejected[e.reason] += 1
                self._reject(source, e.reason)
                continue
            decision = self.ledger.check(se, now)
            if decision.outcome is Outcome.ACCEPT:
                self.ledger.apply(decision)
                pending.append(se)
                pending_by_key[(se.author, se.seq)] = se
                report.accepted += 1
            elif decision.outcome is Outcome.DUPLICATE:
                report.duplicates += 1
            elif decision.outcome is Outcome.GAP:
                if se.author not in report.gaps:
                    report.gaps.append(se.author)
            elif decision.outcome is Outcome.EQUIVOCATION:
                ev = Evidence(self._entries(se.author, decision.conflict_seq, decision.conflict_seq)[0], se)
                if self.ledger.add_evidence(ev):
                    evidence.append(ev)
                    log.warning("ledger: %s equivocated at seq %d", se.author, ev.fork_seq)
                report.equivocations += 1
                self._reject(source, "equivocation")
            else:
                report.rejected[decision.reason] += 1
                self._reject(source, decision.reason)
        # The replica took these in to check the rest of the batch against them; until the commit
        # in the worker thread returns they are not stored, and a kill -9 now loses them (peers
        # still hold them; anti-entropy brings them back). Status counts only stored entries.
        self._committing = len(pending)
        try:
            await self._store(pending, evidence)
        finally:
            self._committing = 0
            self._pending = {}
        self._list_bans(pending, now)
        self._took_in(report.accepted)
        if report.accepted:
            self._m_accepted.labels(source=source).inc(report.accepted)
            self.accepted[source] += report.accepted
        self._update_gauges()
        return report

    async def _store(self, entries: list[SignedEntry], evidence: list[Evidence]) -> None:
        """Commit what the replica took in, after anything a full disk held back. On a full disk the
        node keeps running: all of it stays in memory until a later commit finds room (a restart
        before then loses it from this replica; peers hold it and anti-entropy brings it back)."""
        entries, evidence = self._unstored + entries, self._unstored_evidence + evidence
        try:
            await self.db.run(self.store.commit, entries, evidence)
        except StoreFull as e:
            if not self._unstored and not self._unstored_evidence:
                log.warning("ledger: %s: entries are kept in memory until there is room", e)
            self._unstored, self._unstored_evidence = entries, evidence
            return
        if self._unstored or self._unstored_evidence:
            log.info("ledger: %d entries held back by a full disk are stored", len(self._unstored))
        self._unstored, self._unstored_evidence = [], []

    def _entries(self, author: str, start: int, end: int) -> list[SignedEntry]:
        """Entries ``start..end`` of ``author`` that the replica holds, wherever they are now: in the
        ingest batch not yet committed, held back by a full disk, or stored (the replica's history)."""
        held = {key: u for u in self._unstored if (key := (u.author, u.seq))[0] == author}
        held.update(self._pending)
        store = getattr(self._thread_reader, "store", None) or self.store
        stored = {se.seq: se for se in store.entries(author, start, end)}
        out = []
        for seq in range(start, end + 1):
            se = held.get((author, seq)) or stored.get(seq)
            if se is None:
                raise LocalProtocolError(f"ledger holds {author} seq {seq} but the store does not")
            out.append(se)
        return out

    async def ingest_evidence(self, raw_a: bytes, raw_b: bytes, source: str) -> bool:
        """Check and store an equivocation proof from a peer. True if it lowered a fork point."""
        async with self._store_lock:
            return await self._ingest_evidence_locked(raw_a, raw_b, source)

    async def _ingest_evidence_locked(self, raw_a: bytes, raw_b: bytes, source: str) -> bool:
        try:
            ev = Evidence(parse_entry(raw_a), parse_entry(raw_b))
            if self.ledger.authority_problem(ev.a) or self.ledger.authority_problem(ev.b):
                raise RemoteProtocolError("evidence-not-ours")
            if not self.ledger.add_evidence(ev):
                return False
        except RemoteProtocolError as e:
            self._reject(source, e.reason)
            return False
        await self._store([], [ev])
        log.warning("ledger: %s equivocated at seq %d (evidence from %s)", ev.author, ev.fork_seq, source)
        self._update_gauges()
        return True

    def _reject(self, source: str, reason: str) -> None:
        self.rejections[f"{source}/{reason}"] += 1
        self.node.metrics.reject(source, reason)

    def _update_gauges(self) -> None:
        self._m_entries.set(len(self.ledger))
        self._m_flagged.set(len(self.ledger.flagged()))

    def _penalize(self, peer: str, reason: str) -> None:
        self.node.peers.report(peer, PROTOCOL, reason)
        log.info("ledger: peer %s sent bad ledger data (%s)", peer, reason)

    def _list_bans(self, entries: Iterable[SignedEntry], now_ms: int) -> None:
        """Tell the peer table about bans that penalty entries among ``entries`` give."""
        for se in entries:
            if isinstance(se.body, Penalty) and se.body.ban_seconds > 0:
                ban = self.ledger.ban_of(se.body.peer, now_ms)
                if ban is not None:
                    self.node.peers.ban(ban.peer, BAN_SOURCE, f"{ban.reason} (by {ban.by[-8:]})",
                                        (ban.until_ms - now_ms) / 1000)

    # ---------------------------------------------------------------- cuts

    def _took_in(self, n: int) -> None:
        self._since_cut += n
        if self.is_cutter and self.config.cut_every and n and self._since_cut >= self.config.cut_every:
            self._cut_due.set()

    async def _cut_loop(self) -> None:
        while True:
            await self._cut_due.wait()
            self._cut_due = trio.Event()
            await self.cut_now()

    async def cut_now(self) -> OpenedCut | None:
        """Cut the replica as it stands, sign, adopt and offer the cut (the run's cutter; module doc)."""
        async with self._store_lock:
            if self._unstored:
                return None  # the store lacks entries the cut would cover: after the disk has room
            now = self.now_ms()

            def seal() -> tuple[bytes, OpenedCut]:
                cut = make_cut(self.ledger, time_ms=now, keep_versions=self.config.keep_versions,
                               keep_steps=self.config.keep_steps)
                raw = sign_cut(self.node.identity, cut)
                return raw, open_cut(raw, self.ledger)

            try:
                raw, opened = await self._in_thread(seal)
            except (LocalProtocolError, RemoteProtocolError, ValueError) as e:
                # A cut we cannot make (a bug, a bound passed) must not end the node, nor be tried again at
                # once: the next try is another cut_every entries away.
                self._since_cut = 0
                self.cuts["failed"] += 1
                log.error("ledger: cannot make a cut: %s", e)
                return None
            cut = opened.cut
            if not await self._adopt_locked(opened, raw, check=False):
                return None
        self.cuts["made"] += 1
        log.info("ledger: made cut %d (%d bytes) at %d entries", cut.number, len(raw), len(self.ledger))
        return opened

    async def _in_thread(self, work):
        """``work()`` in a worker thread (a cut of a thousand workers is megabytes: making, checking and
        loading one takes seconds the event loop must not lose), under ``_store_lock``, which keeps the
        replica unchanged meanwhile. The store's reader belongs to the trio thread: the history is read
        through one of the worker's own."""
        def run():
            self._thread_reader.store = reader = LedgerStore(self.store.path, read_only=True)
            try:
                return work()
            finally:
                self._thread_reader.store = None
                reader.close()

        return await trio.to_thread.run_sync(run)

    def _base_replica(self) -> Ledger:
        """An empty replica based on our own cut (what a cut following it is replayed from)."""
        if self._cut_raw is None:
            return self._empty_replica()
        return ledger_from_cut(open_cut(self._cut_raw, self._empty_replica()), self.ledger, self._entries)

    async def _adopt_locked(self, opened: OpenedCut, raw: bytes, *, check: bool = True, source: str = "") -> bool:
        """Base the replica on ``opened`` and drop the stored entries at or below its heads (under
        ``_store_lock``); False when it is refused (logged) or cannot be stored now."""
        cut = opened.cut
        if cut.number <= self.ledger.cut_number or self._unstored:
            return False

        def check_and_rebase() -> tuple[str | None, Ledger | None]:
            if check:
                problem = refusal(self.ledger, opened, self._bases, self._entries, self._base_replica)
                if problem:
                    return problem, None
            return None, rebase(self.ledger, opened, self._entries)

        try:
            problem, rebased = await self._in_thread(check_and_rebase)
        except (RemoteProtocolError, ValueError) as e:  # a trainer-signed cut that does not load: refused, not fatal
            problem, rebased = f"unloadable: {getattr(e, 'reason', '') or e}"[:120], None
        if problem:
            self._refuse_cut(opened, raw, problem, source)
            return False
        heads = {log.author: (log.seq, log.hash) for log in cut.logs}
        try:
            dropped = await self.db.run(self.store.adopt_cut, cut.number, opened.hash, raw, heads)
        except (StoreFull, ValueError) as e:  # ValueError: the store holds a newer cut already
            log.warning("ledger: cut %d not adopted: %s", cut.number, e)
            return False
        self.ledger = rebased
        self._bases = {a: seq for a, (seq, _h) in heads.items() if seq}
        self._cut_raw = raw
        self._since_cut = 0
        self.cuts["adopted"] += 1
        self._update_gauges()
        log.info("ledger: based on cut %d by %s; %d stored entries dropped", cut.number, opened.signer[-8:], dropped)
        return True

    def _refuse_cut(self, opened: OpenedCut, raw: bytes, problem: str, source: str) -> None:
        """A trainer-signed cut our own history contradicts: keep the history, keep the cut as proof."""
        self.cuts["refused"] += 1
        self._reject("cut", problem)
        self._refused_cuts[opened.hash] = None
        while len(self._refused_cuts) > 64:
            self._refused_cuts.popitem(last=False)
        proof = self.node.data_dir / f"ledger-refused-cut-{opened.cut.number}.bin"
        try:
            proof.write_bytes(raw)
        except OSError as e:
            proof = f"not saved: {e}"
        log.error("ledger: REFUSED cut %d signed by trainer %s (from %s): %s. This replica's history disagrees "
                  "with it: the signed cut (%s) and the entries up to its heads are a fraud proof against that "
                  "trainer, for the run's operator; the replica keeps its history", opened.cut.number,
                  opened.signer, source or "us", problem, proof)

    async def _fetch_cut(self, caller, peer: str, number: int, cut_hash: bytes) -> None:
        """Fetch, open and adopt the cut ``number`` a peer's hello named (module doc); CallFailure
        (GARBAGE, the peer reported) when its pages or the cut they make are not what it announced."""
        if len(cut_hash) != 32:
            raise caller.garbage("bad-cut-hash", f"{len(cut_hash)} bytes")
        pages = CutPages(number, cut_hash)
        while not pages.done:
            reply = await self._ask(caller, CutPageRequest(id=self._next_id(), number=number,
                                                           index=pages.next_index), CutPage)
            if reply.count == 0 and not reply.data and reply.number == number:
                self.cuts["not-held"] += 1  # it moved on to a newer cut since its hello (or cannot serve it)
                return
            try:
                pages.add(reply)
            except RemoteProtocolError as e:
                raise caller.garbage(e.reason, e.detail) from None
        try:
            raw = pages.raw()
            opened = await trio.to_thread.run_sync(open_cut, raw, self.ledger)
            if opened.cut.number != number:
                raise RemoteProtocolError("cut-number", f"{opened.cut.number} != {number}")
        except RemoteProtocolError as e:
            if e.reason == "old-cut" and self.ledger.cut_number >= number:
                return  # we adopted it (or a newer one) meanwhile
            raise caller.garbage(e.reason, e.detail) from None
        async with self._store_lock:
            # The work is done and the cut is right: a session deadline passing now must not waste it.
            with trio.CancelScope(shield=True):
                await self._adopt_locked(opened, raw, source=peer)

    def _hello(self, cuts: bool = True) -> SyncHello:
        """Our heads, and the cut we are based on where the session may name one (``cuts``)."""
        heads = tuple(self.ledger.heads()[:MAX_AUTHORS])
        if self._cut_raw is None or not cuts:
            return SyncHello(heads=heads)
        return SyncHello(heads=heads, cut_number=self.ledger.cut_number, cut_hash=self.ledger.cut_hash)

    def _cut_page(self, msg: CutPageRequest) -> CutPage:
        raw = self._cut_raw
        if raw is None or msg.number != self.ledger.cut_number:
            return CutPage(id=msg.id, number=msg.number, index=msg.index, count=0, data=b"")
        count = page_count(len(raw))
        if msg.index >= count:
            raise RemoteProtocolError("bad-cut-page", f"{msg.index} of {count}")
        return CutPage(id=msg.id, number=msg.number, index=msg.index, count=count, data=page_of(raw, msg.index))

    # ---------------------------------------------------------------- gossip

    def validate_gossip(self, forwarder, msg) -> bool:
        """py-libp2p topic validator: True lets the message be delivered and forwarded."""
        try:
            se = parse_entry(msg.data)
        except RemoteProtocolError as e:
            self._reject(self.topic, e.reason)
            return False
        decision = self.ledger.check(se, self.now_ms())
        if decision.outcome is Outcome.REJECT:
            self._reject(self.topic, decision.reason)
            # False costs the forwarder gossip score (node/net/host.py); an entry refused for a reason
            # that does not prove it at fault is let through (IGNORE) and the receive loop drops it.
            return not _forwarder_at_fault(decision.reason, str(forwarder), se.author)
        # GAP and EQUIVOCATION are forwarded: the entry is validly signed, and others need it too.
        self._validated[hashes.digest(msg.data)] = se
        while len(self._validated) > VALIDATED_CACHE:
            self._validated.popitem(last=False)
        return True

    async def _receive_loop(self, subscription) -> None:
        while True:
            msg = await subscription.get()
            se = self._validated.pop(hashes.digest(msg.data), None)
            self.node.metrics.messages_in.labels(topic=self.topic).inc()
            report = await self.ingest([se if se is not None else msg.data], self.topic)
            if report.gaps:
                try:
                    from libp2p.peer.id import ID

                    self.hint_sync(ID(msg.from_id).to_base58())
                except Exception:  # a malformed origin id only costs us the hint  # noqa: BLE001
                    self.hint_sync(None)

    def hint_sync(self, peer: str | None) -> None:
        """Ask the sync loop for a round soon (with ``peer`` if connected). Drops when busy."""
        try:
            self._hint_send.send_nowait(peer or "")
        except trio.WouldBlock:
            pass

    # ---------------------------------------------------------------- anti-entropy: caller

    async def _sync_loop(self) -> None:
        interval = self.config.sync_interval
        while True:
            peer = ""
            with trio.move_on_after(interval * self._rng.uniform(0.5, 1.5)):
                peer = await self._hint_recv.receive()
            connected = [p for p in self.node.host.connected_peers() if p != self.node.peer_id]
            if not connected:
                continue
            if peer not in connected:
                peer = self._rng.choice(connected)
            await self.sync_with(peer)

    async def sync_with(self, peer: str) -> IngestReport:
        """One anti-entropy session with ``peer`` as the caller. Never raises for remote faults."""
        total = IngestReport()
        with trio.move_on_after(self.config.sync_timeout) as scope:
            try:
                await self._call_sync(peer, total)
                self.syncs["ok"] += 1
                self.last_sync.pop(peer, None)
                self.last_sync[peer] = self._wall_clock()
                while len(self.last_sync) > MAX_TRACKED_PEERS:
                    del self.last_sync[next(iter(self.last_sync))]
            except CallFailure as e:
                self.syncs["failed"] += 1
                if e.kind is FailureKind.GARBAGE:  # already reported to the peer table by the caller
                    self._reject(PROTOCOL, e.reason)
                    log.info("ledger: peer %s sent bad ledger data (%s)", peer, e.reason)
                else:
                    if e.kind is FailureKind.UNREACHABLE and e.detail.startswith("TooSlowError"):
                        self.syncs["open-timeout"] += 1
                    log.debug("ledger: sync with %s broke off: %s", peer, e)
        if scope.cancelled_caught:
            self.syncs["timeout"] += 1
        return total

    def _next_id(self) -> int:
        self._request_id = (self._request_id + 1) % 2**32
        return self._request_id

    async def _ask(self, caller, request: Message, cls):
        """One request on a sync session and its reply of type ``cls`` (with the request's id)."""
        reply = await caller.ask(request, messages(cls), self.config.sync_timeout)
        if hasattr(request, "id") and reply.id != request.id:
            raise caller.garbage("wrong-id", f"{reply.id} != {request.id}")
        return reply

    async def _call_sync(self, peer: str, total: IngestReport) -> None:
        async with contextlib.AsyncExitStack() as stack:
            caller = await self._open_session(stack, peer)
            cuts = caller.protocol == PROTOCOL_CUTS
            hello = await self._ask(caller, self._hello(cuts), SyncHello)
            if cuts and hello.cut_number > self.ledger.cut_number and hello.cut_hash not in self._refused_cuts:
                # it holds nothing below that cut: take it first
                await self._fetch_cut(caller, peer, hello.cut_number, hello.cut_hash)
            requests = 0
            _, evidence_authors = self.ledger.missing(hello.heads)
            for author in evidence_authors:
                if requests >= MAX_REQUESTS_PER_STREAM:
                    return
                requests += 1
                reply = await self._ask(caller, EvidenceRequest(id=self._next_id(), author=author), EvidenceReply)
                if reply.a and reply.b:
                    await self.ingest_evidence(reply.a, reply.b, PROTOCOL)
            wants, _ = self.ledger.missing(hello.heads)  # again: new evidence caps what we want
            # Trusted authors first: their entries decide what the others may hold (author-quota).
            wants.sort(key=lambda w: w.author not in self.ledger.trusted)
            for want in wants:
                start = want.start
                while start <= want.end and requests < MAX_REQUESTS_PER_STREAM:
                    requests += 1
                    end = min(want.end, start + self.config.sync_batch - 1)
                    request = RangeRequest(id=self._next_id(), author=want.author, start=start, end=end)
                    reply = await self._ask(caller, request, RangeReply)
                    if not reply.entries:
                        break
                    report = await self._ingest_range(peer, want.author, start, reply.entries)
                    _merge(total, report)
                    if report.rejected or report.gaps or report.equivocations:
                        break  # this author's range from this peer is not usable further
                    start += len(reply.entries)
                    if report.accepted == 0 and report.duplicates == 0:
                        break

    async def _open_session(self, stack: contextlib.AsyncExitStack, peer: str):
        """A caller on the newest of our protocols ``peer`` speaks (module docstring: Versions)."""
        now = trio.current_time()
        offered = [p for p in self.protocols if not (p == PROTOCOL_CUTS and self._legacy_until.get(peer, -1.0) > now)]
        for protocol in offered[:-1]:
            try:
                return await stack.enter_async_context(self._call_on(peer, protocol))
            except CallFailure as e:
                # A refused negotiation is an UNREACHABLE failure of no timeout; a peer really
                # unreachable fails again at once on the next protocol and is reported as such.
                if e.kind is not FailureKind.UNREACHABLE or e.detail.startswith("TooSlowError"):
                    raise
                self._legacy_until.pop(peer, None)
                self._legacy_until[peer] = now + LEGACY_MEMORY
                while len(self._legacy_until) > MAX_TRACKED_PEERS:
                    self._legacy_until.popitem(last=False)
        return await stack.enter_async_context(self._call_on(peer, offered[-1]))

    def _call_on(self, peer: str, protocol: str):
        return open_call(self.node.host, peer, protocol, open_timeout=STREAM_OPEN_TIMEOUT, peers=self.node.peers,
                         source=PROTOCOL)

    async def _ingest_range(self, peer: str, author: str, start: int, raws: tuple[bytes, ...]) -> IngestReport:
        parsed: list[SignedEntry] = []
        report = IngestReport()
        for i, raw in enumerate(raws):
            try:
                se = parse_entry(raw)
            except RemoteProtocolError as e:
                report.rejected[e.reason] += 1
                self._reject(PROTOCOL, e.reason)
                self._penalize(peer, e.reason)
                break
            if se.author != author or se.seq != start + i:
                report.rejected["unrequested"] += 1
                self._reject(PROTOCOL, "unrequested")
                self._penalize(peer, "unrequested")
                break
            parsed.append(se)
        sub = await self.ingest(parsed, PROTOCOL)
        _merge(report, sub)
        if any(r in _SENDER_FAULTS for r in sub.rejected):
            self._penalize(peer, ",".join(sorted(sub.rejected)))
        return report

    # ---------------------------------------------------------------- anti-entropy: answerer

    def sync_handlers(self) -> dict[str, Callable]:
        """The stream handlers answering sync sessions, by protocol: one handler and budget, told on
        ``/swarm/ledger/1.0.0`` that the session is of a node of the release before cuts."""
        sync = replace(SYNC, timeout=self.config.sync_timeout, stream_timeout=self.config.sync_timeout)
        handler = sync.handler(self._answer, on_fault=self._sync_fault, streams=self.streams,
                               peers=self.node.peers, metrics=self.node.metrics)

        async def legacy(stream) -> None:
            token = _ON_LEGACY.set(True)  # for this stream's session only
            try:
                await handler(stream)
            finally:
                _ON_LEGACY.reset(token)

        legacy.inbound = handler.inbound  # the host lists it in status (streams)
        return {p: handler if p == PROTOCOL_CUTS else legacy for p in self.protocols}

    def _sync_fault(self, peer: str, reason: str) -> None:
        if reason == "timeout":
            self._reject(PROTOCOL, reason)
        elif reason not in TRANSPORT_FAILURES:
            self._reject(PROTOCOL, reason)
            self._penalize(peer, reason)

    async def _answer(self, peer: str, msg: Message) -> Message:
        legacy = _ON_LEGACY.get()
        if isinstance(msg, SyncHello):  # a session's first frame: both sides' heads
            wants, evidence = self.ledger.missing(msg.heads)
            if wants or evidence or (not legacy and msg.cut_number > self.ledger.cut_number):
                self.hint_sync(peer)  # push-pull: the caller has something we lack
            return self._hello(cuts=not legacy)
        if isinstance(msg, RangeRequest):
            if msg.end < msg.start:
                raise RemoteProtocolError("bad-range", f"{msg.start}..{msg.end}")
            limit = min(self.config.sync_batch, msg.end - msg.start + 1)
            async with self._store_lock:  # after any commit in flight: the range holds what the replica has
                raws = self.store.range(msg.author, msg.start, msg.end, limit=limit, max_bytes=MAX_REPLY_BYTES)
            return RangeReply(id=msg.id, entries=tuple(raws))
        if isinstance(msg, CutPageRequest) and not legacy:
            return self._cut_page(msg)
        if isinstance(msg, EvidenceRequest):
            ev = self.ledger.evidence(msg.author)
            return EvidenceReply(id=msg.id, a=ev.a.raw if ev else b"", b=ev.b.raw if ev else b"")
        raise RemoteProtocolError("unexpected-message", msg.TYPE)

    # ---------------------------------------------------------------- receipts

    async def _receipt_loop(self) -> None:
        while True:
            with trio.move_on_after(self.config.receipt_interval):
                await self._receipts_full.wait()
            self._receipts_full = trio.Event()
            try:
                await self.flush_receipts()
            except LedgerError as e:  # e.g. our own log is flagged: keep the node running
                log.error("ledger: receipts not recorded: %s", e)


def _merge(into: IngestReport, other: IngestReport) -> None:
    into.accepted += other.accepted
    into.duplicates += other.duplicates
    into.equivocations += other.equivocations
    into.gaps.extend(a for a in other.gaps if a not in into.gaps)
    into.rejected.update(other.rejected)


async def serve_ledger(
    node,
    config: LedgerConfig,
    streams: StreamsConfig,
    *,
    wall_clock: Callable[[], float] = time.time,
    task_status=trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the ledger of ``node`` until cancelled (see the module docstring): ``config`` is the run's
    ``[ledger]`` table, ``streams`` its per-peer stream budgets."""
    with open_ledger_store(node.data_dir) as store:
        await trio.to_thread.run_sync(store.bind_run, node.run.name)
        service = LedgerService(node, store, config, wall_clock=wall_clock, streams=streams)
        problems = await service.load()
        if problems:
            log.warning("ledger: repaired %d broken author tails on open", len(problems))
        for protocol, handler in service.sync_handlers().items():
            node.host.set_handler(protocol, handler)
        node.host.pubsub.set_topic_validator(service.topic, service.validate_gossip, False)
        subscription = await node.host.pubsub.subscribe(service.topic)
        node.status["ledger"] = service.status
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(service._receive_loop, subscription)
                nursery.start_soon(service._sync_loop)
                nursery.start_soon(service._receipt_loop)
                if service.is_cutter and config.cut_every:
                    nursery.start_soon(service._cut_loop)
                task_status.started(service)
        finally:
            # Bytes already received deserve their receipt; give the flush a moment, no more.
            with trio.CancelScope(shield=True) as scope:
                scope.deadline = trio.current_time() + 2
                try:
                    await service.flush_receipts()
                except (LedgerError, BaseLibp2pError):
                    pass
            node.host.pubsub.remove_topic_validator(service.topic)
            await service.db.stop()  # other services' appends may be committing: the store closes after
