"""What the inference role's pipeline costs on top of bare sampling, measured in the same run.

Baseline: ``engine.generate`` alone (no hidden-state capture) on the step's prompts.
Project: one full role step (``RolloutGenerator.run_step``): draw, sample with capture, score with the
verifiers, build TOPLOC proofs, assemble, sign and encode the batch. Same prompts count, group size,
token budget and seeds. Prints completion tokens/s of both (best of N interleaved runs: on a shared
machine the fastest run is the least disturbed one) and the ratio (project / baseline) last.

    .venv/bin/python bench/inference_role.py                  # embedded tiny model, CPU
    .venv/bin/python bench/inference_role.py --model DIR --device cuda --group 16 --prompts 8 --tokens 256
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from node.identity import Identity
from node.engines.model import create_tiny_model
from node.proofs.config import ProofsConfig
from node.rl.config import InferenceConfig, RLConfig
from node.rl.spec import OFFLINE_ROOT, draw_tasks, sampling_seed, step_key
from node.rollouts.config import WorkerConfig
from node.inference.generate import RolloutGenerator
from quick import parse_args  # bench/, the script's own folder


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="", help="HF model folder (default: create the embedded tiny model)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--taskset", default="synthetic")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=10)
    args = parse_args(ap, {"tokens": 16, "repeats": 2})

    model = Path(args.model) if args.model else create_tiny_model(Path(tempfile.mkdtemp()) / "tiny")
    ident = Identity.generate()
    rl = RLConfig(taskset=args.taskset, group_size=args.group, prompts_per_batch=args.prompts, max_new_tokens=args.tokens)
    gen = RolloutGenerator(identity=ident, run_name="bench", rl=rl, proofs=ProofsConfig(),
                           inference=InferenceConfig(engine="torch", device=args.device), worker=WorkerConfig())
    gen.follow(model)
    engine, tok = gen.engine, gen.engine.tokenizer

    def bare(step: int) -> tuple[int, float]:
        key = step_key("bench", ident.peer_id, OFFLINE_ROOT, step)
        tasks = draw_tasks(gen.taskset, key, args.prompts)
        prompts = [tok(t.prompt, add_special_tokens=False)["input_ids"] for t in tasks]
        t0 = time.perf_counter()
        groups = engine.generate(prompts, n=args.group, temperature=rl.temperature, top_p=rl.top_p,
                                 max_new_tokens=args.tokens, seed=sampling_seed(key),
                                 capture_hidden=False)
        return sum(s.num_tokens for g in groups for s in g), time.perf_counter() - t0

    def full(step: int) -> tuple[int, float, float]:
        t0 = time.perf_counter()
        r = gen.run_step(step, 0, 0)
        return r.completion_tokens, time.perf_counter() - t0, r.proof_s

    bare(0), full(0)  # warm-up
    base_rates, role_rates, proof_shares = [], [], []
    for i in range(1, args.repeats + 1):  # interleaved, order alternated, same prompts and seeds for both
        for which in ((0, 1) if i % 2 else (1, 0)):
            if which == 0:
                n, s = bare(i)
                base_rates.append(n / s)
            else:
                n, s, proof_s = full(i)
                role_rates.append(n / s)
                proof_shares.append(proof_s / s)
    base, role = max(base_rates), max(role_rates)
    print(f"model {model.name}, device {args.device}, {args.prompts} prompts x {args.group} samples x <= {args.tokens} tokens, "
          f"best of {args.repeats} interleaved runs")
    print(f"baseline  engine.generate, no capture               : {base:10.1f} completion tokens/s")
    print(f"project   full role step (capture+score+proofs+sign): {role:10.1f} completion tokens/s "
          f"(proofs: median {100 * statistics.median(proof_shares):.1f}% of a step)")
    print(f"ratio project/baseline: {role / base:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
