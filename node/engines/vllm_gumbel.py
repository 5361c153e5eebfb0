"""Our seeded Gumbel-max sampling inside vLLM, so a validator replays vLLM's draws as it replays the
torch engine's (issue 41 item 4; issue 42 hole 1: a batch's tokens must be the ones its seed draws,
whatever engine the batch names).

How this works
--------------
vLLM V1 calls a deployment's logits processors (``LLM(logits_processors=[...])``) on the batch's
(num requests, V) float32 logits before its sampler picks a token. The vLLM engine sends every
sequence at vLLM temperature 0 (greedy: vLLM draws nothing, it takes the argmax) with our sampling
parameters in ``SamplingParams.extra_args[EXTRA_KEY] = [sequence seed, temperature, top-p]``. For
each such request the processor (:class:`GumbelDraws`, wrapped for vLLM in
node/engines/vllm_processor.py) runs :func:`node.engines.sampling.sample_tokens`, the torch engine's
own sampler: logits / T, the top-p mask, the counter-based Gumbel noise of (sequence seed, decode
step), argmax in float64. It then writes 0 at the chosen token and -inf everywhere else in that row,
so vLLM's argmax is exactly our choice. The decode step is the number of tokens the request has
produced so far: the length of the ``output_tok_ids`` list vLLM hands the processor with each new
request and keeps current (its own min_tokens processor counts the same way; with async scheduling,
on a GPU, the not-yet-known token is a placeholder that still counts). A validator replays the draw
from its own prefill's logits, seed and step (node/validator/pipeline.py ``check_sampling_replay``),
exactly as for a torch batch: the engines differ only by the float noise of their logits, which
``sampling_tolerance`` absorbs.

What following this rule gives up
---------------------------------
* **vLLM's sampler**: its top-k/top-p kernels (FlashInfer's on a GPU), its per-request random
  generators, min-p. Sampling is torch code on the logits: a (B, V) hash, softmax (and sort under
  top-p) per step, in float64 for the noise; bench/vllm_replay.py measures the cost.
* **Speculative decoding**: vLLM refuses custom logits processors with it (drafts would not follow
  our noise anyway).
* **Model Runner V2**, the GPU build's default in 0.32: it takes processors of another interface, so
  the engine runs vLLM's V1 model runner (the one the CPU build runs, where this was tested).
* **vLLM's logit edits**: penalties, logit bias, bad words, allowed tokens, structured outputs. The
  engine sets none of them, and the validator's replay knows none.
* **Processed log-probs**: at temperature 0 vLLM's "processed" log-probs would be those of the
  one-hot row. The engine asks for ``logprobs_mode = "raw_logprobs"`` (log softmax of the model's
  logits, before any processor or temperature), which is our convention, log softmax(logits / T),
  at T = 1; at any other temperature it claims the proof prefill's log-probs.

Pure tensor code, no vLLM import: node/engines/vllm_processor.py adapts it to vLLM's interface.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from .sampling import sample_tokens

EXTRA_KEY = "swarm_gumbel"  # SamplingParams.extra_args key: [sequence seed, temperature, top-p]


@dataclass(frozen=True)
class Draw:
    """How one request samples: its sequence seed (63 bits), temperature and top-p, and vLLM's live
    list of the tokens it has produced so far (its length is the decode step)."""

    seed: int
    temperature: float
    top_p: float
    output: Sequence[int]


def draw_args(seed: int, temperature: float, top_p: float) -> dict[str, list]:
    """The ``extra_args`` of a request that samples with our rule."""
    return {EXTRA_KEY: [int(seed), float(temperature), float(top_p)]}


def parse_draw(extra_args, output: Sequence[int] = ()) -> Draw | None:
    """The :class:`Draw` of a request's ``extra_args``, None when it does not use our rule.

    Raises ValueError for a malformed entry (vLLM then refuses the request at admission)."""
    entry = (extra_args or {}).get(EXTRA_KEY)
    if entry is None:
        return None
    try:
        seed, temperature, top_p = entry
        seed, temperature, top_p = int(seed), float(temperature), float(top_p)
    except (TypeError, ValueError):
        raise ValueError(f"extra_args[{EXTRA_KEY!r}]: [seed, temperature, top_p], got {entry!r}") from None
    if not 0 <= seed < 1 << 63 or not temperature > 0 or not 0 < top_p <= 1:
        raise ValueError(f"extra_args[{EXTRA_KEY!r}]: seed in [0, 2**63), temperature > 0, top_p in (0, 1]: {entry!r}")
    return Draw(seed, temperature, top_p, output)


class GumbelDraws:
    """The processor's state: which batch slot holds which :class:`Draw`, kept in step with vLLM's
    persistent batch (requests added, removed, moved or swapped between slots), and the
    logits rewrite itself."""

    def __init__(self) -> None:
        self.slots: dict[int, Draw] = {}

    def update(self, removed: Iterable[int], added: Iterable[tuple], moved: Iterable[tuple]) -> None:
        """Apply one of vLLM's ``BatchUpdate``\\s, in its documented order: removed, added, moved.

        ``added`` holds (slot, SamplingParams, prompt ids, output ids); ``moved`` holds (from, to,
        directionality), a swap when the directionality is named ``SWAP``, else a one-way move."""
        for slot in removed:
            self.slots.pop(slot, None)
        for slot, params, _prompt, output in added:
            draw = parse_draw(getattr(params, "extra_args", None), output)
            if draw is None:
                self.slots.pop(slot, None)
            else:
                self.slots[slot] = draw
        for a, b, how in moved:
            da, db = self.slots.pop(a, None), self.slots.pop(b, None)
            if da is not None:
                self.slots[b] = da
            if db is not None and getattr(how, "name", "") == "SWAP":
                self.slots[a] = db

    def choose(self, logits: torch.Tensor) -> dict[int, int]:
        """Slot -> the token our rule draws from that row of ``logits`` (num rows, V); rows are
        grouped by (step, temperature, top-p) and each group sampled as the torch engine does."""
        groups: dict[tuple[int, float, float], list[int]] = {}
        for slot, d in self.slots.items():
            if slot < logits.shape[0]:
                groups.setdefault((len(d.output), d.temperature, d.top_p), []).append(slot)
        out: dict[int, int] = {}
        for (step, temperature, top_p), slots in groups.items():
            seeds = torch.tensor([self.slots[s].seed for s in slots], dtype=torch.int64, device=logits.device)
            tokens, _ = sample_tokens(logits[slots], seeds, step, temperature, top_p)
            out.update(zip(slots, tokens.tolist()))
        return out

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Rewrite each of our rows to 0 at the drawn token and -inf elsewhere (in place), so a
        greedy argmax takes exactly that token; other rows are left alone."""
        chosen = self.choose(logits)
        if chosen:
            rows = torch.tensor(list(chosen), device=logits.device)
            cols = torch.tensor(list(chosen.values()), device=logits.device)
            logits[rows] = float("-inf")
            logits[rows, cols] = 0.0
        return logits
