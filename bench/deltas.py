"""How much of a checkpoint changes per GRPO step, and how small its delta is (node/shards/delta.py).

    .venv/bin/python bench/deltas.py                       # both settings below, 2 steps each
    .venv/bin/python bench/deltas.py --setting realistic --steps 3 --lrs 1e-6

Real GRPO steps (node/rl/grpo.py ``train_step``, AdamW, INTELLECT-2's clipping) on rollouts of the
synthetic reversal task (node/rl/synthetic.py: prompts of the packaged task generator, G noisy
answers per prompt scored by ``reversal_reward``, group-relative advantages, old log-probs from the
policy itself), after each step the checkpoint is published as safetensors bytes and the delta
against the previous published version is encoded. Settings:

* ``realistic``: a Qwen2-shaped model of ~59M parameters built locally, an fp32 master, weights
  published in bf16, lr in INTELLECT-2's range (3e-7 and 1e-6, no warm-up: every step at peak lr);
* ``demo``: the demo's own setting (the tiny default model, fp32 publish, ``GRPOConfig().lr``).

Per step it prints the fraction of published values that changed and delta bytes / full bytes for
zlib and lzma (the ratio is the figure of merit: the baseline is sending the full checkpoint), and
checks that the delta rebuilds the published files byte-identical.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
from safetensors.torch import save as save_safetensors

from node.engines.model import TinyModelSpec, build_tiny_model, build_tokenizer
from node.rl.config import GRPOConfig
from node.rl.grpo import TrainSample, make_optimizer, pack, token_logprobs, train_step
from node.rl.spec import group_advantages
from node.rl.synthetic import make_reversal_tasks, reversal_reward
from node.shards.delta import apply_delta, encode_delta
from quick import parse_args  # bench/, the script's own folder

# ~59M parameters: 10 layers of width 640 (GQA 10 heads / 2 kv heads), MLP 2560, character vocab.
REALISTIC = TinyModelSpec(hidden_size=640, intermediate_size=2560, num_hidden_layers=10, num_attention_heads=10,
                          num_key_value_heads=2, max_position_embeddings=256)


def rollouts(tok, step: int, prompts: int, group: int, seed: int) -> list[tuple[list[int], list[int], float]]:
    """(prompt ids, completion ids, advantage) of ``prompts`` groups of ``group`` noisy answers."""
    rng = random.Random(seed * 1000 + step)
    out = []
    for task in make_reversal_tasks(prompts, seed=seed * 1000 + step):
        answers = []
        for _ in range(group):
            a = list(task["answer"])
            for i in range(len(a)):
                if rng.random() < 0.4:
                    a[i] = rng.choice("0123456789")
            answers.append("".join(a))
        advs = group_advantages([reversal_reward(a, task["answer"]) for a in answers])
        p = tok(task["prompt"])["input_ids"]
        for a, adv in zip(answers, advs):
            out.append((p, tok(a)["input_ids"] + [tok.eos_token_id], float(adv)))
    return out


def samples_for(model, raw, cfg: GRPOConfig) -> list[TrainSample]:
    """TrainSamples whose old log-probs are the policy's own (on-policy: ratio 1 at the first step)."""
    draft = [TrainSample(p, c, [0.0] * len(c), a) for p, c, a in raw]
    batch = pack(draft, cfg.pack_length, one_per_row=True)
    with torch.no_grad():
        logp, _ = token_logprobs(model, batch, cfg.temperature)
    out = []
    for row, s in enumerate(draft):  # one sample per row: completion targets start at len(prompt) - 1
        lo = len(s.prompt_ids) - 1
        out.append(TrainSample(s.prompt_ids, s.completion_ids, logp[row, lo:lo + len(s.completion_ids)].tolist(), s.advantage))
    return out


def publish(model, dtype) -> dict[str, bytes]:
    """The published folder's weight file as bytes (tied lm_head left out, as save_pretrained does)."""
    sd = {k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    return {"model.safetensors": save_safetensors(sd, metadata={"format": "pt"}), "config.json": b"{}"}


def run(setting: str, lr: float, steps: int, seed: int, group: int) -> list[dict]:
    tok = build_tokenizer()
    spec, dtype = (REALISTIC, torch.bfloat16) if setting == "realistic" else (TinyModelSpec(), torch.float32)
    model = build_tiny_model(len(tok), tok.eos_token_id, tok.pad_token_id, spec, seed=seed)  # fp32 master
    params = sum(p.numel() for p in model.parameters())
    cfg = GRPOConfig(lr=lr, warmup_steps=0 if setting == "realistic" else GRPOConfig().warmup_steps,
                     optimizer_steps=2, kl_coef=0.0, pack_length=128)
    opt, sched = make_optimizer(model, cfg)
    prev = publish(model, dtype)
    rows = []
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        samples = samples_for(model, rollouts(tok, step, 4, group, seed), cfg)
        train_step(model, opt, sched, samples, cfg, pad_id=tok.pad_token_id)
        train_s = time.perf_counter() - t0
        cur = publish(model, dtype)
        row = {"setting": setting, "params": params, "dtype": str(dtype).split(".")[-1], "lr": lr, "step": step,
               "full": sum(len(v) for v in cur.values()), "train_s": train_s}
        for codec in ("zlib", "lzma"):
            t0 = time.perf_counter()
            delta, st = encode_delta(prev, cur, codec)
            row[f"{codec}_s"] = time.perf_counter() - t0
            row[codec] = st.ratio
            row["changed"] = st.changed_fraction
            row["body"] = st.body / st.full
            assert apply_delta(prev, delta, {k: len(v) for k, v in cur.items()}) == cur, "delta does not rebuild"
        rows.append(row)
        print(f"  {setting} lr={lr:g} step {step}: changed {row['changed']:.4%}, zlib {row['zlib']:.4f}, "
              f"lzma {row['lzma']:.4f}, body {row['body']:.4f} (train {train_s:.1f}s, zlib {row['zlib_s']:.1f}s, "
              f"lzma {row['lzma_s']:.1f}s)", flush=True)
        prev = cur
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--setting", choices=["realistic", "demo", "both"], default="both")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--lrs", default="3e-7,1e-6", help="learning rates of the realistic setting")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--group", type=int, default=4, help="answers per prompt (4 prompts per step)")
    ap.add_argument("--threads", type=int, default=2)
    args = parse_args(ap, {"setting": "demo", "steps": 2})
    torch.set_num_threads(args.threads)
    rows = []
    if args.setting in ("realistic", "both"):
        for lr in (float(x) for x in args.lrs.split(",")):
            rows += run("realistic", lr, args.steps, args.seed, args.group)
    if args.setting in ("demo", "both"):
        rows += run("demo", GRPOConfig().lr, args.steps, args.seed, args.group)
    print()
    print("| setting | params | publish dtype | lr | step | values changed | delta/full zlib (encode s) "
          "| delta/full lzma (encode s) | full bytes |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['setting']} | {r['params'] / 1e6:.1f}M | {r['dtype']} | {r['lr']:g} | {r['step']} | "
              f"{r['changed']:.3%} | {r['zlib']:.4f} ({r['zlib_s']:.1f}) | {r['lzma']:.4f} ({r['lzma_s']:.1f}) "
              f"| {r['full']:,} |")


if __name__ == "__main__":
    main()
