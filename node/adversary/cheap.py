"""Cheaper copies of the checkpoint, as a worker saving compute would run them (issue 42, hole 7).

The lie they tell: generate and prove with changed weights while claiming the run's checkpoint.
:func:`quantise_rows` is what an int-``b`` kernel computes (symmetric round-to-nearest, one scale per
output row, as LLM.int8 / GPTQ-style per-channel quantisers do); Gaussian noise of a relative scale
is node/validator/testing.py ``perturbed_model``. bench/cheap_model.py measures which of them the
validator's checks catch; tests/test_cheap_model.py pins the result.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def quantise_rows(model: torch.nn.Module, bits: int) -> torch.nn.Module:
    """``model`` with every weight matrix fake-quantised in place, per row, to ``bits``-bit integers
    (scale = the row's largest |w| / (2^(bits-1) - 1)); vectors (norms, biases) stay as they are,
    as quantisers leave them. Returns ``model``."""
    if not 2 <= bits <= 16:
        raise ValueError(f"bits: 2..16, got {bits}")
    top = 2 ** (bits - 1) - 1
    for p in model.parameters():
        if p.dim() == 2:
            w = p.float()
            scale = w.abs().amax(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / top
            p.copy_(((w / scale).round().clamp(-top, top) * scale).to(p.dtype))
    return model
