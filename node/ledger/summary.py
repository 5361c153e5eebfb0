"""Ledger summaries: a replica's state at a cut, in one row per peer, for a trainer to sign.

How this works
--------------
Issue 46 item 4: every entry is replicated to every peer forever, so a new node's catch-up and a
replica's storage grow with the run's history (``bench/ledger.py --scale``: a week of 1,000 workers
at the demo's rates is 49 M-2 G entries). A summary is what a node needs instead of the history
below a cut: one :class:`SummaryRow` per author or credited peer (usable head, fork point, last time
stamp, every total of :data:`~node.ledger.entries.TOTAL_FIELDS`, the longest active ban), plus the
replica's :meth:`~node.ledger.chain.Ledger.digest`, so it grows with the peers, not the entries.

* :func:`summarise` computes it from a replica (pure, deterministic: two replicas holding the same
  entries and evidence give byte-identical summaries, whatever order the entries came in).
* :func:`sign_summary` seals it for the domain ``"ledger-summary"``; :func:`open_summary` is what a
  new node runs: schema, signature, and a signer among the run file's trainers.
* :func:`summary_problem` is what a node holding the history runs on a summary it is offered: its
  own summary at the same cut must be the same, else the signer summed wrongly (a fraud proof: the
  signed summary and the entries it contradicts).

A summary is a view for people and tools; the state a replica builds on (receipt counts per author,
open per-batch and per-checkpoint claims) is a cut's (node/ledger/cut.py), which also signs with
:func:`sign` and opens with :func:`open_signed`. Neither is wired into sync or the store yet. Pure: time comes in as ``now_ms``; no I/O.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import ClassVar

from ..identity import peer_id_of
from ..wire import Envelope, Message, RemoteProtocolError, bounded, decode_as, encode, register, seal
from .chain import Ledger
from .entries import GENESIS, MAX_PEER_ID, MAX_SEQ, TOTAL_FIELDS

DOMAIN = "ledger-summary"
# Rows in one summary: ~250 bytes each, so 10,000 fit well inside one 4 MiB frame (node.wire.MAX_FRAME).
# A larger swarm needs summaries in pages under one signed root (the proposal's next step).
MAX_SUMMARY_ROWS = 10_000
MAX_SUMMARY_BYTES = 4 * 1024 * 1024


@register
@dataclass(frozen=True)
class SummaryRow(Message):
    """One peer at the cut: its own log's usable head (seq 0 if it authored nothing), fork point,
    last time stamp, its totals in :data:`TOTAL_FIELDS` order and the end of its longest active ban."""

    TYPE: ClassVar[str] = "ledger-summary-row"
    peer: str = bounded(max_len=MAX_PEER_ID)
    seq: int = bounded(min=0, max=MAX_SEQ)
    hash: bytes = bounded(exact_len=32)  # GENESIS when seq is 0
    fork_seq: int = bounded(min=0, max=MAX_SEQ)  # 0 = not flagged
    last_time_ms: int = bounded(min=0, max=MAX_SEQ)
    totals: tuple[int, ...] = bounded(max_len=len(TOTAL_FIELDS), item_min=0, item_max=2**63 - 1)
    ban_until_ms: int = bounded(min=0, max=MAX_SEQ, default=0)  # 0 = no active ban at the summary's time

    def totals_dict(self) -> dict[str, int]:
        return dict(zip(TOTAL_FIELDS, self.totals, strict=True))


@register
@dataclass(frozen=True)
class Summary(Message):
    """A replica's state at a cut: rows sorted by peer, the replica's digest, the time bans are judged at."""

    TYPE: ClassVar[str] = "ledger-summary"
    run: str = bounded(max_len=64)
    time_ms: int = bounded(min=0, max=MAX_SEQ)
    digest: bytes = bounded(exact_len=32)  # Ledger.digest(): the heads and fork points the rows cover
    rows: tuple[SummaryRow, ...] = bounded(max_len=MAX_SUMMARY_ROWS)

    def row(self, peer: str) -> SummaryRow | None:
        """``peer``'s row (binary search: rows are sorted by peer)."""
        lo = bisect.bisect_left(self.rows, peer, key=lambda r: r.peer)
        return self.rows[lo] if lo < len(self.rows) and self.rows[lo].peer == peer else None


def summarise(ledger: Ledger, now_ms: int) -> Summary:
    """The summary of ``ledger`` as it stands, bans judged at ``now_ms``. Raises ValueError past
    :data:`MAX_SUMMARY_ROWS` peers (the caller's bug: pages are not designed yet)."""
    heads = {h.author: h for h in ledger.heads()}
    totals = ledger.totals()
    bans = ledger.bans(now_ms)
    peers = sorted(set(heads) | set(totals) | set(bans))
    if len(peers) > MAX_SUMMARY_ROWS:
        raise ValueError(f"{len(peers)} peers: a summary holds at most {MAX_SUMMARY_ROWS}")
    rows = []
    for peer in peers:
        head = heads.get(peer)
        counts = totals.get(peer) or ledger.totals(peer)[peer]
        ban = bans.get(peer)
        rows.append(SummaryRow(
            peer=peer,
            seq=head.seq if head else 0,
            hash=head.hash if head else GENESIS,
            fork_seq=head.fork_seq if head else 0,
            last_time_ms=ledger.last_time_ms(peer),
            totals=tuple(counts[f] for f in TOTAL_FIELDS),
            ban_until_ms=ban.until_ms if ban else 0,
        ))
    return Summary(run=ledger.run, time_ms=now_ms, digest=ledger.digest(), rows=tuple(rows))


def sign(identity, domain: str, message: Message, envelope: type[Envelope] = Envelope) -> bytes:
    """``message`` sealed by ``identity`` (a trainer of the run) for ``domain``, as it is stored and
    sent, in ``envelope`` (an Envelope type whose payload bound fits the message)."""
    env = seal(identity, domain, message)
    if envelope is not Envelope:
        env = envelope(domain=env.domain, payload=env.payload, public_key=env.public_key, signature=env.signature)
    return encode(env)


def open_signed(raw: bytes, domain: str, cls: type, max_bytes: int, run: str,
                trainers: frozenset[str] | set[str], envelope: type[Envelope] = Envelope) -> tuple[str, Message]:
    """(signer, message) of untrusted bytes sealed for ``domain``: schema, signature, a signer among
    ``trainers`` (the run file's), the right ``run``. RemoteProtocolError with a reason otherwise."""
    env = decode_as(envelope, raw, max_bytes)
    signer = peer_id_of(env.public_key)
    if signer not in trainers:  # before the signature and the payload: anyone can sign megabytes with its own key
        raise RemoteProtocolError("unauthorized", f"{domain} signed by {signer[-8:]}, not a trainer of the run")
    message = env.open_as(domain, cls, max_bytes)
    if message.run != run:
        raise RemoteProtocolError("wrong-run", message.run[:32])
    return signer, message


def sign_summary(identity, summary: Summary) -> bytes:
    """The summary sealed by ``identity`` (a trainer of the run), as it would be stored and sent."""
    return sign(identity, DOMAIN, summary)


def open_summary(raw: bytes, run: str, trainers: frozenset[str] | set[str]) -> tuple[str, Summary]:
    """(signer, summary) of untrusted bytes: schema, signature, a signer among ``trainers`` (the run
    file's), the right run. RemoteProtocolError with a reason otherwise (the sender is wrong)."""
    signer, summary = open_signed(raw, DOMAIN, Summary, MAX_SUMMARY_BYTES, run, trainers)
    if any(a.peer >= b.peer for a, b in zip(summary.rows, summary.rows[1:])):
        raise RemoteProtocolError("unsorted-rows")
    return signer, summary


def summary_problem(summary: Summary, ledger: Ledger) -> str | None:
    """Why ``summary`` is not ``ledger``'s state at the summary's time (None when it is), for a node
    that holds the history. Only meaningful at the same cut: a digest that differs means the replica
    holds other heads (behind, ahead or another branch), not that the summary is wrong."""
    if summary.run != ledger.run:
        return "wrong-run"
    if summary.digest != ledger.digest():
        return "other-cut"
    ours = summarise(ledger, summary.time_ms)
    if ours.rows == summary.rows:
        return None
    theirs = {r.peer: r for r in summary.rows}
    for row in ours.rows:
        if theirs.get(row.peer) != row:
            return f"row-differs:{row.peer}"
    extra = sorted(set(theirs) - {r.peer for r in ours.rows})
    return f"row-differs:{extra[0]}"
