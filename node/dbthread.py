"""SQLite off the event loop: writes in one worker thread at a time, queries on a WAL reader.

How this works
--------------
The stores (trainer spool, validator store, ledger store) stay plain synchronous classes, tested
without trio. Each opens two connections to one WAL database:

* a **writer** connection that does every write transaction. A trio service never calls a write on
  the trio thread: it awaits ``db.run(store.method, *args)`` (:class:`DbThread`), which runs the call
  in a worker thread (``trio.to_thread.run_sync``) under a ``CapacityLimiter(1)``. So one thread at a
  time uses the writer connection (opened with ``check_same_thread=False`` for that reason), writes
  run in the order they were asked for (trio's limiter is FIFO), and while a ``synchronous=FULL``
  commit waits for its fsync — milliseconds on an idle disk, seconds on a busy one — the event loop
  keeps answering probes. A started call is not abandoned on cancellation: a commit always finishes.
* a **reader** connection (:func:`connect_reader`) for the queries made on the trio thread. A WAL
  reader reads a snapshot of the last commit and never waits for the writer, a checkpoint or an
  fsync (https://sqlite.org/wal.html, "Concurrency"), so those queries stay synchronous.

A decision that reads, then writes across that ``await`` (a replay check and the insert that makes it
true, the ledger's chain check and its commit) holds its service's ``trio.Lock`` for the whole
sequence, so no other task acts on the state in between.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import trio

T = TypeVar("T")


class DbThread:
    """Runs one store's writes in a worker thread, one call at a time, in call order."""

    def __init__(self) -> None:
        self._limiter = trio.CapacityLimiter(1)

    async def run(self, fn: Callable[..., T], *args) -> T:
        """``fn(*args)`` in a worker thread; its exceptions are raised here."""
        return await trio.to_thread.run_sync(fn, *args, limiter=self._limiter)


def connect_reader(path: Path) -> sqlite3.Connection:
    """A query-only connection to the WAL database at ``path``, for the trio thread."""
    db = sqlite3.connect(Path(path), isolation_level=None)
    db.execute("PRAGMA query_only=ON")
    return db
