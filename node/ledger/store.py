"""The ledger's SQLite database in the node's data dir (``ledger.sqlite``).

How this works
--------------
Two tables: ``entries`` (one row per accepted entry: author, seq, hash, the canonical envelope
bytes) and ``evidence`` (pairs of entries that prove an equivocation). Rows are only written by
:meth:`LedgerStore.commit`, which the service calls with entries that already passed every check,
in one transaction: after a crash or ``kill -9`` a batch is either all there or not there, and a
half-checked entry is never there because checking finishes before the transaction starts.

Durability (SQLite "PRAGMA synchronous", https://sqlite.org/pragma.html#pragma_synchronous):
the database runs in WAL mode. WAL with ``synchronous=NORMAL`` survives a process crash or
``kill -9`` without losing a commit (the WAL is in the OS page cache); only a power loss or kernel
crash can roll back the last commits. That is fine for *other* authors' entries — peers still hold
them and anti-entropy fetches them again — so remote batches commit with NORMAL. It is not fine for
*our own* entries: if we published seq n, lost it in a power cut and then signed a different seq n,
we would be an equivocator. Own entries therefore commit with ``synchronous=FULL`` (WAL fsynced
before the commit returns, and before the entry is published).

On open, :meth:`LedgerStore.verify_tail` re-checks the last few entries of every author (signature,
link, contiguous seqs) and :meth:`LedgerStore.truncate` drops a broken tail, which peers re-supply.

Cuts (node/ledger/cut.py): ``cuts`` holds the signed cuts the replica adopted (the newest
:data:`KEEP_CUTS`), ``bases`` every author's head at the newest one (seq and hash). Adopting a cut
(:meth:`LedgerStore.adopt_cut`) stores it, replaces the bases and drops the entries at or below them in
one transaction: after a crash the database is the old replica or the new one, never a cut without its
pruning or a pruned history without its cut. From then on an author's stored log starts right above
its base, and its first stored entry chains onto the base's hash; :func:`rebuild` starts from the
newest cut and replays the entries above it.
"""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Iterator
from pathlib import Path

from ..atomic import DataDirError
from ..dbthread import connect_reader
from ..wire import RemoteProtocolError
from .chain import Evidence, Ledger
from .cut import ledger_from_cut, open_cut
from .entries import GENESIS, SignedEntry, parse_entry

DB_FILE = "ledger.sqlite"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS entries (
    author TEXT NOT NULL,
    seq INTEGER NOT NULL,
    hash BLOB NOT NULL,
    raw BLOB NOT NULL,
    PRIMARY KEY (author, seq)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS evidence (
    author TEXT NOT NULL,
    fork_seq INTEGER NOT NULL,
    raw_a BLOB NOT NULL,
    raw_b BLOB NOT NULL,
    PRIMARY KEY (author, fork_seq)
);
CREATE TABLE IF NOT EXISTS cuts (number INTEGER PRIMARY KEY, hash BLOB NOT NULL, raw BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS bases (
    author TEXT PRIMARY KEY,
    seq INTEGER NOT NULL,
    hash BLOB NOT NULL
) WITHOUT ROWID;
"""

# Signed cuts kept: the newest is what the replica is based on and what peers fetch; the one before it
# is what a replica that still holds the history between them can check the newest against.
KEEP_CUTS = 2


PAGE_SIZE = 8192  # bytes per SQLite page of a new ledger database (see LedgerStore.__init__)


class LedgerStoreError(DataDirError):
    """The database cannot be used (another run's database, unreadable file): an operator problem."""


class StoreFull(LedgerStoreError):
    """A commit found the disk full: nothing of it was written, and it can be tried again once there is
    room (bench/soak.py's disk-full event: the error killed an inference node)."""


class LedgerStore:
    """Accepted entries and evidence on disk; one per node.

    Queries use a WAL reader of the opening thread. Writes (:meth:`commit`, :meth:`truncate`,
    :meth:`bind_run`) use their own connection, which the service drives from a worker thread, one
    call at a time (node/dbthread.py), so an fsync never holds up the event loop.
    """

    def __init__(self, path: Path, *, read_only: bool = False) -> None:
        self.path = Path(path)
        try:
            if read_only:
                self._db = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, isolation_level=None)
                self._read = self._db
            else:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
                # A receipts entry of 4+ items is larger than a 4 KiB page and spilled into an overflow
                # page of its own: 8 KiB pages halve the file (bench/ledger.py --scale). Only a new
                # database takes it; it must come before WAL, which fixes the page size.
                self._db.execute(f"PRAGMA page_size={PAGE_SIZE}")
                self._db.execute("PRAGMA journal_mode=WAL")
                self._db.execute("PRAGMA synchronous=NORMAL")
                self._db.executescript(_SCHEMA)
                self._read = connect_reader(self.path)
            self._read.execute("SELECT count(*) FROM entries").fetchone()
        except sqlite3.Error as e:
            raise LedgerStoreError(f"ledger database {self.path}: {e}") from None

    def close(self) -> None:
        if self._read is not self._db:
            self._read.close()
        self._db.close()

    def __enter__(self) -> LedgerStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---------------------------------------------------------------- meta

    def bind_run(self, run: str) -> None:
        """Remember which run this database belongs to; refuse another run's database."""
        row = self._db.execute("SELECT value FROM meta WHERE key='run'").fetchone()
        if row is None:
            self._db.execute("INSERT INTO meta(key, value) VALUES('run', ?)", (run,))
        elif row[0] != run:
            raise LedgerStoreError(run_mismatch(self.path, row[0], run))

    def run(self) -> str | None:
        row = self._read.execute("SELECT value FROM meta WHERE key='run'").fetchone()
        return row[0] if row else None

    # ---------------------------------------------------------------- writing

    @contextlib.contextmanager
    def _transaction(self):
        """One write transaction: committed when the block ends, rolled back on any exception; a full
        disk is StoreFull (the service keeps what it took in and retries once there is room)."""
        try:
            self._db.execute("BEGIN IMMEDIATE")
            yield
            self._db.execute("COMMIT")
        except BaseException as e:
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
            if isinstance(e, sqlite3.OperationalError) and e.sqlite_errorcode == sqlite3.SQLITE_FULL:
                raise StoreFull(f"ledger database {self.path}: the disk is full") from None
            raise

    def commit(self, entries: list[SignedEntry], evidence: list[Evidence] = (), *, durable: bool = False) -> None:
        """Store checked entries and evidence in one transaction (see the module doc for durable)."""
        if not entries and not evidence:
            return
        self._db.execute(f"PRAGMA synchronous={'FULL' if durable else 'NORMAL'}")
        with self._transaction():
            self._db.executemany(
                "INSERT INTO entries(author, seq, hash, raw) VALUES(?, ?, ?, ?)",
                [(e.author, e.seq, e.hash, e.raw) for e in entries],
            )
            self._db.executemany(
                "INSERT OR REPLACE INTO evidence(author, fork_seq, raw_a, raw_b) VALUES(?, ?, ?, ?)",
                [(ev.author, ev.fork_seq, ev.a.raw, ev.b.raw) for ev in evidence],
            )

    def truncate(self, author: str, from_seq: int) -> int:
        """Drop ``author``'s entries from ``from_seq`` on (a corrupt tail). Returns rows removed."""
        with self._db:
            cur = self._db.execute("DELETE FROM entries WHERE author=? AND seq>=?", (author, from_seq))
        return cur.rowcount

    def adopt_cut(self, number: int, cut_hash: bytes, raw: bytes, heads: dict[str, tuple[int, bytes]]) -> int:
        """Store the signed cut ``raw`` (its ``number`` and hash) with its per-author ``heads`` (seq,
        hash) as the new bases, and drop every entry at or below them: one transaction (module doc).
        Returns the entries dropped. ValueError if it is not newer than the newest stored cut."""
        newest = self._db.execute("SELECT max(number) FROM cuts").fetchone()  # the writer's connection: its thread
        if newest[0] is not None and number <= newest[0]:
            raise ValueError(f"cut {number} is not newer than the stored cut {newest[0]}")
        with self._transaction():
            self._db.execute("INSERT INTO cuts(number, hash, raw) VALUES(?, ?, ?)", (number, cut_hash, raw))
            self._db.execute("DELETE FROM cuts WHERE number <= ?", (number - KEEP_CUTS,))
            self._db.execute("DELETE FROM bases")
            self._db.executemany("INSERT INTO bases(author, seq, hash) VALUES(?, ?, ?)",
                                 [(a, seq, h) for a, (seq, h) in heads.items() if seq > 0])
            before = self._db.total_changes
            self._db.executemany("DELETE FROM entries WHERE author=? AND seq<=?",
                                 [(a, seq) for a, (seq, _h) in heads.items() if seq > 0])
            dropped = self._db.total_changes - before
        return dropped

    # ---------------------------------------------------------------- reading

    def count(self) -> int:
        return self._read.execute("SELECT count(*) FROM entries").fetchone()[0]

    def latest_cut(self) -> tuple[int, bytes, bytes] | None:
        """(number, hash, signed bytes) of the newest adopted cut, or None."""
        return self._read.execute("SELECT number, hash, raw FROM cuts ORDER BY number DESC LIMIT 1").fetchone()

    def cut_numbers(self) -> list[int]:
        return [n for (n,) in self._read.execute("SELECT number FROM cuts ORDER BY number")]

    def bases(self) -> dict[str, tuple[int, bytes]]:
        """Every author's head at the newest adopted cut: (seq, hash); its stored log starts above it."""
        return {a: (seq, h) for a, seq, h in self._read.execute("SELECT author, seq, hash FROM bases")}

    def base_of(self, author: str) -> tuple[int, bytes]:
        """``author``'s (seq, hash) at the newest adopted cut; (0, GENESIS) when none."""
        row = self._read.execute("SELECT seq, hash FROM bases WHERE author=?", (author,)).fetchone()
        return (row[0], row[1]) if row else (0, GENESIS)

    def heads(self) -> dict[str, int]:
        return dict(self._read.execute("SELECT author, max(seq) FROM entries GROUP BY author"))

    def get(self, author: str, seq: int) -> bytes | None:
        row = self._read.execute("SELECT raw FROM entries WHERE author=? AND seq=?", (author, seq)).fetchone()
        return row[0] if row else None

    def range(self, author: str, start: int, end: int, *, limit: int, max_bytes: int) -> list[bytes]:
        """Raw entries ``start..end`` of ``author`` in order, at most ``limit`` / ``max_bytes``; none
        when ``start`` is at or below the author's base (pruned by a cut: the asker needs the cut)."""
        if start <= self.base_of(author)[0]:
            return []
        out: list[bytes] = []
        size = 0
        for (raw,) in self._read.execute(
            "SELECT raw FROM entries WHERE author=? AND seq BETWEEN ? AND ? ORDER BY seq LIMIT ?",
            (author, start, end, limit),
        ):
            if out and size + len(raw) > max_bytes:
                break
            out.append(raw)
            size += len(raw)
        return out

    def entries(self, author: str, start: int, end: int) -> list[SignedEntry]:
        """Entries ``start..end`` of ``author`` in seq order, parsed (the replica's history,
        node/ledger/chain.py ``History``; their signatures were checked before they were stored)."""
        return [parse_entry(raw, verify_signature=False) for (raw,) in self._read.execute(
            "SELECT raw FROM entries WHERE author=? AND seq BETWEEN ? AND ? ORDER BY seq", (author, start, end))]

    def iter_raw(self) -> Iterator[tuple[str, int, bytes, bytes]]:
        """(author, seq, hash, raw) of every entry, by author then seq."""
        yield from self._read.execute("SELECT author, seq, hash, raw FROM entries ORDER BY author, seq")

    def iter_evidence(self) -> Iterator[tuple[bytes, bytes]]:
        yield from self._read.execute("SELECT raw_a, raw_b FROM evidence ORDER BY author, fork_seq")

    # ---------------------------------------------------------------- checking

    def verify_tail(self, n: int) -> dict[str, tuple[int, str]]:
        """Re-verify each author's last ``n`` entries. Returns {author: (first bad seq, reason)}."""
        problems: dict[str, tuple[int, str]] = {}
        bases = self.bases()
        for author, head in self.heads().items():
            base = bases.get(author, (0, GENESIS))[0]
            count = self._read.execute("SELECT count(*) FROM entries WHERE author=?", (author,)).fetchone()[0]
            if count != head - base:
                problems[author] = (self._first_missing(author, base), "gap")
                continue
            if n <= 0:
                continue
            start = max(base + 1, head - n + 1)
            bad = self.check_range(author, start, head)
            if bad:
                problems[author] = bad
        return problems

    def check_range(self, author: str, start: int, end: int) -> tuple[int, str] | None:
        """Verify signatures and links of ``start..end`` (from above the author's base at the lowest:
        the first stored entry chains onto the base's hash); (first bad seq, reason) or None."""
        base, base_hash = self.base_of(author)
        start = max(start, base + 1)
        prev = base_hash if start == base + 1 else self._hash_at(author, start - 1)
        rows = self._read.execute(
            "SELECT seq, hash, raw FROM entries WHERE author=? AND seq BETWEEN ? AND ? ORDER BY seq",
            (author, start, end),
        )
        expect = start
        for seq, h, raw in rows:
            problem = _row_problem(author, seq, h, raw, expect, prev)
            if problem:
                return seq, problem
            prev = h
            expect += 1
        return None

    def _hash_at(self, author: str, seq: int) -> bytes | None:
        row = self._read.execute("SELECT hash FROM entries WHERE author=? AND seq=?", (author, seq)).fetchone()
        return row[0] if row else None

    def _first_missing(self, author: str, base: int = 0) -> int:
        expect = base + 1
        for (seq,) in self._read.execute("SELECT seq FROM entries WHERE author=? AND seq>? ORDER BY seq",
                                         (author, base)):
            if seq != expect:
                return expect
            expect += 1
        return expect


def _row_problem(author: str, seq: int, h: bytes, raw: bytes, expect: int, prev: bytes | None) -> str | None:
    """Why a stored row is not a valid continuation of its chain (None when it is)."""
    if seq != expect:
        return "gap"
    try:
        se = parse_entry(raw)
    except RemoteProtocolError as e:
        return e.reason
    if se.hash != h:
        return "hash-mismatch"
    if se.author != author or se.seq != seq:
        return "row-mismatch"
    if prev is None or se.prev != prev:
        return "bad-link"
    return None


def rebuild(store: LedgerStore, ledger: Ledger) -> dict[str, tuple[int, str]]:
    """Load the newest stored cut, every stored entry above it and the evidence into an empty replica.

    The cut's signature and signer are re-checked against ``ledger``'s trainers (a LedgerStoreError if
    it no longer opens: without it the entries above it chain onto nothing). Signatures of entries are
    not re-checked (they were before they were stored; ``verify_tail`` and ``ledger verify`` re-check
    them); links are, by :meth:`Ledger.restore`. Evidence is re-verified, since it is small and
    decides whose credit is excluded. Returns what could not be loaded, ``{author: (first seq not
    loaded, reason)}`` (evidence under the key ``"evidence:<author>"``); only a database edited behind
    the node's back has any.
    """
    newest = store.latest_cut()
    if newest is not None:
        number, _hash, raw = newest
        try:
            based = ledger_from_cut(open_cut(raw, ledger), ledger, ledger.history)
        except RemoteProtocolError as e:
            raise LedgerStoreError(f"ledger database {store.path}: stored cut {number} does not open for this "
                                   f"run's trainers ({e.reason}: {e.detail})") from None
        # Callers hold ``ledger`` (tools, the service): it becomes the replica based on the cut.
        vars(ledger).update(vars(based))
    bases = store.bases() if newest is not None else {}
    skipped: dict[str, tuple[int, str]] = {}
    for author, seq, _hash, raw in store.iter_raw():
        if author in skipped or seq <= bases.get(author, (0,))[0]:  # pruned with the cut; only an edited database has it
            continue
        try:
            ledger.restore(parse_entry(raw, verify_signature=False))
        except (RemoteProtocolError, ValueError) as e:
            skipped[author] = (seq, getattr(e, "reason", "bad-link"))
    for raw_a, raw_b in store.iter_evidence():
        try:
            ev = Evidence(parse_entry(raw_a), parse_entry(raw_b))
            ledger.add_evidence(ev)
        except RemoteProtocolError as e:
            skipped[f"evidence:{len(skipped)}"] = (0, e.reason)
    return skipped


def open_ledger_store(data_dir: Path, *, read_only: bool = False) -> LedgerStore:
    """The ledger database of a data dir (created unless ``read_only``). Close it when done."""
    path = Path(data_dir) / DB_FILE
    if read_only and not path.exists():
        raise LedgerStoreError(f"no ledger database at {path}")
    return LedgerStore(path, read_only=read_only)


def check_run_of(data_dir: Path, run: str) -> None:
    """LedgerStoreError (:func:`run_mismatch`) when ``data_dir`` holds another run's ledger: checked
    before a node starts, so it stops with that one line instead of after its services began."""
    path = Path(data_dir) / DB_FILE
    if not path.exists():
        return
    with LedgerStore(path, read_only=True) as store:
        held = store.run()
    if held is not None and held != run:
        raise LedgerStoreError(run_mismatch(path, held, run))


def run_mismatch(path: Path, held: str, wanted: str) -> str:
    """What a node of run ``wanted`` started on run ``held``'s data dir is told: how to start it on a
    data dir of its own and keep its peer id (the one other peers bootstrap from)."""
    data_dir = path.parent
    return (f"ledger database {path} belongs to run {held!r}, not {wanted!r}: give run {wanted!r} a data dir "
            f"of its own (--data-dir NEW); to keep this node's peer id, first run "
            f"`swarm-node keygen --from {data_dir} --data-dir NEW`")
