"""Which lines of code hold more Python memory than they did after warm-up (opt-in, tracemalloc).

How this works: a node started with Python's own switch ``PYTHONTRACEMALLOC=1`` (or ``-X
tracemalloc``) traces its allocations; :class:`MemoryGrowth` then takes a baseline snapshot once
the node is past its warm-up (model loaded, peers found) and, at most every ``every`` seconds, a
new one, and reports the lines whose live allocations grew most since the baseline. The status
shows it as ``memory_growth`` (node/status.py): the answer to "what is the RSS slope made of" in
an hour-long run (issue 45). Without the switch nothing is traced and nothing is reported, so it
costs nothing; with it, allocations are slower (Python's docs: tracemalloc's own overhead) and a
snapshot takes about a second on a node with torch loaded, which is why snapshots are rare.

Growth of RSS that does not show here is outside Python's allocator: SQLite's page cache, torch,
protobuf, the C allocator's fragmentation. ``heap`` (glibc's ``mallinfo2``) tells the last two
kinds apart: C memory in use grows with live native objects, free-but-kept (``free_mib``) with
fragmentation.
"""

from __future__ import annotations

import tracemalloc
from typing import Callable

from .heap import c_heap

WARMUP_S = 300.0  # no baseline before the node has run this long: loading and first connections are not a leak
EVERY_S = 60.0  # seconds between two snapshots after the baseline
TOP = 10  # lines reported, largest growth first
# Allocations of the tracer itself and of the import machinery are not the node's.
_IGNORE = (tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, "<frozen importlib._bootstrap>"),
           tracemalloc.Filter(False, "<frozen importlib._bootstrap_external>"), tracemalloc.Filter(False, "<unknown>"))


def take_snapshot() -> tracemalloc.Snapshot:
    return tracemalloc.take_snapshot().filter_traces(_IGNORE)


def top_growth(baseline: tracemalloc.Snapshot, now: tracemalloc.Snapshot, top: int = TOP) -> list[dict]:
    """The ``top`` lines whose live allocations grew most from ``baseline`` to ``now`` (shrinkage is
    not listed): ``{"at": "file:line", "kib": growth, "blocks": growth in allocations}``."""
    diffs = sorted((d for d in now.compare_to(baseline, "lineno") if d.size_diff > 0), key=lambda d: -d.size_diff)
    return [{"at": f"{d.traceback[0].filename}:{d.traceback[0].lineno}", "kib": round(d.size_diff / 1024, 1),
             "blocks": d.count_diff} for d in diffs[:top]]


class MemoryGrowth:
    """Growth of traced memory since a baseline taken after ``warmup`` seconds; ``observe(now)`` is
    called on each status write and takes a snapshot at most every ``every`` seconds (``now``: any
    monotonic clock, the caller's)."""

    def __init__(self, *, warmup: float = WARMUP_S, every: float = EVERY_S, top: int = TOP,
                 take: Callable[[], tracemalloc.Snapshot] = take_snapshot):
        self.warmup, self.every, self.top, self.take = warmup, every, top, take
        self.started: float | None = None
        self.baseline: tracemalloc.Snapshot | None = None
        self.baseline_at = 0.0
        self.next_at = 0.0
        self.last: dict = {}

    def observe(self, now: float) -> dict:
        if self.started is None:
            self.started = now
        if self.baseline is None:
            if now - self.started < self.warmup:
                return {"baseline_in_s": round(self.warmup - (now - self.started), 1)}
            self.baseline, self.baseline_at, self.next_at = self.take(), now, now + self.every
            self.last = {"since_s": 0.0, "traced_mib": _traced_mib(), "heap": c_heap(), "top": []}
        elif now >= self.next_at:
            self.next_at = now + self.every
            self.last = {"since_s": round(now - self.baseline_at, 1), "traced_mib": _traced_mib(), "heap": c_heap(),
                         "top": top_growth(self.baseline, self.take(), self.top)}
        return self.last


def _traced_mib() -> float:
    return round(tracemalloc.get_traced_memory()[0] / 2**20, 1)
