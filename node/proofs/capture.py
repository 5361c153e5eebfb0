"""Final hidden states for TOPLOC: recorded during generation, recomputed by a validator's prefill.

Which positions are proven (builder and verifier must agree exactly):

    A prompt of L tokens and a completion c_0 .. c_{T-1} form the sequence s_0 .. s_{L+T-1}.
    The "decode position" of completion token c_i is position L-1+i: the position whose final
    hidden state (the output of the model's final norm, before the LM head) produced the logits
    c_i was sampled from. So the proven states are those at positions L-1 .. L+T-2, one per
    generated token, in order. The state at the last position L+T-1 is never computed during
    generation and is not proven.

During ``generate()`` these are exactly the last position of each forward call: the prefill
call's last prompt position produces c_0, and decode step i (fed c_{i-1}) produces c_i. A
validator gets the same states from one prefill of prompt+completion, sliced with
:func:`decode_positions`. This matches INTELLECT-2's vLLM capture (a hook before the logits
processor, prefill skipped) and the TOPLOC paper's setting (final hidden states, §3).

Pure torch; no network imports (this module runs on GPU machines alone).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence

import torch
from torch import nn

# Attribute names of the final norm in Hugging Face decoder stacks (Llama/Qwen2/Mistral: norm;
# GPT-2/Bloom: ln_f; Phi: final_layernorm; OPT: final_layer_norm; Mamba: norm_f).
FINAL_NORM_NAMES = ("norm", "ln_f", "final_layernorm", "final_layer_norm", "norm_f")


def find_final_norm(model: nn.Module) -> nn.Module:
    """The module whose output is the final hidden state of a Hugging Face causal LM."""
    candidates: list[nn.Module] = []
    get_decoder = getattr(model, "get_decoder", None)
    if callable(get_decoder):
        with contextlib.suppress(Exception):
            candidates.append(get_decoder())
    candidates += [getattr(model, a) for a in ("model", "transformer", "base_model") if hasattr(model, a)]
    candidates.append(model)
    for owner in candidates:
        if isinstance(owner, nn.Module):
            for name in FINAL_NORM_NAMES:
                mod = getattr(owner, name, None)
                if isinstance(mod, nn.Module):
                    return mod
    raise ValueError(f"cannot find the final norm of {type(model).__name__} (looked for {FINAL_NORM_NAMES})")


def _output_tensor(output: object) -> torch.Tensor:
    return output[0] if isinstance(output, (tuple, list)) else output  # type: ignore[return-value]


class HiddenCapture:
    """Final hidden states recorded by :func:`capture_final_hidden`, one entry per forward call."""

    def __init__(self) -> None:
        self._steps: list[torch.Tensor] = []  # each (B, H): the last position of one forward call

    def _record(self, _module: nn.Module, _args: object, output: object) -> None:
        self._steps.append(_output_tensor(output)[:, -1, :].detach())

    @property
    def num_steps(self) -> int:
        return len(self._steps)

    def clear(self) -> None:
        """Forget what was recorded (call between two ``generate()`` calls in one context)."""
        self._steps.clear()

    def stacked(self) -> torch.Tensor:
        """(B, S, H): the state that produced generated token s of every row, s < S."""
        if not self._steps:
            raise ValueError("nothing captured: was generate() called inside the context?")
        return torch.stack(self._steps, dim=1)

    def per_sequence(self, lengths: Sequence[int]) -> list[torch.Tensor]:
        """Row b's (lengths[b], H) decode states: pass each completion's length (EOS included)."""
        states = self.stacked()
        if len(lengths) != states.shape[0]:
            raise ValueError(f"{len(lengths)} lengths for a batch of {states.shape[0]}")
        if any(not 0 <= n <= states.shape[1] for n in lengths):
            raise ValueError(f"lengths {list(lengths)} exceed the {states.shape[1]} captured steps")
        return [states[b, :n] for b, n in enumerate(lengths)]


@contextlib.contextmanager
def capture_final_hidden(model: nn.Module) -> Iterator[HiddenCapture]:
    """Record the final norm's output at the last position of every forward call of ``model``.

    Use around one ``model.generate(...)`` (greedy or sampled, with KV cache; not with speculative
    or assisted decoding, which run several positions per step). Then
    ``capture.per_sequence(completion_lengths(new_tokens, eos_ids))`` gives each completion's
    (T_b, H) states, ready for ``node.proofs.toploc.build_proofs``.
    """
    capture = HiddenCapture()
    handle = find_final_norm(model).register_forward_hook(capture._record)
    try:
        yield capture
    finally:
        handle.remove()


def completion_lengths(new_tokens: torch.Tensor, eos_token_ids: Iterable[int]) -> list[int]:
    """(B, S) generated ids -> per row, the length up to and including the first EOS (else S)."""
    eos = torch.tensor(sorted(set(eos_token_ids)), dtype=new_tokens.dtype, device=new_tokens.device)
    is_eos = torch.isin(new_tokens, eos)  # (B, S)
    first = torch.where(is_eos.any(dim=1), is_eos.int().argmax(dim=1) + 1, new_tokens.shape[1])
    return [int(n) for n in first]


def decode_positions(prompt_len: int, completion_len: int) -> slice:
    """Positions of prompt+completion whose final states produced the completion's tokens."""
    if prompt_len < 1:
        raise ValueError("a prompt needs at least one token")
    return slice(prompt_len - 1, prompt_len - 1 + completion_len)


@torch.no_grad()
def prefill_hidden_states(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """(B, T) ids -> (B, T, H) final hidden states of one forward pass (no KV cache kept)."""
    captured: list[torch.Tensor] = []
    hook = find_final_norm(model).register_forward_hook(lambda _m, _a, out: captured.append(_output_tensor(out)))
    try:
        model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    finally:
        hook.remove()
    if len(captured) != 1:
        raise RuntimeError(f"final norm ran {len(captured)} times in one forward pass")
    return captured[0].detach()


@torch.no_grad()
def recompute_decode_states(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    pad_token_id: int = 0,
) -> list[torch.Tensor]:
    """A validator's side: per sample, the (T_i, H) decode states of completion i after prompt i.

    One right-padded batched prefill; right padding leaves every real position's causal context
    unchanged, so its states match an unpadded forward up to kernel-level numeric noise.
    """
    if len(prompts) != len(completions):
        raise ValueError("one completion per prompt")
    if not prompts:
        return []
    seqs = [list(p) + list(c) for p, c in zip(prompts, completions)]
    width = max(len(s) for s in seqs)
    device = next(model.parameters()).device
    ids = torch.full((len(seqs), width), pad_token_id, dtype=torch.long, device=device)
    mask = torch.zeros((len(seqs), width), dtype=torch.long, device=device)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, : len(s)] = 1
    hidden = prefill_hidden_states(model, ids, mask)  # (B, W, H)
    return [hidden[i, decode_positions(len(p), len(c))] for i, (p, c) in enumerate(zip(prompts, completions))]


def logits_from_hidden(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """Final states (..., H) -> float32 logits (..., V) through the LM head's weights.

    Exact for Llama/Qwen2-style linear heads (no soft-capping or scaling). Computed in float32
    whatever the model's dtype: a bf16 head rounds logits of magnitude ~10 by ~0.04, which would eat
    the log-prob tolerance; the sampler's own logits should be taken the same way. Decode states
    (T, H) give the logits each completion token was sampled from, so a validator recomputes
    log-probabilities from the same prefill that checks the proofs.
    """
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        raise TypeError(f"{type(model).__name__}: output embeddings are not a linear layer")
    with torch.no_grad():
        bias = None if head.bias is None else head.bias.float()
        return nn.functional.linear(hidden.float(), head.weight.float(), bias)
