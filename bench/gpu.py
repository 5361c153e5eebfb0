"""Every GPU measurement of the project in one prepared script (issue 17), with its baseline in the same run.

    .venv/bin/python bench/gpu.py --smoke                    # CPU, tiny model, seconds: checks the script runs
    python bench/gpu.py --out bench/out/gpu.json             # on one CUDA GPU (H200 sizes by default)

Sections (``--sections`` picks some; each prints its ratio last):

* ``correctness``: the CUDA paths agree with the reference paths on the same weights (fp32):
  compiled static-cache decode gives the dynamic path's tokens and its states pass TOPLOC
  verification against a validator prefill; fused AdamW makes the step unfused AdamW makes; a
  packed bf16 row scores each sample as it scores alone.
* ``decode``: tokens/s of the torch engine (dynamic cache; static cache + CUDA graphs) against
  plain ``model.generate(do_sample=True)`` on a Qwen2-0.5B-shaped model (494M parameters with its
  151,936-token vocabulary, random weights: speed does not depend on them), bf16, batch 32 x 512
  new tokens. Goal: compiled >= 5x generate.
* ``proofs``: hidden-state capture on vs off in the compiled engine, and TOPLOC building, as
  fractions of generation time.
* ``validate``: the validator's batched prefill (node/validator/pipeline.py ``CheckModel.recompute``:
  states + logits) of the generated sequences against generation; the vLLM engine's proof prefill
  is the same computation, so this is also its cost as a fraction of generation. Goal >= 20x.
* ``train``: one GRPO step (bf16 autocast over fp32 master weights, packed rows with position-id
  resets, fused AdamW, flash-attention varlen when ``flash_attn`` imports, else SDPA with the
  block mask) on 8 x 2048 tokens against a plain HF step (``model(input_ids, labels)``, unfused
  AdamW) on the same tokens; MFU = 6 x parameters x tokens/s / peak bf16 FLOP/s (``--peak-tflops``,
  989 for the H200's dense bf16; attention FLOPs not counted, as in the usual 6N estimate).
  Goal >= 40 %. Beside it, the trainer's per-step rescoring for each engine's log-prob mismatch
  (node/rl/mismatch.py, ``[trainer] mismatch_samples`` samples, one forward each) as a fraction of
  the step.

``--smoke`` shrinks everything to the tiny default shape on the CPU so the whole script runs in
seconds (ratios then mean nothing; compiled decode falls back to the static cache without graphs).
Results go to ``--out`` as JSON as well as to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from node.engines.model import TinyModelSpec, build_tiny_model
from node.engines.torch_engine import TorchEngine

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from quick import parse_args  # noqa: E402  (bench/, the script's own folder)

SECTIONS = ("correctness", "decode", "proofs", "validate", "train")
QWEN05B = TinyModelSpec(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                        num_key_value_heads=2, max_position_embeddings=4096)
QWEN_VOCAB = 151936
SMOKE = TinyModelSpec(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1)


@dataclass
class Sizes:
    spec: TinyModelSpec
    vocab: int
    batch: int
    new_tokens: int
    prompt_tokens: int
    train_rows: int
    train_len: int
    device: str
    dtype: torch.dtype


def sizes(args) -> Sizes:
    if args.smoke:
        return Sizes(SMOKE, 64, 4, 8, 6, 2, 64, "cpu", torch.float32)
    return Sizes(QWEN05B, QWEN_VOCAB, args.batch, args.tokens, args.prompt_tokens, args.train_rows, args.train_len,
                 args.device, torch.bfloat16)


class ShimTokenizer:
    """What the engine needs of a tokenizer for random token ids: eos, pad and a decode."""

    def __init__(self, eos: int, pad: int) -> None:
        self.eos_token_id, self.pad_token_id = eos, pad

    def decode(self, ids, skip_special_tokens=True) -> str:
        return ""


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device: str):
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t0


def make_model(sz: Sizes, dtype: torch.dtype | None = None, seed: int = 0):
    # eos = the last id: a random model almost never samples it, so every row runs to the length cap
    model = build_tiny_model(sz.vocab, eos_id=sz.vocab - 1, pad_id=0, spec=sz.spec, seed=seed)
    return model.to(device=sz.device, dtype=dtype or sz.dtype).eval()


def make_engine(model, sz: Sizes, decode: str) -> TorchEngine:
    eng = TorchEngine(sz.device, dtype=next(model.parameters()).dtype, decode=decode)
    eng.model, eng._tokenizer = model, ShimTokenizer(sz.vocab - 1, 0)
    return eng


def prompts(sz: Sizes, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, sz.vocab - 1, (sz.prompt_tokens,), generator=g).tolist() for _ in range(sz.batch)]


def tokens_of(groups) -> int:
    return sum(len(s.completion_ids) for g in groups for s in g)


# ------------------------------------------------------------------------------------------ sections


def section_correctness(sz: Sizes, out: dict) -> None:
    from node.proofs.capture import recompute_decode_states
    from node.proofs.config import ProofsConfig
    from node.proofs.toploc import build_proofs_many, verify_proofs
    from node.rl.config import GRPOConfig
    from node.rl.grpo import TrainSample, make_optimizer, pack, token_logprobs, train_step

    small = Sizes(SMOKE if sz.device == "cpu" else TinyModelSpec(), 64, 4, 24, 6, 2, 64, sz.device, torch.float32)
    model = make_model(small)
    ps = prompts(small)
    ref = make_engine(model, small, "dynamic").generate(ps, 2, 1.0, 1.0, small.new_tokens, seed=7)
    fast_engine = make_engine(model, small, "compiled")
    fast = fast_engine.generate(ps, 2, 1.0, 1.0, small.new_tokens, seed=7)
    flat_r, flat_f = [s for g in ref for s in g], [s for g in fast for s in g]
    same_tokens = [a.completion_ids for a in flat_r] == [b.completion_ids for b in flat_f]
    states = recompute_decode_states(model, [s.prompt_ids for s in flat_f], [s.completion_ids for s in flat_f])
    proofs = build_proofs_many([s.hidden for s in flat_f], 32, 128)
    proofs_ok = all(verify_proofs(h, p, ProofsConfig()).ok for h, p in zip(states, proofs))
    out["correctness"] = {"decode_path": fast_engine.decode_mode(), "static_tokens_equal_dynamic": same_tokens,
                          "static_states_pass_toploc": proofs_ok}

    # fused vs unfused AdamW: one step on the same gradients
    cfg = GRPOConfig(optimizer_steps=1, pack_length=64, lr=1e-3, warmup_steps=0, kl_coef=0.0)
    samples = [TrainSample(p[:4], p[4:6], [-1.0, -1.0], 1.0 if i % 2 else -1.0) for i, p in enumerate(ps)]
    a, b = make_model(small, torch.float32), make_model(small, torch.float32)
    opt_a, sch_a = make_optimizer(a, cfg)  # fused when on CUDA
    opt_b = torch.optim.AdamW(b.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.99))
    sch_b = torch.optim.lr_scheduler.LambdaLR(opt_b, lambda s: 1.0)
    train_step(a, opt_a, sch_a, samples, cfg)
    train_step(b, opt_b, sch_b, samples, cfg)
    diff = max(float((pa - pb).detach().abs().max()) for pa, pb in zip(a.parameters(), b.parameters()))
    out["correctness"]["fused_adamw"] = bool(opt_a.param_groups[0].get("fused"))
    out["correctness"]["fused_vs_unfused_max_diff"] = diff

    # a packed bf16 row (autocast) scores each sample as it does alone
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if sz.device.startswith("cuda") else _null()
    with torch.no_grad(), amp:
        together, _ = token_logprobs(a, pack(samples, 64), 1.0)
        alone = [token_logprobs(a, pack([s], 64), 1.0)[0] for s in samples]
    packed_sum = float(together.sum())
    alone_sum = float(sum(t.sum() for t in alone))
    out["correctness"]["packed_vs_alone_logprob_sum_diff"] = abs(packed_sum - alone_sum)
    print(f"correctness: decode path {fast_engine.decode_mode()}, tokens equal {same_tokens}, "
          f"proofs pass {proofs_ok}, fused AdamW {out['correctness']['fused_adamw']} (max diff {diff:.2e}), "
          f"packed vs alone log-prob sum diff {abs(packed_sum - alone_sum):.2e}")


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def section_decode(sz: Sizes, out: dict, shared: dict) -> None:
    model = shared.setdefault("model", make_model(sz))
    ps = prompts(sz)
    ids = torch.tensor(ps, device=sz.device)
    gen_kw = {"do_sample": True, "max_new_tokens": sz.new_tokens, "min_new_tokens": sz.new_tokens,
              "pad_token_id": 0, "eos_token_id": sz.vocab - 1}
    with torch.no_grad():
        model.generate(ids[:, :4], **{**gen_kw, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
        _, t_plain = timed(lambda: model.generate(ids, attention_mask=torch.ones_like(ids), **gen_kw), sz.device)
    plain = sz.batch * sz.new_tokens / t_plain
    rows = {"generate_tok_s": plain}
    for mode in ("dynamic", "compiled"):
        eng = make_engine(model, sz, mode)
        _, t_warm = timed(lambda: eng.generate(ps, 1, 1.0, 1.0, sz.new_tokens, seed=1), sz.device)  # compiles
        groups, t = timed(lambda: eng.generate(ps, 1, 1.0, 1.0, sz.new_tokens, seed=2), sz.device)
        rows[f"{mode}_tok_s"] = tokens_of(groups) / t
        rows[f"{mode}_first_call_s"] = t_warm
        rows[f"{mode}_path"] = eng.decode_mode()
        shared[f"groups_{mode}"], shared[f"gen_s_{mode}"] = groups, t
    rows["compiled_over_generate"] = rows["compiled_tok_s"] / plain
    rows["dynamic_over_generate"] = rows["dynamic_tok_s"] / plain
    out["decode"] = rows
    print(f"decode ({sz.batch} x {sz.new_tokens}): generate {plain:,.0f} tok/s, engine dynamic "
          f"{rows['dynamic_tok_s']:,.0f}, engine {rows['compiled_path']} {rows['compiled_tok_s']:,.0f} "
          f"(first call {rows['compiled_first_call_s']:.1f} s) -> {rows['compiled_over_generate']:.2f}x generate")


def section_proofs(sz: Sizes, out: dict, shared: dict) -> None:
    from node.proofs.toploc import build_proofs_many

    model = shared.setdefault("model", make_model(sz))
    eng = make_engine(model, sz, "compiled")
    ps = prompts(sz)
    eng.generate(ps, 1, 1.0, 1.0, sz.new_tokens, seed=1, capture_hidden=False)  # warm both variants
    eng.generate(ps, 1, 1.0, 1.0, sz.new_tokens, seed=1)
    g_off, t_off = timed(lambda: eng.generate(ps, 1, 1.0, 1.0, sz.new_tokens, seed=3, capture_hidden=False), sz.device)
    g_on, t_on = timed(lambda: eng.generate(ps, 1, 1.0, 1.0, sz.new_tokens, seed=3), sz.device)
    flat = [s for g in g_on for s in g]
    _, t_build = timed(lambda: build_proofs_many([s.hidden for s in flat], 32, 128), "cpu")
    out["proofs"] = {"capture_overhead": t_on / t_off - 1.0, "build_over_generation": t_build / t_on}
    print(f"proofs: capture costs {100 * (t_on / t_off - 1):.1f} % of decode time, TOPLOC building "
          f"{100 * t_build / t_on:.1f} % of generation")


def section_validate(sz: Sizes, out: dict, shared: dict) -> None:
    from node.validator.pipeline import CheckModel

    model = shared.setdefault("model", make_model(sz))
    if "groups_compiled" not in shared:
        section_decode(sz, out, shared)
    groups, t_gen = shared["groups_compiled"], shared["gen_s_compiled"]
    flat = [s for g in groups for s in g]
    check = CheckModel(model, ShimTokenizer(sz.vocab - 1, 0), 0)
    args = ([s.prompt_ids for s in flat], [s.completion_ids for s in flat])
    check.recompute(*args)  # warm-up
    _, t_pre = timed(lambda: check.recompute(*args), sz.device)
    n_tok = sum(len(p) + len(c) for p, c in zip(*args))
    out["validate"] = {"prefill_tok_s": n_tok / t_pre, "generation_s": t_gen, "prefill_s": t_pre,
                       "validation_over_generation": t_gen / t_pre, "vllm_proof_prefill_fraction": t_pre / t_gen}
    print(f"validate: prefill {n_tok / t_pre:,.0f} tok/s; validation {t_gen / t_pre:.1f}x faster than generation "
          f"(the vLLM engine's proof prefill: {100 * t_pre / t_gen:.1f} % of its generation time if vLLM decodes "
          "as fast as the compiled engine)")


def section_train(sz: Sizes, out: dict, peak_tflops: float) -> None:
    import importlib.util

    from node.rl.config import GRPOConfig
    from node.rl.grpo import TrainSample, make_optimizer, train_step
    from node.rl.mismatch import step_mismatch
    from node.trainer.config import TrainerConfig

    flash = sz.device.startswith("cuda") and importlib.util.find_spec("flash_attn") is not None
    model = make_model(sz, torch.float32, seed=1)  # fp32 master weights, bf16 compute under autocast
    if flash:
        model.config._attn_implementation = "flash_attention_2"
    n_params = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(0)
    per_row, sample_len = 4, sz.train_len // 4
    samples = []
    for i in range(sz.train_rows * per_row):
        ids = torch.randint(1, sz.vocab - 1, (sample_len,), generator=g).tolist()
        cut = sample_len // 4
        samples.append(TrainSample(ids[:cut], ids[cut:], [-2.0] * (sample_len - cut), 1.0 if i % 2 else -1.0))
    cfg = GRPOConfig(optimizer_steps=1, pack_length=sz.train_len, lr=1e-6, warmup_steps=0, kl_coef=0.0)
    opt, sched = make_optimizer(model, cfg)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if sz.device.startswith("cuda") else _null()

    def grpo_step():
        with amp:
            return train_step(model, opt, sched, samples, cfg)

    grpo_step()  # warm-up (kernels, allocator)
    stats, t = timed(grpo_step, sz.device)
    tokens = sz.train_rows * sz.train_len  # every row is full: 4 samples of train_len / 4
    ours = tokens / t

    def rescore():  # what the trainer adds to each step for the mismatch figures, at its default size
        with amp:
            return step_mismatch(model, samples, 0, TrainerConfig().mismatch_samples, cfg, lambda dtype: 1.0)

    rescore()
    _, t_rescore = timed(rescore, sz.device)

    plain_model = make_model(sz, torch.float32, seed=1)
    plain_opt = torch.optim.AdamW(plain_model.parameters(), lr=1e-6)
    ids = torch.randint(1, sz.vocab - 1, (sz.train_rows, sz.train_len), generator=g, device=sz.device)

    def plain_step():
        with amp:
            loss = plain_model(input_ids=ids, labels=ids, use_cache=False).loss
        plain_opt.zero_grad(set_to_none=True)
        loss.backward()
        plain_opt.step()

    plain_step()
    _, t_plain = timed(plain_step, sz.device)
    plain = tokens / t_plain
    peak = peak_tflops * 1e12
    out["train"] = {"params": n_params, "tokens": tokens, "grpo_tok_s": ours, "plain_tok_s": plain,
                    "grpo_mfu": 6 * n_params * ours / peak, "plain_mfu": 6 * n_params * plain / peak,
                    "attention": "flash_attention_2 varlen" if flash else "sdpa + block mask",
                    "fused_adamw": bool(opt.param_groups[0].get("fused")), "grpo_over_plain": ours / plain,
                    "mismatch_rescore_s": t_rescore, "mismatch_rescore_over_step": t_rescore / t}
    print(f"train ({sz.train_rows} x {sz.train_len}, {n_params / 1e6:.0f}M params, {out['train']['attention']}): "
          f"GRPO step {ours:,.0f} tok/s MFU {100 * out['train']['grpo_mfu']:.1f} %, plain HF step {plain:,.0f} tok/s "
          f"MFU {100 * out['train']['plain_mfu']:.1f} % -> {ours / plain:.2f}x; mismatch rescore "
          f"{t_rescore * 1e3:.0f} ms = {t_rescore / t:.2f} of the step")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU: check the script runs (seconds)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=512, help="new tokens per sequence")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--train-rows", type=int, default=8)
    ap.add_argument("--train-len", type=int, default=2048)
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak of the GPU (H200: 989)")
    ap.add_argument("--out", default="bench/out/gpu.json")
    # Quick: small sizes on a GPU; without one, the CPU smoke run (every section, tiny shapes).
    quick = ({"batch": 8, "tokens": 64, "train_rows": 2, "train_len": 512} if torch.cuda.is_available()
             else {"smoke": True})
    quick["out"] = "bench/out/gpu-quick.json"  # not over a real run's results
    args = parse_args(ap, quick, argv)
    wanted = [s for s in args.sections.split(",") if s]
    unknown = set(wanted) - set(SECTIONS)
    if unknown:
        ap.error(f"unknown sections {sorted(unknown)}")
    sz = sizes(args)
    if sz.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("no CUDA device: run with --smoke on a CPU machine")
    torch.manual_seed(0)
    out: dict = {"device": torch.cuda.get_device_name() if sz.device.startswith("cuda") else "cpu",
                 "smoke": args.smoke, "torch": torch.__version__}
    shared: dict = {}
    t0 = time.perf_counter()
    for name in wanted:
        t = time.perf_counter()
        if name == "correctness":
            section_correctness(sz, out)
        elif name == "decode":
            section_decode(sz, out, shared)
        elif name == "proofs":
            section_proofs(sz, out, shared)
        elif name == "validate":
            section_validate(sz, out, shared)
        elif name == "train":
            shared.pop("model", None)  # free the inference copy before training
            if sz.device.startswith("cuda"):
                torch.cuda.empty_cache()
            section_train(sz, out, args.peak_tflops)
        out.setdefault("section_s", {})[name] = round(time.perf_counter() - t, 2)
    out["total_s"] = round(time.perf_counter() - t0, 2)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2, default=str))
    print(f"total {out['total_s']:.1f} s; results in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
