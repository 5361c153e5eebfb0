"""The trainer's figures (node/trainer/figures.py): pure, driven with explicit wall times."""

from __future__ import annotations

from node.trainer.figures import MAX_LIFE_TRACKED, TrainerFigures


def test_a_trained_batch_adds_its_stages_and_status_shows_their_means():
    f = TrainerFigures()
    f.on_acked(b"a", generated=100.0, acked=102.0)
    f.on_verified(b"a", 105.0)
    f.on_acked(b"b", generated=101.0, acked=101.0)  # never verified: no validators, ready at once
    f.on_trained(b"a", 8, now=106.0)
    f.on_trained(b"b", 4, now=111.0)
    assert f.sample_outcomes == {"trained": 12} and f.life == {}
    assert f.sample_life() == {"generated_to_acked": 1.0, "acked_to_verified": 1.5, "verified_to_trained": 5.5}


def test_a_worker_clock_ahead_of_ours_counts_no_negative_queueing():
    f = TrainerFigures()
    f.on_acked(b"a", generated=110.0, acked=100.0)
    f.on_trained(b"a", 1, now=100.0)
    assert f.sample_life()["generated_to_acked"] == 0.0


def test_batches_that_leave_untrained_count_their_samples_and_are_forgotten():
    f = TrainerFigures()
    f.on_acked(b"a", 1.0, 2.0)
    f.on_acked(b"b", 1.0, 2.0)
    f.on_gone([b"a", b"b"], 16, "expired")
    f.on_trained(b"a", None, now=5.0)  # its spool row is gone: nothing to count
    assert f.sample_outcomes == {"expired": 16} and f.life_n == 0 and f.sample_life() == {}


def test_the_life_of_at_most_max_life_tracked_batches_is_remembered():
    f = TrainerFigures()
    for i in range(MAX_LIFE_TRACKED + 3):
        f.on_acked(i.to_bytes(4, "big"), 0.0, 1.0)
    assert len(f.life) == MAX_LIFE_TRACKED
    f.on_verified((MAX_LIFE_TRACKED + 1).to_bytes(4, "big"), 2.0)  # untracked: no entry appears
    assert len(f.life) == MAX_LIFE_TRACKED
