"""How close honest proofs come to the run's thresholds, and tighter thresholds fitted to them.

The paper's thresholds (≤ 38 of 128 exponent mismatches, mantissa error mean ≤ 10, median ≤ 8)
were set on multi-billion-parameter models across GPU types, where honest error is largest. On a
smaller model, or one fleet of GPUs, honest error sits far below them, and so does the error of
some cheats: computing in fp32 instead of the run's bf16 on the 4-layer test model measures a
mantissa mean of 3.4-6.6 against an honest worst of 1.4 (tests/test_proofs_model.py), inside the
paper's bounds. A validator therefore records the worst chunk of every rollout that passed
(:class:`ProofMargins`, shown in its status) and, once it has seen enough of them, recommends
thresholds at ``factor`` times that worst: the operator puts them in the run file's ``[proofs]``
table. Measured on real traffic they include the spread between the inference nodes' hardware and
the validator's, which no single-machine calibration can.

Pure: no torch, no I/O, no clock.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from .config import ProofsConfig
from .toploc import ChunkResult

WINDOW = 4096  # recent passing rollouts remembered (worst chunk of each)
MIN_ROLLOUTS = 100  # rollouts seen before thresholds are recommended
FACTOR = 2.0  # recommended threshold = FACTOR x the worst honest measurement
# Floors: never recommend a threshold a single rounding step would cross.
MIN_EXP_MISMATCHES = 2
MIN_MANTISSA = 1.0


@dataclass(frozen=True)
class Worst:
    """The worst chunk measurements of one rollout (exponent mismatches scaled to ``topk`` points)."""

    exp_mismatches: float
    mant_err_mean: float
    mant_err_median: float

    @classmethod
    def of(cls, chunks: Sequence[ChunkResult], topk: int) -> Worst:
        return cls(
            max(c.exp_mismatches * topk / c.points for c in chunks),
            max(c.mant_err_mean for c in chunks),
            max(c.mant_err_median for c in chunks),
        )

    @classmethod
    def over(cls, worsts: Sequence[Worst]) -> Worst:
        return cls(
            max(w.exp_mismatches for w in worsts),
            max(w.mant_err_mean for w in worsts),
            max(w.mant_err_median for w in worsts),
        )


def recommend(worst: Worst, config: ProofsConfig, factor: float = FACTOR) -> ProofsConfig:
    """Thresholds at ``factor`` x ``worst``, never looser than ``config``'s."""
    return ProofsConfig(
        **{
            **vars(config),
            "max_exp_mismatches": min(
                config.max_exp_mismatches, max(MIN_EXP_MISMATCHES, math.ceil(factor * worst.exp_mismatches))
            ),
            "max_mantissa_mean": min(config.max_mantissa_mean, max(MIN_MANTISSA, round(factor * worst.mant_err_mean, 2))),
            "max_mantissa_median": min(
                config.max_mantissa_median, max(MIN_MANTISSA, round(factor * worst.mant_err_median, 2))
            ),
        }
    )


class ProofMargins:
    """The worst chunk of each recent rollout whose proofs passed."""

    def __init__(self, window: int = WINDOW) -> None:
        self.recent: deque[Worst] = deque(maxlen=window)
        self.rollouts = 0

    def add(self, chunks: Sequence[ChunkResult], topk: int) -> None:
        if chunks:
            self.recent.append(Worst.of(chunks, topk))
            self.rollouts += 1

    def worst(self) -> Worst | None:
        return Worst.over(self.recent) if self.recent else None

    def recommended(self, config: ProofsConfig, min_rollouts: int = MIN_ROLLOUTS) -> ProofsConfig | None:
        return self._recommended(self.worst(), config, min_rollouts)

    def _recommended(self, worst: Worst | None, config: ProofsConfig, min_rollouts: int) -> ProofsConfig | None:
        if worst is None or len(self.recent) < min_rollouts:
            return None
        return recommend(worst, config)

    def status(self, config: ProofsConfig) -> dict:
        worst = self.worst()  # once: the window holds up to WINDOW rollouts and status runs every second
        rec = self._recommended(worst, config, MIN_ROLLOUTS)
        return {
            "rollouts": self.rollouts,
            "thresholds": _fields(config),
            "worst_passing": None if worst is None else {
                "max_exp_mismatches": round(worst.exp_mismatches, 1),
                "max_mantissa_mean": round(worst.mant_err_mean, 2),
                "max_mantissa_median": round(worst.mant_err_median, 2),
            },
            "recommended": None if rec is None else _fields(rec),
        }


def _fields(config: ProofsConfig) -> dict:
    return {
        "max_exp_mismatches": config.max_exp_mismatches,
        "max_mantissa_mean": config.max_mantissa_mean,
        "max_mantissa_median": config.max_mantissa_median,
    }
