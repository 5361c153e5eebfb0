"""GRPO step time with sequence packing against one padded sample per row, same samples, same run.

    .venv/bin/python bench/grpo.py                  # tiny default-shaped model on the CPU (< 1 min)
    .venv/bin/python bench/grpo.py --preset qwen0.5b --device cuda --samples 256 --pack 4096

Samples have RL-like lengths: short prompts and completions from a long-tailed distribution (most
short, a few near the cap), where padding every row to the longest sample wastes most of the batch.
Baseline: ``train_step(packed=False)`` (one right-padded sample per row). Project: the packed
``train_step`` (first-fit-decreasing rows of ``--pack`` tokens, block-diagonal attention). Both do
the same optimizer steps on the same model copy; printed last: trained tokens/s of each and the ratio.
"""

from __future__ import annotations

import argparse
import copy
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from node.engines.model import build_tiny_model, build_tokenizer
from node.rl.config import GRPOConfig
from node.rl.grpo import TrainSample, make_optimizer, pack, train_step

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from inference import PRESETS
from quick import parse_args  # bench/, the script's own folder


def make_samples(n: int, max_len: int, vocab: int, seed: int) -> list[TrainSample]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p = rng.randint(8, 32)
        c = min(max_len - p, max(1, int(rng.paretovariate(1.2) * 16)))  # long tail
        out.append(TrainSample([rng.randrange(3, vocab) for _ in range(p)], [rng.randrange(3, vocab) for _ in range(c)],
                               [-4.0] * c, rng.uniform(-1.5, 1.5)))
    return out


def run(model, samples, cfg, packed: bool, device: str) -> tuple[float, int, int]:
    opt, sched = make_optimizer(model, cfg)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    st = train_step(model, opt, sched, samples, cfg, packed=packed)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - t0, st.tokens, st.rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--pack", type=int, default=512, help="tokens per packed row (= the sample length cap)")
    ap.add_argument("--optimizer-steps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=2)
    args = parse_args(ap, {"samples": 32, "pack": 256, "repeats": 1, "threads": 1})
    if args.threads:
        torch.set_num_threads(args.threads)
    tok = build_tokenizer()
    base = build_tiny_model(len(tok), tok.eos_token_id, tok.pad_token_id, PRESETS[args.preset], seed=0).to(args.device)
    cfg = GRPOConfig(optimizer_steps=args.optimizer_steps, pack_length=args.pack, kl_coef=0.0)
    samples = make_samples(args.samples, args.pack, len(tok), seed=0)
    total = sum(s.length for s in samples)
    packed_rows = pack(samples, args.pack).input_ids.shape[0]
    print(f"{args.samples} samples, {total} tokens (longest {max(s.length for s in samples)}), "
          f"{packed_rows} packed rows of {args.pack}; model {args.preset} on {args.device}")
    run(copy.deepcopy(base), samples[:8], cfg, True, args.device)  # warm-up
    res = {True: [0.0, 0], False: [0.0, 0]}
    for _ in range(args.repeats):
        for packed in (False, True):
            s, toks, _ = run(copy.deepcopy(base), samples, cfg, packed, args.device)
            res[packed][0] += s
            res[packed][1] += toks
    un = res[False][1] / res[False][0]
    pk = res[True][1] / res[True][0]
    print(f"baseline  unpacked (one padded sample per row)  {un:9.0f} trained tokens/s")
    print(f"project   packed rows of {args.pack:<5d}              {pk:9.0f} trained tokens/s")
    print(f"packed / unpacked speed ratio: {pk / un:.2f}x")


if __name__ == "__main__":
    main()
