"""Wire messages of ``/swarm/shards/1.0.0`` and of the checkpoint announcements.

How this works
--------------
A stream starts with one message from the side that opened it:

* ``ManifestRequest(root)`` -> one ``ManifestReply(envelope)`` or ``Reject``; the stream closes.
* ``NewestRequest(above)`` -> the ``ManifestReply`` of the newest version held if newer than
  ``above``, else ``Reject`` (``none-newer``, or ``busy`` past the refusal budget); the stream
  closes. A node that waited a re-announcement period for a version it knows exists asks this
  (node/shards/catchup.py). ``NewestRequest(above, version)`` asks for that one version's manifest
  instead (``not-held`` when the peer has none): a validator holding a batch of a version older
  than the newest it knows, whose announcement it never heard.
* ``Hello(root, bitfield)`` opens a transfer session for one manifest. The server answers with its
  ``Bitfield`` (or ``Reject`` and closes). Then, in any order, until either side closes:
  the downloader sends ``Request(piece, offset, length)``, ``Cancel(...)`` and, when the server's
  ``Bitfield`` asked for them (``wants_haves``: a super-seeder), ``Have(piece)`` (so the server knows
  what it may hand to whom); the server sends ``Data(piece, offset,
  bytes)`` or ``Reject(piece, offset, reason)`` per request, and ``Have(piece)`` when it verifies
  (or reveals) a piece, so a relay serves pieces onward while it is still downloading.

This follows BitTorrent's peer wire protocol (BEP 3: bitfield, have, request, piece, cancel) with
BEP 6's reject; choking is replaced by a bounded serving queue per session and a global cap on
requests served at once. Frames are capped at :data:`MAX_SHARDS_FRAME`; every field is bounded.

Announcements (gossip, ``/swarm/<run>/checkpoints/1``) are :class:`Announce` sealed by a trainer
under :data:`ANNOUNCE_DOMAIN`: the manifest itself may be larger than a gossip message, so only its
root id travels there and the manifest is fetched over a stream and checked against that id.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..hashes import DIGEST_SIZE
from ..identity import peer_id_of
from ..wire import Envelope, Message, RemoteProtocolError, bounded, decode, decode_as, read_frame, register
from .manifest import MAX_FILE_NAME, MAX_MANIFEST_BYTES, MAX_PIECE_SIZE, MAX_PIECES, MAX_TOTAL_SIZE, MAX_VERSION

PROTOCOL = "/swarm/shards/1.0.0"
# The same messages; a NewestRequest naming a version goes only here. A node older than the version
# field refuses it as unknown-field and strikes the asker as a garbage sender; it does not speak this
# protocol, so such a request is refused at negotiation instead, before any frame.
PROTOCOL_BY_VERSION = "/swarm/shards/1.1.0"
ANNOUNCE_DOMAIN = "shards-announce"
MAX_BLOCK = 1 << 20  # largest block a request may ask for (config block_size <= this)
MAX_BITFIELD = MAX_PIECES // 8
MAX_REASON = 32
# The largest frame either side reads: a manifest reply or a data block, plus msgpack overhead.
MAX_SHARDS_FRAME = max(MAX_MANIFEST_BYTES + 1024, MAX_BLOCK + 1024) + MAX_FILE_NAME
FIRST_MESSAGE_TIMEOUT = 10.0  # seconds a new stream may stay silent
SOURCE = "shards"  # metrics label for rejections, fault source in the peer table
MAX_ANNOUNCE = 1024

_piece = dict(min=0, max=MAX_PIECES - 1)


@register
@dataclass(frozen=True)
class ManifestRequest(Message):
    TYPE: ClassVar[str] = "shards.manifest-request"
    root: bytes = bounded(exact_len=DIGEST_SIZE)


@register
@dataclass(frozen=True)
class ManifestReply(Message):
    TYPE: ClassVar[str] = "shards.manifest-reply"
    envelope: Envelope = bounded()


@register
@dataclass(frozen=True)
class NewestRequest(Message):
    TYPE: ClassVar[str] = "shards.newest-request"
    above: int = bounded(min=-1, max=MAX_VERSION)
    # The one version wanted (a validator holding a batch of it), -1: the newest above ``above``. Sent
    # only when set, so a request for the newest is the same bytes an older node sends and reads.
    version: int = bounded(min=-1, max=MAX_VERSION, default=-1)

    def to_wire(self) -> dict:
        out = super().to_wire()
        if self.version == -1:
            del out["version"]
        return out


@register
@dataclass(frozen=True)
class Hello(Message):
    TYPE: ClassVar[str] = "shards.hello"
    root: bytes = bounded(exact_len=DIGEST_SIZE)
    bitfield: bytes = bounded(max_len=MAX_BITFIELD)


@register
@dataclass(frozen=True)
class Bitfield(Message):
    TYPE: ClassVar[str] = "shards.bitfield"
    bitfield: bytes = bounded(max_len=MAX_BITFIELD)
    # Does the server want the downloader's Have messages? Only a super-seeder uses them (to pick
    # what to reveal to whom); any other server would read and drop one per piece per peer, which
    # at N peers is N Haves per piece on the downloader's side, each a Yamux frame and a wake-up.
    wants_haves: bool = bounded(default=True)


@register
@dataclass(frozen=True)
class Have(Message):
    TYPE: ClassVar[str] = "shards.have"
    piece: int = bounded(**_piece)


@register
@dataclass(frozen=True)
class Request(Message):
    TYPE: ClassVar[str] = "shards.request"
    piece: int = bounded(**_piece)
    offset: int = bounded(min=0, max=MAX_PIECE_SIZE - 1)
    length: int = bounded(min=1, max=MAX_BLOCK)


@register
@dataclass(frozen=True)
class Cancel(Message):
    TYPE: ClassVar[str] = "shards.cancel"
    piece: int = bounded(**_piece)
    offset: int = bounded(min=0, max=MAX_PIECE_SIZE - 1)
    length: int = bounded(min=1, max=MAX_BLOCK)


@register
@dataclass(frozen=True)
class Data(Message):
    TYPE: ClassVar[str] = "shards.data"
    piece: int = bounded(**_piece)
    offset: int = bounded(min=0, max=MAX_PIECE_SIZE - 1)
    data: bytes = bounded(max_len=MAX_BLOCK)  # as read by read_shards_message: a memoryview of the frame


@register
@dataclass(frozen=True)
class Reject(Message):
    """A request (piece >= 0) or the whole stream (piece = -1) refused, with a short reason."""

    TYPE: ClassVar[str] = "shards.reject"
    piece: int = bounded(min=-1, max=MAX_PIECES - 1)
    offset: int = bounded(min=0, max=MAX_PIECE_SIZE - 1)
    reason: str = bounded(max_len=MAX_REASON)


# Reject reasons
UNKNOWN_ROOT = "unknown-root"
NOT_HELD = "not-held"
BAD_RANGE = "bad-range"
BUSY = "busy"
BANNED = "banned"
RELAYED = "relayed"  # a transfer session asked over a relay circuit: bulk data goes direct only
NONE_NEWER = "none-newer"  # NewestRequest: we hold no version newer than the one asked above


@register
@dataclass(frozen=True)
class Announce(Message):
    """A trainer says: version ``version`` of ``run`` is the manifest with root id ``root``."""

    TYPE: ClassVar[str] = "shards.announce"
    run: str = bounded(max_len=64)
    version: int = bounded(min=0, max=MAX_VERSION)
    root: bytes = bounded(exact_len=DIGEST_SIZE)
    total_size: int = bounded(min=1, max=MAX_TOTAL_SIZE)
    num_pieces: int = bounded(min=1, max=MAX_PIECES)
    # The same version as a delta (node/shards/deltasync.py): the delta manifest's root and the
    # version it applies to; empty / -1 when the trainer published none.
    delta_root: bytes = bounded(max_len=DIGEST_SIZE, default=b"")
    delta_base: int = bounded(min=-1, max=MAX_VERSION, default=-1)

    def __post_init__(self) -> None:
        if self.delta_root and (len(self.delta_root) != DIGEST_SIZE or not 0 <= self.delta_base < self.version):
            raise ValueError("delta_root needs a full root id and a delta_base older than the version")
        if not self.delta_root and self.delta_base != -1:
            raise ValueError("delta_base without delta_root")

    @property
    def delta(self) -> tuple[int, bytes] | None:
        """(base version, delta manifest root) when the trainer offers a delta."""
        return (self.delta_base, self.delta_root) if self.delta_root else None


@dataclass(frozen=True)
class SignedAnnounce:
    announce: Announce
    signer: str


def open_announce(data: bytes, run: str, trainers: list[str]) -> SignedAnnounce:
    """Check a gossip announcement: size, envelope, signature, trainer, run. RemoteProtocolError."""
    if len(data) > MAX_ANNOUNCE:
        raise RemoteProtocolError("oversized", f"announce of {len(data)} bytes")
    env = decode_as(Envelope, data, max_size=MAX_ANNOUNCE)
    msg = env.open_as(ANNOUNCE_DOMAIN, Announce, max_size=MAX_ANNOUNCE)
    signer = peer_id_of(env.public_key)
    if signer not in trainers:
        raise RemoteProtocolError("not-trainer", signer)
    if msg.run != run:
        raise RemoteProtocolError("wrong-run", msg.run)
    return SignedAnnounce(msg, signer)


async def read_shards_message(stream) -> Message | None:
    """The next message on a shards stream (bounded by MAX_SHARDS_FRAME); None at end of stream. A
    ``Data`` block is a read-only view of the frame, not a copy of it."""
    data = await read_frame(stream, MAX_SHARDS_FRAME)
    return None if data is None else decode(data, MAX_SHARDS_FRAME, views=(Data,))
