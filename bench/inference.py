"""Generation speed of the torch engine against plain Hugging Face ``generate``, same model, same run.

    .venv/bin/python bench/inference.py                         # tiny default-shaped model, CPU (< 1 min)
    .venv/bin/python bench/inference.py --preset qwen0.5b --device cuda --batch 32 --tokens 512

Baseline: ``model.generate(do_sample=True)`` with KV cache and no hidden-state capture. Project:
``TorchEngine.generate`` (seeded per-sequence Gumbel-max sampling, per-token log-probs, final hidden
states captured through ``node.proofs.capture``), then TOPLOC proof building on those states
(``node.proofs.toploc.build_proofs_many``) timed separately. Random-init weights (speed does not
depend on them); tokens counted are the tokens actually generated. Printed last: the engine's
speed relative to ``generate`` and proof building as a fraction of generation time.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from node.engines.torch_engine import TorchEngine
from node.engines.model import (
    TinyModelSpec,
    build_tiny_model,
    build_tokenizer,
    save_model_folder,
)
from quick import parse_args  # bench/, the script's own folder

PRESETS = {
    "tiny": TinyModelSpec(),
    # Qwen2-0.5B's shape (494M parameters with its 151k vocabulary; ours keeps the character vocabulary)
    "qwen0.5b": TinyModelSpec(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                              num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096),
}


def timed(fn, device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--batch", type=int, default=32, help="sequences per generate call")
    ap.add_argument("--tokens", type=int, default=64, help="max new tokens")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0)
    args = parse_args(ap, {"batch": 8, "tokens": 32, "repeats": 1, "threads": 1})
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)

    tok = build_tokenizer()
    model = build_tiny_model(len(tok), tok.eos_token_id, tok.pad_token_id, PRESETS[args.preset], seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        save_model_folder(model, tok, tmp)
        engine = TorchEngine(args.device, dtype=dtype)
        engine.load(tmp)
    hf = engine.model  # the same weights for the baseline
    params = sum(p.numel() for p in hf.parameters())
    prompt = tok("rev 3141592=", add_special_tokens=False)["input_ids"]
    print(f"model {args.preset}: {params / 1e6:.2f}M parameters, {args.dtype}, device {args.device}, "
          f"batch {args.batch} x {args.tokens} new tokens, {args.repeats} repeats")

    # warm-up both paths once (allocator, kernels)
    engine.generate([prompt], args.batch, 1.0, 1.0, 4, seed=0)
    ids = torch.tensor([prompt] * args.batch, device=args.device)
    with torch.no_grad():
        hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=4, pad_token_id=tok.pad_token_id)

    from node.proofs.toploc import build_proofs_many

    base_tok = base_s = eng_tok = eng_s = proof_s = 0.0
    for r in range(args.repeats):
        torch.manual_seed(r)

        def baseline():
            with torch.no_grad():
                return hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, top_k=0,
                                   max_new_tokens=args.tokens, pad_token_id=tok.pad_token_id)

        out, s = timed(baseline, args.device)
        new = out[:, len(prompt):]
        n_base = sum(int((row == tok.eos_token_id).nonzero()[0, 0]) + 1 if (row == tok.eos_token_id).any() else len(row)
                     for row in new)
        base_tok, base_s = base_tok + n_base, base_s + s
        groups, s = timed(partial(engine.generate, [prompt], args.batch, 1.0, 1.0, args.tokens, seed=r), args.device)
        samples = groups[0]
        eng_tok, eng_s = eng_tok + sum(x.num_tokens for x in samples), eng_s + s
        _, s = timed(partial(build_proofs_many, [x.hidden for x in samples]), "cpu")
        proof_s += s

    base_rate, eng_rate = base_tok / base_s, eng_tok / eng_s
    print(f"baseline  HF generate (no capture)            {base_rate:10.0f} tokens/s  ({int(base_tok)} tokens)")
    print(f"project   TorchEngine (logprobs + capture)    {eng_rate:10.0f} tokens/s  ({int(eng_tok)} tokens)")
    print(f"project   TOPLOC proof building               {eng_tok / proof_s:10.0f} tokens/s")
    print(f"engine / HF generate speed ratio: {eng_rate / base_rate:.2f}x; "
          f"proof building adds {proof_s / eng_s:.1%} of engine generation time")


if __name__ == "__main__":
    main()
