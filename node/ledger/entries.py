"""Ledger entries: what one author signs, the kinds of facts it may record, and how bytes are checked.

How this works
--------------
An entry is an :class:`Entry` message (run, author peer id, sequence number, hash of the author's
previous entry, timestamp, kind, body) sealed in a signed :class:`~node.wire.Envelope` for the
domain ``"ledger-entry"``. Sequence numbers start at 1; entry 1 points at :data:`GENESIS`.
The body is the msgpack encoding of the kind's own typed message (:data:`KINDS`), so each kind has
its own schema and bounds, and a new kind is one more class, not a change to the entry format.

The entry's hash — what the next entry's ``prev`` points at and what heads are compared by — is
:func:`node.hashes.digest` of the *envelope* bytes, not of the payload, because:

* the chain then commits to the exact signed bytes that are stored and sent, so checking a link
  needs no re-encoding and a stored chain can be verified byte-for-byte from disk;
* the hash covers the signature too, so an entry is only "the same" if it is the same signed object.

Hashing transmitted bytes is only sound if one signed entry has exactly one byte form; otherwise a
relay could re-encode an envelope (reorder map keys, widen an integer) and make an honest author look
like an equivocator. :func:`parse_entry` therefore refuses any envelope that is not byte-identical to
its canonical re-encoding (``non-canonical``), and Ed25519 signatures as checked by OpenSSL are not
malleable (RFC 8032 §5.1.7: S must be < L). The payload inside needs no such check: nobody but the
author can change signed bytes, and an author who signs two encodings of one seq has signed two
different entries — an equivocation, rightly flagged. Ed25519 signing is deterministic, so an
author re-signing the same payload yields the same bytes.

Everything here is pure: no clock, no I/O. Parsing untrusted bytes raises
:class:`~node.wire.RemoteProtocolError` with a short reason, and nothing else.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass
from typing import ClassVar

from .. import hashes
from ..identity import peer_id_of, public_key_of
from ..wire import (
    Envelope,
    LocalProtocolError,
    Message,
    RemoteProtocolError,
    bounded,
    decode_as,
    encode,
    pack,
    register,
    seal,
)

DOMAIN = "ledger-entry"
GENESIS = bytes(32)  # ``prev`` of every author's first entry
# One signed entry on the wire (envelope included). Gossip messages are capped at 64 KiB
# (node.net.host.MAX_GOSSIP); entries are small facts, so 8 KiB leaves room and bounds what a peer can
# make us verify, store and forward per entry.
MAX_ENTRY = 8 * 1024
MAX_BODY = 6 * 1024  # the body inside it (the rest is envelope and entry header)
MAX_SEQ = 2**53  # also JSON-safe
MAX_PEER_ID = 64  # an Ed25519 peer id is 52 characters
MAX_REASON = 64  # one machine-readable reason code
MAX_RECEIPT_ITEMS = 32  # (peer, manifest) pairs per receipt entry: at most ~150 B each, inside MAX_BODY
MAX_VERDICT_REASONS = 16
PEER_ID_CACHE = 4096  # peer ids whose base58 form is cached


class Authors(enum.Flag):
    """Who may author an entry of a kind (the run file lists trainers and validators)."""

    TRAINER = enum.auto()
    VALIDATOR = enum.auto()
    ANYONE = enum.auto()


@functools.lru_cache(maxsize=PEER_ID_CACHE)
def is_peer_id(value: str) -> bool:
    """Whether ``value`` names an Ed25519 peer (cached: the same peers recur in every entry)."""
    try:
        public_key_of(value)
        return True
    except ValueError:
        return False


def check_receipt(peer: str, manifest_id: bytes, nbytes: int, pieces: int) -> None:
    """ValueError for a received-bytes note that could never make a valid receipt (a caller's bug):
    what the ledger's ``note_received`` and its stand-ins refuse alike."""
    if not isinstance(peer, str) or not is_peer_id(peer) or len(manifest_id) != 32 or nbytes < 0 or pieces < 0:
        raise ValueError(f"note_received: bad receipt ({str(peer)[:20]!r}, {len(manifest_id)}-byte id, {nbytes}, {pieces})")


def _check_peer_id(name: str, value: str) -> None:
    if not is_peer_id(value):
        raise ValueError(f"{name} is not an Ed25519 peer id")


# base58 of a 38-byte number costs ~10 µs in Python; the same few hundred peers appear in every
# entry, so both directions are cached (bounded).
_peer_id_of = functools.lru_cache(maxsize=PEER_ID_CACHE)(peer_id_of)


# --------------------------------------------------------------------------------------------
# Credits: what an entry adds to whose totals


@dataclass(frozen=True)
class Credit:
    """``amount`` added to ``field`` of ``peer``'s totals.

    With a ``manifest``, the amount is bytes of that checkpoint: vouched for (``bytes_served``),
    which the replica caps at the checkpoint's published size per voucher, or the published size
    itself (``PUBLISHED``), which sets that cap.

    With a ``batch`` (a rollout batch's id), the credit is for that batch: the replica counts it
    once per (peer, field, batch) however many entries claim it (issue 42: a batch recorded by two
    trainers, or a verdict delivered twice, counted twice).

    ``step`` is a published manifest's checkpoint version, or a batch's draw step, which is its
    ``worker``'s own counter (node/rollouts/steps.py; the batch's id commits to both): a cut
    (node/ledger/cut.py) closes the versions below its ``open_version`` and each worker's draw steps
    below its open step, and credits of a closed manifest or batch count nothing after it.
    """

    peer: str
    field: str
    amount: int
    manifest: bytes | None = None
    batch: bytes | None = None
    step: int = 0
    worker: str = ""  # a batch credit's worker (whose draw step ``step`` is); for a verdict not ``peer``


PUBLISHED = "published"  # pseudo-field of a CheckpointPublished credit: the manifest's size


TOTAL_FIELDS = (
    "entries",  # entries authored
    "checkpoints",  # checkpoints published (trainers)
    "rollouts_accepted",  # samples of this worker accepted by a trainer
    "rollouts_rejected",  # samples of this worker rejected by a trainer
    "tokens",  # tokens in accepted samples
    "verdicts",  # verdicts signed (validators)
    "verdicts_failed",  # verdicts against this worker's batches that failed
    "bytes_served",  # verified bytes other peers say they received from this peer
    "penalties",  # penalty points against this peer
    "bans",  # bans against this peer
)


# --------------------------------------------------------------------------------------------
# Bodies, one typed message per kind. TYPE is the kind name.


class Body(Message):
    """Base of entry bodies: says which credits the entry gives."""

    def credits(self, author: str) -> list[Credit]:
        raise NotImplementedError


@register
@dataclass(frozen=True)
class CheckpointPublished(Body):
    """A trainer published checkpoint ``version`` with manifest ``manifest_id`` (trainer only)."""

    TYPE: ClassVar[str] = "checkpoint"
    version: int = bounded(min=0, max=2**32)
    manifest_id: bytes = bounded(exact_len=32)
    total_bytes: int = bounded(min=0, max=2**50)

    def credits(self, author: str) -> list[Credit]:
        return [Credit(author, "checkpoints", 1),
                Credit(author, PUBLISHED, self.total_bytes, self.manifest_id, step=self.version)]


@register
@dataclass(frozen=True)
class RolloutsJudged(Body):
    """A trainer accepted or rejected a worker's rollout batch for ``step`` (trainer only)."""

    TYPE: ClassVar[str] = "rollouts"
    worker: str = bounded(max_len=MAX_PEER_ID)
    step: int = bounded(min=0, max=2**32)
    accepted: bool
    samples: int = bounded(min=0, max=2**20)
    tokens: int = bounded(min=0, max=2**40)
    batch_hash: bytes = bounded(exact_len=32)
    reason: str = bounded(max_len=MAX_REASON, default="")  # why rejected ("" when accepted)

    def __post_init__(self) -> None:
        _check_peer_id("worker", self.worker)

    def credits(self, author: str) -> list[Credit]:
        w, b, step = self.worker, self.batch_hash, self.step
        if self.accepted:
            return [Credit(w, "rollouts_accepted", self.samples, batch=b, step=step, worker=w),
                    Credit(w, "tokens", self.tokens, batch=b, step=step, worker=w)]
        return [Credit(w, "rollouts_rejected", self.samples, batch=b, step=step, worker=w)]


@register
@dataclass(frozen=True)
class Verdict(Body):
    """A validator's verdict on a worker's batch (validator only)."""

    TYPE: ClassVar[str] = "verdict"
    worker: str = bounded(max_len=MAX_PEER_ID)
    step: int = bounded(min=0, max=2**32)
    batch_hash: bytes = bounded(exact_len=32)
    ok: bool
    reasons: tuple[str, ...] = bounded(max_len=MAX_VERDICT_REASONS, item_max_len=MAX_REASON, default=())

    def __post_init__(self) -> None:
        _check_peer_id("worker", self.worker)

    def credits(self, author: str) -> list[Credit]:
        w, b, step = self.worker, self.batch_hash, self.step
        out = [Credit(author, "verdicts", 1, batch=b, step=step, worker=w)]  # one per batch it judged
        if not self.ok:
            out.append(Credit(w, "verdicts_failed", 1, batch=b, step=step, worker=w))
        return out


@register
@dataclass(frozen=True)
class ReceiptItem(Message):
    """Verified bytes received from ``peer`` for one manifest since the previous receipt."""

    TYPE: ClassVar[str] = "receipt-item"
    peer: str = bounded(max_len=MAX_PEER_ID)
    manifest_id: bytes = bounded(exact_len=32)
    nbytes: int = bounded(min=1, max=2**50)
    pieces: int = bounded(min=1, max=2**32)

    def __post_init__(self) -> None:
        _check_peer_id("peer", self.peer)


@register
@dataclass(frozen=True)
class Receipts(Body):
    """A downloader's batched receipts for verified bytes received (anyone may author).

    Batched (one entry per flush interval, :data:`MAX_RECEIPT_ITEMS` pairs at most) so that a
    checkpoint of thousands of pieces costs a handful of entries, not one per piece.
    """

    TYPE: ClassVar[str] = "receipts"
    items: tuple[ReceiptItem, ...] = bounded(max_len=MAX_RECEIPT_ITEMS)

    def __post_init__(self) -> None:
        if not self.items:
            raise ValueError("a receipt needs at least one item")

    def credits(self, author: str) -> list[Credit]:
        # Receipts for oneself credit nothing: bytes served are what *others* vouch for.
        return [Credit(i.peer, "bytes_served", i.nbytes, i.manifest_id) for i in self.items if i.peer != author]


@register
@dataclass(frozen=True)
class Penalty(Body):
    """A penalty (and optionally a ban) against a peer (trainers and validators)."""

    TYPE: ClassVar[str] = "penalty"
    peer: str = bounded(max_len=MAX_PEER_ID)
    reason: str = bounded(max_len=MAX_REASON)
    points: int = bounded(min=0, max=1_000_000)
    ban_seconds: int = bounded(min=0, max=30 * 86400, default=0)

    def __post_init__(self) -> None:
        _check_peer_id("peer", self.peer)

    def credits(self, author: str) -> list[Credit]:
        out = [Credit(self.peer, "penalties", self.points)]
        if self.ban_seconds:
            out.append(Credit(self.peer, "bans", 1))
        return out


@dataclass(frozen=True)
class Kind:
    body: type[Body]
    authors: Authors


KINDS: dict[str, Kind] = {
    CheckpointPublished.TYPE: Kind(CheckpointPublished, Authors.TRAINER),
    RolloutsJudged.TYPE: Kind(RolloutsJudged, Authors.TRAINER),
    Verdict.TYPE: Kind(Verdict, Authors.VALIDATOR),
    Receipts.TYPE: Kind(Receipts, Authors.ANYONE),
    Penalty.TYPE: Kind(Penalty, Authors.TRAINER | Authors.VALIDATOR),
}


# --------------------------------------------------------------------------------------------
# The entry


@register
@dataclass(frozen=True)
class Entry(Message):
    """One signed fact in an author's log (the payload of a ``ledger-entry`` envelope)."""

    TYPE: ClassVar[str] = "ledger-entry"
    run: str = bounded(max_len=64)
    author: str = bounded(max_len=MAX_PEER_ID)
    seq: int = bounded(min=1, max=MAX_SEQ)
    prev: bytes = bounded(exact_len=32)
    time_ms: int = bounded(min=0, max=MAX_SEQ)  # author's clock, Unix milliseconds
    kind: str = bounded(max_len=32)
    body: bytes = bounded(max_len=MAX_BODY)  # msgpack of KINDS[kind].body


@dataclass(frozen=True)
class SignedEntry:
    """An entry whose bytes, schema and signature have been checked (or that we made ourselves)."""

    raw: bytes  # canonical envelope bytes: what is stored, sent and hashed
    hash: bytes  # hashes.digest(raw)
    entry: Entry
    body: Body

    @property
    def author(self) -> str:
        return self.entry.author

    @property
    def seq(self) -> int:
        return self.entry.seq

    @property
    def prev(self) -> bytes:
        return self.entry.prev

    @property
    def kind(self) -> str:
        return self.entry.kind

    @property
    def time_ms(self) -> int:
        return self.entry.time_ms

    def envelope(self) -> Envelope:
        return decode_as(Envelope, self.raw, MAX_ENTRY)


def make_entry(identity, run: str, seq: int, prev: bytes, time_ms: int, body: Body) -> SignedEntry:
    """Sign a new entry with ``identity`` (anything with ``peer_id``, ``public_bytes``, ``sign``)."""
    if body.TYPE not in KINDS or not isinstance(body, KINDS[body.TYPE].body):
        raise LocalProtocolError(f"{type(body).__name__} is not a ledger entry kind")
    entry = Entry(
        run=run, author=identity.peer_id, seq=seq, prev=prev, time_ms=time_ms, kind=body.TYPE, body=encode(body)
    )
    raw = encode(seal(identity, DOMAIN, entry))
    if len(raw) > MAX_ENTRY:
        raise LocalProtocolError(f"ledger entry of {len(raw)} bytes exceeds MAX_ENTRY")
    return SignedEntry(raw=raw, hash=hashes.digest(raw), entry=entry, body=body)


def parse_entry(raw: bytes, *, verify_signature: bool = True) -> SignedEntry:
    """Check untrusted bytes and return the entry; RemoteProtocolError with a reason otherwise.

    Checks, cheapest first so garbage costs little: size, envelope schema, canonical form, domain,
    entry schema, known kind, body schema, author = signing key, and last the Ed25519 signature.
    Chain rules (links, sequence, authority, run, time) are :mod:`node.ledger.chain`'s job.
    ``verify_signature=False`` is only for re-reading our own database, whose entries were verified
    before they were stored.
    """
    if len(raw) > MAX_ENTRY:
        raise RemoteProtocolError("oversized", f"entry of {len(raw)} bytes > {MAX_ENTRY}")
    env = decode_as(Envelope, raw, MAX_ENTRY)
    if pack(env.to_wire()) != raw:
        raise RemoteProtocolError("non-canonical", "envelope")
    if env.domain != DOMAIN:
        raise RemoteProtocolError("wrong-domain", env.domain[:32])
    entry = decode_as(Entry, env.payload, MAX_ENTRY)
    kind = KINDS.get(entry.kind)
    if kind is None:
        raise RemoteProtocolError("unknown-kind", entry.kind[:32])
    body = decode_as(kind.body, entry.body, MAX_BODY)
    if entry.author != _peer_id_of(env.public_key):
        raise RemoteProtocolError("author-mismatch", entry.author[:20])
    if verify_signature:
        env.open(DOMAIN)
    return SignedEntry(raw=raw, hash=hashes.digest(raw), entry=entry, body=body)


def entry_to_json(se: SignedEntry) -> dict:
    """A JSON-able view of an entry (for export); bytes as hex, the envelope in full."""
    env = se.envelope()
    return {
        "author": se.author,
        "seq": se.seq,
        "hash": se.hash.hex(),
        "prev": se.prev.hex(),
        "time_ms": se.time_ms,
        "run": se.entry.run,
        "kind": se.kind,
        "body": _jsonable(se.body.to_wire()),
        "public_key": env.public_key.hex(),
        "signature": env.signature.hex(),
        "envelope": se.raw.hex(),
    }


def _jsonable(value):
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items() if k not in ("t", "v")}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value
