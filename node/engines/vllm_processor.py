"""The vLLM side of node/engines/vllm_gumbel.py: our seeded Gumbel-max as a vLLM V1 logits processor.

Loaded by vLLM in its engine core process (``LLM(logits_processors=[PROCESSOR])``); importing this
module needs vLLM, which is why the rule itself lives in the vLLM-free vllm_gumbel.py.
"""

from __future__ import annotations

from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

from .vllm_gumbel import GumbelDraws, parse_draw


class GumbelMaxProcessor(LogitsProcessor):
    """Each request with our ``extra_args`` gets exactly the token the torch engine's sampler draws."""

    def __init__(self, vllm_config, device, is_pin_memory) -> None:
        self.draws = GumbelDraws()

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        parse_draw(sampling_params.extra_args)  # a malformed entry: vLLM refuses the request

    def is_argmax_invariant(self) -> bool:
        return False  # it decides the argmax: vLLM must run it for greedy requests too

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is not None:
            self.draws.update(batch_update.removed, batch_update.added, batch_update.moved)

    def apply(self, logits):
        return self.draws.apply(logits)
