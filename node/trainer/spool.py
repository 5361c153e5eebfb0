"""The durable batch spool: every acknowledged batch is on disk before its ack is sent.

How this works
--------------
One SQLite database (WAL journal, ``synchronous=FULL``: a committed transaction survives power loss)
with a row per batch id the trainer has judged. A batch moves through named states:

    GATED ──verdict ok──> READY ──taken by step s──> TRAINED(s)
      │                     │
      └──verdict failed──>  └──too stale by now──>  REJECTED  <── refused at intake (attributable)

(with no validators configured a batch is spooled straight into READY). Rows are never deleted
while a replay of them could still be accepted, so the primary key doubles as the replay filter.
Finished rows older than that are pruned (the table stays bounded); the ``forgotten`` table keeps
how many were removed per state and reason, so :meth:`Spool.counts` and
:meth:`Spool.rejected_by_reason` count every batch ever judged, not only those still on disk.

Exactly-once training across ``kill -9``: batches are marked TRAINED(s+1) *before* step s+1 runs,
and the training state of step s+1 is saved after it. On restart with saved step ``k``,
:meth:`Spool.recover` returns every TRAINED(s > k) batch to READY, so a crash mid-step neither
loses nor double-trains a batch.

Ledger entries ("rollouts accepted/rejected") are due when a batch reaches TRAINED or REJECTED; the
``ledger_done`` flag is set only after the entry is appended, so they too survive a crash.

A damaged file never passes for an intact one (issue 14): at open, :func:`check_spool` runs SQLite's
``integrity_check`` (page structure, free lists, every index against its table) and re-derives every
acknowledged batch not yet trained (GATED, READY) from its signed envelope: the envelope must hash to
the batch id and give the same worker, step, version, sizes and reward as its row. SQLite keeps no
checksum of row contents, so this is what catches a flipped byte inside a row. Either every such
batch is there as it was acknowledged, or the node refuses to start with one line
(:class:`~node.atomic.DataDirError`, exit 2) naming the file. Rows of finished batches keep no
envelope and are checked only for a valid state.
"""

from __future__ import annotations

import enum
import math
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ..atomic import DataDirError
from ..dbthread import connect_reader
from ..rollouts.schema import DOMAIN_BATCH, MAX_BATCH_BYTES, RolloutBatch, SignedBatch, batch_id_of
from ..wire import Envelope, RemoteProtocolError, decode_as
from ..rollouts.steps import StepWindow
from .evaluation import EvalRecord

SCHEMA = """
CREATE TABLE IF NOT EXISTS batches (
    arrival INTEGER PRIMARY KEY AUTOINCREMENT,
    batch_id BLOB NOT NULL UNIQUE,
    worker TEXT NOT NULL,
    step INTEGER NOT NULL,            -- the worker's draw step
    policy_version INTEGER NOT NULL,
    samples INTEGER NOT NULL,
    tokens INTEGER NOT NULL,          -- completion tokens
    mean_reward REAL NOT NULL,
    state TEXT NOT NULL,
    reason TEXT NOT NULL DEFAULT '',
    envelope BLOB,                    -- the signed batch; dropped once trained or rejected
    verdict BLOB,                     -- the signed verdict that decided it, if any
    trained_step INTEGER,
    ledger_due INTEGER NOT NULL,      -- 1: an accepted/rejected ledger entry must be written
    ledger_done INTEGER NOT NULL DEFAULT 0,
    accepted_step INTEGER             -- trainer step when acknowledged (staleness is judged then: intake.py)
);
CREATE INDEX IF NOT EXISTS batches_worker_step ON batches (worker, step);
CREATE INDEX IF NOT EXISTS batches_state ON batches (state);
CREATE TABLE IF NOT EXISTS worker_steps (
    worker TEXT PRIMARY KEY,          -- the step window of node/rollouts/steps.py, per worker
    high INTEGER NOT NULL,            -- highest draw step spooled from the worker
    seen BLOB NOT NULL                -- bit i: step high - i was used
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS steps (
    step INTEGER PRIMARY KEY,         -- the version this step produced
    mean_reward REAL NOT NULL,        -- over every sample of the step's batches (before filtering)
    samples INTEGER NOT NULL,         -- samples trained on (after zero-advantage filtering)
    batches INTEGER NOT NULL,
    tokens INTEGER NOT NULL,
    loss REAL NOT NULL,
    seconds REAL NOT NULL             -- wall time of the update
);
CREATE TABLE IF NOT EXISTS evals (
    version INTEGER PRIMARY KEY,      -- a published version scored on the held-out draw (node/trainer/evaluation.py)
    score REAL NOT NULL,              -- mean task reward of greedy completions
    tasks INTEGER NOT NULL,
    seconds REAL NOT NULL             -- wall time of the evaluation
);
CREATE TABLE IF NOT EXISTS forgotten (
    state TEXT NOT NULL,              -- finished batches removed by prune(), so counts stay whole
    reason TEXT NOT NULL,
    n INTEGER NOT NULL,
    PRIMARY KEY (state, reason)
) WITHOUT ROWID;
"""


class BatchState(enum.Enum):
    GATED = "gated"  # waiting for a validator's verdict
    READY = "ready"  # may be trained
    TRAINED = "trained"
    REJECTED = "rejected"


# Legal transitions (anything else is a bug in the caller).
TRANSITIONS = {
    BatchState.GATED: {BatchState.READY, BatchState.REJECTED},
    BatchState.READY: {BatchState.TRAINED, BatchState.REJECTED},
    BatchState.TRAINED: {BatchState.READY},  # recover() after a crash mid-step, untake() after a dropped step
    BatchState.REJECTED: set(),
}


class SpoolError(Exception):
    """An illegal state transition or unknown batch: a bug in the trainer, not the remote's fault."""


@dataclass(frozen=True)
class SpooledBatch:
    batch_id: bytes
    worker: str
    step: int
    policy_version: int
    samples: int
    tokens: int
    mean_reward: float
    state: BatchState
    reason: str
    trained_step: int | None
    accepted_step: int | None = None  # None: spooled before this was recorded (intake.trainable_until)


@dataclass(frozen=True)
class StepRecord:
    step: int
    mean_reward: float
    samples: int
    batches: int
    tokens: int
    loss: float
    seconds: float


_COLS = "batch_id, worker, step, policy_version, samples, tokens, mean_reward, state, reason, trained_step, accepted_step"


def _row(r) -> SpooledBatch:
    return SpooledBatch(bytes(r[0]), r[1], r[2], r[3], r[4], r[5], r[6], BatchState(r[7]), r[8], r[9], r[10])


def _get(db: sqlite3.Connection, batch_id: bytes) -> SpooledBatch | None:
    r = db.execute(f"SELECT {_COLS} FROM batches WHERE batch_id = ?", (batch_id,)).fetchone()
    return _row(r) if r else None


class Spool:
    """The trainer's batch table. Synchronous (one fsync per write transaction).

    ``db`` does the writes; ``reader`` (default ``db``) the queries. The trainer service passes a
    separate WAL reader and runs the writes in a worker thread (see node/dbthread.py), so a query on
    the trio thread never waits for a commit's fsync.
    """

    def __init__(self, db: sqlite3.Connection, reader: sqlite3.Connection | None = None) -> None:
        self.db = db
        self.reader = db if reader is None else reader

    # ------------------------------------------------------------------ queries

    def knows(self, batch_id: bytes) -> bool:
        return self.reader.execute("SELECT 1 FROM batches WHERE batch_id = ?", (batch_id,)).fetchone() is not None

    def knows_worker_step(self, worker: str, step: int) -> bool:
        q = "SELECT 1 FROM batches WHERE worker = ? AND step = ?"
        return self.reader.execute(q, (worker, step)).fetchone() is not None

    def step_window(self, worker: str, db: sqlite3.Connection | None = None) -> StepWindow:
        """The steps ``worker`` used, as far as the step window needs (node/rollouts/steps.py).
        Read on the trio thread's reader unless a write (on the writer) passes its own ``db``."""
        r = (db or self.reader).execute("SELECT high, seen FROM worker_steps WHERE worker = ?", (worker,)).fetchone()
        return StepWindow.from_row(r[0], bytes(r[1])) if r else StepWindow.EMPTY

    def get(self, batch_id: bytes) -> SpooledBatch | None:
        return _get(self.reader, batch_id)

    def envelope(self, batch_id: bytes) -> bytes | None:
        r = self.reader.execute("SELECT envelope FROM batches WHERE batch_id = ?", (batch_id,)).fetchone()
        return bytes(r[0]) if r and r[0] is not None else None

    def in_state(self, state: BatchState, limit: int = -1) -> list[SpooledBatch]:
        q = f"SELECT {_COLS} FROM batches WHERE state = ? ORDER BY arrival LIMIT ?"
        return [_row(r) for r in self.reader.execute(q, (state.value, limit))]

    def pending(self) -> int:
        """Batches acknowledged and not yet trained or rejected."""
        q = "SELECT COUNT(*) FROM batches WHERE state IN (?, ?)"
        return self.reader.execute(q, (BatchState.GATED.value, BatchState.READY.value)).fetchone()[0]

    def counts(self) -> dict[str, int]:
        """Batches per state, pruned ones included."""
        q = ("SELECT state, SUM(n) FROM (SELECT state, COUNT(*) AS n FROM batches GROUP BY state "
             "UNION ALL SELECT state, n FROM forgotten) GROUP BY state")
        return dict(self.reader.execute(q).fetchall())

    def rejected_by_reason(self) -> dict[str, int]:
        """Rejected batches per reason, pruned ones included."""
        q = ("SELECT reason, SUM(n) FROM (SELECT reason, COUNT(*) AS n FROM batches WHERE state = ?1 GROUP BY reason "
             "UNION ALL SELECT reason, n FROM forgotten WHERE state = ?1) GROUP BY reason")
        return dict(self.reader.execute(q, (BatchState.REJECTED.value,)).fetchall())

    def ledger_due(self, limit: int) -> list[SpooledBatch]:
        q = (f"SELECT {_COLS} FROM batches WHERE ledger_due = 1 AND ledger_done = 0 AND state IN (?, ?) "
             "ORDER BY arrival LIMIT ?")
        return [_row(r) for r in self.reader.execute(q, (BatchState.TRAINED.value, BatchState.REJECTED.value, limit))]

    def steps(self, last: int = 0) -> list[StepRecord]:
        q = "SELECT step, mean_reward, samples, batches, tokens, loss, seconds FROM steps ORDER BY step"
        rows = [StepRecord(*r) for r in self.reader.execute(q)]
        return rows[-last:] if last else rows

    def evals(self) -> list[EvalRecord]:
        """The held-out scores recorded so far, by version (none in a spool written before they were kept)."""
        if self.reader.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'evals'").fetchone() is None:
            return []
        q = "SELECT version, score, tasks, seconds FROM evals ORDER BY version"
        return [EvalRecord(*r) for r in self.reader.execute(q)]

    # ------------------------------------------------------------------ writes (each one transaction)

    def add(self, signed: SignedBatch, state: BatchState, *, reason: str = "", ledger_due: bool = True,
            window: int = 0, accepted_step: int | None = None) -> None:
        """Record a judged batch; durable when this returns (ack only after that). With ``window``
        (the step window's size) the batch's step is marked used in the worker's window too;
        ``accepted_step`` is the trainer's step at the acknowledgement."""
        b = signed.batch
        _, _, _, _, tokens, mean_reward = _batch_figures(b)
        keep = signed.envelope if state in (BatchState.GATED, BatchState.READY) else None
        with self.db:
            self.db.execute(
                "INSERT INTO batches (batch_id, worker, step, policy_version, samples, tokens, mean_reward, "
                "state, reason, envelope, ledger_due, accepted_step) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
                (signed.batch_id, b.worker, b.step, b.policy_version, len(b.samples), tokens, mean_reward,
                 state.value, reason, keep, int(ledger_due), accepted_step),
            )
            if window:
                w = self.step_window(b.worker, self.db).after(b.step, window)
                self.db.execute("INSERT OR REPLACE INTO worker_steps (worker, high, seen) VALUES (?, ?, ?)",
                                (b.worker, w.high, w.to_bytes()))

    def _move(self, batch_ids: list[bytes], to: BatchState, **cols) -> None:
        for bid in batch_ids:
            cur = _get(self.db, bid)  # on the writer: the thread running this write
            if cur is None:
                raise SpoolError(f"unknown batch {bid.hex()[:12]}")
            if to not in TRANSITIONS[cur.state]:
                raise SpoolError(f"batch {bid.hex()[:12]}: {cur.state.value} -> {to.value} is not allowed")
        sets = ", ".join(["state = ?"] + [f"{k} = ?" for k in cols])
        if to in (BatchState.TRAINED, BatchState.REJECTED):
            sets += ", envelope = NULL" if to is BatchState.REJECTED else ""
        with self.db:
            self.db.executemany(f"UPDATE batches SET {sets} WHERE batch_id = ?",
                                [(to.value, *cols.values(), bid) for bid in batch_ids])

    def decide(self, batch_id: bytes, passed: bool, reason: str, verdict: bytes | None) -> None:
        """A verdict arrived for a GATED batch."""
        self._move([batch_id], BatchState.READY if passed else BatchState.REJECTED,
                   reason="" if passed else reason, verdict=verdict)

    def reject(self, batch_ids: list[bytes], reason: str, *, ledger_due: bool = True) -> None:
        self._move(batch_ids, BatchState.REJECTED, reason=reason, ledger_due=int(ledger_due))

    def take(self, batch_ids: list[bytes], step: int) -> None:
        """Mark READY batches as consumed by ``step`` (before the step runs; see recover())."""
        self._move(batch_ids, BatchState.TRAINED, trained_step=step)

    def trained_envelopes(self, step: int) -> list[tuple[bytes, bytes]]:
        q = "SELECT batch_id, envelope FROM batches WHERE state = ? AND trained_step = ? ORDER BY arrival"
        return [(bytes(a), bytes(b)) for a, b in self.reader.execute(q, (BatchState.TRAINED.value, step))]

    def record_step(self, record: StepRecord) -> None:
        """Remember step ``record.step``'s figures, *before* its model is saved: a crash in between
        leaves a record without a saved model, which recover() drops, never a model without one."""
        if not all(math.isfinite(v) for v in (record.mean_reward, record.loss, record.seconds)):
            raise ValueError(f"step {record.step}: non-finite figures {record}")  # our bug: never stored as NULL
        with self.db:
            self.db.execute("INSERT OR REPLACE INTO steps VALUES (?,?,?,?,?,?,?)",
                            (record.step, record.mean_reward, record.samples, record.batches, record.tokens,
                             record.loss, record.seconds))

    def record_eval(self, record: EvalRecord) -> None:
        """Remember a version's held-out score (kept for the whole run, like the step records)."""
        if not math.isfinite(record.score) or not math.isfinite(record.seconds):
            raise ValueError(f"eval of v{record.version}: non-finite figures {record}")  # our bug
        with self.db:
            self.db.execute("INSERT OR REPLACE INTO evals VALUES (?,?,?,?)",
                            (record.version, record.score, record.tasks, record.seconds))

    def finish_step(self, record: StepRecord) -> None:
        """Step ``record.step`` is saved: remember its figures (if not yet) and drop its batches' envelopes."""
        self.record_step(record)
        with self.db:
            self.db.execute("UPDATE batches SET envelope = NULL WHERE state = ? AND trained_step = ?",
                            (BatchState.TRAINED.value, record.step))

    def untake(self, batch_ids: list[bytes]) -> None:
        """A step that did not happen: its batches are READY again."""
        self._move(batch_ids, BatchState.READY, trained_step=None)

    def recover(self, saved_step: int) -> int:
        """After a restart at ``saved_step``: batches taken by later (lost) steps become READY again."""
        with self.db:
            cur = self.db.execute(
                "UPDATE batches SET state = ?, trained_step = NULL WHERE state = ? AND trained_step > ?",
                (BatchState.READY.value, BatchState.TRAINED.value, saved_step))
            self.db.execute("DELETE FROM steps WHERE step > ?", (saved_step,))
            self.db.execute("DELETE FROM evals WHERE version > ?", (saved_step,))  # a version to be made again
        return cur.rowcount

    def mark_ledger_done(self, batch_id: bytes) -> None:
        with self.db:
            self.db.execute("UPDATE batches SET ledger_done = 1 WHERE batch_id = ?", (batch_id,))

    def prune(self, oldest_useful_version: int) -> int:
        """Forget finished batches whose replay would be refused as stale anyway (bounds the table)."""
        where = "state IN (?, ?) AND policy_version < ? AND (ledger_due = 0 OR ledger_done = 1)"
        args = (BatchState.TRAINED.value, BatchState.REJECTED.value, oldest_useful_version)
        with self.db:  # one transaction: a batch is either still a row or already in the tally
            self.db.execute(f"INSERT INTO forgotten (state, reason, n) SELECT state, reason, COUNT(*) FROM batches "
                            f"WHERE {where} GROUP BY state, reason ON CONFLICT (state, reason) DO UPDATE SET n = n + excluded.n",
                            args)
            cur = self.db.execute(f"DELETE FROM batches WHERE {where}", args)
        return cur.rowcount


def _batch_figures(b: RolloutBatch) -> tuple:
    """What a row records of a batch, derived from the batch (as :meth:`Spool.add` computes it)."""
    tokens = sum(len(s.completion_ids) for s in b.samples)
    mean_reward = sum(s.reward for s in b.samples) / len(b.samples) if b.samples else 0.0
    return b.worker, b.step, b.policy_version, len(b.samples), tokens, mean_reward


def check_spool(db: sqlite3.Connection) -> str | None:
    """What is wrong with a spool database, or None (see the module docstring). Reads every page."""
    result = [r[0] for r in db.execute("PRAGMA integrity_check(8)")]
    if result != ["ok"]:
        return "; ".join(result)
    states = tuple(s.value for s in BatchState)
    bad = db.execute(f"SELECT COUNT(*) FROM batches WHERE state NOT IN ({','.join('?' * len(states))})", states)
    if (n := bad.fetchone()[0]):
        return f"{n} batches in an unknown state"
    q = ("SELECT batch_id, worker, step, policy_version, samples, tokens, mean_reward, envelope FROM batches "
         "WHERE state IN (?, ?)")
    for bid, *cols, env in db.execute(q, (BatchState.GATED.value, BatchState.READY.value)):
        name = bytes(bid).hex()[:12]
        if env is None:
            return f"acknowledged batch {name} lost its envelope"
        try:
            envelope = decode_as(Envelope, bytes(env), MAX_BATCH_BYTES)
            if batch_id_of(envelope) != bytes(bid):
                return f"acknowledged batch {name} does not hash to its id"
            batch = envelope.open_as(DOMAIN_BATCH, RolloutBatch, MAX_BATCH_BYTES)
        except RemoteProtocolError as e:
            return f"acknowledged batch {name} cannot be read ({e})"
        if _batch_figures(batch) != tuple(cols):
            return f"acknowledged batch {name}: its row does not match its envelope"
    return None


@contextmanager
def open_spool(path: Path) -> Iterator[Spool]:
    """Open (creating) the spool database at ``path``; closed on exit.

    Writes go through a connection that may be used from a worker thread (one at a time), queries
    through a WAL reader of the opening thread (node/dbthread.py).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # SQLite takes an empty file for a new database: a spool cut to 0 bytes would start empty.
    emptied = path.is_file() and path.stat().st_size == 0
    db = sqlite3.connect(str(path), isolation_level="DEFERRED", check_same_thread=False)
    reader = None
    try:
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=FULL")
            db.executescript(SCHEMA)
            columns = {r[1] for r in db.execute("PRAGMA table_info(batches)")}
            if "accepted_step" not in columns:  # a spool written before staleness was judged at intake
                with db:
                    db.execute("ALTER TABLE batches ADD COLUMN accepted_step INTEGER")
            reader = connect_reader(path)
            problem = "the file is empty" if emptied else check_spool(reader)
        except sqlite3.DatabaseError as e:
            problem = str(e)
        except UnicodeDecodeError:  # SQLite's error quotes a damaged schema text, which Python cannot decode
            problem = "its schema is damaged"
        if problem is not None:
            # Refuse rather than start empty: the spool holds batches we acknowledged.
            raise DataDirError(
                f"trainer spool {path} is damaged ({problem}); it holds acknowledged batches: restore it from a "
                "backup, or move it away to start with an empty spool (those batches are then lost)")
        yield Spool(db, reader)
    finally:
        if reader is not None:
            reader.close()
        db.close()
