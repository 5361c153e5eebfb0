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
* **stopping.** Other services call a store's writes from their own tasks (the trainer and the
  validator append to the ledger; handler tasks spool batches), so the service that owns a store
  may stop while one of them is in a worker thread. Closing a SQLite connection under a running
  statement crashes the process (CPython's sqlite3 frees what that thread is using: a SIGSEGV in
  CI, not an exception). So the owner awaits :meth:`DbThread.stop` before closing the store: it
  waits, shielded, for the running call, and refuses every later one with :class:`StoreClosed`.
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


class StoreClosed(RuntimeError):
    """A write asked of a store that is closing: its owner (and the node) is stopping."""


class DbThread:
    """Runs one store's writes in a worker thread, one call at a time, in call order."""

    def __init__(self) -> None:
        self._limiter = trio.CapacityLimiter(1)
        self._stopped = False

    async def run(self, fn: Callable[..., T], *args) -> T:
        """``fn(*args)`` in a worker thread; its exceptions are raised here. StoreClosed for a call
        not started before :meth:`stop` began: it never touches the store. (Not a LedgerError or any
        error a caller logs and moves past: the write did not happen, and the node is stopping.)"""
        def call() -> T:
            if self._stopped:
                raise StoreClosed("the store is closing: the node is stopping")
            return fn(*args)

        # Checked in the thread, after the limiter: a cancelled caller gets Cancelled, as it would
        # have before the stop, and a call queued when the stop began is refused all the same.
        return await trio.to_thread.run_sync(call, limiter=self._limiter)

    async def stop(self) -> None:
        """Refuse further calls and wait for the running one, even when cancelled: once this
        returns, no thread is inside the store and none will enter, so it may be closed."""
        self._stopped = True
        with trio.CancelScope(shield=True):
            async with self._limiter:
                pass


def connect_reader(path: Path) -> sqlite3.Connection:
    """A query-only connection to the WAL database at ``path``, for the trio thread."""
    db = sqlite3.connect(Path(path), isolation_level=None)
    db.execute("PRAGMA query_only=ON")
    return db
