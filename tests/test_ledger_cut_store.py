"""A ledger database based on a trainer-signed cut (node/ledger/store.py, issue 46 item 4).

Adopting a cut stores it and drops the entries at or below its heads in one transaction (a failure
leaves the old database whole); a rebuild starts from the newest cut and the entries above it and
reaches the state of a replica that kept the whole history and took the same cut; the tail checks and
range reads know an author's stored log starts right above its base; at most KEEP_CUTS cuts stay.
"""

from __future__ import annotations

import sqlite3

import pytest

from node.ledger.chain import Ledger
from node.ledger.cut import make_cut, open_cut, rebase, sign_cut
from node.ledger.store import KEEP_CUTS, LedgerStoreError, open_ledger_store, rebuild
from test_ledger_cut import NOW, RUN, T1, T2, VALIDATOR, deliver, history, new_ledger, state


def replica_of(store) -> Ledger:
    ledger = Ledger(RUN, [T1.peer_id, T2.peer_id], [VALIDATOR.peer_id], max_skew_ms=0, history=store.entries)
    assert rebuild(store, ledger) == {}
    return ledger


def heads_of(cut) -> dict:
    return {log.author: (log.seq, log.hash) for log in cut.logs}


def stored_with_cut(tmp_path, entries, k, keep=4):
    """A database of ``entries`` that adopted T1's cut of the first ``k``; (store, opened, raw)."""
    maker = new_ledger()
    assert deliver(maker, entries[:k]) == []
    cut = make_cut(maker, time_ms=NOW, keep_versions=keep, keep_steps=keep)
    raw = sign_cut(T1, cut)
    opened = open_cut(raw, new_ledger())
    store = open_ledger_store(tmp_path)
    store.bind_run(RUN)
    store.commit(entries)
    return store, opened, raw


def test_a_rebuild_from_the_cut_and_the_entries_above_equals_the_whole_history_rebased(tmp_path):
    entries = history(6, seed=3)
    store, opened, raw = stored_with_cut(tmp_path, entries, len(entries) // 2)
    with store:
        whole = replica_of(store)
        before = store.count()
        dropped = store.adopt_cut(opened.cut.number, opened.hash, raw, heads_of(opened.cut))
        assert dropped == sum(log.seq for log in opened.cut.logs) and store.count() == before - dropped
        based = rebase(whole, opened)
        again = replica_of(store)
        assert state(again) == state(based)
        assert (again.cut_number, again.cut_hash) == (1, opened.hash)
        # the tail checks read from the base on: nothing wrong with a pruned log
        assert store.verify_tail(10**6) == {}
        # a range starting at or below an author's base is not ours to serve any more
        author = opened.cut.logs[0].author
        base = opened.cut.logs[0].seq
        assert store.range(author, base, base + 5, limit=10, max_bytes=10**6) == []
        assert store.range(author, 1, base + 5, limit=10, max_bytes=10**6) == []
        first = store.range(author, base + 1, base + 1, limit=10, max_bytes=10**6)
        assert first == [store.get(author, base + 1)]


def test_an_entry_above_the_base_that_does_not_chain_onto_it_is_found(tmp_path):
    entries = history(5, seed=5)
    store, opened, raw = stored_with_cut(tmp_path, entries, len(entries) // 2)
    with store:
        store.adopt_cut(opened.cut.number, opened.hash, raw, heads_of(opened.cut))
        log = next(log for log in opened.cut.logs if store.get(log.author, log.seq + 2))
        # the first entry above the base removed: the log has a gap right above its base
        store._db.execute("DELETE FROM entries WHERE author=? AND seq=?", (log.author, log.seq + 1))
        assert store.verify_tail(4)[log.author] == (log.seq + 1, "gap")
    with open_ledger_store(tmp_path) as store:
        # a wrong base hash: the stored first entry no longer chains onto the base
        store.truncate(log.author, log.seq + 1)
        store.commit([se for se in entries if se.author == log.author and se.seq > log.seq])
        store._db.execute("UPDATE bases SET hash=? WHERE author=?", (b"\0" * 32, log.author))
        assert store.check_range(log.author, 1, log.seq + 3) == (log.seq + 1, "bad-link")


def test_adopting_is_one_transaction(tmp_path):
    entries = history(4, seed=7)
    store, opened, raw = stored_with_cut(tmp_path, entries, len(entries) // 2)
    with store:
        before = (store.count(), store.heads(), store.bases(), store.latest_cut())
        # the prune fails half way (a trigger stands in for a crash or a full disk at that point)
        store._db.execute("CREATE TRIGGER no_prune BEFORE DELETE ON entries BEGIN SELECT RAISE(ABORT, 'x'); END")
        with pytest.raises(sqlite3.IntegrityError):
            store.adopt_cut(opened.cut.number, opened.hash, raw, heads_of(opened.cut))
        assert (store.count(), store.heads(), store.bases(), store.latest_cut()) == before
        assert before[3] is None and before[2] == {}
        store._db.execute("DROP TRIGGER no_prune")
        store.adopt_cut(opened.cut.number, opened.hash, raw, heads_of(opened.cut))
        assert store.latest_cut() == (1, opened.hash, raw)
        with pytest.raises(ValueError):  # an older or equal cut never replaces the newest
            store.adopt_cut(1, opened.hash, raw, heads_of(opened.cut))


def test_cuts_follow_each_other_and_only_the_newest_are_kept(tmp_path):
    entries = history(8, seed=11)
    n = len(entries)
    with open_ledger_store(tmp_path) as store:
        store.bind_run(RUN)
        store.commit(entries)
        replica = replica_of(store)
        whole = new_ledger()
        assert deliver(whole, entries) == []
        for i, k in enumerate((n // 4, n // 2, 3 * n // 4), start=1):
            maker = new_ledger()
            assert deliver(maker, entries[:k]) == []
            # the cut follows the one before (number, prev) as a replica based on it would make it
            cut = make_cut(maker, time_ms=NOW, keep_versions=4, keep_steps=4, number=i, prev=replica.cut_hash,
                           opened=(max(replica.open_version, maker.next_open(4, 4)[0]),
                                   {w: max(s, replica.open_steps.get(w, 0)) for w, s in maker.next_open(4, 4)[1].items()}))
            raw = sign_cut(T1, cut)
            opened = open_cut(raw, replica)
            replica = rebase(replica, opened, store.entries)
            store.adopt_cut(cut.number, opened.hash, raw, heads_of(cut))
            assert store.cut_numbers() == list(range(max(1, i - KEEP_CUTS + 1), i + 1))
            assert store.count() == n - sum(log.seq for log in cut.logs)
        again = replica_of(store)
        assert again.cut_number == 3 and state(again) == state(replica)
        assert again.digest() == whole.digest()


def test_a_stored_cut_the_runs_trainers_did_not_sign_stops_the_rebuild(tmp_path):
    entries = history(3, seed=2)
    store, opened, raw = stored_with_cut(tmp_path, entries, len(entries) // 2)
    with store:
        store.adopt_cut(opened.cut.number, opened.hash, raw, heads_of(opened.cut))
        other = Ledger(RUN, [T2.peer_id], [VALIDATOR.peer_id], max_skew_ms=0, history=store.entries)
        with pytest.raises(LedgerStoreError, match="stored cut 1"):
            rebuild(store, other)
