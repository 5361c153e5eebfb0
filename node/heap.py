"""The C allocator's heap: how much of it is in use, and giving its free pages back to the system.

How this works: glibc's malloc keeps memory freed by the process (by Python's raw allocations,
protobuf, Noise, SQLite, torch's small buffers) for reuse and gives back to the system only what
lies at the top of each heap, so one long-lived block above freed ones holds them all in the RSS.
In the soak's nodes that freed-but-kept memory was a large share of the RSS and of its growth
(issue 45: ``malloc_trim(0)`` called from gdb took a relay from 303 to 253 MB and a validator from
1081 to 893 MB). :func:`serve_heap_trim` calls ``malloc_trim(0)``, which also releases free pages
in the middle of the heaps, every :data:`TRIM_EVERY_S` in a worker thread (ctypes drops the GIL:
the event loop runs on meanwhile). Elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util

import trio

TRIM_EVERY_S = 300.0  # seconds between two trims of the C heap


class _MallInfo2(ctypes.Structure):  # glibc >= 2.33, malloc.h
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _mallinfo2():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.mallinfo2
    except (OSError, AttributeError):  # not glibc, or older than 2.33
        return None
    fn.restype = _MallInfo2
    return fn


_MALLINFO2 = _mallinfo2()


def _malloc_trim():
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


_MALLOC_TRIM = _malloc_trim()


def trim_heap() -> bool:
    """Give the C heap's free pages back to the system (glibc ``malloc_trim(0)``); False where
    there is no such call."""
    if _MALLOC_TRIM is None:
        return False
    _MALLOC_TRIM(0)
    return True


async def serve_heap_trim(every: float = TRIM_EVERY_S, run_sync=trio.to_thread.run_sync) -> None:
    """Trim the C heap every ``every`` seconds until cancelled (see the module docstring), each
    trim by ``run_sync`` (a worker thread)."""
    if _MALLOC_TRIM is None:
        return
    while True:
        await trio.sleep(every)
        await run_sync(trim_heap)


def c_heap() -> dict | None:
    """The C allocator's heap (glibc): ``in_use_mib`` (live, mmapped blocks included) and
    ``free_mib`` (freed but kept by the allocator, not given back to the system); None elsewhere."""
    if _MALLINFO2 is None:
        return None
    m = _MALLINFO2()
    return {"in_use_mib": round((m.uordblks + m.hblkhd) / 2**20, 1), "free_mib": round(m.fordblks / 2**20, 1)}
