"""Validation throughput beside generation throughput of the same model, on this machine.

    .venv/bin/python bench/validator.py                      # tiny + small shapes on CPU
    .venv/bin/python bench/validator.py --shape qwen2-0.5b --device cuda --dtype bfloat16

Generation: the torch engine samples ``prompts x group`` completions of ``--new-tokens`` tokens with
hidden-state capture on, as an inference node does (proof building timed apart). Validation: the
validator's whole pipeline on the resulting signed batch (node/validator/pipeline.py: batch rules,
task draw, termination, rewards, advantages, one batched prefill, TOPLOC verification, log-probs,
Gumbel-max sampling replay), and the same without the replay. The TOPLOC paper reports validation
up to 100x faster than generation on GPUs (prefill is parallel over positions; decoding is
sequential); on a CPU with a tiny model both are bound by per-call overheads, so expect far less.

Hostile batches (issue 42, hole 2): a code-task batch of endless loops with garbage proofs and
log-probs (``free_sandbox`` of node/validator/testing.py), which costs its worker nothing, judged
beside an honest code-task batch of the same size on the same model: the validator's seconds per
batch and their ratio (the proofs are checked before any sandbox runs, so the ratio stays near 1).

The shapes are random-init Qwen2 models built locally (no download) with the embedded
character-level tokenizer (vocabulary ~100): ``qwen2-0.5b`` has Qwen2-0.5B's layer shapes but not its
151,936-token vocabulary, so its LM head and sampling cost are far smaller than the real model's.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from node.engines.torch_engine import TorchEngine
from node.identity import Identity
from node.engines.model import (
    TinyModelSpec,
    build_tiny_model,
    build_tokenizer,
    save_model_folder,
)
from node.proofs.toploc import build_proofs_many
from node.rl.config import RLConfig
from node.rl.spec import sampling_seed, step_key
from node.validator import testing as T
from node.validator.pipeline import BatchRules, CheckModel, Judgement, judge_batch
from node.validator.tasks import RunTasks
from quick import parse_args  # bench/, the script's own folder

SHAPES = {
    "tiny": TinyModelSpec(),  # the embedded default (hidden 64, 2 layers)
    "small": TinyModelSpec(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
                           num_key_value_heads=2, max_position_embeddings=512),
    "qwen2-0.5b": TinyModelSpec(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                                num_key_value_heads=2, max_position_embeddings=4096),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build(shape: str, folder: Path) -> Path:
    tok = build_tokenizer()
    model = build_tiny_model(len(tok), tok.eos_token_id, tok.pad_token_id, SHAPES[shape], seed=0)
    return save_model_folder(model, tok, folder)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def bench_shape(shape: str, args) -> dict:
    folder = build(shape, Path(tempfile.mkdtemp(prefix=f"bench-validator-{shape}-")))
    engine = TorchEngine(args.device, DTYPES[args.dtype])
    engine.load(folder)
    rules = BatchRules(run="bench", taskset="synthetic", temperature=1.0, top_p=1.0, max_new_tokens=args.new_tokens,
                       group_size=args.group, prompts_per_batch=args.prompts, async_level=2)
    tasks = RunTasks(RLConfig(group_size=args.group, prompts_per_batch=args.prompts, max_new_tokens=args.new_tokens))
    worker = Identity.generate()
    model = CheckModel(engine.model, engine.tokenizer, 0)

    # Generation, timed alone: the same call make_batch makes (warm-up first).
    prompts = [engine.tokenizer.encode(tasks.draw(step_key("bench", worker.peer_id, T.ROOT, 0), i).prompt, add_special_tokens=False)
               for i in range(args.prompts)]
    engine.generate(prompts, 2, 1.0, 1.0, 4, 0)
    gen_s, gen_tokens, proof_s = [], 0, []
    for r in range(args.repeats):
        sync(args.device)
        t0 = time.perf_counter()
        groups = engine.generate(prompts, args.group, 1.0, 1.0, args.new_tokens, sampling_seed(step_key("bench", worker.peer_id, T.ROOT, r)))
        sync(args.device)
        gen_s.append(time.perf_counter() - t0)
        flat = [s for g in groups for s in g]
        gen_tokens = sum(s.num_tokens for s in flat)
        t0 = time.perf_counter()
        build_proofs_many([s.hidden for s in flat], rules.proofs.chunk_tokens, rules.proofs.topk)
        proof_s.append(time.perf_counter() - t0)

    # Validation of honest signed batches (each one judged after a warm-up judgement).
    batches = [T.make_batch(engine, worker, rules, tasks, step=r, policy_version=0) for r in range(args.repeats)]
    judge_batch(batches[0].batch, rules, current_version=0, tasks=tasks, model=model)
    val_s, noreplay_s, tokens = [], [], 0
    no_replay = replace(rules, check_sampling=False)
    for b in batches:
        for rr, bucket in ((rules, val_s), (no_replay, noreplay_s)):
            seconds, j = timed_judgement(b.batch, rr, tasks, model, args.device)
            bucket.append(seconds)
            if not j.accepted:
                raise SystemExit(f"honest batch rejected: {j.main_reason()} {j.details[:1]}")
        tokens = j.tokens
    best = min
    return {
        "shape": shape,
        "params_M": sum(p.numel() for p in engine.model.parameters()) / 1e6,
        "tokens": tokens,
        "gen_tps": gen_tokens / best(gen_s),
        "proof_tps": gen_tokens / best(proof_s),
        "val_tps": tokens / best(val_s),
        "val_noreplay_tps": tokens / best(noreplay_s),
    }


def timed_judgement(batch, rules, tasks, model, device: str) -> tuple[float, Judgement]:
    sync(device)
    t0 = time.perf_counter()
    j = judge_batch(batch, rules, current_version=0, tasks=tasks, model=model)
    sync(device)
    return time.perf_counter() - t0, j


def bench_hostile(shape: str, args) -> dict:
    """Validator seconds per honest code batch and per free-sandbox batch of the same size (best of repeats)."""
    folder = build(shape, Path(tempfile.mkdtemp(prefix=f"bench-validator-hostile-{shape}-")))
    engine = TorchEngine(args.device, DTYPES[args.dtype])
    engine.load(folder)
    new_tokens = max(args.new_tokens, len(T.ENDLESS_PROGRAM) + 1)  # room for the endless program and its eos
    rules = BatchRules(run="bench", taskset="code", temperature=1.0, top_p=1.0, max_new_tokens=new_tokens,
                       group_size=args.group, prompts_per_batch=args.prompts, async_level=2)
    tasks = RunTasks(RLConfig(taskset="code", group_size=args.group, prompts_per_batch=args.prompts,
                              max_new_tokens=new_tokens))
    worker = Identity.generate()
    model = CheckModel(engine.model, engine.tokenizer, 0)
    honest_s, hostile_s = [], []
    for r in range(args.repeats):
        honest = T.make_batch(engine, worker, rules, tasks, step=r, policy_version=0)
        hostile = T.free_sandbox(honest, worker, engine)
        for batch, bucket, want in ((honest, honest_s, True), (hostile, hostile_s, False)):
            seconds, j = timed_judgement(batch.batch, rules, tasks, model, args.device)
            if j.accepted != want:
                raise SystemExit(f"{'honest' if want else 'hostile'} code batch judged {j.main_reason()}: {j.details[:1]}")
            bucket.append(seconds)
    return {"shape": shape, "samples": args.prompts * args.group, "honest_s": min(honest_s), "hostile_s": min(hostile_s)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", action="append", choices=sorted(SHAPES), help="model shape(s) (default: tiny, small)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2, help="runs per measurement; the fastest is kept")
    args = parse_args(ap, {"shape": ["tiny"], "new_tokens": 16, "repeats": 1})
    torch.set_num_threads(max(1, torch.get_num_threads()))
    rows = [bench_shape(s, args) for s in (args.shape or ["tiny", "small"])]
    print(f"device {args.device}, dtype {args.dtype}, {args.prompts} prompts x {args.group} samples x "
          f"{args.new_tokens} new tokens, best of {args.repeats}")
    head = f"{'shape':<11}{'params':>8}{'tokens':>8}{'generate tok/s':>16}{'proofs tok/s':>14}" \
           f"{'validate tok/s':>16}{'(no replay)':>13}{'ratio':>8}{'(no replay)':>13}"
    print(head)
    for r in rows:
        print(f"{r['shape']:<11}{r['params_M']:>7.1f}M{r['tokens']:>8}{r['gen_tps']:>16.0f}{r['proof_tps']:>14.0f}"
              f"{r['val_tps']:>16.0f}{r['val_noreplay_tps']:>13.0f}{r['val_tps'] / r['gen_tps']:>7.1f}x"
              f"{r['val_noreplay_tps'] / r['gen_tps']:>12.1f}x")
    print("ratio = validation tokens/s / generation tokens/s of the same model (TOPLOC paper: up to 100x on GPU)")
    print()
    print(f"{'shape':<11}{'samples':>8}{'honest code batch s':>21}{'free-sandbox batch s':>22}{'hostile/honest':>16}")
    for r in (bench_hostile(s, args) for s in (args.shape or ["tiny", "small"])):
        print(f"{r['shape']:<11}{r['samples']:>8}{r['honest_s']:>21.3f}{r['hostile_s']:>22.3f}"
              f"{r['hostile_s'] / r['honest_s']:>15.2f}x")
    print("free-sandbox: endless-loop code with garbage proofs (issue 42); must stay within 2x an honest batch")


if __name__ == "__main__":
    main()
