"""The Gumbel-max replay mirrors the engine's seeded sampler exactly (random logits, no model)."""

import pytest
import torch

from node.engines.sampling import sample_tokens, sequence_seed
from node.validator.pipeline import BatchReason, Replay, check_sampling_replay


def sampled(logits: torch.Tensor, seed: int, temperature: float, top_p: float) -> list[int]:
    """Tokens the engine samples from these per-step logits (one row per step) for ``seed``."""
    seeds = torch.tensor([seed])
    return [int(sample_tokens(logits[t : t + 1], seeds, t, temperature, top_p)[0]) for t in range(logits.shape[0])]


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9), (1.3, 0.5)])
def test_honest_tokens_replay_and_any_other_token_does_not(temperature, top_p):
    g = torch.Generator().manual_seed(0)
    replays = []
    for k in range(6):
        logits = torch.randn(12, 50, generator=g) * 3
        seed = sequence_seed(99, k, 0)
        replays.append(Replay(logits, sampled(logits, seed, temperature, top_p), seed))
    assert all(r.ok for r in check_sampling_replay(replays, temperature, top_p, tolerance=1e-6))

    swapped = [Replay(r.logits, r.tokens[:5] + [(r.tokens[5] + 1) % 50] + r.tokens[6:], r.seed) for r in replays]
    results = check_sampling_replay(swapped, temperature, top_p, tolerance=1e-6)
    assert all(not r.ok and r.reason is BatchReason.SAMPLING_MISMATCH and r.detail.startswith("token 5") for r in results)

    reseeded = [Replay(r.logits, r.tokens, r.seed + 1) for r in replays]  # right tokens, someone else's seed
    assert sum(not r.ok for r in check_sampling_replay(reseeded, temperature, top_p, tolerance=1e-6)) >= 5


def test_small_logit_noise_is_tolerated_and_bad_ids_are_rejected():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(20, 40, generator=g)
    tokens = sampled(logits, 7, 1.0, 1.0)
    noisy = logits + 1e-4 * torch.randn(20, 40, generator=g)  # prefill vs decode numerics
    assert check_sampling_replay([Replay(noisy, tokens, 7)], 1.0, 1.0, tolerance=0.05)[0].ok
    bad = check_sampling_replay([Replay(logits, tokens[:3] + [40], 7)], 1.0, 1.0, tolerance=0.05)[0]
    assert bad.reason is BatchReason.SAMPLING_MISMATCH and "outside the vocabulary" in bad.detail
