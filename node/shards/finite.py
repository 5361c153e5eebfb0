"""Is every number in a checkpoint finite? A check of ``*.safetensors`` files without torch.

Why here, and why without torch: a checkpoint with one NaN or infinity poisons every node that
loads it (issue 14: a NaN checkpoint was published, downloaded by a relay, served onward, and
crashed the trainer again on its next batch). The trainer checks before it publishes
(node/trainer/checkpoints.py) and every downloader checks after a version is assembled and before
it counts as held (node/shards/service.py), so a trainer-signed checkpoint with NaN, from a bug or
a stolen trainer key, is still refused by the swarm. Relays hold no torch model, so this reads the
format directly.

The safetensors format (https://huggingface.co/docs/safetensors, "Format"): an 8-byte little-endian
header length N, N bytes of JSON ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, ...}``
(plus an optional ``"__metadata__"``), then the tensors' bytes, little-endian, offsets relative to
the end of the header. A float is not finite exactly when all its exponent bits are set, so each
float dtype is checked with one mask over its raw bits (numpy views, no conversion, no copy of the
file: it is memory-mapped and read in chunks).

No event loop, no network: callers run :func:`non_finite_in_folder` in a worker thread.
"""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path

import numpy as np

MAX_HEADER = 100 << 20  # the reference implementation's own bound on the JSON header
CHUNK = 16 << 20  # bytes checked at once (bounds the temporary arrays)
MAX_PROBLEMS = 8  # problems listed per folder: the first few say enough

# dtype -> (numpy view of the raw bits, exponent mask, value that means "not finite" under the mask)
_FLOAT_BITS: dict[str, tuple[str, int, int]] = {
    "F64": ("<u8", 0x7FF0_0000_0000_0000, 0x7FF0_0000_0000_0000),
    "F32": ("<u4", 0x7F80_0000, 0x7F80_0000),
    "F16": ("<u2", 0x7C00, 0x7C00),
    "BF16": ("<u2", 0x7F80, 0x7F80),
    "F8_E5M2": ("u1", 0x7C, 0x7C),
    "F8_E4M3": ("u1", 0x7F, 0x7F),  # the "fn" variant: no infinities, NaN is S.1111.111
}
_ALWAYS_FINITE = {"BOOL", "U8", "I8", "U16", "I16", "U32", "I32", "U64", "I64"}


def non_finite_in(buf, name: str = "") -> list[str]:
    """Problems in one safetensors file held in ``buf`` (bytes, memoryview or mmap): tensors with a
    NaN or an infinity, or a reason the file is not valid safetensors. Empty when all is finite."""
    view = memoryview(buf)
    where = f"{name}: " if name else ""
    if len(view) < 8:
        return [f"{where}not a safetensors file (shorter than its header length)"]
    (n,) = struct.unpack("<Q", view[:8])
    if n > MAX_HEADER or 8 + n > len(view):
        return [f"{where}not a safetensors file (header length {n} of a {len(view)}-byte file)"]
    try:
        header = json.loads(bytes(view[8 : 8 + n]))
    except ValueError as e:
        return [f"{where}not a safetensors file (header: {e})"]
    if not isinstance(header, dict):
        return [f"{where}not a safetensors file (header is not a map)"]
    data = view[8 + n :]
    problems = []
    for tensor, info in header.items():
        if tensor == "__metadata__":
            continue
        try:
            dtype = info["dtype"]
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            problems.append(f"{where}{tensor}: malformed header entry")
            continue
        if not 0 <= begin <= end <= len(data):
            problems.append(f"{where}{tensor}: data outside the file")
            continue
        if dtype in _ALWAYS_FINITE:
            continue
        if dtype not in _FLOAT_BITS:
            problems.append(f"{where}{tensor}: unknown dtype {dtype!r}")
            continue
        bits, mask, bad = _FLOAT_BITS[dtype]
        step = np.dtype(bits).itemsize
        if (end - begin) % step:
            problems.append(f"{where}{tensor}: {end - begin} bytes is not a whole number of {dtype}")
            continue
        chunk = CHUNK - CHUNK % step
        for off in range(begin, end, chunk):
            raw = np.frombuffer(data[off : min(end, off + chunk)], dtype=bits)
            if np.any((raw & raw.dtype.type(mask)) == raw.dtype.type(bad)):
                problems.append(f"{where}{tensor} ({dtype}) holds NaN or infinity")
                break
    return problems


def non_finite_in_file(path: Path) -> list[str]:
    """:func:`non_finite_in` of the file at ``path`` (memory-mapped)."""
    path = Path(path)
    with open(path, "rb") as f:
        if path.stat().st_size == 0:
            return [f"{path.name}: not a safetensors file (empty)"]
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            return non_finite_in(m, path.name)  # its views of ``m`` are gone when it returns


def non_finite_in_folder(folder: Path, names: list[str] | None = None) -> list[str]:
    """Problems in the ``*.safetensors`` files of a model folder (``names``: only those files).
    At most :data:`MAX_PROBLEMS` are listed; empty when every tensor is finite."""
    folder = Path(folder)
    files = sorted(names) if names is not None else sorted(p.name for p in folder.iterdir())
    problems: list[str] = []
    for fname in files:
        if fname.endswith(".safetensors"):
            problems += non_finite_in_file(folder / fname)
            if len(problems) >= MAX_PROBLEMS:
                break
    return problems[:MAX_PROBLEMS]
