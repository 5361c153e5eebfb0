"""The run's tables the inference role reads, handed in by its composition (node/roles/inference.py).

Kept free of torch, trio and libp2p, like the tables themselves.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..proofs.config import ProofsConfig
from ..rl.config import GRPOConfig, InferenceConfig, RLConfig
from ..rollouts.config import WorkerConfig


@dataclass(frozen=True)
class InferenceSections:
    """What the inference service reads of the run; each defaults to a run file without that table."""

    worker: WorkerConfig = field(default_factory=WorkerConfig)  # its outbox, submissions and retries (and cheat)
    rl: RLConfig = field(default_factory=RLConfig)  # what to sample: task set, group size, temperature...
    inference: InferenceConfig = field(default_factory=InferenceConfig)  # which engine samples, in which dtype
    proofs: ProofsConfig = field(default_factory=ProofsConfig)  # how each sample is proven
    grpo: GRPOConfig = field(default_factory=GRPOConfig)  # async_level: how old its weights may be
