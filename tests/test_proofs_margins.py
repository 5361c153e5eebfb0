"""Pure rules of the proof margins a validator keeps and the thresholds it recommends."""

from __future__ import annotations

from node.proofs.config import ProofsConfig
from node.proofs.margins import MIN_ROLLOUTS, ProofMargins, Worst, recommend
from node.proofs.toploc import ChunkResult

PAPER = ProofsConfig()


def test_worst_scales_a_short_last_chunk_to_k_points():
    chunks = [ChunkResult(3, 1.0, 1.0, 128), ChunkResult(2, 0.5, 2.0, 32)]  # 2 of 32 = 8 of 128
    assert Worst.of(chunks, 128) == Worst(8.0, 1.0, 2.0)


def test_recommendation_is_factor_times_worst_never_looser_nor_below_floors():
    rec = recommend(Worst(7.0, 1.39, 1.0), PAPER)
    assert (rec.max_exp_mismatches, rec.max_mantissa_mean, rec.max_mantissa_median) == (14, 2.78, 2.0)
    assert rec.topk == PAPER.topk and rec.logprob_tolerance_max == PAPER.logprob_tolerance_max  # the rest is kept
    loose = recommend(Worst(30.0, 9.0, 6.0), PAPER)  # honest work near the paper's bounds: keep them
    assert (loose.max_exp_mismatches, loose.max_mantissa_mean, loose.max_mantissa_median) == (38, 10.0, 8.0)
    exact = recommend(Worst(0.0, 0.0, 0.0), PAPER)  # bit-identical hardware: still a rounding step of room
    assert (exact.max_exp_mismatches, exact.max_mantissa_mean, exact.max_mantissa_median) == (2, 1.0, 1.0)


def test_margins_recommend_only_after_enough_rollouts_and_forget_old_ones():
    margins = ProofMargins(window=MIN_ROLLOUTS)
    margins.add([ChunkResult(20, 4.0, 3.0, 128)], 128)  # one outlier, first
    for _ in range(MIN_ROLLOUTS - 2):
        margins.add([ChunkResult(5, 1.0, 1.0, 128)], 128)
    assert margins.recommended(PAPER) is None
    margins.add([], 128)  # a rollout without chunks measures nothing
    assert margins.rollouts == MIN_ROLLOUTS - 1 and margins.recommended(PAPER) is None
    margins.add([ChunkResult(5, 1.0, 1.0, 128)], 128)
    assert margins.recommended(PAPER).max_mantissa_mean == 8.0  # the outlier is still in the window
    margins.add([ChunkResult(5, 1.0, 1.0, 128)], 128)  # ...and now it is not
    assert margins.recommended(PAPER).max_mantissa_mean == 2.0
    status = margins.status(PAPER)
    assert status["rollouts"] == MIN_ROLLOUTS + 1 and status["worst_passing"]["max_exp_mismatches"] == 5.0
    assert status["recommended"] == {"max_exp_mismatches": 10, "max_mantissa_mean": 2.0, "max_mantissa_median": 2.0}
