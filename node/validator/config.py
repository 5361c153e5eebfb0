"""The ``[validator]`` table of the run file: queue bounds, checkpoint cache, tolerances, penalties.

Kept free of torch and libp2p so ``node.config`` can build it anywhere. The TOPLOC thresholds and the
log-prob / reward / advantage tolerances live in ``[proofs]`` (every builder and checker shares them);
the run's sampling parameters and task set in ``[rl]``; the staleness bound in ``[grpo]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..net.budget import StreamsConfig
from ..proofs.config import ProofsConfig
from ..rl.config import GRPOConfig, InferenceConfig, RLConfig
from ..rollouts.quota import QuotaConfig


@dataclass
class ValidatorConfig:
    """How a validator checks batches and punishes cheats (trainers read the ban settings too)."""

    queue_size: int = 64  # batches waiting to be checked; a full queue answers "busy" (trainer tries the next)
    keep_models: int = 2  # checkpoint versions kept loaded in memory (a batch may be async_level old)
    device: str = "auto"  # where the validator's prefill runs: auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # prefill dtype: auto (the run's [inference] dtype) | float32 | bfloat16 | float16
    # Gumbel-max replay (TOPLOC2-style): the sampled token's score may trail the best score by at
    # most this much (logit units), to absorb prefill-vs-decode numeric noise (fp32: ~1e-5; bf16: ~1e-2).
    sampling_tolerance: float = 0.05
    check_sampling: bool = True  # replay each token's seeded Gumbel-max choice from the validator's logits
    # Verifier time per batch, spent only on samples that passed every model check; samples not reached
    # are rejected as score_budget (a penalty point): four code time limits (5 s each) plus slack.
    score_budget_s: float = 25.0
    check_seed: bool = True  # the batch seed must be node.rl.spec.sampling_seed(step_key(run, worker, root, step))
    penalty_points: int = 1  # points a rejected batch costs its worker (benign reasons such as staleness cost 0)
    ban_threshold: int = 3  # points within penalty_window that trigger a ban
    penalty_window: float = 3600.0  # seconds over which penalty points add up
    ban_seconds: int = 1800  # how long a ban lasts (trainers and validators refuse the worker's batches)
    deliver_retry: float = 2.0  # seconds between attempts to hand a verdict to an unreachable trainer
    max_pending_verdicts: int = 4096  # signed verdicts awaiting delivery, kept on disk (oldest dropped past this)

    def validate(self) -> None:
        if not 1 <= self.queue_size <= 100_000:
            raise ValueError(f"queue_size: 1..100000, got {self.queue_size}")
        if not 1 <= self.keep_models <= 16:
            raise ValueError(f"keep_models: 1..16, got {self.keep_models}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype: auto | float32 | bfloat16 | float16, got {self.dtype!r}")
        for name in ("penalty_window", "deliver_retry", "score_budget_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        if not self.sampling_tolerance >= 0:
            raise ValueError(f"sampling_tolerance: must be >= 0, got {self.sampling_tolerance}")
        if self.penalty_points < 0 or self.ban_threshold < 1:
            raise ValueError("penalty_points >= 0 and ban_threshold >= 1")
        if not 0 <= self.ban_seconds <= 30 * 86400:
            raise ValueError(f"ban_seconds: 0..2592000 (30 days), got {self.ban_seconds}")
        if self.max_pending_verdicts < 1:
            raise ValueError("max_pending_verdicts: >= 1")


@dataclass(frozen=True)
class ValidatorSections:
    """The run's tables the validator reads, handed in by its role (node/roles/validator.py); each
    defaults to a run file without that table."""

    validator: ValidatorConfig = field(default_factory=ValidatorConfig)  # this table
    rl: RLConfig = field(default_factory=RLConfig)  # the sampling parameters and task set every batch must carry
    grpo: GRPOConfig = field(default_factory=GRPOConfig)  # the staleness bound
    inference: InferenceConfig = field(default_factory=InferenceConfig)  # accepted engines and the prefill dtype
    proofs: ProofsConfig = field(default_factory=ProofsConfig)  # TOPLOC thresholds and tolerances
    quota: QuotaConfig = field(default_factory=QuotaConfig)  # the trainers' intake quota, scaled up as a backstop
    streams: StreamsConfig = field(default_factory=StreamsConfig)  # per-peer stream budgets of its handler
