"""Chain rules: which entries join the replica, equivocation, totals per peer and the state digest.

How this works
--------------
The replica is one append-only log per author, always contiguous from seq 1 (an entry whose
predecessors we lack is a :attr:`Outcome.GAP`: not stored, it asks for anti-entropy). Adding an entry
is two steps so that nothing is kept before it is durable: :meth:`Ledger.check` decides without
changing anything, the caller stores an accepted entry, then :meth:`Ledger.apply` records it.

Outcomes of :meth:`Ledger.check` (entries are already schema- and signature-checked by
:func:`node.ledger.entries.parse_entry`):

=============  ===============================================================================
ACCEPT         seq = head + 1, ``prev`` = hash of the head (GENESIS for seq 1), allowed author,
               right run, timestamp not beyond the clock-skew bound and not before the head's
DUPLICATE      we already hold this exact entry
GAP            seq > head + 1: fetch ``head+1 .. seq`` first
EQUIVOCATION   the author signed two different entries for one seq: either a different entry at a
               seq we hold, or an entry at head + 1 whose ``prev`` is not our head (it commits to
               a different entry at our head's seq). The pair is :class:`Evidence`.
REJECT         everything else, with a reason (wrong-run, unauthorized, future-timestamp,
               time-regress, bad-link, equivocator, author-quota)
=============  ===============================================================================

Equivocation (the classic fork attack on per-author logs, as in Secure Scuttlebutt and
hypercore): both entries are kept as evidence, the author is flagged from the fork seq on (the lowest
seq of any evidence we hold), its entries at or after the fork point give no credit, and no new ones
are accepted. Replicas that saw different branches agree once they share the evidence, because
every view below — heads, digest, totals, bans — stops at ``fork_seq - 1``.

Bytes served: receipts vouch for bytes received from a peer for one checkpoint. Anyone may author
them, so one voucher's claims for a manifest are capped at that manifest's published size (a
downloader receives each byte once) and claims for manifests no trainer published count nothing:
colluders cannot mint credit beyond one checkpoint per identity and checkpoint. And a receipt is
evidence only when its author has no reason to lie (issue 42: one trained batch gave a worker
standing, and its receipts credited a Sybil that served nothing one checkpoint per checkpoint, 5 GB
for five of 1 GB): receipts of trainers and validators count in full; those of any other author
count in full only for a peer that is a trainer or validator or that trusted receipts show serving
that same checkpoint (so it demonstrably holds and serves it), otherwise as a fresh key's
(``unvouched_credit``). Serving workers only, a peer is credited when it has also served a trusted
role that checkpoint; a colluder can inflate only such a peer, by at most one checkpoint per checkpoint.

Sybil bounds (issue 13 "Sybil-resistant accounting", issue 14 item 6): keys are free, and receipts
are the one kind anyone may author, so both what they credit and how many are stored depend on the
author's *standing* (:meth:`Ledger.vouched`): a trainer or validator of the run, a worker with
rollouts a trainer recorded as trained, or a peer a trainer's or validator's receipts vouch for (a
relay that served a validator). Standing comes only from entries of the run's trusted roles.

* credit: receipts of an author without standing count ``unvouched_credit`` of their bytes (0 by
  default), so ten fresh keys vouching for each other mint nothing;
* storage: an author without standing may have ``unvouched_receipts`` receipts entries in its log;
  one with standing ``receipts_burst + receipts_per_checkpoint * (checkpoints the run's trainers
  published)``. Beyond that a receipts entry is refused (``author-quota``) and not stored. A
  downloader writes about one receipt per checkpoint it fetches (one per ``receipt_interval``), so
  the allowance follows the run's progress as the trainers' signed entries show it.

Convergence: the limit is a function of the author's own log and of trusted entries only, never
of arrival order or our clock, and it only grows as trusted entries arrive. A replica that refuses
an entry because it still lacks a trainer's entry accepts it when anti-entropy offers it again
after that entry arrived (``missing`` still lists the range), so replicas holding the same entries
hold the same receipts and the same digest. The one case where standing could shrink is a trainer
or validator caught equivocating (its entries past the fork stop counting); then the bound is lifted
for everyone, which is monotone too (evidence only accumulates), rather than leave replicas that
accepted under the old standing apart from those that did not. Time stamps are the author's own claim (anything up to
the clock-skew bound, back to 1970), so a rate by the entry's time would bound nothing by itself;
the trainers' checkpoints are the clock the allowance is counted in.

Per batch (issue 42): a batch's credits (samples and tokens accepted or rejected, verdicts and
failed verdicts) carry its batch id and count once per (peer, field, batch), however many trainers
record it, validators judge it or entries replay it; a validator's ``verdicts`` count once per batch
it judged. Where entries claim different amounts for one batch, the largest counts (a function of
the usable entries, so order does not matter).

Cuts (node/ledger/cut.py, issue 46 item 4): a replica may be based on a trainer-signed cut instead of
the history below it. Each author's log then starts at the cut's head (``_Log.base``: entries at or
below it are refused as ``below-cut``, one above it that does not chain onto it as ``off-cut``), the
totals start from the cut's, and credits of manifests of versions below the cut's ``open_version`` and
of batches of draw steps below their worker's open step (``open_steps``; each credit names its version
or draw step, :attr:`Credit.step`) count nothing, for every replica based on that cut alike. A fork
below the cut flags its author from the cut on; the cut's totals stand.

Bans: a ``penalty`` entry with ``ban_seconds`` (only trainers and validators may author one) bans its
peer from the entry's time for that long; :meth:`Ledger.ban_of` is what trainers and validators
consult at intake, so a ban given by any one of them holds at all of them once the entry arrives.

The state digest hashes every author's (capped) head and fork seq in author order, so two replicas
with the same entries and evidence have the same digest, whatever order they learned them in.

Memory (issue 45: an hour-long soak grew each node's RSS by ~41 MB/h, 2.1 kB per entry of replica):
the replica keeps per entry only its hash (32 bytes in one ``bytearray`` per author) and what the
entry adds to the derived state, packed into one ``bytes`` value per batch (its claims) and per
voucher and manifest (the bytes vouched for each peer). It does not keep each entry's credits
to unwind them when evidence arrives: evidence is rare, so :meth:`Ledger.add_evidence` re-reads the
entries past the new fork point from ``history`` (the store, node/ledger/store.py) and subtracts what
they had added, exactly as they added it. ``bench/ledger.py --memory DATA_DIR`` measures it.

Pure: time comes in as ``now_ms``; no I/O.
"""

from __future__ import annotations

import enum
import struct
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields, replace
from typing import ClassVar

from .. import hashes
from ..wire import Message, RemoteProtocolError, bounded, register
from .entries import (
    GENESIS,
    KINDS,
    MAX_PEER_ID,
    MAX_SEQ,
    PUBLISHED,
    TOTAL_FIELDS,
    Authors,
    Credit,
    Penalty,
    Receipts,
    SignedEntry,
)

_U64 = struct.Struct(">Q")
DIGEST_DOMAIN = b"swarm-node/ledger-state/v1\x00"
HASH_LEN = len(GENESIS)  # bytes of an entry hash
# A claim on one batch (Ledger._batch_claims): peer number, field (index in TOTAL_FIELDS), the number of
# the batch's worker and its draw step as the claiming entry names them (cuts close each worker's old
# steps, node/ledger/cut.py), amount, how many usable entries claim that amount. Unsigned: a count below 0
# would be our bug, and raises. The amount is one entry's, never a sum: only trainers write batch credits
# (RolloutsJudged, samples <= 2^20, tokens <= 2^40 in entries.py), so it fits 64 bits; the count is of a
# trainer's entries for one batch. The draw step takes 64 bits: entries bound it at 2^32 inclusive, which
# trainers and validators write for any higher step a worker drew (a fresh worker may start anywhere).
_CLAIM = struct.Struct(">IBIQQI")
# Bytes one voucher vouches for one peer for one manifest (Ledger._vouched): peer number, bytes. A sum,
# not one amount: an author with standing may repeat (peer, manifest) at 2^50 bytes a receipt item, 32
# items an entry, entry after entry, past 2^63 after 256 entries (review of 8202c62; MAX_SEQ entries
# reach 2^108). A manifest's records whose sums do not all fit 64 bits are _VOUCHED_WIDE instead (the
# sum in a signed high and an unsigned low half) after one _WIDE byte: an odd length tells them apart.
_VOUCHED = struct.Struct(">Iq")
_VOUCHED_WIDE = struct.Struct(">IqQ")
_WIDE = b"w"
_LOW64 = 2**64 - 1

# Entries ``start..end`` (inclusive) of an author, in seq order, as the replica took them in: what
# add_evidence re-reads to unwind the credits of entries past a new fork point.
History = Callable[[str, int, int], Iterable[SignedEntry]]


class Outcome(enum.Enum):
    ACCEPT = "accept"
    DUPLICATE = "duplicate"
    GAP = "gap"
    EQUIVOCATION = "equivocation"
    REJECT = "reject"


@dataclass(frozen=True)
class Decision:
    outcome: Outcome
    entry: SignedEntry
    reason: str = ""  # REJECT: why; GAP: "gap"
    conflict_seq: int = 0  # EQUIVOCATION: seq of our stored entry that the new one conflicts with


@dataclass(frozen=True)
class Evidence:
    """Two entries signed by one author that cannot both belong to an honest log.

    Either ``a.seq == b.seq`` with different hashes, or ``b.seq == a.seq + 1`` with
    ``b.prev != a.hash`` (b commits to an entry at a.seq other than a). The fork seq is ``a.seq``.
    """

    a: SignedEntry
    b: SignedEntry

    @property
    def author(self) -> str:
        return self.a.author

    @property
    def fork_seq(self) -> int:
        return self.a.seq

    def problem(self) -> str | None:
        """Why this is not valid evidence, or None when it is."""
        if self.a.author != self.b.author:
            return "evidence-authors-differ"
        if self.a.seq == self.b.seq:
            return None if self.a.hash != self.b.hash else "evidence-identical"
        if self.b.seq == self.a.seq + 1:
            return None if self.b.prev != self.a.hash else "evidence-consistent"
        return "evidence-unrelated"


@register
@dataclass(frozen=True)
class Head(Message):
    """One author's head as a replica sees it (capped below the fork point when flagged)."""

    TYPE: ClassVar[str] = "ledger-head"
    author: str = bounded(max_len=MAX_PEER_ID)
    seq: int = bounded(min=0, max=MAX_SEQ)  # 0 = nothing usable (e.g. forked at seq 1)
    hash: bytes = bounded(exact_len=32)  # GENESIS when seq is 0
    fork_seq: int = bounded(min=0, max=MAX_SEQ)  # 0 = not flagged


@dataclass(frozen=True)
class Want:
    """Entries ``start..end`` (inclusive) of ``author`` that a peer has and we lack."""

    author: str
    start: int
    end: int


@dataclass(frozen=True)
class LedgerBan:
    """A ban from a ledger ``penalty`` entry: who, until when (wall ms), why, by whom, at which seq."""

    peer: str
    until_ms: int
    reason: str
    by: str
    seq: int


@dataclass(frozen=True)
class AuthorLimits:
    """Per-author bounds on self-asserted entries (receipts); see the module docstring. Built from
    ``[ledger]`` (node/ledger/config.py), where each field is explained."""

    unvouched_receipts: int = 4
    receipts_burst: int = 16
    receipts_per_checkpoint: int = 4
    unvouched_credit: float = 0.0


@dataclass(frozen=True)
class BaseParts:
    """A replica's state at a cut, peers by name (:meth:`Ledger.base_parts`; node/ledger/cut.py puts it
    on the wire). Every map holds only non-empty values, so equal replicas give equal parts."""

    open_version: int  # credits of manifests of older versions count nothing after the cut
    open_steps: dict[str, int]  # worker -> its oldest open draw step: credits of its older batches count nothing
    # author -> (seq, hash, last time stamp, receipts, fork seq, evidence)
    logs: dict[str, tuple[int, bytes, int, int, int, Evidence | None]]
    totals: dict[str, tuple[int, ...]]  # peer -> TOTAL_FIELDS values; bytes_served: what closed manifests gave
    trusted_vouched: dict[str, int]  # peer -> bytes trainers' and validators' receipts vouch for (standing)
    # open batch -> [(peer, field, worker, draw step, amount, entries claiming it)]
    batches: dict[bytes, list[tuple[str, int, str, int, int, int]]]
    vouched: dict[tuple[str, bytes], dict[str, int]]  # (voucher, open manifest) -> {peer: bytes}
    published: dict[bytes, dict[tuple[int, int], int]]  # open manifest -> {(version, size): entries}
    bans: list[LedgerBan]  # bans still running at the cut's time, of usable entries


@dataclass
class PeerTotals:
    """A peer's contribution as the ledger records it (fields: :data:`entries.TOTAL_FIELDS`)."""

    entries: int = 0
    checkpoints: int = 0
    rollouts_accepted: int = 0
    rollouts_rejected: int = 0
    tokens: int = 0
    verdicts: int = 0
    verdicts_failed: int = 0
    bytes_served: int = 0
    penalties: int = 0
    bans: int = 0

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


assert tuple(f.name for f in fields(PeerTotals)) == TOTAL_FIELDS


@dataclass
class _Log:
    """What the replica remembers of one author (entry bytes and credits stay in the store)."""

    hashes: bytearray = field(default_factory=bytearray)  # the hashes of seq base+1, base+2, ..., HASH_LEN bytes each
    last_time_ms: int = 0
    receipts: int = 0  # receipts entries in the log (the per-author bound of the module docstring)
    fork_seq: int = 0  # 0 = not flagged
    evidence: Evidence | None = None
    base: int = 0  # seq of the author's head at the cut the replica is based on (node/ledger/cut.py); 0 = none
    base_hash: bytes = GENESIS  # its hash

    @property
    def head(self) -> int:
        return self.base + len(self.hashes) // HASH_LEN

    def hash_at(self, seq: int) -> bytes | None:
        """Hash of ``seq`` (base..head); GENESIS for seq 0; None below the base (pruned by a cut)."""
        if seq <= self.base:
            return self.base_hash if seq == self.base else None
        i = seq - self.base
        return bytes(self.hashes[(i - 1) * HASH_LEN:i * HASH_LEN])

    def usable(self) -> int:
        """Highest seq that counts: everything before the fork point, and the cut's head whatever
        the fork point (a cut is final: its totals stand, node/ledger/cut.py)."""
        return min(self.head, max(self.fork_seq - 1, self.base)) if self.fork_seq else self.head


class Ledger:
    """An in-memory replica of every author's log, checked against the run's rules."""

    def __init__(self, run: str, trainers: Iterable[str], validators: Iterable[str], max_skew_ms: int,
                 limits: AuthorLimits = AuthorLimits(), history: History | None = None) -> None:
        """``history`` re-reads entries the replica holds (a store's :meth:`LedgerStore.entries`);
        without one the replica keeps every entry it takes in, in memory (tests, short-lived tools).
        A replica based on a cut is made by :func:`node.ledger.cut.ledger_from_cut`."""
        self.run = run
        self.trainers = frozenset(trainers)
        self.validators = frozenset(validators)
        self.trusted = self.trainers | self.validators
        self.max_skew_ms = max_skew_ms
        self.limits = limits
        self._trusted_vouched: dict[str, int] = {}  # peer -> bytes trainers' and validators' receipts vouch for
        self._logs: dict[str, _Log] = {}
        self._totals: dict[str, PeerTotals] = {}
        self._bans: dict[str, list[LedgerBan]] = {}  # banned peer -> ban entries naming it
        # Bytes vouched for, per voucher and manifest: _VOUCHED records (peer, bytes) packed; and the
        # published sizes of each manifest ({size: number of usable entries}); bytes_served is
        # computed from both on demand.
        self._vouched: dict[str, dict[bytes, bytes]] = {}
        self._published: dict[bytes, dict[tuple[int, int], int]] = {}  # {(version, size): usable entries}
        self._manifests: dict[bytes, bytes] = {}  # one bytes object per manifest id for all the keys naming it
        # Credits for one rollout batch, per batch id: (peer, field, amount, usable entries claiming it)
        # packed as _CLAIM records (a batch has a few; a dict and tuples per claim took ~500 B per entry).
        self._batch_claims: dict[bytes, bytes] = {}
        self._peer_numbers: dict[str, int] = {}  # peer id -> its number in packed records
        self._peer_names: list[str] = []  # and back
        self._kept: dict[str, list[SignedEntry]] | None = None if history else {}
        self._history: History = history or self._kept_entries
        # What a cut (node/ledger/cut.py) leaves: credits of batches and manifests of versions below
        # open_version count nothing, and bytes served up to the cut are a fixed sum per peer.
        self.open_version = 0
        self.open_steps: dict[str, int] = {}
        self._served_base: dict[str, int] = {}
        self.cut_number = 0  # 0 = based on no cut
        self.cut_hash = GENESIS  # hash of the signed cut the replica is based on

    def _kept_entries(self, author: str, start: int, end: int) -> list[SignedEntry]:
        base = self._logs[author].base if author in self._logs else 0
        return self._kept.get(author, [])[start - 1 - base:end - base]

    # ---------------------------------------------------------------- adding entries

    def authority_problem(self, se: SignedEntry) -> str | None:
        """Rules that need no chain state: run, author's role for the kind. None = fine."""
        if se.entry.run != self.run:
            return "wrong-run"
        allowed = KINDS[se.kind].authors
        if Authors.ANYONE in allowed:
            return None
        if Authors.TRAINER in allowed and se.author in self.trainers:
            return None
        if Authors.VALIDATOR in allowed and se.author in self.validators:
            return None
        return "unauthorized"

    def check(self, se: SignedEntry, now_ms: int) -> Decision:
        """Decide what to do with a parsed entry; changes nothing."""
        problem = self.authority_problem(se)
        if problem:
            return Decision(Outcome.REJECT, se, problem)
        if se.time_ms > now_ms + self.max_skew_ms:
            return Decision(Outcome.REJECT, se, "future-timestamp")
        log = self._logs.get(se.author)
        head = log.head if log else 0
        if log and se.seq <= log.base and se.hash != log.base_hash:
            return Decision(Outcome.REJECT, se, "below-cut")  # final; a fork there needs both entries as Evidence
        if log and se.seq == log.base + 1 and se.prev != log.base_hash and log.base:
            return Decision(Outcome.REJECT, se, "off-cut")  # our entry at the base is pruned: no Evidence to make
        if se.seq <= head:
            if log.hash_at(se.seq) == se.hash:
                return Decision(Outcome.DUPLICATE, se)
            return Decision(Outcome.EQUIVOCATION, se, "equivocation", conflict_seq=se.seq)
        if log and log.fork_seq and se.seq >= log.fork_seq:
            return Decision(Outcome.REJECT, se, "equivocator")
        if se.seq > head + 1:
            return Decision(Outcome.GAP, se, "gap")
        if se.prev != (log.hash_at(head) if head else GENESIS):
            if head:
                return Decision(Outcome.EQUIVOCATION, se, "equivocation", conflict_seq=head)
            return Decision(Outcome.REJECT, se, "bad-link")
        if log and se.time_ms < log.last_time_ms:
            return Decision(Outcome.REJECT, se, "time-regress")
        if se.kind == Receipts.TYPE and self.receipts_left(se.author) == 0:
            return Decision(Outcome.REJECT, se, "author-quota")
        return Decision(Outcome.ACCEPT, se)

    def vouched(self, peer: str) -> bool:
        """Whether ``peer`` has standing: a trusted role, rollouts trained by a trainer, or bytes a
        trainer's or validator's receipts vouch for (usable entries only)."""
        return (peer in self.trusted or self.accepted_samples(peer) > 0
                or self._trusted_vouched.get(peer, 0) > 0)

    def receipts_left(self, author: str) -> int | None:
        """How many more receipts entries ``author``'s log may hold now (None: no bound, a trusted role)."""
        if author in self.trusted:
            return None
        if any(self._logs[t].fork_seq for t in self.trusted if t in self._logs):
            return None  # a trusted author forked: standing is no longer monotone (module docstring)
        lim = self.limits
        if self.vouched(author):
            checkpoints = sum(self._totals[t].checkpoints for t in self.trainers if t in self._totals)
            allowed = lim.receipts_burst + lim.receipts_per_checkpoint * checkpoints
        else:
            allowed = lim.unvouched_receipts
        log = self._logs.get(author)
        return max(0, allowed - (log.receipts if log else 0))

    def apply(self, decision: Decision) -> None:
        """Record an accepted entry (after the caller stored it)."""
        if decision.outcome is not Outcome.ACCEPT:
            raise ValueError(f"apply() takes accepted entries, got {decision.outcome}")
        se = decision.entry
        log = self._logs.setdefault(se.author, _Log())
        if se.seq != log.head + 1 or se.prev != log.hash_at(log.head):
            raise ValueError("apply() of an entry that no longer fits; check() and apply() interleaved")
        self._append(log, se)

    def restore(self, se: SignedEntry) -> None:
        """Re-load an entry from our own store on start (it passed check() when stored)."""
        log = self._logs.setdefault(se.author, _Log())
        if se.seq != log.head + 1 or se.prev != log.hash_at(log.head):
            raise ValueError(f"stored chain of {se.author} is broken at seq {se.seq}")
        self._append(log, se)

    def _append(self, log: _Log, se: SignedEntry) -> None:
        # Credit first: should it raise (our bug), the entry is not half taken in (head without credit).
        if not log.fork_seq or se.seq < log.fork_seq:
            self._credit(se.author, _credits_of(se), +1)
        log.hashes += se.hash
        if self._kept is not None:
            self._kept.setdefault(se.author, []).append(se)
        log.last_time_ms = max(log.last_time_ms, se.time_ms)
        log.receipts += se.kind == Receipts.TYPE
        body = se.body
        if isinstance(body, Penalty) and body.ban_seconds:
            until = se.time_ms + 1000 * body.ban_seconds
            self._bans.setdefault(body.peer, []).append(LedgerBan(body.peer, until, body.reason, se.author, se.seq))

    def _credit(self, author: str, credits: Iterable[Credit], sign: int) -> None:
        # Peer ids are interned: the derived state names a few peers in many keys (issue 45, memory).
        author = sys.intern(author)
        for c in credits:
            peer = sys.intern(c.peer)
            if (c.step < self.open_version if c.field == PUBLISHED
                    else c.batch is not None and c.step < self.open_steps.get(c.worker, 0)):
                continue  # a version or draw step our cut closed (node/ledger/cut.py)
            if c.field == PUBLISHED:
                sizes = self._published.setdefault(c.manifest, {})
                key = (c.step, c.amount)
                sizes[key] = sizes.get(key, 0) + sign
                if not sizes[key]:
                    del sizes[key]
                    if not sizes:
                        del self._published[c.manifest]
            elif c.manifest is not None:  # bytes vouched for: capped when totals are read
                self._vouch(author, peer, c.manifest, sign * c.amount)
                if author in self.trusted:
                    self._trusted_vouched[peer] = self._trusted_vouched.get(peer, 0) + sign * c.amount
            elif c.batch is not None:
                self._credit_batch(peer, c, sign)
            else:
                self._add(peer, c.field, sign * c.amount)

    def _add(self, peer: str, name: str, amount: int) -> None:
        t = self._totals.setdefault(peer, PeerTotals())
        setattr(t, name, getattr(t, name) + amount)

    def _credit_batch(self, peer: str, c: Credit, sign: int) -> None:
        """Count a batch's credit once: the largest amount any usable entry claims for (peer, field,
        batch). The largest, not the first, so that replicas agree whatever order entries came in
        (two trainers may count one batch differently, e.g. after dropping zero-advantage groups)."""
        who = (self._peer_number(peer), TOTAL_FIELDS.index(c.field))
        claims = {claim[:5]: claim[5] for claim in _CLAIM.iter_unpack(self._batch_claims.get(c.batch, b""))}
        before = max((amount for p, f, _w, _step, amount in claims if (p, f) == who), default=0)
        key = (*who, self._peer_number(sys.intern(c.worker)), c.step, c.amount)
        left = claims.pop(key, 0) + sign
        if left:
            claims[key] = left
        after = max((amount for p, f, _w, _step, amount in claims if (p, f) == who), default=0)
        if claims:
            self._batch_claims[c.batch] = b"".join(_CLAIM.pack(*claim, n) for claim, n in claims.items())
        else:
            del self._batch_claims[c.batch]
        self._add(peer, c.field, after - before)

    def _peer_number(self, peer: str) -> int:
        n = self._peer_numbers.setdefault(peer, len(self._peer_numbers))
        if n == len(self._peer_names):
            self._peer_names.append(peer)
        return n

    def _vouch(self, voucher: str, peer: str, manifest: bytes, amount: int) -> None:
        manifest = self._manifests.setdefault(manifest, manifest)
        held = self._vouched.setdefault(voucher, {})
        claims = _unpack_vouched(held.get(manifest, b""))
        n = self._peer_number(peer)
        claims[n] = claims.get(n, 0) + amount
        if not claims[n]:
            del claims[n]  # counts nothing either way (_bytes_served)
        if claims:
            held[manifest] = _pack_vouched(claims)
        else:
            held.pop(manifest, None)

    def _vouched_claims(self) -> Iterable[tuple[str, bytes, dict[str, int]]]:
        """(voucher, manifest, {peer: bytes vouched for}) of every voucher and manifest."""
        for voucher, held in self._vouched.items():
            for manifest, packed in held.items():
                yield voucher, manifest, {self._peer_names[n]: amount for n, amount in _unpack_vouched(packed).items()}

    def _bytes_served(self, manifests: Callable[[bytes], bool] = lambda m: True) -> dict[str, int]:
        """Vouched bytes, capped per voucher and checkpoint at the checkpoint's published size.

        A downloader receives each verified byte of a checkpoint once, so its receipts for one
        manifest add up to at most that manifest's size; a voucher claiming more (to inflate a
        colluder's credit) has its claims scaled down to the size, and claims for a manifest no
        trainer published count nothing. A voucher without standing (:meth:`vouched`) counts
        ``unvouched_credit`` of what it vouches for (Sybil keys crediting each other); one with
        standing but not trusted counts in full only for a trusted peer or one a trusted role's
        receipts show serving that checkpoint, else as one without standing. Computed from
        the whole replica, so every replica with the same entries agrees, whatever order they
        arrived in. Only the manifests ``manifests`` says yes to (a cut's closed ones, node/ledger/cut.py).
        """
        out: dict[str, int] = {}
        weight = self.limits.unvouched_credit
        seen = self._seen_serving()
        for voucher, manifest, claims in self._vouched_claims():
            if not manifests(manifest):
                continue
            sizes = [size for (_version, size), n in self._published.get(manifest, {}).items() if n > 0]
            cap = max(sizes, default=0)
            if not cap:
                continue
            trusted, standing = voucher in self.trusted, self.vouched(voucher)
            if not standing and weight <= 0:
                continue
            claimed = sum(claims.values())
            for peer, amount in claims.items():
                if amount > 0:
                    got = amount if claimed <= cap else amount * cap // claimed
                    full = trusted or (standing and (peer in self.trusted or (peer, manifest) in seen))
                    out[peer] = out.get(peer, 0) + (got if full else int(got * weight))
        return out

    def _seen_serving(self) -> set[tuple[str, bytes]]:
        """(peer, manifest) pairs a trainer's or validator's usable receipts vouch for: evidence that
        the peer holds that checkpoint and serves it (the module docstring, "Bytes served")."""
        return {(peer, manifest) for voucher, manifest, claims in self._vouched_claims() if voucher in self.trusted
                for peer, amount in claims.items() if amount > 0}

    def add_evidence(self, ev: Evidence) -> bool:
        """Flag an equivocating author. Returns True if it lowered (or set) the fork point.

        Raises RemoteProtocolError when the pair proves nothing (the sender is wrong).
        """
        problem = ev.problem()
        if problem:
            raise RemoteProtocolError(problem)
        log = self._logs.setdefault(ev.author, _Log())
        if log.fork_seq and log.fork_seq <= ev.fork_seq:
            return False
        old_usable = log.usable()
        log.fork_seq = ev.fork_seq
        log.evidence = ev
        self._unwind(ev.author, log, log.usable() + 1, old_usable)
        return True

    def _unwind(self, author: str, log: _Log, start: int, end: int) -> None:
        """Take back the credits of ``author``'s entries ``start..end``, re-read from the history
        (a ValueError when it does not give back the entries the replica holds: we are wrong)."""
        if start > end:
            return
        seq = start
        for se in self._history(author, start, end):
            if se.author != author or se.seq != seq or se.hash != log.hash_at(seq):
                raise ValueError(f"history of {author} at seq {seq} is not the entry the replica holds")
            self._credit(author, _credits_of(se), -1)
            seq += 1
        if seq <= end:
            raise ValueError(f"history of {author} lacks seq {seq}..{end}, whose credits the replica counted")

    # ---------------------------------------------------------------- views

    @property
    def history(self) -> History:
        """What re-reads the entries this replica holds (its store's, or its own in-memory list)."""
        return self._history

    def usable_of(self, author: str) -> int:
        """``author``'s highest seq that counts (its head, or below its fork point)."""
        log = self._logs.get(author)
        return log.usable() if log else 0

    def newest_version(self) -> int:
        """The newest checkpoint version a usable entry publishes (counted from the replica's cut on:
        ``open_version - 1`` when none)."""
        return max((v for sizes in self._published.values() for v, _size in sizes), default=self.open_version - 1)

    def head_of(self, author: str) -> int:
        log = self._logs.get(author)
        return log.head if log else 0

    def last_time_ms(self, author: str) -> int:
        log = self._logs.get(author)
        return log.last_time_ms if log else 0

    def hash_at(self, author: str, seq: int) -> bytes | None:
        log = self._logs.get(author)
        return log.hash_at(seq) if log and 1 <= seq <= log.head else None

    def __len__(self) -> int:
        return sum(log.head for log in self._logs.values())

    def authors(self) -> list[str]:
        return sorted(self._logs)

    def heads(self) -> list[Head]:
        """Every author's usable head, in author order (what anti-entropy exchanges)."""
        out = []
        for author in sorted(self._logs):
            log = self._logs[author]
            seq = log.usable()
            out.append(Head(author, seq, log.hash_at(seq), log.fork_seq))
        return out

    def digest(self) -> bytes:
        """Deterministic digest of the replica: equal iff the usable heads and fork points are."""
        h = hashes.hasher()
        h.update(DIGEST_DOMAIN)
        for head in self.heads():
            a = head.author.encode()
            h.update(_U64.pack(len(a)) + a + _U64.pack(head.seq) + head.hash + _U64.pack(head.fork_seq))
        return h.digest()

    def flagged(self) -> dict[str, int]:
        """Equivocating authors and their fork seq."""
        return {a: log.fork_seq for a, log in sorted(self._logs.items()) if log.fork_seq}

    def evidence(self, author: str) -> Evidence | None:
        log = self._logs.get(author)
        return log.evidence if log else None

    def accepted_samples(self, peer: str) -> int:
        """Samples of ``peer``'s rollouts that trainers of the run recorded as trained (its history:
        node/rollouts/quota.py). O(1); entries past a trainer's fork point do not count."""
        t = self._totals.get(peer)
        return t.rollouts_accepted if t else 0

    def ban_of(self, peer: str, now_ms: int) -> LedgerBan | None:
        """The longest active ban on ``peer`` (entries past an equivocator's fork point do not count)."""
        live = [
            b for b in self._bans.get(peer, ())
            if b.until_ms > now_ms and b.seq <= self._logs[b.by].usable()
        ]
        return max(live, key=lambda b: b.until_ms, default=None)

    def bans(self, now_ms: int) -> dict[str, LedgerBan]:
        """Every active ban (for status views)."""
        out = {p: self.ban_of(p, now_ms) for p in self._bans}
        return {p: b for p, b in sorted(out.items()) if b is not None}

    def totals(self, peer: str | None = None) -> dict[str, dict[str, int]]:
        """Totals per peer (credits of flagged authors' entries after the fork point excluded).

        Without ``peer``, only peers with something to show: whether an all-zero row exists depends
        on the order entries arrived in (an equivocator forked at seq 1 leaves one where its entries
        were counted before the fork was seen), and equal replicas must give equal totals."""
        served = self._bytes_served()
        for p, amount in self._served_base.items():
            served[p] = served.get(p, 0) + amount
        peers = [peer] if peer is not None else sorted(set(self._totals) | set(served))
        out = {}
        for p in peers:
            t = replace(self._totals.get(p) or PeerTotals(), bytes_served=served.get(p, 0)).as_dict()
            if peer is not None or any(t.values()):
                out[p] = t
        return out

    # ---------------------------------------------------------------- cuts (node/ledger/cut.py)

    def next_open(self, keep_versions: int, keep_steps: int) -> tuple[int, dict[str, int]]:
        """(open_version, open_steps) of a cut made now that keeps the newest ``keep_versions``
        checkpoint versions and each worker's newest ``keep_steps`` draw steps open (never fewer than
        the cut this replica is based on: nothing closed reopens)."""
        steps = dict(self.open_steps)
        for packed in self._batch_claims.values():
            for _p, _f, w, step, _a, _n in _CLAIM.iter_unpack(packed):
                worker = self._peer_names[w]
                steps[worker] = max(steps.get(worker, 0), step + 1 - keep_steps)
        return (max(self.open_version, self.newest_version() + 1 - keep_versions),
                {w: step for w, step in steps.items() if step > 0})

    def base_parts(self, open_version: int, open_steps: dict[str, int], now_ms: int) -> BaseParts:
        """What a cut closing the versions below ``open_version`` and each worker's draw steps below
        ``open_steps`` at ``now_ms`` keeps of this replica, with peers by name (a canonical form: equal
        for replicas holding the same entries and evidence). Bytes served for closed manifests become
        fixed sums; claims of closed batches, vouched bytes and published sizes of closed manifests
        are left out; a flagged author's log is closed (its usable head, no time or receipt count:
        nothing more joins it)."""
        if open_version < self.open_version or any(open_steps.get(w, 0) < s for w, s in self.open_steps.items()):
            raise ValueError("a cut cannot reopen what the cut it follows closed")
        open_manifests = {m for m, sizes in self._published.items() if max(v for v, _size in sizes) >= open_version}
        served = self._bytes_served(lambda m: m not in open_manifests)
        for peer, amount in self._served_base.items():
            served[peer] = served.get(peer, 0) + amount
        totals = {}
        for peer in set(self._totals) | set(served):
            row = replace(self._totals.get(peer) or PeerTotals(), bytes_served=served.get(peer, 0))
            values = tuple(getattr(row, name) for name in TOTAL_FIELDS)
            if any(values):
                totals[peer] = values
        logs = {}
        for author, log in self._logs.items():
            seq = log.usable()
            closed = bool(log.fork_seq)
            logs[author] = (seq, log.hash_at(seq), 0 if closed else log.last_time_ms, 0 if closed else log.receipts,
                            log.fork_seq, log.evidence)
        batches = {}
        names = self._peer_names
        for batch, packed in self._batch_claims.items():
            claims = [(names[p], f, names[w], step, amount, n) for p, f, w, step, amount, n in _CLAIM.iter_unpack(packed)]
            if any(step >= open_steps.get(w, 0) for _p, _f, w, step, _a, _n in claims):
                batches[batch] = sorted(claims)
        vouched = {(voucher, manifest): claims for voucher, manifest, claims in self._vouched_claims()
                   if manifest in open_manifests}
        bans = [b for bs in self._bans.values() for b in bs
                if b.until_ms > now_ms and b.seq <= self._logs[b.by].usable()]
        return BaseParts(
            open_version=open_version,
            open_steps={w: step for w, step in open_steps.items() if step > 0},
            logs=logs,
            totals=totals,
            trusted_vouched={p: n for p, n in self._trusted_vouched.items() if n},
            batches=batches,
            vouched=vouched,
            published={m: dict(self._published[m]) for m in open_manifests},
            bans=sorted(bans, key=lambda b: (b.peer, b.by, b.seq)),
        )

    def load_base(self, parts: BaseParts) -> None:
        """Start this empty replica from a cut's parts (:func:`node.ledger.cut.ledger_from_cut`)."""
        if self._logs or self._totals:
            raise ValueError("load_base() takes an empty replica")
        self.open_version = parts.open_version
        self.open_steps = dict(parts.open_steps)
        for author, (seq, head_hash, last_time_ms, receipts, fork_seq, evidence) in parts.logs.items():
            self._logs[sys.intern(author)] = _Log(last_time_ms=last_time_ms, receipts=receipts, fork_seq=fork_seq,
                                                  evidence=evidence, base=seq, base_hash=head_hash)
        for peer, values in parts.totals.items():
            row = dict(zip(TOTAL_FIELDS, values, strict=True))
            if row.pop("bytes_served"):
                self._served_base[sys.intern(peer)] = values[TOTAL_FIELDS.index("bytes_served")]
            self._totals[sys.intern(peer)] = PeerTotals(**row)
        self._trusted_vouched.update(parts.trusted_vouched)
        for batch, claims in parts.batches.items():
            self._batch_claims[batch] = b"".join(
                _CLAIM.pack(self._peer_number(sys.intern(p)), f, self._peer_number(sys.intern(w)), step, amount, n)
                for p, f, w, step, amount, n in claims)
        for (voucher, manifest), claims in parts.vouched.items():
            for peer, amount in claims.items():
                self._vouch(sys.intern(voucher), sys.intern(peer), manifest, amount)
        for manifest, sizes in parts.published.items():
            self._published[self._manifests.setdefault(manifest, manifest)] = dict(sizes)
        for ban in parts.bans:
            self._bans.setdefault(ban.peer, []).append(ban)

    def missing(self, remote: Iterable[Head]) -> tuple[list[Want], list[str]]:
        """What a peer with ``remote`` heads has that we lack: entry ranges, and authors whose
        equivocation evidence (a lower fork point than ours) we should fetch."""
        wants: list[Want] = []
        evidence: list[str] = []
        for head in remote:
            log = self._logs.get(head.author)
            if head.fork_seq and (log is None or not log.fork_seq or head.fork_seq < log.fork_seq):
                evidence.append(head.author)
            ours = log.head if log else 0
            limit = head.seq
            if log and log.fork_seq:
                limit = min(limit, log.fork_seq - 1)
            if limit > ours:
                wants.append(Want(head.author, ours + 1, limit))
            elif log and max(1, log.base) <= head.seq <= ours and log.hash_at(head.seq) != head.hash:
                wants.append(Want(head.author, head.seq, head.seq))  # will show the fork
        return wants, evidence


def _pack_vouched(claims: dict[int, int]) -> bytes:
    """Records of {peer number: bytes}: _VOUCHED, or _WIDE and _VOUCHED_WIDE where a sum needs it."""
    if all(-(2**63) <= amount < 2**63 for amount in claims.values()):
        return b"".join(_VOUCHED.pack(*claim) for claim in claims.items())
    return _WIDE + b"".join(_VOUCHED_WIDE.pack(n, amount >> 64, amount & _LOW64) for n, amount in claims.items())


def _unpack_vouched(packed: bytes) -> dict[int, int]:
    """{peer number: bytes} of :func:`_pack_vouched` records."""
    if len(packed) % 2:  # _WIDE (1 byte) + 20 bytes a record; narrow records are 12 bytes
        return {n: high << 64 | low for n, high, low in _VOUCHED_WIDE.iter_unpack(packed[len(_WIDE):])}
    return dict(_VOUCHED.iter_unpack(packed))


def _credits_of(se: SignedEntry) -> list[Credit]:
    """What one entry adds to the totals: one entry for its author, and its body's credits."""
    return [Credit(se.author, "entries", 1), *se.body.credits(se.author)]
