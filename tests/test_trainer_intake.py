"""Trainer intake: every refusal reason, replay filtering, and acks that survive kill -9."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

from node.config import RunConfig
from node.identity import Identity
from node.engines.model import build_tokenizer
from node.rl.config import GRPOConfig
from node.rollouts.schema import MAX_BATCH_BYTES, open_batch
from node.trainer.config import TrainerConfig, TrainerSections
from node.peers import FaultRule, PeerTable
from node.trainer.intake import NOT_STRIKES, IntakeLimits, expired, intake_reason, staleness_reason, trainable_until
from node.trainer.service import Trainer
from node.trainer.spool import BatchState, SpoolError, open_spool
from node.trainer.testing import fake_context, fake_wiring, reversal_batch, sign_batch
from node.wire import Envelope, decode_as, encode

RUN = "test"
WORKER = Identity.from_seed(b"w" * 32)
OTHER = Identity.from_seed(b"o" * 32)
TOK = build_tokenizer()


def batch(step=0, version=5, ident=WORKER, **kw):
    return reversal_batch(ident, RUN, step=step, policy_version=version, tokenizer=TOK, **kw)


def fake_node(validators=()):
    return fake_context(RunConfig(name=RUN, validators=list(validators)))


@pytest.fixture
def trainer(tmp_path):
    """A Trainer at step 5 (async level 2) over a real spool; the policy is a stand-in (no model)."""
    policy = SimpleNamespace(step=5, vocab_size=len(TOK), device="cpu")
    with open_spool(tmp_path / "spool.sqlite") as spool:
        clock = SimpleNamespace(now=0.0)
        tcfg = TrainerConfig(max_pending_batches=4, ban_after_strikes=3, strike_window_s=60, ban_seconds=100)
        sections = TrainerSections(grpo=GRPOConfig(async_level=2, pack_length=64), trainer=tcfg)
        yield Trainer(fake_node(), policy, spool, sections,
                      clock=lambda: clock.now, **fake_wiring())


def test_staleness_window():
    assert staleness_reason(5, 5, 2) is None
    assert staleness_reason(3, 5, 2) is None
    assert staleness_reason(2, 5, 2) == "stale"
    assert staleness_reason(6, 5, 2) == "future"
    assert staleness_reason(0, 0, 0) is None


async def test_accepts_a_fresh_batch_and_spools_it_ready(trainer):
    data = sign_batch(WORKER, batch())
    ack = await trainer.judge(data, WORKER.peer_id)
    assert ack.accepted and ack.trainer_step == 5
    row = trainer.spool.get(ack.batch_id)
    assert row.state is BatchState.READY and row.samples == 8
    assert trainer.spool.envelope(ack.batch_id) == data


@pytest.mark.parametrize("version, reason", [(2, "stale"), (6, "future")])
async def test_refuses_stale_and_future_versions(trainer, version, reason):
    ack = await trainer.judge(sign_batch(WORKER, batch(version=version)), WORKER.peer_id)
    assert not ack.accepted and ack.reason == reason
    assert trainer.spool.get(ack.batch_id).state is BatchState.REJECTED


async def test_replay_is_refused_and_not_counted_against_the_worker(trainer):
    data = sign_batch(WORKER, batch())
    assert (await trainer.judge(data, WORKER.peer_id)).accepted
    again = await trainer.judge(data, OTHER.peer_id)
    assert not again.accepted and again.reason == "duplicate"
    assert trainer.spool.counts() == {"ready": 1}


async def test_second_batch_for_the_same_draw_step_is_refused(trainer):
    assert (await trainer.judge(sign_batch(WORKER, batch(seed=1)), WORKER.peer_id)).accepted
    ack = await trainer.judge(sign_batch(WORKER, batch(seed=2)), WORKER.peer_id)
    assert ack.reason == "duplicate-step"


async def test_forged_worker_field(trainer):
    forged = dataclasses.replace(batch(), worker=OTHER.peer_id)  # WORKER signs a batch claiming to be OTHER
    ack = await trainer.judge(sign_batch(WORKER, forged), WORKER.peer_id)
    assert ack.reason == "forged"
    assert trainer.spool.counts() == {}


async def test_tampered_signature(trainer):
    env = decode_as(Envelope, sign_batch(WORKER, batch()))
    bad = dataclasses.replace(env, signature=bytes(64))
    assert (await trainer.judge(encode(bad), WORKER.peer_id)).reason == "bad-signature"


async def test_wrong_run(trainer):
    other_run = dataclasses.replace(batch(), run="another")
    assert (await trainer.judge(sign_batch(WORKER, other_run), WORKER.peer_id)).reason == "wrong-run"


async def test_oversized_and_garbage(trainer):
    assert (await trainer.judge(b"\x00" * (MAX_BATCH_BYTES + 1), WORKER.peer_id)).reason == "oversized"
    assert (await trainer.judge(b"\xc1garbage", WORKER.peer_id)).reason == "malformed"
    assert trainer.spool.counts() == {}


async def test_shape_refusals(trainer):
    assert (await trainer.judge(sign_batch(WORKER, batch(temperature=0.7, step=1)), WORKER.peer_id)).reason == "wrong-temperature"
    long = batch(step=2, completions=[["1" * 60] * 4, ["2"] * 4])
    assert (await trainer.judge(sign_batch(WORKER, long), WORKER.peer_id)).reason == "too-long"
    b = batch(step=3)
    s0 = dataclasses.replace(b.samples[0], completion_ids=[len(TOK) + 5], logprobs=[-1.0])
    bad_token = dataclasses.replace(b, samples=[s0, *b.samples[1:]])
    assert (await trainer.judge(sign_batch(WORKER, bad_token), WORKER.peer_id)).reason == "bad-token"


async def test_busy_when_the_spool_is_full(trainer):
    for step in range(4):
        assert (await trainer.judge(sign_batch(WORKER, batch(step=step)), WORKER.peer_id)).accepted
    ack = await trainer.judge(sign_batch(WORKER, batch(step=9)), WORKER.peer_id)
    assert ack.reason == "busy"
    assert not trainer.spool.knows(ack.batch_id)  # "busy" is not final: the worker may retry


async def test_only_the_workers_own_submission_is_recorded_against_it(trainer):
    stale = batch(version=1)
    await trainer.judge(sign_batch(WORKER, stale), OTHER.peer_id)  # a third party replays an old batch
    assert trainer.spool.ledger_due(10) == []
    await trainer.judge(sign_batch(WORKER, batch(version=0, step=1)), WORKER.peer_id)
    assert [r.reason for r in trainer.spool.ledger_due(10)] == ["stale"]


async def test_repeated_garbage_gets_the_sender_banned(trainer):
    for _ in range(2):
        await trainer.judge(b"\xc1garbage", OTHER.peer_id)
        await trainer.judge(sign_batch(WORKER, batch(version=1)), OTHER.peer_id)  # stale: lag, not a strike
    assert not trainer.node.peers.is_banned(OTHER.peer_id, "rollouts", 0.0)
    await trainer.judge(sign_batch(WORKER, dataclasses.replace(batch(), worker=OTHER.peer_id)), OTHER.peer_id)  # forged
    assert trainer.node.peers.is_banned(OTHER.peer_id, "rollouts", 0.0) and trainer.status()["banned"] == 1
    assert not trainer.node.peers.is_banned(OTHER.peer_id, "rollouts", 100.0)  # the ban ends
    assert not trainer.node.peers.is_banned(WORKER.peer_id, "rollouts", 0.0)


def test_strikes_outside_the_window_do_not_add_up():
    table = PeerTable({"rollouts": FaultRule(strikes=2, window=10.0, ban_seconds=5.0)})
    assert not table.on_fault("p", "rollouts", "malformed", 0.0)
    assert not table.on_fault("p", "rollouts", "malformed", 11.0)  # the first one has expired
    assert table.on_fault("p", "rollouts", "forged", 12.0)
    assert table.is_banned("p", 16.9) and not table.is_banned("p", 17.0)


def test_a_worker_that_dies_mid_upload_earns_no_strike(trainer):
    assert {"truncated", "stream-error"} <= NOT_STRIKES
    for _ in range(3):
        trainer._strike(OTHER.peer_id, "truncated")
        trainer._strike(OTHER.peer_id, "stream-error")
    assert not trainer.node.peers.is_banned(OTHER.peer_id, now=0.0)


async def test_flat_batches_are_consumed_and_do_not_fill_the_queue(trainer):
    flat = [["x"] * 4, ["y"] * 4]  # every completion of a group scores the same
    for step in range(3):
        assert (await trainer.judge(sign_batch(WORKER, batch(step=step, completions=flat)), WORKER.peer_id)).accepted
    assert await trainer.pick() is None  # nothing to learn from, so no step...
    assert trainer.spool.pending() == 0  # ...but nothing left waiting either
    assert trainer.status()["batches"]["no_signal"] == 3
    assert {r.trained_step for r in trainer.spool.in_state(BatchState.TRAINED)} == {6}
    assert len(trainer.spool.ledger_due(10)) == 3  # valid work: credited as accepted


async def test_a_batch_fresh_at_intake_is_not_wasted_by_a_slow_wait(trainer):
    """Issue 15: staleness is judged at intake. Version 3 acknowledged at step 5 (async level 2) is
    still trained at step 6 and 7, though by its version alone it would have been stale at 6."""
    trainer.cfg.min_batch_samples = 4
    ack = await trainer.judge(sign_batch(WORKER, batch(version=3)), WORKER.peer_id)
    assert ack.accepted and trainer.spool.get(ack.batch_id).accepted_step == 5
    trainer.policy.step = 7  # two steps of queueing later (verify_grace_steps = 2)
    picked_ids, _, _ = await trainer.pick()
    assert picked_ids == [ack.batch_id]


async def test_batches_past_their_grace_expire_without_blame(trainer):
    ack = await trainer.judge(sign_batch(WORKER, batch(version=3)), WORKER.peer_id)
    assert ack.accepted
    trainer.policy.step = 8  # acknowledged at 5, grace 2: the last step it could be trained at was 7
    assert await trainer.pick() is None
    row = trainer.spool.get(ack.batch_id)
    assert row.state is BatchState.REJECTED and row.reason == "expired"
    assert trainer.spool.ledger_due(10) == []  # no ledger entry against the worker
    assert not trainer.node.peers.table.bans(0.0)  # and no strike
    assert trainer.status()["sample_outcomes"] == {"expired": 8}


def test_trainable_until_never_earlier_than_by_version():
    assert trainable_until(3, 5, async_level=2, grace=2) == 7
    assert trainable_until(5, 5, async_level=2, grace=0) == 7  # fresh by its version: the old rule still holds
    assert trainable_until(3, None, async_level=2, grace=2) == 5  # a row from before accepted_step: old rule
    assert trainable_until(4, 4, async_level=0, grace=0) == 4  # synchronous: trained before the next version
    assert not expired(3, 5, 7, async_level=2, grace=2) and expired(3, 5, 8, async_level=2, grace=2)


async def test_pick_takes_every_trainable_batch_up_to_max_step_samples(trainer):
    trainer.cfg.min_batch_samples = 12
    ids = [(await trainer.judge(sign_batch(WORKER, batch(step=s)), WORKER.peer_id)).batch_id for s in range(3)]
    picked_ids, samples, mean_reward = await trainer.pick()
    assert picked_ids == ids and len(samples) == 24 and 0 < mean_reward <= 1  # not only min_batch_samples' worth
    trainer.tcfg.max_step_samples = 16
    picked_ids, samples, _ = await trainer.pick()
    assert picked_ids == ids[:2] and len(samples) == 16


async def test_acks_carry_back_pressure_and_busy_says_when_to_retry(trainer):
    """max_pending_batches 4, target 2: the second ack asks for a wait, the fifth batch is busy with one."""
    acks = [await trainer.judge(sign_batch(WORKER, batch(step=s)), WORKER.peer_id) for s in range(5)]
    assert [a.accepted for a in acks] == [True] * 4 + [False]
    assert acks[0].retry_after_ms == 0  # below the target: no wait
    assert 0 < acks[1].retry_after_ms < acks[2].retry_after_ms < acks[3].retry_after_ms  # grows with the queue
    assert acks[4].reason == "busy" and acks[4].retry_after_ms >= acks[3].retry_after_ms


def test_pure_intake_order_of_checks():
    limits = IntakeLimits(vocab_size=len(TOK), pack_length=64, temperature=1.0, async_level=2)
    b = batch(version=0)
    assert intake_reason(b, known_batch=True, known_worker_step=True, step=5, limits=limits) == "duplicate"
    assert intake_reason(b, known_batch=False, known_worker_step=True, step=5, limits=limits) == "duplicate-step"
    assert intake_reason(b, known_batch=False, known_worker_step=False, step=5, limits=limits) == "stale"
    assert intake_reason(b, known_batch=False, known_worker_step=False, step=1, limits=limits) is None


def test_a_batch_from_an_engine_the_run_refuses_is_refused_at_intake():
    """A run without validators must not train on an engine its run file refuses (issue 17)."""
    torch_only = IntakeLimits(vocab_size=len(TOK), pack_length=64, temperature=1.0, async_level=2)
    b = batch(version=5)
    vllm = dataclasses.replace(b, engine="vllm")
    assert intake_reason(b, known_batch=False, known_worker_step=False, step=5, limits=torch_only) is None
    assert intake_reason(vllm, known_batch=False, known_worker_step=False, step=5, limits=torch_only) == "engine_refused"
    both = dataclasses.replace(torch_only, engines=("torch", "vllm"))
    assert intake_reason(vllm, known_batch=False, known_worker_step=False, step=5, limits=both) is None


def test_spool_refuses_illegal_transitions(tmp_path):
    with open_spool(tmp_path / "s.sqlite") as spool:
        signed = open_batch(sign_batch(WORKER, batch()), RUN)
        spool.add(signed, BatchState.READY)
        with pytest.raises(SpoolError):
            spool.decide(signed.batch_id, True, "", None)  # READY has no verdict to wait for
        spool.reject([signed.batch_id], "expired", ledger_due=False)
        with pytest.raises(SpoolError):
            spool.take([signed.batch_id], 1)


def test_a_step_lost_in_a_crash_gives_its_batches_back(tmp_path):
    with open_spool(tmp_path / "s.sqlite") as spool:
        ids = []
        for step in range(3):
            signed = open_batch(sign_batch(WORKER, batch(step=step)), RUN)
            spool.add(signed, BatchState.READY)
            ids.append(signed.batch_id)
        spool.take(ids[:2], 6)
    with open_spool(tmp_path / "s.sqlite") as spool:  # restarted; the saved state says step 5
        assert spool.recover(5) == 2
        assert [r.batch_id for r in spool.in_state(BatchState.READY)] == ids
        assert all(spool.envelope(i) for i in ids)


def test_pruned_batches_still_count_in_the_totals(tmp_path):
    """Pruning bounds the table; the status's totals (trained, rejected by reason) must not shrink
    with it, or accepted == gated + ready + trained + rejected stops holding mid-run."""
    with open_spool(tmp_path / "s.sqlite") as spool:
        ids = []
        for step in range(5):
            signed = open_batch(sign_batch(WORKER, batch(step=step, version=1 + step // 3)), RUN)
            spool.add(signed, BatchState.READY, ledger_due=False)
            ids.append(signed.batch_id)
        spool.take(ids[:2], 6)
        spool.reject(ids[2:4], "expired", ledger_due=False)
        before = spool.counts(), spool.rejected_by_reason()
        assert before == ({"trained": 2, "rejected": 2, "ready": 1}, {"expired": 2})
        assert spool.prune(2) == 3  # versions 1 (steps 0..2) go; step 3 (version 2) stays a row
        assert not spool.knows(ids[0]) and spool.knows(ids[3])
        assert (spool.counts(), spool.rejected_by_reason()) == before
        spool.reject([ids[4]], "expired", ledger_due=False)
        assert spool.prune(3) == 2
    with open_spool(tmp_path / "s.sqlite") as spool:  # the tally is on disk, not in memory
        assert spool.counts() == {"trained": 2, "rejected": 3}
        assert spool.rejected_by_reason() == {"expired": 3}


KILL_AFTER_ACK = textwrap.dedent("""
    import os, signal, sys
    import trio
    from types import SimpleNamespace
    sys.path.insert(0, {tests!r})
    from test_trainer_intake import fake_node, batch, WORKER, TOK
    from node.rl.config import GRPOConfig
    from node.trainer.config import TrainerSections
    from node.trainer.service import Trainer
    from node.trainer.spool import open_spool
    from node.trainer.testing import fake_wiring, sign_batch
    from node.wire import encode
    with open_spool({db!r}) as spool:
        t = Trainer(fake_node(), SimpleNamespace(step=5, vocab_size=len(TOK), device="cpu"), spool,
                    TrainerSections(grpo=GRPOConfig(pack_length=64)), clock=lambda: 0.0, **fake_wiring())
        ack = trio.run(t.judge, sign_batch(WORKER, batch()), WORKER.peer_id)
        sys.stdout.write(ack.batch_id.hex() + "\\n")
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)  # no close, no checkpoint of the WAL: a crash
""")


def test_acknowledged_batch_survives_kill_9(tmp_path):
    db = str(tmp_path / "spool.sqlite")
    script = KILL_AFTER_ACK.format(tests=os.path.dirname(__file__), db=db)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == -9, proc.stderr
    batch_id = bytes.fromhex(proc.stdout.strip())
    with open_spool(db) as spool:
        row = spool.get(batch_id)
        assert row is not None and row.state is BatchState.READY
        assert open_batch(spool.envelope(batch_id), RUN).batch_id == batch_id


def test_status_reward_curve_spans_the_whole_run():
    from node.trainer.figures import reward_points

    curve = [(s, s / 1000) for s in range(1, 1001)]
    pts = reward_points(curve, 200)
    assert len(pts) == 200 and pts[0] == [5, 0.003] and pts[-1] == [1000, 0.998]
    assert reward_points(curve[:3], 200) == [[1, 0.001], [2, 0.002], [3, 0.003]]


async def test_a_worker_banned_in_the_ledger_is_refused_at_intake(trainer):
    """A validator's penalty entry with a ban reaches the trainer's ledger replica: the worker's
    batches are refused (and the refusal is no strike against whoever forwarded them)."""
    from node.ledger.chain import Ledger, Outcome
    from node.ledger.entries import GENESIS, Penalty, make_entry

    validator = Identity.from_seed(b"v" * 32)
    now_ms = 1_700_000_000_000
    replica = Ledger(RUN, [], [validator.peer_id], 60_000)
    entry = make_entry(validator, RUN, 1, GENESIS, now_ms,
                       Penalty(peer=WORKER.peer_id, reason="fake-rewards", points=3, ban_seconds=600))
    decision = replica.check(entry, now_ms)
    assert decision.outcome is Outcome.ACCEPT
    replica.apply(decision)
    trainer.ledger = SimpleNamespace(ban_of=lambda peer: replica.ban_of(peer, now_ms), accepted_samples=replica.accepted_samples)
    ack = await trainer.judge(sign_batch(WORKER, batch()), OTHER.peer_id)
    assert not ack.accepted and ack.reason == "banned"
    assert OTHER.peer_id not in trainer.node.peers.table.peers
    assert (await trainer.judge(sign_batch(OTHER, batch(ident=OTHER)), OTHER.peer_id)).accepted  # others unaffected
