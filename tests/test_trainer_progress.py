"""The trainer says when it stalls and why (node/trainer/progress.py), and paces by what is checked (issue 39)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from node.config import RunConfig
from node.engines.model import build_tokenizer
from node.identity import Identity
from node.rl.config import GRPOConfig
from node.trainer.config import TrainerSections
from node.trainer.pacing import DEFAULT_INTERVAL
from node.trainer.progress import STALL_AFTER_S, STALL_KINDS, Backlog, Progress, stall_cause, stall_kind
from node.trainer.service import Trainer
from node.trainer.spool import open_spool
from node.rollouts.schema import DOMAIN_VERDICT, Verdict
from node.trainer.testing import fake_context, fake_wiring, reversal_batch, sign_batch
from node.wire import encode, seal

RUN = "test"
WORKER = Identity.from_seed(b"p" * 32)
VALIDATOR_ID = Identity.from_seed(b"v" * 32)
VALIDATOR = VALIDATOR_ID.peer_id
TOK = build_tokenizer()


def test_steps_per_minute_and_the_stall_bound():
    p = Progress(started=0.0)
    assert p.seconds_since_step(30.0) == 30.0 and p.steps_per_minute(30.0) is None
    assert not p.stalled(1000.0)  # no batch yet: waiting for workers, not stalled
    p.on_work(10.0)
    assert not p.stalled(10.0 + STALL_AFTER_S - 1) and p.stalled(10.0 + STALL_AFTER_S)
    for t in (40.0, 70.0, 100.0):
        p.on_step(t)
    assert p.steps_per_minute(100.0) == pytest.approx(2.0)
    assert not p.stalled(100.0 + STALL_AFTER_S - 1)
    assert p.stalled(100.0 + STALL_AFTER_S)
    assert p.steps_per_minute(220.0) == pytest.approx(60.0 * 2 / 180.0)  # a stall brings the rate down


def _backlog(**kw):
    base = dict(stepping_s=None, gated_unsent=0, gated_sent=0, ready=0, samples_in_hand=0, min_samples=16,
                validators=1, live_validators=1)
    return Backlog(**{**base, **kw})


@pytest.mark.parametrize("kw, kind", [
    (dict(stepping_s=120.0), "training"),
    (dict(gated_unsent=3, live_validators=0), "no validator"),
    (dict(gated_unsent=40, gated_sent=4), "validator backlog"),
    (dict(gated_sent=4), "waiting for verdicts"),
    (dict(ready=2, samples_in_hand=4), "too few samples"),
    (dict(), "no batches"),
])
def test_each_stall_names_what_the_trainer_waits_for(kw, kind):
    cause = stall_cause(_backlog(**kw))
    assert stall_kind(cause) == kind and kind in STALL_KINDS, cause


@pytest.fixture
def trainer(tmp_path):
    """A trainer of a run with one validator, clock in our hands."""
    now = [0.0]
    node = fake_context(RunConfig(name=RUN, validators=[VALIDATOR]))
    policy = SimpleNamespace(step=5, vocab_size=len(TOK), device="cpu")
    with open_spool(tmp_path / "spool.sqlite") as spool:
        t = Trainer(node, policy, spool, TrainerSections(grpo=GRPOConfig(async_level=2, pack_length=64)),
                    clock=lambda: now[0], **fake_wiring())
        t.now = now
        yield t


async def _accept(trainer, steps):
    ids = []
    for s in steps:
        b = reversal_batch(WORKER, RUN, step=s, policy_version=5, tokenizer=TOK, seed=s)
        ack = await trainer.judge(sign_batch(WORKER, b), WORKER.peer_id)
        assert ack.accepted, ack.reason
        ids.append(ack.batch_id)
    return ids


async def test_expired_batches_do_not_speed_up_the_measured_drain_rate(trainer):
    """Issue 39: expiries counted as departures, so the more batches expired the faster the trainer
    looked and the less it slowed its workers."""
    ids = await _accept(trainer, range(4))
    for i, t in enumerate((10.0, 11.0)):
        trainer.now[0] = t
        await trainer._expire(ids[i * 2:i * 2 + 2])
    assert trainer.pacer.seconds_per_batch(11.0) == DEFAULT_INTERVAL
    assert trainer.figures.sample_outcomes["expired"] == 4 * 8


async def test_a_batch_drains_when_trained_not_at_its_verdict(trainer):
    """The queue drains at the pace of the slower of validators and trainer: counted at the verdict,
    verified batches piled up past what capped steps could take, and expired (issue 39)."""
    ids = await _accept(trainer, range(3))
    for i, t in enumerate((10.0, 11.0, 12.0)):
        trainer.now[0] = t
        verdict = Verdict(run=RUN, batch_id=ids[i], worker=WORKER.peer_id, validator=VALIDATOR, accepted=True,
                          reasons=["ok"] * 8, policy_version=5, created_ms=0)
        assert (await trainer.on_verdict_bytes(encode(seal(VALIDATOR_ID, DOMAIN_VERDICT, verdict))))[1]
    assert trainer.pacer.seconds_per_batch(12.0) == DEFAULT_INTERVAL
    trainer.now[0] = 30.0
    trainer._trained(ids[:2])
    trainer.now[0] = 36.0
    trainer._trained(ids[2:])
    assert trainer.pacer.seconds_per_batch(36.0) == pytest.approx(6.0 / 2)


async def test_status_shows_the_last_step_the_rate_and_a_stall_with_its_cause(trainer):
    status = trainer.status()
    assert status["last_step_at"] is None and status["steps_per_min"] is None and status["stalled"] == ""
    await _accept(trainer, range(3))
    trainer.now[0] = STALL_AFTER_S + 1
    status = trainer.status()
    assert status["seconds_since_step"] == pytest.approx(STALL_AFTER_S + 1)
    assert stall_kind(status["stalled"]) == "no validator"  # membership knows no validator alive
    trainer.membership.alive = {VALIDATOR: "validator"}
    for batch_id, _ in trainer.gate.due([VALIDATOR], trainer.now[0]):
        trainer.gate.sent(batch_id, trainer.now[0])
    assert stall_kind(trainer.status()["stalled"]) == "waiting for verdicts"
    for t in (100.0, 130.0):
        trainer.now[0] = t
        trainer._stepped()
    trainer.wall_clock = lambda: 5000.0  # pinned: no bound on how long the test may take
    status = trainer.status()
    assert status["stalled"] == "" and status["steps_per_min"] == pytest.approx(2.0)
    assert status["last_step_at"] == 5000.0  # the last step was at "now"


async def test_a_step_waits_a_little_for_batches_it_would_leave_to_expire(trainer):
    """Issue 39: steps of one batch each, made as fast as verdicts came, moved the version two steps
    on while the rest were checked, and they expired. The step now waits for them, at most step_hold_s."""
    await _accept(trainer, range(2))  # acknowledged at step 5: trainable until step 7
    assert not trainer._hold_step()
    trainer.policy.step = 7
    assert trainer._hold_step()
    trainer.now[0] = trainer.tcfg.step_hold_s - 1
    assert trainer._hold_step()
    trainer.now[0] = trainer.tcfg.step_hold_s
    assert not trainer._hold_step()  # bounded: the step goes on
    trainer._stepped()
    assert trainer.hold_since is None


def test_a_running_step_is_not_idle_time():
    """A 135 M model's first step ran 5 minutes; the demo called that trainer 100 % idle (only finished
    steps counted as busy)."""
    from node.trainer.progress import idle_fraction

    assert idle_fraction(0.0, 0.0, None) is None
    assert idle_fraction(31.0, 0.0, None) == 1.0
    assert idle_fraction(31.0, 0.0, 279.0) == 0.1
    assert idle_fraction(30.0, 90.0, None) == 0.25


async def test_each_verdict_is_answered_and_counted_by_what_it_did(trainer):
    """The verdict paths of on_verdict_bytes (issue 44 flattened it): a verdict for no batch of ours, for
    another worker's, "cannot judge yet", a pass, the same pass again (acknowledged: not the validator's
    fault) and a failure, each with its ack and its count in status."""
    ids = await _accept(trainer, range(2))

    def signed(batch_id, worker=WORKER.peer_id, accepted=True, reasons=("ok",) * 8, unjudged=""):
        verdict = Verdict(run=RUN, batch_id=batch_id, worker=worker, validator=VALIDATOR, accepted=accepted,
                          reasons=list(reasons), policy_version=5, created_ms=0, unjudged=unjudged)
        return encode(seal(VALIDATOR_ID, DOMAIN_VERDICT, verdict))

    assert await trainer.on_verdict_bytes(signed(bytes(32))) == (bytes(32), False, "unknown-batch")
    assert await trainer.on_verdict_bytes(signed(ids[0], worker=VALIDATOR)) == (ids[0], False, "wrong-worker")
    unjudged = signed(ids[0], accepted=False, reasons=(), unjudged="no-checkpoint")
    assert await trainer.on_verdict_bytes(unjudged) == (ids[0], True, "")
    assert await trainer.on_verdict_bytes(signed(ids[0])) == (ids[0], True, "")
    assert await trainer.on_verdict_bytes(signed(ids[0])) == (ids[0], True, "already-decided")
    failed = signed(ids[1], accepted=False, reasons=["ok"] * 7 + ["bad-proof"])
    assert await trainer.on_verdict_bytes(failed) == (ids[1], True, "")
    assert trainer.status()["gate"]["verdicts"] == {"unknown-batch": 1, "wrong-worker": 1, "unjudged:no-checkpoint": 1,
                                                    "passed": 1, "already-decided": 1, "failed": 1}
    assert trainer.status()["sample_outcomes"] == {"verdict:bad-proof": 8}
    assert trainer.spool.get(ids[0]).state.value == "ready" and trainer.spool.get(ids[1]).state.value == "rejected"


@pytest.mark.parametrize("reason, barred", [("stale_policy", 0), ("step_ahead", 0), ("bad-proof", 1)])
async def test_only_a_verdict_that_is_the_workers_fault_costs_a_fresh_key_the_pool(trainer, reason, barred):
    """A batch that went stale waiting for its verdict (a fast trainer, a slow validator) is lost, but
    its worker did nothing wrong: barring its key from the pool for ten intervals locked an honest
    newcomer out for lack of history it was trying to earn."""
    ids = await _accept(trainer, range(1))
    verdict = Verdict(run=RUN, batch_id=ids[0], worker=WORKER.peer_id, validator=VALIDATOR, accepted=False,
                      reasons=["ok"] * 7 + [reason], policy_version=5, created_ms=0)
    assert (await trainer.on_verdict_bytes(encode(seal(VALIDATOR_ID, DOMAIN_VERDICT, verdict))))[1]
    assert trainer.spool.get(ids[0]).state.value == "rejected"
    assert trainer.status()["quota"]["barred"] == barred
