"""The one interface every generation engine implements, and the sample it returns.

An engine owns one model in memory. ``load(path)`` reads a Hugging Face folder; ``swap_weights(path)``
replaces the weights with those of a newer checkpoint of the same architecture *in place* (no process
restart, no re-allocation of the engine), which is how an inference node follows the trainer's
versions. ``generate`` samples ``n`` completions per prompt and returns, for each, the token ids,
the per-token log-probabilities under the tempered sampling distribution, and the final hidden states
(after the last norm) that TOPLOC proofs are built from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

FINISH_STOP = "stop"  # the sequence ended with the eos token (included in completion_ids)
FINISH_LENGTH = "length"  # max_new_tokens reached without eos


@dataclass
class Sample:
    """One sampled completion of one prompt."""

    prompt_index: int  # index into the prompts given to generate()
    sample_index: int  # 0..n-1 within its prompt's group
    seed: int  # per-sequence sampling seed (see sampling.sequence_seed)
    prompt_ids: list[int]
    completion_ids: list[int]  # generated tokens, eos included when finish_reason == "stop"
    logprobs: list[float]  # log softmax(logits / T)[token] per completion token
    finish_reason: str  # FINISH_STOP | FINISH_LENGTH
    hidden: Any = None  # torch.Tensor (len(completion_ids), H) on CPU in the model's dtype; None if not captured
    text: str = ""  # decoded completion without special tokens (for verifiers)

    @property
    def num_tokens(self) -> int:
        return len(self.completion_ids)


@dataclass
class SamplingParams:
    """How to sample; stamped into every rollout so validators can check it."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    seed: int = 0
    capture_hidden: bool = True
    extra: dict = field(default_factory=dict)


@runtime_checkable
class Engine(Protocol):
    """What the inference role needs from any generation backend."""

    name: str  # stated in every batch (RolloutBatch.engine): decides which checks a validator runs

    @property
    def dtype_name(self) -> str:
        """The dtype the loaded model runs in ("float32" | "bfloat16" | "float16"), stated in every batch."""

    def load(self, path: Path) -> None:
        """Load the model (and tokenizer) of a local HF folder."""

    def swap_weights(self, path: Path) -> None:
        """Replace the weights with those in ``path`` (same architecture) without restarting."""

    @property
    def tokenizer(self) -> Any:
        """The tokenizer of the loaded model (encode prompts, decode completions)."""

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
        seed: int,
        capture_hidden: bool = True,
    ) -> list[list[Sample]]:
        """``n`` samples for each prompt (token ids), grouped per prompt, in prompt order."""
