"""Seeded, replayable token sampling: temperature, top-p, and Gumbel-max with counter-based noise.

How this works: to sample from softmax(z / T) restricted to the top-p nucleus we add Gumbel noise
g = -log(-log(u)) to the tempered, masked logits and take the argmax (the Gumbel-max trick; it draws
exactly from the softmax). The uniform u for (sequence seed, step, vocabulary index) comes from a
counter-based hash (splitmix64's finaliser over int64 tensors), not from a stateful RNG, so:

* a sequence's tokens depend only on its own seed and logits, never on which other sequences shared
  its batch, the batch order or the device;
* a validator holding the logits (from one prefill) and the seed can replay the sampling exactly —
  the idea prime-rl's TOPLOC2 adopted (per-sequence seeded Gumbel-max sampling).

All functions are pure tensor maths (no I/O, no global RNG).
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB


def _signed(x: int) -> int:
    """A uint64 constant as the int64 with the same bits (torch has no uint64 arithmetic)."""
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


def _srl(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 finaliser on int64 tensors; multiplication wraps modulo 2**64."""
    x = x ^ _srl(x, 30)
    x = x * _signed(_M1)
    x = x ^ _srl(x, 27)
    x = x * _signed(_M2)
    return x ^ _srl(x, 31)


def uniform_noise(seeds: torch.Tensor, step: int, vocab_size: int) -> torch.Tensor:
    """(B, V) float64 uniforms in (0, 1) from per-row seeds (B,) int64 and the decode step."""
    device = seeds.device
    base = _mix64(seeds.to(torch.int64) * _signed(_GOLDEN) + _signed(step * _M1 + 1))  # (B,)
    idx = torch.arange(vocab_size, dtype=torch.int64, device=device)  # (V,)
    x = _mix64(base[:, None] ^ (idx[None, :] * _signed(_GOLDEN)))  # (B, V)
    mant = _srl(x, 11).to(torch.float64)  # 53 random bits
    return (mant + 0.5) / float(1 << 53)


def top_p_mask(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Boolean (B, V): True for tokens kept by nucleus (top-p) filtering of softmax(logits).

    Keeps the smallest set of highest-probability tokens whose mass reaches ``top_p`` (the token that
    crosses the threshold is kept; the most likely token is always kept).
    """
    if top_p >= 1.0:
        return torch.ones_like(logits, dtype=torch.bool)
    probs = torch.softmax(logits.float(), dim=-1)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_p.cumsum(dim=-1) - sorted_p  # mass of strictly more likely tokens
    keep_sorted = mass_before < top_p
    keep_sorted[..., 0] = True
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


def sample_tokens(
    logits: torch.Tensor, seeds: torch.Tensor, step: int, temperature: float, top_p: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; returns (tokens (B,), log-probs (B,)).

    The log-prob is log softmax(logits / T) at the chosen token over the *full* vocabulary — the
    quantity the trainer recomputes (INTELLECT-2 divides logits by the sampling temperature) and the
    validator compares; with top_p < 1 it is not the nucleus-renormalised probability.
    ``temperature == 0`` means greedy.
    """
    z = logits.float()  # (B, V)
    if temperature <= 0:
        tokens = z.argmax(dim=-1)
        logp = torch.log_softmax(z, dim=-1)
    else:
        z = z / temperature
        logp = torch.log_softmax(z, dim=-1)
        keep = top_p_mask(z, top_p)
        u = uniform_noise(seeds, step, z.shape[-1])
        gumbel = -torch.log(-torch.log(u))  # float64
        scores = torch.where(keep, z.double() + gumbel, torch.tensor(float("-inf"), dtype=torch.float64, device=z.device))
        tokens = scores.argmax(dim=-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


def sequence_seed(seed: int, prompt_index: int, sample_index: int) -> int:
    """The per-sequence seed (63-bit) for sample ``sample_index`` of prompt ``prompt_index``."""
    from ..hashes import digest

    d = digest(f"swarm-sample:{seed}:{prompt_index}:{sample_index}".encode())
    return int.from_bytes(d[:8], "big") >> 1
