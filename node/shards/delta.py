"""Checkpoint deltas: version v as the bytes that changed since a base version b (pure, no I/O).

How this works
--------------
In RL post-training with bf16 weights published from an fp32 master and a small learning rate, a
published value changes only when an update carries the master across a bf16 rounding boundary, so
most values of v equal those of v-1 (measured: docs/benchmarks.md, ``bench/deltas.py``).
A delta lists, per file of the target folder, one record:

* ``same``: the file is byte-identical to the base's file of that name;
* ``raw``: the whole file (new files, config, tokenizer, or a safetensors file whose header moved);
* ``tensors``: a safetensors file whose header (names, dtypes, shapes, offsets) equals the base's.
  For each tensor with changed elements: the changed positions, delta-coded as LEB128 varints or
  as a bitmap, whichever is smaller, and the new values XOR the old ones, split into byte planes
  (the XOR of a value moved by a few ulps is mostly zero bits; planes put the zeros together).

The records are msgpack-encoded and the whole body is compressed with a stdlib codec (zlib by
default; lzma is ~10 % smaller and ~10x slower to encode) behind a small container header (magic,
codec, raw length). Everything decoded is bounded: the raw length, the file count and names, each tensor
index, position count and value size; a position out of range or out of order is refused. A delta
that decodes but builds wrong bytes is not caught here: the receiver checks every rebuilt piece
against the full version's signed piece hashes (node/shards/deltasync.py), which is the only
thing that makes a rebuilt checkpoint trusted.
"""

from __future__ import annotations

import json
import lzma
import struct
import zlib
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from ..wire import RemoteProtocolError, pack, unpack

MAGIC = b"SNDELTA1"
_HEAD = struct.Struct(">8sBQ")  # magic, codec, raw body length
CODECS = {"zlib": 1, "lzma": 2}
_CODEC_NAMES = {v: k for k, v in CODECS.items()}
MAX_DELTA_FILES = 1024  # like MAX_FILES of a manifest
MAX_NAME = 255
MAX_TENSORS = 1 << 20  # tensors in one safetensors file
MAX_HEADER = 100 << 20  # safetensors' own limit for the JSON header
MAX_VARINT_BYTES = 8  # 56 bits: positions beyond 2^56 elements are refused
POS_BITMAP, POS_VARINT = 0, 1
SAME, RAW, TENSORS = "same", "raw", "tensors"
# Element width of each safetensors dtype: the unit in which a value "changed".
ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
            "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def bad(detail: str) -> RemoteProtocolError:
    return RemoteProtocolError("bad-delta", detail)


# --------------------------------------------------------------------------------------------
# safetensors layout


@dataclass(frozen=True)
class Region:
    """One tensor's bytes in a safetensors file: [start, start + count * itemsize)."""

    start: int
    count: int
    itemsize: int


def tensor_regions(data: bytes | memoryview) -> tuple[int, list[Region]] | None:
    """(header end, tensor regions in header order) of a safetensors file, or None when ``data`` is
    not one we can split (unknown dtype, regions outside the file or overlapping)."""
    if len(data) < 8:
        return None
    (n,) = struct.unpack_from("<Q", data, 0)
    if n > MAX_HEADER or 8 + n > len(data):
        return None
    try:
        header = json.loads(bytes(data[8 : 8 + n]))
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(header, dict) or len(header) > MAX_TENSORS:
        return None
    base = 8 + n
    regions = []
    for name in sorted(k for k in header if k != "__metadata__"):
        t = header[name]
        try:
            size = ITEMSIZE[t["dtype"]]
            lo, hi = (int(x) for x in t["data_offsets"])
        except (KeyError, TypeError, ValueError):
            return None
        if not 0 <= lo <= hi or base + hi > len(data) or (hi - lo) % size:
            return None
        regions.append(Region(base + lo, (hi - lo) // size, size))
    spans = sorted((r.start, r.start + r.count * r.itemsize) for r in regions)
    if any(a[1] > b[0] for a, b in zip(spans, spans[1:])):
        return None
    return base, regions


def _outside_regions_equal(a: bytes, b: bytes, header_end: int, regions: list[Region]) -> bool:
    """Bytes of ``a`` and ``b`` not inside any tensor (header, padding) are equal."""
    pos = 0
    for start, end in sorted((r.start, r.start + r.count * r.itemsize) for r in regions) + [(len(a), len(a))]:
        if a[pos:start] != b[pos:start]:
            return False
        pos = max(pos, end)
    return True


# --------------------------------------------------------------------------------------------
# Position coding


def varint_encode(values: np.ndarray) -> bytes:
    """LEB128 of non-negative integers (vectorised)."""
    v = values.astype(np.uint64)
    if len(v) == 0:
        return b""
    if int(v.max()) >= 1 << (7 * MAX_VARINT_BYTES):
        raise ValueError("varint too large")
    nb = np.ones(len(v), dtype=np.int64)
    for k in range(1, MAX_VARINT_BYTES):
        nb += v >= np.uint64(1 << (7 * k))
    starts = np.cumsum(nb) - nb
    out = np.empty(int(nb.sum()), dtype=np.uint8)
    for j in range(int(nb.max())):
        sel = nb > j
        byte = (v[sel] >> np.uint64(7 * j)) & np.uint64(0x7F)
        out[starts[sel] + j] = byte.astype(np.uint8) | np.where(nb[sel] > j + 1, 0x80, 0).astype(np.uint8)
    return out.tobytes()


def varint_decode(data: bytes, count: int) -> np.ndarray:
    """Exactly ``count`` LEB128 integers filling ``data``; RemoteProtocolError otherwise."""
    b = np.frombuffer(data, dtype=np.uint8)
    if count == 0:
        if len(b):
            raise bad("varint bytes for no positions")
        return np.zeros(0, dtype=np.uint64)
    ends = np.flatnonzero((b & 0x80) == 0)
    if len(ends) != count or ends[-1] != len(b) - 1:
        raise bad("varint count does not match")
    starts = np.concatenate(([0], ends[:-1] + 1))
    lens = ends - starts + 1
    if int(lens.max()) > MAX_VARINT_BYTES:
        raise bad("varint too long")
    vid = np.repeat(np.arange(count), lens)
    shift = ((np.arange(len(b)) - starts[vid]) * 7).astype(np.uint64)
    parts = (b & 0x7F).astype(np.uint64) << shift
    return np.bitwise_or.reduceat(parts, starts)


def encode_positions(mask: np.ndarray) -> tuple[int, bytes]:
    """(kind, bytes) of the True positions of ``mask``: bitmap or delta-coded varints, the smaller."""
    idx = np.flatnonzero(mask)
    gaps = np.diff(idx, prepend=-1) - 1  # first position, then the gaps between positions
    var = varint_encode(gaps)
    bitmap_size = (len(mask) + 7) // 8
    if bitmap_size < len(var):
        return POS_BITMAP, np.packbits(mask).tobytes()
    return POS_VARINT, var


def decode_positions(kind: int, data: bytes, count: int, numel: int) -> np.ndarray:
    """The ``count`` positions (increasing, < ``numel``) coded as ``kind``; RemoteProtocolError otherwise."""
    if kind == POS_BITMAP:
        if len(data) != (numel + 7) // 8:
            raise bad("bitmap length")
        bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8), count=numel) if numel else np.zeros(0, np.uint8)
        idx = np.flatnonzero(bits)
        if len(idx) != count:
            raise bad("bitmap count does not match")
        return idx
    if kind == POS_VARINT:
        if len(data) > count * MAX_VARINT_BYTES:
            raise bad("varint bytes exceed the count")
        gaps = varint_decode(data, count)
        if count and int(gaps.max()) >= numel:
            raise bad("position out of range")
        idx = np.cumsum(gaps.astype(np.int64) + 1) - 1
        if count and int(idx[-1]) >= numel:
            raise bad("position out of range")
        return idx
    raise bad(f"position kind {kind}")


# --------------------------------------------------------------------------------------------
# Encoding (publisher side)


@dataclass
class DeltaStats:
    """What a delta carries, for benchmarks and logs."""

    values: int = 0  # elements in tensors compared
    changed: int = 0  # of those, elements that changed
    raw_files: int = 0
    raw_bytes: int = 0  # bytes of files sent whole
    body: int = 0  # uncompressed body
    size: int = 0  # the delta's bytes (compressed, with the container header)
    full: int = 0  # bytes of the target folder

    @property
    def changed_fraction(self) -> float:
        return self.changed / self.values if self.values else 0.0

    @property
    def ratio(self) -> float:
        return self.size / self.full if self.full else 0.0


def _tensor_changes(base: bytes, target: bytes, r: Region) -> tuple[int, bytes, bytes, int] | None:
    """(position kind, positions, XOR value planes, count) of the changed elements of ``r``, None if none."""
    u = _UINT[r.itemsize]
    a = np.frombuffer(base, dtype=u, count=r.count, offset=r.start)
    b = np.frombuffer(target, dtype=u, count=r.count, offset=r.start)
    mask = a != b
    count = int(mask.sum())
    if count == 0:
        return None
    kind, pos = encode_positions(mask)
    xor = (a[mask] ^ b[mask]).view(np.uint8).reshape(count, r.itemsize)
    return kind, pos, np.ascontiguousarray(xor.T).tobytes(), count


def encode_file(name: str, base: bytes | None, target: bytes, stats: DeltaStats) -> list:
    """The record of one target file against the base's file of that name (None: no such file)."""
    if base is not None and base == target:
        layout = tensor_regions(target)
        stats.values += sum(r.count for r in layout[1]) if layout else 0
        return [name, SAME]
    if base is not None and len(base) == len(target):
        layout = tensor_regions(target)
        if layout is not None and base[: layout[0]] == target[: layout[0]] and _outside_regions_equal(
                base, target, *layout):
            tensors = []
            for i, r in enumerate(layout[1]):
                stats.values += r.count
                ch = _tensor_changes(base, target, r)
                if ch is not None:
                    kind, pos, planes, count = ch
                    stats.changed += count
                    tensors.append([i, kind, count, pos, planes])
            return [name, TENSORS, tensors]
    stats.raw_files += 1
    stats.raw_bytes += len(target)
    return [name, RAW, target]


def encode_delta(base: Mapping[str, bytes], target: Mapping[str, bytes], codec: str = "zlib",
                 level: int | None = None, max_body: int | None = None) -> tuple[bytes | None, DeltaStats]:
    """The delta that turns the files ``base`` (name -> bytes) into ``target``, and what it holds.

    ``max_body``: give up (None, with the stats) before compressing a body larger than this; the
    compression is most of the cost, and a body that big would not make a delta worth sending."""
    if codec not in CODECS:
        raise ValueError(f"codec: one of {', '.join(CODECS)}, got {codec!r}")
    stats = DeltaStats(full=sum(len(v) for v in target.values()))
    records = [encode_file(name, base.get(name), target[name], stats) for name in sorted(target)]
    body = pack({"files": records})
    stats.body = len(body)
    if max_body is not None and len(body) > max_body:
        stats.size = len(body)
        return None, stats
    out = _compress(codec, body, level)
    stats.size = len(out)
    return out, stats


def _compress(codec: str, body: bytes, level: int | None) -> bytes:
    if codec == "zlib":
        packed = zlib.compress(body, 6 if level is None else level)
    else:
        packed = lzma.compress(body, preset=6 if level is None else level)
    return _HEAD.pack(MAGIC, CODECS[codec], len(body)) + packed


# --------------------------------------------------------------------------------------------
# Decoding (receiver side)


def _decompress(data: bytes, max_raw: int) -> bytes:
    if len(data) < _HEAD.size:
        raise bad("shorter than its header")
    magic, codec, raw_len = _HEAD.unpack_from(data)
    if magic != MAGIC:
        raise bad("not a delta")
    if codec not in _CODEC_NAMES:
        raise bad(f"codec {codec}")
    if raw_len > max_raw:
        raise bad(f"body of {raw_len} bytes > {max_raw}")
    d = zlib.decompressobj() if codec == CODECS["zlib"] else lzma.LZMADecompressor()
    try:
        # max_length bounds what a compression bomb can make us allocate
        body = d.decompress(data[_HEAD.size :], raw_len + 1)
    except (zlib.error, lzma.LZMAError) as e:
        raise bad(f"corrupt {_CODEC_NAMES[codec]} stream: {e}") from None
    if len(body) != raw_len or not d.eof:
        raise bad("body length does not match its header")
    return body


@dataclass(frozen=True)
class DeltaBody:
    """A decoded delta: one record per target file, checked for shape (not yet against a base)."""

    files: list[list]

    def names(self) -> list[str]:
        return [r[0] for r in self.files]


def decode_delta(data: bytes, max_raw: int) -> DeltaBody:
    """Parse a delta whose body may be at most ``max_raw`` bytes; RemoteProtocolError if malformed."""
    body = unpack(_decompress(data, max_raw), max_raw + 64)
    if not isinstance(body, dict) or set(body) != {"files"} or not isinstance(body["files"], list):
        raise bad("body is not {files: [...]}")
    files = body["files"]
    if len(files) > MAX_DELTA_FILES:
        raise bad(f"{len(files)} files")
    names = []
    for rec in files:
        if not isinstance(rec, list) or len(rec) < 2 or not isinstance(rec[0], str) or len(rec[0]) > MAX_NAME:
            raise bad("file record")
        names.append(rec[0])
        kind = rec[1]
        if kind == SAME and len(rec) == 2:
            continue
        if kind == RAW and len(rec) == 3 and isinstance(rec[2], bytes):
            continue
        if kind == TENSORS and len(rec) == 3 and isinstance(rec[2], list) and len(rec[2]) <= MAX_TENSORS:
            last = -1
            for t in rec[2]:
                if not (isinstance(t, list) and len(t) == 5 and all(isinstance(x, int) for x in t[:3])
                        and isinstance(t[3], bytes) and isinstance(t[4], bytes)):
                    raise bad(f"{rec[0]}: tensor record")
                if t[0] <= last:
                    raise bad(f"{rec[0]}: tensor indices not increasing")
                if t[2] < 1:
                    raise bad(f"{rec[0]}: tensor with no changed element")
                last = t[0]
            continue
        raise bad(f"{rec[0][:40]}: record of kind {str(kind)[:16]!r}")
    if names != sorted(set(names)):
        raise bad("file names not sorted and unique")
    return DeltaBody(files)


def apply_file(record: list, base: bytes | None, size: int) -> bytes:
    """The target file ``record`` describes, built on the base's file (None: none held) and required
    to be ``size`` bytes (the full manifest's size). RemoteProtocolError when it cannot be built."""
    name, kind = record[0], record[1]
    if kind == RAW:
        out = record[2]
    elif base is None:
        raise bad(f"{name}: needs a base file we do not hold")
    elif kind == SAME:
        out = base
    else:
        layout = tensor_regions(base)
        if layout is None:
            raise bad(f"{name}: base file is not safetensors")
        regions = layout[1]
        buf = bytearray(base)
        for index, kind_, count, pos, planes in record[2]:
            if not 0 <= index < len(regions):
                raise bad(f"{name}: tensor index {index}")
            r = regions[index]
            if count > r.count:
                raise bad(f"{name}: {count} changes in a tensor of {r.count}")
            if len(planes) != count * r.itemsize:
                raise bad(f"{name}: value bytes do not match the count")
            idx = decode_positions(kind_, pos, count, r.count)
            u = _UINT[r.itemsize]
            view = np.frombuffer(buf, dtype=u, count=r.count, offset=r.start)
            xor = np.frombuffer(planes, dtype=np.uint8).reshape(r.itemsize, count).T.copy().view(u).reshape(count)
            view[idx] ^= xor
        out = bytes(buf)
    if len(out) != size:
        raise bad(f"{name}: builds {len(out)} bytes, the manifest says {size}")
    return out


def apply_delta(base: Mapping[str, bytes], delta: bytes, sizes: Mapping[str, int]) -> dict[str, bytes]:
    """The target files (name -> bytes) from the ``base`` files and ``delta``, every file named and
    sized as ``sizes`` (from the full manifest) says; RemoteProtocolError otherwise."""
    body = decode_delta(delta, max_body_for(sum(sizes.values()), len(sizes)))
    if body.names() != sorted(sizes):
        raise bad("files do not match the full manifest")
    return {r[0]: apply_file(r, base.get(r[0]), sizes[r[0]]) for r in body.files}


def max_body_for(total_size: int, files: int) -> int:
    """The largest body a delta of a ``total_size``-byte folder may have: every file sent raw, plus
    the worst case of positions and values (a bitmap and all values, ~1.1x a tensor, and a few
    bytes of framing per tensor of a single element), plus msgpack framing."""
    return 4 * total_size + 64 * files + (1 << 16)
