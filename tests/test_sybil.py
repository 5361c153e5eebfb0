"""Sybil identities (issue 13): what a fresh key can get taken at intake before it has history.

Red-team first: each attack here was accepted in full before node/rollouts/quota.py (every batch of
every fresh key was spooled and, without validators, trained). The rule is pure and takes the time
as an argument, so the unit tests drive it directly; the intake tests drive the real trainer
intake (real SQLite spool) and the validator's intake with the time as a number.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from node.config import NodeConfig, RunConfig
from node.engines.model import build_tokenizer
from node.identity import Identity
from node.metrics import Metrics
from node.peers import Peers
from node.rl.config import GRPOConfig
from node.rollouts.quota import QuotaBook, QuotaConfig, allowance, fresh_gain_per_hour, validator_scale
from node.inference.outbox import TRANSIENT_REASONS
from node.trainer.config import TrainerConfig, TrainerSections
from node.trainer.intake import KEEPS_WINDOW, NOT_ATTRIBUTABLE, NOT_STRIKES
from node.trainer.service import Trainer
from node.trainer.spool import open_spool
from node.trainer.testing import FakeLedger, FakeShards, fake_context, fake_wiring, reversal_batch, sign_batch

RUN = "test"
TOK = build_tokenizer()
CFG = QuotaConfig()  # the defaults are what docs/security.md's figures are computed from


# ---------------------------------------------------------------- the pure rule


def test_a_fresh_identity_gets_new_batches_per_interval_and_the_refusal_says_when_to_retry():
    book = QuotaBook(CFG)
    now = 10 * CFG.interval_s + 12.5
    for _ in range(CFG.new_batches):
        assert book.check("w", 0, now) is None
        book.take("w", 0, now)
    refusal = book.check("w", 0, now)
    assert refusal.reason == "quota" and refusal.retry_after_s == CFG.interval_s - 12.5
    assert book.check("w", 0, 11 * CFG.interval_s) is None  # the next interval starts afresh


def test_all_identities_without_history_share_one_pool():
    """However many fresh keys send at one instant, together they get ``new_total`` batches (the
    welcome bucket; tests/test_sybil_pool.py shows how the pool is shared over time)."""
    book = QuotaBook(CFG)
    taken = 0
    for i in range(10 * CFG.new_total):  # ten times more fresh keys than the pool has batches
        while book.check(f"sybil-{i}", 0, 5.0) is None:
            book.take(f"sybil-{i}", 0, 5.0)
            taken += 1
    assert taken == CFG.new_total
    assert book.check("sybil-x", 0, 5.0).reason == "quota-new"
    assert book.check("veteran", 3, 5.0) is None  # a worker with history is not in the pool


def test_allowance_grows_with_accepted_history_and_ends_at_trusted_after():
    assert allowance(0, CFG) == CFG.new_batches
    assert allowance(CFG.new_batches, CFG) == 2 * CFG.new_batches
    assert allowance(CFG.trusted_after - 1, CFG) == CFG.new_batches + CFG.trusted_after - 1
    assert allowance(CFG.trusted_after, CFG) is None
    assert allowance(0, QuotaConfig(new_batches=0)) is None  # quota off
    assert allowance(0, CFG, validator_scale(1)) == 2 * CFG.new_batches


def test_an_honest_worker_that_trains_what_it_sends_doubles_its_allowance_each_interval():
    """The ramp of a new honest worker: every batch it sends trains before the next interval."""
    book = QuotaBook(CFG)
    accepted, per_interval = 0, []
    for k in range(5):
        sent = 0
        while book.check("honest", accepted, k * CFG.interval_s) is None:
            book.take("honest", accepted, k * CFG.interval_s)
            sent += 1
        per_interval.append(sent)
        accepted += sent
    assert per_interval == [16, 32, 64, 128, 256]  # then 496 accepted >= trusted_after: no quota


@pytest.mark.parametrize("workers, stale", [(1, 0.0), (2, 0.0), (2, 0.2), (3, 0.25)])
def test_the_demo_pipeline_never_meets_the_quota(workers, stale):
    """A model of node/app/demo.py's pipeline: the trainer holds at most 12 batches not yet judged
    (``[trainer] max_pending_batches``) and workers fill it as soon as there is room; the validator
    judges about 25 batches a minute, oldest first; a fraction ``stale`` of the judged batches fail
    as stale (no history) and the rest train and count as accepted at once (the trainer's own ledger
    entry). New workers all start at time 0. No batch may meet the quota.

    Stale verdicts use up allowance without adding history: one new worker alone whose batches go
    stale at more than about 4 of 25 per minute meets the quota in its first interval (a transient
    refusal: it retries and the batch is kept), which is why the cases stop at these rates."""
    book = QuotaBook(CFG)
    pending: list[str] = []
    accepted = {f"w{i}": 0 for i in range(workers)}
    stale_due = 0.0
    tick = CFG.interval_s / 25  # one verdict per tick
    for n in range(25 * 30):  # thirty intervals
        now = n * tick
        while len(pending) < 12:  # workers take turns filling the queue
            w = f"w{(n + len(pending)) % workers}"
            assert book.check(w, accepted[w], now) is None, f"{w} refused at {now:.1f}s"
            book.take(w, accepted[w], now)
            pending.append(w)
        w = pending.pop(0)
        stale_due += stale
        if stale_due >= 1:  # this one failed as stale
            stale_due -= 1
        else:
            accepted[w] += 1
    assert book.refused == 0


def test_fresh_gain_per_hour_under_the_defaults():
    """The gain under the defaults for the demo's batches (32 samples: [rl] prompts_per_batch 4 x group_size 8):
    all fresh keys together, the pool's accrual (new_total) and the welcome bucket's refill (new_batches) per interval."""
    gain = fresh_gain_per_hour(CFG, 32)
    assert gain == {"batches": 960, "samples": 30720, "all_new_batches": 4800, "all_new_samples": 153600}


@pytest.mark.parametrize("bad", [{"interval_s": 0.5}, {"new_batches": -1}, {"new_total": 4}, {"trusted_after": -1}])
def test_config_bounds(bad):
    with pytest.raises(ValueError):
        QuotaConfig(**bad).validate()


def test_a_quota_refusal_is_not_now_everywhere():
    for codes in (NOT_STRIKES, NOT_ATTRIBUTABLE, KEEPS_WINDOW, TRANSIENT_REASONS):
        assert {"quota", "quota-new"} <= codes


def test_a_worker_refused_by_the_quota_keeps_its_batch_and_spends_no_attempt():
    from node.rollouts.schema import RolloutAck
    from node.inference.outbox import BatchState, Outbox, Pending

    ob = Outbox(4, max_attempts=2, backoff=1.0, backoff_max=30.0, async_level=2)
    p = Pending(batch_id=b"q" * 32, envelope=b"x", policy_version=0, num_samples=4, created_at=0.0)
    ob.offer(p)
    now = 0.0
    for _ in range(10):  # far more refusals than max_attempts: the batch stays queued
        got = ob.take(["t"], now)
        assert got is not None, "the batch was dropped"
        out = ob.on_ack(p.batch_id, "t", RolloutAck(batch_id=p.batch_id, accepted=False, reason="quota"), now)
        assert out.state is BatchState.QUEUED
        now = ob.blocked_until("t")  # the trainer is backed off meanwhile (1 s, doubling, at most 30 s)
    assert ob.backoff_of("t") == 30.0


# ---------------------------------------------------------------- trainer intake


def _trainer(spool, ledger, clock, remote_ip=lambda peer: "127.0.0.1", **quota):
    node = fake_context(RunConfig(name=RUN), remote_ip=remote_ip)
    policy = SimpleNamespace(step=5, vocab_size=len(TOK), device="cpu")
    wiring = fake_wiring() | {"ledger": ledger}
    sections = TrainerSections(grpo=GRPOConfig(async_level=2, pack_length=64), quota=QuotaConfig(**quota),
                               trainer=TrainerConfig(max_pending_batches=1000, ban_after_strikes=3))
    return Trainer(node, policy, spool, sections, clock=lambda: clock.now, **wiring)


def _batch(ident, step):
    return sign_batch(ident, reversal_batch(ident, RUN, step=step, policy_version=5, tokenizer=TOK))


async def test_a_fresh_identity_flooding_the_trainer_gets_at_most_its_quota(tmp_path: Path):
    clock = SimpleNamespace(now=100.0)
    with open_spool(tmp_path / "spool.sqlite") as spool:
        trainer = _trainer(spool, FakeLedger(), clock)
        sybil = Identity.generate()
        n = 2 * CFG.new_batches
        acks = [await trainer.judge(_batch(sybil, step), sybil.peer_id) for step in range(n)]
        assert sum(a.accepted for a in acks) == CFG.new_batches
        refused = [a for a in acks if not a.accepted]
        assert {a.reason for a in refused} == {"quota"}
        # Not struck, not recorded, not spooled: the worker may send the same batches later.
        assert sybil.peer_id not in trainer.node.peers.table.peers
        assert all(spool.get(a.batch_id) is None for a in refused)
        assert spool.pending() == CFG.new_batches
        clock.now += CFG.interval_s
        assert (await trainer.judge(_batch(sybil, n), sybil.peer_id)).accepted
        assert trainer.status()["quota"]["refused"] == n - CFG.new_batches


async def test_many_fresh_identities_share_the_pool_and_a_worker_with_history_is_unaffected(tmp_path: Path):
    clock = SimpleNamespace(now=100.0)
    veteran = Identity.generate()
    ledger = FakeLedger(accepted={veteran.peer_id: 400 * 64})  # 400 batches of the run's 4 x 16 samples trained
    with open_spool(tmp_path / "spool.sqlite") as spool:
        trainer = _trainer(spool, ledger, clock)
        sybils = [Identity.generate() for _ in range(3 * CFG.new_total // CFG.new_batches)]
        accepted = 0
        for step in range(CFG.new_batches):
            for s in sybils:
                accepted += (await trainer.judge(_batch(s, step), s.peer_id)).accepted
        assert accepted == CFG.new_total
        acks = [await trainer.judge(_batch(veteran, step), veteran.peer_id) for step in range(20)]
        assert all(a.accepted for a in acks)


async def test_sybils_flooding_the_trainer_at_its_own_retry_after_leave_a_newcomer_its_share(tmp_path: Path):
    """Issue 42 hole 3 through the real intake: four fresh keys send until refused and come back
    exactly when ``retry_after_ms`` says; a newcomer arriving a second later is refused only until its
    own share holds a batch (on the pool of fixed intervals it waited for the next interval, and lost)."""
    clock = SimpleNamespace(now=100.0)
    with open_spool(tmp_path / "spool.sqlite") as spool:
        trainer = _trainer(spool, FakeLedger(), clock)
        sybils, step = [Identity.generate() for _ in range(4)], 0
        for s in sybils:
            while (await trainer.judge(_batch(s, step), s.peer_id)).accepted:
                step += 1
        newcomer = Identity.generate()
        clock.now += 1.0
        ack = await trainer.judge(_batch(newcomer, 0), newcomer.peer_id)
        assert not ack.accepted and ack.reason == "quota-new" and ack.retry_after_ms < 10_000
        clock.now += ack.retry_after_ms / 1000 + 0.001
        for s in sybils:  # the Sybils come back at the same moment
            await trainer.judge(_batch(s, step), s.peer_id)
            step += 1
        assert (await trainer.judge(_batch(newcomer, 0), newcomer.peer_id)).accepted


async def test_a_node_signing_every_batch_with_a_new_key_gets_one_addresss_share(tmp_path: Path):
    """The key-making lockout (issue 42 hole 3, left open by per-key sharing): one address, a fresh key
    per batch. Its keys draw on that address's share alone, so a newcomer at another address is
    taken at once; on loopback every key still counts for itself."""
    clock = SimpleNamespace(now=100.0)
    newcomer = Identity.generate()
    where = lambda peer: "198.51.100.9" if peer == newcomer.peer_id else "203.0.113.7"  # noqa: E731
    with open_spool(tmp_path / "spool.sqlite") as spool:
        trainer = _trainer(spool, FakeLedger(), clock, remote_ip=where)
        taken = 0
        for _ in range(2 * CFG.new_total):
            s = Identity.generate()
            taken += (await trainer.judge(_batch(s, 0), s.peer_id)).accepted
        assert taken == CFG.new_batches  # the address's welcome, however many keys
        assert trainer.status()["quota"]["fresh_origins"] == 1
        assert (await trainer.judge(_batch(newcomer, 0), newcomer.peer_id)).accepted


async def test_the_quota_is_a_run_setting(tmp_path: Path):
    clock = SimpleNamespace(now=0.0)
    with open_spool(tmp_path / "spool.sqlite") as spool:
        trainer = _trainer(spool, FakeLedger(), clock, new_batches=2, new_total=2)
        w = Identity.generate()
        acks = [await trainer.judge(_batch(w, step), w.peer_id) for step in range(3)]
        assert [a.accepted for a in acks] == [True, True, False]


# ---------------------------------------------------------------- validator intake


def test_the_validator_backstops_a_trainer_that_lets_too_much_through(tmp_path: Path):
    from node.roles.sections import RunSections
    from node.validator.config import ValidatorSections
    from node.validator.pipeline import BatchRules
    from node.validator.service import ValidatorService
    from node.validator.store import ValidatorStore
    from node.validator import testing as T
    from test_validator_service import _NoTasks, _tiny_batch, held_nowhere

    trainer = Identity.generate().peer_id
    ident = Identity.generate()
    run = RunConfig(name="test", trainers=[trainer], validators=[ident.peer_id], tables={"validator": {"queue_size": 1000}})
    node = SimpleNamespace(config=SimpleNamespace(run=run, role="validator"), identity=ident, peer_id=ident.peer_id,
                           metrics=Metrics(), status={}, data_dir=tmp_path)
    rules = BatchRules(run="test", taskset="synthetic", temperature=1.0, top_p=1.0, max_new_tokens=8,
                       group_size=1, prompts_per_batch=1, async_level=2)
    svc = ValidatorService(node, RunSections.of(run).pick(ValidatorSections), rules, _NoTasks(),
                           ValidatorStore(tmp_path / "v.sqlite"), shards=FakeShards(held=held_nowhere(0)), ledger=FakeLedger())
    sybil = Identity.generate()
    answers = [svc.submit(trainer, T.sign_batch(sybil, _tiny_batch(sybil.peer_id, step)).envelope, 30.0)
               for step in range(40)]
    limit = validator_scale(1) * CFG.new_batches
    assert [a[1:] for a in answers] == [(True, "")] * limit + [(False, "quota")] * (40 - limit)
    assert svc.results["quota"] == 40 - limit


# ---------------------------------------------------------------- the ledger (issue 14 item 6)

from node.ledger.chain import AuthorLimits, Ledger, Outcome  # noqa: E402
from node.ledger.config import LedgerConfig  # noqa: E402
from node.ledger.entries import (  # noqa: E402
    GENESIS,
    CheckpointPublished,
    ReceiptItem,
    Receipts,
    RolloutsJudged,
    make_entry,
)

NOW_MS = 1_700_000_000_000
TRAINER = Identity.from_seed(b"T" * 32)
VALIDATOR = Identity.from_seed(b"V" * 32)
MANIFEST = b"m" * 32
LIMITS = LedgerConfig().limits()


def _chain(ident, bodies, start_ms=NOW_MS, step_ms=1):
    """``ident``'s log of ``bodies`` (seq 1, 2, ...), each entry ``step_ms`` after the previous."""
    out, prev = [], GENESIS
    for i, body in enumerate(bodies):
        se = make_entry(ident, RUN, i + 1, prev, start_ms + i * step_ms, body)
        out.append(se)
        prev = se.hash
    return out


def _receipt(peer, nbytes=1000, manifest=MANIFEST):
    return Receipts(items=(ReceiptItem(peer=peer, manifest_id=manifest, nbytes=nbytes, pieces=1),))


def _trained(worker, samples=32):
    return RolloutsJudged(worker=worker, step=1, accepted=True, samples=samples, tokens=samples, batch_hash=b"h" * 32)


def _ledger():
    return Ledger(RUN, [TRAINER.peer_id], [VALIDATOR.peer_id], 120_000, LIMITS)


def _offer(led, entries):
    """Offer entries until nothing more is accepted (gaps and standing filled in), as anti-entropy
    re-offers what a peer still has; returns the outcomes of the last pass."""
    while True:
        before = len(led)
        last = []
        for se in entries:
            d = led.check(se, NOW_MS)
            if d.outcome is Outcome.ACCEPT:
                led.apply(d)
            last.append(d)
        if len(led) == before:
            return last


def _flood(n_ids=10, per_id=90, backdate=True):
    """The issue's attack: ``n_ids`` fresh keys, each a chain of ``per_id`` receipts vouching for the
    others' bytes, time stamps spaced a minute apart from 1970 (so no rate by time stamp stops it)."""
    ids = [Identity.from_seed(bytes([i + 1]) * 32) for i in range(n_ids)]
    out = []
    for k, ident in enumerate(ids):
        buddy = ids[(k + 1) % n_ids].peer_id
        out += _chain(ident, [_receipt(buddy, 10**6) for _ in range(per_id)],
                      start_ms=0 if backdate else NOW_MS, step_ms=60_000 if backdate else 1)
    return ids, out


def test_900_receipt_entries_from_10_fresh_identities_are_not_stored():
    ids, flood = _flood()
    led = _ledger()
    led_entries = [_chain(TRAINER, [CheckpointPublished(version=1, manifest_id=MANIFEST, total_bytes=10**6)])[0]]
    _offer(led, led_entries + flood)
    assert len(led) == 1 + 10 * LIMITS.unvouched_receipts  # 41 of 901
    refused = [d for d in (led.check(se, NOW_MS) for se in flood) if d.outcome is Outcome.REJECT]
    assert refused and {d.reason for d in refused} == {"author-quota"}
    # ... and they credit nothing: every voucher lacks standing.
    assert all(led.totals(i.peer_id)[i.peer_id]["bytes_served"] == 0 for i in ids)


def test_sybil_receipts_give_no_credit_and_a_voucher_with_standing_does():
    worker = Identity.generate()
    relay = Identity.generate().peer_id
    sybils = [Identity.generate() for _ in range(10)]
    entries = _chain(TRAINER, [CheckpointPublished(version=1, manifest_id=MANIFEST, total_bytes=5000),
                               _trained(worker.peer_id)])
    for s in sybils:
        entries += _chain(s, [_receipt(relay, 5000)])
    led = _ledger()
    _offer(led, entries)
    assert led.totals(relay)[relay]["bytes_served"] == 0  # ten fresh keys: 0 of 50,000 claimed bytes
    _offer(led, _chain(worker, [_receipt(relay, 3000)]))
    assert led.totals(relay)[relay]["bytes_served"] == 0  # a worker with standing: not without evidence (issue 42)
    # A relay a validator's receipts vouch for gets standing too: its own receipts count, and so do
    # the worker's for that checkpoint (the relay demonstrably serves it).
    _offer(led, _chain(VALIDATOR, [_receipt(relay, 5000)]))
    assert led.vouched(relay) and not led.vouched(sybils[0].peer_id)
    assert led.totals(relay)[relay]["bytes_served"] == 5000 + 3000
    # "little": a run may let unvouched receipts count a fraction.
    half = Ledger(RUN, [TRAINER.peer_id], [VALIDATOR.peer_id], 120_000, AuthorLimits(unvouched_credit=0.5))
    _offer(half, entries)
    assert half.totals(relay)[relay]["bytes_served"] == 10 * 5000 // 2  # each voucher's claim, halved


def test_a_worker_with_standing_may_keep_writing_receipts_as_the_run_publishes_checkpoints():
    worker = Identity.generate()
    publishes = [CheckpointPublished(version=v, manifest_id=bytes([v]) * 32, total_bytes=1000) for v in range(10)]
    trainer = _chain(TRAINER, [_trained(worker.peer_id)] + publishes)
    allowed = LIMITS.receipts_burst + LIMITS.receipts_per_checkpoint * 10
    mine = _chain(worker, [_receipt(TRAINER.peer_id, 10, bytes([i % 10]) * 32) for i in range(allowed + 5)])
    led = _ledger()
    _offer(led, trainer + mine)
    assert led.head_of(worker.peer_id) == allowed
    assert led.receipts_left(worker.peer_id) == 0 and led.receipts_left(TRAINER.peer_id) is None


def test_replicas_converge_whatever_order_standing_and_receipts_arrive_in():
    """The limit depends on the entries only: a replica that refused receipts for lack of the
    trainer's entry takes them when they are offered again after it, and ends with the same digest."""
    worker = Identity.generate()
    trainer = _chain(TRAINER, [_trained(worker.peer_id)])
    mine = _chain(worker, [_receipt(TRAINER.peer_id, 10) for _ in range(12)])
    _, flood = _flood(3, 20, backdate=False)
    early, late = _ledger(), _ledger()
    for se in trainer + mine + flood:  # in order
        d = early.check(se, NOW_MS)
        if d.outcome is Outcome.ACCEPT:
            early.apply(d)
    for se in mine:  # receipts before the trainer's entry...
        d = late.check(se, NOW_MS)
        if d.outcome is Outcome.ACCEPT:
            late.apply(d)
    assert late.head_of(worker.peer_id) == LIMITS.unvouched_receipts  # ... only the unvouched allowance
    _offer(late, flood + trainer + mine)  # anti-entropy offers the rest again
    assert late.digest() == early.digest() and late.totals() == early.totals()
    assert late.head_of(worker.peer_id) == 12


async def test_ingest_refuses_and_never_stores_over_quota_entries_and_scores_the_sync_peer(tmp_path: Path):
    """Through the ledger service and its SQLite store: the flood is refused at ingest, not stored,
    and a sync peer that serves such entries (after we took its trusted authors' entries) loses score."""
    from node.ledger.store import open_ledger_store
    from node.ledger.service import PROTOCOL, LedgerService

    metrics = Metrics()
    run = RunConfig(name=RUN, trainers=[TRAINER.peer_id], validators=[VALIDATOR.peer_id])
    me = Identity.generate()
    node = SimpleNamespace(config=NodeConfig(run=run), metrics=metrics, peers=Peers(None, metrics), peer_id=me.peer_id,
                           identity=me, topic=lambda name: f"/swarm/{RUN}/{name}/1")
    with open_ledger_store(tmp_path) as store:
        svc = LedgerService(node, store, run.section("ledger"), wall_clock=lambda: NOW_MS / 1000)
        ids, flood = _flood()
        report = await svc.ingest([se.raw for se in flood], "gossip-test")
        assert report.accepted == 10 * LIMITS.unvouched_receipts
        # Each author's fifth is refused; what follows it cannot link (a gap) and is not stored either.
        assert report.rejected["author-quota"] == 10 and len(report.gaps) == 10
        assert store.count() == report.accepted
        # A sync peer serving the fifth receipt of a fresh author is at fault (an honest one would not hold it).
        sybil = ids[0]
        assert svc.ledger.head_of(sybil.peer_id) == 4
        before = node.peers.table.score("sync-peer", 0.0)
        got = await svc._ingest_range("sync-peer", sybil.peer_id, 5, tuple(se.raw for se in flood[4:8]))
        assert got.rejected["author-quota"] == 1 and store.count() == report.accepted
        assert node.peers.table.score("sync-peer", 0.0) < before
        assert svc.status()["rejected"][f"{PROTOCOL}/author-quota"] == 1


async def test_own_receipts_stop_at_the_allowance_instead_of_failing(tmp_path: Path):
    from node.ledger.store import open_ledger_store
    from node.ledger.service import LedgerService

    metrics = Metrics()
    run = RunConfig(name=RUN, trainers=[TRAINER.peer_id], validators=[VALIDATOR.peer_id])
    me = Identity.generate()
    host = SimpleNamespace(connected_peers=lambda: [], pubsub=SimpleNamespace(publish=_no_publish))
    node = SimpleNamespace(config=NodeConfig(run=run), metrics=metrics, peers=Peers(None, metrics), peer_id=me.peer_id,
                           identity=me, topic=lambda name: f"/swarm/{RUN}/{name}/1", host=host)
    with open_ledger_store(tmp_path) as store:
        svc = LedgerService(node, store, run.section("ledger"), wall_clock=lambda: NOW_MS / 1000)
        written = 0
        for _ in range(LIMITS.unvouched_receipts + 3):
            svc.note_received(TRAINER.peer_id, MANIFEST, 100)
            written += await svc.flush_receipts() is not None
        assert written == LIMITS.unvouched_receipts
        assert svc.status()["rejected"]["receipts/author-quota"] == 3 and svc.status()["pending_receipts"] == 0


async def _no_publish(topic, data):
    return None
