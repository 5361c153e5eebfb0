"""``[worker]``: how an inference node runs its loop and delivers its batches.

What to sample (group size, temperature, task set...) is the run's ``[rl]`` table and which engine
runs it is ``[inference]`` (both in node/rl/config.py); this table holds the inference role's own
plumbing: the outbox of unsent batches, submission timeouts and retries, and the demo's cheating
modes. Kept free of torch, trio and libp2p so ``node.config`` can import it cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass

# Deliberately dishonest behaviours, for demos and for testing validators end to end. Each one is
# something a real cheater might try; the validator must reject every one of them.
CHEATS = (
    "",  # honest
    "perturbed-model",  # generate with slightly changed weights (cheaper/quantised model): proofs fail
    "fake-rewards",  # claim reward 1.0 for every sample: reward check fails
    "cherry-pick",  # solve tasks other than the drawn ones: task check fails
    "replay",  # send every batch twice: duplicate batch id
    "drop-groups",  # leave out the group of the prompt it did worst on: incomplete-batch check fails
    "early-exit",  # completions that exit before the code tests, claimed at 1.0: reward check fails
    "free-sandbox",  # endless-loop code with garbage proofs: proof check fails before any sandbox runs
    "pasted-answers",  # right answers written in, re-proved, stated as vLLM's: the sampling replay fails
    "sybil-flood",  # junk under a fresh key per batch into the fresh-identity pool: newcomers keep their share
)


@dataclass
class WorkerConfig:
    """The inference role's loop: outbox, submission and retries."""

    max_pending_batches: int = 8  # unsent batches kept; generation waits when the outbox is full
    submit_timeout_s: float = 30.0  # one submission (write the batch, read the ack) to one trainer
    max_attempts: int = 6  # failures after reaching a trainer (reset, timeout, bad ack) before a batch is dropped
    backoff_s: float = 1.0  # first wait before retrying a trainer that failed; doubles per failure
    backoff_max_s: float = 30.0  # cap of that wait
    max_batch_bytes: int = 4 * 1024 * 1024 - 4096  # signed batch size cap; bigger step outputs are split
    cheat: str = ""  # "" (honest) or one of CHEATS: a deliberately dishonest node for demos and tests

    def validate(self) -> None:
        if not 1 <= self.max_pending_batches <= 1024:
            raise ValueError("max_pending_batches: 1..1024")
        if self.submit_timeout_s <= 0:
            raise ValueError("submit_timeout_s: > 0")
        if self.max_attempts < 1:
            raise ValueError("max_attempts: >= 1")
        if not 0 < self.backoff_s <= self.backoff_max_s:
            raise ValueError("backoff_s: > 0 and <= backoff_max_s")
        if not 64 * 1024 <= self.max_batch_bytes <= 4 * 1024 * 1024 - 4096:
            raise ValueError("max_batch_bytes: 64 KiB .. 4 MiB - 4 KiB (one wire frame)")
        if self.cheat not in CHEATS:
            raise ValueError(f"cheat: one of {', '.join(repr(c) for c in CHEATS)}")
