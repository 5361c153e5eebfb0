"""Ledger summaries (node/ledger/summary.py, issue 46 item 4): the rows say what the replica says,
equal replicas sign equal bytes, only a trainer's signature opens, a node with the history catches a
wrong summary, and the size follows the peers, not the entries (pure: no I/O, no clock)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from node.identity import Identity
from node.ledger.chain import Ledger, Outcome
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
from node.ledger.summary import Summary, open_summary, sign_summary, summarise, summary_problem
from node.wire import RemoteProtocolError, encode

RUN = "summary-run"
NOW = 1_700_000_000_000  # ms
TRAINER = Identity.from_seed(b"T" * 32)
VALIDATOR = Identity.from_seed(b"V" * 32)
WORKERS = [Identity.from_seed(bytes([0x40 + i]) * 32) for i in range(5)]
BANNED = Identity.from_seed(b"X" * 32)  # credited (penalised, banned) but authors nothing


def new_ledger() -> Ledger:
    return Ledger(RUN, [TRAINER.peer_id], [VALIDATOR.peer_id], max_skew_ms=0)


def history(steps: int) -> list:
    """``steps`` training steps as a run writes them: a checkpoint, each worker's batch judged and
    verified (worker 1's first one rejected), each worker's receipt for the checkpoint from its
    neighbour and the validator's from worker 0; one penalty with a ban."""
    heads: dict[str, tuple[int, bytes]] = {}
    out = []

    def add(author, body):
        seq, prev = heads.get(author.peer_id, (0, GENESIS))
        se = make_entry(author, RUN, seq + 1, prev, NOW - 10_000_000 + len(out), body)
        heads[author.peer_id] = (se.seq, se.hash)
        out.append(se)

    for step in range(steps):
        manifest = step.to_bytes(32, "big")
        add(TRAINER, CheckpointPublished(version=step, manifest_id=manifest, total_bytes=1 << 20))
        for i, w in enumerate(WORKERS):
            batch = (1000 * step + i).to_bytes(32, "big")
            ok = (i, step) != (1, 0)
            add(VALIDATOR, Verdict(worker=w.peer_id, step=step, batch_hash=batch, ok=ok, reasons=("ok",)))
            add(TRAINER, RolloutsJudged(worker=w.peer_id, step=step, accepted=ok, samples=8, tokens=80 + i,
                                        batch_hash=batch))
            neighbour = WORKERS[(i + 1) % len(WORKERS)]
            add(w, Receipts(items=(ReceiptItem(peer=neighbour.peer_id, manifest_id=manifest, nbytes=1 << 18, pieces=1),)))
        add(VALIDATOR, Receipts(items=(ReceiptItem(peer=WORKERS[0].peer_id, manifest_id=manifest, nbytes=1 << 19,
                                                   pieces=1),)))
        if step == 0:
            add(VALIDATOR, Penalty(peer=BANNED.peer_id, reason="cheat", points=3, ban_seconds=86400))
    return out


def replica(entries) -> Ledger:
    ledger = new_ledger()
    for se in entries:
        decision = ledger.check(se, NOW)
        assert decision.outcome is Outcome.ACCEPT, decision.reason
        ledger.apply(decision)
    return ledger


def test_the_rows_say_what_the_replica_says():
    ledger = replica(history(4))
    summary = summarise(ledger, NOW)
    totals = ledger.totals()
    assert [r.peer for r in summary.rows] == sorted(set(ledger.authors()) | {BANNED.peer_id})
    for row in summary.rows:
        assert row.totals_dict() == ledger.totals(row.peer)[row.peer]
        assert summary.row(row.peer) is row
    assert summary.row(WORKERS[1].peer_id).totals_dict()["rollouts_rejected"] == 8
    assert summary.row(WORKERS[0].peer_id).totals_dict()["bytes_served"] == totals[WORKERS[0].peer_id]["bytes_served"] > 0
    heads = {h.author: h for h in ledger.heads()}
    for author, head in heads.items():
        row = summary.row(author)
        assert (row.seq, row.hash, row.fork_seq) == (head.seq, head.hash, head.fork_seq)
        assert row.last_time_ms == ledger.last_time_ms(author)
    banned = summary.row(BANNED.peer_id)
    assert (banned.seq, banned.hash) == (0, GENESIS)
    assert banned.ban_until_ms == ledger.ban_of(BANNED.peer_id, NOW).until_ms
    assert summary.digest == ledger.digest()
    assert summary.row("no-such-peer") is None
    # judged a day later, the ban is over
    assert summarise(ledger, NOW + 2 * 86_400_000).row(BANNED.peer_id).ban_until_ms == 0


HISTORY = history(3)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(min_value=0, max_value=2**32 - 1))
def test_replicas_that_got_the_entries_in_other_orders_sign_the_same_bytes(seed):
    entries = HISTORY
    shuffled = list(entries)
    random.Random(seed).shuffle(shuffled)
    other = new_ledger()
    pending = shuffled
    for _round in range(len(entries)):  # deliver what fits, retry the rest (gaps), as anti-entropy would
        if not pending:
            break
        left = []
        for se in pending:
            decision = other.check(se, NOW)
            if decision.outcome is Outcome.ACCEPT:
                other.apply(decision)
            else:
                left.append(se)
        pending = left
    assert not pending
    a, b = summarise(replica(entries), NOW), summarise(other, NOW)
    assert encode(a) == encode(b)
    assert sign_summary(TRAINER, a) == sign_summary(TRAINER, b)  # Ed25519 is deterministic


def test_a_new_node_opens_only_a_trainers_summary_of_its_run():
    summary = summarise(replica(history(2)), NOW)
    trainers = {TRAINER.peer_id}
    signer, opened = open_summary(sign_summary(TRAINER, summary), RUN, trainers)
    assert (signer, opened) == (TRAINER.peer_id, summary)
    with pytest.raises(RemoteProtocolError) as e:
        open_summary(sign_summary(VALIDATOR, summary), RUN, trainers)
    assert e.value.reason == "unauthorized"
    with pytest.raises(RemoteProtocolError) as e:
        open_summary(sign_summary(TRAINER, summary), "another-run", trainers)
    assert e.value.reason == "wrong-run"
    swapped = Summary(run=summary.run, time_ms=summary.time_ms, digest=summary.digest,
                      rows=(summary.rows[1], summary.rows[0]) + summary.rows[2:])
    with pytest.raises(RemoteProtocolError) as e:
        open_summary(sign_summary(TRAINER, swapped), RUN, trainers)
    assert e.value.reason == "unsorted-rows"  # Summary.row() looks peers up by bisection
    raw = bytearray(sign_summary(TRAINER, summary))
    at = raw.index(WORKERS[0].peer_id.encode()) + 10  # inside a row of the signed payload
    raw[at] ^= 1
    with pytest.raises(RemoteProtocolError) as e:
        open_summary(bytes(raw), RUN, trainers)
    assert e.value.reason == "bad-signature"


def test_a_node_with_the_history_catches_a_summary_that_sums_wrongly():
    ledger = replica(history(3))
    honest = summarise(ledger, NOW)
    assert summary_problem(honest, ledger) is None
    victim = WORKERS[2].peer_id
    rows = tuple(r if r.peer != victim else
                 type(r)(**{**r.__dict__, "totals": tuple(v + (f == "rollouts_accepted") for f, v in zip(TOTAL_FIELDS, r.totals))})
                 for r in honest.rows)
    inflated = Summary(run=honest.run, time_ms=honest.time_ms, digest=honest.digest, rows=rows)
    assert summary_problem(inflated, ledger) == f"row-differs:{victim}"
    dropped = Summary(run=honest.run, time_ms=honest.time_ms, digest=honest.digest,
                      rows=tuple(r for r in honest.rows if r.peer != BANNED.peer_id))
    assert summary_problem(dropped, ledger) == f"row-differs:{BANNED.peer_id}"  # a ban left out
    behind = replica(history(2))
    assert summary_problem(honest, behind) == "other-cut"  # not wrong: another cut


def test_a_summary_grows_with_the_peers_not_the_history():
    short = len(encode(summarise(replica(history(2)), NOW)))
    long_ = len(encode(summarise(replica(history(40)), NOW)))
    entries = len(history(40))
    assert long_ - short < 5 * len(WORKERS) + 40  # a few wider integers per row, nothing per entry
    assert long_ < entries * 10  # 40 steps are ~670 entries of ~500 bytes each; the summary is a few rows
