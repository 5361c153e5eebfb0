"""The wire: typed, versioned msgpack messages, length-prefixed frames and signed envelopes.

How this works
--------------
* A message is a frozen dataclass subclassing :class:`Message` with a ``TYPE`` tag and a schema
  ``VERSION``. On the wire it is a msgpack map ``{"t": TYPE, "v": VERSION, <field>: <value>...}``.
  Each field declares its bounds with :func:`bounded` (max length of str/bytes/list, min/max of
  numbers); :func:`decode` checks the type, version, every field's type and bounds, and unknown or
  missing keys, before any object is built.
* Anything wrong with bytes that came from the network raises :class:`RemoteProtocolError` with a
  short machine-readable ``reason`` ("the remote peer is wrong"). Encoding a message that breaks its
  own schema raises :class:`LocalProtocolError` ("we are wrong": a bug). This is h11's split.
* Frames on streams are a 4-byte big-endian length and the body; the reader refuses a length over its
  cap before reading the body, so a peer cannot make us buffer more than the cap.
* A signed envelope carries payload bytes, the signer's raw Ed25519 public key and a signature over
  ``DOMAIN_PREFIX + domain + 0x00 + payload``. The domain names the message kind, so a signature made
  for one kind ("member record") can never be replayed as another ("ledger entry").

This module imports neither libp2p nor torch, so proofs and ledger code can use it anywhere.
"""

from __future__ import annotations

import dataclasses
import math
import struct
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import msgpack
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from . import refusals

__all__ = [
    "RemoteProtocolError",
    "LocalProtocolError",
    "Message",
    "bounded",
    "register",
    "encode",
    "decode",
    "decode_as",
    "pack",
    "unpack",
    "Envelope",
    "seal",
    "MAX_FRAME",
    "read_frame",
    "write_frame",
]

# Default cap for one frame / one message. Bulk data (shard blocks) is smaller than this; anything
# larger is a protocol violation, not a big message.
MAX_FRAME = 4 * 1024 * 1024
DOMAIN_PREFIX = b"swarm-node/v1/"
_LEN = struct.Struct(">I")


class RemoteProtocolError(Exception):
    """The remote peer sent something invalid. Drop it, score the peer down, keep running.

    ``reason`` is a short stable code (``"oversized"``, ``"bad-signature"``...) used as a metrics
    label and in status tables.
    """

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


# Reasons that mean the stream broke (reset, or EOF in the middle of a frame), which is what a
# peer that crashes, is killed or loses its connection leaves behind: never counted against it.
TRANSPORT_FAILURES = refusals.TRANSPORT_FAILURES


class LocalProtocolError(Exception):
    """We tried to send something that breaks our own schema: a bug in this node."""


# --------------------------------------------------------------------------------------------
# Schemas


@dataclass(frozen=True)
class Bounds:
    max_len: int | None = None  # str (characters), bytes, list, dict (items)
    min: float | None = None  # numbers
    max: float | None = None
    exact_len: int | None = None  # bytes that must have a fixed length (keys, hashes, signatures)
    item_min: float | None = None  # bounds of each number in a list
    item_max: float | None = None
    item_max_len: int | None = None  # length bound of each str/bytes in a list (else the frame cap)


def bounded(
    *,
    max_len: int | None = None,
    min: float | None = None,  # noqa: A002 - reads naturally at the call site
    max: float | None = None,  # noqa: A002
    exact_len: int | None = None,
    item_min: float | None = None,
    item_max: float | None = None,
    item_max_len: int | None = None,
    default: Any = dataclasses.MISSING,
    default_factory: Any = dataclasses.MISSING,
) -> Any:
    """A dataclass field with wire bounds. Every str/bytes/list field must declare a max length."""
    meta = {"bounds": Bounds(max_len=max_len, min=min, max=max, exact_len=exact_len, item_min=item_min, item_max=item_max,
                             item_max_len=item_max_len)}
    if default_factory is not dataclasses.MISSING:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class Message:
    """Base class of every typed wire message."""

    TYPE: ClassVar[str] = ""
    VERSION: ClassVar[int] = 1

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"t": self.TYPE, "v": self.VERSION}
        for f in _schema(type(self))[0]:
            out[f.name] = _to_plain(getattr(self, f.name))
        return out


_REGISTRY: dict[str, type[Message]] = {}
_SCHEMAS: dict[type, tuple[tuple["_Field", ...], frozenset[str]]] = {}
_SHAPES: dict[Any, tuple[Any, tuple[Any, ...]]] = {}
_UNIONS = (typing.Union, types.UnionType)
M = TypeVar("M", bound=Message)


def register(cls: type[M]) -> type[M]:
    """Class decorator: make a message type decodable by its ``TYPE`` tag."""
    if not cls.TYPE:
        raise LocalProtocolError(f"{cls.__name__} has no TYPE")
    if cls.TYPE in _REGISTRY and _REGISTRY[cls.TYPE] is not cls:
        raise LocalProtocolError(f"duplicate message type {cls.TYPE!r}")
    for f in _schema(cls)[0]:
        if _needs_len(f.hint) and f.bounds.max_len is None and f.bounds.exact_len is None:
            raise LocalProtocolError(f"{cls.__name__}.{f.name} needs a max_len bound")
    _REGISTRY[cls.TYPE] = cls
    return cls


def _needs_len(hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if origin in _UNIONS:
        return any(_needs_len(a) for a in typing.get_args(hint) if a is not type(None))
    return hint in (str, bytes) or origin in (list, tuple, dict)


def _bounds(f: dataclasses.Field) -> Bounds:
    return f.metadata.get("bounds", Bounds())


@dataclass(frozen=True)
class _Field:
    """One field of a message type, as its wire check needs it."""

    name: str
    label: str  # "type.field", in errors
    hint: Any
    bounds: Bounds
    required: bool


def _schema(cls: type) -> tuple[tuple[_Field, ...], frozenset[str]]:
    """(fields, every key a wire map of ``cls`` may hold), worked out once per message type: every
    message sent or received is checked against it (type hints and ``dataclasses.fields`` cost
    more than the check itself)."""
    schema = _SCHEMAS.get(cls)
    if schema is None:
        hints = typing.get_type_hints(cls)
        fields = tuple(
            _Field(f.name, f"{cls.TYPE}.{f.name}", hints[f.name], _bounds(f),
                   f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
            for f in dataclasses.fields(cls))
        schema = _SCHEMAS[cls] = (fields, frozenset(f.name for f in fields) | {"t", "v"})
    return schema


def _to_plain(value: Any) -> Any:
    if isinstance(value, Message):
        d = value.to_wire()
        return d
    if isinstance(value, tuple):
        return [_to_plain(v) for v in value]
    if isinstance(value, list):
        return [_to_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_plain(v) for k, v in value.items()}
    return value


def _check(name: str, hint: Any, value: Any, b: Bounds) -> Any:
    """Validate ``value`` against a type hint and bounds; return the value to store."""
    shape = _SHAPES.get(hint)
    if shape is None:  # the hints of registered message types: a few dozen
        shape = _SHAPES[hint] = (typing.get_origin(hint), typing.get_args(hint))
    origin, args = shape
    if origin in _UNIONS:
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        errors = []
        for a in inner:
            try:
                return _check(name, a, value, b)
            except RemoteProtocolError as e:
                errors.append(e)
        raise errors[0]
    if hint is bool:
        if not isinstance(value, bool):
            raise RemoteProtocolError("bad-field", f"{name}: expected bool")
        return value
    if hint is int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise RemoteProtocolError("bad-field", f"{name}: expected int")
        _check_range(name, value, b)
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise RemoteProtocolError("bad-field", f"{name}: expected number")
        value = float(value)
        if not math.isfinite(value):  # NaN satisfies no bound, and either one poisons every sum it enters
            raise RemoteProtocolError("bad-field", f"{name}: {value} is not finite")
        _check_range(name, value, b)
        return value
    if hint in (str, bytes):
        if not isinstance(value, hint) and not (hint is bytes and type(value) is memoryview):  # decode's views
            raise RemoteProtocolError("bad-field", f"{name}: expected {hint.__name__}")
        _check_len(name, len(value), b)
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise RemoteProtocolError("bad-field", f"{name}: expected list")
        _check_len(name, len(value), b)
        item_hint = args[0] if args else Any
        inner_b = Bounds(max_len=b.item_max_len or MAX_FRAME, min=b.item_min, max=b.item_max)
        items = [_check(f"{name}[]", item_hint, v, inner_b) for v in value]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise RemoteProtocolError("bad-field", f"{name}: expected map")
        _check_len(name, len(value), b)
        kh, vh = args if args else (Any, Any)
        inner_b = Bounds(max_len=MAX_FRAME)
        return {
            _check(f"{name}.key", kh, k, inner_b): _check(f"{name}.value", vh, v, inner_b)
            for k, v in value.items()
        }
    if isinstance(hint, type) and issubclass(hint, Message):
        if not isinstance(value, dict):
            raise RemoteProtocolError("bad-field", f"{name}: expected {hint.TYPE} map")
        return _from_wire(hint, value)
    if hint is Any:
        return value
    raise LocalProtocolError(f"unsupported field type {hint!r} for {name}")


def _check_range(name: str, value: float, b: Bounds) -> None:
    if b.min is not None and value < b.min:
        raise RemoteProtocolError("out-of-bounds", f"{name}={value} < {b.min}")
    if b.max is not None and value > b.max:
        raise RemoteProtocolError("out-of-bounds", f"{name}={value} > {b.max}")


def _check_len(name: str, n: int, b: Bounds) -> None:
    if b.exact_len is not None and n != b.exact_len:
        raise RemoteProtocolError("bad-length", f"{name}: length {n} != {b.exact_len}")
    if b.max_len is not None and n > b.max_len:
        raise RemoteProtocolError("oversized", f"{name}: length {n} > {b.max_len}")


def _from_wire(cls: type[M], data: dict[str, Any]) -> M:
    if data.get("t") != cls.TYPE:
        raise RemoteProtocolError("wrong-type", f"expected {cls.TYPE!r}, got {data.get('t')!r}")
    if data.get("v") != cls.VERSION:
        raise RemoteProtocolError("bad-version", f"{cls.TYPE} v{data.get('v')!r}")
    fields, known = _schema(cls)
    if not known.issuperset(data):
        unknown = set(data) - known
        raise RemoteProtocolError("unknown-field", f"{cls.TYPE}: {sorted(map(str, unknown))[:3]}")
    kwargs = {}
    for f in fields:
        if f.name in data:
            kwargs[f.name] = _check(f.label, f.hint, data[f.name], f.bounds)
        elif f.required:
            raise RemoteProtocolError("missing-field", f.label)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:  # __post_init__ checks of cross-field rules
        raise RemoteProtocolError("bad-message", f"{cls.TYPE}: {e}") from None


# --------------------------------------------------------------------------------------------
# Encoding


def pack(obj: Any) -> bytes:
    """msgpack with the project's settings (bytes stay bytes, str stays str)."""
    return msgpack.packb(obj, use_bin_type=True)


def _limits(max_size: int) -> dict[str, Any]:
    return dict(raw=False, strict_map_key=True, max_bin_len=max_size, max_str_len=max_size,
                max_array_len=max_size, max_map_len=max_size // 2)


def unpack(data: bytes, max_size: int = MAX_FRAME) -> Any:
    """Parse msgpack from an untrusted source. Raises RemoteProtocolError, nothing else."""
    if len(data) > max_size:
        raise RemoteProtocolError("oversized", f"{len(data)} bytes > {max_size}")
    try:
        return msgpack.unpackb(data, **_limits(max_size))
    except Exception as e:  # msgpack raises many types; all mean "garbage"
        raise RemoteProtocolError("malformed", f"msgpack: {type(e).__name__}") from None


VIEW_SCAN = 256  # (unpack_viewing_tail) bytes searched for the fields before a map's long last value
_BIN_LENGTH_BYTES = {0xC4: 1, 0xC5: 2, 0xC6: 4}  # msgpack bin 8, 16, 32


def unpack_viewing_tail(data: bytes, max_size: int = MAX_FRAME) -> dict[str, Any] | None:
    """The map ``data`` holds, parsed as :func:`unpack` would, but with its last value a read-only
    view of ``data`` instead of a copy, when that value is a bin of ``SPLIT_BYTES`` or more that
    ends ``data`` (the layout :func:`frame_parts` writes) and every key is a str; otherwise None
    (then :func:`unpack` parses it: this is a shortcut, never a second opinion). msgpack copies
    every bin value it returns: for a 1 MiB block, a copy of each byte a downloader receives.

    The fields before the last value are read by msgpack from the first ``VIEW_SCAN`` bytes, pair
    by pair in order (a repeated key's last value wins, as in :func:`unpack`), so only the position
    of the last value is ours to find, and its bin header says exactly where it must end."""
    if not SPLIT_BYTES <= len(data) <= max_size:
        return None
    parser = msgpack.Unpacker(**_limits(max_size))
    parser.feed(data[:VIEW_SCAN])
    out: dict[str, Any] = {}
    try:
        pairs = parser.read_map_header()
        if pairs < 1:
            return None
        for i in range(pairs):
            key = parser.unpack()
            if type(key) is not str:
                return None
            if i < pairs - 1:
                out[key] = parser.unpack()
        at = parser.tell()
    except Exception:  # garbage, or fields longer than VIEW_SCAN: the whole parse says which
        return None
    width = _BIN_LENGTH_BYTES.get(data[at]) if at < len(data) else None
    if width is None:
        return None
    start = at + 1 + width
    length = int.from_bytes(data[at + 1:start], "big")
    if length < SPLIT_BYTES or start + length != len(data):
        return None
    out[key] = memoryview(data)[start:]
    return out


def encode(msg: Message) -> bytes:
    """Serialize a message after checking it against its own schema (a bug if it fails)."""
    return pack(_checked_wire(msg))


def _checked_wire(msg: Message) -> dict[str, Any]:
    wire = msg.to_wire()
    try:
        _from_wire(type(msg), wire)
    except RemoteProtocolError as e:
        raise LocalProtocolError(f"refusing to send invalid {msg.TYPE}: {e}") from None
    return wire


def _registered_type(obj: dict) -> type[Message] | None:
    t = obj.get("t")
    return _REGISTRY.get(t) if isinstance(t, str) else None


def decode(data: bytes, max_size: int = MAX_FRAME, views: tuple[type[Message], ...] = ()) -> Message:
    """Decode any registered message type from untrusted bytes. A message of a type in ``views``
    whose last field is a long bytes value (a block of ``shards.data``) gets that value as a
    read-only view of ``data``, not a copy (:func:`unpack_viewing_tail`)."""
    obj = unpack_viewing_tail(data, max_size) if views else None
    if obj is not None and _registered_type(obj) not in views:
        obj = None
    if obj is None:
        obj = unpack(data, max_size)
    if not isinstance(obj, dict):
        raise RemoteProtocolError("malformed", "message is not a map")
    cls = _registered_type(obj)
    if cls is None:
        raise RemoteProtocolError("unknown-type", repr(obj.get("t"))[:40])
    return _from_wire(cls, obj)


def decode_as(cls: type[M], data: bytes, max_size: int = MAX_FRAME) -> M:
    """Decode bytes that must hold a message of exactly ``cls``."""
    msg = decode(data, max_size)
    if not isinstance(msg, cls):
        raise RemoteProtocolError("wrong-type", f"expected {cls.TYPE}, got {msg.TYPE}")
    return msg


# --------------------------------------------------------------------------------------------
# Signed envelopes


@register
@dataclass(frozen=True)
class Envelope(Message):
    """Payload bytes signed by an Ed25519 key for one domain (message kind)."""

    TYPE: ClassVar[str] = "envelope"
    domain: str = bounded(max_len=64)
    payload: bytes = bounded(max_len=MAX_FRAME)
    public_key: bytes = bounded(exact_len=32)
    signature: bytes = bounded(exact_len=64)

    @staticmethod
    def signed_bytes(domain: str, payload: bytes) -> bytes:
        return DOMAIN_PREFIX + domain.encode() + b"\x00" + payload

    def open(self, domain: str) -> bytes:
        """Check domain and signature; return the payload. RemoteProtocolError if either fails."""
        if self.domain != domain:
            raise RemoteProtocolError("wrong-domain", f"{self.domain!r} != {domain!r}")
        try:
            key = Ed25519PublicKey.from_public_bytes(self.public_key)
            key.verify(self.signature, self.signed_bytes(domain, self.payload))
        except (InvalidSignature, ValueError):
            raise RemoteProtocolError("bad-signature", domain) from None
        return self.payload

    def open_as(self, domain: str, cls: type[M], max_size: int = MAX_FRAME) -> M:
        """Verify, then decode the payload as ``cls``."""
        return decode_as(cls, self.open(domain), max_size)


class _Signer(typing.Protocol):
    public_bytes: bytes

    def sign(self, data: bytes) -> bytes: ...


def seal(signer: _Signer, domain: str, payload: Message | bytes) -> Envelope:
    """Sign ``payload`` (a message or raw bytes) for ``domain`` with the node's identity."""
    body = encode(payload) if isinstance(payload, Message) else payload
    sig = signer.sign(Envelope.signed_bytes(domain, body))
    return Envelope(domain=domain, payload=body, public_key=signer.public_bytes, signature=sig)


# --------------------------------------------------------------------------------------------
# Frames on byte streams (libp2p streams or anything with async read(n)/write(b))


class _Reader(typing.Protocol):
    async def read(self, n: int | None = None) -> bytes: ...


class _Writer(typing.Protocol):
    async def write(self, data: bytes) -> Any: ...


def _is_eof(exc: Exception) -> bool:
    # py-libp2p signals end-of-stream with StreamEOF instead of b""; matched by name so that this
    # module stays importable without libp2p.
    return type(exc).__name__ in ("StreamEOF", "EOFError", "EndOfChannel")


async def _read_some(stream: _Reader, n: int) -> bytes:
    """One read; b"" on EOF; any other stream failure (reset, closed) is the remote's doing."""
    try:
        return await stream.read(n)
    except Exception as e:  # trio.Cancelled is a BaseException and passes through
        if _is_eof(e):
            return b""
        raise RemoteProtocolError("stream-error", type(e).__name__) from None


async def read_exactly(stream: _Reader, n: int) -> bytes:
    """Read exactly n bytes; EOF before that is the remote's fault."""
    chunks: list[bytes] = []
    remaining = n
    while remaining:
        chunk = await _read_some(stream, remaining)
        if not chunk:
            raise RemoteProtocolError("truncated", f"EOF with {remaining} of {n} bytes missing")
        chunks.append(chunk)
        remaining -= len(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def _until_buffered(stream: _Reader, n: int) -> None:
    """Wait until ``stream`` holds ``n`` bytes unread, where it can say so (a libp2p stream over
    Yamux: ``node.net.patches.speed.WholeFrameReads``), so that a frame is read in one piece: one
    join of its bytes and one wake-up of the reader, not a read and a copy per part that arrived."""
    wait = getattr(getattr(stream, "muxed_stream", None), "until_buffered", None)
    if wait is not None:
        await wait(n)


async def read_header(stream: _Reader, max_size: int = MAX_FRAME) -> int | None:
    """Read one frame's length prefix: the body's announced length (at most ``max_size``), or None
    on a clean EOF between frames. The body is not read: a caller with a memory budget reserves the
    announced length first (node/net/budget.py), then reads it with :func:`read_exactly`."""
    first = await _read_some(stream, _LEN.size)
    if not first:
        return None
    head = first if len(first) == _LEN.size else first + await read_exactly(stream, _LEN.size - len(first))
    (n,) = _LEN.unpack(head)
    if n > max_size:
        raise RemoteProtocolError("oversized", f"frame of {n} bytes > {max_size}")
    return n


async def read_frame(stream: _Reader, max_size: int = MAX_FRAME) -> bytes | None:
    """Read one length-prefixed frame. Returns None on a clean EOF between frames."""
    n = await read_header(stream, max_size)
    if n is None:
        return None
    if not n:
        return b""
    await _until_buffered(stream, n)
    return await read_exactly(stream, n)


async def read_message(stream: _Reader, max_size: int = MAX_FRAME) -> Message | None:
    """Read and decode one frame; None on clean EOF."""
    data = await read_frame(stream, max_size)
    return None if data is None else decode(data, max_size)


SPLIT_BYTES = 4096  # (frame_parts) below this, copying the value costs less than a part of its own
_EMPTY_BIN = b"\xc4\x00"  # msgpack's bin 8 of length 0; bin 16/32 carry longer values, as msgpack would


def frame_of(data: bytes | Message) -> bytes:
    """One length-prefixed frame, to write alone or joined with others in one stream write."""
    return b"".join(frame_parts(data))


def frame_parts(data: bytes | Message) -> list[bytes]:
    """One length-prefixed frame as parts whose join is :func:`frame_of`'s bytes. A message whose
    last field holds ``SPLIT_BYTES`` or more (a block of ``shards.data``) keeps that value as a part
    of its own: the writer joins it once with the rest of its batch, where packing copied it into
    the map and the length prefix copied it again (two copies of every byte a seeder sends)."""
    if not isinstance(data, Message):
        return [_prefixed(len(data), data)]
    wire = _checked_wire(data)
    last = next(reversed(wire))
    value = wire[last]
    if not isinstance(value, bytes) or len(value) < SPLIT_BYTES:
        body = pack(wire)
        return [_prefixed(len(body), body)]
    wire[last] = b""
    head = pack(wire)
    assert head.endswith(_EMPTY_BIN), "msgpack packs b'' as bin 8 of length 0"
    n = len(value)
    bin_header = b"\xc5" + n.to_bytes(2, "big") if n < 1 << 16 else b"\xc6" + n.to_bytes(4, "big")
    head = head[: -len(_EMPTY_BIN)] + bin_header
    return [_prefixed(len(head) + n, head), value]


def _prefixed(length: int, head: bytes) -> bytes:
    if length > MAX_FRAME:
        raise LocalProtocolError(f"frame of {length} bytes exceeds MAX_FRAME")
    return _LEN.pack(length) + head


async def write_frame(stream: _Writer, data: bytes | Message) -> None:
    await stream.write(frame_of(data))


class Gather(tuple):
    """Buffers that one stream write sends as if joined (:func:`write_parts`)."""

    __slots__ = ()

    @property
    def nbytes(self) -> int:
        return sum(memoryview(part).nbytes for part in self)


async def write_parts(stream: _Writer, parts: list[bytes | memoryview]) -> None:
    """Write ``parts`` as one write. A libp2p stream over Yamux (``node.net.patches.speed.YamuxSends``)
    takes them as they are and copies each byte once, into its frames; anything else gets them
    joined, a copy of every byte more (a seeder's 1 MiB block, for each time it is sent)."""
    if getattr(getattr(stream, "muxed_stream", None), "writes_gather", False):
        await stream.write(Gather(parts))
    else:
        await stream.write(b"".join(parts))
