"""What TOPLOC costs beside generation, measured in the same run on the same model.

    .venv/bin/python bench/proofs.py                      # tiny Llama on the CPU (< 2 minutes)
    .venv/bin/python bench/proofs.py --preset qwen0.5b --device cuda   # ~0.5B Qwen2-shaped, bf16

Baseline: sampling the same tokens with Hugging Face ``generate`` (KV cache), with the hidden-state
capture hook on. Project figures: building the proofs from the captured states, and a validator's
work (one batched prefill of prompt+completion, then verification). Printed last: build time as a
fraction of generation time, and how many times faster validation is than generation (the TOPLOC
paper reports up to 100x on GPU). Random-init weights: speed does not depend on them.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import transformers

from node.proofs.capture import (
    capture_final_hidden,
    completion_lengths,
    recompute_decode_states,
)
from node.proofs.config import ProofsConfig
from node.proofs.toploc import build_proofs_many, summarize, verify_proofs
from quick import parse_args  # bench/, the script's own folder

PRESETS = {
    # hidden, intermediate, layers, heads, kv heads, vocab, tied embeddings
    "tiny": (256, 512, 4, 4, 2, 256, False),
    "qwen0.5b": (896, 4864, 24, 14, 2, 151936, True),  # Qwen2-0.5B's shape, 494M parameters
}


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device: str, repeat: int = 1):
    """(best wall time over ``repeat`` runs, last result)."""
    best, result = float("inf"), None
    for _ in range(repeat):
        sync(device)
        t0 = time.perf_counter()
        result = fn()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best, result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--repeat", type=int, default=3, help="repeats of the cheap steps (best is kept)")
    args = parse_args(ap, {"batch": 4, "new_tokens": 32, "repeat": 1})

    hidden, inter, layers, heads, kv, vocab, tied = PRESETS[args.preset]
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv, vocab_size=vocab, initializer_range=0.2, eos_token_id=None, tie_word_embeddings=tied,
    )
    dtype = getattr(torch, args.dtype)
    model = transformers.LlamaForCausalLM(cfg).to(dtype).to(args.device).eval()
    params = sum(p.numel() for p in model.parameters())
    pcfg = ProofsConfig()
    prompts = torch.randint(3, vocab, (args.batch, args.prompt_len), device=args.device)

    def generate(n: int = args.new_tokens):
        with capture_final_hidden(model) as cap, torch.no_grad():
            out = model.generate(
                prompts, attention_mask=torch.ones_like(prompts), do_sample=True, max_new_tokens=n,
                min_new_tokens=n, pad_token_id=0,
            )
        new = out[:, args.prompt_len :]
        return new, cap.per_sequence(completion_lengths(new, [-1]))

    generate(4)  # warm-up (allocator, kernels)
    t_gen, (new, states) = timed(generate, args.device)
    tokens = int(new.numel())
    t_build, proofs = timed(lambda: build_proofs_many(states, pcfg.chunk_tokens, pcfg.topk), args.device, args.repeat)
    completions = new.tolist()
    prompt_list = prompts.tolist()
    t_prefill, vstates = timed(lambda: recompute_decode_states(model, prompt_list, completions), args.device, args.repeat)
    t_verify, verdicts = timed(lambda: [verify_proofs(s, p, pcfg) for s, p in zip(vstates, proofs)], args.device, args.repeat)
    assert all(v.ok for v in verdicts), [v.check for v in verdicts if not v.ok]

    print(f"model: Llama-shaped {args.preset}, {params / 1e6:.1f}M parameters, {args.dtype} on {args.device}; "
          f"batch {args.batch} x {args.new_tokens} new tokens after {args.prompt_len}-token prompts ({tokens} tokens)")
    print(f"proofs: {len(proofs[0])} per sequence, {len(proofs[0][0])} bytes each; {summarize(verdicts)}")
    rows = [
        ("generate + capture (baseline)", t_gen),
        ("build proofs", t_build),
        ("validator prefill", t_prefill),
        ("verify proofs", t_verify),
        ("validation = prefill + verify", t_prefill + t_verify),
    ]
    print(f"{'step':32s} {'seconds':>9s} {'tokens/s':>11s}")
    for name, t in rows:
        print(f"{name:32s} {t:9.4f} {tokens / t:11.0f}")
    print(f"build / generation:             {t_build / t_gen:.4f}  ({100 * t_build / t_gen:.2f}% of generation time)")
    print(f"generation / validation:        {t_gen / (t_prefill + t_verify):.1f}x  (validation is that many times faster)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
