"""Sums of vouched bytes past 64 bits (review of 8202c62, issue 45): a worker with standing can vouch
2^50 bytes per receipt item, 32 items per entry, for one (peer, manifest) again and again within its
quota. The packed per-voucher records once held a signed 64-bit sum: after 256 such entries
``apply()`` raised, after ``check()`` had accepted the entry and gossip had forwarded it, and every
node's receive loop crashed on it. Amounts are exact integers, as Python ints would give."""

from __future__ import annotations

import pytest
from test_ledger_chain import NOW, OTHER, RUN, TRAINER, VALIDATOR, WORKER, Author, add, new_ledger, rollouts

from node.config import NodeConfig, RunConfig
from node.context import NodeContext
from node.ledger.chain import Evidence, Outcome
from node.ledger.config import LedgerConfig
from node.ledger.entries import MAX_RECEIPT_ITEMS, CheckpointPublished, ReceiptItem, Receipts
from node.ledger.service import LedgerService
from node.ledger.store import open_ledger_store, rebuild

BIG = 2**50  # the most one receipt item may carry (entries.ReceiptItem.nbytes)
ENTRIES = 300  # 300 * 32 * 2^50 > 2^63
CHECKPOINTS = 72  # quota: receipts_burst 16 + 4 per checkpoint > ENTRIES
M = b"m" * 32


def trainer_chain():
    """The worker's standing (one trained batch) and enough checkpoints for its quota; M is 2^50 bytes."""
    t = Author(TRAINER)
    return [t.next(rollouts(worker=WORKER)),
            *(t.next(CheckpointPublished(version=v, manifest_id=M if v == 0 else v.to_bytes(32, "big"),
                                         total_bytes=BIG)) for v in range(CHECKPOINTS))]


def huge_receipts():
    """31 items for the trainer and one for the validator (both count in full), all on M."""
    items = (ReceiptItem(peer=TRAINER.peer_id, manifest_id=M, nbytes=BIG, pieces=1),) * (MAX_RECEIPT_ITEMS - 1)
    body = Receipts(items=(*items, ReceiptItem(peer=VALIDATOR.peer_id, manifest_id=M, nbytes=BIG, pieces=1)))
    w = Author(WORKER)
    return [w.next(body) for _ in range(ENTRIES)], w


def expected_served(entries: int) -> dict[str, int]:
    """bytes_served as Python ints give it: the worker's claims scaled down to M's size, in proportion."""
    claimed = entries * MAX_RECEIPT_ITEMS * BIG
    return {TRAINER.peer_id: entries * (MAX_RECEIPT_ITEMS - 1) * BIG * BIG // claimed,
            VALIDATOR.peer_id: entries * BIG * BIG // claimed}


def served(led) -> dict[str, int]:
    tot = led.totals()
    return {p: tot[p]["bytes_served"] for p in (TRAINER.peer_id, VALIDATOR.peer_id)}


def test_vouched_sums_past_64_bits_are_exact_and_unwind():
    led = new_ledger()
    for se in trainer_chain():
        assert add(led, se).outcome is Outcome.ACCEPT
    chain, w = huge_receipts()
    for se in chain:
        assert add(led, se).outcome is Outcome.ACCEPT  # raised struct.error at entry 256
    assert led.head_of(WORKER.peer_id) == ENTRIES
    assert served(led) == expected_served(ENTRIES)
    # the worker equivocates at seq 101: entries 101.. are unwound, past 2^63 downwards
    w.seq, w.prev = 100, chain[99].hash
    other = w.next(Receipts(items=(ReceiptItem(peer=OTHER.peer_id, manifest_id=M, nbytes=1, pieces=1),)))
    assert led.add_evidence(Evidence(chain[100], other)) is True
    assert served(led) == expected_served(100)
    assert led.totals(WORKER.peer_id)[WORKER.peer_id]["entries"] == 100


async def test_a_replica_ingests_and_rebuilds_sums_past_64_bits(tmp_path):
    """The crash as a node met it: ingest raised, the replica's head and the store diverged."""
    run = RunConfig(name=RUN, trainers=[TRAINER.peer_id], validators=[VALIDATOR.peer_id])
    node = NodeContext(NodeConfig(data_dir=str(tmp_path), run=run), OTHER, host=None, data_dir=tmp_path)
    chain, _ = huge_receipts()
    with open_ledger_store(tmp_path) as store:
        svc = LedgerService(node, store, LedgerConfig(), wall_clock=lambda: NOW / 1000)
        await svc.ingest([se.raw for se in trainer_chain()], "test")
        report = await svc.ingest([se.raw for se in chain], "test")
        assert svc.ledger.head_of(WORKER.peer_id) == ENTRIES, report
        assert served(svc.ledger) == expected_served(ENTRIES)
        fresh = svc.ledger.__class__(svc.ledger.run, svc.ledger.trainers, svc.ledger.validators,
                                     svc.ledger.max_skew_ms, svc.ledger.limits, history=store.entries)
        assert rebuild(store, fresh) == {}
        assert served(fresh) == expected_served(ENTRIES)


def test_an_entry_whose_crediting_raises_is_not_half_taken_in(monkeypatch):
    """Defence in depth: were crediting to raise again (our bug), the replica's head must not move
    past an entry whose credit it never counted (the hash was appended first)."""
    led = new_ledger()
    t = Author(TRAINER)
    add(led, t.next(rollouts(worker=WORKER)))
    d = led.check(t.next(rollouts(worker=WORKER)), NOW)

    def broken(*_):
        raise OverflowError("a bug in crediting")

    monkeypatch.setattr(led, "_credit", broken)
    with pytest.raises(OverflowError):
        led.apply(d)
    monkeypatch.undo()
    assert led.head_of(TRAINER.peer_id) == 1
    assert led.check(d.entry, NOW).outcome is Outcome.ACCEPT  # and it can be taken in once fixed
