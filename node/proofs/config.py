"""The ``[proofs]`` table of the run file: TOPLOC parameters and the tolerances of the rollout checks.

Every peer of a run must agree on these (builders and verifiers use the same chunking and k), which is
why they live in the run file and not in per-node settings. Kept free of torch and libp2p imports so
``node.config`` can load it cheaply.

Defaults follow INTELLECT-2 and the TOPLOC paper (Ong et al., arXiv 2501.16007, §5 experiments):
32 decode tokens per proof, k = 128 points, acceptance at ≤ 38 exponent mismatches of 128,
mantissa error mean ≤ 10 and median ≤ 8 (in bf16 mantissa units).
"""

from __future__ import annotations

from dataclasses import dataclass

# The prime of the field the proof polynomials live in (0xFFD9); fixed by the byte format.
FIELD_PRIME = 65497
# Most points one proof may carry: its coefficients must stay a bounded, small message.
MAX_TOPK = 4096


@dataclass
class ProofsConfig:
    """TOPLOC and rollout-check parameters shared by inference nodes and validators."""

    chunk_tokens: int = 32  # decode positions per proof ("decode_batching_size" in the reference)
    topk: int = 128  # points per proof: the k largest |activations| of the chunk
    max_exp_mismatches: int = 38  # per chunk of `topk` points; scaled down for a shorter last chunk
    max_mantissa_mean: float = 10.0  # mean |mantissa difference| over exponent-matching points
    max_mantissa_median: float = 8.0  # median of the same
    # Log-prob tolerances: bf16 KV-cache decoding vs one prefill moves log-probs a little (measured on
    # the tiny test model: mean |diff| <= 0.06, max <= 0.26 per rollout); a replaced token moves its own
    # by nats unless the replacement is about as likely as the sampled token.
    logprob_tolerance_mean: float = 0.1  # mean |claimed - recomputed| token log-prob allowed
    logprob_tolerance_max: float = 1.0  # largest single-token |claimed - recomputed| allowed
    # The same when the batch states float32 and the validator prefills in float32: honest decoding
    # then moves log-probs by < 1e-6, and a model fake-quantised to 8 bits by > 3e-3 (bench/cheap_model.py).
    logprob_tolerance_mean_fp32: float = 1e-3  # mean |claimed - recomputed| token log-prob allowed, float32 on both sides
    logprob_tolerance_max_fp32: float = 1e-2  # largest single-token |claimed - recomputed| allowed, float32 on both sides
    reward_tolerance: float = 1e-6  # |claimed - recomputed| reward allowed
    advantage_tolerance: float = 1e-4  # |claimed - (r - mean)/(std + 1e-6)| allowed

    def validate(self) -> None:
        if self.chunk_tokens < 1:
            raise ValueError(f"chunk_tokens: must be >= 1, got {self.chunk_tokens}")
        if not 1 <= self.topk <= MAX_TOPK:
            raise ValueError(f"topk: must be 1..{MAX_TOPK}, got {self.topk}")
        if not 0 <= self.max_exp_mismatches <= self.topk:
            raise ValueError(f"max_exp_mismatches: must be 0..topk ({self.topk}), got {self.max_exp_mismatches}")
        for name in (
            "max_mantissa_mean",
            "max_mantissa_median",
            "logprob_tolerance_mean",
            "logprob_tolerance_max",
            "logprob_tolerance_mean_fp32",
            "logprob_tolerance_max_fp32",
            "reward_tolerance",
            "advantage_tolerance",
        ):
            value = getattr(self, name)
            if not value >= 0:  # also rejects NaN
                raise ValueError(f"{name}: must be >= 0, got {value}")
