"""Why a rollout (or one of its proofs) was accepted or rejected: one Enum for every check.

The values are short snake_case strings because they travel: into signed verdicts, into
``node.metrics.reject(source, reason)`` labels and into ``swarm-node status``. Never renumber or
rename a value that has shipped; add new ones.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Reason(str, enum.Enum):
    OK = "ok"

    # TOPLOC proofs (node.proofs.toploc)
    PROOF_MALFORMED = "proof_malformed"  # not bytes, odd length, modulus or coefficient out of range
    PROOF_NULL = "proof_null"  # the builder failed and sent a null proof (modulus 0)
    PROOF_COUNT = "proof_count"  # not one proof per chunk of the completion
    PROOF_LENGTH = "proof_length"  # a proof carries the wrong number of coefficients
    PROOF_EXPONENT = "proof_exponent"  # too many exponent mismatches: different computation
    PROOF_MANTISSA_MEAN = "proof_mantissa_mean"  # mantissa error mean above threshold
    PROOF_MANTISSA_MEDIAN = "proof_mantissa_median"  # mantissa error median above threshold

    # Termination
    EMPTY_COMPLETION = "empty_completion"
    TOKENS_AFTER_EOS = "tokens_after_eos"
    NOT_TERMINATED = "not_terminated"  # no EOS and shorter than the maximum length
    TOO_LONG = "too_long"

    # Sampling
    LOGPROB_SHAPE = "logprob_shape"  # not one log-prob per completion token
    LOGPROB_MISMATCH = "logprob_mismatch"
    WRONG_TEMPERATURE = "wrong_temperature"
    WRONG_SEED = "wrong_seed"

    # Data
    WRONG_TASK = "wrong_task"
    REWARD_MISMATCH = "reward_mismatch"
    ADVANTAGE_MISMATCH = "advantage_mismatch"
    OUT_OF_BOUNDS = "out_of_bounds"
    STALE_POLICY = "stale_policy"
    FUTURE_POLICY = "future_policy"


@dataclass(frozen=True)
class CheckResult:
    """The outcome of one check: ``ok`` iff ``reason is Reason.OK``; ``detail`` is for humans/logs."""

    reason: Reason
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.reason is Reason.OK

    def __bool__(self) -> bool:  # `if check_x(...):` reads naturally
        return self.ok


PASS = CheckResult(Reason.OK)


def fail(reason: Reason, detail: str) -> CheckResult:
    return CheckResult(reason, detail)
