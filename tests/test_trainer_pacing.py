"""Back-pressure in the trainer's acks (node/trainer/pacing.py): pure, time passed in."""

from __future__ import annotations

import pytest

from node.trainer.pacing import DEFAULT_INTERVAL, Pacer


def test_no_wait_below_the_target():
    p = Pacer(target=4, max_pending=8, max_wait=30.0)
    assert [p.retry_after(n, 0.0) for n in range(4)] == [0.0] * 4
    assert not p.busy(7) and p.busy(8)


def test_wait_is_the_time_to_drain_back_below_the_target_at_the_measured_rate():
    p = Pacer(target=2, max_pending=8, max_wait=30.0)
    assert p.retry_after(2, 0.0) == DEFAULT_INTERVAL  # nothing measured yet
    for t in (10.0, 10.5, 11.0, 11.5, 12.0):  # a batch leaves every 0.5 s
        p.on_drained(1, t)
    assert p.seconds_per_batch(12.0) == pytest.approx(0.5)
    assert p.retry_after(2, 12.0) == pytest.approx(0.5)
    assert p.retry_after(5, 12.0) == pytest.approx(2.0)  # 4 batches over the target... to drain below it


def test_a_stalled_trainer_slows_its_workers_more_and_the_wait_is_capped():
    p = Pacer(target=1, max_pending=8, max_wait=5.0)
    p.on_drained(1, 0.0)
    p.on_drained(1, 1.0)
    assert p.retry_after(1, 1.0) == pytest.approx(1.0)
    assert p.retry_after(1, 3.0) == pytest.approx(3.0)  # nothing left for 2 s: the rate is lower now
    assert p.retry_after(8, 3.0) == 5.0


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError):
        Pacer(target=0, max_pending=8, max_wait=1.0)
    with pytest.raises(ValueError):
        Pacer(target=9, max_pending=8, max_wait=1.0)


def test_the_target_is_what_can_be_checked_before_a_batch_expires():
    """Issue 39: with the default target (half of 256 pending batches) one validator checking a
    batch every 6 s fell minutes behind a trainer stepping every 35 s, and a third of the honest
    samples expired. Batches must be trained within the grace steps: 2 * 35 s / 6 s = 11 of them,
    of which half is the target (the rest absorbs swings)."""
    p = Pacer(target=128, max_pending=256, max_wait=30.0, horizon_steps=2)
    assert p.target_now(0.0) == 8  # nothing measured yet: a small start, not 128
    for t in range(0, 120, 6):
        p.on_drained(1, float(t))
    for t in (9.0, 44.0, 79.0, 114.0):
        p.on_step(t)
    assert p.target_now(114.0) == 2 * 35 // (2 * 6)
    assert p.retry_after(4, 114.0) == 0.0 and p.retry_after(5, 114.0) == pytest.approx(6.0)
    # A stall lowers both rates alike; the target never falls below MIN_TARGET nor rises above the cap.
    assert 2 <= p.target_now(1000.0) <= 128
    fast = Pacer(target=4, max_pending=8, max_wait=30.0, horizon_steps=2)
    for t in range(10):
        fast.on_drained(1, t * 0.1)
        fast.on_step(float(t))
    assert fast.target_now(1.0) == 4
