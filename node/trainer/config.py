"""``[trainer]``: how the trainer node keeps batches, talks to validators and stores checkpoints.

The GRPO hyper-parameters (async level, batch size, learning rate...) are the ``[grpo]`` table
(:class:`node.rl.config.GRPOConfig`); this table holds what only the trainer node needs.
Kept free of torch and libp2p so ``node.config`` can build it cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..net.budget import StreamsConfig
from ..proofs.config import ProofsConfig
from ..rl.config import GRPOConfig, InferenceConfig, RLConfig
from ..rollouts.config import WorkerConfig
from ..rollouts.quota import QuotaConfig

DEVICES_HINT = "auto | cpu | cuda | cuda:N"
PUBLISH_DTYPES = ("auto", "bfloat16", "float16", "float32")


@dataclass
class TrainerConfig:
    """``[trainer]`` table of the run file."""

    keep_checkpoints: int = 4  # K: model folders kept on the trainer's disk (async_level + 2 is enough)
    max_pending_batches: int = 256  # spooled batches not yet trained; beyond it intake answers "busy"
    max_step_samples: int = 1024  # cap on samples in one rollout step (batches are taken whole)
    max_concurrent_intake: int = 16  # rollout streams handled at once; more wait for a slot
    max_intake_per_peer: int = 4  # rollout streams one peer may hold at once (below max_concurrent_intake); more are refused
    verify_timeout_s: float = 120.0  # a validator silent this long on a batch is skipped for it
    max_verify_in_flight: int = 64  # batches sent to validators and awaiting a verdict
    # Of those, on one validator: the trainer, not a validator's FIFO, orders verification.
    max_verify_per_validator: int = 4
    # A batch every live validator answered "cannot judge yet" (checkpoint not held) is offered again
    # after this many seconds, while its slot serves batches they can judge (node/trainer/gate.py).
    unjudged_retry_s: float = 2.0
    # Pending batches above which acks tell workers to wait. 0 = adaptive: what the validators check
    # within [grpo] verify_grace_steps trainer steps, at most max_pending_batches // 2 (node/trainer/pacing.py).
    target_pending_batches: int = 0
    # Longest a step waits for verdicts on batches it would otherwise leave to expire (0: never waits).
    # Steps are counted in versions: small steps made as fast as verdicts come left the batches still
    # being checked behind (issue 39).
    step_hold_s: float = 30.0
    max_retry_after_s: float = 30.0  # longest wait an ack asks of a worker
    ban_after_strikes: int = 5  # invalid batches (forged, malformed, bad tokens...) that get a sender banned
    strike_window_s: float = 600.0  # ... when they fall within this many seconds
    ban_seconds: float = 3600.0  # how long a banned sender's streams are refused
    device: str = "auto"  # auto (cuda when present, else cpu) | cpu | cuda | cuda:N
    seed: int = 0  # seeds the torch RNG on first start (restored from the training state afterwards)
    init_warmup_steps: int = -1  # warm-up steps of a fresh embedded default model (-1 = node.rl.warmup's default, 0 = random)
    # Held-out evaluation (node/trainer/evaluation.py): greedy score of version 0 and of every
    # eval_every-th version on eval_tasks tasks no worker is asked to train on, in a separate
    # process at a low CPU priority (off the training path). 0 = off.
    eval_every: int = 5
    eval_tasks: int = 64  # evaluation tasks per version (a fixed draw: the same tasks for every version)
    eval_device: str = "cpu"  # where the evaluation process runs the model: cpu | auto | cuda | cuda:N
    eval_threads: int = 1  # torch threads of the evaluation process
    # Rescored before the update, among the samples the version held generated: one forward each.
    mismatch_samples: int = 8  # samples per step scored for each engine's log-prob mismatch (node/rl/mismatch.py); 0 = off
    # The weights of published checkpoints. The trainer trains float32 master weights and keeps them
    # in its state either way; bfloat16 halves the bytes every node fetches, and with a small learning
    # rate most bfloat16 values stay the same from one version to the next, so deltas are small
    # (node/shards/delta.py). Workers and validators then run what they fetched ([inference] dtype).
    publish_dtype: str = "auto"  # auto (float32, as trained) | bfloat16 | float16 | float32

    def pacing_target(self) -> int:
        """Pending batches at which back-pressure starts, or its cap when adaptive (node/trainer/pacing.py)."""
        return self.target_pending_batches or max(1, self.max_pending_batches // 2)

    def validate(self) -> None:
        if self.keep_checkpoints < 1:
            raise ValueError("keep_checkpoints: at least 1")
        if self.max_pending_batches < 1 or self.max_step_samples < 1 or self.max_concurrent_intake < 1:
            raise ValueError("max_pending_batches, max_step_samples, max_concurrent_intake: at least 1")
        if not 1 <= self.max_intake_per_peer < max(2, self.max_concurrent_intake):
            raise ValueError("max_intake_per_peer: 1..max_concurrent_intake - 1 (one peer never takes every slot)")
        if self.ban_after_strikes < 1 or self.strike_window_s <= 0 or self.ban_seconds < 0:
            raise ValueError("ban_after_strikes >= 1, strike_window_s > 0, ban_seconds >= 0")
        if self.verify_timeout_s <= 0:
            raise ValueError("verify_timeout_s: > 0")
        if not 0 < self.unjudged_retry_s <= self.verify_timeout_s:
            raise ValueError("unjudged_retry_s: in (0, verify_timeout_s]")
        if self.max_verify_in_flight < 1 or self.max_verify_per_validator < 1:
            raise ValueError("max_verify_in_flight, max_verify_per_validator: at least 1")
        if not 0 <= self.target_pending_batches <= self.max_pending_batches:
            raise ValueError("target_pending_batches: 0 (= max_pending_batches // 2) .. max_pending_batches")
        if not 0 <= self.step_hold_s <= 600:
            raise ValueError("step_hold_s: 0..600")
        if self.max_retry_after_s <= 0 or self.max_retry_after_s > 3600:
            raise ValueError("max_retry_after_s: in (0, 3600]")
        if self.init_warmup_steps < -1:
            raise ValueError("init_warmup_steps: -1 (default), 0 (none) or more")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ValueError(f"device: {DEVICES_HINT}")
        if not (self.eval_device in ("auto", "cpu", "cuda") or self.eval_device.startswith("cuda:")):
            raise ValueError(f"eval_device: {DEVICES_HINT}")
        if self.eval_every < 0:
            raise ValueError("eval_every: 0 (off) or every how many published versions to evaluate")
        if not 1 <= self.eval_tasks <= 4096 or not 1 <= self.eval_threads <= 256:
            raise ValueError("eval_tasks: 1..4096; eval_threads: 1..256")
        if self.publish_dtype not in PUBLISH_DTYPES:
            raise ValueError(f"publish_dtype: one of {' | '.join(PUBLISH_DTYPES)}")
        if not 0 <= self.mismatch_samples <= self.max_step_samples:
            raise ValueError(f"mismatch_samples: 0 (off)..max_step_samples ({self.max_step_samples})")


@dataclass(frozen=True)
class TrainerSections:
    """The run's tables the trainer reads, handed in by its role (node/roles/trainer.py); each
    defaults to a run file without that table."""

    trainer: TrainerConfig = field(default_factory=TrainerConfig)  # this table
    grpo: GRPOConfig = field(default_factory=GRPOConfig)  # the GRPO hyper-parameters and staleness bounds
    rl: RLConfig = field(default_factory=RLConfig)  # batch shape (prompts x group) and the evaluation's tasks
    inference: InferenceConfig = field(default_factory=InferenceConfig)  # the engines whose batches it takes
    worker: WorkerConfig = field(default_factory=WorkerConfig)  # the workers' outbox, which sizes the step window
    quota: QuotaConfig = field(default_factory=QuotaConfig)  # fresh identities' intake allowance
    proofs: ProofsConfig = field(default_factory=ProofsConfig)  # the validator's log-prob tolerances (mismatch figures)
    streams: StreamsConfig = field(default_factory=StreamsConfig)  # per-peer stream budgets of its handlers
