"""Peak memory of one GRPO step: micro-batched passes against one pass over each mini-batch.

    .venv/bin/python bench/train_memory.py                                    # embedded model, 256 samples
    .venv/bin/python bench/train_memory.py --model .models/smollm2-135m-instruct --samples 48

Each variant runs in a child process of its own (so its peak resident memory, ``ru_maxrss``, is its
alone): load the model in float32, one ``train_step`` of ``--samples`` samples (prompt and
completion lengths like the SmolLM2 demo's: ~100-token chat prompts, short answers) in
``--optimizer-steps`` mini-batches. Baseline: ``micro_batch_tokens`` large enough for one pass per
mini-batch (the behaviour before micro-batching). Project: the default ``micro_batch_tokens``.
Printed: peak RSS and step seconds of each, and their ratios.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from quick import parse_args  # noqa: E402  (bench/, the script's own folder)


def child(args) -> dict:
    import torch

    from node.engines.model import build_tiny_model, build_tokenizer, load_model
    from node.rl.config import GRPOConfig
    from node.rl.grpo import TrainSample, make_optimizer, train_step

    torch.set_num_threads(args.threads)
    if args.model:
        model = load_model(args.model, device="cpu", dtype=torch.float32)
        vocab = model.config.vocab_size
    else:
        tok = build_tokenizer()
        model = build_tiny_model(len(tok), tok.eos_token_id, tok.pad_token_id, seed=0)
        vocab = len(tok)
    rng = random.Random(0)
    samples = []
    for _ in range(args.samples):
        p = [rng.randrange(3, vocab) for _ in range(rng.randint(90, 120))]
        c = [rng.randrange(3, vocab) for _ in range(rng.randint(2, 16))]
        samples.append(TrainSample(p, c, [rng.uniform(-3, -0.1) for _ in c], rng.uniform(-1, 1)))
    cfg = GRPOConfig(optimizer_steps=args.optimizer_steps, kl_coef=0.0, micro_batch_tokens=args.micro)
    opt, sched = make_optimizer(model, cfg)
    t0 = time.perf_counter()
    train_step(model, opt, sched, samples, cfg)
    secs = time.perf_counter() - t0
    return {"peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "seconds": secs}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="", help="an HF model folder (default: the embedded tiny model)")
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--optimizer-steps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--micro", type=int, default=0, help=argparse.SUPPRESS)  # set in the children
    args = parse_args(ap, {"samples": 32}, argv)
    if args.micro:
        print(json.dumps(child(args)))
        return
    from node.rl.config import GRPOConfig

    default = GRPOConfig().micro_batch_tokens
    rows = {}
    for name, micro in (("one pass per mini-batch (baseline)", 1 << 30), (f"micro_batch_tokens {default}", default)):
        cmd = [sys.executable, __file__, "--samples", str(args.samples), "--optimizer-steps", str(args.optimizer_steps),
               "--threads", str(args.threads), "--micro", str(micro)] + (["--model", args.model] if args.model else [])
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
        rows[name] = json.loads(out)
        print(f"{name:38s} peak RSS {rows[name]['peak_mb']:8.0f} MB   step {rows[name]['seconds']:7.1f} s", flush=True)
    base, proj = rows.values()
    print(f"micro-batched / one pass: memory {proj['peak_mb'] / base['peak_mb']:.2f}x, "
          f"time {proj['seconds'] / base['seconds']:.2f}x ({args.samples} samples, {args.optimizer_steps} mini-batches)")


if __name__ == "__main__":
    main()
