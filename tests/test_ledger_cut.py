"""Ledger cuts (node/ledger/cut.py, issue 46 item 4): a trainer-signed state that later entries build on.

A replica based on a cut and fed the entries above it reaches the digest and totals of a replica that
saw the whole history and took the same cut; with nothing closed that is the history's own totals; a
replica holding the history refuses a cut that disagrees with it; only a trainer's cut of this run,
newer than ours, opens; a batch closed by a cut counts nothing when re-recorded above it; a fork is
provable below a cut and leaves the cut's totals standing; and a cut's size follows the peers, not the
history. Pure: no I/O, no clock.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from node import hashes
from node.identity import Identity
from node.ledger.chain import Evidence, Ledger, Outcome
from node.ledger.cut import (
    Cut,
    CutBatch,
    CutPublished,
    cut_problem,
    ledger_from_cut,
    make_cut,
    open_cut,
    rebase,
    replay_to,
    sign_cut,
)
from node.ledger.entries import (
    GENESIS,
    TOTAL_FIELDS,
    CheckpointPublished,
    Penalty,
    ReceiptItem,
    Receipts,
    RolloutsJudged,
    Verdict,
    make_entry,
)
from node.wire import RemoteProtocolError, encode

RUN = "cut-run"
NOW = 1_700_000_000_000  # ms
T1, T2 = Identity.from_seed(b"T" * 32), Identity.from_seed(b"U" * 32)
VALIDATOR = Identity.from_seed(b"V" * 32)
WORKERS = [Identity.from_seed(bytes([0x40 + i]) * 32) for i in range(5)]
FORKER = WORKERS[4]  # signs two receipts at one seq in histories with a fork
FRESH = Identity.from_seed(b"F" * 32)  # a key without standing that vouches for a worker
BANNED = Identity.from_seed(b"X" * 32)


def new_ledger() -> Ledger:
    return Ledger(RUN, [T1.peer_id, T2.peer_id], [VALIDATOR.peer_id], max_skew_ms=0)


class Writer:
    """Signs entries in each author's chain, in time order."""

    def __init__(self) -> None:
        self.heads: dict[str, tuple[int, bytes]] = {}
        self.out: list = []

    def add(self, author: Identity, body, *, fork: bool = False):
        seq, prev = self.heads.get(author.peer_id, (0, GENESIS))
        se = make_entry(author, RUN, seq + 1, prev, NOW - 10_000_000 + len(self.out), body)
        if not fork:
            self.heads[author.peer_id] = (se.seq, se.hash)
        self.out.append(se)
        return se


def manifest(step: int) -> bytes:
    return hashes.digest(b"cut-manifest %d" % step)


def batch(step: int, i: int) -> bytes:
    return hashes.digest(b"cut-batch %d %d" % (step, i))


DRAW = [0, 450, 37, 1200, 9]  # each worker's draw steps are its own counter (node/rollouts/steps.py)


def draw(step: int, i: int) -> int:
    """Worker i's draw step for its batch of the run's ``step``."""
    return DRAW[i] + step


def history(steps: int, seed: int, fork_at: int | None = None) -> list:
    """A run's entries: each step a checkpoint, every worker's batch judged by T1 and verified (some
    failed, some rejected), some batches recorded again by T2 two steps later with another count, the
    workers' receipts for the checkpoint from their neighbours, the validator's from worker 0, a fresh
    key's for worker 1, a ban; FORKER signs two receipts at one seq at step ``fork_at``."""
    rng = random.Random(seed)
    w = Writer()
    late = []
    for step in range(steps):
        w.add(T1, CheckpointPublished(version=step, manifest_id=manifest(step), total_bytes=1 << 20))
        for s, i, samples in [x for x in late if x[0] == step - 2]:
            w.add(T2, RolloutsJudged(worker=WORKERS[i].peer_id, step=draw(s, i), accepted=True, samples=samples, tokens=64,
                                     batch_hash=batch(s, i)))
        for i, worker in enumerate(WORKERS):
            ok = step == 0 or rng.random() > 0.2  # every worker has standing for its receipts
            samples = rng.choice((4, 8))
            w.add(VALIDATOR, Verdict(worker=worker.peer_id, step=draw(step, i), batch_hash=batch(step, i), ok=ok,
                                     reasons=("x",)))
            w.add(T1, RolloutsJudged(worker=worker.peer_id, step=draw(step, i), accepted=ok, samples=samples,
                                     tokens=10 * samples,
                                     batch_hash=batch(step, i)))
            if ok and rng.random() < 0.3:
                late.append((step, i, rng.choice((2, 12))))
        for i, worker in enumerate(WORKERS):
            peer = WORKERS[(i + 1) % len(WORKERS)].peer_id
            body = Receipts(items=(ReceiptItem(peer=peer, manifest_id=manifest(step), nbytes=1 << 18, pieces=1),))
            if worker is FORKER and step == fork_at:
                w.add(worker, Receipts(items=(ReceiptItem(peer=peer, manifest_id=manifest(step), nbytes=1 << 19,
                                                          pieces=2),)), fork=True)
            w.add(worker, body)
        w.add(VALIDATOR, Receipts(items=(ReceiptItem(peer=WORKERS[0].peer_id, manifest_id=manifest(step),
                                                     nbytes=1 << 19, pieces=1),)))
        if step == 1:
            w.add(VALIDATOR, Penalty(peer=BANNED.peer_id, reason="cheat", points=3, ban_seconds=86400))
            w.add(FRESH, Receipts(items=(ReceiptItem(peer=WORKERS[1].peer_id, manifest_id=manifest(step),
                                                     nbytes=1 << 10, pieces=1),)))
    return w.out


def deliver(ledger: Ledger, entries, now=NOW) -> list:
    """Take in ``entries`` as anti-entropy would (what fits, again until nothing more does); a
    conflicting entry becomes evidence. Returns the entries no round took."""
    pending = list(entries)
    for _round in range(len(pending) + 1):
        left = []
        for se in pending:
            d = ledger.check(se, now)
            if d.outcome is Outcome.ACCEPT:
                ledger.apply(d)
            elif d.outcome is Outcome.EQUIVOCATION:
                stored = next(iter(ledger.history(se.author, d.conflict_seq, d.conflict_seq)))
                ledger.add_evidence(Evidence(stored, se))
            elif d.outcome in (Outcome.GAP, Outcome.REJECT) and d.reason in ("gap", "author-quota"):
                left.append(se)
        if len(left) == len(pending):
            return left
        pending = left
    return pending


def above(cut: Cut, entries) -> list:
    heads = {log.author: log.seq for log in cut.logs}
    return [se for se in entries if se.seq > heads.get(se.author, 0)]


def state(ledger: Ledger) -> tuple:
    return ledger.digest(), ledger.totals(), ledger.flagged(), ledger.bans(NOW)


def opened(cut: Cut, ledger: Ledger, signer=T1):
    return open_cut(sign_cut(signer, cut), ledger)


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), steps=st.integers(3, 7), split=st.floats(0.1, 0.95),
       keep=st.integers(1, 9), fork=st.one_of(st.none(), st.integers(0, 6)))
def test_a_replica_from_a_cut_and_the_entries_above_reaches_the_whole_historys_state(seed, steps, split, keep, fork):
    entries = history(steps, seed, fork_at=fork)
    k = int(len(entries) * split)
    maker = new_ledger()
    assert deliver(maker, entries[:k]) == []
    cut = make_cut(maker, time_ms=NOW, keep_versions=keep, keep_steps=keep)
    whole = new_ledger()
    assert deliver(whole, entries) == []

    # a replica that holds the history (here ahead of the cut) finds the cut right
    replayed = replay_to(cut, new_ledger(), whole.history)
    assert cut_problem(cut, replayed) is None

    # a new node: the cut, then the entries above it in any order, and the evidence gossip brings
    sealed = opened(cut, new_ledger())
    fresh = ledger_from_cut(sealed, new_ledger())
    rest = above(cut, entries)
    random.Random(seed).shuffle(rest)
    left = deliver(fresh, rest)  # only a forker's other branch, when the cut took the first: off-cut
    assert {se.author for se in left} <= set(whole.flagged())
    for author in whole.flagged():
        fresh.add_evidence(whole.evidence(author))
    based = rebase(whole, sealed)
    assert state(fresh) == state(based)
    assert based.cut_number == fresh.cut_number == 1 and based.cut_hash == fresh.cut_hash == sealed.hash

    # nothing closed (every worker's open step at or below its first draw step) and no fork found below
    # the cut after it: the history's own totals, exactly
    late_fork = any(f <= next((log.seq for log in cut.logs if log.author == a), 0) and not any(
        log.author == a and log.fork_seq for log in cut.logs) for a, f in whole.flagged().items())
    first_draw = {w.peer_id: draw(0, i) for i, w in enumerate(WORKERS)}
    if cut.open_version == 0 and all(r.open_step <= first_draw.get(r.peer, 0) for r in cut.rows) and not late_fork:
        assert state(based) == state(whole)


def test_two_replicas_with_the_same_entries_in_other_orders_sign_the_same_cut():
    entries = history(4, seed=7, fork_at=2)
    a, b = new_ledger(), new_ledger()
    deliver(a, entries)
    shuffled = list(entries)
    random.Random(3).shuffle(shuffled)
    deliver(b, shuffled)
    cuts = [make_cut(r, time_ms=NOW, keep_versions=2, keep_steps=2) for r in (a, b)]
    assert sign_cut(T1, cuts[0]) == sign_cut(T1, cuts[1])


def test_cuts_chain_and_a_second_cut_is_checked_from_the_first():
    entries = history(6, seed=1)
    third = len(entries) // 3
    maker = new_ledger()
    deliver(maker, entries[:third])
    first = opened(make_cut(maker, time_ms=NOW, keep_versions=2, keep_steps=2), maker)
    maker = rebase(maker, first)
    deliver(maker, entries[third:2 * third])
    second_cut = make_cut(maker, time_ms=NOW, keep_versions=2, keep_steps=2)
    assert (second_cut.number, second_cut.prev) == (2, first.hash)
    # a replica based on the first cut checks the second from its own entries between the two
    holder = rebase(new_ledger(), first)
    deliver(holder, above(first.cut, entries))
    assert cut_problem(second_cut, replay_to(second_cut, ledger_from_cut(first, holder), holder.history)) is None
    second = open_cut(sign_cut(T2, second_cut), holder)  # any trainer of the run
    fresh = ledger_from_cut(second, new_ledger())
    deliver(fresh, above(second_cut, entries))
    assert state(fresh) == state(rebase(holder, second))
    with pytest.raises(RemoteProtocolError) as e:
        open_cut(sign_cut(T1, first.cut), fresh)
    assert e.value.reason == "old-cut"


def test_a_replica_holding_the_history_refuses_a_cut_whose_totals_disagree():
    entries = history(4, seed=2)
    honest = new_ledger()
    deliver(honest, entries)
    cut = make_cut(honest, time_ms=NOW, keep_versions=2, keep_steps=2)
    i = next(i for i, r in enumerate(cut.rows) if r.peer == WORKERS[0].peer_id)
    field = TOTAL_FIELDS.index("rollouts_accepted")
    inflated = cut.rows[i].totals[:field] + (cut.rows[i].totals[field] + 1000,) + cut.rows[i].totals[field + 1:]
    wrong = dataclasses.replace(cut, rows=cut.rows[:i] + (dataclasses.replace(cut.rows[i], totals=inflated),)
                                + cut.rows[i + 1:])
    sealed = opened(wrong, honest)  # a trainer's signature opens; only the history can say it is wrong
    assert cut_problem(sealed.cut, replay_to(sealed.cut, new_ledger(), honest.history)) == "rows-differ"
    # a closed batch's claims dropped, a ban left out: each caught
    assert cut_problem(dataclasses.replace(cut, batches=cut.batches[1:]),
                       replay_to(cut, new_ledger(), honest.history)) == "batches-differ"
    assert cut_problem(dataclasses.replace(cut, bans=()), replay_to(cut, new_ledger(), honest.history)) == "bans-differ"
    # a cut that reopens versions its base closed, or that follows a cut we have not taken
    first = opened(cut, honest)
    based = rebase(honest, first)
    reopen = make_cut(based, time_ms=NOW, keep_versions=9, keep_steps=9)
    assert reopen.open_version == first.cut.open_version  # never below the base's
    assert [r.open_step for r in reopen.rows] == [r.open_step for r in first.cut.rows]
    for changed in (dataclasses.replace(reopen, open_version=0),
                    dataclasses.replace(reopen, rows=tuple(dataclasses.replace(r, open_step=0) for r in reopen.rows))):
        assert cut_problem(changed, replay_to(changed, ledger_from_cut(first, honest), honest.history)) == "reopens"
    skipped = dataclasses.replace(make_cut(based, time_ms=NOW, keep_versions=2, keep_steps=2), number=3,
                                  prev=bytes(range(32)))
    assert cut_problem(skipped, replay_to(skipped, ledger_from_cut(first, honest), honest.history)) == "other-base"
    # a replica missing entries the cut covers is behind, not wronged
    behind = new_ledger()
    deliver(behind, entries[: len(entries) // 2])
    assert replay_to(cut, new_ledger(), behind.history) == "behind"


def test_a_batch_closed_by_the_cut_counts_nothing_when_claimed_again_above_it():
    entries = history(5, seed=3)
    maker = new_ledger()
    deliver(maker, entries)
    cut = make_cut(maker, time_ms=NOW, keep_versions=2, keep_steps=2)
    assert cut.open_version == 3
    assert {r.peer: r.open_step for r in cut.rows if r.open_step} == {w.peer_id: draw(3, i) for i, w in enumerate(WORKERS)}
    fresh = ledger_from_cut(opened(cut, maker), new_ledger())
    worker = WORKERS[0].peer_id
    before = fresh.totals(worker)[worker]
    w = Writer()
    w.heads = {log.author: (log.seq, log.hash) for log in cut.logs}
    w.out = [None] * len(entries)  # time stamps after the history's
    old = w.add(T2, RolloutsJudged(worker=worker, step=draw(0, 0), accepted=True, samples=1 << 20, tokens=1 << 30,
                                   batch_hash=batch(0, 0)))
    again = w.add(VALIDATOR, Verdict(worker=worker, step=draw(1, 0), batch_hash=batch(1, 0), ok=False, reasons=("x",)))
    assert deliver(fresh, [old, again]) == []
    after = fresh.totals(worker)[worker]
    assert after == before  # closed versions: the entries join the chain, their claims count nothing
    # a batch of an open version is still counted once, at its largest claim
    open_batch = w.add(T2, RolloutsJudged(worker=worker, step=draw(4, 0), accepted=True, samples=1, tokens=1,
                                          batch_hash=batch(4, 0)))
    deliver(fresh, [open_batch])
    assert fresh.totals(worker)[worker] == after
    bigger = w.add(T2, RolloutsJudged(worker=worker, step=draw(4, 0), accepted=True, samples=100, tokens=1000,
                                      batch_hash=batch(4, 0)))
    deliver(fresh, [bigger])
    prior = max(se.body.samples for se in entries if se.kind == RolloutsJudged.TYPE
                and se.body.batch_hash == batch(4, 0) and se.body.accepted)
    assert fresh.totals(worker)[worker]["rollouts_accepted"] - after["rollouts_accepted"] == 100 - prior > 0


def test_only_a_trainers_cut_of_this_run_opens():
    ledger = new_ledger()
    entries = history(2, seed=4)
    deliver(ledger, entries)
    cut = make_cut(ledger, time_ms=NOW, keep_versions=1, keep_steps=1)
    for signer, reason in ((VALIDATOR, "unauthorized"), (WORKERS[0], "unauthorized")):
        with pytest.raises(RemoteProtocolError) as e:
            opened(cut, ledger, signer)
        assert e.value.reason == reason
    with pytest.raises(RemoteProtocolError) as e:
        opened(dataclasses.replace(cut, run="an-older-run"), ledger)
    assert e.value.reason == "wrong-run"
    raw = bytearray(sign_cut(T1, cut))
    raw[raw.index(WORKERS[0].peer_id.encode()) + 5] ^= 1  # inside the signed payload
    with pytest.raises(RemoteProtocolError):
        open_cut(bytes(raw), ledger)
    with pytest.raises(RemoteProtocolError):
        open_cut(encode(cut), ledger)  # not sealed at all
    swapped = dataclasses.replace(cut, rows=(cut.rows[1], cut.rows[0]) + cut.rows[2:])
    with pytest.raises(RemoteProtocolError) as e:
        opened(swapped, ledger)
    assert e.value.reason == "unsorted-cut"
    bad_index = dataclasses.replace(cut, batches=(CutBatch(batch=bytes(32), claims=b"\xff" * 4 + bytes(21)),))
    with pytest.raises(RemoteProtocolError) as e:
        ledger_from_cut(opened(bad_index, ledger), new_ledger())
    assert e.value.reason == "malformed-cut"
    half_evidence = dataclasses.replace(cut, logs=(dataclasses.replace(cut.logs[0], fork_seq=1,
                                                                       evidence=(entries[0].raw,)),) + cut.logs[1:])
    with pytest.raises(RemoteProtocolError) as e:
        ledger_from_cut(opened(half_evidence, ledger), new_ledger())
    assert e.value.reason == "malformed-cut"
    lying_digest = dataclasses.replace(cut, digest=bytes(32))
    with pytest.raises(RemoteProtocolError) as e:
        ledger_from_cut(opened(lying_digest, ledger), new_ledger())
    assert e.value.reason == "malformed-cut"


def test_a_fork_is_provable_below_a_cut_and_the_cuts_totals_stand():
    w = Writer()
    w.add(T1, CheckpointPublished(version=0, manifest_id=manifest(0), total_bytes=1 << 20))
    w.add(T1, RolloutsJudged(worker=FORKER.peer_id, step=0, accepted=True, samples=8, tokens=80, batch_hash=batch(0, 4)))
    peer = WORKERS[0].peer_id
    branch_a = [w.add(FORKER, Receipts(items=(ReceiptItem(peer=peer, manifest_id=manifest(0), nbytes=n, pieces=1),)))
                for n in (100, 200)]
    other = make_entry(FORKER, RUN, 2, branch_a[0].hash, branch_a[1].time_ms, Receipts(
        items=(ReceiptItem(peer=peer, manifest_id=manifest(0), nbytes=999, pieces=1),)))
    maker = new_ledger()
    deliver(maker, w.out)
    cut = make_cut(maker, time_ms=NOW, keep_versions=1, keep_steps=1)
    fresh = ledger_from_cut(opened(cut, maker), new_ledger())
    totals = fresh.totals()
    # the pruned replica cannot judge entries at or below the cut itself ...
    assert fresh.check(other, NOW).reason == "below-cut"
    assert fresh.check(branch_a[1], NOW).outcome is Outcome.DUPLICATE
    # ... but the pair is evidence whoever holds it: flagged from then on, the cut's totals stand
    assert fresh.add_evidence(Evidence(branch_a[1], other)) is True
    assert fresh.flagged() == {FORKER.peer_id: 2}
    assert fresh.totals() == totals
    more = w.add(FORKER, Receipts(items=(ReceiptItem(peer=peer, manifest_id=manifest(0), nbytes=5, pieces=1),)))
    assert fresh.check(more, NOW).reason == "equivocator"
    # an entry right above the cut that does not chain onto the cut's head is refused, not taken as a fork
    off = make_entry(WORKERS[1], RUN, 1, GENESIS, NOW - 1, Receipts(
        items=(ReceiptItem(peer=peer, manifest_id=manifest(0), nbytes=5, pieces=1),)))
    off_cut = make_entry(FORKER, RUN, 3, bytes(32), NOW - 1, Receipts(
        items=(ReceiptItem(peer=peer, manifest_id=manifest(0), nbytes=5, pieces=1),)))
    honest = ledger_from_cut(opened(cut, maker), new_ledger())
    assert honest.check(off_cut, NOW).reason == "off-cut"
    assert honest.check(off, NOW).outcome is not Outcome.EQUIVOCATION


def test_a_cut_grows_with_the_peers_not_with_the_history():
    sizes = {}
    for steps in (3, 12):
        ledger = new_ledger()
        entries = history(steps, seed=5)
        deliver(ledger, entries)
        sizes[steps] = (len(sign_cut(T1, make_cut(ledger, time_ms=NOW, keep_versions=2, keep_steps=2))),
                        sum(len(se.raw) for se in entries))
    (cut_small, raw_small), (cut_big, raw_big) = sizes[3], sizes[12]
    assert raw_big > 3.5 * raw_small
    assert cut_big < 1.1 * cut_small  # the same peers, the same window: wider integers at most


def test_a_cut_larger_than_one_frame_is_signed_opened_and_loaded():
    """A thousand workers' open claims make a cut of several MiB (bench/ledger.py --scale: 10-12 MB),
    more than the 4 MiB one frame (and a plain Envelope) holds: the cutter raised out of its loop and
    ended the node, again at each restart."""
    ledger = new_ledger()
    deliver(ledger, history(2, seed=4))
    cut = make_cut(ledger, time_ms=NOW, keep_versions=1, keep_steps=1)
    rng = random.Random(7)
    extra = tuple(CutPublished(manifest=rng.randbytes(32), version=10**6 + i, size=1 << 20, entries=1)
                  for i in range(90_000))  # ~5 MiB of open versions' published sizes
    big = dataclasses.replace(cut, published=tuple(sorted(cut.published + extra, key=lambda p: (p.manifest, p.version))))
    raw = sign_cut(T1, big)
    assert len(raw) > 4 * 1024 * 1024
    got = open_cut(raw, ledger)
    assert got.cut == big and got.signer == T1.peer_id
    assert ledger_from_cut(got, new_ledger()).digest() == ledger.digest()


def test_a_cut_signed_by_a_stranger_is_refused_before_its_payload_is_decoded(monkeypatch):
    """Anyone can sign megabytes of schema-valid junk with its own key: the signer is checked first."""
    import node.wire

    ledger = new_ledger()
    deliver(ledger, history(2, seed=4))
    raw = sign_cut(WORKERS[0], make_cut(ledger, time_ms=NOW, keep_versions=1, keep_steps=1))
    decoded = []
    real = node.wire.Envelope.open_as
    monkeypatch.setattr(node.wire.Envelope, "open_as", lambda self, *a, **k: decoded.append(1) or real(self, *a, **k))
    with pytest.raises(RemoteProtocolError) as e:
        open_cut(raw, ledger)
    assert e.value.reason == "unauthorized" and not decoded
