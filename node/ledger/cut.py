"""Ledger cuts: a trainer-signed state of the replica that later entries build on, history prunable below it.

How this works
--------------
Issue 46 item 4: every entry is replicated to every peer forever, so a new node's catch-up and a
replica's storage grow with the run's history (``bench/ledger.py --scale``: a week of 1,000 workers at
the demo's rates is 10^8-10^9 entries). A *cut* is the replica's state at one set of author heads, in a
form whose size follows the number of peers and the run's rates, never its length; a replica based on
a cut needs none of the entries at or below it, and a new node is caught up with the latest cut and
the entries above it.

What a cut holds (:class:`Cut`; :meth:`~node.ledger.chain.Ledger.base_parts` computes it):

* per author its usable head (seq and hash: the next entry's ``prev`` chains onto it), last time
  stamp and receipts count (the time-regress and quota rules go on exactly), fork seq and the
  :class:`~node.ledger.chain.Evidence` pair of a flagged author (whose log the cut closes);
* per peer every total of :data:`~node.ledger.entries.TOTAL_FIELDS` and the bytes trainers' and
  validators' receipts vouch for it (its standing, :meth:`Ledger.vouched`);
* the *open* part of the per-batch and per-checkpoint state, bounded by windows: ``open_version``
  is the oldest checkpoint version still open (the newest published minus ``keep_versions - 1``),
  and each worker's ``open_step`` the oldest of its draw steps still open (the highest its claimed
  batches name minus ``keep_steps - 1``). Batch claims (a batch counts once, at its largest claim)
  are kept for batches of open draw steps; bytes vouched per (voucher, manifest) and the published
  sizes only for manifests of open versions. What closed manifests gave is added into the peers'
  ``bytes_served``;
* bans still running at the cut's time;
* the run, its number (1, 2, ... one cut after another), the hash of the signed cut it follows
  (``prev``: cuts form a chain as each author's entries do), the cut's time and the replica's
  :meth:`Ledger.digest` at its heads.

The windows are in numbers the entries carry, not in arrival order: every published size carries its
manifest's version (trainer-stamped), every batch credit its worker and draw step (the entry's
``worker`` and ``step``; the batch's id commits to both, and a worker's draw steps are its own
counter, node/rollouts/steps.py, not a clock shared by the run: in soak60b's inference-1 database
batches name draw steps up to 1,131 beside 679 published checkpoints), and after a cut **a credit of a closed version or draw step counts nothing**, at
every replica based on that cut, whatever order entries arrive in. That is the one rule the cut
changes: a batch re-recorded above the cut (a second trainer, a replayed verdict) is still counted
once, by the cut when it is closed and by the open claims when it is not. A trainer refuses a draw
step more than its step window behind the worker's highest (``step-behind``), so with ``keep_steps``
above that window and the validators' lag an honest batch never loses credit (soak60b's
inference-1: every claim within 37 steps of its worker's highest so far).

Who signs it and when: a trainer of the run (the run file lists them; they already sign the
manifests every node trusts), every ``cut_interval`` of its own entries, from its own replica as it
stands (:func:`make_cut`, :func:`sign_cut`), and gossips it. Ed25519 signing is deterministic and the
parts are canonical, so two trainers cutting at the same heads sign the same payload.

How a replica takes one:

1. :func:`open_cut`: schema, signature, a signer among the run's trainers, the right run, and a
   number above the cut the replica is based on (an older cut, or one of another run, is refused).
2. A replica that holds the entries up to the cut's heads rebuilds its own state there
   (:func:`replay_to`: its base and the entries between, the cut's evidence applied) and compares
   (:func:`cut_problem`). A replica still missing some of them is *behind*, not wronged: it syncs
   first. One that disagrees refuses the cut and keeps its history. Trainers are trusted by the run
   file (they sign the checkpoints and judge every batch already), so a wrong cut is not scored like
   a peer's garbage: the signed cut and the entries it contradicts are a fraud proof anyone holding
   both can check, logged for the run's operator; the node goes on without it.
3. :func:`rebase`: the new replica is :func:`ledger_from_cut` plus the replica's own entries above
   the cut's heads and its own evidence; its store may then drop everything at or below the heads.
   A new node has no history to check the cut against: it trusts the trainer's signature, as it
   trusts the trainer's manifests.

Known limit: a replica that holds another branch of a forked author than the one the cut took
replays to other heads (``other-heads``) and cannot check the cut from its store alone; it needs
the cut's branch of that author from the peer offering the cut (which with its own branch is the
evidence that flags the author) and then checks the cut with that branch.

What a peer can still prove after pruning, and what not:

* Equivocation evidence is a pair of signed entries and needs nothing of ours, so a fork is
  provable after pruning by anyone who holds both entries: the author is flagged from then on (no
  more entries join its log, credits of its entries above the cut are taken back), but a cut is
  final: the totals up to it stand. An entry at or below an author's cut head that is not the head
  is refused (``below-cut``), as is one right above it that does not chain onto it (``off-cut``): the
  replica no longer holds the entry it would conflict with, so it cannot make the evidence itself.
* Totals up to a cut are provable against the trainer's signature, and, by a replica that kept the
  entries, against the entries. Per-entry questions below the cut ("did this batch count?") need a
  replica that kept the history (trainers and archives may keep it all).
* A trainer that equivocates on a cut (two different cuts with one number) signs both; like a fork in
  its entries this is evidence against it (detection at the gossip layer, not here).

Pure: time comes in as ``time_ms``; no I/O.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import ClassVar

from .. import hashes
from ..wire import Envelope, Message, RemoteProtocolError, bounded, register
from .chain import _CLAIM, BaseParts, Evidence, History, Ledger, LedgerBan
from .entries import GENESIS, MAX_ENTRY, MAX_PEER_ID, MAX_REASON, MAX_SEQ, TOTAL_FIELDS, parse_entry
from .summary import open_signed, sign

DOMAIN = "ledger-cut"
# A cut's size follows the peers and the open window (bench/ledger.py --scale prints it): 1,000 workers
# and a demo's window are well under 16 MiB. It is one message here; on the wire it will go in pages
# under one signed root (node.wire.MAX_FRAME is 4 MiB), the wiring's step.
MAX_CUT_BYTES = 64 * 1024 * 1024
MAX_CUT_PEERS = 100_000
MAX_CUT_RECORDS = 1_000_000
# A claim on an open batch is chain.py's _CLAIM record, peers by index in Cut.rows; bytes vouched for one
# peer: peer index, the sum in two unsigned halves (sums may pass 2^64: node/ledger/chain.py _VOUCHED_WIDE).
_VOUCH = struct.Struct(">IQQ")
_LOW64 = 2**64 - 1


@register
@dataclass(frozen=True)
class CutLog(Message):
    """One author's log at the cut (see the module docstring)."""

    TYPE: ClassVar[str] = "ledger-cut-log"
    author: str = bounded(max_len=MAX_PEER_ID)
    seq: int = bounded(min=0, max=MAX_SEQ)
    hash: bytes = bounded(exact_len=32)
    last_time_ms: int = bounded(min=0, max=MAX_SEQ)
    receipts: int = bounded(min=0, max=MAX_SEQ)
    fork_seq: int = bounded(min=0, max=MAX_SEQ)
    evidence: tuple[bytes, ...] = bounded(max_len=2, item_max_len=MAX_ENTRY, default=())  # two raw entries when flagged


@register
@dataclass(frozen=True)
class CutRow(Message):
    """One peer's totals (:data:`TOTAL_FIELDS` order) and the bytes trusted receipts vouch for it."""

    TYPE: ClassVar[str] = "ledger-cut-row"
    peer: str = bounded(max_len=MAX_PEER_ID)
    totals: tuple[int, ...] = bounded(max_len=len(TOTAL_FIELDS), item_min=0, item_max=_LOW64)
    trusted_vouched: int = bounded(min=0, max=_LOW64, default=0)
    open_step: int = bounded(min=0, max=2**32, default=0)  # as a worker: its oldest draw step still open


@register
@dataclass(frozen=True)
class CutBatch(Message):
    """The claims on one batch of an open version (_CLAIM records, peers by row index)."""

    TYPE: ClassVar[str] = "ledger-cut-batch"
    batch: bytes = bounded(exact_len=32)
    claims: bytes = bounded(max_len=_CLAIM.size * 4096)


@register
@dataclass(frozen=True)
class CutVouched(Message):
    """Bytes one voucher (row index) vouches for peers for one manifest of an open version (_VOUCH records)."""

    TYPE: ClassVar[str] = "ledger-cut-vouched"
    voucher: int = bounded(min=0, max=MAX_CUT_PEERS)
    manifest: bytes = bounded(exact_len=32)
    claims: bytes = bounded(max_len=_VOUCH.size * 4096)


@register
@dataclass(frozen=True)
class CutPublished(Message):
    """A published size of a manifest of an open version, and how many usable entries publish it."""

    TYPE: ClassVar[str] = "ledger-cut-published"
    manifest: bytes = bounded(exact_len=32)
    version: int = bounded(min=0, max=2**32)
    size: int = bounded(min=0, max=2**50)
    entries: int = bounded(min=1, max=MAX_SEQ)


@register
@dataclass(frozen=True)
class CutBan(Message):
    """A ban still running at the cut: the penalty entry's peer, end, reason, author and seq."""

    TYPE: ClassVar[str] = "ledger-cut-ban"
    peer: str = bounded(max_len=MAX_PEER_ID)
    until_ms: int = bounded(min=0, max=MAX_SEQ)
    reason: str = bounded(max_len=MAX_REASON)
    by: str = bounded(max_len=MAX_PEER_ID)
    seq: int = bounded(min=1, max=MAX_SEQ)


@register
@dataclass(frozen=True)
class Cut(Message):
    """A replica's state at its heads, for a trainer to sign (module docstring). Every part is sorted."""

    TYPE: ClassVar[str] = "ledger-cut"
    run: str = bounded(max_len=64)
    number: int = bounded(min=1, max=MAX_SEQ)
    prev: bytes = bounded(exact_len=32)  # hash of the signed cut before it; GENESIS for number 1
    time_ms: int = bounded(min=0, max=MAX_SEQ)
    open_version: int = bounded(min=0, max=2**32 + 1)
    digest: bytes = bounded(exact_len=32)  # Ledger.digest() at the cut's heads
    logs: tuple[CutLog, ...] = bounded(max_len=MAX_CUT_PEERS)
    rows: tuple[CutRow, ...] = bounded(max_len=MAX_CUT_PEERS)
    batches: tuple[CutBatch, ...] = bounded(max_len=MAX_CUT_RECORDS)
    vouched: tuple[CutVouched, ...] = bounded(max_len=MAX_CUT_RECORDS)
    published: tuple[CutPublished, ...] = bounded(max_len=MAX_CUT_RECORDS)
    bans: tuple[CutBan, ...] = bounded(max_len=MAX_CUT_RECORDS)


@register
@dataclass(frozen=True)
class CutEnvelope(Envelope):
    """A signed cut: an :class:`~node.wire.Envelope` whose payload may be a whole cut (a thousand
    workers' open claims pass the 4 MiB of one frame; it travels in pages, node/ledger/cutsync.py)."""

    TYPE: ClassVar[str] = "ledger-cut-envelope"
    payload: bytes = bounded(max_len=MAX_CUT_BYTES)


@dataclass(frozen=True)
class OpenedCut:
    """A cut whose signature and signer were checked, with the hash of its signed bytes (the next cut's prev)."""

    signer: str
    cut: Cut
    hash: bytes


def make_cut(ledger: Ledger, *, time_ms: int, keep_versions: int = 0, keep_steps: int = 0, number: int | None = None,
             prev: bytes | None = None, opened: tuple[int, dict[str, int]] | None = None) -> Cut:
    """The cut of ``ledger`` as it stands: the checkpoint versions older than the newest
    ``keep_versions`` and each worker's draw steps older than its newest ``keep_steps`` closed (or
    exactly ``opened``, (open_version, open_steps): what a verifier rebuilds a received cut with), bans
    judged at ``time_ms``, following the cut the replica is based on unless ``number``/``prev`` say
    otherwise."""
    open_version, open_steps = opened or ledger.next_open(keep_versions, keep_steps)
    parts = ledger.base_parts(open_version, open_steps, time_ms)
    names = sorted(set(parts.logs) | set(parts.totals) | set(parts.trusted_vouched) | set(parts.open_steps)
                   | {name for claims in parts.batches.values() for p, _f, w, *_ in claims for name in (p, w)}
                   | {name for (voucher, _m), claims in parts.vouched.items() for name in (voucher, *claims)})
    index = {name: i for i, name in enumerate(names)}
    zeros = (0,) * len(TOTAL_FIELDS)
    rows = tuple(CutRow(peer=p, totals=parts.totals.get(p, zeros), trusted_vouched=parts.trusted_vouched.get(p, 0),
                        open_step=parts.open_steps.get(p, 0)) for p in names)
    logs = tuple(CutLog(author=a, seq=seq, hash=h, last_time_ms=t, receipts=r, fork_seq=f, evidence=_pair(ev))
                 for a, (seq, h, t, r, f, ev) in sorted(parts.logs.items()))
    batches = tuple(CutBatch(batch=b, claims=b"".join(_CLAIM.pack(index[p], f, index[w], *rest)
                                                      for p, f, w, *rest in claims))
                    for b, claims in sorted(parts.batches.items()))
    vouched = tuple(CutVouched(voucher=index[v], manifest=m,
                               claims=b"".join(_VOUCH.pack(index[p], n >> 64, n & _LOW64) for p, n in sorted(c.items())))
                    for (v, m), c in sorted(parts.vouched.items()))
    published = tuple(CutPublished(manifest=m, version=v, size=size, entries=n)
                      for m, sizes in sorted(parts.published.items()) for (v, size), n in sorted(sizes.items()))
    bans = tuple(CutBan(peer=b.peer, until_ms=b.until_ms, reason=b.reason, by=b.by, seq=b.seq) for b in parts.bans)
    return Cut(run=ledger.run, number=ledger.cut_number + 1 if number is None else number,
               prev=ledger.cut_hash if prev is None else prev, time_ms=time_ms, open_version=open_version,
               digest=ledger.digest(), logs=logs, rows=rows, batches=batches, vouched=vouched,
               published=published, bans=bans)


def _pair(ev: Evidence | None) -> tuple[bytes, ...]:
    """The evidence's two raw entries; a same-seq pair in hash order, so that replicas that saw the two
    branches in either order put the same bytes in their cuts (three branches can still differ)."""
    if ev is None:
        return ()
    a, b = (ev.a, ev.b) if ev.a.seq != ev.b.seq or ev.a.hash < ev.b.hash else (ev.b, ev.a)
    return a.raw, b.raw


def sign_cut(identity, cut: Cut) -> bytes:
    """The cut sealed by ``identity`` (a trainer of the run), as it is stored and sent."""
    return sign(identity, DOMAIN, cut, CutEnvelope)


def open_signed_cut(raw: bytes, ledger: Ledger) -> tuple[str, Cut]:
    """(signer, cut) of untrusted bytes: schema, signature, a signer among ``ledger``'s trainers, its run
    (what :func:`open_cut` checks before the cut's number and order)."""
    return open_signed(raw, DOMAIN, Cut, MAX_CUT_BYTES, ledger.run, ledger.trainers, CutEnvelope)


def open_cut(raw: bytes, ledger: Ledger) -> OpenedCut:
    """Check untrusted bytes for ``ledger`` (its run, its trainers, newer than the cut it is based on):
    RemoteProtocolError with a reason otherwise (the sender is wrong, or the cut is old news)."""
    signer, cut = open_signed_cut(raw, ledger)
    if cut.number <= ledger.cut_number:
        raise RemoteProtocolError("old-cut", f"cut {cut.number}, based on {ledger.cut_number}")
    for name in ("logs", "rows"):
        keys = [getattr(x, "author" if name == "logs" else "peer") for x in getattr(cut, name)]
        if any(a >= b for a, b in zip(keys, keys[1:])):
            raise RemoteProtocolError("unsorted-cut", name)
    return OpenedCut(signer, cut, hashes.digest(raw))


def parts_of(cut: Cut) -> BaseParts:
    """The replica state a cut describes; RemoteProtocolError("malformed-cut") if it names what it
    cannot (a row index out of range, a record cut short, evidence that proves nothing)."""
    names = [r.peer for r in cut.rows]
    try:
        def peer(i: int) -> str:
            if i >= len(names):
                raise ValueError(f"row {i} of {len(names)}")
            return names[i]

        def records(st: struct.Struct, packed: bytes):
            if len(packed) % st.size or not packed:
                raise ValueError("record cut short")
            return st.iter_unpack(packed)

        logs = {}
        for log in cut.logs:
            ev = None
            if log.evidence:
                if len(log.evidence) != 2:
                    raise ValueError(f"evidence of {log.author[-8:]}: one entry")
                ev = Evidence(*(parse_entry(raw) for raw in log.evidence))
                if ev.problem() or ev.author != log.author or ev.fork_seq != log.fork_seq:
                    raise ValueError(f"evidence of {log.author[-8:]}")
            elif log.fork_seq:
                raise ValueError(f"{log.author[-8:]} flagged without evidence")
            logs[log.author] = (log.seq, log.hash, log.last_time_ms, log.receipts, log.fork_seq, ev)
        batches = {}
        for b in cut.batches:
            claims = [(peer(p), f, peer(w), step, amount, n) for p, f, w, step, amount, n in records(_CLAIM, b.claims)]
            if any(f >= len(TOTAL_FIELDS) or n < 1 for _p, f, _w, _s, _a, n in claims):
                raise ValueError("claim")
            batches[b.batch] = claims
        published: dict[bytes, dict[tuple[int, int], int]] = {}
        for p in cut.published:
            published.setdefault(p.manifest, {})[(p.version, p.size)] = p.entries
        return BaseParts(
            open_version=cut.open_version,
            open_steps={r.peer: r.open_step for r in cut.rows if r.open_step},
            logs=logs,
            totals={r.peer: r.totals for r in cut.rows if any(r.totals)},
            trusted_vouched={r.peer: r.trusted_vouched for r in cut.rows if r.trusted_vouched},
            batches=batches,
            vouched={(peer(v.voucher), v.manifest): {peer(p): high << 64 | low for p, high, low in records(_VOUCH, v.claims)}
                     for v in cut.vouched},
            published=published,
            bans=[LedgerBan(b.peer, b.until_ms, b.reason, b.by, b.seq) for b in cut.bans],
        )
    except (ValueError, RemoteProtocolError) as e:
        raise RemoteProtocolError("malformed-cut", str(e)[:80]) from None


def ledger_from_cut(opened: OpenedCut, template: Ledger, history: History | None = None) -> Ledger:
    """A new replica based on ``opened`` (no entries yet), with ``template``'s run, roles and limits."""
    cut = opened.cut
    if any(len(r.totals) != len(TOTAL_FIELDS) for r in cut.rows):
        raise RemoteProtocolError("malformed-cut", "row totals")
    if any(b.by not in {log.author for log in cut.logs} for b in cut.bans):
        raise RemoteProtocolError("malformed-cut", "ban by no author")
    ledger = Ledger(template.run, template.trainers, template.validators, template.max_skew_ms, template.limits,
                    history)
    ledger.load_base(parts_of(cut))
    ledger.cut_number, ledger.cut_hash = cut.number, opened.hash
    if ledger.digest() != cut.digest:
        raise RemoteProtocolError("malformed-cut", "digest is not the logs'")
    return ledger


def replay_to(cut: Cut, base: Ledger, history: History) -> Ledger | str:
    """``base`` (an empty replica, or one from the cut before ``cut``) brought to exactly ``cut``'s
    heads from ``history`` with the cut's evidence: what :func:`cut_problem` compares. A reason
    instead when ``history`` lacks entries the cut covers (the replica is behind: sync first) or
    ``base`` is past the cut."""
    for log in cut.logs:
        if log.evidence:
            base.add_evidence(Evidence(*(parse_entry(raw, verify_signature=False) for raw in log.evidence)))
    for log in cut.logs:
        start = base.head_of(log.author) + 1
        if start > log.seq + 1:
            return "base-past-cut"
        for se in history(log.author, start, log.seq):
            base.restore(se)
        if base.head_of(log.author) != log.seq:
            return "behind"
    return base


def cut_problem(cut: Cut, replayed: Ledger) -> str | None:
    """Why ``cut`` is not ``replayed``'s state (a :func:`replay_to` result from the cut it follows), or
    None when it is. A cut is checked from the base it was made on: one that follows a cut we have not
    taken (``other-base``) could close versions ours does not, so entries between would count
    differently."""
    if cut.run != replayed.run:
        return "wrong-run"
    if cut.prev != replayed.cut_hash or cut.number != replayed.cut_number + 1:
        return "other-base"  # made on another cut than ours: we need the cuts between first
    open_steps = {r.peer: r.open_step for r in cut.rows if r.open_step}
    if cut.open_version < replayed.open_version or any(open_steps.get(w, 0) < s for w, s in replayed.open_steps.items()):
        return "reopens"
    if cut.digest != replayed.digest():
        return "other-heads"
    ours = make_cut(replayed, time_ms=cut.time_ms, opened=(cut.open_version, open_steps))
    for name in ("logs", "rows", "batches", "vouched", "published", "bans"):
        if getattr(ours, name) != getattr(cut, name):
            return f"{name}-differ"
    return None if ours == cut else "header-differs"


def rebase(ledger: Ledger, opened: OpenedCut, history: History | None = None) -> Ledger:
    """``ledger`` based on ``opened`` instead of its history at or below the cut's heads: the cut's
    replica, then ``ledger``'s evidence and its entries above the heads (re-read from ``history``,
    default ``ledger``'s own, and then the new replica keeps its entries in memory). The caller
    checked the cut first (:func:`cut_problem`) when it could."""
    out = ledger_from_cut(opened, ledger, history)
    history = history or ledger.history
    for author in ledger.authors():
        ev = ledger.evidence(author)
        if ev is not None:
            out.add_evidence(ev)
    for author in ledger.authors():
        end = ledger.head_of(author) if not ledger.flagged().get(author) else ledger.usable_of(author)
        for se in history(author, out.head_of(author) + 1, end):
            out.restore(se)
    return out

