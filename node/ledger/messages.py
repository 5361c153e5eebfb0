"""Wire messages of the ledger's anti-entropy sync, ``/swarm/ledger/1.0.0`` (pure: no I/O).

A session opens with both sides' :class:`SyncHello` (every author's head as the sender sees it);
then the caller asks, one frame at a time, for equivocation evidence it lacks
(:class:`EvidenceRequest` -> :class:`EvidenceReply`) and for missing ranges of an author's log
(:class:`RangeRequest` -> :class:`RangeReply`, at most :data:`MAX_REPLY_BYTES` of entries). Replies
carry their request's ``id``. node/ledger/service.py runs the sessions (its ``SYNC`` spec holds the
session's budgets and deadlines); entries themselves are node/ledger/entries.py's signed bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..wire import Message, bounded, register
from .chain import Head
from .entries import MAX_ENTRY, MAX_PEER_ID

PROTOCOL = "/swarm/ledger/1.0.0"
MAX_AUTHORS = 20_000  # heads in one SyncHello (about 130 bytes each: well under the 4 MiB frame cap)
MAX_REPLY_BYTES = 1024 * 1024  # entry bytes in one RangeReply
MAX_REPLY_ENTRIES = 4096  # schema bound; sync_batch (config) is the working value


@register
@dataclass(frozen=True)
class SyncHello(Message):
    """Both sides' first frame: every author's head as the sender sees it."""

    TYPE: ClassVar[str] = "ledger-hello"
    heads: tuple[Head, ...] = bounded(max_len=MAX_AUTHORS)


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
