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
    """TOPLOC and rollout-check parameters shared by inference nodes and validators.

    How the log-prob tolerances were chosen, and their margin over honest work. The bf16-sized pair
    (mean 0.1, per token 1.0) comes from the first proofs tests (commit b457c6a): bf16 KV-cache
    decoding against one bf16 prefill of a 4-layer random model moved a rollout's log-probs by mean
    |Δ| <= 0.06 and max <= 0.26 (margins 1.7x and 3.8x), while a replaced token moves its own by
    nats. The float32 pair (1e-3, 1e-2) is issue 42's (node/proofs/checks.py ``logprob_tolerances``).
    Per engine, against the trainer's float32 recomputation at the same weights (node/rl/mismatch.py;
    ``bench/vllm_cpu.py --dtype bfloat16 --batch 8 --tokens 32 --repeats 1``: 20 steps of 8 prompts,
    embedded model, one busy CPU), both engines in bfloat16: the torch engine's largest token |Δ|
    6.9e-3 (margin 145x under 1.0) and largest sample mean 2.9e-3 (34x under 0.1); vLLM-CPU's 5.9e-3
    (171x) and 2.0e-3 (51x); no token beyond; KL ~1e-6 against prime-rl's 0.015 admission line. In
    float32 (``bench/vllm_cpu.py``, 64 tokens) both engines' largest token |Δ| was 1e-6: 1e4x under
    1e-2. No GPU engine has been measured: a GPU's bf16 kernels may differ more.
    """

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
