"""The C heap's free pages go back to the system (issue 45: freed-but-kept glibc heap was a large
share of the soak nodes' RSS and of its growth; node/heap.py)."""

from __future__ import annotations

import ctypes
import ctypes.util

import pytest
import trio
import trio.testing

from node import heap

BLOCK = 64 * 1024  # below glibc's mmap threshold: on the heap
BLOCKS = 1600  # 100 MiB


def rss_anon_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon")) / 1024


def test_a_trim_gives_back_free_pages_held_under_a_live_block():
    if heap.c_heap() is None or not heap.trim_heap():
        pytest.skip("not glibc: no mallinfo2 / malloc_trim")
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(BLOCK) for _ in range(BLOCKS)]
    for b in blocks:
        ctypes.memset(b, 1, BLOCK)  # resident
    pin = blocks.pop()  # one live block above the rest, as a long-lived object allocated late
    before = rss_anon_mib()
    for b in blocks:
        libc.free(b)
    freed = rss_anon_mib()
    assert before - freed < 20  # free() alone keeps them: they are not at the heap's top
    assert heap.c_heap()["free_mib"] >= 90
    heap.trim_heap()
    assert freed - rss_anon_mib() >= 80
    libc.free(pin)


def test_the_heap_is_trimmed_every_interval(monkeypatch):
    if heap._MALLOC_TRIM is None:
        pytest.skip("not glibc")
    trims: list[float] = []
    monkeypatch.setattr(heap, "trim_heap", lambda: trims.append(trio.current_time()))

    async def inline(fn):  # the trim in the trio thread: no worker thread for the mock clock to jump over
        return fn()

    async def main():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(heap.serve_heap_trim, 300.0, inline)
            await trio.sleep(1000)
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert trims == [300.0, 600.0, 900.0]
