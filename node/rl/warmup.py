"""Brief supervised warm-up of a fresh model on a task's format, and the embedded default model built with it.

Why: a randomly initialised model emits uniform noise over ~100 characters, so every sample of a
group scores 0, every advantage is 0 and GRPO has nothing to learn from. INTELLECT-2 started from a
strong reasoning model (QwQ-32B); the tiny demo model gets the same kind of head start, a few
hundred cheap next-token steps on *separately generated* examples (a different seed from the packaged
task set), stopped early on purpose so that RL still has a clear gap to close on the demo.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..engines.model import TinyModelSpec, build_tiny_model, build_tokenizer, save_model_folder
from .synthetic import make_reversal_tasks


@dataclass
class WarmupStats:
    steps: int
    first_loss: float
    last_loss: float


def supervised_warmup(model, tokenizer, pairs: Sequence[tuple[str, str]], steps: int, batch_size: int = 32,
                      lr: float = 3e-3, seed: int = 0) -> WarmupStats:
    """Cross-entropy on completion tokens (prompt tokens are context only) of (prompt, answer) pairs.

    The completion is the answer followed by eos. Deterministic for a given seed.
    """
    if steps <= 0 or not pairs:
        return WarmupStats(0, float("nan"), float("nan"))
    gen = torch.Generator().manual_seed(seed)
    encoded = []
    for prompt, answer in pairs:
        p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        c = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        encoded.append((p, c))
    pad = tokenizer.pad_token_id
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    first = last = float("nan")
    for step in range(steps):
        idx = torch.randint(len(encoded), (batch_size,), generator=gen).tolist()
        rows = [encoded[i] for i in idx]
        L = max(len(p) + len(c) for p, c in rows)
        ids = torch.full((batch_size, L), pad, dtype=torch.long)
        labels = torch.full((batch_size, L), -100, dtype=torch.long)
        attn = torch.zeros((batch_size, L), dtype=torch.long)
        for r, (p, c) in enumerate(rows):
            seq = p + c
            ids[r, :len(seq)] = torch.tensor(seq)
            labels[r, len(p):len(seq)] = torch.tensor(c)
            attn[r, :len(seq)] = 1
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        last = float(loss.detach())
        if step == 0:
            first = last
    model.eval()
    return WarmupStats(steps, first, last)


# Supervised warm-up of the default model on the synthetic task's format (supervised_warmup above):
# enough that sampled completions score ~0.1 on the digit-reversal reward (greedy ~0.3) and most
# groups carry signal, leaving RL a wide gap to close. Examples come from a seed different from
# the packaged task set's.
DEFAULT_WARMUP_STEPS = 30
WARMUP_EXAMPLES = 5000
WARMUP_SEED = 12345


def create_default_model(path: Path, *, seed: int = 0, warmup_steps: int = DEFAULT_WARMUP_STEPS,
                         spec: TinyModelSpec = TinyModelSpec()):
    """The demo's default model: the tiny Qwen2 plus a short supervised warm-up (0 = random init).

    Returns ``(path, warmup_stats)``; ``warmup_stats`` is None when no warm-up ran.
    """
    tok = build_tokenizer()
    model = build_tiny_model(len(tok), tok.eos_token_id, tok.pad_token_id, spec, seed)
    stats = None
    if warmup_steps > 0:
        pairs = [(t["prompt"], t["answer"]) for t in make_reversal_tasks(WARMUP_EXAMPLES, seed=WARMUP_SEED)]
        stats = supervised_warmup(model, tok, pairs, warmup_steps, seed=seed)
    return save_model_folder(model, tok, path), stats
