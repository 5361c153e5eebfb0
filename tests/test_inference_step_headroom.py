"""Issue 39: an honest worker whose batches are lost (dropped as stale in its outbox, refused as busy
and left to age) must never be refused ``step-ahead`` by a trainer. Pure: the real :class:`Outbox`
against the real trainer-side :class:`StepWindow` rule, with no network and no clock."""

from __future__ import annotations

import random

import pytest

from node.rollouts.schema import RolloutAck
from node.rollouts.steps import STEP_SLACK, StepWindow, step_window_size
from node.inference.outbox import UNCOUNTED_REASONS, BatchState, Outbox, Pending
from node.trainer.intake import KEEPS_WINDOW

CAPACITY = 4
WINDOW = step_window_size(CAPACITY)


def outbox(first_step: int = 0, capacity: int = CAPACITY, counted: int | None = None) -> Outbox:
    return Outbox(capacity, max_attempts=3, backoff=1.0, backoff_max=8.0, async_level=1,
                  step_window=step_window_size(capacity), first_step=first_step, counted_step=counted)


def batch(step: int, version: int) -> Pending:
    return Pending(batch_id=step.to_bytes(32, "big"), envelope=b"x", policy_version=version, num_samples=4,
                   created_at=0.0, step=step)


class Trainer:
    """The trainer's judgement of one worker's batches, as node/trainer/service.py makes it: the step
    window first, then busy (transient), then staleness; a refusal in KEEPS_WINDOW leaves the window."""

    def __init__(self, window: int) -> None:
        self.size = window
        self.window = StepWindow.EMPTY
        self.version = 0
        self.refusals: list[str] = []

    def answer(self, p: Pending, busy: bool) -> RolloutAck:
        reason = self.window.reason(p.step, self.size)
        if reason is None and busy:
            reason = "busy"
        if reason is None and p.policy_version < self.version - 1:
            reason = "stale"
        if reason not in KEEPS_WINDOW:
            self.window = self.window.after(p.step, self.size)
        self.refusals += [reason] if reason else []
        return RolloutAck(batch_id=p.batch_id, accepted=reason is None, reason=reason or "", trainer_step=self.version)


@pytest.mark.parametrize("capacity, crashes, seed", [(4, 0.0, 39), (4, 0.02, 1), (16, 0.02, 2), (1, 0.05, 3)])
def test_lost_batches_never_lock_an_honest_worker_out(capacity, crashes, seed):
    """Rounds where the trainer moves on while most of the worker's batches wait (busy, then stale),
    and the worker crashes now and then (losing its outbox and the step it was generating, keeping
    what it persisted before each step: the next step and how far the trainer counted): without the
    outbox's step headroom the dropped batches burned step numbers until the next one was above the
    trainer's window, and every later batch was refused ``step-ahead``."""
    rng = random.Random(seed)
    window = step_window_size(capacity)
    ob, trainer = outbox(capacity=capacity), Trainer(window)
    next_step, used, dropped, now, persisted = 0, [], 0, 0.0, None
    for _ in range(600):
        now += 1.0
        if rng.random() < crashes:  # the step in generation is lost too: its number was persisted first
            dropped += len(ob) + 1
            next_step += 1
            ob = outbox(first_step=next_step, capacity=capacity, counted=persisted)
        if not ob.full and not ob.step_hold(next_step):
            used.append(next_step)
            persisted = ob.counted_step
            assert ob.offer(batch(next_step, trainer.version))
            next_step += 1
        if rng.random() < 0.5:  # the trainer steps on: queued batches go stale and are dropped here
            trainer.version += 1
            dropped += len(ob.observe_version(trainer.version))
        got = ob.take(["T"], now)
        if got is not None:
            p, t = got
            ob.on_ack(p.batch_id, t, trainer.answer(p, busy=rng.random() < 0.7), now)
    assert "step-ahead" not in trainer.refusals
    assert dropped > 2 * window and "stale" in trainer.refusals  # the scenario did lose batches, many windows' worth
    assert len(used) == len(set(used)) and next_step > 150  # steps never reused, and the worker kept going


def test_generation_waits_at_the_edge_while_a_batch_is_outstanding():
    ob = outbox(first_step=10)  # a restarted node: its crash may have lost the outbox and the step in generation
    assert ob.counted_step == 9 - (CAPACITY + 1)
    edge = ob.counted_step + WINDOW - STEP_SLACK
    assert not ob.step_hold(edge + 5)  # nothing outstanding: drawing never waits for nothing
    ob.offer(batch(edge, 0))
    assert ob.step_hold(edge + 1)  # past the edge while a batch is outstanding: wait for its answer
    assert ob.observe_version(5)[0].step == edge  # at the edge a stale batch is still dropped unsent ...
    assert not ob.step_hold(edge + 1)  # ... and with nothing outstanding the next step is drawn, not waited for
    ob.offer(batch(edge + 1, 0))
    assert ob.step_hold(edge + 2)
    assert ob.observe_version(6) == []  # past the edge a stale batch is kept: the trainer must see its step
    p, t = ob.take(["T"], 0.0)
    assert ob.on_ack(p.batch_id, t, RolloutAck(batch_id=p.batch_id, reason="stale", trainer_step=6), 0.0).state \
        is BatchState.REFUSED
    assert ob.counted_step == edge + 1 and not ob.step_hold(edge + 2)  # the trainer counted it: room again


def test_a_step_ahead_refusal_resets_the_workers_view():
    ob = outbox(first_step=100)
    ob.offer(batch(100, 0))
    ob.offer(batch(101, 0))
    p, t = ob.take(["T"], 0.0)
    ob.on_ack(p.batch_id, t, RolloutAck(batch_id=p.batch_id, reason="step-ahead"), 0.0)
    assert ob.counted_step < 100 - WINDOW  # the trainer's window is below what we believed
    assert ob.step_hold(102)  # no new step while 101 is outstanding


def test_uncounted_reasons_match_the_trainers():
    """What the worker believes a trainer did not count is exactly what the trainer leaves out."""
    assert UNCOUNTED_REASONS == KEEPS_WINDOW
