"""Wire messages of the ledger's anti-entropy sync, ``/swarm/ledger/1.1.0`` and ``1.0.0`` (pure: no I/O).

A session opens with both sides' :class:`SyncHello` (every author's head as the sender sees it);
then the caller asks, one frame at a time, for equivocation evidence it lacks
(:class:`EvidenceRequest` -> :class:`EvidenceReply`) and for missing ranges of an author's log
(:class:`RangeRequest` -> :class:`RangeReply`, at most :data:`MAX_REPLY_BYTES` of entries). Replies
carry their request's ``id``. node/ledger/service.py runs the sessions (its ``SYNC`` spec holds the
session's budgets and deadlines); entries themselves are node/ledger/entries.py's signed bytes.

Cuts (node/ledger/cut.py, node/ledger/cutsync.py): a hello also names the trainer-signed cut the sender's
replica is based on (number and hash of the signed bytes; left off the wire when it has none, so a
node without cuts sends the bytes older nodes read). A caller seeing a newer cut than its own asks for
it first, one page at a time (:class:`CutPageRequest` -> :class:`CutPage`: the signed cut is larger
than a frame), since a peer based on a cut holds no entries at or below its heads.

Versions: a session that may carry cuts goes on :data:`PROTOCOL_CUTS`. Nodes of the release before cuts
speak :data:`PROTOCOL` only, and their decoder refuses a hello naming a cut (``unknown-field``, the
sender scored down), so on :data:`PROTOCOL` a hello never names one and no cut page is asked for; a
caller offers :data:`PROTOCOL_CUTS` first and falls back to :data:`PROTOCOL` (node/ledger/service.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..wire import Message, bounded, register
from .chain import Head
from .entries import MAX_ENTRY, MAX_PEER_ID

PROTOCOL = "/swarm/ledger/1.0.0"  # without cuts; also the source sync faults are counted under
PROTOCOL_CUTS = "/swarm/ledger/1.1.0"  # the same messages, a hello naming the sender's cut, cut pages
MAX_AUTHORS = 20_000  # heads in one SyncHello (about 130 bytes each: well under the 4 MiB frame cap)
MAX_REPLY_BYTES = 1024 * 1024  # entry bytes in one RangeReply
MAX_REPLY_ENTRIES = 4096  # schema bound; sync_batch (config) is the working value
CUT_PAGE_BYTES = 1024 * 1024  # bytes of a signed cut per CutPage (node.wire.MAX_FRAME is 4 MiB)
MAX_CUT_NUMBER = 2**53


@register
@dataclass(frozen=True)
class SyncHello(Message):
    """Both sides' first frame: every author's head as the sender sees it."""

    TYPE: ClassVar[str] = "ledger-hello"
    heads: tuple[Head, ...] = bounded(max_len=MAX_AUTHORS)
    # The cut the sender's replica is based on: its number (0 = none) and the hash of its signed bytes.
    cut_number: int = bounded(min=0, max=MAX_CUT_NUMBER, default=0)
    cut_hash: bytes = bounded(max_len=32, default=b"")

    def to_wire(self) -> dict:
        out = super().to_wire()
        if self.cut_number == 0 and not self.cut_hash:  # what a node without cuts sent before they existed
            del out["cut_number"], out["cut_hash"]
        return out


@register
@dataclass(frozen=True)
class RangeRequest(Message):
    TYPE: ClassVar[str] = "ledger-range?"
    id: int = bounded(min=0, max=2**32)
    author: str = bounded(max_len=MAX_PEER_ID)
    start: int = bounded(min=1, max=2**53)
    end: int = bounded(min=1, max=2**53)


@register
@dataclass(frozen=True)
class RangeReply(Message):
    TYPE: ClassVar[str] = "ledger-range"
    id: int = bounded(min=0, max=2**32)
    entries: tuple[bytes, ...] = bounded(max_len=MAX_REPLY_ENTRIES, item_max_len=MAX_ENTRY)


@register
@dataclass(frozen=True)
class EvidenceRequest(Message):
    TYPE: ClassVar[str] = "ledger-evidence?"
    id: int = bounded(min=0, max=2**32)
    author: str = bounded(max_len=MAX_PEER_ID)


@register
@dataclass(frozen=True)
class EvidenceReply(Message):
    TYPE: ClassVar[str] = "ledger-evidence"
    id: int = bounded(min=0, max=2**32)
    a: bytes = bounded(max_len=MAX_ENTRY)  # both empty: no evidence
    b: bytes = bounded(max_len=MAX_ENTRY)


@register
@dataclass(frozen=True)
class CutPageRequest(Message):
    """Page ``index`` of the signed cut ``number`` the answerer's hello named."""

    TYPE: ClassVar[str] = "ledger-cut-page?"
    id: int = bounded(min=0, max=2**32)
    number: int = bounded(min=1, max=MAX_CUT_NUMBER)
    index: int = bounded(min=0, max=2**16)


@register
@dataclass(frozen=True)
class CutPage(Message):
    """One page of a signed cut, of ``count`` pages; ``count`` 0 (and no data): the answerer no longer
    holds cut ``number`` (it adopted a newer one since its hello)."""

    TYPE: ClassVar[str] = "ledger-cut-page"
    id: int = bounded(min=0, max=2**32)
    number: int = bounded(min=1, max=MAX_CUT_NUMBER)
    index: int = bounded(min=0, max=2**16)
    count: int = bounded(min=0, max=2**16)
    data: bytes = bounded(max_len=CUT_PAGE_BYTES)
