"""The validator's durable memory (``validator.sqlite`` in the data dir): what it judged, what it owes.

Three tables:

* ``judged``: one row per batch id with its signed verdict and whether the trainer has recorded it.
  A trainer that re-sends a batch (its ack was lost, or it re-assigned after a timeout and the batch
  came back) gets the *same* verdict again instead of a replay rejection; verdicts not yet delivered
  are re-sent after a restart, so a judged batch is never lost on its way to the trainer.
* ``prompts``: (worker, step, prompt index) -> batch id. A drawn task is solved once: the same
  slot in a *different* batch (re-signed with a new time, or split differently) is a replay.
* ``penalties``: bans given, so a restarted validator keeps refusing a banned worker.
* ``worker_steps``: each worker's step window (node/rollouts/steps.py): the highest step judged and
  which steps below it were used, so step grinding is refused across restarts and after ``judged``
  rows are forgotten.

Durability: WAL with ``synchronous=FULL`` — a verdict or ban row is on disk before the verdict
leaves the node (https://sqlite.org/pragma.html#pragma_synchronous). Rows are bounded by
``MAX_JUDGED``: the oldest judged batches are forgotten first; by then their policy versions are far
beyond any async level, so a replay of them is rejected as stale anyway.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable
from pathlib import Path

from ..atomic import DataDirError
from ..dbthread import connect_reader
from ..rollouts.steps import StepWindow

DB_FILE = "validator.sqlite"
MAX_JUDGED = 200_000  # judged batches remembered (a few hundred bytes to a few KiB each)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS judged (
    batch_id BLOB PRIMARY KEY,
    worker TEXT NOT NULL,
    step INTEGER NOT NULL,
    accepted INTEGER NOT NULL,
    reasons TEXT NOT NULL,
    trainer TEXT NOT NULL,
    verdict BLOB NOT NULL,
    delivered INTEGER NOT NULL DEFAULT 0,
    time_ms INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS judged_undelivered ON judged (delivered, time_ms);
CREATE TABLE IF NOT EXISTS prompts (
    worker TEXT NOT NULL,
    step INTEGER NOT NULL,
    prompt_index INTEGER NOT NULL,
    batch_id BLOB NOT NULL,
    PRIMARY KEY (worker, step, prompt_index)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS worker_steps (
    worker TEXT PRIMARY KEY,
    high INTEGER NOT NULL,
    seen BLOB NOT NULL
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS bans (
    peer TEXT PRIMARY KEY,
    until_s REAL NOT NULL,
    reason TEXT NOT NULL
);
"""


class ValidatorStore:
    """Judged batches, claimed task slots and bans on disk; one per node.

    Queries use a WAL reader of the opening thread. Writes (:meth:`record`, :meth:`mark_delivered`,
    :meth:`save_ban`) use their own connection, which the service drives from a worker thread, one
    call at a time (node/dbthread.py), so an fsync never holds up the event loop.
    """

    def __init__(self, path: Path, max_judged: int = MAX_JUDGED) -> None:
        self.path = Path(path)
        self.max_judged = max_judged
        self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        try:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.executescript(_SCHEMA)
            self._read = connect_reader(self.path)
            self._read.execute("SELECT count(*) FROM judged").fetchone()
        except sqlite3.DatabaseError as e:
            self._db.close()
            raise DataDirError(
                f"validator store {self.path} is damaged ({e}): move it away to start afresh (batches judged "
                "before may then be judged again; their signed verdicts stay in the ledger)") from None

    def close(self) -> None:
        self._read.close()
        self._db.close()

    def verdict_of(self, batch_id: bytes) -> tuple[str, bytes] | None:
        """(trainer, signed verdict bytes) of a batch judged before, else None."""
        row = self._read.execute("SELECT trainer, verdict FROM judged WHERE batch_id = ?", (batch_id,)).fetchone()
        return None if row is None else (row[0], bytes(row[1]))

    def step_window(self, worker: str, db: sqlite3.Connection | None = None) -> StepWindow:
        """The steps ``worker`` used, as far as the step window needs (the reader's view unless a
        write on the writer passes its own ``db``)."""
        row = (db or self._read).execute("SELECT high, seen FROM worker_steps WHERE worker = ?", (worker,)).fetchone()
        return StepWindow.from_row(row[0], bytes(row[1])) if row else StepWindow.EMPTY

    def replayed_slots(self, worker: str, step: int, prompt_indices: Iterable[int], batch_id: bytes) -> set[int]:
        """The prompt indices of (worker, step) already claimed by another batch."""
        out = set()
        for p in set(prompt_indices):
            row = self._read.execute(
                "SELECT batch_id FROM prompts WHERE worker = ? AND step = ? AND prompt_index = ?", (worker, step, p)
            ).fetchone()
            if row is not None and bytes(row[0]) != batch_id:
                out.add(p)
        return out

    def record(
        self, batch_id: bytes, worker: str, step: int, prompt_indices: Iterable[int], accepted: bool,
        reasons: list[str], trainer: str, verdict: bytes, time_ms: int, window: int = 0,
    ) -> None:
        """Store a verdict and claim its task slots, in one transaction (before the verdict is sent);
        with ``window`` (the step window's size), mark the batch's step used in the worker's window."""
        with self._db:
            self._db.execute("BEGIN")
            self._db.execute(
                "INSERT OR IGNORE INTO judged (batch_id, worker, step, accepted, reasons, trainer, verdict, time_ms)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (batch_id, worker, step, int(accepted), json.dumps(reasons), trainer, verdict, time_ms),
            )
            self._db.executemany(
                "INSERT OR IGNORE INTO prompts (worker, step, prompt_index, batch_id) VALUES (?, ?, ?, ?)",
                [(worker, step, p, batch_id) for p in sorted(set(prompt_indices))],
            )
            if window:
                w = self.step_window(worker, self._db).after(step, window)
                self._db.execute("INSERT OR REPLACE INTO worker_steps (worker, high, seen) VALUES (?, ?, ?)",
                                 (worker, w.high, w.to_bytes()))
            self._prune()

    def _prune(self) -> None:
        (n,) = self._db.execute("SELECT COUNT(*) FROM judged").fetchone()
        if n <= self.max_judged:
            return
        old = [bytes(r[0]) for r in self._db.execute(
            "SELECT batch_id FROM judged ORDER BY time_ms LIMIT ?", (n - self.max_judged,))]
        self._db.executemany("DELETE FROM judged WHERE batch_id = ?", [(b,) for b in old])
        self._db.executemany("DELETE FROM prompts WHERE batch_id = ?", [(b,) for b in old])

    def undelivered(self, limit: int) -> list[tuple[bytes, str, bytes]]:
        """(batch id, trainer, verdict) not yet recorded by their trainer, oldest first."""
        rows = self._read.execute(
            "SELECT batch_id, trainer, verdict FROM judged WHERE delivered = 0 ORDER BY time_ms LIMIT ?", (limit,)
        )
        return [(bytes(b), t, bytes(v)) for b, t, v in rows]

    def mark_delivered(self, batch_id: bytes) -> None:
        self._db.execute("UPDATE judged SET delivered = 1 WHERE batch_id = ?", (batch_id,))

    def counts(self) -> dict[str, int]:
        acc, rej, pending = self._read.execute(
            "SELECT COALESCE(SUM(accepted), 0), COALESCE(SUM(1 - accepted), 0), COALESCE(SUM(1 - delivered), 0) FROM judged"
        ).fetchone()
        return {"accepted": acc, "rejected": rej, "undelivered": pending}

    def save_ban(self, peer: str, until_s: float, reason: str) -> None:
        self._db.execute(
            "INSERT INTO bans (peer, until_s, reason) VALUES (?, ?, ?)"
            " ON CONFLICT (peer) DO UPDATE SET until_s = MAX(until_s, excluded.until_s), reason = excluded.reason",
            (peer, until_s, reason),
        )

    def bans(self, now_s: float) -> list[tuple[str, float, str]]:
        return [(p, u, r) for p, u, r in self._read.execute("SELECT peer, until_s, reason FROM bans WHERE until_s > ?", (now_s,))]
